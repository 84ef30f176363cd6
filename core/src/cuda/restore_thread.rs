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

/// `PTRACE_EVENT_STOP`, the stop `PTRACE_INTERRUPT` produces for a seized tracee.
const PTRACE_EVENT_STOP: i32 = 128;

fn ptrace(req: libc::c_uint, tid: i32, addr: usize, data: usize) -> io::Result<libc::c_long> {
    // SAFETY: every request used here takes an address and data word; the only pointer passed
    // (for the signal-mask requests) points to a live u64 of the size given in `addr`.
    let r = unsafe {
        libc::ptrace(
            req,
            tid,
            addr as *mut libc::c_void,
            data as *mut libc::c_void,
        )
    };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
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
        match ptrace(
            libc::PTRACE_GETSIGMASK,
            tid,
            std::mem::size_of::<u64>(),
            (&raw mut mask) as usize,
        ) {
            Ok(_) => {}
            // Not traced by this thread: the thread runs on its own.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                return Ok(RunningThread {
                    tid,
                    saved_mask: None,
                });
            }
            Err(e) => return Err(e),
        }
        let block: u64 = !(1u64 << (libc::SIGTRAP - 1));
        ptrace(
            libc::PTRACE_SETSIGMASK,
            tid,
            std::mem::size_of::<u64>(),
            (&raw const block) as usize,
        )?;
        let started = ptrace(libc::PTRACE_SETOPTIONS, tid, 0, 0)
            .and_then(|_| ptrace(libc::PTRACE_CONT, tid, 0, 0));
        if let Err(e) = started {
            let _ = restore_state(tid, mask);
            return Err(e);
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
        ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0)?;
        loop {
            let mut status = 0;
            // SAFETY: waitpid writes the status into the live local `status`.
            let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
            if r == -1 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
            if !libc::WIFSTOPPED(status) {
                return Err(io::Error::other(format!(
                    "restore thread {tid} ended while running (status {status:#x})"
                )));
            }
            if status >> 16 == PTRACE_EVENT_STOP {
                break;
            }
            // A signal-delivery stop: hand the signal back and wait for the interrupt's stop.
            let sig = libc::WSTOPSIG(status);
            ptrace(libc::PTRACE_CONT, tid, 0, sig as usize)?;
        }
        restore_state(tid, mask)
    }
}

fn restore_state(tid: i32, mask: u64) -> io::Result<()> {
    let opts = (libc::PTRACE_O_SUSPEND_SECCOMP | libc::PTRACE_O_TRACESYSGOOD) as usize;
    if ptrace(libc::PTRACE_SETOPTIONS, tid, 0, opts).is_err() {
        // Suspending seccomp needs CAP_SYS_ADMIN; without it CRIU could not have set it.
        ptrace(
            libc::PTRACE_SETOPTIONS,
            tid,
            0,
            libc::PTRACE_O_TRACESYSGOOD as usize,
        )?;
    }
    ptrace(
        libc::PTRACE_SETSIGMASK,
        tid,
        std::mem::size_of::<u64>(),
        (&raw const mask) as usize,
    )?;
    Ok(())
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
