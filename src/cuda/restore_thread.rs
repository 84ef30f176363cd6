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
//! seize), it is running anyway and nothing needs doing.

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

/// A restore thread let run by [`RunningThread::start`]; [`RunningThread::stop`] puts it back.
#[derive(Debug)]
pub struct RunningThread {
    tid: i32,
    /// The signal mask CRIU left, when we are the tracer.
    saved_mask: Option<u64>,
}

impl RunningThread {
    /// Lets thread `tid` run, if it is our stopped tracee.
    pub fn start(tid: i32) -> io::Result<RunningThread> {
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
            let _ = Self::restore_state(tid, mask);
            return Err(e);
        }
        Ok(RunningThread {
            tid,
            saved_mask: Some(mask),
        })
    }

    /// The thread's id.
    pub fn tid(&self) -> i32 {
        self.tid
    }

    /// Stops the thread again and restores what CRIU had set.
    pub fn stop(self) -> io::Result<()> {
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
        Self::restore_state(tid, mask)
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
}

/// Runs `f` with each of `tids` running, then stops them all again. Threads that could not be
/// started are reported with their error and `f` is not run.
pub fn with_threads_running<T>(tids: &[i32], f: impl FnOnce() -> T) -> io::Result<T> {
    let mut running = Vec::with_capacity(tids.len());
    for &tid in tids {
        match RunningThread::start(tid) {
            Ok(r) => running.push(r),
            Err(e) => {
                for r in running {
                    let _ = r.stop();
                }
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot let restore thread {tid} run: {e}"),
                ));
            }
        }
    }
    let out = f();
    let mut first_err = None;
    for r in running {
        let tid = r.tid();
        if let Err(e) = r.stop() {
            first_err.get_or_insert(io::Error::new(
                e.kind(),
                format!("cannot stop restore thread {tid} again: {e}"),
            ));
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
