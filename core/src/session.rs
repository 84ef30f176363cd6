//! The CUDA driver as `criu-gpu` uses it, through the plugin's own code: settings read as the
//! plugin reads them, the driver loaded and checked, each target process probed (uses CUDA?
//! state?), and the batches of driver calls (lock, checkpoint, restore, put back), plus the
//! per-process facts and the claim on a process that the tool's `suspend`, `resume` and
//! `status` need.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use crate::config::Config;
use crate::cuda::batch::{Batch, restore_each, run_each};
use crate::cuda::driver::LoadError;
use crate::cuda::executor::{Outcome, Plan, execute};
use crate::cuda::helper;
use crate::cuda::step::{Step, check_put_back};
use crate::cuda::{CudaSettings, driver, gpus, procfs};
use cuda_ckpt_sys::{Driver, DriverError, GpuPair, GpuUuid, ProcessState};

pub use crate::cuda::error::CallError;
pub use crate::cuda::exclusive::{
    Claim, ClaimError, DirProblem, FALLBACK_DIR, HeldBy, LOCK_DIR, Role,
};
pub use crate::cuda::gpus::parse_device_map;
pub use crate::cuda::nvml::GpuMemory;
pub use crate::cuda::procfs::{rss_bytes, start_time};
pub use crate::cuda::step::Timed;

/// `pid` and its descendants, root first (every thread's `/proc/PID/task/TID/children`).
pub fn process_tree(pid: i32) -> Vec<i32> {
    procfs::tree(pid)
}

/// Claims process `pid` (started at `start`) for this `criu-gpu` run: the plugin's claim, so
/// that no CRIU dump (or other `criu-gpu`) acts on the process at the same time.
pub fn claim(pid: i32, start: u64) -> Result<Claim, ClaimError> {
    crate::cuda::exclusive::claim_as(pid, start, Role::CriuGpu)
}

/// The command name of `pid`, for listings (empty when it cannot be read).
pub fn comm(pid: i32) -> String {
    criu_plugin::files::read_regular(None, Path::new(&format!("/proc/{pid}/comm")), false, 256)
        .map(|b| String::from_utf8_lossy(&b).trim_end().to_string())
        .unwrap_or_default()
}

/// Why the driver cannot be used the way the plugin's settings say.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The settings cannot be read.
    #[error("{0}; fix or remove the settings file (or point CRIU_GPU_PLUGIN_CONFIG elsewhere)")]
    Config(String),
    /// A setting's value is bad.
    #[error("a setting is bad: {0}; fix it in the settings file or the environment")]
    Setting(String),
    /// No kernel driver listing where the settings say.
    #[error("no NVIDIA driver here ({0}): load the nvidia kernel module, or set cuda.nvidia-proc")]
    NoDriver(String),
    /// The CUDA driver cannot be loaded or has no checkpoint API.
    #[error("cannot use the CUDA driver: {0} (set libcuda in the settings to another library)")]
    Driver(#[from] LoadError),
}

/// Why a CUDA process's state is not known.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ProbeError {
    /// The driver cannot tell whether it uses CUDA.
    #[error("cannot tell whether it uses CUDA: {0} (are you root?)")]
    Unknown(DriverError),
    /// It cannot run, so the driver cannot answer for it.
    #[error(transparent)]
    NotRunnable(#[from] NotRunnable),
    /// The driver's answer to the state query.
    #[error("the driver cannot tell its state: {0}")]
    State(DriverError),
}

/// Why the driver cannot act on a process now.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NotRunnable {
    /// Stopped by a signal or a debugger.
    #[error(
        "it is {how}; CUDA can only act on a running process: continue it (kill -CONT {pid}) and try again"
    )]
    Stopped {
        /// How, in words.
        how: &'static str,
        /// The process.
        pid: i32,
    },
    /// Stopped by its tracer: a CRIU dump that holds it, or a debugger.
    #[error(
        "it is stopped by pid {tracer} ({by}), which traces it (a CRIU dump, or a debugger); CUDA can only act on a running process: try again once pid {tracer} has let it go"
    )]
    Traced {
        /// The tracer.
        tracer: i32,
        /// The tracer's command name.
        by: String,
    },
    /// In a frozen cgroup.
    #[error(
        "it is in frozen cgroup {0}; CUDA can only act on a running process: thaw the cgroup and try again"
    )]
    Frozen(String),
}

/// The plugin's settings (its file, `CRIU_GPU_*` variables), with warnings printed.
pub fn load_config() -> Result<Config, OpenError> {
    let cfg = Config::from_process().map_err(|e| OpenError::Config(e.to_string()))?;
    for w in &cfg.warnings {
        log::warn!("settings: {w}");
    }
    Ok(cfg)
}

/// A loaded driver and the settings it was loaded with.
pub struct Session {
    pub driver: Driver,
    pub version: i32,
    pub settings: CudaSettings,
    pub parallel: bool,
}

/// How one target process was found.
#[derive(Clone, Debug)]
pub enum Found {
    /// It uses no CUDA (or the driver knows none of it).
    NotCuda,
    /// It went away.
    Gone,
    /// A CUDA process with its restore thread; its state, or why it cannot be had.
    Cuda {
        tid: i32,
        state: Result<ProcessState, ProbeError>,
    },
}

/// One probed process.
#[derive(Clone, Debug)]
pub struct Probe {
    pub pid: i32,
    pub comm: String,
    pub found: Found,
}

impl Probe {
    /// The restore thread, for a CUDA process.
    pub fn tid(&self) -> Option<i32> {
        match self.found {
            Found::Cuda { tid, .. } => Some(tid),
            _ => None,
        }
    }

    /// The state, for a CUDA process whose state is known.
    pub fn state(&self) -> Option<ProcessState> {
        match &self.found {
            Found::Cuda { state: Ok(s), .. } => Some(*s),
            _ => None,
        }
    }

    /// The state as a word: `running`, `locked`, `checkpointed`, `not CUDA`, ...
    pub fn state_word(&self) -> String {
        match &self.found {
            Found::NotCuda => "not CUDA".into(),
            Found::Gone => "gone".into(),
            Found::Cuda { state: Ok(s), .. } => s.to_string(),
            Found::Cuda { state: Err(_), .. } => "unknown".into(),
        }
    }
}

impl Session {
    /// Loads the driver the plugin's settings name.
    pub fn open(serial: bool) -> Result<Session, OpenError> {
        let cfg = load_config()?;
        let settings = CudaSettings::from_config(&cfg);
        if let Some(p) = settings.problems.first() {
            return Err(OpenError::Setting(p.to_string()));
        }
        if let Some(problem) = settings.nvidia_proc_problem() {
            return Err(OpenError::NoDriver(problem));
        }
        let (driver, version) = driver::load(&settings)?;
        log::info!(
            "driver {} (CUDA {})",
            driver.path(),
            cuda_ckpt_sys::format_version(version)
        );
        Ok(Session {
            driver,
            version,
            parallel: settings.parallel && !serial,
            settings,
        })
    }

    /// Probes every pid: whether it uses CUDA, its restore thread and state. A stopped process
    /// or one in a frozen cgroup is not asked (the driver would wait for it for good).
    pub fn probe(&self, pids: &[i32]) -> Vec<Probe> {
        let mut out: Vec<Probe> = pids
            .iter()
            .map(|&pid| {
                let comm = comm(pid);
                let found = match self.driver.restore_thread_id(pid) {
                    Ok(tid) => Found::Cuda {
                        tid,
                        state: runnable(pid, tid)
                            .map(|()| ProcessState::Running)
                            .map_err(ProbeError::from),
                    },
                    Err(_) if !Path::new(&format!("/proc/{pid}")).exists() => Found::Gone,
                    Err(e) if driver::not_a_cuda_process(&e) => Found::NotCuda,
                    Err(e) => Found::Cuda {
                        tid: 0,
                        state: Err(ProbeError::Unknown(e)),
                    },
                };
                Probe { pid, comm, found }
            })
            .collect();
        let ask: Vec<i32> = out
            .iter()
            .filter(|p| matches!(p.found, Found::Cuda { state: Ok(_), .. }))
            .map(|p| p.pid)
            .collect();
        let driver = &self.driver;
        let ran = execute(&ask, Plan::in_process(self.parallel), &|k| {
            driver.process_state(ask[k])
        });
        // A query that panicked leaves the process as found.
        let states: BTreeMap<i32, Result<ProcessState, DriverError>> = ran
            .into_iter()
            .filter_map(|(pid, a, _)| match a {
                Outcome::Returned(s) => Some((pid, s)),
                _ => None,
            })
            .collect();
        for p in &mut out {
            if let (Found::Cuda { state, tid }, Some(s)) = (&mut p.found, states.get(&p.pid)) {
                // A stop that lands while the driver is asked (SIGSTOP reaches threads one by
                // one) fails the call; say what the user can act on, not the driver's errno.
                *state = s.clone().map_err(|e| match runnable(p.pid, *tid) {
                    Err(why) => why.into(),
                    Ok(()) => ProbeError::State(e),
                });
            }
        }
        out
    }

    /// Locks `pids` with `timeout`, all at once.
    pub fn lock(&self, pids: &[i32], timeout: Duration) -> Vec<Timed> {
        // Never 0, which the driver reads as "wait for good".
        let ms = timeout.as_millis().clamp(1, u128::from(u32::MAX)) as u32;
        let lock = Step::Lock { timeout_ms: ms };
        run_each(pids, self.parallel, |pid| lock.run(&self.driver, pid))
    }

    /// Checkpoints `procs` (pid, restore thread), all at once, as one batch.
    pub fn checkpoint(&self, procs: &[(i32, i32)]) -> Vec<Timed> {
        let mut batch = Batch::new(self.parallel);
        let mut refused = Vec::new();
        for &(pid, tid) in procs {
            if let Err(e) = batch.add(pid, tid) {
                refused.push((pid, Err(thread_error(tid, &e)), Duration::ZERO));
            }
        }
        let driver = &self.driver;
        let mut ran = batch.run(|pids, parallel| {
            run_each(pids, parallel, |pid| Step::Checkpoint.run(driver, pid))
        });
        ran.log_not_stopped();
        ran.phase.log("checkpoint");
        let mut results = std::mem::take(&mut ran.results);
        results.extend(refused);
        results
    }

    /// Restores the checkpointed of `procs` (pid, restore thread, checkpointed) onto `pairs`
    /// and unlocks every one, as one batch; a restore that needs `cuInit` is redone from a
    /// helper process, as in the plugin.
    pub fn restore(&self, procs: &[(i32, i32, bool)], pairs: &[GpuPair]) -> Vec<Timed> {
        let driver = &self.driver;
        self.batch_of_restores(
            procs,
            |checkpointed| match checkpointed {
                true => Step::Restore {
                    pairs,
                    unlock: true,
                },
                false => Step::Unlock,
            },
            |pid, _| expect_state(driver, pid, ProcessState::Running),
        )
    }

    /// Puts `procs` (pid, restore thread, unlock) back as they were found: restored if
    /// checkpointed, unlocked when `unlock` (the tool locked them).
    pub fn put_back(&self, procs: &[(i32, i32, bool)]) -> Vec<Timed> {
        let driver = &self.driver;
        self.batch_of_restores(
            procs,
            |unlock| Step::PutBack { unlock },
            |pid, s| check_put_back(driver, pid, matches!(s, Step::PutBack { unlock: true })),
        )
    }

    /// One batch of `step`s (of each process's flag), a restore that needs `cuInit` redone
    /// from a helper process and then checked with `check`.
    fn batch_of_restores<'a>(
        &self,
        procs: &[(i32, i32, bool)],
        step: impl Fn(bool) -> Step<'a>,
        check: impl Fn(i32, &Step<'_>) -> Result<(), CallError>,
    ) -> Vec<Timed> {
        let mut batch = Batch::new(self.parallel);
        let mut steps = Vec::new();
        let mut refused = Vec::new();
        for &(pid, tid, flag) in procs {
            match batch.add(pid, tid) {
                Ok(()) => steps.push((pid, step(flag))),
                Err(e) => refused.push((pid, Err(thread_error(tid, &e)), Duration::ZERO)),
            }
        }
        let driver = &self.driver;
        let mut ran = batch.run(|_, parallel| restore_each(driver, &steps, parallel, check));
        ran.log_not_stopped();
        ran.phase.log("restore");
        let mut results = std::mem::take(&mut ran.results);
        results.extend(refused);
        results
    }

    /// Every GPU's total and free memory from NVML (in a helper process, as the plugin asks);
    /// `None` when NVML cannot answer.
    pub fn gpu_memory(&self) -> Option<BTreeMap<GpuUuid, GpuMemory>> {
        let local = gpus::read_gpus(&self.settings.nvidia_proc, &self.settings.nvidia_dev).ok()?;
        let uuids: Vec<GpuUuid> = local.iter().map(|g| g.uuid).collect();
        match helper::query_memory(&self.settings.nvml, &uuids) {
            Ok(m) => Some(m),
            Err(e) => {
                log::info!("GPU memory unknown: {e}");
                None
            }
        }
    }

    /// The GPUs `pid` holds open (`/dev/nvidiaN` among its files), by UUID.
    pub fn gpus_of(&self, pid: i32) -> Vec<GpuUuid> {
        let Ok(local) = gpus::read_gpus(&self.settings.nvidia_proc, &self.settings.nvidia_dev)
        else {
            return Vec::new();
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return Vec::new();
        };
        let mut minors = Vec::new();
        for fd in fds.flatten().take(1 << 16) {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let Some(n) = target.to_str().and_then(|t| t.strip_prefix("/dev/nvidia")) else {
                continue;
            };
            if let Ok(minor) = n.parse::<u32>() {
                minors.push(minor);
            }
        }
        local
            .iter()
            .filter(|g| g.minor.is_some_and(|m| minors.contains(&m)))
            .map(|g| g.uuid)
            .collect()
    }
}

/// Refuses a process the driver could not answer for: stopped, or in a frozen cgroup.
fn runnable(pid: i32, tid: i32) -> Result<(), NotRunnable> {
    if let Some(state @ ('T' | 't')) = procfs::thread_state(pid, tid) {
        if let Some(tracer) = procfs::tracer(pid).filter(|&t| t > 0 && state == 't') {
            return Err(NotRunnable::Traced {
                tracer,
                by: comm(tracer),
            });
        }
        let how = if state == 't' {
            "stopped by a debugger"
        } else {
            "stopped (SIGSTOP)"
        };
        return Err(NotRunnable::Stopped { how, pid });
    }
    if let Some(cg) = procfs::frozen_cgroup(pid) {
        return Err(NotRunnable::Frozen(cg));
    }
    Ok(())
}

fn thread_error(tid: i32, e: &std::io::Error) -> CallError {
    CallError::System {
        message: format!("cannot let restore thread {tid} run: {e}"),
        errno: criu_plugin::error::errno_of(e),
    }
}

/// Checks that `pid` ended up in `want`.
fn expect_state(driver: &Driver, pid: i32, want: ProcessState) -> Result<(), CallError> {
    let end = driver.process_state(pid)?;
    if end != want {
        return Err(CallError::Process(format!(
            "pid {pid} is {end} afterwards, not {want}"
        )));
    }
    Ok(())
}
