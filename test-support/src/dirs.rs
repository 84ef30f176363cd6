//! Directories of a test process: each named after its owner (so that other test processes
//! sweep only the directories of owners that are gone), removed when done.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::target_tmp;

/// Prefix of every directory these tests make (with the test process's pid after it).
const DIR_PREFIX: &str = "criu-gpu-e2e-";
/// Set, to the pid of the test process outside, in the environment of a test run again as pid
/// 1 of a pid namespace of its own (`tests/containers_support/pidns.rs`).
pub const OUTER_PID_VAR: &str = "CRIU_GPU_TEST_OUTER_PID";

/// What names this test process's directories and cgroups: its pid, or, in a run as pid 1 of a
/// pid namespace of its own, `<pid of the test process outside>-pidns` (that process waits for
/// this one), so that names stay unique on the machine and other test processes, which sweep
/// directories of dead pids, see a live owner.
pub fn owner_tag() -> String {
    let own = std::process::id();
    match std::env::var(OUTER_PID_VAR) {
        Ok(outer) if own == 1 && outer.parse::<u32>().is_ok() => format!("{outer}-pidns"),
        _ => own.to_string(),
    }
}

/// A directory removed (with everything in it) on drop.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new, empty directory under `base`, named after this process and `stem`.
    pub fn new_in(base: &Path, stem: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        sweep_stale(base);
        let path = base.join(format!(
            "{DIR_PREFIX}{}-{stem}-{}",
            owner_tag(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        TempDir { path }
    }

    /// A new directory under cargo's scratch directory (`target/tmp`, absolute).
    pub fn new(stem: &str) -> TempDir {
        TempDir::new_in(target_tmp(), stem)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.path.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // `CRIU_GPU_TEST_KEEP=1` keeps a failed test's directory for a post-mortem.
        if std::thread::panicking()
            && std::env::var_os("CRIU_GPU_TEST_KEEP").is_some_and(|v| v == "1")
        {
            eprintln!("kept {}", self.path.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Removes directories that earlier test processes, now gone, left under `base` (a run killed
/// before its guards ran). Not in a pid namespace of the test's own: the owners of the others'
/// directories are not visible there.
fn sweep_stale(base: &Path) {
    if std::process::id() == 1 {
        return;
    }
    static SWEPT: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);
    let mut swept = SWEPT.lock().unwrap_or_else(|e| e.into_inner());
    if !swept
        .get_or_insert_with(HashSet::new)
        .insert(base.to_path_buf())
    {
        return;
    }
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Some(rest) = name.strip_prefix(DIR_PREFIX) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        if !pid.is_empty()
            && pid != std::process::id().to_string()
            && !Path::new("/proc").join(pid).exists()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// This process's build directory: compiled fixtures and the plugin's `--libdir`. Removed when
/// the test process exits.
pub fn build_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = target_tmp();
        sweep_stale(base);
        let dir = base.join(format!("{DIR_PREFIX}{}-build", owner_tag()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("build directory");
        extern "C" fn remove_build_dir() {
            if let Some(d) = DIR.get() {
                let _ = std::fs::remove_dir_all(d);
            }
        }
        // SAFETY: atexit only records the function pointer; the handler runs at exit(3) on the
        // exiting thread and touches nothing but the already-initialised `DIR` and the file
        // system.
        unsafe { libc::atexit(remove_build_dir) };
        dir
    })
}
