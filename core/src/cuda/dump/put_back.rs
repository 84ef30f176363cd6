//! Putting processes back as the dump found them: after a failed dump, or when the tasks run
//! on (`--leave-running`, `DUMP_FINISH` with an error), every process the dump locked or
//! checkpointed is restored and unlocked again, and a lock given up on is undone should it
//! have completed since.

use super::super::batch::{Batch, Ran, ms, restore_each};
use super::super::helper;
use super::super::procfs;
use super::super::step::{Step, check_put_back};
use super::{DumpRun, LOCK_GRACE};

impl DumpRun {
    /// Puts every process touched during the dump back as it was found.
    /// Returns how many processes could not be put back. Those put back are forgotten as
    /// touched, so that a second call (`DUMP_FINISH` twice, then `exit`) does nothing more.
    pub(super) fn put_back_all(&mut self) -> usize {
        let touched: Vec<(i32, bool)> = self
            .dumped
            .values()
            .filter(|p| p.locked_by_us || p.checkpointed_by_us)
            .map(|p| (p.pid, p.locked_by_us))
            .collect();
        if touched.is_empty() {
            return 0;
        }
        let mut batch = Batch::new(self.settings.parallel);
        let mut steps = Vec::with_capacity(touched.len());
        for &(pid, unlock) in &touched {
            let Some(tid) = self.dumped.get(&pid).map(|p| p.restore_tid) else {
                continue;
            };
            match batch.add(pid, tid) {
                Ok(()) => steps.push((pid, Step::PutBack { unlock })),
                Err(e) => log::error!(
                    "cuda: pid {pid}: cannot let restore thread {tid} run to put it back: {e}"
                ),
            }
        }
        let driver = &self.driver;
        let mut ran = batch.run(|_, parallel| {
            restore_each(driver, &steps, parallel, |pid, s| {
                check_put_back(driver, pid, matches!(s, Step::PutBack { unlock: true }))
            })
        });
        ran.log_not_stopped();
        let Ran { results, phase, .. } = ran;
        let mut failed = touched.len() - steps.len();
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
