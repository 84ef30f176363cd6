//! A batch: one driver step (checkpoint, restore, put back) over many processes at once.
//!
//! Every batch runs the same way: CRIU's alarm suspended, each process's restore thread let
//! run ([`RunningThreads`]), the step on worker threads (one per process when parallel), the
//! restore threads stopped again, and one log line with the phase's figures.
//!
//! A restore the driver refuses for want of `cuInit` (persistence mode off) is redone from a
//! helper process that calls it ([`restore_each`]): dump's put-back and restore share that.

use std::io;
use std::time::{Duration, Instant};

use criu_plugin::symbols::AlarmSuspended;
use cuda_ckpt_sys::{Driver, DriverError};

use super::error::CallError;
use super::executor::{Outcome, Plan, execute};
use super::helper;
use super::restore_thread::RunningThreads;
use super::step::{Step, needs_init};
pub use super::step::{Timed, ms};

/// How long the helper process of one batch may run (the C plugin's default timeout).
pub const HELPER_DEADLINE: Duration = Duration::from_secs(300);

/// A batch being put together: the processes whose restore thread runs.
pub struct Batch {
    alarm: AlarmSuspended,
    started: Instant,
    threads: RunningThreads,
    runnable: Vec<i32>,
    serial_driver: Duration,
    parallel: bool,
}

/// A batch that has run.
pub struct Ran<E> {
    /// Each process's result, in the order the processes were added.
    pub results: Vec<Timed<E>>,
    /// Restore threads that could not be stopped again, with why.
    pub not_stopped: Vec<(i32, io::Error)>,
    /// The figures of the phase.
    pub phase: Phase,
}

/// A phase's figures. CRIU's alarm stays suspended until the phase is dropped.
pub struct Phase {
    _alarm: AlarmSuspended,
    processes: usize,
    wall: Duration,
    in_driver: Duration,
    parallel: bool,
}

impl Batch {
    /// Starts a batch: CRIU's alarm is suspended and the clock starts.
    pub fn new(parallel: bool) -> Batch {
        Batch {
            alarm: AlarmSuspended::new(),
            started: Instant::now(),
            threads: RunningThreads::new(),
            runnable: Vec::new(),
            serial_driver: Duration::ZERO,
            parallel,
        }
    }

    /// Lets `pid`'s restore thread `tid` run so that the step can be done on `pid`; a process
    /// whose thread cannot run is left out.
    pub fn add(&mut self, pid: i32, tid: i32) -> io::Result<()> {
        self.threads.start(tid)?;
        self.runnable.push(pid);
        Ok(())
    }

    /// Asks the driver for `pid`'s restore thread on CRIU's thread; the time counts as driver
    /// time of the phase.
    pub fn restore_thread_id(&mut self, driver: &Driver, pid: i32) -> Result<i32, DriverError> {
        let t = Instant::now();
        let tid = driver.restore_thread_id(pid);
        self.serial_driver += t.elapsed();
        tid
    }

    /// Runs `step` over the processes added, then stops their restore threads again.
    pub fn run<E>(mut self, step: impl FnOnce(&[i32], bool) -> Vec<Timed<E>>) -> Ran<E> {
        let results = step(&self.runnable, self.parallel);
        let not_stopped = self.threads.stop_all();
        let wall = self.started.elapsed();
        let in_driver = self.serial_driver
            + if self.parallel {
                results.iter().map(|r| r.2).max().unwrap_or_default()
            } else {
                results.iter().map(|r| r.2).sum()
            };
        Ran {
            results,
            not_stopped,
            phase: Phase {
                _alarm: self.alarm,
                processes: self.runnable.len(),
                wall,
                in_driver,
                parallel: self.parallel,
            },
        }
    }
}

impl<E> Ran<E> {
    /// Logs the restore threads that could not be stopped again.
    pub fn log_not_stopped(&mut self) {
        for (tid, e) in self.not_stopped.drain(..) {
            log::error!("cuda: cannot stop restore thread {tid} again: {e}");
        }
    }
}

impl Phase {
    /// Logs the phase's figures: wall time, the time in the driver (the longest call when the
    /// calls ran at once), and what the plugin itself added (thread start, ptrace,
    /// bookkeeping), in total and per process.
    pub fn log(&self, what: &str) {
        let own = self.wall.saturating_sub(self.in_driver);
        log::info!(
            "cuda: {what} phase: {} process(es) {}, {:.1} ms wall, {:.1} ms in the driver, plugin own time {:.3} ms ({:.3} ms per process)",
            self.processes,
            if self.parallel {
                "at once"
            } else {
                "one after another"
            },
            ms(self.wall),
            ms(self.in_driver),
            ms(own),
            ms(own) / self.processes.max(1) as f64
        );
    }
}

/// Runs `op` for every pid in this process ([`Plan::in_process`]), on worker threads when
/// `parallel`, and reports each result with the time it took. A call that panics is reported
/// as that pid's failure, never unwound further. For `criu-gpu`, where no CRIU is to protect.
pub fn run_each<E: Into<CallError>>(
    pids: &[i32],
    parallel: bool,
    op: impl Fn(i32) -> Result<(), E> + Sync,
) -> Vec<Timed> {
    let ran = execute(pids, Plan::in_process(parallel), &|k| {
        op(pids[k]).map_err(Into::into)
    });
    ran.into_iter()
        .map(|(pid, a, took)| {
            let r = match a {
                Outcome::Returned(r) => r,
                Outcome::Panicked(message) => Err(CallError::Panic { pid, message }),
                // In process, unwatched and unbounded: every call returns.
                Outcome::Ended | Outcome::NoAnswer => Err(CallError::Process(format!(
                    "pid {pid}: the driver gave no answer"
                ))),
            };
            (pid, r, took)
        })
        .collect()
}

/// Makes each step in a helper process ([`helper::each_in_helper`]): a driver call that never
/// returns, or waits for a task that died, costs a killed helper, never a CRIU that hangs. A
/// helper that gives no answer fails every pid, saying why.
pub fn each_in_helper(driver: &Driver, steps: &[(i32, Step<'_>)], parallel: bool) -> Vec<Timed> {
    if steps.is_empty() {
        return Vec::new();
    }
    let t = Instant::now();
    match helper::each_in_helper(driver, steps, parallel, false, HELPER_DEADLINE) {
        Ok(v) => v,
        Err(e) => steps
            .iter()
            .map(|&(pid, _)| {
                let why = format!("the driver helper process gave no answer: {e}");
                (pid, Err(CallError::Helper(why)), t.elapsed())
            })
            .collect(),
    }
}

/// Makes each step (a restore, or a put-back) in a helper process; the steps whose restore the
/// driver refused for want of `cuInit` are redone ([`Step::after_init`]) from a helper process
/// that calls it (`cuInit` starts threads, which must not stay in CRIU's process) and then
/// checked with `check`.
pub fn restore_each(
    driver: &Driver,
    steps: &[(i32, Step<'_>)],
    parallel: bool,
    check: impl Fn(i32, &Step<'_>) -> Result<(), CallError>,
) -> Vec<Timed> {
    let step = |pid: i32| steps.iter().find(|s| s.0 == pid).map(|s| &s.1);
    let mut results = each_in_helper(driver, steps, parallel);
    let retry: Vec<(i32, Step<'_>)> = results
        .iter()
        .filter(|(_, r, _)| needs_init(r))
        .filter_map(|(pid, _, _)| step(*pid).map(|s| (*pid, s.after_init())))
        .collect();
    if retry.is_empty() {
        return results;
    }
    log::info!(
        "cuda: restore needs an initialised driver (persistence mode is off): restoring {} process(es) from a helper process that calls cuInit",
        retry.len()
    );
    let t = Instant::now();
    let redone = helper::each_in_helper(driver, &retry, parallel, true, HELPER_DEADLINE);
    let helper_wall = t.elapsed();
    for slot in results.iter_mut().filter(|(_, r, _)| needs_init(r)) {
        let (pid, result, took) = slot;
        *result = match &redone {
            Ok(v) => match v.iter().find(|(p, _, _)| p == pid) {
                Some((_, Ok(()), helper_took)) => {
                    *took += *helper_took;
                    step(*pid).map_or(Ok(()), |s| check(*pid, s))
                }
                Some((_, Err(e), helper_took)) => {
                    *took += *helper_took;
                    Err(e.clone())
                }
                None => Err(CallError::Helper("the restore helper skipped it".into())),
            },
            Err(e) => {
                *took += helper_wall;
                Err(CallError::Helper(format!("restore helper: {e}")))
            }
        };
    }
    results
}
