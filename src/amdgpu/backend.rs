//! The AMD backend: CRIU's hooks for processes that have `/dev/kfd` open.
//!
//! | hook | process | what it does |
//! |---|---|---|
//! | `init` (dump, pre-dump) | dumper | active when `/dev/kfd` exists |
//! | `HANDLE_DEVICE_VMA` | dumper | claims mappings of `/dev/kfd` and of KFD GPUs' render nodes; records `amdgpu_plugin` in the inventory |
//! | `DUMP_EXT_FILE` | dumper | KFD file: PROCESS_INFO, CHECKPOINT, images, BO contents ([`super::dump`]); render node of a KFD GPU: its image; dma-buf: matched to a dumped KFD BO (or deferred until that BO is dumped); anything else is not ours |
//! | `DUMP_DEVICES_LATE` | dumper | UNPAUSE every paused process (all, even after a failure); fail on dma-bufs of no dumped BO |
//! | `exit` (dump) | dumper | UNPAUSE whatever is still paused: hosts without `DUMP_DEVICES_LATE`, failed dumps |
//! | `init` (restore) | master | active when the image lists `amdgpu_plugin`; maps the parallel-restore queue before CRIU forks |
//! | `RESTORE_INIT` | master | preflight: every KFD image readable and its GPUs mappable onto this machine, before anything is forked |
//! | `POST_FORKING` | master | claims the parallel restore (no thread: CRIU's process must stay single-threaded, it enters the restored tree's mount namespace before `RESUME_DEVICES_LATE`) |
//! | `RESTORE_EXT_FILE` | task | KFD file: RESTORE and contents ([`super::restore`]); render node: the mapped GPU's node; dma-buf: the restored BO's dma-buf, from this task or another through CRIU's fdstore (`retry_needed` while that BO is not restored yet) |
//! | `UPDATE_VMA_MAP` | task | new mmap offset (and the render fd) of KFD and render-node mappings |
//! | `RESUME_DEVICES_LATE` | master | first call: the copies tasks handed over; then RESUME; `ESRCH` (no KFD process) is "not mine" |
//! | `exit` (restore) | master | does the handed-over copies a failed restore left, then clears the fdstore |
//!
//! Every hook returns "not mine" when the backend did nothing (the C plugin returns success
//! from some hooks it has no part in, which hides them from later plugins), so later backends
//! and plugins get their turn. The first ERROR logged is the reason the operation failed.

use std::collections::HashMap;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, IntoRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use criu_plugin::{CriuSymbols, HookError, HookId, HookResult, InventoryListing, Stage, VmaUpdate};

use super::device::{self, CriuLimits, FileIdentity, FileKind, KfdDevice, classify};
use super::dump::{self, DumpCtx, DumpState};
use super::error::Error;
use super::hw::HwDevice;
use super::image::open_image_dir;
use super::images::{Images, ImagesDir};
use super::parallel::{CriuFdStore, FdStore, KeyTable, Outcome, RestoreQueue};
use super::restore::{self, MappedPath, RestoreCtx, TaskState};
use super::settings::AmdgpuSettings;
use crate::backend::{GpuBackend, InitContext};

/// Inventory name of CRIU's C plugin, kept so images move both ways.
pub const INVENTORY_NAME: &CStr = c"amdgpu_plugin";

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
}

/// Who copied a file's BO contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// Dump: GPU to pages files, in CRIU's dumping process.
    Dump,
    /// Restore: pages files to GPU, in the restored task.
    RestoreInTask,
    /// Restore: pages files to GPU, in CRIU's main process (parallel restore).
    RestoreInMain,
}

/// One BO content copy of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyRecord {
    /// CRIU file id of the KFD file.
    pub file_id: u32,
    /// Direction and place.
    pub kind: CopyKind,
    /// What the copy pipeline did.
    pub stats: super::copy::CopyStats,
}

/// Checkpoint and restore of KFD processes.
pub struct AmdgpuBackend {
    factory: DeviceFactory,
    options: BackendOptions,
    run: Option<Run>,
    copies: Vec<CopyRecord>,
}

struct Run {
    stage: Stage,
    has_dump_late: bool,
    dev: Arc<dyn KfdDevice>,
    settings: AmdgpuSettings,
    images: Arc<Images>,
    kfd_rdev: Option<u64>,
    limits: CriuLimits,
    inventory_added: bool,
    dump: DumpState,
    queue: Option<Arc<RestoreQueue>>,
    fdstore: Option<Arc<dyn FdStore>>,
    keys: Option<Arc<KeyTable>>,
    publish_dmabufs: bool,
    outcome: Option<Outcome>,
    tasks: HashMap<u32, TaskState>,
    resume_kfd: Option<OwnedFd>,
    copies: Vec<CopyRecord>,
    /// The first bad AMD setting (its default is used), which fails the run once it needs AMD.
    settings_error: Option<String>,
    /// CRIU's image stream (`--stream`), looked up on first need.
    stream: std::cell::OnceCell<Option<criu_plugin::stream::ImageStream>>,
}

impl Default for AmdgpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

fn fail(e: Error) -> HookError {
    log::error!("amdgpu: {e}");
    HookError::Errno(e.errno.max(1))
}

impl AmdgpuBackend {
    /// The backend on this machine's amdkfd.
    pub fn new() -> Self {
        Self::with_device_factory(
            Box::new(|| Ok(Arc::new(HwDevice::new()) as Arc<dyn KfdDevice>)),
            BackendOptions {
                use_process_env: true,
                ..Default::default()
            },
        )
    }

    /// A backend whose runs use the devices `factory` makes (the KFD simulator in tests).
    pub fn with_device_factory(factory: DeviceFactory, options: BackendOptions) -> Self {
        AmdgpuBackend {
            factory,
            options,
            run: None,
            copies: Vec::new(),
        }
    }

    /// The BO content copies of the current or last run (dump or restore), in order.
    pub fn copies(&self) -> &[CopyRecord] {
        match &self.run {
            Some(r) => &r.copies,
            None => &self.copies,
        }
    }

    fn run(&mut self, stage: Stage) -> HookResult<&mut Run> {
        match self.run.as_mut() {
            Some(r) if r.stage == stage => Ok(r),
            _ => Err(HookError::NotMine),
        }
    }

    fn init_run(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<Option<Run>, Error> {
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
            return Ok(None);
        }
        let images = match &self.options.images_dir {
            Some(p) => ImagesDir::Owned(open_image_dir(p).map_err(|e| {
                Error::io(&e, format!("cannot open images directory {}", p.display()))
            })?),
            None => ImagesDir::Criu,
        };
        let images = Arc::new(Images::new(images, self.options.image_quota));
        let found = (self.factory)().and_then(|d| d.kfd_rdev().map(|r| (d, r)));
        let (dev, kfd_rdev) = match found {
            Ok((d, r)) => (d, Some(r)),
            Err(e) => {
                if stage != Stage::Restore {
                    log::debug!("amdgpu: no /dev/kfd ({e}): nothing to do");
                    return Ok(None);
                }
                // Listed (or an image without a list): fail now if the image holds KFD state
                // this machine cannot take, rather than restore processes without their GPUs.
                // Too many files to count is not "none".
                let n = match images.kfd_ids(1 << 16) {
                    Ok(v) => v.len().to_string(),
                    Err(_) => "more than 65536".to_string(),
                };
                if n != "0" {
                    return Err(Error::new(
                        libc::ENODEV,
                        format!(
                            "the image holds the GPU state of {n} AMD process file(s) but this machine has no usable /dev/kfd ({e})"
                        ),
                    ));
                }
                return Ok(None);
            }
        };
        if stage == Stage::Restore {
            if let Some(e) = &settings_error {
                if images
                    .kfd_ids(1 << 16)
                    .map(|v| !v.is_empty())
                    .unwrap_or(true)
                {
                    return Err(Error::new(
                        libc::EINVAL,
                        format!("{e}; this restore needs the AMD GPU backend: correct the setting"),
                    ));
                }
            }
        }
        let mut queue = None;
        let mut fdstore = None;
        let mut keys = None;
        let mut publish_dmabufs = false;
        if stage == Stage::Restore {
            // Shared state must exist before CRIU forks the tasks, which is now.
            fdstore = self
                .options
                .fdstore
                .clone()
                .or_else(|| CriuFdStore::resolve().map(|s| Arc::new(s) as Arc<dyn FdStore>));
            if fdstore.is_some()
                && settings.parallel_restore
                && ctx.host.has_hook(HookId::PostForking)
            {
                match RestoreQueue::create() {
                    Ok(q) => queue = Some(Arc::new(q)),
                    Err(e) => log::warn!("amdgpu: no parallel restore: {e}"),
                }
            }
            publish_dmabufs = images.count_prefix("amdgpu-dmabuf_").unwrap_or(0) > 0;
            if publish_dmabufs && fdstore.is_some() {
                match KeyTable::create() {
                    Ok(t) => keys = Some(Arc::new(t)),
                    Err(e) => log::warn!("amdgpu: dma-bufs only within a task: {e}"),
                }
            }
        }
        log::info!(
            "amdgpu: {} ({:?}); {} copy threads, {} staging, parallel restore {}",
            dev.describe(),
            stage,
            settings.copy_threads,
            device::Bytes(settings.staging_bytes),
            if queue.is_some() { "on" } else { "off" }
        );
        Ok(Some(Run {
            stage,
            has_dump_late: ctx.host.has_hook(HookId::DumpDevicesLate),
            dev,
            settings,
            images,
            kfd_rdev,
            limits: CriuLimits::default(),
            inventory_added: false,
            stream: std::cell::OnceCell::new(),
            settings_error,
            dump: DumpState::default(),
            queue,
            fdstore,
            keys,
            publish_dmabufs,
            outcome: None,
            tasks: HashMap::new(),
            resume_kfd: None,
            copies: Vec::new(),
        }))
    }
}

impl Run {
    fn dump_ctx(&self) -> DumpCtx<'_> {
        DumpCtx {
            dev: self.dev.as_ref(),
            settings: &self.settings,
            images: &self.images,
            limits: self.limits,
        }
    }

    fn add_inventory(&mut self) -> HookResult {
        if !self.inventory_added {
            CriuSymbols::get()
                .add_inventory_plugin(INVENTORY_NAME)
                .map_err(|e| {
                    fail(Error::new(
                        libc::ENOMEM,
                        format!("cannot record the plugin in the inventory ({e})"),
                    ))
                })?;
            self.inventory_added = true;
        }
        Ok(())
    }

    /// Whether render node `minor` belongs to a KFD GPU (unknown topology: assume so).
    fn is_kfd_render_node(&mut self, minor: u32) -> bool {
        if self.dump.topology.is_none() {
            match super::topology::Topology::from_sysfs(&self.settings.topology_root) {
                Ok(t) => self.dump.topology = Some(t),
                Err(e) => {
                    log::warn!(
                        "amdgpu: cannot read the KFD topology ({e}); claiming renderD{minor}"
                    );
                    return true;
                }
            }
        }
        self.dump
            .topology
            .as_ref()
            .is_some_and(|t| t.gpu_by_render_minor(minor).is_some())
    }

    /// Fails when CRIU streams its images: this backend writes its images as files of the
    /// images directory, which a stream would leave out (the dump would look complete and
    /// could not be restored).
    /// Refuses to dump an AMD process when the run cannot: a bad AMD setting (which fails
    /// only runs that need AMD), or CRIU streaming its images.
    fn refuse_unusable(&self) -> HookResult {
        if let Some(e) = &self.settings_error {
            return Err(fail(Error::new(
                libc::EINVAL,
                format!("{e}; this dump needs the AMD GPU backend: correct the setting"),
            )));
        }
        match self.stream.get_or_init(criu_plugin::stream::image_stream) {
            None => Ok(()),
            Some(s) => Err(fail(Error::new(
                libc::EOPNOTSUPP,
                format!(
                    "CRIU streams its images ({s:?}); the AMD GPU backend writes its images as files and does not support --stream, so the process's GPU state would be missing from the stream"
                ),
            ))),
        }
    }

    fn dump_kfd(&mut self, fd: RawFd, id: u32) -> HookResult {
        let started = Instant::now();
        // SAFETY: CRIU passes an fd that is open for the duration of the hook.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let ctx = DumpCtx {
            dev: self.dev.as_ref(),
            settings: &self.settings,
            images: &self.images,
            limits: self.limits,
        };
        let own = ctx
            .dev
            .open_kfd()
            .map_err(|e| fail(Error::io(&e, "cannot open /dev/kfd")))?;
        dump::check_kfd_version(ctx.dev, own.as_fd())
            .map_err(|e| fail(e.context(format!("file {id}"))))?;
        drop(own);
        let info = dump::pause(&ctx, &mut self.dump, fd, id)
            .map_err(|e| fail(e.context(format!("file {id}"))))?;
        match dump::checkpoint(&ctx, &mut self.dump, fd, id, &info) {
            Ok(stats) => {
                dump::log_stats(id, info.pid, &stats, started);
                self.copies.push(CopyRecord {
                    file_id: id,
                    kind: CopyKind::Dump,
                    stats: stats.copy,
                });
                dump::retry_pending_dmabufs(&ctx, &mut self.dump)
                    .map_err(|e| fail(e.context("dumping deferred dma-buf files")))?;
                Ok(())
            }
            Err(e) => {
                // The reason first, then the clean-up.
                let errno = e.errno.max(1);
                log::error!("amdgpu: file {id} (pid {}): {e}", info.pid);
                if let Some(p) = self.dump.paused.iter_mut().rev().find(|p| p.id == id) {
                    match dump::unpause(self.dev.as_ref(), p) {
                        Ok(()) => log::info!(
                            "amdgpu: pid {}: GPU queues restarted after the failed checkpoint",
                            p.pid
                        ),
                        Err(u) => log::error!("amdgpu: {u}; will retry at the end of the dump"),
                    }
                }
                Err(HookError::Errno(errno))
            }
        }
    }

    /// UNPAUSE every paused process; every one is tried. Returns the failures.
    fn unpause_all(&mut self) -> usize {
        let mut failures = 0;
        for p in self.dump.paused.iter_mut().filter(|p| p.paused) {
            match dump::unpause(self.dev.as_ref(), p) {
                Ok(()) => log::debug!("amdgpu: pid {}: GPU queues restarted", p.pid),
                Err(e) => {
                    log::error!("amdgpu: {e}");
                    failures += 1;
                }
            }
        }
        failures
    }

    fn restore_ctx(&self) -> RestoreCtx<'_> {
        RestoreCtx {
            dev: self.dev.as_ref(),
            settings: &self.settings,
            images: &self.images,
            limits: self.limits,
            queue: self.queue.as_deref(),
            fdstore: self.fdstore.as_deref(),
            keys: self.keys.as_deref(),
            publish_dmabufs: self.publish_dmabufs,
        }
    }

    fn restore_file(&mut self, id: u32, retry: Option<&mut bool>) -> HookResult<RawFd> {
        let me = self.dev.current_task();
        let mut task = self.tasks.remove(&me).unwrap_or_default();
        let r = self.restore_file_in(&mut task, id, retry);
        self.tasks.insert(me, task);
        r
    }

    fn restore_file_in(
        &mut self,
        task: &mut TaskState,
        id: u32,
        retry: Option<&mut bool>,
    ) -> HookResult<RawFd> {
        let ctx = self.restore_ctx();
        let dir = ctx.images.dir().map_err(fail)?;
        match dir.read_kfd(id, &ctx.images.limits) {
            Ok(image) => {
                let (fd, copied) = restore::restore_kfd(&ctx, task, id, &image)
                    .map_err(|e| fail(e.context(format!("restoring KFD file {id}"))))?;
                if let Some(stats) = copied {
                    self.copies.push(CopyRecord {
                        file_id: id,
                        kind: CopyKind::RestoreInTask,
                        stats,
                    });
                }
                return Ok(fd.into_raw_fd());
            }
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(fail(Error::from(e))),
        }
        match dir.read_render_node(id, &ctx.images.limits) {
            Ok(image) => {
                let fd = restore::restore_render(&ctx, task, id, &image)
                    .map_err(|e| fail(e.context(format!("restoring render node file {id}"))))?;
                return Ok(fd.into_raw_fd());
            }
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(fail(Error::from(e))),
        }
        match dir.read_dmabuf(id, &ctx.images.limits) {
            Ok(image) => {
                let can_retry = retry.is_some();
                match restore::restore_dmabuf(&ctx, task, id, image.gem_handle, can_retry) {
                    Ok(Some(fd)) => Ok(fd.into_raw_fd()),
                    Ok(None) => {
                        if let Some(r) = retry {
                            *r = true;
                        }
                        Ok(0)
                    }
                    Err(e) => Err(fail(e)),
                }
            }
            Err(e) if e.is_not_found() => Err(HookError::NotMine),
            Err(e) => Err(fail(Error::from(e))),
        }
    }

    /// Ends the parallel restore: serves every request the tasks handed over, here in CRIU's
    /// main process (with the copy pipeline's threads, joined before it returns), logs what
    /// was done and keeps the outcome.
    fn finish_worker(&mut self) {
        let Some(q) = self.queue.clone() else {
            return;
        };
        if self.outcome.is_some() {
            return;
        }
        let started = Instant::now();
        let mut served = Vec::new();
        if let Some(store) = &self.fdstore {
            restore::serve_ready(
                self.dev.as_ref(),
                &self.settings,
                &self.images,
                store.as_ref(),
                &q,
                &mut served,
            );
        }
        for s in &served {
            if let Ok(stats) = &s.result {
                self.copies.push(CopyRecord {
                    file_id: s.file_id,
                    kind: CopyKind::RestoreInMain,
                    stats: *stats,
                });
            }
            match &s.result {
                Ok(st) => log::info!(
                    "amdgpu: file {}: {} of BO contents restored by CRIU's main process in {:.3} s ({:.0} MiB/s)",
                    s.file_id,
                    device::Bytes(st.bytes),
                    st.elapsed.as_secs_f64(),
                    st.rate() / (1u64 << 20) as f64
                ),
                Err(e) => log::error!("amdgpu: file {}: {e}", s.file_id),
            }
        }
        let o = q.outcome();
        if !served.is_empty() || !o.failed.is_empty() {
            log::info!(
                "amdgpu: parallel restore: {} file(s) done, {} failed; waited {:.3} s",
                o.done,
                o.failed.len(),
                started.elapsed().as_secs_f64()
            );
        }
        self.outcome = Some(o);
    }
}

impl GpuBackend for AmdgpuBackend {
    fn name(&self) -> &'static str {
        "amdgpu"
    }

    fn inventory_name(&self) -> &'static CStr {
        INVENTORY_NAME
    }

    fn init(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<bool, HookError> {
        if let Some(old) = self.run.take() {
            drop(old);
        }
        self.copies.clear();
        match self.init_run(ctx, stage) {
            Ok(Some(run)) => {
                self.run = Some(run);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(fail(e)),
        }
    }

    fn handle_device_vma(&mut self, _fd: RawFd, st: &libc::stat) -> HookResult {
        let run = match self.run.as_mut() {
            Some(r) if matches!(r.stage, Stage::Dump | Stage::PreDump) => r,
            _ => return Err(HookError::NotMine),
        };
        let id = FileIdentity {
            mode: st.st_mode,
            rdev: st.st_rdev,
            dmabuf: false,
        };
        let ours = match classify(&id, run.kfd_rdev) {
            FileKind::Kfd => true,
            FileKind::RenderNode { minor } => run.is_kfd_render_node(minor),
            _ => false,
        };
        if !ours {
            return Err(HookError::NotMine);
        }
        run.refuse_unusable()?;
        run.add_inventory()
    }

    fn dump_file(&mut self, fd: RawFd, id: u32) -> HookResult {
        let run = self.run(Stage::Dump)?;
        // SAFETY: CRIU passes an fd that is open for the duration of the hook.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let ident = run
            .dev
            .identify(borrowed)
            .map_err(|e| fail(Error::io(&e, format!("cannot inspect file {id}"))))?;
        match classify(&ident, run.kfd_rdev) {
            FileKind::Kfd => {
                run.refuse_unusable()?;
                run.add_inventory()?;
                run.dump_kfd(fd, id)
            }
            FileKind::RenderNode { minor } => {
                if run.is_kfd_render_node(minor) {
                    run.refuse_unusable()?;
                }
                let mut state = std::mem::take(&mut run.dump);
                let r = dump::dump_render_node(&run.dump_ctx(), &mut state, borrowed, id, minor);
                run.dump = state;
                match r {
                    Ok(Some(user)) => {
                        run.add_inventory()?;
                        log::info!("amdgpu: file {id}: renderD{minor} (GPU {user:#x})");
                        Ok(())
                    }
                    Ok(None) => Err(HookError::NotMine),
                    Err(e) => Err(fail(e.context(format!("dumping render node file {id}")))),
                }
            }
            FileKind::DmaBuf => {
                let mut state = std::mem::take(&mut run.dump);
                let r = dump::dump_dmabuf(&run.dump_ctx(), &mut state, id, borrowed);
                let r = match r {
                    Ok(true) => Ok(()),
                    Ok(false) if run.has_dump_late => match borrowed.try_clone_to_owned() {
                        // Its BO may belong to a process dumped later (a copy of the fd is
                        // kept, not CRIU's fd number, which CRIU closes once the hook returns).
                        Ok(copy) => {
                            log::info!(
                                "amdgpu: file {id}: dma-buf of no BO dumped so far; deferred"
                            );
                            state.pending_dmabufs.push((id, copy));
                            Ok(())
                        }
                        Err(e) => Err(fail(Error::io(&e, "cannot duplicate a dma-buf fd"))),
                    },
                    Ok(false) => Err(fail(Error::new(
                        libc::ENOENT,
                        format!(
                            "file {id} is a dma-buf of no AMD GPU BO dumped so far, and this CRIU has no DUMP_DEVICES_LATE to wait for it"
                        ),
                    ))),
                    Err(e) => Err(fail(e.context(format!("dumping dma-buf file {id}")))),
                };
                run.dump = state;
                r
            }
            FileKind::Other => Err(HookError::NotMine),
        }
    }

    fn dump_late(&mut self, _root_pid: i32) -> HookResult {
        let run = self.run(Stage::Dump)?;
        if run.dump.paused.is_empty() && run.dump.pending_dmabufs.is_empty() {
            return Err(HookError::NotMine);
        }
        let started = Instant::now();
        let n = run.dump.paused.iter().filter(|p| p.paused).count();
        let failures = run.unpause_all();
        if failures > 0 {
            return Err(HookError::Errno(libc::EIO));
        }
        if !run.dump.pending_dmabufs.is_empty() {
            let ids: Vec<u32> = run.dump.pending_dmabufs.iter().map(|p| p.0).collect();
            return Err(fail(Error::new(
                libc::ENOENT,
                format!("dma-buf file(s) {ids:?} belong to no BO of a dumped AMD GPU process"),
            )));
        }
        log::info!(
            "amdgpu: GPU queues of {n} process(es) restarted in {:.3} s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    fn restore_prepare(&mut self) -> HookResult {
        let run = self.run(Stage::Restore)?;
        let ids = run
            .images
            .kfd_ids(1 << 16)
            .map_err(|e| fail(e.context("restore preflight")))?;
        if ids.is_empty() {
            return Err(HookError::NotMine);
        }
        if run.kfd_rdev.is_none() {
            return Err(fail(Error::new(
                libc::ENODEV,
                format!(
                    "the image holds the GPU state of {} AMD process file(s) but this machine has no /dev/kfd",
                    ids.len()
                ),
            )));
        }
        let ctx = run.restore_ctx();
        for id in &ids {
            let image = ctx
                .images
                .dir()
                .and_then(|d| Ok(d.read_kfd(*id, &ctx.images.limits)?))
                .map_err(|e| fail(e.context("restore preflight")))?;
            restore::check_image(&image, &ctx.limits)
                .and_then(|()| restore::compute_map(&ctx, &image))
                .and_then(|_| restore::open_pages(ctx.images, *id, &image).map(drop))
                .map_err(|e| fail(e.context(format!("restore preflight of KFD file {id}"))))?;
        }
        log::info!("amdgpu: {} KFD file(s) can be restored here", ids.len());
        Ok(())
    }

    fn restore_file(&mut self, id: u32, mut retry: Option<&mut bool>) -> HookResult<RawFd> {
        if let Some(r) = retry.as_deref_mut() {
            *r = false;
        }
        let run = self.run(Stage::Restore)?;
        run.restore_file(id, retry)
    }

    fn update_vma(&mut self, path: &CStr, addr: u64, old_pgoff: u64) -> HookResult<VmaUpdate> {
        let run = self.run(Stage::Restore)?;
        let Some(kind) = restore::mapped_path(path) else {
            return Err(HookError::NotMine);
        };
        let me = run.dev.current_task();
        let task = run.tasks.get(&me);
        let found = task.and_then(|t| {
            t.remaps
                .iter()
                .find(|r| r.addr == addr && r.old_offset == old_pgoff)
        });
        let Some(r) = found else {
            if kind == MappedPath::Render {
                log::warn!(
                    "amdgpu: no restored BO for the mapping of {} at {addr:#x} (offset {old_pgoff:#x}); left as it was",
                    path.to_string_lossy()
                );
            }
            return Ok(VmaUpdate {
                new_pgoff: old_pgoff,
                plugin_fd: None,
            });
        };
        let plugin_fd = match (kind, r.render_minor) {
            (MappedPath::Render, Some(minor)) => {
                let fd = restore::dup_for_criu(task.expect("found in it"), minor).map_err(fail)?;
                Some(fd.into_raw_fd())
            }
            _ => None,
        };
        Ok(VmaUpdate {
            new_pgoff: r.new_offset,
            plugin_fd,
        })
    }

    fn dump_finish(&mut self, ret: i32) -> HookResult {
        let run = self.run(Stage::Dump)?;
        let n = run.dump.paused.iter().filter(|p| p.paused).count();
        if ret == 0 || n == 0 {
            return Err(HookError::NotMine);
        }
        log::info!(
            "amdgpu: DUMP_FINISH({ret}): the tasks run on; restarting the GPU queues of {n} process(es)"
        );
        if run.unpause_all() > 0 {
            return Err(fail(Error::new(
                libc::EIO,
                "some GPU queues could not be restarted".to_string(),
            )));
        }
        Ok(())
    }

    fn post_forking(&mut self) -> HookResult {
        let run = self.run(Stage::Restore)?;
        if run.queue.is_none() || run.fdstore.is_none() {
            return Err(HookError::NotMine);
        }
        // A thread serving the queue from here on would still run when CRIU enters the
        // restored tree's mount namespace, which the kernel refuses to a multi-threaded
        // process: the copies wait for RESUME_DEVICES_LATE.
        Ok(())
    }

    fn resume(&mut self, pid: i32) -> HookResult {
        let run = self.run(Stage::Restore)?;
        run.finish_worker();
        if let Some(o) = &run.outcome {
            if !o.failed.is_empty() {
                // CRIU ignores this hook's errors, so the process would run on with missing
                // GPU memory; its queues stay evicted instead.
                log::error!(
                    "amdgpu: BO contents of KFD file(s) {:?} could not be restored; pid {pid} is left with its GPU queues stopped",
                    o.failed.iter().map(|f| f.0).collect::<Vec<_>>()
                );
                return Err(HookError::Errno(libc::EIO));
            }
        }
        if run.resume_kfd.is_none() {
            let fd = run
                .dev
                .open_kfd()
                .map_err(|e| fail(Error::io(&e, "cannot open /dev/kfd")))?;
            run.resume_kfd = Some(fd);
        }
        let kfd = run.resume_kfd.as_ref().expect("set above").as_fd();
        let started = Instant::now();
        match device::resume(run.dev.as_ref(), kfd, pid as u32) {
            Ok(()) => {
                log::info!(
                    "amdgpu: pid {pid}: GPU resumed in {:.3} s",
                    started.elapsed().as_secs_f64()
                );
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                log::debug!("amdgpu: pid {pid} has no KFD process");
                Err(HookError::NotMine)
            }
            Err(e) => Err(fail(Error::io(
                &e,
                format!("KFD RESUME of pid {pid} failed"),
            ))),
        }
    }

    fn finish(&mut self, stage: Stage, ret: i32) {
        let Some(mut run) = self.run.take() else {
            return;
        };
        match stage {
            Stage::Dump => {
                let n = run.dump.paused.iter().filter(|p| p.paused).count();
                if n > 0 {
                    log::info!(
                        "amdgpu: dump {}: restarting the GPU queues of {n} process(es)",
                        if ret != 0 { "failed" } else { "done" }
                    );
                    if run.unpause_all() > 0 {
                        log::error!("amdgpu: some GPU queues could not be restarted");
                    }
                }
            }
            Stage::Restore => {
                run.finish_worker();
                if let Some(s) = &run.fdstore {
                    s.clear();
                }
            }
            Stage::PreDump => {}
        }
        self.copies = std::mem::take(&mut run.copies);
    }
}
