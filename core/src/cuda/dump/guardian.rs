//! The dump's guardian ([`super::super::guardian::PutBack`]): started before the first lock
//! (again if it died), told what undoes the dump's work on each process, and forgetting each
//! process the dump put back itself.

use criu_plugin::HookResult;
use criu_plugin::guardian::Guardian;

use super::super::error::{Failure, FailureKind};
use super::super::exclusive;
use super::super::guardian::{Action, PutBack};
use super::{DumpRun, FoundState, Locked};

impl DumpRun {
    /// Starts the guardian (once, or again if it died): no process is locked unless something
    /// outside CRIU will put it back should CRIU end before the dump does.
    pub(super) fn start_guardian(&mut self) -> HookResult {
        if let Some(g) = &self.guardian {
            if g.stopped() {
                return Err(Failure::new(
                    FailureKind::System,
                    libc::EAGAIN,
                    format!(
                        "cuda: the guardian process {pid} that puts CUDA processes back should CRIU end early is stopped; nothing more is locked until it runs again (`kill -CONT {pid}`)",
                        pid = g.pid()
                    ),
                ).into());
            }
            if g.alive() {
                return Ok(());
            }
            // Killed (the OOM killer, say): the dump goes on under a new one, told of every
            // process the first one looked after.
            log::warn!(
                "cuda: the guardian process {} that puts CUDA processes back should CRIU end early is gone (killed?); starting another",
                g.pid()
            );
            self.guardian = None;
        }
        if self.unguarded {
            return Ok(());
        }
        match Guardian::spawn(PutBack {
            driver: &self.driver,
        }) {
            Ok(g) => {
                log::info!("cuda: guardian {} started", g.pid());
                for (&pid, &(start, action)) in &self.watches {
                    let claim = self.claims.get(&pid).and_then(exclusive::Claim::fd);
                    if let Err(e) = g.watch(pid, start, action, claim) {
                        log::warn!("cuda: pid {pid}: the new guardian was not told of it: {e}");
                    }
                }
                self.guardian = Some(g);
                let watched: Vec<i32> = self.watches.keys().copied().collect();
                for pid in watched {
                    self.record_guardian(pid);
                }
                Ok(())
            }
            // Kernels before 5.3 have no pidfds; CRIU the init of its pid namespace: such a dump
            // runs as before, unguarded.
            Err(e) if criu_plugin::guardian::unavailable_here(&e) => {
                log::warn!(
                    "cuda: no guardian can run here ({e}), so processes stay locked or checkpointed should CRIU be killed in the middle of this dump"
                );
                self.unguarded = true;
                Ok(())
            }
            Err(e) => Err(Failure::new(
                FailureKind::System,
                e.raw_os_error().unwrap_or(libc::EIO),
                format!(
                    "cuda: cannot start the guardian process that puts CUDA processes back should CRIU end early ({e}); nothing is locked without it"
                ),
            ).into()),
        }
    }

    /// Tells the guardian what undoes the dump's work on `pid` (with the claim, which it then
    /// holds too, and is recorded as holding), once the lock helper said how it found the
    /// process.
    pub(super) fn watch(&mut self, pid: i32, start: Option<u64>, locked: &Locked) {
        let (Some(g), Some(start)) = (&self.guardian, start) else {
            return;
        };
        let action = match (locked.found, locked.locked_by_us) {
            (_, true) => Action::RESTORE | Action::UNLOCK,
            // Checkpointed by this dump, left locked by whoever locked it.
            (FoundState::Locked, false) => Action::RESTORE,
            _ => return,
        };
        self.watches.insert(pid, (start, action.bits()));
        let claim = self.claims.get(&pid).and_then(exclusive::Claim::fd);
        match g.watch(pid, start, action.bits(), claim) {
            Ok(()) => self.record_guardian(pid),
            Err(e) => log::warn!("cuda: pid {pid}: the guardian was not told of it: {e}"),
        }
    }

    /// Tells the guardian that `pid` needs nothing more from it.
    pub(super) fn forget(&mut self, pid: i32) {
        self.watches.remove(&pid);
        if let Some(g) = &self.guardian {
            let _ = g.forget(pid);
        }
    }
}
