//! Driver and NVML calls made in a helper process ([`criu_plugin::child`]) instead of CRIU's.
//!
//! Three kinds of call must not run in CRIU's process, which has to stay single-threaded:
//!
//! - NVML: `nvmlInit_v2` starts a thread that `nvmlShutdown` leaves running;
//! - `cuInit`, which a restore needs when persistence mode is off: it starts libcuda's threads;
//! - calls that may never return (the state query and the lock wait for the target's restore
//!   thread): a hung helper is killed at its deadline, a hung thread could never be.
//!
//! Each request is an [`Op`], run in the helper ([`Op::serve`]); its [`Reply`] travels back in
//! the one encoding of [`protocol`], read back with bounds on every length. The calls are made
//! by the one executor ([`execute`]), its workers left behind by the helper's `_exit`.

mod protocol;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criu_plugin::child::{self, ChildError};
use cuda_ckpt_sys::{Driver, DriverError, GpuUuid, ProcessState};

use super::error::CallError;
use super::executor::{Outcome, Plan, execute};
use super::library::{LibraryError, library};
use super::nvml::{self, GpuMemory};
use super::step::{Step, Timed};
pub use protocol::StateAnswer;
use protocol::{MAX_REPLY, Malformed, NvmlFailed, Reply};

/// How long an NVML query may take before it is given up (the free-memory check is then
/// skipped, as without NVML).
pub const NVML_DEADLINE: Duration = Duration::from_secs(15);

/// What a helper process is asked to do.
pub enum Op<'a> {
    /// NVML's memory figures for `uuids`, from library `nvml`.
    Memory {
        /// The NVML library setting.
        nvml: &'a str,
        /// The GPUs asked about.
        uuids: &'a [GpuUuid],
    },
    /// `pid`'s state and, when it runs, a lock with `timeout_ms` once `announce` says the
    /// guardian knows of it.
    StateAndLock {
        /// The driver.
        driver: &'a Driver,
        /// The process.
        pid: i32,
        /// The lock timeout, of which the state query's time is taken off.
        timeout_ms: u32,
        /// Tells the guardian of the process; `false`: it could not, and nothing is locked.
        announce: &'a dyn Fn() -> bool,
    },
    /// Unlocks `pid` when it is locked.
    UnlockIfLocked {
        /// The driver.
        driver: &'a Driver,
        /// The process.
        pid: i32,
    },
    /// Each of `pids`'s state, waiting at most `wait` for the answers.
    States {
        /// The driver.
        driver: &'a Driver,
        /// The processes.
        pids: &'a [i32],
        /// How long the answers are waited for.
        wait: Duration,
    },
    /// Each step on its process (after `cuInit` when `init`), all at once when `parallel`.
    Steps {
        /// The driver.
        driver: &'a Driver,
        /// The processes and their steps.
        steps: &'a [(i32, Step<'a>)],
        /// All at once, else one after another.
        parallel: bool,
        /// Call `cuInit` first.
        init: bool,
    },
}

impl Op<'_> {
    /// Inside the helper: does what is asked.
    fn serve(&self) -> Reply {
        match *self {
            Op::Memory { nvml, uuids } => Reply::Memory(
                nvml::query_memory(nvml, uuids)
                    .map(|m| m.into_iter().collect())
                    .map_err(|e| NvmlFailed(e.to_string())),
            ),
            Op::StateAndLock {
                driver,
                pid,
                timeout_ms,
                announce,
            } => {
                let t = Instant::now();
                let state = driver.process_state(pid);
                let lock = match state {
                    Ok(ProcessState::Running) => {
                        // What is left of the timeout after the state query: the lock must
                        // end before the parent's deadline, never after the helper is gone.
                        let spent = t.elapsed().as_millis().min(u128::from(u32::MAX)) as u32;
                        let left = timeout_ms.saturating_sub(spent).max(1);
                        Some(if announce() {
                            Step::Lock { timeout_ms: left }.run(driver, pid)
                        } else {
                            Err(CallError::Helper(format!(
                                "pid {pid} is not locked: the guardian that would put it back could not be told of it"
                            )))
                        })
                    }
                    _ => None,
                };
                Reply::StateAndLock {
                    state,
                    lock,
                    in_driver: t.elapsed(),
                }
            }
            Op::UnlockIfLocked { driver, pid } => {
                Reply::UnlockIfLocked(match driver.process_state(pid) {
                    Ok(ProcessState::Locked) => driver.unlock(pid).map(|()| true),
                    Ok(_) => Ok(false),
                    Err(e) => Err(e),
                })
            }
            Op::States { driver, pids, wait } => {
                // SAFETY: `serve` runs in the helper, which `_exit`s after its reply; `pids` and
                // `driver` live in the frames of the callers of `child::run`, which the helper
                // never returns into, and the query is leaked below.
                let plan = unsafe { Plan::in_helper(true) }.unwatched().within(wait);
                // A dead task's query is answered by the driver or not at all: unwatched, so
                // that a query that never returns reads as no answer within `wait`.
                // Leaked: a worker stuck in the driver outlives this frame (not the process).
                let query = Box::leak(Box::new(move |k: usize| driver.process_state(pids[k])));
                let ran = execute(pids, plan, query);
                Reply::States(
                    ran.into_iter()
                        .map(|(pid, a, _)| match a {
                            Outcome::Returned(r) => (pid, Some(r)),
                            _ => (pid, None),
                        })
                        .collect(),
                )
            }
            Op::Steps {
                driver,
                steps,
                parallel,
                init,
            } => Reply::Steps(if init { driver.init() } else { Ok(()) }.map(|()| {
                // Leaked: a worker stuck in the driver outlives this frame (not the process).
                let pids: &[i32] = Vec::leak(steps.iter().map(|s| s.0).collect());
                let step = Box::leak(Box::new(move |k: usize| steps[k].1.run(driver, steps[k].0)));
                // SAFETY: `serve` runs in the helper, which `_exit`s after its reply; `pids` and
                // `step` are leaked, the rest they borrow lives in the frames of the callers of
                // `child::run`, which the helper never returns into.
                let plan = unsafe { Plan::in_helper(parallel) };
                let ran = execute(pids, plan, step);
                ran.into_iter()
                    .map(|(pid, a, took)| (pid, step_result(pid, a), took))
                    .collect()
            })),
        }
    }

    /// Runs the operation in a helper process killed after `deadline`, and reads its reply.
    fn ask(&self, deadline: Duration) -> Result<Reply, ChildError> {
        let bytes = child::run(deadline, MAX_REPLY, || protocol::encode(&self.serve()))?;
        protocol::decode(&bytes).map_err(malformed)
    }
}

/// A step's result as the helper reports it: a target that ended mid-call is the process's
/// failure, not the driver's.
fn step_result(pid: i32, a: Outcome<Result<(), CallError>>) -> Result<(), CallError> {
    match a {
        Outcome::Returned(r) => r,
        Outcome::Panicked(message) => Err(CallError::Panic { pid, message }),
        Outcome::Ended => Err(CallError::Process(format!(
            "pid {pid} ended while the driver was working on it"
        ))),
        Outcome::NoAnswer => Err(CallError::Helper(
            "the driver helper had no thread to call the driver".into(),
        )),
    }
}

fn malformed(e: Malformed) -> ChildError {
    ChildError::NoReply(format!("answered malformed data ({e})"))
}

/// Why NVML's memory figures could not be had.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The `nvml` setting names a library that may not be loaded.
    #[error("nvml = {lib}: {source}")]
    Library {
        /// The setting.
        lib: String,
        /// Why.
        source: LibraryError,
    },
    /// The helper process gave no answer.
    #[error("NVML: {0}")]
    Helper(ChildError),
    /// NVML's own answer, from the helper.
    #[error(transparent)]
    Nvml(NvmlFailed),
}

/// NVML's memory figures for `uuids`, asked in a helper process.
pub fn query_memory(
    lib: &str,
    uuids: &[GpuUuid],
) -> Result<BTreeMap<GpuUuid, GpuMemory>, MemoryError> {
    library(lib).map_err(|source| MemoryError::Library {
        lib: lib.to_string(),
        source,
    })?;
    match (Op::Memory { nvml: lib, uuids }).ask(NVML_DEADLINE) {
        Ok(Reply::Memory(m)) => m
            .map(|v| v.into_iter().collect())
            .map_err(MemoryError::Nvml),
        Ok(_) => Err(MemoryError::Helper(malformed(Malformed::Unexpected))),
        Err(e) => Err(MemoryError::Helper(e)),
    }
}

/// What a pause helper found and did.
#[derive(Debug)]
pub struct LockOutcome {
    /// The process's state before anything was done.
    pub state: Result<ProcessState, DriverError>,
    /// The lock's result, when the process was running and a lock was asked for.
    pub lock: Option<Result<(), CallError>>,
    /// Time spent in the driver inside the helper (the rest of the call is the helper's cost).
    pub in_driver: Duration,
}

/// Asks for `pid`'s state and, when it runs, locks it with `timeout_ms`, in a helper killed
/// after `deadline`. The helper calls `announce` just before it asks for the lock (the
/// guardian learns of the process there: a CRIU killed during the lock is covered); when
/// `announce` says it could not, the process is not locked.
pub fn state_and_lock(
    driver: &Driver,
    pid: i32,
    timeout_ms: u32,
    deadline: Duration,
    announce: &dyn Fn() -> bool,
) -> Result<LockOutcome, ChildError> {
    let op = Op::StateAndLock {
        driver,
        pid,
        timeout_ms,
        announce,
    };
    match op.ask(deadline)? {
        Reply::StateAndLock {
            state,
            lock,
            in_driver,
        } => Ok(LockOutcome {
            state,
            lock,
            in_driver,
        }),
        _ => Err(malformed(Malformed::Unexpected)),
    }
}

/// Unlocks `pid` if it is locked, in a helper killed after `deadline`: for a process whose
/// lock the plugin gave up waiting for, which may have completed since. `Ok(true)` when it
/// was locked and is now unlocked.
pub fn unlock_if_locked(
    driver: &Driver,
    pid: i32,
    deadline: Duration,
) -> Result<bool, UnlockError> {
    match (Op::UnlockIfLocked { driver, pid }).ask(deadline)? {
        Reply::UnlockIfLocked(r) => Ok(r?),
        _ => Err(malformed(Malformed::Unexpected).into()),
    }
}

/// Why [`unlock_if_locked`] could not tell or unlock.
#[derive(Debug, thiserror::Error)]
pub enum UnlockError {
    /// The driver's answer.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The helper process gave no answer.
    #[error(transparent)]
    Helper(#[from] ChildError),
}

/// The state of each of `pids`, asked from one helper process with each query on its own
/// thread there, so that a target that never answers costs only its own answer: what has not
/// answered within `wait` comes back as `None`. The helper is killed shortly after `wait`.
pub fn process_states(
    driver: &Driver,
    pids: &[i32],
    wait: Duration,
) -> Result<Vec<(i32, StateAnswer)>, ChildError> {
    match (Op::States { driver, pids, wait }).ask(wait + Duration::from_secs(2))? {
        Reply::States(v) => Ok(v),
        _ => Err(malformed(Malformed::Unexpected)),
    }
}

/// Makes each step on its process in a helper process killed after `deadline` (after `cuInit`
/// when `init`, as the driver requires of a restoring process when persistence mode is off):
/// each call on a thread of the helper's, all at once when `parallel`, else one after another.
/// A driver call waits for the target's restore thread, and a target that dies meanwhile may
/// never answer: the helper watches each target through a pidfd and answers for one that
/// ended at once, so a task killed in the middle of a dump costs a failed call, not a CRIU
/// that hangs. A `cuInit` that fails fails every step.
pub fn each_in_helper(
    driver: &Driver,
    steps: &[(i32, Step<'_>)],
    parallel: bool,
    init: bool,
    deadline: Duration,
) -> Result<Vec<Timed>, ChildError> {
    let op = Op::Steps {
        driver,
        steps,
        parallel,
        init,
    };
    match op.ask(deadline)? {
        Reply::Steps(Ok(v)) => Ok(v),
        Reply::Steps(Err(e)) => Ok(steps
            .iter()
            .map(|&(pid, _)| (pid, Err(CallError::from(e.clone())), Duration::ZERO))
            .collect()),
        _ => Err(malformed(Malformed::Unexpected)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_that_cannot_load_is_reported_from_the_helper() {
        let e = query_memory("/nonexistent/libnvidia-ml.so.1", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be loaded"), "{e}");
    }
}
