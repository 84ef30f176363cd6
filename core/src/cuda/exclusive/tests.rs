use super::super::procfs;
use super::*;

/// Two lock directories of a test's own, under a fresh parent.
struct Dirs {
    parent: PathBuf,
    main: PathBuf,
    fallback: PathBuf,
}

impl Dirs {
    fn new(name: &str) -> Dirs {
        let parent =
            std::env::temp_dir().join(format!("cuda-claims-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        std::fs::create_dir_all(&parent).unwrap();
        Dirs {
            main: parent.join("run"),
            fallback: parent.join("shm"),
            parent,
        }
    }

    fn both(&self) -> [&Path; 2] {
        [&self.main, &self.fallback]
    }

    fn claim(&self, pid: i32, start: u64, role: Role) -> Result<Claim, ClaimError> {
        claim_in(&self.both(), pid, start, Holder::this(role))
    }

    /// What a second claim gets: `None` when it got the claim (then ended), else who holds it
    /// (`Err` when no claim could be made). Taken in this process: the locks of two open files
    /// conflict as those of two processes do (a forked helper could hang on a lock another test
    /// thread held when it was forked).
    fn elsewhere(&self, pid: i32, start: u64) -> Result<Option<Vec<Holder>>, String> {
        match self.claim(pid, start, Role::CriuGpu) {
            Ok(_) => Ok(None),
            Err(ClaimError::Busy(h)) => Ok(Some(h.holders.iter().map(|x| x.0).collect())),
            Err(ClaimError::Unavailable(p)) => Err(ClaimError::problems(&p)),
        }
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.parent);
    }
}

fn me(role: Role) -> Holder {
    Holder::this(role).unwrap()
}

#[test]
fn a_second_claim_is_refused_until_the_first_ends_and_names_its_holders() {
    let d = Dirs::new("second");
    let mut a = d.claim(42, 7, Role::Criu).unwrap();
    assert!(a.fallback_from().is_none());
    assert_eq!(d.elsewhere(42, 7).unwrap(), Some(vec![me(Role::Criu)]));
    // The guardian it is handed to is added to the record.
    let g = Holder {
        role: Role::Guardian,
        pid: 1,
        start: procfs::start_time(1).unwrap(),
    };
    a.record_holder(g).unwrap();
    assert_eq!(d.elsewhere(42, 7).unwrap(), Some(vec![me(Role::Criu), g]));
    // Another process (or the same pid reused) is another claim.
    assert_eq!(d.elsewhere(42, 8).unwrap(), None);
    drop(a);
    assert!(
        !lock_path(&d.main, 42, 7).exists(),
        "an ended claim leaves no file"
    );
    assert_eq!(d.elsewhere(42, 7).unwrap(), None);
}

#[test]
fn an_unusable_lock_directory_falls_back_and_both_users_still_see_each_other() {
    let d = Dirs::new("fallback");
    // Something else in the lock directory's place.
    std::fs::write(&d.main, "not a directory").unwrap();
    let a = d.claim(42, 7, Role::Criu).unwrap();
    let why = a
        .fallback_from()
        .expect("taken in the fallback")
        .to_string();
    assert!(
        why.contains(&d.main.display().to_string()) && why.contains("ENOTDIR"),
        "{why}"
    );
    assert!(a.path().starts_with(&d.fallback));
    assert_eq!(d.elsewhere(42, 7).unwrap(), Some(vec![me(Role::Criu)]));
    // The lock directory usable again (for another user, say): a claim taken there still
    // sees the one in the fallback.
    std::fs::remove_file(&d.main).unwrap();
    assert_eq!(d.elsewhere(42, 7).unwrap(), Some(vec![me(Role::Criu)]));
    drop(a);
    assert_eq!(d.elsewhere(42, 7).unwrap(), None);
    // And the other way round: held in the lock directory, seen by one that can only use the
    // fallback (the lock directory read-only for it, as a bind mount would make it).
    let b = d.claim(42, 7, Role::Criu).unwrap();
    assert!(b.path().starts_with(&d.main));
    let held = held_in(&d.main, 42, 7).expect("a lock seen without writing");
    assert_eq!(held.holders.len(), 1);
    assert!(held_in(&d.fallback, 42, 7).is_none());
}

#[test]
fn no_usable_directory_is_no_claim() {
    let d = Dirs::new("none");
    std::fs::write(&d.main, "x").unwrap();
    // A directory someone else may write to (as a user could plant in /dev/shm).
    std::fs::create_dir(&d.fallback).unwrap();
    std::fs::set_permissions(
        &d.fallback,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let Err(ClaimError::Unavailable(p)) = d.claim(42, 7, Role::Criu) else {
        panic!("a claim without a usable directory");
    };
    let text = ClaimError::problems(&p);
    assert!(
        text.contains("ENOTDIR") && text.contains("only it may write"),
        "{text}"
    );
    // A link in the fallback's place is not followed.
    std::fs::remove_dir(&d.fallback).unwrap();
    std::os::unix::fs::symlink(&d.parent, &d.fallback).unwrap();
    assert!(matches!(
        d.claim(42, 7, Role::Criu),
        Err(ClaimError::Unavailable(_))
    ));
}
