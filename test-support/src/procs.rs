//! Processes seen from outside: signals, reaping, `/proc` reads, and waiting for a condition.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::WAIT;

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

/// Whether `pid` runs: it exists and has not ended (a zombie has).
pub fn running(pid: i32) -> bool {
    exists(pid) && state_of(pid) != Some('Z')
}

/// Process group of `pid` from `/proc/<pid>/stat`.
pub fn pgid_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    // state ppid pgrp ...
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// Field `name` (with its colon, e.g. `"TracerPid:"`) of a `/proc/.../status` text, trimmed.
pub fn status_field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(str::trim)
}

/// What `/proc` says of the task at `dir` (`/proc/PID` or `/proc/PID/task/TID`): its state,
/// tracer, where it sleeps and the system call it is in; "gone" when it is.
pub fn task_state_at(dir: &Path) -> String {
    let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
        return "gone".into();
    };
    let field = |name: &str| status_field(&status, name).unwrap_or("?");
    let wchan = std::fs::read_to_string(dir.join("wchan")).unwrap_or_default();
    let syscall = std::fs::read_to_string(dir.join("syscall")).unwrap_or_default();
    format!(
        "state {}, tracer {}, waiting in {wchan:?}, system call {}",
        field("State:"),
        field("TracerPid:"),
        syscall.split_whitespace().next().unwrap_or("?")
    )
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

/// Children of every thread of `pid`.
pub fn children_of(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let text = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        out.extend(
            text.split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok()),
        );
    }
    out
}

pub fn comm_of(pid: i32) -> Option<String> {
    let c = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(c.trim_end().to_string())
}

/// The pid of `pid` in its own (innermost) pid namespace: the last NSpid value.
pub fn ns_pid_of(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Session id of `pid` (as this process sees it) from `/proc/<pid>/stat`.
pub fn sid_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // state ppid pgrp session ...
    stat.rsplit_once(") ")?
        .1
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

/// The pid namespace of `pid` (`pid:[inode]`).
pub fn pid_ns_of(pid: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// Makes a FIFO at `path`: a file whose blocking open for reading waits for a writer for good.
pub fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path without NUL");
    // SAFETY: mkfifo with a NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}", path.display());
}
