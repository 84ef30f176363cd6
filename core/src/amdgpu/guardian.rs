//! What restarts a dumped process's GPU queues should CRIU end in the middle of the dump.
//!
//! PROCESS_INFO pauses (evicts) a process's queues; the dump restarts them with UNPAUSE once
//! its files are dumped, when a file fails, and at the end of the run. A CRIU killed in
//! between (a runtime's timeout, the OOM killer) would leave the process running on the CPU
//! with its GPU work stopped for good. So before the first pause a dump starts a guardian
//! ([`criu_plugin::guardian`]), a process that outlives CRIU; it tells it of each process
//! before pausing it ([`QueueGuard::watch`], the process found by
//! [`KfdDevice::kfd_holder`]), and that it needs nothing more once the queues run again
//! ([`QueueGuard::forget`]); a run that ends with every queue running releases it. Should
//! CRIU end first, the guardian's [`RestartQueues`] restarts the queues of every process it
//! still watches ([`restart_queues`], through [`KfdDevice::unpause_holder`]). `criu-gpu
//! resume` does the same by hand ([`restart_queues_of`]).
//!
//! The dump reaches the guardian through [`QueueGuard`], made by the backend's
//! [`QueueGuardFactory`]: the plugin's backend spawns the guardian process
//! ([`guardian_process`]); tests on the KFD simulator, whose processes are not real, pass a
//! guard of their own and run [`restart_queues`] themselves as the guardian would.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use criu_plugin::guardian::{Duty, Guardian, Watched};

use super::device::{KfdDevice, KfdHolder};

/// Keeps watch over the processes a dump pauses.
pub trait QueueGuard: Send {
    /// Whether the guard still works (the guardian process can be killed or stopped like any
    /// other).
    fn alive(&self) -> bool;

    /// `holder`'s queues are about to be paused: restart them should CRIU end.
    fn watch(&self, holder: &KfdHolder) -> io::Result<()>;

    /// `pid`'s queues run again.
    fn forget(&self, pid: i32) -> io::Result<()>;

    /// The run ended with every queue running.
    fn release(self: Box<Self>);
}

/// Starts a dump's guard for the run's device, once per dump before its first pause.
/// `Ok(None)`: this machine cannot run one (a kernel without pidfds); the dump goes on
/// without.
pub type QueueGuardFactory =
    Arc<dyn Fn(Arc<dyn KfdDevice>) -> io::Result<Option<Box<dyn QueueGuard>>> + Send + Sync>;

/// The guardian process of [`criu_plugin::guardian`], doing [`RestartQueues`].
pub fn guardian_process() -> QueueGuardFactory {
    Arc::new(|dev| match Guardian::spawn(RestartQueues { dev }) {
        Ok(g) => {
            log::debug!("amdgpu: guardian {} started", g.pid());
            Ok(Some(Box::new(GuardianProcess(g)) as Box<dyn QueueGuard>))
        }
        // Kernels before 5.3 have no pidfds; CRIU the init of its pid namespace.
        Err(e) if criu_plugin::guardian::unavailable_here(&e) => Ok(None),
        Err(e) => Err(e),
    })
}

struct GuardianProcess(Guardian);

impl QueueGuard for GuardianProcess {
    fn alive(&self) -> bool {
        self.0.alive() && !self.0.stopped()
    }

    fn watch(&self, holder: &KfdHolder) -> io::Result<()> {
        // The action word carries the fd number the process holds its KFD file under.
        self.0
            .watch(holder.pid, holder.start, holder.fd as u32, None)
    }

    fn forget(&self, pid: i32) -> io::Result<()> {
        self.0.forget(pid)
    }

    fn release(self: Box<Self>) {
        self.0.release()
    }
}

/// The guardian's duty: restart the queues of every process it still watches.
pub struct RestartQueues {
    /// The run's device (the guardian's copy of it).
    pub dev: Arc<dyn KfdDevice>,
}

impl Duty for RestartQueues {
    fn rescue(&mut self, watched: Vec<Watched>) {
        let left: Vec<(KfdHolder, Option<BorrowedFd<'_>>)> = watched
            .iter()
            .map(|w| {
                let holder = KfdHolder {
                    pid: w.pid,
                    start: w.start,
                    fd: w.action as i32,
                };
                (holder, Some(w.pidfd().as_fd()))
            })
            .collect();
        for (pid, r) in restart_queues(self.dev.as_ref(), &left) {
            match r {
                Restart::Restarted(_) => log::warn!(
                    "guardian: CRIU ended in the middle of the dump; pid {pid}'s GPU queues run again (KFD UNPAUSE)"
                ),
                Restart::WasRunning => {
                    log::info!("guardian: pid {pid}: its GPU queues were not paused")
                }
                Restart::Failed(e) => log::error!(
                    "guardian: pid {pid}'s GPU queues stay paused: {e}; run `{}`",
                    recovery_command(pid)
                ),
            }
        }
    }
}

/// What [`restart_queues`] did for one process.
#[derive(Debug)]
pub enum Restart {
    /// The queues run again (this many UNPAUSEs went through).
    Restarted(u32),
    /// Nothing was paused (CRIU ended before the pause or after the dump restarted them).
    WasRunning,
    /// The queues stay paused.
    Failed(io::Error),
}

/// The command that restarts a process's GPU queues by hand.
pub fn recovery_command(pid: i32) -> String {
    format!("criu-gpu resume {pid}")
}

/// Restarts the queues of each process of `left` (with a pidfd of it where there is one), all
/// at once. Runs outside CRIU (threads).
pub fn restart_queues(
    dev: &dyn KfdDevice,
    left: &[(KfdHolder, Option<BorrowedFd<'_>>)],
) -> Vec<(i32, Restart)> {
    let outcome = |(holder, pidfd): &(KfdHolder, Option<BorrowedFd<'_>>)| {
        let r = match dev.unpause_holder(holder, *pidfd) {
            Ok(0) => Restart::WasRunning,
            Ok(n) => Restart::Restarted(n),
            Err(e) => Restart::Failed(e),
        };
        (holder.pid, r)
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = left
            .iter()
            .map(|item| {
                let worker = std::thread::Builder::new()
                    .name(format!("restart-{}", item.0.pid))
                    .spawn_scoped(s, move || outcome(item));
                (item, worker)
            })
            .collect();
        workers
            .into_iter()
            .map(|(item, worker)| match worker {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    let e = io::Error::other("its restart thread panicked");
                    (item.0.pid, Restart::Failed(e))
                }),
                // No thread to be had: this one does it.
                Err(_) => outcome(item),
            })
            .collect()
    })
}

/// Restarts, on this machine's amdkfd, the GPU queues of each process of `pids` that holds a
/// `/dev/kfd` file and has them paused (what `criu-gpu resume` does for a process a killed
/// dump left paused). Processes without a `/dev/kfd` file are left out; a machine without
/// `/dev/kfd` has none.
pub fn restart_queues_of(pids: &[i32]) -> Vec<(i32, Restart)> {
    let dev = super::kernel::KernelKfd::new();
    let Ok(kfd_rdev) = dev.kfd_rdev() else {
        return Vec::new();
    };
    let holders: Vec<(KfdHolder, Option<BorrowedFd<'_>>)> = pids
        .iter()
        .filter_map(|&pid| {
            let fd = super::holder::kfd_fd_number(pid, kfd_rdev)?;
            let start = criu_plugin::proc::start_time(pid)?;
            Some((KfdHolder { pid, start, fd }, None))
        })
        .collect();
    restart_queues(&dev, &holders)
}
