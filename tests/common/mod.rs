//! Helpers shared by the end-to-end tests: real CRIU, the plugin built from this tree, small C
//! programs as the processes to checkpoint.
//!
//! - CRIU is `$CRIU_BIN`, else `<repo>/.criu/bin/criu` (made by `scripts/install-criu.sh`), else
//!   `criu` on `PATH`. Without one the tests FAIL, unless `GPU_PLUGIN_SKIP_E2E=1`.
//! - The plugin is the release cdylib, the one the package ships ([`release_plugin`]; build it
//!   with `cargo build --release -p criu-gpu-plugin --lib`), copied as `gpu_plugin.so` into a
//!   directory of its own: CRIU loads every `*.so` of its `--libdir`, which must be an
//!   absolute path.
//! - The test process is a child subreaper, and every workload is its direct child in a session
//!   of its own. After a dump kills a tree, its tasks (the root, and the rest re-parented here)
//!   are reaped until their pids are free, or `criu restore` could not recreate them ("Can't fork
//!   for PID: File exists"). A tree restored with `-d` is re-parented here too.
//! - Subreaping and reaping are process-wide, so every e2e test holds one lock ([`E2e::start`]).
//! - Everything a test starts is killed by id and every directory it made is removed when its
//!   [`E2e`] is dropped, also when an assertion fails.

#![allow(dead_code)]

pub mod fake_cuda;
mod fake_cuda_build;
pub mod release_plugin;
pub mod run_leftovers;

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

pub const MANIFEST_DIR: &str = env!("CARGO_MANIFEST_DIR");
const TARGET_TMPDIR: &str = env!("CARGO_TARGET_TMPDIR");

/// How long a test waits for something a running process should do.
pub const WAIT: Duration = Duration::from_secs(20);
/// A CRIU run that takes longer hangs.
const CRIU_TIMEOUT: Duration = Duration::from_secs(120);
/// Prefix of every directory these tests make (with the test process's pid after it).
const DIR_PREFIX: &str = "criu-gpu-e2e-";

/// Messages CRIU logs as errors that are the machine's, not ours, and after which CRIU goes
/// on: the test machine's container does not let it raise `RLIMIT_NOFILE` beyond the hard
/// limit, and on kernels before 6.7 (Debian 12's 6.1) the first CRIU run after a boot probes
/// whether binfmt_misc mounts in a user namespace and logs the refusal as an error.
const ENVIRONMENT_ERRORS: &[&str] = &[
    "rlimit: Can't setup RLIMIT_NOFILE",
    "Unable to create the binfmt_misc file system",
];

// ---- locating -----------------------------------------------------------------------------

/// The plugin under test: the release cdylib the package ships ([`release_plugin`]).
pub fn plugin_path() -> PathBuf {
    release_plugin::release_plugin_path(Path::new(MANIFEST_DIR))
}

fn skip_requested() -> bool {
    std::env::var_os("GPU_PLUGIN_SKIP_E2E").is_some_and(|v| v == "1")
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The CRIU binary, or a panic that says how to get one.
fn criu_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("CRIU_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "CRIU_BIN={} does not exist; unset it to use <repo>/.criu/bin/criu (made by \
             scripts/install-criu.sh)",
            p.display()
        );
        return p;
    }
    let private = Path::new(MANIFEST_DIR).join(".criu/bin/criu");
    if private.is_file() {
        return private;
    }
    find_in_path("criu").unwrap_or_else(|| {
        panic!(
            "CRIU not found (no $CRIU_BIN, no {}, no `criu` on PATH): run scripts/install-criu.sh \
             to install it, or set GPU_PLUGIN_SKIP_E2E=1 to skip the end-to-end tests",
            private.display()
        )
    })
}

/// `criu --version`'s "Version: X.Y[.Z]" as (X, Y).
fn criu_version(criu: &Path) -> Option<(u32, u32)> {
    let out = Command::new(criu).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))?
        .trim();
    let mut parts = v.split(['.', '-']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

// ---- directories --------------------------------------------------------------------------

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
        TempDir::new_in(Path::new(TARGET_TMPDIR), stem)
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
        let base = Path::new(TARGET_TMPDIR);
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

/// Runs `cc` once per process for output `name` (in the build directory).
pub fn cc(name: &str, args: &[String]) -> PathBuf {
    static BUILT: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let out = build_dir().join(name);
    let mut guard = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !guard
        .get_or_insert_with(HashSet::new)
        .insert(name.to_string())
    {
        return out;
    }
    let result = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror"])
        .args(args)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `cc` (a C compiler is needed): {e}"));
    assert!(
        result.status.success(),
        "cc {args:?} -o {} failed:\n{}",
        out.display(),
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

/// A fixture source file.
pub fn fixture(rel: &str) -> String {
    Path::new(MANIFEST_DIR)
        .join("tests/fixtures")
        .join(rel)
        .display()
        .to_string()
}

/// `tests/fixtures/e2e/tree.c`, built.
pub fn tree_binary() -> PathBuf {
    cc("tree", &[fixture("e2e/tree.c"), "-lpthread".into()])
}

/// The plugin's library directory: only `gpu_plugin.so`, the cdylib under test.
pub fn plugin_libdir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = build_dir().join("criu-lib");
        std::fs::create_dir_all(&dir).expect("plugin directory");
        std::fs::copy(plugin_path(), dir.join("gpu_plugin.so")).expect("copy the plugin");
        dir
    })
    .clone()
}

// ---- processes ----------------------------------------------------------------------------

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Sends `sig` to `pid`; false when there is no such process.
pub fn signal(pid: i32, sig: i32) -> bool {
    // SAFETY: kill(2) takes plain integers and touches no memory of this process.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// Whether a task with this pid exists (zombies included).
pub fn exists(pid: i32) -> bool {
    signal(pid, 0) || errno() != libc::ESRCH
}

/// Process group of `pid` from `/proc/<pid>/stat`.
pub fn pgid_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    // state ppid pgrp ...
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// Scheduler state letter of `pid` (`R`, `S`, `T`, `t`, `Z`, ...).
pub fn state_of(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Reaps every child that has exited (this process is a subreaper, so orphans of the trees under
/// test come here) until none of `pids` exists any more. False on timeout.
pub fn reap_until_gone(pids: &[i32], timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        loop {
            let mut status = 0;
            // SAFETY: waitpid writes one int through the valid pointer; WNOHANG never blocks.
            let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if r <= 0 {
                break;
            }
        }
        if pids.iter().all(|&p| !exists(p)) {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Polls `cond` until it holds; panics with `what` after [`WAIT`].
pub fn wait_until(what: impl std::fmt::Display, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Processes a test started: each tree is a session whose id is its root's pid.
#[derive(Default)]
struct Started {
    /// Session/group id -> every pid learnt of that tree.
    trees: BTreeMap<i32, HashSet<i32>>,
}

// ---- the test context ---------------------------------------------------------------------

/// One end-to-end test: holds the e2e lock, a work directory, CRIU, and whatever it started.
/// Dropping it kills every process it started (by id) and removes its directories.
pub struct E2e {
    started: Mutex<Started>,
    dirs: Vec<TempDir>,
    pub criu: PathBuf,
    criu_version: Option<(u32, u32)>,
    /// Released last.
    _lock: MutexGuard<'static, ()>,
}

/// Environment variables of the caller that could change what the plugin, CRIU or the fake
/// driver do; no child of a test inherits them.
fn inherited_settings() -> Vec<OsString> {
    std::env::vars_os()
        .map(|(k, _)| k)
        .filter(|k| {
            let k = k.to_string_lossy();
            k.starts_with("CRIU_GPU_") || k.starts_with("FAKE_CUDA_") || k == "CRIU_LIBS_DIR"
        })
        .collect()
}

impl E2e {
    /// Takes the e2e lock, makes this process a child subreaper and finds CRIU; `None` (after
    /// saying so) only when `GPU_PLUGIN_SKIP_E2E=1`. Panics when CRIU or root is missing.
    pub fn start(test: &str) -> Option<E2e> {
        if skip_requested() {
            eprintln!("SKIPPED {test}: GPU_PLUGIN_SKIP_E2E=1");
            return None;
        }
        static LOCK: Mutex<()> = Mutex::new(());
        static SUBREAPER: Once = Once::new();
        let lock = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        SUBREAPER.call_once(|| {
            // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes plain integers and touches no memory.
            let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
            assert_eq!(
                rc,
                0,
                "PR_SET_CHILD_SUBREAPER: {}",
                std::io::Error::last_os_error()
            );
        });
        // Exited leftovers of an earlier test (one that failed half-way) must not hold pids.
        reap_until_gone(&[], Duration::ZERO);
        let criu = criu_binary();
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(
            euid, 0,
            "the end-to-end tests run CRIU and need root (set GPU_PLUGIN_SKIP_E2E=1 to skip them)"
        );
        let criu_version = criu_version(&criu);
        Some(E2e {
            started: Mutex::new(Started::default()),
            dirs: vec![TempDir::new(test)],
            criu,
            criu_version,
            _lock: lock,
        })
    }

    /// The test's work directory (absolute).
    pub fn dir(&self) -> &Path {
        self.dirs[0].path()
    }

    /// Another directory under `base`, removed with the test.
    pub fn extra_dir(&mut self, base: &Path, stem: &str) -> PathBuf {
        let d = TempDir::new_in(base, stem);
        let p = d.path().to_path_buf();
        self.dirs.push(d);
        p
    }

    /// A fresh image directory `name` under the work directory.
    pub fn images(&self, name: &str) -> PathBuf {
        let p = self.dir().join(name);
        std::fs::create_dir_all(&p).expect("image directory");
        p
    }

    /// CRIU's release as (major, minor), where `criu --version` said it.
    pub fn criu_release(&self) -> Option<(u32, u32)> {
        self.criu_version
    }

    /// The hook count CRIU prints for a plugin (`CR_PLUGIN_HOOK__MAX` of that release), where
    /// known.
    pub fn criu_hook_count(&self) -> Option<u32> {
        match self.criu_version? {
            (4, 0) | (4, 1) => Some(12),
            (4, 2) => Some(13),
            (4, 3) => Some(17),
            _ => None,
        }
    }

    /// A command with none of the caller's plugin, CRIU-plugin-path or fake-driver settings,
    /// and a plugin settings file that does not exist (so `/etc/criu/gpu-plugin.conf` of the
    /// machine does not count).
    pub fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        for k in inherited_settings() {
            cmd.env_remove(k);
        }
        cmd.env(
            "CRIU_GPU_PLUGIN_CONFIG",
            self.dir().join("no-such-gpu-plugin.conf"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        cmd
    }

    /// Starts `cmd` as a direct child in a session of its own (CRIU then needs no
    /// `--shell-job`) with stdio on /dev/null; returns its pid.
    pub fn spawn_session(&self, cmd: Command) -> i32 {
        self.spawn_in_session(cmd, false)
    }

    /// [`E2e::spawn_session`], and no descriptor of the test runner's beyond stdio reaches the
    /// program (a shell's deleted /dev/null, say: CRIU would dump it as a ghost file, whose
    /// remap a CRIU killed in the middle of a restore leaves behind).
    pub fn spawn_session_alone(&self, cmd: Command) -> i32 {
        self.spawn_in_session(cmd, true)
    }

    fn spawn_in_session(&self, mut cmd: Command, alone: bool) -> i32 {
        // SAFETY: the closure runs in the forked child before exec and only calls setsid(2)
        // and close_range(2), which are async-signal-safe and touch no memory of the parent.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if alone {
                    // Marked close-on-exec: std's own pipe that reports a failed exec stays.
                    libc::syscall(
                        libc::SYS_close_range,
                        3u32,
                        u32::MAX,
                        libc::CLOSE_RANGE_CLOEXEC,
                    );
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let pid = child.id() as i32;
        // Reaped by `reap_until_gone`, never by std (the Child is dropped without a wait).
        drop(child);
        self.adopt(pid, pid);
        pid
    }

    /// Records `pid` as a member of the tree whose session is `sid`: killed at the end.
    pub fn adopt(&self, sid: i32, pid: i32) {
        let mut s = self.started.lock().unwrap_or_else(|e| e.into_inner());
        s.trees.entry(sid).or_default().insert(pid);
    }

    /// SIGKILLs `pids` (members of trees this test started) and reaps them until their pids are
    /// free.
    pub fn kill_and_reap(&self, pids: &[i32]) {
        for &p in pids {
            signal(p, libc::SIGKILL);
        }
        assert!(
            reap_until_gone(pids, WAIT),
            "pids {pids:?} still exist after SIGKILL: {:?}",
            pids.iter().map(|&p| (p, state_of(p))).collect::<Vec<_>>()
        );
    }

    /// Waits until CRIU's kill of a dumped tree is complete and its pids are free.
    pub fn reap(&self, pids: &[i32]) {
        assert!(
            reap_until_gone(pids, WAIT),
            "pids {pids:?} still exist after the dump: {:?}",
            pids.iter().map(|&p| (p, state_of(p))).collect::<Vec<_>>()
        );
    }

    /// Runs CRIU with `args` on image directory `images`, logging to `images/<log>`, with the
    /// plugin's settings isolated (see [`E2e::command`]) plus `env`.
    pub fn criu(&self, args: &[&str], images: &Path, log: &str, env: &[(&str, String)]) -> CriuRun {
        let out = self.dir().join(format!("{log}.stdout"));
        let out_file = std::fs::File::create(&out).expect("criu output file");
        let err_file = out_file.try_clone().expect("criu output file");
        let mut cmd = self.command(&self.criu);
        cmd.args(args)
            .arg("-D")
            .arg(images)
            .args(["-o", log])
            .stdout(out_file)
            .stderr(err_file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let what = format!(
            "criu {} -D {} -o {log} (env {env:?})",
            args.join(" "),
            images.display()
        );
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.criu.display()));
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait for criu") {
                break st;
            }
            if started.elapsed() > CRIU_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what}: still running after {CRIU_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let run = CriuRun {
            what,
            code: status.code(),
            log: std::fs::read_to_string(images.join(log)).unwrap_or_default(),
            output: std::fs::read_to_string(&out).unwrap_or_default(),
            took: started.elapsed(),
        };
        eprintln!("{}: exit {:?} in {:?}", run.what, run.code, run.took);
        run
    }
}

impl Drop for E2e {
    fn drop(&mut self) {
        let started = self.started.get_mut().unwrap_or_else(|e| e.into_inner());
        let trees = std::mem::take(&mut started.trees);
        let mut all = Vec::new();
        for (sid, pids) in trees {
            // The whole session's group (every tree here runs in its own, pgid = sid), then each
            // pid learnt, in case one left the group; only tasks still in that group are hit.
            if pids.iter().any(|&p| pgid_of(p) == Some(sid)) || pgid_of(sid) == Some(sid) {
                signal(-sid, libc::SIGKILL);
            }
            for p in pids {
                if pgid_of(p) == Some(sid) {
                    signal(p, libc::SIGKILL);
                }
                all.push(p);
            }
        }
        if !reap_until_gone(&all, WAIT) {
            eprintln!("warning: pids {all:?} did not all go away");
        }
        // Directories go with `self.dirs`, the lock last.
    }
}

// ---- CRIU runs and their logs -------------------------------------------------------------

/// One finished CRIU run.
pub struct CriuRun {
    pub what: String,
    pub code: Option<i32>,
    pub log: String,
    pub output: String,
    pub took: Duration,
}

impl CriuRun {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// Error lines of the log, without the ones this machine adds to every run.
    pub fn errors(&self) -> Vec<&str> {
        self.log
            .lines()
            .filter(|l| l.contains(") Error (") || l.starts_with("Error ("))
            .filter(|l| !ENVIRONMENT_ERRORS.iter().any(|e| l.contains(e)))
            .collect()
    }

    pub fn first_error(&self) -> Option<&str> {
        self.errors().into_iter().next()
    }

    pub fn has(&self, needle: &str) -> bool {
        self.log.contains(needle)
    }

    /// Log lines containing `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<&str> {
        self.log.lines().filter(|l| l.contains(needle)).collect()
    }

    /// Panics with the log's story unless CRIU succeeded.
    pub fn assert_ok(&self) {
        assert!(self.ok(), "{self:?}");
    }

    pub fn assert_failed(&self) {
        assert!(
            self.code.is_some_and(|c| c != 0),
            "expected CRIU to fail: {self:?}"
        );
    }

    /// No error line mentions the plugin.
    pub fn assert_no_plugin_errors(&self) {
        let ours: Vec<&str> = self
            .errors()
            .into_iter()
            .filter(|l| l.contains("gpu_plugin"))
            .collect();
        assert!(ours.is_empty(), "plugin errors {ours:#?}: {self:?}");
    }
}

impl std::fmt::Debug for CriuRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: exit {:?} after {:?}",
            self.what, self.code, self.took
        )?;
        writeln!(f, "  output: {:?}", self.output)?;
        writeln!(f, "  error lines:")?;
        for l in self.errors() {
            writeln!(f, "    {l}")?;
        }
        writeln!(f, "  plugin lines:")?;
        for l in self
            .log
            .lines()
            .filter(|l| l.contains("gpu_plugin:"))
            .take(60)
        {
            writeln!(f, "    {l}")?;
        }
        writeln!(f, "  log tail:")?;
        let lines: Vec<&str> = self.log.lines().collect();
        for l in &lines[lines.len().saturating_sub(25)..] {
            writeln!(f, "    {l}")?;
        }
        Ok(())
    }
}

/// Whether `hay` contains `needle` (raw bytes of an image file).
pub fn bytes_contain(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

// ---- the tree program (tests/fixtures/e2e/tree.c) ------------------------------------------

/// The four counters of a tree, in the order of [`TREE_SOURCES`].
pub type Counters = [u64; 4];
pub const TREE_SOURCES: [&str; 4] = ["parent", "pthread", "child", "cthread"];

/// A running `tree` process tree.
pub struct Tree {
    pub out: PathBuf,
    pub root: i32,
    pub child: i32,
}

impl Tree {
    /// Starts `tree OUT extra...` and waits until every counter has ticked a few times.
    pub fn start(e: &E2e, name: &str, extra: &[&str]) -> Tree {
        let out = e.dir().join(name);
        let mut cmd = e.command(&tree_binary());
        cmd.arg(&out).args(extra);
        let root = e.spawn_session(cmd);
        let mut child = 0;
        wait_until(format!("tree {name} ({root}) ready"), || {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let Some(l) = text.lines().find(|l| l.starts_with("ready ")) else {
                return false;
            };
            child = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix("child="))
                .and_then(|v| v.parse().ok())
                .expect("ready line names the child");
            true
        });
        e.adopt(root, child);
        let t = Tree { out, root, child };
        t.wait_ticks(3);
        t
    }

    pub fn pids(&self) -> [i32; 2] {
        [self.root, self.child]
    }

    /// The output's complete lines.
    pub fn text(&self) -> String {
        let mut t = std::fs::read_to_string(&self.out).unwrap_or_default();
        let end = t.rfind('\n').map_or(0, |i| i + 1);
        t.truncate(end);
        t
    }

    /// The restored tree runs again, with the same pids, and goes on from the values it was dumped
    /// with: each counter's first value after the restore is the one after its last value before
    /// (`dumped` = the whole output at the dump, the file not being part of the image).
    pub fn assert_continues(&self, dumped: &str) {
        for pid in self.pids() {
            let st = state_of(pid);
            assert!(
                matches!(st, Some('R' | 'S')),
                "pid {pid} is not running after the restore: {st:?}"
            );
        }
        self.wait_ticks(3);
        let text = self.text();
        let last = last_values(dumped);
        let after = values(&text[dumped.len()..]);
        for (i, src) in TREE_SOURCES.iter().enumerate() {
            assert!(last[i] > 0, "{src} never counted before the dump");
            assert_eq!(
                after[i].first().copied(),
                Some(last[i] + 1),
                "{src}: last value before the dump {}, values after the restore {:?}",
                last[i],
                &after[i][..after[i].len().min(5)]
            );
        }
        assert_consecutive(&text, "the tree's whole output");
    }

    /// Waits until every counter has at least `n` more values than now.
    pub fn wait_ticks(&self, n: usize) {
        let before = self.text().len();
        wait_until(
            format!("{n} more ticks of every task of tree {}", self.root),
            || {
                let text = self.text();
                let vals = values(&text[before.min(text.len())..]);
                vals.iter().all(|v| v.len() >= n)
            },
        );
    }
}

/// Every value of each source in `text`, in file order.
pub fn values(text: &str) -> [Vec<u64>; 4] {
    let mut out: [Vec<u64>; 4] = Default::default();
    for l in text.lines() {
        let Some((src, v)) = l.split_once(' ') else {
            continue;
        };
        if let (Some(i), Ok(v)) = (TREE_SOURCES.iter().position(|s| *s == src), v.parse()) {
            out[i].push(v);
        }
    }
    out
}

/// The last value of each source in `text` (0 where none).
pub fn last_values(text: &str) -> Counters {
    let v = values(text);
    std::array::from_fn(|i| v[i].last().copied().unwrap_or(0))
}

/// Checks that each source's values in `text` go up by exactly one from line to line.
pub fn assert_consecutive(text: &str, what: &str) {
    for (i, vals) in values(text).iter().enumerate() {
        for w in vals.windows(2) {
            assert_eq!(
                w[1],
                w[0] + 1,
                "{what}: {} values jump from {} to {}",
                TREE_SOURCES[i],
                w[0],
                w[1]
            );
        }
    }
}

/// Makes a FIFO at `path`: a file whose blocking open for reading waits for a writer for good.
pub fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path without NUL");
    // SAFETY: mkfifo with a NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}", path.display());
}

pub use fake_cuda_build::FakeCudaBuild;

/// Builds (or finds, once built) the stand-in CUDA driver, NVML and their programs.
pub fn fake_cuda_build() -> FakeCudaBuild {
    fake_cuda_build::build(&cc, &fixture, build_dir())
}
