//! The restore's guardian ([`criu_plugin::guardian::restore`]): started at `init`, told of the
//! root task from `POST_FORKING` and before any GPU work, and that the tree has its GPU state
//! once it has.

use criu_plugin::HookResult;
use criu_plugin::guardian::Guardian;
use criu_plugin::guardian::forks::{CriuForks, ForkMarker};
use criu_plugin::guardian::restore::{EndRestore, Watch};

use super::super::error::{Failure, FailureKind};
use super::super::{image, procfs};

/// The restore's guardian, with the marker its CRIU's forks inherit (mapped in CRIU's process
/// for the whole run: forks made after it was unmapped would not carry it).
pub(super) struct RestoreGuardian {
    pub(super) guardian: Guardian,
    forks: CriuForks,
    _marker: Option<ForkMarker>,
}

impl RestoreGuardian {
    /// Starts the restore's guardian: should CRIU end before the tasks have their GPU state
    /// back, it kills what CRIU forked. Its pid must not be one the restore needs (CRIU gives
    /// the tasks the image's pids when they share its pid namespace).
    pub(super) fn spawn() -> HookResult<Option<RestoreGuardian>> {
        let marker = match ForkMarker::create() {
            Ok(m) => Some(m),
            Err(e) => {
                log::warn!(
                    "cuda: cannot map the marker that tells this CRIU's forks apart ({e}); a restore cut short before the guardian saw its tasks may leave them behind"
                );
                None
            }
        };
        let forks = CriuForks::of_this_process(marker.as_ref());
        let wanted: Vec<u32> = image::image_dir()
            .and_then(|d| criu_plugin::pstree::read_pids(d).ok())
            .unwrap_or_default();
        let mut last = None;
        for _ in 0..8 {
            let duty =
                EndRestore::new(forks.clone(), super::super::guardian::ClaimTasks::default());
            match Guardian::spawn(duty) {
                Ok(g) if wanted.contains(&(g.pid() as u32)) => {
                    g.release();
                }
                Ok(g) => {
                    log::debug!("cuda: restore guardian {} started", g.pid());
                    return Ok(Some(RestoreGuardian {
                        guardian: g,
                        forks,
                        _marker: marker,
                    }));
                }
                // Kernels before 5.3 have no pidfds: the restore runs as before, unguarded.
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    log::warn!(
                        "cuda: this kernel has no pidfd_open ({e}): no guardian, so a restore cut short may leave its tasks behind"
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
        Err(Failure::new(
            FailureKind::System,
            libc::EAGAIN,
            format!(
                "cuda: cannot start the guardian process that ends a cut-short restore ({why}); the restore is refused"
            ),
        ).into())
    }

    /// Tells the guardian of every root task CRIU has forked so far.
    pub(super) fn announce_roots(&self) {
        let guardian = self.guardian.pid();
        for (pid, _) in self.forks.roots(&|p| p == guardian) {
            self.watch_root(pid, Watch::EndTree);
        }
    }

    /// Tells the guardian what to do with the tree of `root` should CRIU end.
    pub(super) fn watch_root(&self, root: i32, what: Watch) {
        if !self.guardian.alive() || self.guardian.stopped() {
            log::warn!(
                "cuda: the restore's guardian (pid {}) is {}: should CRIU end now, nothing ends the tree of pid {root}",
                self.guardian.pid(),
                if self.guardian.alive() {
                    "stopped"
                } else {
                    "gone"
                }
            );
        }
        let Some(start) = procfs::start_time(root) else {
            return;
        };
        if let Err(e) = self.guardian.watch(root, start, what as u32, None) {
            log::warn!("cuda: the restore's guardian was not told of pid {root}: {e}");
        }
    }
}
