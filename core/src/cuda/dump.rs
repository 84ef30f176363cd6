//! Dump: each CUDA process is locked at `PAUSE_DEVICES` and the whole tree checkpointed at
//! the first `CHECKPOINT_DEVICES`, then the metadata is written; what must run on afterwards
//! is put back as it was found ([`put_back`]).

mod claims;
mod guardian;
pub(super) mod put_back;
mod record;
mod unusable;

pub use unusable::Unusable;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use criu_plugin::child::ChildError;
use criu_plugin::guardian::Guardian;
use criu_plugin::{CriuSymbols, HookError, HookResult};
use cuda_ckpt_sys::{Driver, ProcessState};

use super::batch::{Batch, Ran, each_in_helper, ms};
use super::error::{CallError, Failure, FailureKind, Report, call_failure, os_failure};
use super::gpus::{self, Gpu};
use super::guardian::Action;
use super::metadata::{self, FoundState};
use super::settings::CudaSettings;
use super::step::Step;
use super::{INVENTORY_NAME, driver, exclusive, helper, image, procfs};

/// Time kept back from CRIU's alarm so that a lock timeout is reported by us, not by SIGALRM.
const ALARM_MARGIN: Duration = Duration::from_millis(500);
/// How old a process must be before "not a CUDA process" is believed: a restore's guardian
/// claims the tasks its CRIU forks within a few milliseconds (see `guardian::EndRestore`).
const YOUNG: Duration = Duration::from_millis(60);
/// How much longer than its own timeout a lock may take before the plugin gives up on it.
const LOCK_GRACE: Duration = Duration::from_secs(2);

/// One dump's state, from `init` to `exit`.
pub struct DumpRun {
    settings: CudaSettings,
    driver: Driver,
    driver_version: i32,
    gpus: Vec<Gpu>,
    /// Every process paused, by host pid.
    dumped: BTreeMap<i32, DumpedProcess>,
    /// Processes whose lock the plugin stopped waiting for: it may complete later, and must
    /// not leave them locked.
    abandoned_locks: Vec<(i32, Option<u64>)>,
    /// This CRIU's claims on the processes it dumps, held until `exit`.
    claims: BTreeMap<i32, exclusive::Claim>,
    /// The process that puts everything back should CRIU end first; started before the
    /// first lock.
    guardian: Option<Guardian>,
    /// What the guardian was told, by pid (start time, action): told again to a new guardian
    /// should the first one die.
    watches: BTreeMap<i32, (u64, u32)>,
    /// No guardian can run here (a kernel without pidfds): warned about once.
    unguarded: bool,
    /// A claim could not be taken where it belongs: warned about once.
    claims_warned: bool,
    inventory_added: bool,
}

/// What the backend did to one process during a dump.
#[derive(Debug)]
struct DumpedProcess {
    pid: i32,
    ns_pid: i32,
    restore_tid: i32,
    found: FoundState,
    locked_by_us: bool,
    checkpointed_by_us: bool,
    rss_before: u64,
    host_bytes: u64,
    /// The answer to `CHECKPOINT_DEVICES`, once the batch has run (already logged).
    result: Option<HookResult>,
    /// Start time when paused: tells the process from a later one with its pid.
    start_time: Option<u64>,
}

/// How the lock helper found a process, and what it cost.
struct Locked {
    found: FoundState,
    locked_by_us: bool,
    in_driver: Duration,
    helper_cost: Duration,
}

impl DumpRun {
    /// Prepares a dump: `Ok(None)` when this machine has no NVIDIA driver; `Err(why)` when the
    /// NVIDIA side cannot run although it may be needed (settings file unreadable, a
    /// `cuda.nvidia-proc` that lists nothing, no driver or checkpoint API, GPUs that cannot
    /// be listed): a process that holds an NVIDIA device then fails the dump with `why`.
    pub fn start(settings: CudaSettings) -> Result<Option<DumpRun>, Unusable> {
        if let Some(e) = &settings.file_error {
            // The file may name another libcuda or switch the NVIDIA side off: load nothing.
            return Err(Unusable::Settings(e.clone()));
        }
        let proc_dir = &settings.nvidia_proc;
        if let Some(problem) = settings.nvidia_proc_problem() {
            // Nothing there and no NVIDIA device node: a machine without the driver (tests
            // and fleet-wide settings name a listing that only GPU nodes have).
            if !proc_dir.exists() && !Path::new("/dev/nvidiactl").exists() {
                log::info!(
                    "cuda: no NVIDIA driver here ({} is missing): the NVIDIA side is off",
                    proc_dir.display()
                );
                return Ok(None);
            }
            return Err(Unusable::Machine(problem));
        }
        let (driver, driver_version) = driver::load(&settings)?;
        let mut gpus =
            gpus::read_gpus(proc_dir, &settings.nvidia_dev).map_err(|source| Unusable::Gpus {
                dir: proc_dir.display().to_string(),
                from: settings.nvidia_proc_from.to_string(),
                source,
            })?;
        driver::fill_memory(&settings.nvml, &mut gpus);
        // Locking needs runnable tasks: keep CRIU from freezing the cgroup before PAUSE_DEVICES.
        if !CriuSymbols::get().request_interrupt_only_mode() {
            log::debug!("cuda: this CRIU has no interrupt-only seize mode");
        }
        log::info!(
            "cuda: driver {} (CUDA {}), {} GPU(s)",
            driver::read_release(proc_dir)
                .as_deref()
                .unwrap_or("of unknown release"),
            cuda_ckpt_sys::format_version(driver_version),
            gpus.len()
        );
        exclusive::sweep(64);
        Ok(Some(DumpRun {
            settings,
            driver,
            driver_version,
            gpus,
            dumped: BTreeMap::new(),
            abandoned_locks: Vec::new(),
            claims: BTreeMap::new(),
            guardian: None,
            watches: BTreeMap::new(),
            unguarded: false,
            claims_warned: false,
            inventory_added: false,
        }))
    }

    /// `PAUSE_DEVICES`: locks `pid` if it uses CUDA and runs.
    pub fn pause(&mut self, pid: i32) -> HookResult {
        self.pause_once(pid, true)
    }

    /// [`DumpRun::pause`]; `may_wait`: a process that just started may be waited out once.
    fn pause_once(&mut self, pid: i32, may_wait: bool) -> HookResult {
        if self.dumped.contains_key(&pid) {
            // CRIU may ask again for a child after a failed seize attempt.
            return Ok(());
        }
        let started = Instant::now();
        // Claimed before the driver is asked: a task that another CRIU is restoring is not a
        // CUDA process yet, and must not be dumped as one without its GPU state.
        let (start, unclaimed) = match self.claim(pid)? {
            claims::Claimed::Yes(start) => (start, None),
            claims::Claimed::Impossible(start, why) => (Some(start), Some(why)),
        };
        let t = Instant::now();
        let tid_result = self.driver.restore_thread_id(pid);
        let mut in_driver = t.elapsed();
        let tid = match tid_result {
            Ok(tid) => tid,
            Err(e) => {
                if driver::not_a_cuda_process(&e) || !Path::new(&format!("/proc/{pid}")).exists() {
                    self.claims.remove(&pid);
                    let young = procfs::age(pid).and_then(|a| YOUNG.checked_sub(a));
                    if let (true, Some(wait)) = (may_wait, young) {
                        // Just started: perhaps a task another CRIU is restoring, not CUDA yet,
                        // which that CRIU's guardian claims within moments. Asked again then.
                        std::thread::sleep(wait + Duration::from_millis(10));
                        return self.pause_once(pid, false);
                    }
                    log::debug!("cuda: pid {pid} is not a CUDA process ({e})");
                    return Err(HookError::NotMine);
                }
                return Err(Failure::new(
                    FailureKind::Driver,
                    e.errno(),
                    format!("cuda: cannot tell whether pid {pid} uses CUDA: {e}"),
                )
                .caused_by(e)
                .into());
            }
        };
        self.settings.check(&format!("cuda: pid {pid} uses CUDA"))?;
        if let Some(why) = unclaimed {
            return Err(claims::refuse_unclaimed(pid, &why).into());
        }
        check_runnable(pid, tid)?;
        self.start_guardian()?;
        let locked = self.lock(pid, start)?;
        in_driver += locked.in_driver;
        self.watch(pid, start, &locked);
        self.dumped.insert(
            pid,
            DumpedProcess {
                pid,
                ns_pid: procfs::ns_pid(pid).unwrap_or(pid),
                restore_tid: tid,
                found: locked.found,
                locked_by_us: locked.locked_by_us,
                checkpointed_by_us: false,
                rss_before: 0,
                host_bytes: 0,
                result: None,
                start_time: start,
            },
        );
        if !self.inventory_added {
            CriuSymbols::get()
                .add_inventory_plugin(INVENTORY_NAME)
                .map_err(|e| {
                    Failure::new(
                        FailureKind::System,
                        libc::ENOMEM,
                        format!("cuda: cannot record the plugin in the inventory ({e})"),
                    )
                })?;
            self.inventory_added = true;
        }
        let total = started.elapsed();
        log::info!(
            "cuda: pid {pid} (restore thread {tid}) paused: {:.2} ms in the driver, plugin own time {:.3} ms (of which the lock helper process {:.3} ms)",
            ms(in_driver),
            ms(total.saturating_sub(in_driver)),
            ms(locked.helper_cost)
        );
        Ok(())
    }

    /// Asks for `pid`'s state and locks it when it runs, in a helper process: a target that
    /// never answers costs a killed helper, not a thread stuck in CRIU's process for good.
    fn lock(&mut self, pid: i32, start: Option<u64>) -> HookResult<Locked> {
        self.lock_once(pid, start, false)
    }

    fn lock_once(&mut self, pid: i32, start: Option<u64>, again: bool) -> HookResult<Locked> {
        let timeout = self.lock_timeout();
        // Never 0, which the driver reads as "wait for good".
        let ms_timeout = timeout.as_millis().clamp(1, u32::MAX as u128) as u32;
        let deadline = timeout + LOCK_GRACE;
        let t = Instant::now();
        let guardian = self.guardian.as_ref();
        // In the helper, just before the lock: from then on the guardian unlocks it.
        let announce = || match (guardian, start) {
            (Some(g), Some(start)) => g
                .watch(pid, start, (Action::RESTORE | Action::UNLOCK).bits(), None)
                .is_ok(),
            // No start time: the process is gone. No guardian: a kernel without pidfds.
            _ => true,
        };
        let outcome = helper::state_and_lock(&self.driver, pid, ms_timeout, deadline, &announce)
            .map_err(|e| match e {
                // A lock may have been asked for and complete later: checked again at exit.
                ChildError::TimedOut(_) => {
                    self.abandoned_locks.push((pid, procfs::start_time(pid)));
                    Failure::new(FailureKind::Process,
                        libc::ETIMEDOUT,
                        format!(
                            "cuda: pid {pid} did not answer the driver (state query and lock, {} ms at most): {e}; the dump is abandoned",
                            deadline.as_millis()
                        ),
                    )
                }
                e => Failure::helper(format!("cuda: pid {pid}: the lock helper failed: {e}"))
                    .caused_by(e),
            })?;
        let helper_cost = t.elapsed().saturating_sub(outcome.in_driver);
        let state = outcome.state.map_err(|e| {
            Failure::new(FailureKind::Driver, e.errno(), format!("cuda: {e}")).caused_by(e)
        })?;
        let (found, locked_by_us) = match state {
            ProcessState::Running => {
                match outcome.lock {
                    Some(Ok(())) => {}
                    Some(Err(e)) => {
                        // Not locked: nothing for the guardian to undo.
                        self.forget(pid);
                        // The guardian died between its check and the lock (the helper could
                        // not tell it, so it did not lock): once more under a new one.
                        if !again
                            && matches!(e, CallError::Helper(_))
                            && self.guardian.as_ref().is_some_and(|g| !g.alive())
                        {
                            self.start_guardian()?;
                            return self.lock_once(pid, start, true);
                        }
                        let why = if e.errno() == libc::ETIMEDOUT {
                            format!(
                                "; its GPU work did not finish within {ms_timeout} ms (raise CRIU's --timeout)"
                            )
                        } else {
                            String::new()
                        };
                        return Err(Failure::new(e.kind(), e.errno(), format!("cuda: {e}{why}"))
                            .caused_by(e)
                            .into());
                    }
                    None => {
                        return Err(Failure::helper(format!(
                            "cuda: pid {pid}: the lock helper did not lock it"
                        ))
                        .into());
                    }
                }
                (FoundState::Running, true)
            }
            ProcessState::Locked => {
                log::info!("cuda: pid {pid} was already locked; it stays locked afterwards");
                (FoundState::Locked, false)
            }
            ProcessState::Checkpointed => {
                log::info!("cuda: pid {pid} was already checkpointed; it stays so afterwards");
                (FoundState::Checkpointed, false)
            }
            other => {
                return Err(Failure::new(
                    FailureKind::Process,
                    libc::EIO,
                    format!("cuda: pid {pid} is in CUDA state {other}; it cannot be checkpointed"),
                )
                .into());
            }
        };
        Ok(Locked {
            found,
            locked_by_us,
            in_driver: outcome.in_driver,
            helper_cost,
        })
    }

    /// The lock timeout: what is left of CRIU's alarm, less a margin, else the setting.
    fn lock_timeout(&self) -> Duration {
        match criu_plugin::symbols::alarm_remaining() {
            Some(left) => left
                .saturating_sub(ALARM_MARGIN)
                .max(Duration::from_millis(100)),
            None => Duration::from_millis(self.settings.lock_timeout_ms),
        }
    }

    /// `CHECKPOINT_DEVICES`: the first call checkpoints every paused process at once; each
    /// process then gets its own answer, and the first error fails the dump.
    pub fn checkpoint(&mut self, pid: i32) -> HookResult {
        let Some(p) = self.dumped.get(&pid) else {
            return Err(HookError::NotMine);
        };
        // A process paused after that batch (CRIU found it late) gets a batch of its own.
        if p.result.is_none() {
            self.checkpoint_all(pid);
        }
        match self.dumped.get(&pid) {
            Some(p) => p
                .result
                .clone()
                .unwrap_or(Err(HookError::logged(libc::EIO))),
            None => Err(HookError::NotMine),
        }
    }

    /// Checkpoints every paused process without an answer yet, then writes the metadata; a
    /// metadata failure is `current`'s answer.
    fn checkpoint_all(&mut self, current: i32) {
        // A guardian killed since the last lock is replaced before the longest part of the
        // dump (the driver's checkpoint and CRIU's memory dump).
        if self.guardian.as_ref().is_some_and(|g| !g.alive()) && self.start_guardian().is_err() {
            log::warn!(
                "cuda: no guardian could replace the one that died: should CRIU end now, the processes stay locked or checkpointed"
            );
        }
        self.leave_out_unseized();
        for p in self.dumped.values_mut() {
            if p.found == FoundState::Checkpointed && p.result.is_none() {
                p.result = Some(Ok(()));
            }
        }
        let mut batch = Batch::new(self.settings.parallel);
        for p in self.dumped.values_mut().filter(|p| p.result.is_none()) {
            p.rss_before = procfs::rss_bytes(p.pid);
            if let Err(e) = batch.add(p.pid, p.restore_tid) {
                let why = format!(
                    "cuda: pid {}: cannot let restore thread {} run: {e}",
                    p.pid, p.restore_tid
                );
                p.result = Some(Err(os_failure(&e, why).report()));
            }
        }
        let driver = &self.driver;
        let Ran {
            results,
            not_stopped,
            phase,
        } = batch.run(|pids, parallel| {
            let steps: Vec<(i32, Step<'_>)> =
                pids.iter().map(|&pid| (pid, Step::Checkpoint)).collect();
            each_in_helper(driver, &steps, parallel)
        });
        for (pid, r, took) in results {
            let Some(p) = self.dumped.get_mut(&pid) else {
                continue;
            };
            p.result = Some(match r {
                Ok(()) => {
                    p.checkpointed_by_us = true;
                    p.host_bytes = procfs::rss_bytes(pid).saturating_sub(p.rss_before);
                    log::info!(
                        "cuda: pid {pid}: checkpoint {:.1} ms, {} MiB moved to host memory",
                        ms(took),
                        p.host_bytes >> 20
                    );
                    Ok(())
                }
                Err(e) => Err(call_failure(pid, &e).report()),
            });
        }
        for (tid, e) in not_stopped {
            if let Some(p) = self.dumped.values_mut().find(|p| p.restore_tid == tid) {
                let why = format!(
                    "cuda: pid {}: cannot stop restore thread {tid} again: {e}",
                    p.pid
                );
                p.result = Some(Err(os_failure(&e, why).report()));
            }
        }
        phase.log("checkpoint");
        // Metadata only for a dump that checkpointed something: none would restore nothing.
        if self.dumped.is_empty()
            || !self
                .dumped
                .values()
                .all(|p| matches!(p.result, Some(Ok(()))))
        {
            return;
        }
        if let Err(e) = image::write_metadata(|| self.metadata()) {
            let err = Failure::new(
                FailureKind::Image,
                libc::EIO,
                format!("cannot write {}: {e}", metadata::FILE_NAME),
            )
            .report();
            if let Some(p) = self.dumped.get_mut(&current) {
                p.result = Some(Err(err));
            }
        }
    }

    /// Drops the processes that went away (or were never seized) since `PAUSE_DEVICES`: they
    /// get no `CHECKPOINT_DEVICES` call, so there is nothing to checkpoint and nothing to put
    /// back. One this dump locked but CRIU did not seize must not stay locked.
    fn leave_out_unseized(&mut self) {
        let me = std::process::id() as i32;
        let gone: Vec<i32> = self
            .dumped
            .values()
            .filter(|p| p.result.is_none() && procfs::tracer(p.pid) != Some(me))
            .map(|p| p.pid)
            .collect();
        for pid in gone {
            let Some(p) = self.dumped.remove(&pid) else {
                continue;
            };
            if !p.locked_by_us
                || !Path::new(&format!("/proc/{pid}")).exists()
                || procfs::start_time(pid) != p.start_time
            {
                log::info!("cuda: pid {pid} ended after it was paused; dropped");
                continue;
            }
            match helper::unlock_if_locked(&self.driver, pid, LOCK_GRACE) {
                Ok(true) => log::info!(
                    "cuda: pid {pid} was paused but not seized by CRIU; unlocked and left out"
                ),
                Ok(false) => log::info!(
                    "cuda: pid {pid} was paused but not seized by CRIU, and is no longer locked; left out"
                ),
                Err(e) => log::error!(
                    "cuda: pid {pid} was paused but not seized by CRIU, and cannot be unlocked: {e}"
                ),
            }
        }
    }

    /// `DUMP_FINISH`: with `ret` non-zero the tasks run on, so every process is put back.
    pub fn dump_finish(&mut self, ret: i32) -> HookResult {
        if ret == 0 {
            // Nothing to roll back; `exit` does what the final state asks.
            return Ok(());
        }
        log::info!("cuda: DUMP_FINISH({ret}): the tasks run on; putting processes back");
        let failed = self.put_back_all();
        self.release_abandoned_locks();
        if failed > 0 {
            return Err(Failure::new(
                FailureKind::Driver,
                libc::EIO,
                format!("cuda: {failed} process(es) could not be put back as they were found"),
            )
            .into());
        }
        Ok(())
    }

    /// `exit`: after a failed dump, or when the tasks live on, every process is put back. The
    /// claims go with the run. The guardian is released when nothing is left for it to do:
    /// the dump is done and CRIU ends the tasks, or every process was put back; otherwise it
    /// stays, and tries again once CRIU has ended (the tasks then run untraced).
    pub fn finish(mut self, ret: i32) {
        let final_state = CriuSymbols::get().final_state();
        let put_back = ret != 0 || !matches!(final_state, Some(criu_plugin::FinalState::Dead));
        let mut left = 0;
        if put_back {
            log::info!(
                "cuda: dump {} (final state {final_state:?}): putting processes back",
                if ret != 0 { "failed" } else { "done" }
            );
            left = self.put_back_all();
        }
        left += self.release_abandoned_locks();
        if let Some(g) = self.guardian.take() {
            if left == 0 {
                g.release();
            } else {
                // Their claims stay with the guardian, on files no new claim replaces.
                for p in self.dumped.values() {
                    if (p.locked_by_us || p.checkpointed_by_us)
                        && let Some(c) = self.claims.remove(&p.pid)
                    {
                        c.leave();
                    }
                }
                log::warn!(
                    "cuda: {left} process(es) not put back yet; guardian {} tries again once CRIU has ended",
                    g.pid()
                );
            }
        }
    }
}

/// Refuses a process the driver could not lock because it cannot run: the call would wait
/// for good instead of timing out.
fn check_runnable(pid: i32, tid: i32) -> HookResult {
    if let Some(state @ ('T' | 't')) = procfs::thread_state(pid, tid) {
        let how = if state == 't' {
            "stopped by a debugger"
        } else {
            "stopped (SIGSTOP)"
        };
        return Err(Failure::new(
            FailureKind::Process,
            libc::EBUSY,
            format!(
                "cuda: pid {pid} is {how}; CUDA can only lock a running process: continue it before the dump"
            ),
        ).into());
    }
    if let Some(cg) = procfs::frozen_cgroup(pid) {
        return Err(Failure::new(
            FailureKind::Process,
            libc::EBUSY,
            format!(
                "cuda: pid {pid} is in frozen cgroup {cg}; CUDA can only lock a running process: thaw it, or use CRIU 4.2 or later, which thaws it for plugins"
            ),
        ).into());
    }
    Ok(())
}
