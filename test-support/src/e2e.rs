//! The context of one end-to-end test ([`E2e`]): the e2e lock, a work directory, CRIU, and
//! every process the test started, killed by id when the test ends.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

use crate::criu::{CRIU_TIMEOUT, criu_binary, criu_version, skip_requested};
use crate::{
    CriuRun, REPO, TempDir, WAIT, build_dir, pgid_of, reap_until_gone, release_plugin, signal,
    state_of,
};

/// The plugin under test: the release cdylib the package ships ([`release_plugin`]).
pub fn plugin_path() -> PathBuf {
    release_plugin::release_plugin_path(Path::new(REPO))
}

/// The plugin's library directory: only `gpu_plugin.so`, the cdylib under test.
pub fn plugin_libdir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = build_dir().join("criu-lib");
        std::fs::create_dir_all(&dir).expect("plugin directory");
        // Copied under another name and renamed into place: a file rewritten in place would
        // change the code under a guardian of an earlier run that still maps it.
        let part = dir.join("gpu_plugin.so.part");
        std::fs::copy(plugin_path(), &part).expect("copy the plugin");
        std::fs::rename(&part, dir.join("gpu_plugin.so")).expect("the plugin into place");
        dir
    })
    .clone()
}

/// Processes a test started: each tree is a session whose id is its root's pid.
#[derive(Default)]
struct Started {
    /// Session/group id -> every pid learnt of that tree.
    trees: BTreeMap<i32, HashSet<i32>>,
}

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

    /// CRIU loaded the plugin (with this release's hook count, where known) and the plugin
    /// logged its hello for `stage`, in `run`'s log.
    pub fn assert_plugin_loaded(&self, run: &CriuRun, stage: &str) {
        let loaded = match self.criu_hook_count() {
            Some(n) => format!("Plugin \"gpu_plugin\" (version 512 hooks {n})"),
            None => "Plugin \"gpu_plugin\" (version 512 hooks ".to_string(),
        };
        assert!(run.has(&loaded), "no `{loaded}` in CRIU's log: {run:?}");
        assert!(
            run.log
                .lines()
                .any(|l| l.contains("gpu_plugin: gpu_plugin ")
                    && l.contains(&format!("stage {stage}"))),
            "no INFO line of the plugin for stage {stage}: {run:?}"
        );
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
        // and close_range(2) (`own_session`), which are async-signal-safe and touch no memory
        // of the parent.
        unsafe {
            cmd.pre_exec(move || own_session(alone));
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

/// For a forked child before `exec`: a session of its own and, with `alone`, every descriptor
/// above stdio marked close-on-exec, so that none the test runner inherited (from whatever
/// started cargo) reaches the program: CRIU would have to dump them, and cannot in another
/// mount namespace. Marked, not closed: std's own pipe that reports a failed exec stays.
/// Calls only setsid(2) and close_range(2), which are async-signal-safe.
pub fn own_session(alone: bool) -> std::io::Result<()> {
    // SAFETY: setsid and close_range take no pointers and touch no memory.
    unsafe {
        if libc::setsid() < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if alone {
            libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
        }
    }
    Ok(())
}
