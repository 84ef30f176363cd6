//! Letting one stopped thread run: the CUDA restore thread.
//!
//! The driver does the work of checkpoint, restore and unlock inside the target process, on
//! libcuda's restore thread. CRIU has every thread of the tree ptrace-stopped when those calls
//! are due, so around each call the plugin, from CRIU's thread (the tracer), lets exactly that
//! thread run with every signal blocked, then stops it again exactly as CRIU left it:
//!
//! 1. `PTRACE_GETSIGMASK` (kept), `PTRACE_SETSIGMASK` all but `SIGTRAP`;
//! 2. `PTRACE_SETOPTIONS 0` (drops `PTRACE_O_SUSPEND_SECCOMP` while the thread runs);
//! 3. `PTRACE_CONT`; the driver call runs;
//! 4. `PTRACE_INTERRUPT`, wait for the `PTRACE_EVENT_STOP` (signal stops are passed back on, as
//!    CRIU's own wait does);
//! 5. `PTRACE_SETOPTIONS SUSPEND_SECCOMP|TRACESYSGOOD`, `PTRACE_SETSIGMASK` the kept mask.
//!
//! When the thread is not our tracee (a task CRIU never seized, for example after a failed
//! seize), it is running anyway and nothing needs doing. [`RunningThreads`] stops every thread
//! it started when dropped, so an early return or a panic cannot leave one running.

use std::io;

use nix::errno::Errno;
use nix::sys::ptrace::{self, Options};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// `PTRACE_EVENT_STOP`, the stop `PTRACE_INTERRUPT` produces for a seized tracee.
const PTRACE_EVENT_STOP: i32 = 128;

/// `PTRACE_GETSIGMASK` or `PTRACE_SETSIGMASK` (which nix does not wrap) of `tid`'s mask in
/// `mask`.
fn sigmask(req: libc::c_uint, tid: i32, mask: *mut u64) -> io::Result<()> {
    // SAFETY: both requests take the mask's size as the address word and a pointer to a live
    // u64 of that size as the data word (read by SETSIGMASK, written by GETSIGMASK).
    let r = unsafe {
        libc::ptrace(
            req,
            tid,
            std::mem::size_of::<u64>() as *mut libc::c_void,
            mask.cast::<libc::c_void>(),
        )
    };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The options CRIU gives its tracees
/// ([`criu_plugin::criu_internals::tracee_ptrace_options`]; nix names no
/// `PTRACE_O_SUSPEND_SECCOMP`).
fn criu_options(suspend_seccomp: bool) -> Options {
    Options::from_bits_retain(criu_plugin::criu_internals::tracee_ptrace_options(
        suspend_seccomp,
    ))
}

/// One restore thread let run; [`RunningThread::stop`] puts it back.
#[derive(Debug)]
struct RunningThread {
    tid: i32,
    /// The signal mask CRIU left, when we are the tracer.
    saved_mask: Option<u64>,
}

impl RunningThread {
    fn start(tid: i32) -> io::Result<RunningThread> {
        let mut mask: u64 = 0;
        match sigmask(libc::PTRACE_GETSIGMASK, tid, &raw mut mask) {
            Ok(()) => {}
            // Not traced by this thread: the thread runs on its own.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                return Ok(RunningThread {
                    tid,
                    saved_mask: None,
                });
            }
            Err(e) => return Err(e),
        }
        let mut block: u64 = !(1u64 << (libc::SIGTRAP - 1));
        sigmask(libc::PTRACE_SETSIGMASK, tid, &raw mut block)?;
        let pid = Pid::from_raw(tid);
        let started =
            ptrace::setoptions(pid, Options::empty()).and_then(|()| ptrace::cont(pid, None));
        if let Err(e) = started {
            let _ = restore_state(tid, mask);
            return Err(e.into());
        }
        Ok(RunningThread {
            tid,
            saved_mask: Some(mask),
        })
    }

    fn stop(self) -> io::Result<()> {
        let Some(mask) = self.saved_mask else {
            return Ok(());
        };
        let tid = self.tid;
        let pid = Pid::from_raw(tid);
        ptrace::interrupt(pid)?;
        loop {
            // Every signal but SIGTRAP is blocked in the thread, so a stop names a signal nix
            // knows (it refuses, EINVAL, one it has no name for).
            match waitpid(pid, Some(WaitPidFlag::__WALL)) {
                Ok(WaitStatus::PtraceEvent(_, _, PTRACE_EVENT_STOP)) => break,
                // A signal-delivery stop: hand the signal back and wait for the interrupt's
                // stop.
                Ok(WaitStatus::Stopped(_, sig) | WaitStatus::PtraceEvent(_, sig, _)) => {
                    ptrace::cont(pid, sig)?
                }
                Ok(WaitStatus::PtraceSyscall(_)) => ptrace::cont(pid, None)?,
                Ok(st) => {
                    return Err(io::Error::other(format!(
                        "restore thread {tid} ended while running ({st:?})"
                    )));
                }
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        restore_state(tid, mask)
    }
}

fn restore_state(tid: i32, mut mask: u64) -> io::Result<()> {
    let pid = Pid::from_raw(tid);
    if ptrace::setoptions(pid, criu_options(true)).is_err() {
        // Suspending seccomp needs CAP_SYS_ADMIN; without it CRIU could not have set it.
        ptrace::setoptions(pid, criu_options(false))?;
    }
    sigmask(libc::PTRACE_SETSIGMASK, tid, &raw mut mask)
}

/// Restore threads let run; all are stopped again by [`RunningThreads::stop_all`] or on drop.
#[derive(Debug, Default)]
pub struct RunningThreads {
    running: Vec<RunningThread>,
}

impl RunningThreads {
    /// None running yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Lets thread `tid` run, if it is our stopped tracee.
    pub fn start(&mut self, tid: i32) -> io::Result<()> {
        self.running.push(RunningThread::start(tid)?);
        Ok(())
    }

    /// Stops every thread again; returns the ones that could not be put back, with why.
    pub fn stop_all(&mut self) -> Vec<(i32, io::Error)> {
        let mut failed = Vec::new();
        for r in self.running.drain(..) {
            let tid = r.tid;
            if let Err(e) = r.stop() {
                failed.push((tid, e));
            }
        }
        failed
    }
}

impl Drop for RunningThreads {
    fn drop(&mut self) {
        for (tid, e) in self.stop_all() {
            log::error!("cuda: cannot stop restore thread {tid} again: {e}");
        }
    }
}
