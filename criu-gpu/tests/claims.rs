//! The per-process claims with real CRIU (the plugin, the stand-in CUDA driver). A
//! `--leave-running` dump is held in its post-dump action script, every process checkpointed:
//! - its guardian killed, then CRIU killed: the claims die with them, and `criu-gpu resume`
//!   brings every process back (also when CRIU is stopped and killed with both processes only
//!   locked);
//! - its guardian stopped, then CRIU killed: `criu-gpu resume` and a new dump are refused,
//!   naming the stopped guardian and what to do; once it is continued, the guardian puts
//!   every process back by itself;
//! - run in a mount namespace where `/run/criu-gpu-plugin` is a read-only `tmpfs`: the dump
//!   warns, claims in `/dev/shm/criu-gpu-plugin`, and a `criu-gpu resume` racing it from the
//!   host is refused; with `/dev/shm/criu-gpu-plugin` read-only too, the dump refuses its CUDA
//!   processes and leaves them running.
//!
//! The guardian is found by its line in CRIU's log ("cuda: guardian PID started"), not by its
//! ancestry. Needs root, `cc`, `unshare` and `nsenter`.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use support::{T, Workload, wait_until};

/// A `--leave-running` dump of `w` waiting in its post-dump action script until told to go.
struct HeldDump {
    criu: Child,
    images: PathBuf,
    /// The action script's own pid (it loops until `go` exists).
    script: i32,
}

/// Writes the action script into `dir`: it notes each action with its pid, and holds the
/// post-dump one until `dir/go` exists.
fn action_script(dir: &Path) -> PathBuf {
    let script = dir.join("hold.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$CRTOOLS_SCRIPT_ACTION $$\" >> {d}/actions\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\nwhile [ ! -e {d}/go ]; do sleep 0.02; done\n",
            d = dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    script
}

/// CRIU's command line for a dump of `root` into `images`, behind `launcher`.
fn criu_dump(t: &T, launcher: &[&str], root: i32, images: &Path, extra: &[&str]) -> Command {
    let criu = criu_gpu_test_support::criu_binary();
    let mut cmd = match launcher.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(&criu);
            c
        }
        None => Command::new(&criu),
    };
    std::fs::create_dir_all(images).unwrap();
    cmd.args(["dump", "--leave-running", "-t", &root.to_string(), "-L"])
        .arg(criu_gpu_test_support::plugin_libdir())
        .arg("-D")
        .arg(images)
        .args(["-o", "dump.log", "-v4"])
        .args(extra);
    for (k, v) in t.env() {
        cmd.env(k, v);
    }
    cmd
}

impl HeldDump {
    fn start(t: &T, w: &Workload, launcher: &[&str], name: &str) -> HeldDump {
        let dir = t.dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let script = action_script(&dir);
        let images = dir.join("img");
        let criu = criu_dump(
            t,
            launcher,
            w.root(),
            &images,
            &["--action-script", &script.display().to_string()],
        )
        .spawn()
        .expect("run criu (set CRIU_BIN)");
        let mut held = HeldDump {
            criu,
            images,
            script: 0,
        };
        let actions = dir.join("actions");
        // A dump on a loaded 2-core machine has taken over 20 s to get there: a minute, and
        // CRIU's log if even that passes.
        let t0 = Instant::now();
        while !std::fs::read_to_string(&actions).is_ok_and(|a| a.contains("post-dump ")) {
            if let Ok(Some(st)) = held.criu.try_wait() {
                panic!("criu ended ({st}) before its post-dump:\n{}", held.log());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "CRIU did not reach its post-dump script in 60 s; its log so far:\n{}",
                held.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        held.script = std::fs::read_to_string(&actions)
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("post-dump ")?.parse().ok())
            .expect("the script's pid");
        held
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.images.join("dump.log")).unwrap_or_default()
    }

    /// The dump's guardian, from CRIU's log.
    fn guardian(&self) -> i32 {
        self.log()
            .lines()
            .find_map(|l| {
                l.split("cuda: guardian ")
                    .nth(1)?
                    .strip_suffix(" started")?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no guardian in CRIU's log:\n{}", self.log()))
    }

    fn pid(&self) -> i32 {
        self.criu.id() as i32
    }

    /// Lets the dump finish; its exit status.
    fn go(mut self) -> ExitStatus {
        let dir = self.images.parent().unwrap().to_path_buf();
        std::fs::write(dir.join("go"), "").unwrap();
        self.criu.wait().unwrap()
    }

    /// SIGKILLs CRIU and its held script.
    fn kill(mut self) {
        signal(self.pid(), libc::SIGKILL);
        self.criu.wait().unwrap();
        signal(self.script, libc::SIGKILL);
    }
}

fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) of a process this test started (CRIU, its script, its guardian).
    unsafe { libc::kill(pid, sig) };
}

/// The one-letter state of `pid` (`None`: gone).
fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

fn assert_checkpointed(t: &T, w: &Workload, what: &str) {
    for &p in &w.pids {
        assert_eq!(
            t.device_files(p),
            0,
            "{what}: pid {p} still holds GPU memory"
        );
    }
}

/// Waits until every process of `w` runs untraced again (CRIU gone).
fn wait_untraced(w: &Workload) {
    for &p in &w.pids {
        wait_until(format!("pid {p} untraced"), || {
            std::fs::read_to_string(format!("/proc/{p}/status"))
                .is_ok_and(|s| s.contains("TracerPid:\t0\n"))
        });
    }
}

#[test]
fn criu_gpu_resume_recovers_what_a_dead_guardian_left() {
    let t = T::start("dead-guardian");
    let w = t.workload("w", 1, 8);
    let dump = HeldDump::start(&t, &w, &[], "d");
    assert_checkpointed(&t, &w, "at post-dump");
    let g = dump.guardian();
    signal(g, libc::SIGKILL);
    wait_until("the guardian's end", || {
        matches!(state(g), None | Some('Z' | 'X'))
    });
    dump.kill();
    wait_untraced(&w);
    // Nobody is left to put them back: they stay checkpointed...
    std::thread::sleep(Duration::from_millis(300));
    assert_checkpointed(&t, &w, "after CRIU and its guardian died");
    let st = t.tool(&["status", &w.root().to_string()], &[]);
    assert_eq!(st.stdout.matches(" checkpointed ").count(), 2, "{st:?}");
    // ... and the claims died with their holders: resume brings every process back.
    let r = t.tool(&["resume", &w.root().to_string()], &[]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("total: 2 process(es) resumed"), "{r:?}");
    w.assert_running();
}

/// The same with CRIU stopped as soon as both processes are locked, before their checkpoint:
/// `criu-gpu resume` unlocks what the dead guardian left locked. (A try in which the
/// checkpoint came first, on a busy machine, is resumed and tried again, three times at most.)
#[test]
fn criu_gpu_resume_unlocks_what_a_dead_guardian_left_locked() {
    let t = T::start("dead-guardian-locked");
    for round in 0..3 {
        let w = t.workload(&format!("w{round}"), 1, 8);
        let root = w.root().to_string();
        let images = t.dir.join(format!("img{round}"));
        t.clear_calls();
        let mut criu = criu_dump(&t, &[], w.root(), &images, &[])
            .spawn()
            .expect("criu");
        let calls = t.dir.join("calls");
        let count = |op: &str| {
            std::fs::read_to_string(&calls)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with(op))
                .count()
        };
        let t0 = Instant::now();
        while count("lock ") < 2 {
            assert!(t0.elapsed() < Duration::from_secs(20), "no locks");
            std::thread::sleep(Duration::from_micros(200));
        }
        signal(criu.id() as i32, libc::SIGSTOP);
        let early = count("checkpoint ") == 0;
        let log = std::fs::read_to_string(images.join("dump.log")).unwrap_or_default();
        let g: i32 = log
            .lines()
            .find_map(|l| {
                l.split("cuda: guardian ")
                    .nth(1)?
                    .strip_suffix(" started")?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no guardian in CRIU's log:\n{log}"));
        signal(g, libc::SIGKILL);
        signal(criu.id() as i32, libc::SIGKILL);
        criu.wait().unwrap();
        wait_untraced(&w);
        let st = t.tool(&["status", &root], &[]);
        if early {
            assert_eq!(st.stdout.matches(" locked ").count(), 2, "{st:?}");
        }
        let r = t.tool(&["resume", &root], &[]);
        assert_eq!(r.code, Some(0), "{r:?}");
        w.assert_running();
        if early {
            return;
        }
        eprintln!("try {round}: CRIU was stopped after a checkpoint; again");
    }
    panic!("CRIU was never stopped between the locks and the checkpoint");
}

#[test]
fn a_stopped_guardian_is_named_and_finishes_once_continued() {
    let t = T::start("stopped-guardian");
    let w = t.workload("w", 1, 8);
    let root = w.root().to_string();
    let dump = HeldDump::start(&t, &w, &[], "d");
    assert_checkpointed(&t, &w, "at post-dump");
    let (g, criu) = (dump.guardian(), dump.pid());
    signal(g, libc::SIGSTOP);
    wait_until("the guardian stopped", || state(g) == Some('T'));
    dump.kill();
    wait_untraced(&w);

    let r = t.tool(&["resume", &root], &[]);
    assert_eq!(r.code, Some(4), "{r:?}");
    for want in [
        format!("guardian {g} (of CRIU {criu}, which has ended), which is stopped"),
        "stopped".to_string(),
        format!("`kill -CONT {g}`"),
        format!("`kill -KILL {g}`"),
    ] {
        assert!(r.stderr.contains(&want), "{want}: {r:?}");
    }
    assert_checkpointed(&t, &w, "after a refused resume");

    // A new dump is refused the same way, naming the guardian in CRIU's log.
    let images = t.dir.join("second");
    let out = criu_dump(&t, &[], w.root(), &images, &[])
        .output()
        .expect("criu");
    let log = std::fs::read_to_string(images.join("dump.log")).unwrap_or_default();
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains(&format!(
            "guardian {g} (of CRIU {criu}, which has ended), which is stopped"
        )) && log.contains(&format!("`kill -CONT {g}`")),
        "{log}"
    );

    // Continued, the guardian does what it was left to do: every process runs again by itself.
    let t0 = Instant::now();
    signal(g, libc::SIGCONT);
    for &p in &w.pids {
        wait_until(format!("pid {p} given its GPU memory back"), || {
            t.device_files(p) > 0
        });
    }
    eprintln!("back {:?} after the guardian was continued", t0.elapsed());
    w.assert_running();
    wait_until("the guardian's end", || {
        matches!(state(g), None | Some('Z' | 'X'))
    });
    let r = t.tool(&["resume", &root], &[]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_eq!(r.stdout.matches("already running").count(), 2, "{r:?}");
}

/// A private mount namespace held by a sleeping process, with a read-only `tmpfs` over each of
/// `ro` (made on the host first, mode 0700, as the plugin makes them); `nsenter` into it.
struct Namespace {
    holder: i32,
}

impl Namespace {
    fn new(t: &T, ro: &[&str]) -> Namespace {
        for d in ro {
            use std::os::unix::fs::DirBuilderExt;
            let _ = std::fs::DirBuilder::new().mode(0o700).create(d);
        }
        let ready = t.dir.join(format!("ns-ready-{}", ro.len()));
        let mounts: String = ro
            .iter()
            .map(|d| format!("mount -t tmpfs -o ro,mode=0700 criu-gpu-test {d} && "))
            .collect();
        let holder = t.spawn(
            Path::new("unshare"),
            &[
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                &format!("{mounts}touch {} && exec sleep 600", ready.display()),
            ],
        );
        wait_until("the private mount namespace", || ready.exists());
        Namespace { holder }
    }

    /// A launcher into the namespace. The program gets its standard files opened there: CRIU
    /// refuses a file of a mount it cannot find in the task's namespace (the copies of the
    /// host's mounts have other ids).
    fn enter(&self) -> Vec<String> {
        let holder = self.holder.to_string();
        let run = r#"exec </dev/null >/dev/null 2>&1; exec "$@""#;
        [
            "nsenter", "-F", "-t", &holder, "-m", "--", "sh", "-c", run, "sh",
        ]
        .map(String::from)
        .to_vec()
    }
}

const LOCK_DIR: &str = "/run/criu-gpu-plugin";
const FALLBACK_DIR: &str = "/dev/shm/criu-gpu-plugin";

#[test]
fn a_read_only_lock_directory_is_warned_about_and_never_raced() {
    let t = T::start("ro-lock-dir");
    let ns = Namespace::new(&t, &[LOCK_DIR]);
    let enter = ns.enter();
    let enter: Vec<&str> = enter.iter().map(String::as_str).collect();
    let w = t.workload_via(&enter, "w", 1, 8);
    let root = w.root().to_string();
    let dump = HeldDump::start(&t, &w, &enter, "d");
    assert_checkpointed(&t, &w, "at post-dump");
    let log = dump.log();
    let warn = log
        .lines()
        .find(|l| l.contains("claims cannot be taken in /run/criu-gpu-plugin"))
        .unwrap_or_else(|| panic!("no warning:\n{log}"));
    assert!(
        warn.contains("Warn") && warn.contains("EROFS") && warn.contains(FALLBACK_DIR),
        "{warn}"
    );
    assert_eq!(
        log.matches("claims cannot be taken").count(),
        1,
        "warned once per run:\n{log}"
    );
    // The host's criu-gpu claims in /run and still sees the dump's claim in /dev/shm.
    let r = t.tool(&["resume", &root], &[]);
    assert_eq!(r.code, Some(4), "{r:?}");
    assert!(
        r.stderr
            .contains(&format!("held by CRIU {} right now", dump.pid())),
        "{r:?}"
    );
    assert_checkpointed(&t, &w, "after a refused resume");
    let st = dump.go();
    assert!(st.success(), "criu: {st}");
    w.assert_running();
}

#[test]
fn no_usable_lock_directory_refuses_cuda_processes_and_leaves_them_running() {
    let t = T::start("no-lock-dir");
    let ns = Namespace::new(&t, &[LOCK_DIR, FALLBACK_DIR]);
    let enter = ns.enter();
    let enter: Vec<&str> = enter.iter().map(String::as_str).collect();
    let w = t.workload_via(&enter, "w", 1, 8);
    let images = t.dir.join("img");
    let out = criu_dump(&t, &enter, w.root(), &images, &[])
        .output()
        .expect("criu");
    let log = std::fs::read_to_string(images.join("dump.log")).unwrap_or_default();
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains(&format!("pid {} uses CUDA but cannot be claimed", w.root()))
            && log.contains("no claim can be taken")
            && log.contains("EROFS"),
        "{log}"
    );
    assert!(
        !std::fs::read_to_string(t.dir.join("calls"))
            .unwrap_or_default()
            .contains("lock "),
        "a process was locked unclaimed"
    );
    w.assert_running();
}
