//! A restore's guardian for any GPU vendor: the vendor-neutral duty of
//! [`criu_plugin::guardian::restore`] (should CRIU end before the restored tree has its GPU
//! state back, every task this CRIU forked is ended, whole trees), with the marker CRIU's forks
//! inherit, started before CRIU forks anything and told of the tree's root and of the moment
//! the tree has its GPU state.
//!
//! A backend starts one per restore that needs it ([`RestoreGuardian::spawn`], before CRIU
//! forks the tasks), announces the root tasks once they exist ([`RestoreGuardian::announce_roots`]
//! at `POST_FORKING`, and [`RestoreGuardian::watch_root`] before any GPU work at
//! `RESUME_DEVICES_LATE`), says when the tree has its GPU state ([`Watch::Settled`]), and
//! releases it when the restore succeeded ([`RestoreGuardian::release`]).

use criu_plugin::guardian::Guardian;
use criu_plugin::guardian::forks::{CriuForks, ForkMarker};
use criu_plugin::guardian::restore::{EndRestore, RestoreTasks};

pub use criu_plugin::guardian::restore::Watch;

/// Why a restore's guardian could not start; the restore is then refused.
#[derive(Debug, thiserror::Error)]
#[error(
    "{vendor}: cannot start the guardian process that ends a cut-short restore ({why}); the restore is refused"
)]
pub struct GuardianStartError {
    /// The backend whose restore it is.
    pub vendor: &'static str,
    /// The last spawn's error, or that every try took a pid the restore needs.
    pub why: String,
}

/// The restore's guardian, with the marker its CRIU's forks inherit until CRIU's restorer
/// unmaps it in them ([`criu_plugin::criu_internals::RESTORER_UNMAPS_CRIU_MEMORY`]); mapped in
/// CRIU's process for the whole run: forks made after it was unmapped would not carry it.
pub struct RestoreGuardian {
    vendor: &'static str,
    guardian: Guardian,
    forks: CriuForks,
    _marker: Option<ForkMarker>,
}

impl RestoreGuardian {
    /// Starts the guardian (in CRIU's process, before it forks the restore's tasks), doing
    /// what `tasks` makes beside ending them; `vendor` prefixes its messages. Its pid is never one of
    /// `image_pids` (CRIU gives the tasks the image's pids when they share its pid namespace).
    /// `Ok(None)`: this kernel has no pidfds, the restore runs unguarded (warned). An error:
    /// the guardian cannot start, and the restore must be refused.
    pub fn spawn<T: RestoreTasks>(
        vendor: &'static str,
        image_pids: &[u32],
        tasks: impl Fn() -> T,
    ) -> Result<Option<RestoreGuardian>, GuardianStartError> {
        let marker = match ForkMarker::create() {
            Ok(m) => Some(m),
            Err(e) => {
                log::warn!(
                    "{vendor}: cannot map the marker that tells this CRIU's forks apart ({e}); a restore cut short before the guardian saw its tasks may leave them behind"
                );
                None
            }
        };
        let forks = CriuForks::of_this_process(marker.as_ref());
        let mut last = None;
        for _ in 0..8 {
            match Guardian::spawn(EndRestore::new(forks.clone(), tasks())) {
                Ok(g) if image_pids.contains(&(g.pid() as u32)) => g.release(),
                Ok(g) => {
                    log::debug!("{vendor}: restore guardian {} started", g.pid());
                    return Ok(Some(RestoreGuardian {
                        vendor,
                        guardian: g,
                        forks,
                        _marker: marker,
                    }));
                }
                // Kernels before 5.3 have no pidfds; CRIU the init of its pid namespace (which
                // takes the restored tree with it when it ends): unguarded.
                Err(e) if criu_plugin::guardian::unavailable_here(&e) => {
                    log::warn!(
                        "{vendor}: no guardian can run here ({e}), so a restore cut short may leave its tasks behind"
                    );
                    return Ok(None);
                }
                Err(e) => last = Some(e),
            }
        }
        let why = last.map_or_else(
            || "every try took a pid the restore needs".to_string(),
            |e| e.to_string(),
        );
        Err(GuardianStartError { vendor, why })
    }

    /// Tells the guardian of every root task CRIU has forked so far.
    pub fn announce_roots(&self) {
        let guardian = self.guardian.pid();
        for (pid, _) in self.forks.roots(&|p| p == guardian) {
            self.watch_root(pid, Watch::EndTree);
        }
    }

    /// Tells the guardian what to do with the tree of `root` should CRIU end.
    pub fn watch_root(&self, root: i32, what: Watch) {
        if !self.guardian.alive() || self.guardian.stopped() {
            log::warn!(
                "{}: the restore's guardian (pid {}) is {}: should CRIU end now, nothing ends the tree of pid {root}",
                self.vendor,
                self.guardian.pid(),
                if self.guardian.alive() {
                    "stopped"
                } else {
                    "gone"
                }
            );
        }
        let Some(start) = criu_plugin::proc::start_time(root) else {
            return;
        };
        if let Err(e) = self.guardian.watch(root, start, what as u32, None) {
            log::warn!(
                "{}: the restore's guardian was not told of pid {root}: {e}",
                self.vendor
            );
        }
    }

    /// The restore succeeded: nothing is left for the guardian.
    pub fn release(self) {
        self.guardian.release();
    }
}
