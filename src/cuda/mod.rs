//! NVIDIA GPUs through the CUDA driver's checkpoint API (`cuCheckpointProcess*`).
//!
//! The driver moves a process's GPU state into the process's own memory (checkpoint) and back
//! (restore); CRIU then saves and restores that memory like any other. The backend calls the
//! driver in-process through `libcuda.so.1` (no `cuda-checkpoint` utility), and:
//!
//! - `PAUSE_DEVICES`: locks each CUDA process of the tree while it still runs, with CRIU's
//!   remaining `--timeout` as the lock timeout; processes found locked or checkpointed by someone
//!   else are left as found. A stopped process or a frozen cgroup is refused with a reason
//!   instead of a driver call that would never return.
//! - `CHECKPOINT_DEVICES`: on the first call, checkpoints every locked process of the tree at
//!   once (driver calls on worker threads; ptrace stays on CRIU's thread), then writes
//!   [`metadata::FILE_NAME`].
//! - `exit` after a failed dump, or with `--leave-running`/`--leave-stopped`: every process it
//!   touched is restored and unlocked, back to the state it was found in.
//! - restore `init`: reads the metadata and refuses early what cannot work (older driver, GPUs
//!   missing or of another model, too little free GPU memory); plans the GPU map.
//! - `RESUME_DEVICES_LATE`: on the first call (CRIU calls it for the root first), restores and
//!   unlocks every process of the restored tree at once. Processes are matched by their pid in
//!   their own pid namespace, which a container keeps across a restore while the host pid
//!   changes.
//!
//! The inventory name is `cuda_plugin`, the C plugin's, so images move between the two.

pub mod exclusive;
pub mod gpus;
pub mod helper;
pub mod metadata;
pub mod nvml;
pub mod procfs;
pub mod restore_thread;
pub mod worker;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CStr;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criu_plugin::symbols::AlarmSuspended;
use criu_plugin::{CriuSymbols, FinalState, HookError, HookResult, InventoryListing, Stage};
use cuda_ckpt_sys::{CUresult, Driver, DriverError, GpuPair, ProcessState};

use crate::backend::{GpuBackend, InitContext};
use gpus::Gpu;
use metadata::{CudaMetadata, FoundState, ProcessRecord};
use restore_thread::RunningThreads;

/// Inventory name of CRIU's C plugin, kept so images move both ways.
pub const INVENTORY_NAME: &CStr = c"cuda_plugin";

/// Lock timeout when CRIU has no alarm running.
const DEFAULT_LOCK_TIMEOUT_MS: u64 = 10_000;
/// Time kept back from CRIU's alarm so that a lock timeout is reported by us, not by SIGALRM.
const ALARM_MARGIN: Duration = Duration::from_millis(500);
/// How much longer than its own timeout a lock may take before the plugin gives up on it.
const LOCK_GRACE: Duration = Duration::from_secs(2);

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
    /// Explicit restore GPU map, as written (parsed when a restore needs it).
    pub device_map: String,
    /// NVML library for memory sizes.
    pub nvml: String,
}

impl CudaSettings {
    /// Reads the settings; a bad value is warned about and replaced by its default, since a
    /// typo in a GPU setting must not fail every CRIU run on the host.
    fn from_config(cfg: &crate::config::Config) -> CudaSettings {
        let parallel = cfg.get_bool("cuda.parallel", true).unwrap_or_else(|e| {
            log::warn!("cuda: settings: {e}; using true");
            true
        });
        // 0 would ask the driver to wait for good: a lock must always end by itself.
        let lock_timeout_ms = match cfg.get_u64("cuda.lock-timeout-ms", DEFAULT_LOCK_TIMEOUT_MS) {
            Ok(0) => {
                log::warn!(
                    "cuda: settings: cuda.lock-timeout-ms = 0 would wait for good; using {DEFAULT_LOCK_TIMEOUT_MS}"
                );
                DEFAULT_LOCK_TIMEOUT_MS
            }
            Ok(n) => n.min(u64::from(u32::MAX)),
            Err(e) => {
                log::warn!("cuda: settings: {e}; using {DEFAULT_LOCK_TIMEOUT_MS}");
                DEFAULT_LOCK_TIMEOUT_MS
            }
        };
        CudaSettings {
            libcuda: cfg.get("libcuda").map(PathBuf::from),
            nvidia_proc: PathBuf::from(
                cfg.get("cuda.nvidia-proc")
                    .unwrap_or("/proc/driver/nvidia/gpus"),
            ),
            parallel,
            lock_timeout_ms,
            device_map: cfg.get("cuda.device-map").unwrap_or("").to_string(),
            nvml: cfg.get("nvml").unwrap_or("libnvidia-ml.so.1").to_string(),
        }
    }
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
    result: Option<HookResult>,
    /// Start time when paused: tells the process from a later one with its pid.
    start_time: Option<u64>,
}

/// Checkpoint and restore of CUDA processes.
#[derive(Default)]
pub struct CudaBackend {
    stage: Option<Stage>,
    settings: Option<CudaSettings>,
    driver: Option<Arc<Driver>>,
    driver_version: i32,
    gpus: Vec<Gpu>,
    // Dump.
    dumped: BTreeMap<i32, DumpedProcess>,
    /// Processes whose lock the plugin stopped waiting for: it may complete later, and must
    /// not leave them locked.
    abandoned_locks: Vec<(i32, Option<u64>)>,
    /// This CRIU's claims on the processes it dumps, held until `exit`.
    claims: BTreeMap<i32, exclusive::Claim>,
    inventory_added: bool,
    // Restore.
    metadata: Option<CudaMetadata>,
    gpu_map: Vec<GpuPair>,
    /// Results by host pid, once the restore batch has run.
    resume_results: Option<BTreeMap<i32, HookResult>>,
}

fn fail(errno: i32, msg: impl std::fmt::Display) -> HookError {
    log::error!("{msg}");
    HookError::Errno(errno)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The kernel driver's release from `version` beside the GPU listing (normally
/// `/proc/driver/nvidia/version`).
fn read_driver_release(gpus_dir: &Path) -> Option<String> {
    let mut text = String::new();
    let bytes =
        criu_plugin::files::read_regular(None, &gpus_dir.parent()?.join("version"), false, 4096)
            .ok()?;
    text.push_str(&String::from_utf8_lossy(&bytes));
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
    // SAFETY: CRIU keeps its image directory fd open for the whole run.
    let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(dir) };
    if !write {
        return match criu_plugin::files::open_regular(Some(dir), Path::new(name), true) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        };
    }
    let cname = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    // O_NONBLOCK and O_NOFOLLOW: a FIFO or a link left in the image directory must neither
    // block the dump nor be written through.
    let flags = libc::O_WRONLY
        | libc::O_CREAT
        | libc::O_TRUNC
        | libc::O_CLOEXEC
        | libc::O_NONBLOCK
        | libc::O_NOFOLLOW;
    // SAFETY: openat with CRIU's image directory fd and a NUL-terminated relative name.
    let fd = unsafe {
        libc::openat(
            std::os::fd::AsRawFd::as_raw_fd(&dir),
            cname.as_ptr(),
            flags,
            0o600,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    if !f.metadata()?.file_type().is_file() {
        return Err(std::io::Error::other(format!(
            "{name} is not a regular file"
        )));
    }
    Ok(Some(f))
}

/// Ends the restored processes `tree` after `failed` (some of them) could not get their GPU
/// state back. CRIU ignores what `RESUME_DEVICES_LATE` returns, so the processes would
/// otherwise run on frozen behind "Restore finished successfully"; once they are gone, CRIU's
/// own detach from them fails and CRIU fails the restore. The image is left as it is, for
/// another try.
fn end_restored(tree: &[i32], failed: &[i32]) {
    log::error!(
        "cuda: the GPU state of pid(s) {} could not be restored: ending the {} restored process(es) so that the restore fails instead of leaving them frozen; the image is unchanged for another try",
        list_pids(failed),
        tree.len()
    );
    for &pid in tree {
        // SAFETY: kill(2) of a task this restore created (CRIU still holds it under ptrace).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Up to eight pids, then how many more: a hostile image must not make a huge message.
fn list_pids(pids: &[i32]) -> String {
    let mut s: Vec<String> = pids.iter().take(8).map(|p| p.to_string()).collect();
    if pids.len() > 8 {
        s.push(format!("and {} more", pids.len() - 8));
    }
    s.join(", ")
}

/// The sum of sizes that come from an image or a driver, saturating instead of wrapping: a
/// record claiming 2^64 − 1 bytes must not add up with another to a small number.
fn total_bytes(sizes: impl Iterator<Item = u64>) -> u64 {
    sizes.fold(0, u64::saturating_add)
}

/// Refuses a configured library path that is not a regular file: `dlopen` of a FIFO blocks
/// for good.
fn library_file(p: &Path) -> Result<(), String> {
    match std::fs::metadata(p) {
        Ok(m) if !m.is_file() => Err(format!("{} is not a regular file", p.display())),
        _ => Ok(()),
    }
}

/// Fills in each GPU's total memory from NVML and returns the free memory by UUID, or `None`
/// (with a log line) when NVML cannot answer.
fn fill_memory(nvml: &str, gpus: &mut [Gpu]) -> Option<BTreeMap<cuda_ckpt_sys::GpuUuid, u64>> {
    let t = Instant::now();
    let uuids: Vec<_> = gpus.iter().map(|g| g.uuid).collect();
    match helper::query_memory(nvml, &uuids) {
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

/// Whether the driver refused a restore because the caller has not called `cuInit` (needed
/// when persistence mode is off).
fn needs_init(r: &Result<(), DriverError>) -> bool {
    matches!(r, Err(DriverError::Cuda(e))
        if e.code == CUresult::NOT_PERMITTED && e.call == "cuCheckpointProcessRestore")
}

/// How long a restore helper may run for a batch (the C plugin's default timeout).
const RESTORE_HELPER_DEADLINE: Duration = Duration::from_secs(300);

/// Restores (and unlocks) every job: in this process first, then, for the processes the driver
/// refused for want of `cuInit`, from a helper process that calls it (`cuInit` starts threads,
/// which must not stay in CRIU's process).
fn restore_batch(
    driver: &Driver,
    jobs: &[helper::RestoreJob],
    pairs: &[GpuPair],
    parallel: bool,
) -> Vec<(i32, Result<(), DriverError>, Duration)> {
    let pids: Vec<i32> = jobs.iter().map(|j| j.pid).collect();
    let mut results = run_each(&pids, parallel, |pid| {
        let r = driver.restore(pid, pairs);
        if needs_init(&r) {
            return r;
        }
        r?;
        if jobs.iter().any(|j| j.pid == pid && j.unlock) {
            driver.unlock(pid)?;
        }
        Ok::<(), DriverError>(())
    });
    let retry: Vec<helper::RestoreJob> = results
        .iter()
        .filter(|(_, r, _)| needs_init(r))
        .filter_map(|(pid, _, _)| jobs.iter().find(|j| j.pid == *pid).copied())
        .collect();
    if retry.is_empty() {
        return results;
    }
    log::info!(
        "cuda: restore needs an initialised driver (persistence mode is off): restoring {} process(es) from a helper process that calls cuInit",
        retry.len()
    );
    let t = Instant::now();
    let redone =
        helper::restore_with_init(driver, &retry, pairs, parallel, RESTORE_HELPER_DEADLINE)
            .unwrap_or_else(|e| {
                let why = DriverError::InvalidArgument(format!("restore helper: {e}"));
                retry
                    .iter()
                    .map(|j| (j.pid, Err(why.clone()), t.elapsed()))
                    .collect()
            });
    for (pid, r, took) in redone {
        if let Some(slot) = results.iter_mut().find(|(p, _, _)| *p == pid) {
            slot.1 = r;
            slot.2 += took;
        }
    }
    results
}

/// Puts one process back as the dump found it: restore if checkpointed, unlock if we locked it.
/// A restore the driver refuses for want of `cuInit` is returned as is, for the caller to redo
/// from a helper process ([`helper::restore_with_init`]), then to check with [`check_put_back`].
fn put_back(driver: &Driver, pid: i32, unlock: bool) -> Result<(), DriverError> {
    if driver.process_state(pid)? == ProcessState::Checkpointed {
        driver.restore(pid, &[])?;
    }
    if unlock && driver.process_state(pid)? == ProcessState::Locked {
        driver.unlock(pid)?;
    }
    check_put_back(driver, pid, unlock)
}

/// Checks that a process put back is in the state the dump found it in.
fn check_put_back(driver: &Driver, pid: i32, unlock: bool) -> Result<(), DriverError> {
    let end = driver.process_state(pid)?;
    let expected = if unlock {
        ProcessState::Running
    } else {
        ProcessState::Locked
    };
    if end != expected {
        return Err(DriverError::InvalidArgument(format!(
            "pid {pid} is {end} after being put back, not {expected}"
        )));
    }
    Ok(())
}

impl CudaBackend {
    /// A backend with nothing set up yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn driver(&self) -> &Arc<Driver> {
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
        if let Some(p) = &s.libcuda {
            library_file(p)?;
        }
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
        self.driver = Some(Arc::new(driver));
        Ok(())
    }

    /// Loads the driver for a restore that cannot do without it; `why` starts the error.
    fn require_driver(&mut self, why: &str) -> HookResult {
        let proc_dir = &self.settings().nvidia_proc;
        if !proc_dir.is_dir() {
            return Err(fail(
                libc::ENODEV,
                format!(
                    "{why} but this machine has no NVIDIA driver ({} is missing)",
                    proc_dir.display()
                ),
            ));
        }
        self.load_driver()
            .map_err(|e| fail(libc::ENODEV, format!("{why} but {e}")))
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
        self.gpus = match gpus::read_gpus(&proc_dir, Path::new("/dev")) {
            Ok(g) => g,
            Err(e) => {
                log::warn!("cuda: cannot list the GPUs, CUDA checkpointing is off: {e}");
                return Ok(false);
            }
        };
        let nvml = self.settings().nvml.clone();
        fill_memory(&nvml, &mut self.gpus);
        // Locking needs runnable tasks: keep CRIU from freezing the cgroup before PAUSE_DEVICES.
        if !CriuSymbols::get().request_interrupt_only_mode() {
            log::debug!("cuda: this CRIU has no interrupt-only seize mode");
        }
        log::info!(
            "cuda: driver {} (CUDA {}), {} GPU(s)",
            read_driver_release(&proc_dir)
                .as_deref()
                .unwrap_or("of unknown release"),
            cuda_ckpt_sys::format_version(self.driver_version),
            self.gpus.len()
        );
        exclusive::sweep(64);
        Ok(true)
    }

    fn read_metadata() -> Result<Option<CudaMetadata>, HookError> {
        match open_image(metadata::FILE_NAME, false) {
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
                Ok(Some(
                    CudaMetadata::decode(&text).map_err(|e| fail(libc::EINVAL, e))?,
                ))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(fail(
                libc::EIO,
                format!("cannot open {}: {e}", metadata::FILE_NAME),
            )),
        }
    }

    fn init_restore(&mut self, listing: InventoryListing) -> Result<bool, HookError> {
        let proc_dir = self.settings().nvidia_proc.clone();
        // An image that does not need the plugin is none of its business: whatever file of
        // our name lies in it (stale, misplaced, hostile) is not even opened.
        if listing == InventoryListing::NotListed {
            return Ok(false);
        }
        let Some(md) = Self::read_metadata()? else {
            // No metadata: an image from CRIU's C plugin, or one without CUDA processes.
            return match listing {
                InventoryListing::NotListed => Ok(false),
                // Old images list nothing: CUDA may or may not be in there.
                InventoryListing::NoList => Ok(proc_dir.is_dir() && self.load_driver().is_ok()),
                InventoryListing::Listed => {
                    self.require_driver("the image needs cuda_plugin (it holds CUDA processes)")?;
                    Ok(true)
                }
            };
        };
        if md.processes.is_empty() {
            if listing == InventoryListing::Listed {
                // Our dump records every CUDA process it checkpointed: restoring on would
                // leave them checkpointed for good behind a successful restore.
                return Err(fail(
                    libc::EINVAL,
                    format!(
                        "the image needs cuda_plugin but {} records no CUDA process (truncated or edited?); its CUDA processes could not be given their GPU state back",
                        metadata::FILE_NAME
                    ),
                ));
            }
            return Ok(false);
        }
        Self::check_records_in_tree(&md)?;
        self.require_driver(&format!(
            "the image holds {} CUDA process(es)",
            md.processes.len()
        ))?;
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
        let explicit = gpus::parse_device_map(&self.settings().device_map)
            .map_err(|e| fail(libc::EINVAL, format!("settings: cuda.device-map: {e}")))?;
        let mut local = gpus::read_gpus(&proc_dir, Path::new("/dev"))
            .map_err(|e| fail(libc::EIO, format!("cannot list this machine's GPUs: {e}")))?;
        let nvml = self.settings().nvml.clone();
        let free = fill_memory(&nvml, &mut local);
        let plan = gpus::plan_gpu_map(&md.gpus, &local, &explicit).map_err(|e| {
            fail(
                libc::ENODEV,
                format!("cannot restore onto this machine's GPUs: {e}"),
            )
        })?;
        if let Some(free) = free {
            let need = total_bytes(
                md.processes
                    .iter()
                    .filter(|p| p.found != FoundState::Checkpointed)
                    .map(|p| p.host_bytes),
            );
            let targets: BTreeSet<_> = plan.iter().map(|p| p.new).collect();
            let have = total_bytes(targets.iter().filter_map(|u| free.get(u).copied()));
            nvml::check_free_memory(need, have, targets.len())
                .map_err(|e| fail(libc::ENOMEM, format!("cannot restore: {e}")))?;
        }
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

    /// Refuses records of processes the restore will not create (per the image's
    /// `pstree.img`): their GPU state would be restored nowhere, and the task that is restored
    /// in their place would stay checkpointed. Unreadable trees (`--stream`) are not checked.
    fn check_records_in_tree(md: &CudaMetadata) -> HookResult {
        let Some(dir) = CriuSymbols::get().image_dir_fd() else {
            return Ok(());
        };
        // SAFETY: CRIU keeps its image directory fd open for the whole run.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(dir) };
        let pids: BTreeSet<u32> = match criu_plugin::pstree::read_pids(dir) {
            Ok(p) => p.into_iter().collect(),
            Err(e) => {
                log::debug!("cuda: process tree not checked: {e}");
                return Ok(());
            }
        };
        let missing: Vec<i32> = md
            .processes
            .iter()
            .map(|p| p.pid)
            .filter(|&p| u32::try_from(p).map_or(true, |p| !pids.contains(&p)))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(fail(
            libc::EINVAL,
            format!(
                "{} records CUDA process(es) {} that the image's process tree does not hold (a damaged or mismatched image); the restore would leave processes without their GPU state",
                metadata::FILE_NAME,
                list_pids(&missing)
            ),
        ))
    }

    /// The lock timeout: what is left of CRIU's alarm, less a margin, else the setting.
    fn lock_timeout(&self) -> Duration {
        match criu_plugin::symbols::alarm_remaining() {
            Some(left) => left
                .saturating_sub(ALARM_MARGIN)
                .max(Duration::from_millis(100)),
            None => Duration::from_millis(self.settings().lock_timeout_ms),
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
            return Err(fail(
                libc::EBUSY,
                format!(
                    "cuda: pid {pid} is {how}; CUDA can only lock a running process: continue it before the dump"
                ),
            ));
        }
        if let Some(cg) = procfs::frozen_cgroup(pid) {
            return Err(fail(
                libc::EBUSY,
                format!(
                    "cuda: pid {pid} is in frozen cgroup {cg}; CUDA can only lock a running process: thaw it, or use CRIU 4.2 or later, which thaws it for plugins"
                ),
            ));
        }
        Ok(())
    }

    fn checkpoint_all(&mut self, current: i32) {
        // A process that went away (or was never seized) since PAUSE_DEVICES gets no
        // CHECKPOINT_DEVICES call: nothing to checkpoint and nothing to put back.
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
            if !p.locked_by_us || !Path::new(&format!("/proc/{pid}")).exists() {
                log::info!("cuda: pid {pid} ended after it was paused; dropped");
                continue;
            }
            // Locked by us but not part of this dump (CRIU did not seize it): it must not
            // stay locked.
            if procfs::start_time(pid) != p.start_time {
                log::info!("cuda: pid {pid} ended after it was paused; dropped");
                continue;
            }
            match helper::unlock_if_locked(self.driver(), pid, LOCK_GRACE) {
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
        for p in self.dumped.values_mut() {
            if p.found == FoundState::Checkpointed && p.result.is_none() {
                p.result = Some(Ok(()));
            }
        }
        let pending: Vec<i32> = self
            .dumped
            .values()
            .filter(|p| p.result.is_none())
            .map(|p| p.pid)
            .collect();
        let _alarm = AlarmSuspended::new();
        let started = Instant::now();
        let mut threads = RunningThreads::new();
        let mut runnable = Vec::with_capacity(pending.len());
        for pid in &pending {
            let p = self.dumped.get_mut(pid).unwrap();
            p.rss_before = procfs::rss_bytes(*pid);
            match threads.start(p.restore_tid) {
                Ok(()) => runnable.push(*pid),
                Err(e) => {
                    p.result = Some(Err(fail(
                        e.raw_os_error().unwrap_or(libc::EIO),
                        format!(
                            "cuda: pid {pid}: cannot let restore thread {} run: {e}",
                            p.restore_tid
                        ),
                    )))
                }
            }
        }
        let parallel = self.settings().parallel;
        let driver = self.driver().clone();
        let results = run_each(&runnable, parallel, |pid| driver.checkpoint(pid));
        let stop_failures = threads.stop_all();
        let wall = started.elapsed();
        let mut driver_times = Vec::with_capacity(results.len());
        for (pid, r, took) in results {
            driver_times.push(took);
            let p = self.dumped.get_mut(&pid).unwrap();
            match r {
                Ok(()) => {
                    p.checkpointed_by_us = true;
                    p.host_bytes = procfs::rss_bytes(pid).saturating_sub(p.rss_before);
                    log::info!(
                        "cuda: pid {pid}: checkpoint {:.1} ms, {} MiB moved to host memory",
                        ms(took),
                        p.host_bytes >> 20
                    );
                    p.result = Some(Ok(()));
                }
                Err(e) => p.result = Some(Err(fail(-e.errno(), format!("cuda: pid {pid}: {e}")))),
            }
        }
        for (tid, e) in stop_failures {
            if let Some(p) = self.dumped.values_mut().find(|p| p.restore_tid == tid) {
                p.result = Some(Err(fail(
                    e.raw_os_error().unwrap_or(libc::EIO),
                    format!(
                        "cuda: pid {}: cannot stop restore thread {tid} again: {e}",
                        p.pid
                    ),
                )));
            }
        }
        log_phase("checkpoint", &runnable, wall, &driver_times, parallel);
        // Metadata only for a dump that checkpointed something: none would restore nothing.
        if !self.dumped.is_empty()
            && self
                .dumped
                .values()
                .all(|p| matches!(p.result, Some(Ok(()))))
        {
            if let Err(e) = self.write_metadata() {
                let err = fail(
                    libc::EIO,
                    format!("cannot write {}: {e}", metadata::FILE_NAME),
                );
                if let Some(p) = self.dumped.get_mut(&current) {
                    p.result = Some(Err(err));
                }
            }
        }
    }

    fn write_metadata(&self) -> std::io::Result<()> {
        // With `--stream` a file in the images directory would not be part of the stream.
        // The metadata is optional at restore (images of CRIU's C plugin have none), so the
        // checkpoint stays complete without it; only the early GPU checks are lost.
        if let Some(s) = criu_plugin::stream::image_stream() {
            log::info!(
                "cuda: CRIU streams its images ({s:?}); {} is not written, so restore skips the early GPU checks",
                metadata::FILE_NAME
            );
            return Ok(());
        }
        let md = CudaMetadata {
            driver_version: self.driver_version,
            driver_release: read_driver_release(&self.settings().nvidia_proc),
            gpus: self.gpus.clone(),
            processes: self
                .dumped
                .values()
                .map(|p| ProcessRecord {
                    pid: p.ns_pid,
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
    /// Returns how many processes could not be put back. Those put back are forgotten as
    /// touched, so that a second call (`DUMP_FINISH` twice, then `exit`) does nothing more.
    fn undo_dump(&mut self) -> usize {
        let touched: Vec<&DumpedProcess> = self
            .dumped
            .values()
            .filter(|p| p.locked_by_us || p.checkpointed_by_us)
            .collect();
        if touched.is_empty() {
            return 0;
        }
        let _alarm = AlarmSuspended::new();
        let started = Instant::now();
        let mut threads = RunningThreads::new();
        let mut runnable = Vec::new();
        for p in &touched {
            match threads.start(p.restore_tid) {
                Ok(()) => runnable.push(p.pid),
                Err(e) => log::error!(
                    "cuda: pid {}: cannot let restore thread {} run to put it back: {e}",
                    p.pid,
                    p.restore_tid
                ),
            }
        }
        let parallel = self.settings().parallel;
        let driver = self.driver().clone();
        let dumped = &self.dumped;
        let mut results = run_each(&runnable, parallel, |pid| {
            put_back(&driver, pid, dumped[&pid].locked_by_us)
        });
        let retry: Vec<helper::RestoreJob> = results
            .iter()
            .filter(|(_, r, _)| needs_init(r))
            .map(|(pid, _, _)| helper::RestoreJob {
                pid: *pid,
                unlock: dumped[pid].locked_by_us,
            })
            .collect();
        if !retry.is_empty() {
            let redone =
                helper::restore_with_init(&driver, &retry, &[], parallel, RESTORE_HELPER_DEADLINE);
            for slot in results.iter_mut().filter(|(_, r, _)| needs_init(r)) {
                let pid = slot.0;
                slot.1 = match &redone {
                    Ok(v) => match v.iter().find(|(p, _, _)| *p == pid) {
                        Some((_, Ok(()), _)) => {
                            check_put_back(&driver, pid, dumped[&pid].locked_by_us)
                        }
                        Some((_, Err(e), _)) => Err(e.clone()),
                        None => Err(DriverError::InvalidArgument(
                            "restore helper skipped it".into(),
                        )),
                    },
                    Err(e) => Err(DriverError::InvalidArgument(format!("restore helper: {e}"))),
                };
            }
        }
        for (tid, e) in threads.stop_all() {
            log::error!("cuda: cannot stop restore thread {tid} again: {e}");
        }
        let mut driver_times = Vec::new();
        let mut back = Vec::new();
        let mut failed = touched.len() - runnable.len();
        for (pid, r, took) in results {
            driver_times.push(took);
            match r {
                Ok(()) => {
                    log::info!(
                        "cuda: pid {pid}: back to {} in {:.1} ms",
                        match dumped[&pid].found {
                            FoundState::Running => "running",
                            FoundState::Locked => "locked",
                            FoundState::Checkpointed => "checkpointed",
                        },
                        ms(took)
                    );
                    back.push(pid);
                }
                Err(e) => {
                    failed += 1;
                    log::error!("cuda: pid {pid}: could not be put back as found: {e}");
                }
            }
        }
        log_phase(
            "put-back",
            &runnable,
            started.elapsed(),
            &driver_times,
            parallel,
        );
        for pid in back {
            if let Some(p) = self.dumped.get_mut(&pid) {
                p.locked_by_us = false;
                p.checkpointed_by_us = false;
            }
        }
        failed
    }

    /// Claims `pid` for this dump; refuses it while another CRIU dumps it.
    fn claim(&mut self, pid: i32) -> HookResult {
        // Already ours (CRIU asks again after a failed seize): a second lock of the same file
        // from this process would be granted, and dropping either would release both.
        if self.claims.contains_key(&pid) {
            return Ok(());
        }
        let Some(start) = procfs::start_time(pid) else {
            return Ok(());
        };
        match exclusive::claim(pid, start) {
            Ok(c) => {
                self.claims.insert(pid, c);
                Ok(())
            }
            Err(exclusive::ClaimError::Busy) => Err(fail(
                libc::EBUSY,
                format!(
                    "cuda: pid {pid} is being checkpointed by another CRIU right now; it is left to that one (try again once it is done)"
                ),
            )),
            Err(exclusive::ClaimError::Unavailable(e)) => {
                log::debug!("cuda: pid {pid}: no claim against concurrent dumps ({e})");
                Ok(())
            }
        }
    }

    /// Unlocks the processes whose lock was abandoned, should the lock have completed since.
    fn release_abandoned_locks(&mut self) {
        let driver = self.driver().clone();
        for (pid, start) in std::mem::take(&mut self.abandoned_locks) {
            // The pid may belong to another process by now: leave that one alone.
            if start.is_none() || procfs::start_time(pid) != start {
                log::debug!("cuda: pid {pid}: ended since its lock was given up on");
                continue;
            }
            match helper::unlock_if_locked(&driver, pid, LOCK_GRACE) {
                Ok(true) => log::info!(
                    "cuda: pid {pid}: the lock given up on had completed; unlocked again"
                ),
                Ok(false) => log::debug!("cuda: pid {pid}: not locked after the abandoned lock"),
                Err(e) => log::error!(
                    "cuda: pid {pid}: cannot check whether the abandoned lock completed ({e}); if it did, the process stays locked: run `cuda-checkpoint --toggle --pid {pid}`"
                ),
            }
        }
    }

    /// Restores every process of the restored tree rooted at `root` (host pid) at once.
    fn resume_all(&mut self, root: i32) {
        let md = self.metadata.as_ref().expect("resume_all needs metadata");
        let mut results = BTreeMap::new();
        // Host pid of each recorded process: match by the pid in its own namespace.
        let mut by_ns: BTreeMap<i32, &ProcessRecord> =
            md.processes.iter().map(|p| (p.pid, p)).collect();
        let mut todo: Vec<(i32, &ProcessRecord)> = Vec::new();
        for host_pid in procfs::tree(root) {
            let ns = procfs::ns_pid(host_pid).unwrap_or(host_pid);
            if let Some(rec) = by_ns.remove(&ns) {
                if rec.found == FoundState::Checkpointed {
                    log::info!("cuda: pid {host_pid}: was checkpointed when dumped; left so");
                    results.insert(host_pid, Ok(()));
                } else {
                    todo.push((host_pid, rec));
                }
            }
        }
        let unmatched: Vec<i32> = by_ns.keys().copied().collect();
        if !unmatched.is_empty() {
            log::error!(
                "cuda: process(es) {} of the image are not in the restored tree; their GPU state is not restored",
                list_pids(&unmatched)
            );
        }
        let _alarm = AlarmSuspended::new();
        let started = Instant::now();
        let driver = self.driver().clone();
        let mut threads = RunningThreads::new();
        let mut runnable = Vec::new();
        let mut lookups = Duration::ZERO;
        for (pid, _) in &todo {
            // Thread ids change with the pid namespace: ask the driver (it answers for a
            // stopped process).
            let t = Instant::now();
            let tid = driver.restore_thread_id(*pid);
            lookups += t.elapsed();
            let started = tid
                .map_err(|e| e.to_string())
                .and_then(|tid| threads.start(tid).map_err(|e| e.to_string()));
            match started {
                Ok(()) => runnable.push(*pid),
                Err(e) => {
                    results.insert(
                        *pid,
                        Err(fail(
                            libc::EIO,
                            format!("cuda: pid {pid}: cannot let its restore thread run: {e}"),
                        )),
                    );
                }
            }
        }
        let unlock: BTreeSet<i32> = todo
            .iter()
            .filter(|(_, r)| r.found == FoundState::Running)
            .map(|(p, _)| *p)
            .collect();
        let pairs = &self.gpu_map;
        let parallel = self.settings().parallel;
        let jobs: Vec<helper::RestoreJob> = runnable
            .iter()
            .map(|&pid| helper::RestoreJob {
                pid,
                unlock: unlock.contains(&pid),
            })
            .collect();
        let rs = restore_batch(&driver, &jobs, pairs, parallel);
        for (tid, e) in threads.stop_all() {
            log::error!("cuda: cannot stop restore thread {tid} again: {e}");
        }
        let mut driver_times = Vec::new();
        for (pid, r, took) in rs {
            driver_times.push(took);
            match r {
                Ok(()) => {
                    log::info!("cuda: pid {pid}: restore and unlock {:.1} ms", ms(took));
                    results.insert(pid, Ok(()));
                }
                Err(e) => {
                    results.insert(pid, Err(fail(-e.errno(), format!("cuda: pid {pid}: {e}"))));
                }
            }
        }
        log_phase_with(
            "restore",
            &runnable,
            started.elapsed(),
            &driver_times,
            lookups,
            parallel,
        );
        let failed: Vec<i32> = results
            .iter()
            .filter(|(_, r)| r.is_err())
            .map(|(p, _)| *p)
            .collect();
        if !failed.is_empty() || !unmatched.is_empty() {
            let why = if failed.is_empty() {
                &unmatched
            } else {
                &failed
            };
            end_restored(&procfs::tree(root), why);
        }
        self.resume_results = Some(results);
    }

    /// Restore of an image without our metadata (CRIU's C plugin made it): one process at a time.
    fn resume_one(&mut self, pid: i32) -> HookResult {
        let driver = self.driver().clone();
        let tid = match driver.restore_thread_id(pid) {
            Ok(tid) => tid,
            Err(e)
                if matches!(
                    e.cuda_code(),
                    Some(CUresult::NOT_INITIALIZED | CUresult::INVALID_VALUE | CUresult::NOT_FOUND)
                ) =>
            {
                return Err(HookError::NotMine);
            }
            // A CUDA process the driver cannot name a restore thread for stays checkpointed:
            // it must not run on frozen behind a successful restore.
            Err(e) => {
                let err = fail(-e.errno(), format!("cuda: pid {pid}: {e}"));
                end_restored(&[pid], &[pid]);
                return Err(err);
            }
        };
        let started = Instant::now();
        let mut threads = RunningThreads::new();
        threads.start(tid).map_err(|e| {
            fail(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("cuda: pid {pid}: cannot let restore thread {tid} run: {e}"),
            )
        })?;
        let job = helper::RestoreJob { pid, unlock: true };
        let r = restore_batch(&driver, &[job], &[], false)
            .pop()
            .map(|(_, r, _)| r)
            .unwrap_or(Ok(()));
        for (tid, e) in threads.stop_all() {
            log::error!("cuda: cannot stop restore thread {tid} again: {e}");
        }
        if let Err(e) = r {
            let err = fail(-e.errno(), format!("cuda: pid {pid}: {e}"));
            end_restored(&[pid], &[pid]);
            return Err(err);
        }
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
    log_phase_with(what, pids, wall, driver, Duration::ZERO, parallel)
}

/// [`log_phase`] with `serial_driver`: driver time spent on CRIU's thread before the batch (for
/// example restore-thread queries).
fn log_phase_with(
    what: &str,
    pids: &[i32],
    wall: Duration,
    driver: &[Duration],
    serial_driver: Duration,
    parallel: bool,
) {
    let longest = serial_driver
        + if parallel {
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
/// time it took. A worker that panics is reported as that pid's failure, never unwound further.
fn run_each<E>(
    pids: &[i32],
    parallel: bool,
    op: impl Fn(i32) -> Result<(), E> + Sync,
) -> Vec<(i32, Result<(), E>, Duration)>
where
    E: Send + From<DriverError>,
{
    let timed = |pid: i32| {
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(pid))).unwrap_or_else(
            |_| {
                Err(E::from(DriverError::InvalidArgument(format!(
                    "internal error while handling pid {pid}"
                ))))
            },
        );
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
                    .spawn_scoped(s, move || {
                        worker::block_sigalrm();
                        timed(pid)
                    })
            })
            .collect();
        handles
            .into_iter()
            .zip(pids)
            .map(|(h, &pid)| match h.map(|h| h.join()) {
                Ok(Ok(r)) => r,
                // No thread could be started (or it died outside `op`): do it here.
                _ => timed(pid),
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
        self.settings = Some(CudaSettings::from_config(ctx.config));
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
        let driver = self.driver().clone();
        let t = Instant::now();
        let tid_result = driver.restore_thread_id(pid);
        in_driver += t.elapsed();
        let tid = match tid_result {
            Ok(tid) => tid,
            Err(e) => {
                let no_cuda = matches!(
                    e.cuda_code(),
                    Some(CUresult::NOT_INITIALIZED | CUresult::INVALID_VALUE | CUresult::NOT_FOUND)
                );
                if no_cuda || !Path::new(&format!("/proc/{pid}")).exists() {
                    log::debug!("cuda: pid {pid} is not a CUDA process ({e})");
                    return Err(HookError::NotMine);
                }
                return Err(fail(
                    -e.errno(),
                    format!("cuda: cannot tell whether pid {pid} uses CUDA: {e}"),
                ));
            }
        };
        self.claim(pid)?;
        Self::check_runnable(pid, tid)?;
        let timeout = self.lock_timeout();
        // Never 0, which the driver reads as "wait for good".
        let ms_timeout = timeout.as_millis().clamp(1, u32::MAX as u128) as u32;
        let deadline = timeout + LOCK_GRACE;
        let t = Instant::now();
        // In a helper process: a target that never answers costs a killed helper, not a
        // thread stuck in CRIU's process for good.
        let outcome = helper::state_and_lock(&driver, pid, ms_timeout, deadline).map_err(|e| {
            match e {
                // A lock may have been asked for and complete later: checked again at exit.
                criu_plugin::child::ChildError::TimedOut(_) => {
                    self.abandoned_locks.push((pid, procfs::start_time(pid)));
                    fail(
                        libc::ETIMEDOUT,
                        format!(
                            "cuda: pid {pid} did not answer the driver (state query and lock, {} ms at most): {e}; the dump is abandoned",
                            deadline.as_millis()
                        ),
                    )
                }
                e => fail(
                    libc::EIO,
                    format!("cuda: pid {pid}: the lock helper failed: {e}"),
                ),
            }
        })?;
        let helper_took = t.elapsed();
        in_driver += outcome.in_driver;
        let helper_cost = helper_took.saturating_sub(outcome.in_driver);
        let state = outcome
            .state
            .map_err(|e| fail(-e.errno(), format!("cuda: {e}")))?;
        let (found, locked_by_us) = match state {
            ProcessState::Running => {
                match outcome.lock {
                    Some(Ok(())) => {}
                    Some(Err(e)) => {
                        let why = if e.errno() == -libc::ETIMEDOUT {
                            format!(
                                "; its GPU work did not finish within {ms_timeout} ms (raise CRIU's --timeout)"
                            )
                        } else {
                            String::new()
                        };
                        return Err(fail(-e.errno(), format!("cuda: {e}{why}")));
                    }
                    None => {
                        return Err(fail(
                            libc::EIO,
                            format!("cuda: pid {pid}: the lock helper did not lock it"),
                        ));
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
                ns_pid: procfs::ns_pid(pid).unwrap_or(pid),
                restore_tid: tid,
                found,
                locked_by_us,
                checkpointed_by_us: false,
                rss_before: 0,
                host_bytes: 0,
                result: None,
                start_time: procfs::start_time(pid),
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
            "cuda: pid {pid} (restore thread {tid}) paused: {:.2} ms in the driver, plugin own time {:.3} ms (of which the lock helper process {:.3} ms)",
            ms(in_driver),
            ms(total.saturating_sub(in_driver)),
            ms(helper_cost)
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
            self.checkpoint_all(pid);
        }
        // Every process gets its own answer; the first error fails the dump.
        match self.dumped.get(&pid) {
            Some(p) => p.result.unwrap_or(Err(HookError::Errno(libc::EIO))),
            None => Err(HookError::NotMine),
        }
    }

    fn resume(&mut self, pid: i32) -> HookResult {
        if self.stage != Some(Stage::Restore) {
            return Err(HookError::NotMine);
        }
        if self.metadata.is_none() {
            return self.resume_one(pid);
        }
        // CRIU calls this for the root task first: the whole tree is restored then.
        if self.resume_results.is_none() {
            self.resume_all(pid);
        }
        self.resume_results
            .as_ref()
            .and_then(|r| r.get(&pid).copied())
            .unwrap_or(Err(HookError::NotMine))
    }

    fn dump_finish(&mut self, ret: i32) -> HookResult {
        if self.stage != Some(Stage::Dump) || self.driver.is_none() {
            return Err(HookError::NotMine);
        }
        if ret == 0 {
            // Nothing to roll back; `exit` does what the final state asks.
            return Ok(());
        }
        log::info!("cuda: DUMP_FINISH({ret}): the tasks run on; putting processes back");
        let failed = self.undo_dump();
        self.release_abandoned_locks();
        if failed > 0 {
            return Err(fail(
                libc::EIO,
                format!("cuda: {failed} process(es) could not be put back as they were found"),
            ));
        }
        Ok(())
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
            self.release_abandoned_locks();
        }
        *self = CudaBackend::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_from_images_do_not_wrap() {
        assert_eq!(total_bytes([u64::MAX, 1].into_iter()), u64::MAX);
        assert_eq!(total_bytes([1 << 30, 1 << 30].into_iter()), 2 << 30);
        assert!(
            nvml::check_free_memory(total_bytes([u64::MAX, 1].into_iter()), 80 << 30, 1).is_err()
        );
    }
}
