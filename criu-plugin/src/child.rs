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
//! restore; a child that sends no signal is invisible to its `waitpid(-1)` (only `__WALL` or
//! `__WCLONE` waits see it), and is reaped here by pid. The child blocks the signals CRIU
//! handles, dies with CRIU (`PR_SET_PDEATHSIG`), writes its reply into a pipe and leaves with
//! `_exit`, so it never returns into CRIU's code, runs no `atexit` handler and flushes no
//! buffer of CRIU's. Work that panics in the child is reported as a child that gave no reply.
//!
//! The child is a copy of the caller: call [`run`] only while the calling process has a
//! single thread (CRIU's does, when a plugin keeps the rule above). In a multi-threaded
//! process a lock another thread held at the moment of the copy would stay held in the child.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

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

/// Signals CRIU handles in its own process; the child must never run CRIU's handlers.
const BLOCKED_IN_CHILD: [libc::c_int; 8] = [
    libc::SIGCHLD,
    libc::SIGALRM,
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGPIPE,
    libc::SIGUSR1,
    libc::SIGUSR2,
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
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two fds into the valid array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(ChildError::Spawn(io::Error::last_os_error()));
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
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
fn block_criu_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data initialised by sigemptyset; pthread_sigmask changes only
    // the calling thread's mask and writes the old one into `old`.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in BLOCKED_IN_CHILD {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        old
    }
}

fn restore_mask(old: &libc::sigset_t) {
    // SAFETY: `old` is a mask pthread_sigmask returned.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}

/// The child (CRIU's signals already blocked): die with the parent, run the work, write
/// `[len: u64 LE][bytes]`, `_exit`.
fn child_main(wr: OwnedFd, parent: libc::pid_t, work: impl FnOnce() -> Vec<u8>) -> ! {
    // SAFETY: prctl and getppid only concern this (child) process; _exit ends it at once.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        // The parent died before the death signal was armed.
        if libc::getppid() != parent {
            libc::_exit(4);
        }
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
        // SAFETY: writes from a valid slice to an fd this process owns.
        let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return false;
        }
        buf = &buf[n as usize..];
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
        let mut pfd = libc::pollfd {
            fd: rd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(ChildError::Spawn(io::Error::last_os_error()));
        }
        if r == 0 {
            continue;
        }
        // SAFETY: reads into a valid stack buffer from an fd this process owns.
        let n = unsafe { libc::read(rd.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(ChildError::Spawn(io::Error::last_os_error()));
        }
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n as usize]);
    }
}

/// Waits up to `limit` for the child to end; `None` if it has not.
fn reap(pid: libc::pid_t, pidfd: Option<&OwnedFd>, limit: Duration) -> Option<libc::c_int> {
    let started = Instant::now();
    let mut pause = Duration::from_micros(50);
    if let Some(fd) = pidfd {
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = limit.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd; a pidfd turns readable when its process has ended.
        unsafe { libc::poll(&mut pfd, 1, ms) };
    }
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child by pid; __WALL because it sends no SIGCHLD.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG | libc::__WALL) };
        if r == pid {
            return Some(status);
        }
        if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return None;
        }
        if started.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

fn kill_and_reap(pid: libc::pid_t, pidfd: Option<&OwnedFd>) {
    // SAFETY: signals our own child, which has not been reaped yet (its pid is still ours).
    unsafe { libc::kill(pid, libc::SIGKILL) };
    // A child stuck in the kernel dies when it leaves it; if that takes longer, it stays a
    // process of its own (never a thread of CRIU's) and is reaped by init once CRIU exits.
    let _ = reap(pid, pidfd, REAP_GRACE);
}

fn describe(status: Option<libc::c_int>) -> String {
    match status {
        None => "did not end".to_string(),
        Some(s) if libc::WIFEXITED(s) => format!("exited with status {}", libc::WEXITSTATUS(s)),
        Some(s) if libc::WIFSIGNALED(s) => format!("was killed by signal {}", libc::WTERMSIG(s)),
        Some(s) => format!("ended with wait status {s:#x}"),
    }
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
    fn threads_started_in_the_child_stay_there() {
        let r = run(Duration::from_secs(10), 64, || {
            std::thread::spawn(|| std::thread::sleep(Duration::from_secs(60)));
            thread_count().unwrap().to_le_bytes().to_vec()
        })
        .unwrap();
        assert!(usize::from_le_bytes(r.try_into().unwrap()) >= 2);
    }
}
