//! The AMD backend: CRIU's hooks for processes that have `/dev/kfd` open.
//!
//! | hook | process | what it does |
//! |---|---|---|
//! | `init` (dump, pre-dump) | dumper | active when `/dev/kfd` exists |
//! | `HANDLE_DEVICE_VMA` | dumper | claims mappings of `/dev/kfd` and of KFD GPUs' render nodes; records `amdgpu_plugin` in the inventory |
//! | `DUMP_EXT_FILE` | dumper | KFD file: the guardian started (first file) and told of the process, PROCESS_INFO, CHECKPOINT, images, BO contents ([`super::dump`], per file in `dump/files.rs`); render node of a KFD GPU: its image; dma-buf: matched to a dumped KFD BO (or deferred until that BO is dumped); anything else is not ours |
//! | `DUMP_DEVICES_LATE` | dumper | UNPAUSE every paused process (all, even after a failure); fail on dma-bufs of no dumped BO |
//! | `exit` (dump) | dumper | UNPAUSE whatever is still paused: hosts without `DUMP_DEVICES_LATE`, failed dumps; release the guardian ([`super::guardian`]) once every queue runs |
//! | `init` (restore) | master | active when the image lists `amdgpu_plugin`; maps the parallel-restore queue before CRIU forks |
//! | `RESTORE_INIT` | master | preflight: every KFD image readable and its GPUs mappable onto this machine, before anything is forked; then the restore's guardian started ([`crate::restore_guardian`]) |
//! | `POST_FORKING` | master | tells the guardian of the root task; claims the parallel restore (no thread: CRIU's process must stay single-threaded, it enters the restored tree's mount namespace before `RESUME_DEVICES_LATE`) |
//! | `RESTORE_EXT_FILE` | task | KFD file: RESTORE and contents ([`super::restore`], per file in `restore/files.rs`); render node: the mapped GPU's node; dma-buf: the restored BO's dma-buf, from this task or another through CRIU's fdstore (`retry_needed` while that BO is not restored yet) |
//! | `UPDATE_VMA_MAP` | task | new mmap offset (and the render fd) of KFD and render-node mappings |
//! | `RESUME_DEVICES_LATE` | master | first call: the guardian told of the root, the copies tasks handed over; then RESUME; `ESRCH` (no KFD process) is "not mine"; once every KFD process is resumed, the guardian leaves the tree running |
//! | `exit` (restore) | master | does the handed-over copies a failed restore left, then clears the fdstore; releases the guardian after a restore that succeeded |
//!
//! Every hook returns "not mine" when the backend did nothing (the C plugin returns success
//! from some hooks it has no part in, which hides them from later plugins), so later backends
//! and plugins get their turn. The first ERROR logged is the reason the operation failed.

use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::Arc;

use criu_plugin::{HookError, HookHandler, HookId, HookResult, InventoryListing, Stage, VmaUpdate};

use super::device::{self, CriuLimits, KfdDevice};
use super::dump::DumpRun;
use super::error::{Error, FailureKind, device_error};
use super::guardian::QueueGuardFactory;
use super::image::{DMABUF_FILE_PREFIX, open_image_dir};
use super::kernel::KernelKfd;
use super::parallel::{CriuFdStore, FdStore, Handover};
use super::restore::RestoreRun;
pub use super::run::{CopyKind, CopyObserver, CopyRecord, INVENTORY_NAME};
use super::run::{MAX_KFD_IMAGES, RunBase, fail};
use super::settings::AmdgpuSettings;
use super::store::{ImageStore, StoreLocation};
use crate::backend::{GpuBackend, InitContext};

/// Makes the [`KfdDevice`] a run uses (called at every `init`).
pub type DeviceFactory = Box<dyn Fn() -> io::Result<Arc<dyn KfdDevice>> + Send>;

/// How a backend is set up beyond its settings.
#[derive(Default)]
pub struct BackendOptions {
    /// Images directory to use instead of CRIU's (tests and tools).
    pub images_dir: Option<PathBuf>,
    /// Bytes the backend may write into the images directory; more fails with `ENOSPC`
    /// (simulates a full disk in tests).
    pub image_quota: Option<u64>,
    /// Read environment overrides (`KFD_*`, `CRIU_GPU_AMDGPU_*`).
    pub use_process_env: bool,
    /// fd passing between restore processes to use instead of CRIU's fdstore.
    pub fdstore: Option<Arc<dyn FdStore>>,
    /// Told of every BO content copy (tests and benchmarks check and time them).
    pub copy_observer: Option<Arc<dyn CopyObserver>>,
    /// What restarts a dump's paused queues should CRIU end in the middle of it
    /// ([`super::guardian`]); `None`: nothing does (tests on the simulator, which pass their
    /// own). [`AmdgpuBackend::new`] uses [`super::guardian::guardian_process`].
    pub queue_guard: Option<QueueGuardFactory>,
    /// Start a guardian process that ends the tasks of a restore CRIU left half done (a
    /// process forked from the caller: only in CRIU's own process, as in the plugin).
    pub restore_guardian: bool,
}

/// Checkpoint and restore of KFD processes.
pub struct AmdgpuBackend {
    factory: DeviceFactory,
    options: BackendOptions,
    run: Run,
}

/// The run `init` set up, one variant per stage: a hook finds its stage's state or answers
/// "not mine".
enum Run {
    /// No run, or one with nothing for the AMD backend to do.
    Idle,
    /// A pre-dump: device mappings are claimed, no file is dumped.
    PreDump(DumpRun),
    /// A dump.
    Dump(DumpRun),
    /// A restore.
    Restore(RestoreRun),
}

impl Default for AmdgpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl AmdgpuBackend {
    /// The backend on this machine's amdkfd.
    pub fn new() -> Self {
        Self::build(
            Box::new(|| Ok(Arc::new(KernelKfd::new()) as Arc<dyn KfdDevice>)),
            BackendOptions {
                use_process_env: true,
                queue_guard: Some(super::guardian::guardian_process()),
                restore_guardian: true,
                ..Default::default()
            },
        )
    }

    /// A backend whose runs use the devices `factory` makes (the KFD simulator in tests).
    pub fn with_device_factory(factory: DeviceFactory, options: BackendOptions) -> Self {
        Self::build(factory, options)
    }

    fn build(factory: DeviceFactory, options: BackendOptions) -> Self {
        AmdgpuBackend {
            factory,
            options,
            run: Run::Idle,
        }
    }

    fn dump_run(&mut self) -> HookResult<&mut DumpRun> {
        match &mut self.run {
            Run::Dump(r) => Ok(r),
            _ => Err(HookError::NotMine),
        }
    }

    fn restore_run(&mut self) -> HookResult<&mut RestoreRun> {
        match &mut self.run {
            Run::Restore(r) => Ok(r),
            _ => Err(HookError::NotMine),
        }
    }

    /// The run of `stage`; [`Run::Idle`] when this machine or image has nothing for the
    /// backend.
    fn start_run(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<Run, Error> {
        let env = |k: &str| std::env::var(k).ok();
        let no_env = |_: &str| None;
        let env: &dyn Fn(&str) -> Option<String> = if self.options.use_process_env {
            &env
        } else {
            &no_env
        };
        // A bad value keeps its default and fails only a run that needs an AMD GPU: a typo
        // in an AMD setting must not fail the CRIU runs of every other process on the host.
        let (settings, bad) = AmdgpuSettings::from_config_lenient(ctx.config, env);
        for e in &bad {
            log::warn!("amdgpu: settings: {e}; the default is used");
        }
        let settings_error = bad.first().map(|e| format!("amdgpu settings: {e}"));
        if stage == Stage::Restore && ctx.listing == InventoryListing::NotListed {
            return Ok(Run::Idle);
        }
        let images = match &self.options.images_dir {
            Some(p) => StoreLocation::Owned(open_image_dir(p).map_err(|e| {
                Error::io(&e, format!("cannot open images directory {}", p.display()))
            })?),
            None => StoreLocation::Criu,
        };
        let images = ImageStore::new(images, self.options.image_quota);
        let found = (self.factory)().and_then(|d| d.kfd_rdev().map(|r| (d, r)));
        let (dev, kfd_rdev) = match found {
            Ok(found) => found,
            Err(e) => {
                if stage != Stage::Restore {
                    log::debug!("amdgpu: no /dev/kfd ({e}): nothing to do");
                    return Ok(Run::Idle);
                }
                // Listed (or an image without a list): fail now if the image holds KFD state
                // this machine cannot take, rather than restore processes without their GPUs.
                // Too many files to count is not "none".
                let n = match images.kfd_ids(MAX_KFD_IMAGES) {
                    Ok(v) => v.len().to_string(),
                    Err(_) => format!("more than {MAX_KFD_IMAGES}"),
                };
                if n != "0" {
                    return Err(device_error(
                        libc::ENODEV,
                        format!(
                            "the image holds the GPU state of {n} AMD process file(s) but this machine has no usable /dev/kfd ({e})"
                        ),
                    ));
                }
                return Ok(Run::Idle);
            }
        };
        let base = RunBase {
            dev,
            settings,
            images,
            limits: CriuLimits::default(),
            copy_observer: self.options.copy_observer.clone(),
        };
        if stage != Stage::Restore {
            log_start(&base, stage, false);
            let guard = self.options.queue_guard.clone();
            let run = DumpRun::new(base, kfd_rdev, settings_error, guard, ctx);
            return Ok(if stage == Stage::Dump {
                Run::Dump(run)
            } else {
                Run::PreDump(run)
            });
        }
        if let Some(e) = &settings_error {
            if base
                .images
                .kfd_ids(MAX_KFD_IMAGES)
                .map(|v| !v.is_empty())
                .unwrap_or(true)
            {
                return Err(Error::new(
                    FailureKind::Settings,
                    libc::EINVAL,
                    format!("{e}; this restore needs the AMD GPU backend: correct the setting"),
                ));
            }
        }
        // Shared state must exist before CRIU forks the tasks, which is now.
        let publish_dmabufs = base.images.count_prefix(DMABUF_FILE_PREFIX).unwrap_or(0) > 0;
        let parallel = base.settings.parallel_restore && ctx.host.has_hook(HookId::PostForking);
        let handover = self
            .options
            .fdstore
            .clone()
            .or_else(|| CriuFdStore::resolve().map(|s| Arc::new(s) as Arc<dyn FdStore>))
            .map(|store| Handover::create(store, parallel, publish_dmabufs));
        log_start(
            &base,
            stage,
            handover.as_ref().is_some_and(Handover::parallel),
        );
        Ok(Run::Restore(RestoreRun::new(
            base,
            handover,
            publish_dmabufs,
            self.options.restore_guardian,
        )))
    }
}

fn log_start(base: &RunBase, stage: Stage, parallel: bool) {
    log::info!(
        "amdgpu: {} ({:?}); {} copy threads, {} staging, parallel restore {}",
        base.dev.describe(),
        stage,
        base.settings.copy_threads,
        device::Bytes(base.settings.staging_bytes),
        if parallel { "on" } else { "off" }
    );
}

impl GpuBackend for AmdgpuBackend {
    fn name(&self) -> &'static str {
        "amdgpu"
    }

    fn inventory_name(&self) -> &'static CStr {
        INVENTORY_NAME
    }

    fn init(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<bool, HookError> {
        // The last run's state (fds, shared mappings) goes before a new one is set up.
        self.run = Run::Idle;
        match self.start_run(ctx, stage) {
            Ok(Run::Idle) => Ok(false),
            Ok(run) => {
                self.run = run;
                // CRIU before 4.3 calls no RESTORE_INIT: the images are checked now, still
                // before CRIU forks the tasks, instead of in each task's RESTORE_EXT_FILE.
                if stage == Stage::Restore && !ctx.host.has_hook(HookId::RestoreInit) {
                    match self.restore_init() {
                        Ok(()) | Err(HookError::NotMine) => {}
                        Err(e) => {
                            self.exit(stage, -1);
                            return Err(e);
                        }
                    }
                }
                Ok(true)
            }
            Err(e) => Err(fail(e)),
        }
    }

    fn exit(&mut self, _stage: Stage, ret: i32) {
        match &mut std::mem::replace(&mut self.run, Run::Idle) {
            Run::Dump(r) => r.finish(ret),
            Run::Restore(r) => r.finish(ret),
            Run::PreDump(_) | Run::Idle => {}
        }
    }
}

impl HookHandler for AmdgpuBackend {
    fn handle_device_vma(&mut self, _fd: RawFd, st: &libc::stat) -> HookResult {
        match &mut self.run {
            Run::PreDump(r) | Run::Dump(r) => r.handle_device_vma(st),
            _ => Err(HookError::NotMine),
        }
    }

    fn dump_ext_file(&mut self, fd: RawFd, id: u32) -> HookResult {
        self.dump_run()?.dump_ext_file(fd, id)
    }

    fn dump_devices_late(&mut self, _root_pid: i32) -> HookResult {
        self.dump_run()?.dump_devices_late()
    }

    fn restore_init(&mut self) -> HookResult {
        self.restore_run()?.preflight()
    }

    fn restore_ext_file(&mut self, id: u32, mut retry: Option<&mut bool>) -> HookResult<RawFd> {
        if let Some(r) = retry.as_deref_mut() {
            *r = false;
        }
        self.restore_run()?.restore_ext_file(id, retry)
    }

    fn update_vma_map(&mut self, path: &CStr, addr: u64, old_pgoff: u64) -> HookResult<VmaUpdate> {
        self.restore_run()?.update_vma_map(path, addr, old_pgoff)
    }

    fn dump_finish(&mut self, ret: i32) -> HookResult {
        self.dump_run()?.dump_finish(ret)
    }

    fn post_forking(&mut self) -> HookResult {
        self.restore_run()?.post_forking()
    }

    fn resume_devices_late(&mut self, pid: i32) -> HookResult {
        self.restore_run()?.resume(pid)
    }
}
