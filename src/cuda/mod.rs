//! NVIDIA GPUs through the CUDA driver's checkpoint API (`cuCheckpointProcess*`).
//!
//! The driver moves a process's GPU state into the process's own memory (checkpoint) and back
//! (restore); CRIU then saves and restores that memory like any other. The backend calls the
//! driver in-process through `libcuda.so.1` (no `cuda-checkpoint` utility), and:
//!
//! - `PAUSE_DEVICES`: locks each CUDA process of the tree while it still runs, with CRIU's
//!   remaining `--timeout` as the lock timeout; processes found locked or checkpointed by someone
//!   else are left as found.
//! - `CHECKPOINT_DEVICES`: on the first call, checkpoints every locked process of the tree at
//!   once (driver calls on worker threads; ptrace stays on CRIU's thread), then writes
//!   [`metadata::FILE_NAME`].
//! - `exit` after a failed dump, or with `--leave-running`/`--leave-stopped`: every process it
//!   touched is restored and unlocked, back to the state it was found in.
//! - restore `init`: reads the metadata and refuses early what cannot work (older driver, GPUs
//!   missing or of another model); plans the GPU map.
//! - `RESUME_DEVICES_LATE`: on the first call, restores and unlocks every process at once.
//!
//! The inventory name is `cuda_plugin`, the C plugin's, so images move between the two.

pub mod gpus;
pub mod metadata;
pub mod nvml;
pub mod restore_thread;

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criu_plugin::{CriuSymbols, FinalState, HookError, HookResult, InventoryListing, Stage};
use cuda_ckpt_sys::{Driver, DriverError, GpuPair, ProcessState};

use crate::backend::{GpuBackend, InitContext};
use gpus::Gpu;
use metadata::{CudaMetadata, FoundState, ProcessRecord};
use restore_thread::with_threads_running;

/// Inventory name of CRIU's C plugin, kept so images move both ways.
pub const INVENTORY_NAME: &CStr = c"cuda_plugin";

/// Lock timeout when CRIU has no alarm running.
const DEFAULT_LOCK_TIMEOUT_MS: u64 = 10_000;
/// Time kept back from CRIU's alarm so that a lock timeout is reported by us, not by SIGALRM.
const ALARM_MARGIN: Duration = Duration::from_millis(500);

/// The backend's settings, from [`crate::config::Config`].
#[derive(Clone, Debug)]
pub struct CudaSettings {
    /// Library to load; `None` = `libcuda.so.1` from the search path.
    pub libcuda: Option<PathBuf>,
    /// Directory listing the kernel driver's GPUs.
    pub nvidia_proc: PathBuf,
    /// Checkpoint and restore all processes at once.
    pub parallel: bool,
    /// Lock timeout when CRIU sets none.
    pub lock_timeout_ms: u64,
    /// Explicit restore GPU map.
    pub device_map: Vec<GpuPair>,
    /// NVML library for memory sizes.
    pub nvml: String,
}

impl CudaSettings {
    fn from_config(cfg: &crate::config::Config) -> Result<CudaSettings, String> {
        Ok(CudaSettings {
            libcuda: cfg.get("libcuda").map(PathBuf::from),
            nvidia_proc: PathBuf::from(
                cfg.get("cuda.nvidia-proc")
                    .unwrap_or("/proc/driver/nvidia/gpus"),
            ),
            parallel: cfg.get_bool("cuda.parallel", true)?,
            lock_timeout_ms: cfg.get_u64("cuda.lock-timeout-ms", DEFAULT_LOCK_TIMEOUT_MS)?,
            device_map: gpus::parse_device_map(cfg.get("cuda.device-map").unwrap_or(""))?,
            nvml: cfg.get("nvml").unwrap_or("libnvidia-ml.so.1").to_string(),
        })
    }
}

/// What the backend did to one process during a dump.
#[derive(Debug)]
struct DumpedProcess {
    pid: i32,
    restore_tid: i32,
    found: FoundState,
    locked_by_us: bool,
    checkpointed_by_us: bool,
    rss_before: u64,
    host_bytes: u64,
    result: Option<HookResult>,
}

/// Checkpoint and restore of CUDA processes.
#[derive(Default)]
pub struct CudaBackend {
    stage: Option<Stage>,
    settings: Option<CudaSettings>,
    driver: Option<Driver>,
    driver_version: i32,
    gpus: Vec<Gpu>,
    // Dump.
    dumped: BTreeMap<i32, DumpedProcess>,
    inventory_added: bool,
    // Restore.
    metadata: Option<CudaMetadata>,
    gpu_map: Vec<GpuPair>,
    resume_results: Option<BTreeMap<i32, HookResult>>,
}

fn driver_errno(e: &DriverError) -> HookError {
    HookError::Errno(-e.errno())
}

fn fail(errno: i32, msg: impl std::fmt::Display) -> HookError {
    log::error!("{msg}");
    HookError::Errno(errno)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Resident memory of a process in bytes (0 when it cannot be read).
fn rss_bytes(pid: i32) -> u64 {
    let mut text = String::new();
    let ok = std::fs::File::open(format!("/proc/{pid}/status"))
        .and_then(|f| f.take(64 * 1024).read_to_string(&mut text))
        .is_ok();
    if !ok {
        return 0;
    }
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// The kernel driver's release from `version` beside the GPU listing (normally
/// `/proc/driver/nvidia/version`).
fn read_driver_release(gpus_dir: &std::path::Path) -> Option<String> {
    let mut text = String::new();
    std::fs::File::open(gpus_dir.parent()?.join("version"))
        .and_then(|f| f.take(4096).read_to_string(&mut text))
        .ok()?;
    // "NVRM version: NVIDIA UNIX [Open ]Kernel Module for x86_64  580.159.04  Release Build ..."
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| {
            w.split('.').count() >= 2
                && w.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

/// Opens `name` in CRIU's image directory (relative to its fd; never a path from an image).
fn open_image(name: &str, write: bool) -> std::io::Result<Option<std::fs::File>> {
    let Some(dir) = CriuSymbols::get().image_dir_fd() else {
        return Ok(None);
    };
    let cname = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    let flags = if write {
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC
    } else {
        libc::O_RDONLY | libc::O_CLOEXEC
    };
    // SAFETY: openat with CRIU's image directory fd and a NUL-terminated relative name.
    let fd = unsafe { libc::openat(dir, cname.as_ptr(), flags, 0o600) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        if !write && e.kind() == std::io::ErrorKind::NotFound {
            return Ok(None);
        }
        return Err(e);
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(Some(std::fs::File::from(unsafe {
        OwnedFd::from_raw_fd(fd)
    })))
}

/// Fills in each GPU's total memory from NVML and returns the free memory by UUID, or `None`
/// (with a log line) when NVML cannot answer.
fn fill_memory(nvml: &str, gpus: &mut [Gpu]) -> Option<BTreeMap<cuda_ckpt_sys::GpuUuid, u64>> {
    let t = Instant::now();
    let uuids: Vec<_> = gpus.iter().map(|g| g.uuid).collect();
    match nvml::query_memory(nvml, &uuids) {
        Ok(mem) => {
            for g in gpus.iter_mut() {
                if let Some(m) = mem.get(&g.uuid) {
                    g.memory = m.total;
                }
            }
            log::debug!("cuda: NVML memory query {:.1} ms", ms(t.elapsed()));
            Some(mem.into_iter().map(|(u, m)| (u, m.free)).collect())
        }
        Err(e) => {
            log::info!("cuda: GPU memory sizes unknown ({e}); the free-memory check is skipped");
            None
        }
    }
}

impl CudaBackend {
    /// A backend with nothing set up yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn driver(&self) -> &Driver {
        self.driver
            .as_ref()
            .expect("an active CUDA backend always has a driver")
    }

    fn settings(&self) -> &CudaSettings {
        self.settings
            .as_ref()
            .expect("an active CUDA backend always has settings")
    }

    fn load_driver(&mut self) -> Result<(), String> {
        let s = self.settings();
        let driver = match &s.libcuda {
            Some(p) => Driver::open(p),
            None => Driver::open_default(),
        }
        .map_err(|e| e.to_string())?;
        self.driver_version = driver.check_checkpoint_support().map_err(|e| {
            format!(
                "{e}: the CUDA checkpoint API needs driver 570 or later (CUDA {})",
                cuda_ckpt_sys::format_version(cuda_ckpt_sys::MIN_CHECKPOINT_VERSION)
            )
        })?;
        self.driver = Some(driver);
        Ok(())
    }

    fn init_dump(&mut self) -> Result<bool, HookError> {
        let proc_dir = self.settings().nvidia_proc.clone();
        if !proc_dir.is_dir() {
            log::info!(
                "cuda: no NVIDIA driver here ({} is missing): the NVIDIA side is off",
                proc_dir.display()
            );
            return Ok(false);
        }
        if let Err(e) = self.load_driver() {
            log::warn!("cuda: NVIDIA driver present but CUDA checkpointing is off: {e}");
            return Ok(false);
        }
        self.gpus = gpus::read_gpus(&proc_dir, std::path::Path::new("/dev"))
            .map_err(|e| fail(libc::EIO, e))?;
        let nvml = self.settings().nvml.clone();
        fill_memory(&nvml, &mut self.gpus);
        // Locking needs runnable tasks: keep CRIU from freezing the cgroup before PAUSE_DEVICES.
        if !CriuSymbols::get().request_interrupt_only_mode() {
            log::debug!("cuda: this CRIU has no interrupt-only seize mode");
        }
        log::info!(
            "cuda: driver {} (CUDA {}), {} GPU(s)",
            read_driver_release(&self.settings().nvidia_proc)
                .as_deref()
                .unwrap_or("of unknown release"),
            cuda_ckpt_sys::format_version(self.driver_version),
            self.gpus.len()
        );
        Ok(true)
    }

    fn init_restore(&mut self, listing: InventoryListing) -> Result<bool, HookError> {
        let md = match open_image(metadata::FILE_NAME, false) {
            Ok(Some(mut f)) => {
                let mut text = String::new();
                Read::by_ref(&mut f)
                    .take(metadata::MAX_BYTES + 1)
                    .read_to_string(&mut text)
                    .map_err(|e| {
                        fail(
                            libc::EIO,
                            format!("cannot read {}: {e}", metadata::FILE_NAME),
                        )
                    })?;
                Some(CudaMetadata::decode(&text).map_err(|e| fail(libc::EINVAL, e))?)
            }
            Ok(None) => None,
            Err(e) => {
                return Err(fail(
                    libc::EIO,
                    format!("cannot open {}: {e}", metadata::FILE_NAME),
                ));
            }
        };
        let proc_dir = self.settings().nvidia_proc.clone();
        let Some(md) = md else {
            // No metadata: an image from CRIU's C plugin, or one without CUDA processes.
            return match listing {
                InventoryListing::NotListed => Ok(false),
                // Old images list nothing: CUDA may or may not be in there.
                InventoryListing::NoList => Ok(proc_dir.is_dir() && self.load_driver().is_ok()),
                InventoryListing::Listed => {
                    if !proc_dir.is_dir() {
                        return Err(fail(
                            libc::ENODEV,
                            format!(
                                "the image needs cuda_plugin (it holds CUDA processes) but this machine has no NVIDIA driver ({} is missing)",
                                proc_dir.display()
                            ),
                        ));
                    }
                    self.load_driver().map_err(|e| {
                        fail(
                            libc::ENODEV,
                            format!("the image holds CUDA processes but {e}"),
                        )
                    })?;
                    Ok(true)
                }
            };
        };
        if md.processes.is_empty() {
            return Ok(false);
        }
        if !proc_dir.is_dir() {
            return Err(fail(
                libc::ENODEV,
                format!(
                    "the image holds {} CUDA process(es) but this machine has no NVIDIA driver ({} is missing)",
                    md.processes.len(),
                    proc_dir.display()
                ),
            ));
        }
        self.load_driver().map_err(|e| {
            fail(
                libc::ENODEV,
                format!("the image holds CUDA processes but {e}"),
            )
        })?;
        if self.driver_version < md.driver_version {
            return Err(fail(
                libc::EINVAL,
                format!(
                    "the image was made with CUDA driver {} (CUDA {}); this machine's driver supports only CUDA {}",
                    md.driver_release.as_deref().unwrap_or("?"),
                    cuda_ckpt_sys::format_version(md.driver_version),
                    cuda_ckpt_sys::format_version(self.driver_version)
                ),
            ));
        }
        let local = gpus::read_gpus(&proc_dir, std::path::Path::new("/dev"))
            .map_err(|e| fail(libc::EIO, e))?;
        let plan =
            gpus::plan_gpu_map(&md.gpus, &local, &self.settings().device_map).map_err(|e| {
                fail(
                    libc::ENODEV,
                    format!("cannot restore onto this machine's GPUs: {e}"),
                )
            })?;
        if gpus::is_identity(&plan) {
            self.gpu_map = Vec::new();
        } else {
            for p in &plan {
                log::info!("cuda: GPU {} restores onto {}", p.old, p.new);
            }
            if self.driver_version < cuda_ckpt_sys::GPU_PAIRS_VERSION {
                return Err(fail(
                    libc::EOPNOTSUPP,
                    "restoring onto other GPUs needs driver 580 (CUDA 13.0) or later",
                ));
            }
            self.gpu_map = plan;
        }
        self.gpus = local;
        log::info!(
            "cuda: {} CUDA process(es) to restore, checked against {} local GPU(s)",
            md.processes.len(),
            self.gpus.len()
        );
        self.metadata = Some(md);
        Ok(true)
    }

    /// The lock timeout: what is left of CRIU's alarm, less a margin, else the setting.
    fn lock_timeout_ms(&self) -> u32 {
        let ms = match criu_plugin::symbols::alarm_remaining() {
            Some(left) => left.saturating_sub(ALARM_MARGIN).as_millis().max(100) as u64,
            None => self.settings().lock_timeout_ms,
        };
        ms.min(u32::MAX as u64) as u32
    }

    fn checkpoint_all(&mut self) {
        for p in self.dumped.values_mut() {
            if p.found == FoundState::Checkpointed && p.result.is_none() {
                p.result = Some(Ok(()));
            }
        }
        let pids: Vec<i32> = self
            .dumped
            .values()
            .filter(|p| p.result.is_none())
            .map(|p| p.pid)
            .collect();
        for pid in &pids {
            let p = self.dumped.get_mut(pid).unwrap();
            p.rss_before = rss_bytes(*pid);
        }
        let tids: Vec<i32> = pids
            .iter()
            .map(|pid| self.dumped[pid].restore_tid)
            .collect();
        let started = Instant::now();
        let parallel = self.settings().parallel;
        let driver = self.driver();
        let outcome = with_threads_running(&tids, || {
            run_each(&pids, parallel, |pid| driver.checkpoint(pid))
        });
        let wall = started.elapsed();
        let mut driver_times = Vec::new();
        match outcome {
            Err(e) => {
                log::error!("cuda: {e}");
                for pid in &pids {
                    self.dumped.get_mut(pid).unwrap().result =
                        Some(Err(HookError::Errno(e.raw_os_error().unwrap_or(libc::EIO))));
                }
            }
            Ok(results) => {
                for (pid, r, took) in results {
                    driver_times.push(took);
                    let p = self.dumped.get_mut(&pid).unwrap();
                    match r {
                        Ok(()) => {
                            p.checkpointed_by_us = true;
                            p.host_bytes = rss_bytes(pid).saturating_sub(p.rss_before);
                            log::info!(
                                "cuda: pid {pid}: checkpoint {:.1} ms, {} MiB moved to host memory",
                                ms(took),
                                p.host_bytes >> 20
                            );
                            p.result = Some(Ok(()));
                        }
                        Err(e) => {
                            log::error!("cuda: pid {pid}: {e}");
                            p.result = Some(Err(driver_errno(&e)));
                        }
                    }
                }
            }
        }
        log_phase("checkpoint", &pids, wall, &driver_times, parallel);
        if self
            .dumped
            .values()
            .all(|p| matches!(p.result, Some(Ok(()))))
        {
            if let Err(e) = self.write_metadata() {
                let err = fail(
                    libc::EIO,
                    format!("cannot write {}: {e}", metadata::FILE_NAME),
                );
                if let Some(p) = self.dumped.values_mut().next() {
                    p.result = Some(Err(err));
                }
            }
        }
    }

    fn write_metadata(&self) -> std::io::Result<()> {
        let md = CudaMetadata {
            driver_version: self.driver_version,
            driver_release: read_driver_release(&self.settings().nvidia_proc),
            gpus: self.gpus.clone(),
            processes: self
                .dumped
                .values()
                .map(|p| ProcessRecord {
                    pid: p.pid,
                    restore_tid: p.restore_tid,
                    found: p.found,
                    host_bytes: p.host_bytes,
                })
                .collect(),
        };
        match open_image(metadata::FILE_NAME, true)? {
            Some(mut f) => f.write_all(md.encode().as_bytes()),
            None => {
                log::warn!("cuda: CRIU gave no image directory; metadata not written");
                Ok(())
            }
        }
    }

    /// Puts every process touched during the dump back as it was found.
    fn undo_dump(&mut self) {
        let touched: Vec<i32> = self
            .dumped
            .values()
            .filter(|p| p.locked_by_us || p.checkpointed_by_us)
            .map(|p| p.pid)
            .collect();
        if touched.is_empty() {
            return;
        }
        let tids: Vec<i32> = touched
            .iter()
            .map(|pid| self.dumped[pid].restore_tid)
            .collect();
        let parallel = self.settings().parallel;
        let driver = self.driver();
        let dumped = &self.dumped;
        let started = Instant::now();
        let outcome = with_threads_running(&tids, || {
            run_each(&touched, parallel, |pid| {
                let p = &dumped[&pid];
                if p.checkpointed_by_us {
                    driver.restore(pid, &[])?;
                }
                if p.locked_by_us {
                    driver.unlock(pid)?;
                }
                Ok::<(), DriverError>(())
            })
        });
        match outcome {
            Err(e) => log::error!("cuda: cannot give processes their GPUs back: {e}"),
            Ok(results) => {
                for (pid, r, took) in results {
                    match r {
                        Ok(()) => log::info!(
                            "cuda: pid {pid}: back to {} in {:.1} ms",
                            match dumped[&pid].found {
                                FoundState::Running => "running",
                                _ => "locked",
                            },
                            ms(took)
                        ),
                        Err(e) => {
                            log::error!("cuda: pid {pid}: could not be put back as found: {e}")
                        }
                    }
                }
            }
        }
        log::info!(
            "cuda: {} process(es) put back in {:.1} ms",
            touched.len(),
            ms(started.elapsed())
        );
    }

    fn resume_all(&mut self) {
        let md = self.metadata.as_ref().expect("resume_all needs metadata");
        let mut results = BTreeMap::new();
        let todo: Vec<&ProcessRecord> = md
            .processes
            .iter()
            .filter(|p| p.found != FoundState::Checkpointed)
            .collect();
        for p in md
            .processes
            .iter()
            .filter(|p| p.found == FoundState::Checkpointed)
        {
            log::info!("cuda: pid {}: was checkpointed when dumped; left so", p.pid);
            results.insert(p.pid, Ok(()));
        }
        let pids: Vec<i32> = todo.iter().map(|p| p.pid).collect();
        let tids: Vec<i32> = todo.iter().map(|p| p.restore_tid).collect();
        let driver = self.driver();
        let pairs = &self.gpu_map;
        let parallel = self.settings().parallel;
        let found: BTreeMap<i32, FoundState> = todo.iter().map(|p| (p.pid, p.found)).collect();
        let started = Instant::now();
        let mut driver_times = Vec::new();
        let outcome = with_threads_running(&tids, || {
            run_each(&pids, parallel, |pid| {
                driver.restore(pid, pairs)?;
                if found[&pid] == FoundState::Running {
                    driver.unlock(pid)?;
                }
                Ok::<(), DriverError>(())
            })
        });
        match outcome {
            Err(e) => {
                log::error!("cuda: {e}");
                for pid in &pids {
                    results.insert(*pid, Err(HookError::Errno(libc::EIO)));
                }
            }
            Ok(rs) => {
                for (pid, r, took) in rs {
                    driver_times.push(took);
                    match r {
                        Ok(()) => {
                            log::info!("cuda: pid {pid}: restore and unlock {:.1} ms", ms(took));
                            results.insert(pid, Ok(()));
                        }
                        Err(e) => {
                            log::error!("cuda: pid {pid}: {e}");
                            results.insert(pid, Err(driver_errno(&e)));
                        }
                    }
                }
            }
        }
        log_phase("restore", &pids, started.elapsed(), &driver_times, parallel);
        self.resume_results = Some(results);
    }

    /// Restore of an image without our metadata (CRIU's C plugin made it): one process at a time.
    fn resume_one(&mut self, pid: i32) -> HookResult {
        let driver = self.driver();
        let Ok(tid) = driver.restore_thread_id(pid) else {
            return Err(HookError::NotMine);
        };
        let started = Instant::now();
        let r = with_threads_running(&[tid], || {
            driver.restore(pid, &[])?;
            driver.unlock(pid)
        })
        .map_err(|e| fail(e.raw_os_error().unwrap_or(libc::EIO), format!("cuda: {e}")))?;
        r.map_err(|e| fail(-e.errno(), format!("cuda: pid {pid}: {e}")))?;
        log::info!(
            "cuda: pid {pid}: restore and unlock {:.1} ms",
            ms(started.elapsed())
        );
        Ok(())
    }
}

/// Logs a phase's figures: wall time, the longest driver call, and what the plugin itself added
/// (thread start, ptrace, bookkeeping), in total and per process.
fn log_phase(what: &str, pids: &[i32], wall: Duration, driver: &[Duration], parallel: bool) {
    let longest = if parallel {
        driver.iter().copied().max().unwrap_or_default()
    } else {
        driver.iter().sum()
    };
    let own = wall.saturating_sub(longest);
    log::info!(
        "cuda: {what} phase: {} process(es) {}, {:.1} ms wall, {:.1} ms in the driver, plugin own time {:.3} ms ({:.3} ms per process)",
        pids.len(),
        if parallel {
            "at once"
        } else {
            "one after another"
        },
        ms(wall),
        ms(longest),
        ms(own),
        ms(own) / pids.len().max(1) as f64
    );
}

/// Runs `op` for every pid, on worker threads when `parallel`, and reports each result with the
/// time it took.
fn run_each<E: Send>(
    pids: &[i32],
    parallel: bool,
    op: impl Fn(i32) -> Result<(), E> + Sync,
) -> Vec<(i32, Result<(), E>, Duration)> {
    let timed = |pid: i32| {
        let t = Instant::now();
        let r = op(pid);
        (pid, r, t.elapsed())
    };
    if !parallel || pids.len() < 2 {
        return pids.iter().map(|&pid| timed(pid)).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = pids
            .iter()
            .map(|&pid| {
                let timed = &timed;
                std::thread::Builder::new()
                    .name(format!("cuda-{pid}"))
                    .spawn_scoped(s, move || timed(pid))
            })
            .collect();
        handles
            .into_iter()
            .zip(pids)
            .map(|(h, &pid)| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| panic!("worker for pid {pid} panicked")),
                // No thread could be started: do it here.
                Err(_) => timed(pid),
            })
            .collect()
    })
}

impl GpuBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn inventory_name(&self) -> &'static CStr {
        INVENTORY_NAME
    }

    fn init(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<bool, HookError> {
        *self = CudaBackend::new();
        self.settings = Some(
            CudaSettings::from_config(ctx.config)
                .map_err(|e| fail(libc::EINVAL, format!("settings: {e}")))?,
        );
        self.stage = Some(stage);
        match stage {
            // Nothing would unlock a process locked in pre-dump: CRIU calls no exit there.
            Stage::PreDump => Ok(false),
            Stage::Dump => self.init_dump(),
            Stage::Restore => self.init_restore(ctx.listing),
        }
    }

    fn pause(&mut self, pid: i32) -> HookResult {
        if self.stage != Some(Stage::Dump) {
            return Err(HookError::NotMine);
        }
        if self.dumped.contains_key(&pid) {
            // CRIU may ask again for a child after a failed seize attempt.
            return Ok(());
        }
        let started = Instant::now();
        let mut in_driver = Duration::ZERO;
        let driver = self.driver();
        let t = Instant::now();
        let tid_result = driver.restore_thread_id(pid);
        in_driver += t.elapsed();
        let tid = match tid_result {
            Ok(tid) => tid,
            Err(e) => {
                log::debug!("cuda: pid {pid} is not a CUDA process ({e})");
                return Err(HookError::NotMine);
            }
        };
        let t = Instant::now();
        let state = driver
            .process_state(pid)
            .map_err(|e| fail(-e.errno(), format!("cuda: {e}")))?;
        in_driver += t.elapsed();
        let (found, locked_by_us) = match state {
            ProcessState::Running => {
                let timeout = self.lock_timeout_ms();
                let t = Instant::now();
                driver.lock(pid, timeout).map_err(|e| {
                    let why = if e.errno() == -libc::ETIMEDOUT {
                        format!(
                            "; its GPU work did not finish within {timeout} ms (raise CRIU's --timeout)"
                        )
                    } else {
                        String::new()
                    };
                    fail(-e.errno(), format!("cuda: {e}{why}"))
                })?;
                in_driver += t.elapsed();
                log::debug!("cuda: pid {pid}: lock {:.2} ms", ms(t.elapsed()));
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
                return Err(fail(
                    libc::EIO,
                    format!("cuda: pid {pid} is in CUDA state {other}; it cannot be checkpointed"),
                ));
            }
        };
        self.dumped.insert(
            pid,
            DumpedProcess {
                pid,
                restore_tid: tid,
                found,
                locked_by_us,
                checkpointed_by_us: false,
                rss_before: 0,
                host_bytes: 0,
                result: None,
            },
        );
        if !self.inventory_added {
            CriuSymbols::get()
                .add_inventory_plugin(INVENTORY_NAME)
                .map_err(|e| {
                    fail(
                        libc::ENOMEM,
                        format!("cuda: cannot record the plugin in the inventory ({e})"),
                    )
                })?;
            self.inventory_added = true;
        }
        let total = started.elapsed();
        log::info!(
            "cuda: pid {pid} (restore thread {tid}) paused: {:.2} ms in the driver, plugin own time {:.3} ms",
            ms(in_driver),
            ms(total.saturating_sub(in_driver))
        );
        Ok(())
    }

    fn checkpoint(&mut self, pid: i32) -> HookResult {
        if self.stage != Some(Stage::Dump) || !self.dumped.contains_key(&pid) {
            return Err(HookError::NotMine);
        }
        // The first call checkpoints every paused process at once; a process paused after that
        // batch (CRIU found it late) gets a batch of its own.
        if self.dumped[&pid].result.is_none() {
            self.checkpoint_all();
        }
        // Every process gets its own answer; the first error fails the dump.
        self.dumped[&pid]
            .result
            .unwrap_or(Err(HookError::Errno(libc::EIO)))
    }

    fn resume(&mut self, pid: i32) -> HookResult {
        if self.stage != Some(Stage::Restore) {
            return Err(HookError::NotMine);
        }
        let Some(md) = &self.metadata else {
            return self.resume_one(pid);
        };
        if !md.processes.iter().any(|p| p.pid == pid) {
            return Err(HookError::NotMine);
        }
        if self.resume_results.is_none() {
            self.resume_all();
        }
        self.resume_results
            .as_ref()
            .and_then(|r| r.get(&pid).copied())
            .unwrap_or(Err(HookError::Errno(libc::EIO)))
    }

    fn finish(&mut self, stage: Stage, ret: i32) {
        if stage == Stage::Dump && self.driver.is_some() {
            let final_state = CriuSymbols::get().final_state();
            let put_back = ret != 0 || !matches!(final_state, Some(FinalState::Dead));
            if put_back {
                log::info!(
                    "cuda: dump {} (final state {final_state:?}): putting processes back",
                    if ret != 0 { "failed" } else { "done" }
                );
                self.undo_dump();
            }
        }
        *self = CudaBackend::new();
    }
}
