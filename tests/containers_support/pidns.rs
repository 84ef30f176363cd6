//! A pid namespace of the test's own, for a runtime that must never run in the machine's: crun
//! 1.28's restore leaves a container whose removal signals every process crun can see
//! (`docs/crun-restore-kills.md`). The test runs again as pid 1 of a new pid namespace (with its
//! own `/proc`): a `kill(-1, ...)` from anything it starts reaches only what that namespace
//! holds, never pid 1 (the test), and a bystander process there shows whether it happened.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{reap_now, run_tool_for};
use crate::common::{self, E2e};

/// `/proc/self/ns/pid` of the machine's initial pid namespace (the kernel's
/// `PROC_PID_INIT_INO`).
const INITIAL_PID_NS_INODE: u64 = 0xEFFF_FFFC;

/// How long the whole test may take in its namespace.
const LIMIT: Duration = Duration::from_secs(300);

/// This process is pid 1 of a pid namespace other than the machine's: nothing it starts can
/// signal a process outside that namespace, nor this one with `kill(-1, ...)`.
pub fn in_own_pid_namespace() -> bool {
    let ino = std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino());
    std::process::id() == 1 && ino.is_ok_and(|i| i != INITIAL_PID_NS_INODE)
}

/// Outside: runs test `name` of this test executable again as pid 1 of a new pid namespace
/// (`unshare --fork --pid --mount-proc --kill-child`), prints its output, panics unless it
/// passed, and returns `true`. Inside that run: returns `false` (the test's body goes on),
/// after checking that it is indeed there.
pub fn rerun_in_own_pid_namespace(e: &E2e, name: &str) -> bool {
    if std::env::var_os(common::OUTER_PID_VAR).is_some() {
        assert!(
            in_own_pid_namespace(),
            "{} is set but this is not pid 1 of a pid namespace of its own",
            common::OUTER_PID_VAR
        );
        return false;
    }
    let exe = std::env::current_exe().expect("test executable");
    let mut cmd = Command::new("unshare");
    cmd.args(["--fork", "--pid", "--mount-proc", "--kill-child", "--"])
        .arg(&exe)
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(common::OUTER_PID_VAR, std::process::id().to_string());
    let run = run_tool_for(
        e.dir(),
        cmd,
        &format!("{name} in a pid namespace of its own"),
        LIMIT,
    );
    eprintln!(
        "---- {name} in its own pid namespace ----\n{}{}",
        run.stdout, run.stderr
    );
    assert!(
        run.ok() && run.stdout.contains("test result: ok. 1 passed"),
        "{name} failed in its own pid namespace (its output is above): exit {:?}",
        run.code
    );
    true
}

/// A process that only sleeps, in the test's pid namespace: what a runtime that signals every
/// process it can would kill first.
pub struct Bystander {
    pid: i32,
}

impl Bystander {
    pub fn start(e: &E2e) -> Bystander {
        let mut cmd = e.command(Path::new("sleep"));
        cmd.arg("600");
        Bystander {
            pid: e.spawn_session(cmd),
        }
    }

    /// Panics, naming `step`, when the bystander was killed.
    pub fn assert_alive(&self, step: &str) {
        reap_now();
        assert!(
            common::running(self.pid),
            "the {step} killed a bystander process (pid {} of the test's pid namespace, not in \
             the container): the runtime signalled processes that are not its container's \
             (docs/crun-restore-kills.md)",
            self.pid
        );
    }
}

/// What makes crun's restore (1.21, 1.28) kill every process it sees
/// (`docs/crun-restore-kills.md`):
/// on cgroup v1, the first hierarchy of `/proc/self/cgroup` other than memory is one crun does
/// not join, because `/sys/fs/cgroup/<name>` is not there or is read-only. `None` when that is
/// not so.
pub fn crun_restore_kills_here() -> Option<String> {
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        return None; // cgroup v2 only: crun restores without its helper process.
    }
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let controller = text.lines().find_map(|l| {
        let c = l.split(':').nth(1)?;
        (c != "memory").then(|| c.to_string())
    })?;
    // crun's names for the directories.
    let dir = match controller.as_str() {
        "" => "unified",
        "cpuacct,cpu" => "cpu,cpuacct",
        "net_prio,net_cls" => "net_cls,net_prio",
        c => c.strip_prefix("name=").unwrap_or(c),
    };
    let path = Path::new("/sys/fs/cgroup").join(dir);
    let what = if !path.is_dir() {
        "not mounted at"
    } else if read_only(&path) {
        "read-only at"
    } else {
        return None;
    };
    Some(format!(
        "the first hierarchy of /proc/self/cgroup other than memory, {controller:?}, is {what} {}",
        path.display()
    ))
}

fn read_only(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statvfs for the call to fill.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        libc::statvfs(c.as_ptr(), &mut st) == 0 && st.f_flag & libc::ST_RDONLY != 0
    }
}
