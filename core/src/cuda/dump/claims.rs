//! The dump's claims on the processes it dumps ([`super::super::exclusive`]): taken before the
//! driver is asked anything, the guardian recorded as a holder once it has its copy, and a
//! claim that cannot be made said once per run in CRIU's log.

use criu_plugin::HookResult;

use super::super::error::{Failure, FailureKind};
use super::super::exclusive::{self, ClaimError, Holder};
use super::super::procfs;
use super::DumpRun;

/// How the claim on one process went.
pub(super) enum Claimed {
    /// Claimed (or nothing to claim: the process is gone); its start time, if it has one.
    Yes(Option<u64>),
    /// No claim can be made on this machine (why): the process is dumped only if it turns out
    /// not to use CUDA.
    Impossible(u64, String),
}

impl DumpRun {
    /// Claims `pid` for this dump; refuses it while someone else holds it.
    pub(super) fn claim(&mut self, pid: i32) -> HookResult<Claimed> {
        let Some(start) = procfs::start_time(pid) else {
            return Ok(Claimed::Yes(None));
        };
        // Already ours (CRIU asks again after a failed seize).
        if self.claims.contains_key(&pid) {
            return Ok(Claimed::Yes(Some(start)));
        }
        match exclusive::claim(pid, start) {
            Ok(c) => {
                if let Some(p) = c.fallback_from() {
                    self.warn_once(format!(
                        "cuda: claims cannot be taken in {p}; they are taken in {} instead, where criu-gpu and other CRIUs look too",
                        exclusive::FALLBACK_DIR
                    ));
                }
                self.claims.insert(pid, c);
                Ok(Claimed::Yes(Some(start)))
            }
            Err(ClaimError::Busy(held)) => Err(Failure::new(
                FailureKind::Process,
                libc::EBUSY,
                format!("cuda: pid {pid} {}", held.describe(pid)),
            )
            .into()),
            Err(ClaimError::Unavailable(problems)) => {
                let why = ClaimError::problems(&problems);
                self.warn_once(format!(
                    "cuda: no claim can be taken ({why}): CUDA processes are refused by this dump, which could otherwise race criu-gpu or another CRIU acting on them"
                ));
                Ok(Claimed::Impossible(start, why))
            }
        }
    }

    /// Adds the guardian to the record of the claim on `pid` once it holds a copy of it.
    pub(super) fn record_guardian(&mut self, pid: i32) {
        let Some(g) = self
            .guardian
            .as_ref()
            .and_then(|g| Holder::guardian(g.pid()))
        else {
            return;
        };
        if let Some(c) = self.claims.get_mut(&pid)
            && let Err(e) = c.record_holder(g)
        {
            log::debug!(
                "cuda: pid {pid}: guardian {} not recorded as a holder ({e})",
                g.pid
            );
        }
    }

    fn warn_once(&mut self, message: String) {
        if !self.claims_warned {
            self.claims_warned = true;
            log::warn!("{message}");
        }
    }
}

/// The failure of a CUDA process that could not be claimed.
pub(super) fn refuse_unclaimed(pid: i32, why: &str) -> Failure {
    Failure::new(
        FailureKind::System,
        libc::ENOLCK,
        format!(
            "cuda: pid {pid} uses CUDA but cannot be claimed ({why}): dumped unclaimed it could be changed by criu-gpu or another CRIU at the same time, so the dump is refused; make {} (or {}) a writable directory of root's",
            exclusive::LOCK_DIR,
            exclusive::FALLBACK_DIR
        ),
    )
}
