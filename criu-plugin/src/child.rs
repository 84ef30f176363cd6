//! Work done in a short-lived child process of CRIU's, not in CRIU's own process.
//!
//! CRIU enters the namespaces of the tasks it dumps and restores with `setns(2)`, which the
//! kernel refuses (`EINVAL`) to a process with more than one thread. So a plugin must return
//! to CRIU with CRIU's process single-threaded, and a library that starts threads of its own
//! (NVIDIA's NVML starts one that outlives `nvmlShutdown`; `cuInit` starts libcuda's) must run
//! somewhere else. A child process is also the only thing that can be stopped when a driver
//! call never returns: a thread cannot be killed, a process can.
//!
//! [`run`] makes the child with `clone(2)` and **no exit signal**. During a restore CRIU's
//! `SIGCHLD` handler treats any child that exits as a restore task that died and aborts the
//! restore ([`crate::criu_internals::RESTORE_SIGCHLD_ABORTS`]); a child that sends no signal is invisible to its `waitpid(-1)` (only `__WALL` or
//! `__WCLONE` waits see it), and is reaped here by pid. The child blocks the signals CRIU
//! handles, dies with CRIU (`PR_SET_PDEATHSIG`), writes its reply into a pipe and leaves with
//! `_exit`, so it never returns into CRIU's code, runs no `atexit` handler and flushes no
//! buffer of CRIU's. Work that panics in the child is reported as a child that gave no reply.
//!
//! The parent-death signal is armed by the child's first call and kills it stopped or not.
//! Before that call it can only be stopped by a `SIGSTOP` sent to it (the job-control stops,
//! a Ctrl-Z of CRIU's process group, stay blocked from before the copy): such a child
//! outlives a CRIU killed meanwhile, stopped, until it is continued, and then ends at once
//! (its parent is gone).
//!
//! The child is a copy of the caller: call [`run`] only while the calling process has a
//! single thread (CRIU's does, when a plugin keeps the rule above). In a multi-threaded
//! process a lock another thread held at the moment of the copy would stay held in the child.

use std::io;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::wait::{WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// Why a child gave no reply.
#[derive(Debug)]
pub enum ChildError {
    /// No pipe or no child could be made.
    Spawn(io::Error),
    /// The child did not reply within its deadline; it was killed.
    TimedOut(Duration),
    /// The child ended without a complete reply (it crashed, panicked or was killed).
    NoReply(String),
    /// The reply was larger than the caller allows.
    TooLarge(usize),
}

impl std::fmt::Display for ChildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Spawn(e) => write!(f, "cannot start a helper process: {e}"),
            Self::TimedOut(d) => write!(
                f,
                "the helper process did not answer within {} ms and was killed",
                d.as_millis()
            ),
            Self::NoReply(how) => write!(f, "the helper process {how} without an answer"),
            Self::TooLarge(n) => write!(f, "the helper process answered {n} bytes, too many"),
        }
    }
}

impl std::error::Error for ChildError {}

/// Signals CRIU handles in its own process (the child must never run CRIU's handlers:
/// [`crate::criu_internals::RESTORE_SIGCHLD_ABORTS`], [`crate::criu_internals::SEIZE_ALARM`]),
/// those whoever runs CRIU may send it, and the job-control stops: a child stopped before it has armed its parent-death signal would
/// outlive a CRIU killed meanwhile.
const BLOCKED_IN_CHILD: [Signal; 11] = [
    Signal::SIGCHLD,
    Signal::SIGALRM,
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGPIPE,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGTSTP,
    Signal::SIGTTIN,
    Signal::SIGTTOU,
];

/// How long a killed child may take to be reaped before it is left to the init process.
const REAP_GRACE: Duration = Duration::from_secs(2);

/// Runs `work` in a child process and returns the bytes it produced, at most `max_reply`.
/// The child is killed if it has not replied within `deadline`.
pub fn run(
    deadline: Duration,
    max_reply: usize,
    work: impl FnOnce() -> Vec<u8>,
) -> Result<Vec<u8>, ChildError> {
    let (rd, wr) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| ChildError::Spawn(e.into()))?;
    let parent = std::process::id() as libc::pid_t;
    // CRIU's signals stay blocked from before the copy until the child has its own mask: a
    // signal in between would run CRIU's handler in the child.
    let saved = block_criu_signals();
    // SAFETY: this process is single-threaded (see the module docs).
    let (pid, pidfd) = match unsafe { fork_quietly() } {
        Ok(Forked::Child) => {
            drop(rd);
            child_main(wr, parent, work)
        }
        Ok(Forked::Parent { pid, pidfd }) => {
            restore_mask(&saved);
            (pid, pidfd)
        }
        Err(e) => {
            restore_mask(&saved);
            return Err(ChildError::Spawn(e));
        }
    };
    drop(wr);
    let started = Instant::now();
    let reply = read_reply(&rd, deadline, max_reply);
    drop(rd);
    match reply {
        Ok(Some(bytes)) => {
            // It exits right after replying; one that does not is killed.
            if reap(pid, pidfd.as_ref(), REAP_GRACE).is_none() {
                kill_and_reap(pid, pidfd.as_ref());
            }
            Ok(bytes)
        }
        Ok(None) => {
            // Closed without a whole reply: give it a moment to end, then make sure it does.
            let left = deadline.saturating_sub(started.elapsed()).min(REAP_GRACE);
            let status = match reap(pid, pidfd.as_ref(), left) {
                Some(st) => Some(st),
                None => {
                    kill_and_reap(pid, pidfd.as_ref());
                    None
                }
            };
            Err(ChildError::NoReply(describe(status)))
        }
        Err(e) => {
            kill_and_reap(pid, pidfd.as_ref());
            Err(e)
        }
    }
}

/// Which side of [`fork_quietly`] this is.
pub(crate) enum Forked {
    /// The new process.
    Child,
    /// The caller, with the child's pid and pidfd (`None` on kernels without `CLONE_PIDFD`).
    Parent {
        pid: libc::pid_t,
        pidfd: Option<OwnedFd>,
    },
}

/// A copy of the calling process made with `clone(2)` and no exit signal: fork(2) that sends
/// the parent no `SIGCHLD` (CRIU's handler would take the child for a dead task; `waitpid(-1)`
/// without `__WALL` never sees it), with `CLONE_PIDFD`.
///
/// # Safety
///
/// The calling process must have a single thread: in the copy, a lock another thread held at
/// the moment of the copy would stay held. The child continues from the return of this
/// function on a copy of the caller's stack, and must never return into CRIU's code.
pub(crate) unsafe fn fork_quietly() -> io::Result<Forked> {
    let mut pidfd: libc::c_int = -1;
    // SAFETY: clone without CLONE_VM and without a new stack is fork(2): the child gets a copy
    // of this process and of this stack, and returns from the call with 0. CLONE_PIDFD stores
    // a pidfd of the child in `pidfd` (the parent-tid argument).
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            libc::CLONE_PIDFD as libc::c_ulong,
            0 as libc::c_ulong,
            &mut pidfd as *mut libc::c_int,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    match pid {
        0 => Ok(Forked::Child),
        p if p < 0 => Err(io::Error::last_os_error()),
        p => Ok(Forked::Parent {
            pid: p as libc::pid_t,
            // SAFETY: the kernel just created this fd for us (kernels without CLONE_PIDFD
            // leave -1).
            pidfd: (pidfd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(pidfd) }),
        }),
    }
}

/// Blocks [`BLOCKED_IN_CHILD`] in the calling thread; returns the mask before.
fn block_criu_signals() -> SigSet {
    let set: SigSet = BLOCKED_IN_CHILD.into_iter().collect();
    // Only EINVAL (a bad `how`) can fail; the mask before is then the mask now.
    set.thread_swap_mask(SigmaskHow::SIG_BLOCK)
        .unwrap_or_else(|_| SigSet::thread_get_mask().unwrap_or_else(|_| SigSet::empty()))
}

pub(crate) fn restore_mask(old: &SigSet) {
    let _ = old.thread_set_mask();
}

/// The child (CRIU's signals already blocked): die with the parent, run the work, write
/// `[len: u64 LE][bytes]`, `_exit`.
fn child_main(wr: OwnedFd, parent: libc::pid_t, work: impl FnOnce() -> Vec<u8>) -> ! {
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    // The parent died before the death signal was armed.
    if nix::unistd::getppid().as_raw() != parent {
        // SAFETY: _exit ends the child at once, without running any of CRIU's exit handlers.
        unsafe { libc::_exit(4) };
    }
    let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
        Ok(bytes) => {
            let mut msg = (bytes.len() as u64).to_le_bytes().to_vec();
            msg.extend_from_slice(&bytes);
            if write_all(&wr, &msg) { 0 } else { 2 }
        }
        Err(_) => 3,
    };
    // SAFETY: _exit ends the child at once, without running any of CRIU's exit handlers.
    unsafe { libc::_exit(code) }
}

fn write_all(fd: &OwnedFd, mut buf: &[u8]) -> bool {
    while !buf.is_empty() {
        match nix::unistd::write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(Errno::EINTR) => continue,
            Err(_) => return false,
        }
    }
    true
}

/// Reads the framed reply: `Ok(None)` when the child closed the pipe before a whole reply.
fn read_reply(
    rd: &OwnedFd,
    deadline: Duration,
    max_reply: usize,
) -> Result<Option<Vec<u8>>, ChildError> {
    let started = Instant::now();
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if buf.len() >= 8 {
            let len = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
            if len > max_reply as u64 {
                return Err(ChildError::TooLarge(len as usize));
            }
            if buf.len() as u64 >= 8 + len {
                buf.drain(..8);
                buf.truncate(len as usize);
                return Ok(Some(buf));
            }
        }
        let left = deadline.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(ChildError::TimedOut(deadline));
        }
        match poll_in(rd.as_fd(), left) {
            Ok(true) => {}
            Ok(false) | Err(Errno::EINTR) => continue,
            Err(e) => return Err(ChildError::Spawn(e.into())),
        }
        match nix::unistd::read(rd, &mut chunk) {
            Ok(0) => return Ok(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(ChildError::Spawn(e.into())),
        }
    }
}

/// Whether `fd` turns readable within `wait` (at least 1 ms): a pipe with data or at EOF, a
/// pidfd whose process has ended.
pub(crate) fn poll_in(fd: std::os::fd::BorrowedFd<'_>, wait: Duration) -> nix::Result<bool> {
    let ms = wait.as_millis().clamp(1, i32::MAX as u128) as i32;
    let mut pfd = [PollFd::new(fd, PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
    Ok(nix::poll::poll(&mut pfd, timeout)? > 0)
}

/// `waitpid(pid, WNOHANG | __WALL)` (`__WALL` because the child sends no `SIGCHLD`): how the
/// child ended, `Ok(None)` while it runs.
pub(crate) fn try_reap(pid: libc::pid_t) -> nix::Result<Option<String>> {
    let flags = WaitPidFlag::WNOHANG | WaitPidFlag::__WALL;
    match nix::sys::wait::waitpid(Pid::from_raw(pid), Some(flags)) {
        Ok(WaitStatus::Exited(_, code)) => Ok(Some(format!("exited with status {code}"))),
        Ok(WaitStatus::Signaled(_, sig, _)) => {
            Ok(Some(format!("was killed by signal {}", sig as i32)))
        }
        // A stop is no end (none is reported without WUNTRACED or a tracer).
        Ok(_) => Ok(None),
        // With these flags the kernel has no EINVAL to give: nix says so when the child was
        // reaped but ended by a signal it has no name for (a real-time one).
        Err(Errno::EINVAL) => Ok(Some("was killed by a real-time signal".to_string())),
        Err(e) => Err(e),
    }
}

/// Waits up to `limit` for the child to end; how it ended, `None` if it has not.
fn reap(pid: libc::pid_t, pidfd: Option<&OwnedFd>, limit: Duration) -> Option<String> {
    let started = Instant::now();
    let mut pause = Duration::from_micros(50);
    if let Some(fd) = pidfd {
        let _ = poll_in(fd.as_fd(), limit);
    }
    loop {
        match try_reap(pid) {
            Ok(Some(st)) => return Some(st),
            Ok(None) | Err(Errno::EINTR) => {}
            Err(_) => return None,
        }
        if started.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

fn kill_and_reap(pid: libc::pid_t, pidfd: Option<&OwnedFd>) {
    // Our own child, not reaped yet: its pid is still its own.
    let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
    // A child stuck in the kernel dies when it leaves it; if that takes longer, it stays a
    // process of its own (never a thread of CRIU's) and is reaped by init once CRIU exits.
    let _ = reap(pid, pidfd, REAP_GRACE);
}

fn describe(status: Option<String>) -> String {
    status.unwrap_or_else(|| "did not end".to_string())
}

/// Number of threads of the calling process (entries of `/proc/self/task`); `None` if unknown.
pub fn thread_count() -> Option<usize> {
    std::fs::read_dir("/proc/self/task").ok().map(|d| d.count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_comes_back() {
        let r = run(Duration::from_secs(10), 1 << 20, || b"hello".to_vec()).unwrap();
        assert_eq!(r, b"hello");
        let big = run(Duration::from_secs(10), 1 << 20, || vec![7u8; 300_000]).unwrap();
        assert_eq!(big.len(), 300_000);
        assert!(big.iter().all(|&b| b == 7));
    }

    #[test]
    fn a_hung_child_is_killed_at_its_deadline() {
        let t = Instant::now();
        let e = run(Duration::from_millis(200), 64, || {
            std::thread::sleep(Duration::from_secs(60));
            Vec::new()
        })
        .unwrap_err();
        assert!(matches!(e, ChildError::TimedOut(_)), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn panics_and_oversized_replies_are_errors() {
        let e = run(Duration::from_secs(10), 64, || panic!("boom")).unwrap_err();
        assert!(matches!(e, ChildError::NoReply(_)), "{e}");
        assert!(e.to_string().contains("status 3"), "{e}");
        let e = run(Duration::from_secs(10), 4, || vec![0; 5]).unwrap_err();
        assert!(matches!(e, ChildError::TooLarge(5)), "{e}");
    }

    #[test]
    fn the_child_blocks_criu_signals_and_job_control_stops() {
        let r = run(Duration::from_secs(10), 64, || {
            let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
            let blocked = status
                .lines()
                .find_map(|l| l.strip_prefix("SigBlk:"))
                .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
                .unwrap_or(0);
            blocked.to_le_bytes().to_vec()
        })
        .unwrap();
        let blocked = u64::from_le_bytes(r.try_into().unwrap());
        let stops = [Signal::SIGTSTP, Signal::SIGTTIN, Signal::SIGTTOU];
        for sig in BLOCKED_IN_CHILD.into_iter().chain(stops) {
            assert_ne!(blocked & (1 << (sig as u32 - 1)), 0, "{sig} is not blocked");
        }
    }

    #[test]
    fn threads_started_in_the_child_stay_there() {
        let r = run(Duration::from_secs(10), 64, || {
            std::thread::spawn(|| std::thread::sleep(Duration::from_secs(60)));
            thread_count().unwrap().to_le_bytes().to_vec()
        })
        .unwrap();
        assert!(usize::from_le_bytes(r.try_into().unwrap()) >= 2);
    }
}
