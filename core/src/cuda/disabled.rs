//! A restore with the NVIDIA side switched off (`disable = cuda`): nothing is restored onto a
//! GPU, but no restore reports success while a task it restored is a CUDA process left
//! checkpointed or locked, frozen for good behind "Restore finished successfully".
//!
//! CRIU itself refuses an image whose inventory lists `cuda_plugin` when no plugin claims
//! the name, as with the NVIDIA side off. What it cannot refuse is an image whose inventory
//! lost that list (or never had one), restored with the NVIDIA side off: its tasks come back
//! with their GPU state still inside their memory, checkpointed. A checkpointed process holds
//! no NVIDIA device (the checkpoint released it), so only the driver can tell: where this
//! machine has the driver, every restored task is asked about at `RESUME_DEVICES_LATE`, and
//! one that is a CUDA process not running fails the restore and ends the restored tree (CRIU
//! ignores the hook's answer; the image is kept for another try with the NVIDIA side on).
//! Without a driver nothing can be asked, and nothing is checked.

use std::collections::BTreeMap;
use std::time::Duration;

use criu_plugin::{HookError, HookResult};
use cuda_ckpt_sys::{Driver, DriverError, ProcessState};

use super::batch::{Batch, Timed};
use super::error::{Failure, FailureKind, Report};
use super::restore::{end_restored, list_pids, settle};
use super::settings::CudaSettings;
use super::{driver, procfs};

/// What a restored task is, that the NVIDIA side, switched off, cannot give its GPU state:
/// the middle of the message that fails the restore.
#[derive(Debug, thiserror::Error)]
enum Frozen {
    /// A CUDA process whose restore thread cannot be let run.
    #[error("a CUDA process whose restore thread {tid} cannot run ({source})")]
    Thread {
        /// The restore thread.
        tid: i32,
        /// Why.
        source: std::io::Error,
    },
    /// The driver cannot tell whether it is one.
    #[error("perhaps a CUDA process: the driver cannot tell ({0})")]
    Unknown(DriverError),
    /// A CUDA process not running.
    #[error("a CUDA process left {0}")]
    Left(ProcessState),
    /// A CUDA process whose state is not known.
    #[error("a CUDA process whose state cannot be had ({0})")]
    NoState(settle::StateError),
}

/// A restore the NVIDIA side is switched off for, watched for CUDA processes left frozen.
pub struct DisabledRestore {
    driver: Driver,
    parallel: bool,
    /// Where `disable` was set, for the message.
    origin: String,
    /// Answers by host pid, once the tree has been asked about at its root's call.
    results: Option<BTreeMap<i32, HookResult>>,
}

impl DisabledRestore {
    /// Prepares the check; `None` where this machine has no NVIDIA driver to ask.
    pub fn start(settings: &CudaSettings, origin: String) -> Option<DisabledRestore> {
        if !settings.nvidia_proc.is_dir() {
            return None;
        }
        let (driver, _) = driver::load(settings)
            .map_err(|e| {
                log::info!(
                    "cuda: disabled, and its driver cannot be asked about the restored tasks: {e}"
                )
            })
            .ok()?;
        log::info!(
            "cuda: disabled by settings ({origin}); the restored tasks are still checked for CUDA processes left checkpointed"
        );
        Some(DisabledRestore {
            driver,
            parallel: settings.parallel,
            origin,
            results: None,
        })
    }

    /// `RESUME_DEVICES_LATE`: the first call (the root's) asks about the whole tree.
    pub fn resume(&mut self, pid: i32) -> HookResult {
        let results = match &self.results {
            Some(r) => r,
            None => self
                .results
                .insert(check_tree(&self.driver, self.parallel, pid, &self.origin)),
        };
        results
            .get(&pid)
            .cloned()
            .unwrap_or(Err(HookError::NotMine))
    }
}

/// Asks the driver about every task of the tree at `root`: the answers of those that fail (and
/// of the root, when any fails), each failure logged, the tree ended.
fn check_tree(
    driver: &Driver,
    parallel: bool,
    root: i32,
    origin: &str,
) -> BTreeMap<i32, HookResult> {
    let tree = procfs::tree(root);
    let mut failed: BTreeMap<i32, Frozen> = BTreeMap::new();
    let mut batch = Batch::new(parallel);
    for &pid in &tree {
        match batch.restore_thread_id(driver, pid) {
            Ok(tid) => {
                if let Err(e) = batch.add(pid, tid) {
                    failed.insert(pid, Frozen::Thread { tid, source: e });
                }
            }
            Err(e) if driver::not_a_cuda_process(&e) => {}
            Err(e) => {
                failed.insert(pid, Frozen::Unknown(e));
            }
        }
    }
    let mut ran = batch.run(|pids, _| {
        settle::ask_states(driver, pids)
            .into_iter()
            .map(|(pid, a)| {
                let r = match a {
                    Ok(ProcessState::Running) => Ok(()),
                    Ok(s) => Err(Frozen::Left(s)),
                    Err(e) => Err(Frozen::NoState(e)),
                };
                (pid, r, Duration::ZERO)
            })
            .collect::<Vec<Timed<Frozen>>>()
    });
    ran.log_not_stopped();
    for (pid, r, _) in ran.results {
        if let Err(why) = r {
            failed.insert(pid, why);
        }
    }
    if failed.is_empty() {
        return BTreeMap::new();
    }
    let mut results = BTreeMap::new();
    for (pid, why) in &failed {
        let f = Failure::new(
            FailureKind::Settings,
            libc::EOPNOTSUPP,
            format!(
                "cuda: restored pid {pid} is {why}, but the NVIDIA side is disabled (`disable = cuda`, {origin}): its GPU state would not be given back and it would stay frozen behind a successful restore; remove cuda from `disable` and restore again"
            ),
        );
        results.insert(*pid, Err(f.report()));
    }
    let pids: Vec<i32> = failed.keys().copied().collect();
    results.entry(root).or_insert_with(|| {
        Err(Failure::new(
            FailureKind::Settings,
            libc::EOPNOTSUPP,
            format!(
                "cuda: the restored tree holds CUDA process(es) {} that cannot be given their GPU state with the NVIDIA side disabled",
                list_pids(&pids)
            ),
        )
        .into())
    });
    end_restored(&tree, &pids);
    results
}
