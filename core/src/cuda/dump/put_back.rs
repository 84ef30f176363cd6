//! Putting processes back as the dump found them: after a failed dump, or when the tasks run
//! on (`--leave-running`, `DUMP_FINISH` with an error), every process the dump locked or
//! checkpointed is restored and unlocked again, and a lock given up on is undone should it
//! have completed since.

use cuda_ckpt_sys::{Driver, ProcessState};

use super::super::batch::{Batch, Ran, ms, restore_each};
use super::super::error::CallError;
use super::super::helper::{self, RestoreJob};
use super::super::procfs;
use super::{DumpRun, LOCK_GRACE};

impl DumpRun {
    /// Puts every process touched during the dump back as it was found.
    /// Returns how many processes could not be put back. Those put back are forgotten as
    /// touched, so that a second call (`DUMP_FINISH` twice, then `exit`) does nothing more.
    pub(super) fn put_back_all(&mut self) -> usize {
        let touched: Vec<RestoreJob> = self
            .dumped
            .values()
            .filter(|p| p.locked_by_us || p.checkpointed_by_us)
            .map(|p| RestoreJob {
                pid: p.pid,
                unlock: p.locked_by_us,
            })
            .collect();
        if touched.is_empty() {
            return 0;
        }
        let mut batch = Batch::new(self.settings.parallel);
        let mut jobs = Vec::with_capacity(touched.len());
        for job in &touched {
            let Some(tid) = self.dumped.get(&job.pid).map(|p| p.restore_tid) else {
                continue;
            };
            match batch.add(job.pid, tid) {
                Ok(()) => jobs.push(*job),
                Err(e) => log::error!(
                    "cuda: pid {}: cannot let restore thread {tid} run to put it back: {e}",
                    job.pid
                ),
            }
        }
        let driver = &self.driver;
        let mut ran = batch.run(|_, parallel| {
            restore_each(
                driver,
                &jobs,
                &[],
                parallel,
                |j| put_back(driver, j.pid, j.unlock),
                |j| check_put_back(driver, j.pid, j.unlock),
            )
        });
        ran.log_not_stopped();
        let Ran { results, phase, .. } = ran;
        let mut failed = touched.len() - jobs.len();
        for (pid, r, took) in results {
            match r {
                Ok(()) => {
                    let Some(p) = self.dumped.get_mut(&pid) else {
                        continue;
                    };
                    log::info!(
                        "cuda: pid {pid}: back to {} in {:.1} ms",
                        p.found.as_str(),
                        ms(took)
                    );
                    p.locked_by_us = false;
                    p.checkpointed_by_us = false;
                    self.forget(pid);
                }
                Err(e) => {
                    failed += 1;
                    log::error!("cuda: pid {pid}: could not be put back as found: {e}");
                }
            }
        }
        phase.log("put-back");
        failed
    }

    /// Unlocks the processes whose lock was abandoned, should the lock have completed since.
    /// Returns how many could not be checked (the guardian tries again once CRIU ends).
    pub(super) fn release_abandoned_locks(&mut self) -> usize {
        let mut unsettled = 0;
        for (pid, start) in std::mem::take(&mut self.abandoned_locks) {
            // The pid may belong to another process by now: leave that one alone.
            if start.is_none() || procfs::start_time(pid) != start {
                log::debug!("cuda: pid {pid}: ended since its lock was given up on");
                continue;
            }
            match helper::unlock_if_locked(&self.driver, pid, LOCK_GRACE) {
                Ok(true) => log::info!(
                    "cuda: pid {pid}: the lock given up on had completed; unlocked again"
                ),
                Ok(false) => log::debug!("cuda: pid {pid}: not locked after the abandoned lock"),
                Err(e) => {
                    log::error!(
                        "cuda: pid {pid}: cannot check whether the abandoned lock completed ({e}); the guardian checks again once CRIU ends"
                    );
                    unsettled += 1;
                    continue;
                }
            }
            if !self.dumped.contains_key(&pid) {
                self.forget(pid);
            }
        }
        unsettled
    }
}

/// Puts one process back as the dump found it: restore if checkpointed, unlock if we locked it.
/// A restore the driver refuses for want of `cuInit` is returned as is, for [`restore_each`] to
/// redo from a helper process and then to check with [`check_put_back`].
pub fn put_back(driver: &Driver, pid: i32, unlock: bool) -> Result<(), CallError> {
    if driver.process_state(pid)? == ProcessState::Checkpointed {
        driver.restore(pid, &[])?;
    }
    if unlock && driver.process_state(pid)? == ProcessState::Locked {
        driver.unlock(pid)?;
    }
    check_put_back(driver, pid, unlock)
}

/// Checks that a process put back is in the state the dump found it in.
pub fn check_put_back(driver: &Driver, pid: i32, unlock: bool) -> Result<(), CallError> {
    let end = driver.process_state(pid)?;
    let expected = if unlock {
        ProcessState::Running
    } else {
        ProcessState::Locked
    };
    if end != expected {
        return Err(CallError::Process(format!(
            "pid {pid} is {end} after being put back, not {expected}"
        )));
    }
    Ok(())
}
