//! The last step of a restore: every restored task the driver knows as a CUDA process is asked
//! for its state and brought to running with its GPU state, whatever the image says of it.
//!
//! The driver, not the image, decides what a task needs: a checkpointed task is restored and
//! unlocked, a locked one unlocked, a running one left alone, and any other state (or no
//! answer) fails the restore. The image's metadata only names the tasks that must be CUDA
//! processes; a record can be missing or edited (a truncated or tampered file), and a task left
//! checkpointed or locked behind "Restore finished successfully" is a process frozen for good.
//!
//! A record's `locked`/`checkpointed` (someone else had locked or checkpointed the process when
//! it was dumped) is not honoured either: whoever did that acts on the old process, not on this
//! new one, and nothing would ever unlock it. Such tasks are given their GPU state back and
//! unlocked, as CRIU's C plugin does, with a WARN naming them.

use std::collections::BTreeMap;
use std::time::Duration;

use criu_plugin::{HookError, HookResult};
use cuda_ckpt_sys::{Driver, DriverError, GpuPair, ProcessState};

use super::super::batch::{Batch, restore_each};
use super::super::driver::not_a_cuda_process;
use super::super::error::{CallError, Cause, Failure, FailureKind, Report, call_failure};
use super::super::helper;
use super::super::metadata::FoundState;
use super::super::step::{Step, Timed, ms};

/// How long the state query may wait for each target (the driver answers through the
/// target's own restore thread, which may never answer).
const STATE_WAIT: Duration = Duration::from_secs(10);

/// One restored task to settle: its host pid and, when the image records it, the state it was
/// found in at dump.
#[derive(Clone, Copy, Debug)]
pub(super) struct Task {
    pub pid: i32,
    pub record: Option<FoundState>,
}

/// What one task needs, from the driver's answer.
enum Need {
    Restore,
    Unlock,
    Nothing,
}

/// Settles `tasks`: the answer for every CUDA task (already logged when it is a failure);
/// tasks the driver knows no CUDA in are left out, unless recorded (a failure then).
pub(super) fn settle(
    driver: &Driver,
    tasks: &[Task],
    gpu_map: &[GpuPair],
    parallel: bool,
) -> BTreeMap<i32, HookResult> {
    let mut results = BTreeMap::new();
    let mut batch = Batch::new(parallel);
    let mut added = 0usize;
    for t in tasks {
        let pid = t.pid;
        // Thread ids change with the pid namespace: ask the driver (it answers for a stopped
        // process, from CRIU's thread).
        let tid = match batch.restore_thread_id(driver, pid) {
            Ok(tid) => tid,
            Err(e) if t.record.is_none() && not_a_cuda_process(&e) => continue,
            Err(e) => {
                let why = match t.record {
                    Some(_) => "recorded as a CUDA process, but",
                    None => "a CUDA process, but",
                };
                results.insert(pid, Err(fail(pid, format!("{why} {e}"))));
                continue;
            }
        };
        match batch.add(pid, tid) {
            Ok(()) => added += 1,
            Err(e) => {
                let why = format!("cannot let its restore thread {tid} run: {e}");
                results.insert(pid, Err(fail(pid, why)));
            }
        }
    }
    if added == 0 {
        // No CUDA task: no helper, no phase line (the common case of a plain restore).
        return results;
    }
    let records: BTreeMap<i32, Option<FoundState>> =
        tasks.iter().map(|t| (t.pid, t.record)).collect();
    let mut ran = batch.run(|pids, parallel| {
        let mut out: Vec<Timed<HookError>> = Vec::new();
        let mut steps = Vec::new();
        for (pid, answer) in ask_states(driver, pids) {
            let record = records.get(&pid).copied().flatten();
            match need(pid, record, answer) {
                Ok(Need::Restore) => steps.push((
                    pid,
                    Step::Restore {
                        pairs: gpu_map,
                        unlock: true,
                    },
                )),
                Ok(Need::Unlock) => steps.push((pid, Step::Unlock)),
                Ok(Need::Nothing) => out.push((pid, Ok(()), Duration::ZERO)),
                Err(e) => out.push((pid, Err(e), Duration::ZERO)),
            }
        }
        // Restores and unlocks alike in the helper process, all at once.
        for (pid, r, took) in restore_each(driver, &steps, parallel, |_, _| Ok(())) {
            let what = match steps.iter().find(|s| s.0 == pid) {
                Some((_, Step::Unlock)) => "unlock",
                _ => "restore and unlock",
            };
            out.push((pid, answer(pid, what, r, took), took));
        }
        out
    });
    ran.log_not_stopped();
    for (pid, r, _) in ran.results {
        results.insert(pid, r);
    }
    ran.phase.log("restore");
    results
}

/// Why a task's state is not known.
#[derive(Clone, Debug, thiserror::Error)]
pub(in crate::cuda) enum StateError {
    /// The driver's answer.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// No answer within the wait.
    #[error("the driver did not answer for its state within {} s", STATE_WAIT.as_secs())]
    NoAnswer,
    /// The helper process that asks gave no answer.
    #[error("its state could not be asked: {0}")]
    Helper(String),
}

/// A task whose state is not known cannot be brought to running.
impl Cause for StateError {
    fn errno(&self) -> i32 {
        libc::EIO
    }
    fn kind(&self) -> FailureKind {
        FailureKind::Driver
    }
}

/// Asks the driver for every pid's state at once, bounded in time; a helper that fails
/// leaves every pid without an answer.
pub(in crate::cuda) fn ask_states(
    driver: &Driver,
    pids: &[i32],
) -> Vec<(i32, Result<ProcessState, StateError>)> {
    match helper::process_states(driver, pids, STATE_WAIT) {
        Ok(v) => v
            .into_iter()
            .map(|(pid, a)| {
                let a = a.ok_or(StateError::NoAnswer);
                (pid, a.and_then(|r| r.map_err(StateError::from)))
            })
            .collect(),
        Err(e) => pids
            .iter()
            .map(|&pid| (pid, Err(StateError::Helper(e.to_string()))))
            .collect(),
    }
}

/// What a task in `state` needs; a state no step can bring to running is a failure.
fn need(
    pid: i32,
    record: Option<FoundState>,
    state: Result<ProcessState, StateError>,
) -> Result<Need, HookError> {
    let state = state.map_err(|e| e.failure(format!("cuda: pid {pid}: ")).report())?;
    let need = match state {
        ProcessState::Checkpointed => Need::Restore,
        ProcessState::Locked => Need::Unlock,
        ProcessState::Running => Need::Nothing,
        other => {
            return Err(fail(
                pid,
                format!("the driver reports it {other}; its GPU state cannot be given back"),
            ));
        }
    };
    match (record, &need) {
        (None, Need::Nothing) => {
            log::debug!("cuda: pid {pid}: a running CUDA process the image does not record")
        }
        (None, _) => log::warn!(
            "cuda: pid {pid}: {state} but the image records no GPU state for it (damaged metadata, or an image made without this plugin's checkpoint): its GPU state is restored and it is unlocked, so that it does not stay frozen"
        ),
        (Some(FoundState::Running), Need::Nothing) => log::warn!(
            "cuda: pid {pid}: recorded as checkpointed by the dump, but the driver reports it running; left so"
        ),
        (Some(f @ (FoundState::Locked | FoundState::Checkpointed)), _) => log::warn!(
            "cuda: pid {pid}: was {} by another tool when dumped; that lock does not carry over to the restored process, which is given its GPU state back and unlocked instead of staying frozen",
            f.as_str()
        ),
        _ => {}
    }
    Ok(need)
}

/// The answer for one driver step, logged.
fn answer(pid: i32, what: &str, r: Result<(), CallError>, took: Duration) -> HookResult {
    match r {
        Ok(()) => {
            log::info!("cuda: pid {pid}: {what} {:.1} ms", ms(took));
            Ok(())
        }
        Err(e) => Err(call_failure(pid, &e).report()),
    }
}

/// A task that cannot be brought to running, logged.
fn fail(pid: i32, why: impl std::fmt::Display) -> HookError {
    Failure::new(
        FailureKind::Driver,
        libc::EIO,
        format!("cuda: pid {pid}: {why}"),
    )
    .report()
}
