//! What the NVIDIA side's guardian ([`criu_plugin::guardian`]) does when CRIU ends before a run
//! is done.
//!
//! - Dump ([`PutBack`]): each process the dump locked or checkpointed is restored (if
//!   checkpointed) and unlocked (if the dump locked it), as the dump found it. CRIU's end
//!   detaches its ptrace from the tasks, so their restore threads run and the driver answers.
//!   A lock helper announces a process before it asks the driver to lock it, so a CRIU killed
//!   in the middle of a lock is covered too.
//! - Restore: the vendor-neutral [`criu_plugin::guardian::restore::EndRestore`] ends the tasks
//!   CRIU forked; [`ClaimTasks`] claims each of them meanwhile.

use std::time::Duration;

use criu_plugin::guardian::restore::RestoreTasks;
use criu_plugin::guardian::{Duty, Watched};
use cuda_ckpt_sys::Driver;

use super::executor::{Outcome, Plan, execute};
use super::step::{Step, needs_init};

bitflags::bitflags! {
    /// What the guardian does for a watched process (the `action` word of [`Watched`]).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Action: u32 {
        /// Restore the process if it is checkpointed.
        const RESTORE = 1;
        /// Unlock the process if it is locked.
        const UNLOCK = 2;
    }
}

impl Action {
    /// The action of a guardian's word (bits this side does not name are dropped).
    fn of(word: u32) -> Action {
        Action::from_bits_truncate(word)
    }
}

/// The dump's duty: put every watched process back as the dump found it.
pub struct PutBack<'a> {
    /// The run's driver (the guardian's copy of it).
    pub driver: &'a Driver,
}

/// The most time the guardian gives its put-backs: a driver call on a process that cannot answer
/// (stopped between the check and the call, say) must not keep the guardian, and the claims it
/// holds, for good.
const PUT_BACK_DEADLINE: Duration = Duration::from_secs(300);

impl Duty for PutBack<'_> {
    fn rescue(&mut self, watched: Vec<Watched>) {
        let driver = self.driver;
        // A watchdog ends the guardian, hung calls and all, at the deadline; its claims go with
        // it, so `criu-gpu resume` can take over.
        let pids: Vec<i32> = watched.iter().map(|w| w.pid).collect();
        let late = pids.clone();
        let _ = std::thread::Builder::new()
            .name("put-back-deadline".into())
            .spawn(move || {
                std::thread::sleep(PUT_BACK_DEADLINE);
                log::error!(
                    "guardian: putting back pid(s) {late:?} took longer than {} s; giving up: run `criu-gpu resume PID` for each",
                    PUT_BACK_DEADLINE.as_secs()
                );
                // SAFETY: ends the guardian's process at once; nothing of CRIU's runs here.
                unsafe { libc::_exit(2) }
            });
        let put_back_one = |w: &Watched| {
            // The driver cannot answer for a stopped process (its calls wait until it runs),
            // and a dead one has nothing to put back.
            match criu_plugin::proc::state(w.pid) {
                Some('T' | 't') => {
                    log::error!(
                        "guardian: pid {pid} is stopped and cannot be put back now; after `kill -CONT {pid}`, run `criu-gpu resume {pid}`",
                        pid = w.pid
                    );
                    return;
                }
                None | Some('Z' | 'X') => {
                    log::info!("guardian: pid {} ended; nothing to put back", w.pid);
                    return;
                }
                _ => {}
            }
            let step = Step::PutBack {
                unlock: Action::of(w.action).contains(Action::UNLOCK),
            };
            let mut r = step.run(driver, w.pid);
            if needs_init(&r) && driver.init().is_ok() {
                r = step.run(driver, w.pid);
            }
            match r {
                Ok(()) => log::warn!(
                    "guardian: pid {} put back as the dump found it (its GPU state restored)",
                    w.pid
                ),
                Err(e) => log::error!(
                    "guardian: pid {} could not be put back: {e}; run `criu-gpu resume {}`",
                    w.pid,
                    w.pid
                ),
            }
        };
        // Every process at once, each on a worker, a lone one too: the guardian's own thread
        // takes its signals.
        let plan = Plan::in_process(true).lone_on_worker();
        for (pid, answer, _) in execute(&pids, plan, &|k| put_back_one(&watched[k])) {
            if let Outcome::Panicked(message) = answer {
                log::error!("guardian: putting back pid {pid} panicked: {message}");
            }
        }
    }
}

/// What the NVIDIA side adds to the restore's duty ([`criu_plugin::guardian::restore`]): it
/// claims each task found ([`super::exclusive`]), so that a dump started while the restore runs
/// refuses the tree instead of dumping half-restored tasks as processes without CUDA; the
/// claims go once the tree has its GPU state.
#[derive(Default)]
pub struct ClaimTasks {
    claims: Vec<super::exclusive::Claim>,
    settled: bool,
}

/// The most tasks of a restore the guardian claims.
const MAX_CLAIMS: usize = 4096;

impl RestoreTasks for ClaimTasks {
    fn found(&mut self, pid: i32, start: u64) {
        if self.settled || self.claims.len() >= MAX_CLAIMS {
            return;
        }
        if let Ok(c) = super::exclusive::claim_as(pid, start, super::exclusive::Role::Guardian) {
            self.claims.push(c);
        }
    }

    fn settled(&mut self) {
        self.settled = true;
        self.claims.clear();
    }
}
