//! Worker threads inside CRIU's process: the one way a plugin starts them.
//!
//! Three properties, each one a rule of running inside CRIU:
//!
//! - **Joined before the hook returns.** CRIU must be single-threaded again whenever the
//!   plugin returns to it (it forks, `setns`es and `dlclose`s the plugin). Workers exist only
//!   inside [`scope`], which joins every one of them before it returns: no handle can escape.
//! - **Every asynchronous signal blocked from the first instruction.** A process-directed
//!   signal (CRIU's `SIGALRM` timeout, the `SIGCHLD` that tells it a task or helper changed
//!   state: [`crate::criu_internals::SEIZE_ALARM`],
//!   [`crate::criu_internals::RESTORE_SIGCHLD_ABORTS`]; a `SIGTERM` or `SIGINT` from whoever runs CRIU, `SIGPIPE`, `SIGUSR1/2`...) goes to
//!   any thread that does not block it; taken by a worker, it would run CRIU's handler on the
//!   wrong thread or fail to interrupt the system call CRIU's thread waits in. The mask is set
//!   in the spawning thread around the spawn, so the new thread inherits it before it runs a
//!   single instruction, and then put back. Left unblocked are only the signals the kernel
//!   raises on the faulting thread itself ([`FAULT_SIGNALS`]): blocking one of those does not
//!   hold it back, it makes the kernel reset its handler and kill the process (Rust's stack
//!   overflow report is such a handler).
//! - **A panic is an error, not an unwind.** A worker's panic is caught on the worker and
//!   handed to whoever joins it as a [`WorkerPanic`]; one that nobody joined is returned by
//!   [`scope`]. Nothing unwinds into the hook from a worker.
//!
//! ```
//! let total = criu_plugin::threads::scope(|workers| {
//!     let a = workers.spawn("sum-a", || (1..=10).sum::<u32>()).unwrap();
//!     let b = workers.spawn("sum-b", || (11..=20).sum::<u32>()).unwrap();
//!     a.join().unwrap() + b.join().unwrap()
//! })
//! .unwrap();
//! assert_eq!(total, 210);
//! ```

use std::fmt;
use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{Scope, ScopedJoinHandle};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};

/// The signals a worker leaves unblocked: synchronous ones, delivered to the thread that
/// caused them (a bad access, a bad instruction, a breakpoint, a seccomp trap).
pub const FAULT_SIGNALS: [Signal; 6] = [
    Signal::SIGSEGV,
    Signal::SIGBUS,
    Signal::SIGFPE,
    Signal::SIGILL,
    Signal::SIGTRAP,
    Signal::SIGSYS,
];

/// The mask every worker starts with: every signal but [`FAULT_SIGNALS`]. (`SIGKILL` and
/// `SIGSTOP` cannot be blocked; the C library keeps its own internal signals out of the set.)
pub fn worker_mask() -> SigSet {
    let mut set = SigSet::all();
    for sig in FAULT_SIGNALS {
        set.remove(sig);
    }
    set
}

/// A worker that panicked: its name and what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerPanic {
    /// The name the worker was spawned with.
    pub worker: String,
    /// The panic's message (its payload when that is a string).
    pub message: String,
}

impl fmt::Display for WorkerPanic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "worker thread {} panicked: {}",
            self.worker, self.message
        )
    }
}

impl std::error::Error for WorkerPanic {}

impl From<WorkerPanic> for io::Error {
    fn from(p: WorkerPanic) -> Self {
        io::Error::other(p)
    }
}

/// Where a worker leaves its panic until it is joined (or [`scope`] ends).
type PanicSlot = Arc<Mutex<Option<WorkerPanic>>>;

fn take(slot: &PanicSlot) -> Option<WorkerPanic> {
    slot.lock().unwrap_or_else(PoisonError::into_inner).take()
}

/// The spawner of one [`scope`].
pub struct Workers<'scope, 'env: 'scope> {
    scope: &'scope Scope<'scope, 'env>,
    slots: Mutex<Vec<PanicSlot>>,
}

/// A running worker; [`Worker::join`] waits for it. Dropping it does not wait: [`scope`] does.
pub struct Worker<'scope, T> {
    handle: ScopedJoinHandle<'scope, Option<T>>,
    name: String,
    panic: PanicSlot,
}

impl<'scope, T> Worker<'scope, T> {
    /// Waits for the worker; its result, or its panic.
    pub fn join(self) -> Result<T, WorkerPanic> {
        match self.handle.join() {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(take(&self.panic).unwrap_or_else(|| WorkerPanic {
                worker: self.name.clone(),
                message: "(no message)".into(),
            })),
            // Only a panic while dropping a panic's payload gets past the worker's catch.
            Err(_) => Err(WorkerPanic {
                worker: self.name,
                message: "panicked while dropping a panic".into(),
            }),
        }
    }
}

impl<'scope> Workers<'scope, '_> {
    /// Starts a worker named `name` running `f`, with [`worker_mask`] blocked from its first
    /// instruction. An error (no thread to be had, a mask that could not be set) starts none:
    /// callers then do the work on their own thread or with fewer workers.
    pub fn spawn<F, T>(&self, name: impl Into<String>, f: F) -> io::Result<Worker<'scope, T>>
    where
        F: FnOnce() -> T + Send + 'scope,
        T: Send + 'scope,
    {
        let name = name.into();
        let panic: PanicSlot = Arc::default();
        let slot = Arc::clone(&panic);
        let worker = name.clone();
        let body = move || match catch_unwind(AssertUnwindSafe(f)) {
            Ok(t) => Some(t),
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(a payload that is not a string)".into());
                *slot.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(WorkerPanic { worker, message });
                None
            }
        };
        // The new thread inherits the spawning thread's mask: block, spawn, put back.
        let before = worker_mask()
            .thread_swap_mask(SigmaskHow::SIG_BLOCK)
            .map_err(io::Error::from)?;
        let spawned = std::thread::Builder::new()
            .name(name.clone())
            .spawn_scoped(self.scope, body);
        let restored = before.thread_set_mask();
        let handle = spawned?;
        if let Err(e) = restored {
            // Cannot happen with a mask the kernel returned; say so rather than hide it.
            log::error!("signal mask not restored after starting worker {name}: {e}");
        }
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&panic));
        Ok(Worker {
            handle,
            name,
            panic,
        })
    }
}

/// Runs `f` with a spawner of workers and returns after every worker it started has ended.
/// `Err` is the first panic of a worker that nobody joined (a joined worker's panic went to
/// its joiner). A panic of `f` itself unwinds as usual, after the workers are joined.
pub fn scope<'env, F, T>(f: F) -> Result<T, WorkerPanic>
where
    F: for<'scope> FnOnce(&Workers<'scope, 'env>) -> T,
{
    let (t, slots) = std::thread::scope(|s| {
        let workers = Workers {
            scope: s,
            slots: Mutex::new(Vec::new()),
        };
        let t = f(&workers);
        (t, workers.slots)
    });
    let slots = slots.into_inner().unwrap_or_else(PoisonError::into_inner);
    match slots.iter().find_map(take) {
        Some(p) => Err(p),
        None => Ok(t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SigBlk` of the calling thread, from `/proc/thread-self/status`.
    fn blocked_here() -> u64 {
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .unwrap();
        u64::from_str_radix(line.trim(), 16).unwrap()
    }

    fn bit(sig: Signal) -> u64 {
        1 << (sig as i32 - 1)
    }

    #[test]
    fn a_worker_blocks_every_asynchronous_signal_and_the_spawner_keeps_its_mask() {
        let before = blocked_here();
        let seen = scope(|w| w.spawn("mask", blocked_here).unwrap().join().unwrap()).unwrap();
        assert_eq!(
            blocked_here(),
            before,
            "the spawning thread's mask is put back"
        );
        for sig in [
            Signal::SIGALRM,
            Signal::SIGCHLD,
            Signal::SIGTERM,
            Signal::SIGINT,
            Signal::SIGHUP,
            Signal::SIGQUIT,
            Signal::SIGUSR1,
            Signal::SIGUSR2,
            Signal::SIGPIPE,
            Signal::SIGABRT,
            Signal::SIGCONT,
            Signal::SIGWINCH,
        ] {
            assert_ne!(seen & bit(sig), 0, "{sig} blocked in the worker ({seen:x})");
        }
        for sig in FAULT_SIGNALS {
            assert_eq!(
                seen & bit(sig),
                0,
                "{sig} not blocked in the worker ({seen:x})"
            );
        }
        // Real-time signals (those the C library does not keep for itself) are blocked too.
        assert_ne!(seen >> 40, 0, "{seen:x}");
    }

    #[test]
    fn a_panicking_worker_is_reported_to_its_joiner() {
        let r = scope(|w| {
            let h = w
                .spawn("bad", || -> u32 { panic!("lost the device") })
                .unwrap();
            let good = w.spawn("good", || 7).unwrap();
            (h.join(), good.join())
        })
        .unwrap();
        let p = r.0.unwrap_err();
        assert_eq!(p.worker, "bad");
        assert_eq!(p.message, "lost the device");
        assert!(p.to_string().contains("bad") && p.to_string().contains("lost the device"));
        assert_eq!(r.1, Ok(7));
    }

    #[test]
    fn a_panic_nobody_joined_is_returned_by_the_scope() {
        let n = 3;
        let r = scope(|w| {
            for i in 0..4 {
                w.spawn(format!("w{i}"), move || {
                    if i == n {
                        panic!("worker {i} failed");
                    }
                })
                .unwrap();
            }
            "done"
        });
        let p = r.unwrap_err();
        assert_eq!(p.worker, "w3");
        assert_eq!(p.message, "worker 3 failed");
        let e: io::Error = p.into();
        assert!(e.to_string().contains("worker 3 failed"));
    }

    #[test]
    fn workers_borrow_from_the_caller_and_are_joined_when_the_scope_returns() {
        let counter = std::sync::atomic::AtomicUsize::new(0);
        scope(|w| {
            for i in 0..8 {
                let counter = &counter;
                let _ = w.spawn(format!("n{i}"), move || {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        })
        .unwrap();
        assert_eq!(counter.load(std::sync::atomic::Ordering::SeqCst), 8);
    }
}
