//! A dump run ([`DumpRun`], one dump's state from `init` to `exit`, laid out as CUDA's): the
//! dumper's hooks (`HANDLE_DEVICE_VMA`, `DUMP_EXT_FILE`, `DUMP_DEVICES_LATE`, `DUMP_FINISH`,
//! `exit`) over what [`files`] does per file, the processes whose queues the run stopped, and
//! the guardian that restarts them should CRIU end first ([`super::guardian`]).

mod files;

use std::cell::OnceCell;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::time::Instant;

use criu_plugin::stream::ImageStream;
use criu_plugin::{CriuSymbols, HookError, HookId, HookResult};

use super::device::{self, FileIdentity, FileKind, classify};
use super::error::{Error, FailureKind, device_error};
use super::guardian::{QueueGuard, QueueGuardFactory};
use super::run::{CopyKind, INVENTORY_NAME, RunBase, fail};
use super::topology::Topology;
use crate::backend::InitContext;
use files::{DumpCtx, DumpState};

/// The state of a dump (or pre-dump) run.
pub(super) struct DumpRun {
    pub(super) base: RunBase,
    /// `st_rdev` of `/dev/kfd`.
    kfd_rdev: u64,
    /// Whether this CRIU calls `DUMP_DEVICES_LATE` (dma-bufs may then wait for their BO).
    has_dump_late: bool,
    inventory_added: bool,
    /// The first bad AMD setting (its default is used), which fails the run once it needs AMD.
    settings_error: Option<String>,
    /// CRIU's image stream (`--stream`), looked up on first need.
    stream: OnceCell<Option<ImageStream>>,
    state: DumpState,
    /// Starts the guard, `None`: the run has none.
    guard_factory: Option<QueueGuardFactory>,
    /// What restarts the paused queues should CRIU end first; started before the first pause.
    guard: Option<Box<dyn QueueGuard>>,
    /// No guard can run here (a kernel without pidfds), or the run has none.
    unguarded: bool,
}

impl RunBase {
    fn dump_ctx(&self) -> DumpCtx<'_> {
        DumpCtx {
            dev: self.dev.as_ref(),
            settings: &self.settings,
            images: &self.images,
            limits: self.limits,
        }
    }
}

impl DumpRun {
    pub(super) fn new(
        base: RunBase,
        kfd_rdev: u64,
        settings_error: Option<String>,
        guard_factory: Option<QueueGuardFactory>,
        ctx: &InitContext<'_>,
    ) -> DumpRun {
        DumpRun {
            base,
            kfd_rdev,
            has_dump_late: ctx.host.has_hook(HookId::DumpDevicesLate),
            inventory_added: false,
            settings_error,
            stream: OnceCell::new(),
            state: DumpState::default(),
            guard_factory,
            guard: None,
            unguarded: false,
        }
    }

    /// Starts the guard (once, before the first pause): no queue is paused unless something
    /// outside CRIU restarts it should CRIU end before the dump does.
    fn start_guard(&mut self) -> HookResult {
        if let Some(g) = &self.guard {
            if g.alive() {
                return Ok(());
            }
            return Err(fail(device_error(
                libc::ESRCH,
                "the guardian process that restarts GPU queues should CRIU end early is gone or stopped; no more queues are paused without it".to_string(),
            )));
        }
        if self.unguarded {
            return Ok(());
        }
        let Some(factory) = &self.guard_factory else {
            self.unguarded = true;
            return Ok(());
        };
        match factory(self.base.dev.clone()) {
            Ok(Some(g)) => {
                self.guard = Some(g);
                Ok(())
            }
            Ok(None) => {
                log::warn!(
                    "amdgpu: no guardian can run here (a kernel without pidfds, or CRIU the init of its pid namespace), so GPU queues stay paused should CRIU be killed in the middle of this dump"
                );
                self.unguarded = true;
                Ok(())
            }
            Err(e) => Err(fail(Error::io(
                &e,
                "cannot start the guardian process that restarts GPU queues should CRIU end early; nothing is paused without it",
            ))),
        }
    }

    /// Tells the guard of the process that holds KFD file `fd` (file `id`), before its queues
    /// are paused. Returns its pid when the guard watches it.
    fn watch(&self, fd: BorrowedFd<'_>, id: u32) -> Option<i32> {
        let g = self.guard.as_ref()?;
        let holder = match self.base.dev.kfd_holder(fd) {
            Ok(Some(h)) => h,
            Ok(None) => {
                log::warn!(
                    "amdgpu: file {id}: no process this CRIU traces holds the KFD file; the guardian cannot restart its queues should CRIU end early"
                );
                return None;
            }
            Err(e) => {
                log::warn!(
                    "amdgpu: file {id}: cannot tell which process holds the KFD file ({e}); the guardian cannot restart its queues should CRIU end early"
                );
                return None;
            }
        };
        match g.watch(&holder) {
            Ok(()) => Some(holder.pid),
            Err(e) => {
                log::warn!(
                    "amdgpu: pid {}: the guardian was not told of it ({e}); its queues are paused unguarded",
                    holder.pid
                );
                None
            }
        }
    }

    /// Tells the guard that `pid`'s queues run again, once no file of it is paused.
    fn forget(&self, pid: Option<i32>) {
        let (Some(g), Some(pid)) = (&self.guard, pid) else {
            return;
        };
        let still = self
            .state
            .paused
            .iter()
            .any(|p| p.paused && p.guarded == Some(pid));
        if !still && let Err(e) = g.forget(pid) {
            log::debug!("amdgpu: pid {pid}: the guardian was not told its queues run: {e}");
        }
    }

    fn add_inventory(&mut self) -> HookResult {
        if !self.inventory_added {
            CriuSymbols::get()
                .add_inventory_plugin(INVENTORY_NAME)
                .map_err(|e| {
                    fail(device_error(
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
        let topology = match self.state.topology.take() {
            Some(t) => t,
            None => match Topology::from_sysfs(&self.base.settings.topology_root) {
                Ok(t) => t,
                Err(e) => {
                    log::warn!(
                        "amdgpu: cannot read the KFD topology ({e}); claiming renderD{minor}"
                    );
                    return true;
                }
            },
        };
        self.state
            .topology
            .insert(topology)
            .gpu_by_render_minor(minor)
            .is_some()
    }

    /// Refuses to dump an AMD process when the run cannot: a bad AMD setting (which fails
    /// only runs that need AMD), or CRIU streaming its images (this backend writes its
    /// images as files of the images directory, which a stream would leave out: the dump
    /// would look complete and could not be restored).
    fn refuse_unusable(&self) -> HookResult {
        if let Some(e) = &self.settings_error {
            return Err(fail(Error::new(
                FailureKind::Settings,
                libc::EINVAL,
                format!("{e}; this dump needs the AMD GPU backend: correct the setting"),
            )));
        }
        match self.stream.get_or_init(criu_plugin::stream::image_stream) {
            None => Ok(()),
            Some(s) => Err(fail(device_error(
                libc::EOPNOTSUPP,
                format!(
                    "CRIU streams its images ({s:?}); the AMD GPU backend writes its images as files and does not support --stream, so the process's GPU state would be missing from the stream"
                ),
            ))),
        }
    }

    /// `HANDLE_DEVICE_VMA`: claims mappings of `/dev/kfd` and of KFD GPUs' render nodes.
    pub(super) fn handle_device_vma(&mut self, st: &libc::stat) -> HookResult {
        let id = FileIdentity {
            mode: st.st_mode,
            rdev: st.st_rdev,
            dmabuf: false,
        };
        let ours = match classify(&id, Some(self.kfd_rdev)) {
            FileKind::Kfd => true,
            FileKind::RenderNode { minor } => self.is_kfd_render_node(minor),
            _ => false,
        };
        if !ours {
            return Err(HookError::NotMine);
        }
        self.refuse_unusable()?;
        self.add_inventory()
    }

    /// `DUMP_EXT_FILE`.
    pub(super) fn dump_ext_file(&mut self, fd: RawFd, id: u32) -> HookResult {
        // SAFETY: CRIU passes an fd that is open for the duration of the hook.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let ident = self
            .base
            .dev
            .identify(borrowed)
            .map_err(|e| fail(Error::io(&e, format!("cannot inspect file {id}"))))?;
        match classify(&ident, Some(self.kfd_rdev)) {
            FileKind::Kfd => {
                self.refuse_unusable()?;
                self.add_inventory()?;
                self.dump_kfd(borrowed, id)
            }
            FileKind::RenderNode { minor } => {
                if self.is_kfd_render_node(minor) {
                    self.refuse_unusable()?;
                }
                let ctx = self.base.dump_ctx();
                match files::dump_render_node(&ctx, &mut self.state, borrowed, id, minor) {
                    Ok(Some(user)) => {
                        self.add_inventory()?;
                        log::info!("amdgpu: file {id}: renderD{minor} (GPU {user:#x})");
                        Ok(())
                    }
                    Ok(None) => Err(HookError::NotMine),
                    Err(e) => Err(fail(e.context(format!("dumping render node file {id}")))),
                }
            }
            FileKind::DmaBuf => self.dump_dmabuf(borrowed, id),
            FileKind::Other => Err(HookError::NotMine),
        }
    }

    fn dump_dmabuf(&mut self, fd: BorrowedFd<'_>, id: u32) -> HookResult {
        let ctx = self.base.dump_ctx();
        match files::dump_dmabuf(&ctx, &mut self.state, id, fd) {
            Ok(true) => Ok(()),
            Ok(false) if self.has_dump_late => match fd.try_clone_to_owned() {
                // Its BO may belong to a process dumped later (a copy of the fd is kept, not
                // CRIU's fd number, which CRIU closes once the hook returns:
                // criu_internals::DUMP_EXT_FILE_FD_CLOSED_AFTER_HOOK).
                Ok(copy) => {
                    log::info!("amdgpu: file {id}: dma-buf of no BO dumped so far; deferred");
                    self.state.pending_dmabufs.push((id, copy));
                    Ok(())
                }
                Err(e) => Err(fail(Error::io(&e, "cannot duplicate a dma-buf fd"))),
            },
            Ok(false) => Err(fail(device_error(
                libc::ENOENT,
                format!(
                    "file {id} is a dma-buf of no AMD GPU BO dumped so far, and this CRIU has no DUMP_DEVICES_LATE to wait for it"
                ),
            ))),
            Err(e) => Err(fail(e.context(format!("dumping dma-buf file {id}")))),
        }
    }

    fn dump_kfd(&mut self, fd: BorrowedFd<'_>, id: u32) -> HookResult {
        let started = Instant::now();
        let ctx = self.base.dump_ctx();
        let own = ctx
            .dev
            .open_kfd()
            .map_err(|e| fail(Error::io(&e, "cannot open /dev/kfd")))?;
        device::check_kfd_version(ctx.dev, own.as_fd())
            .map_err(|e| fail(e.context(format!("file {id}"))))?;
        drop(own);
        self.start_guard()?;
        let guarded = self.watch(fd, id);
        let ctx = self.base.dump_ctx();
        let info = match files::pause(&ctx, &mut self.state, fd, id, guarded) {
            Ok(info) => info,
            Err(e) => {
                self.forget(guarded);
                return Err(fail(e.context(format!("file {id}"))));
            }
        };
        log::info!("amdgpu: file {id} (pid {}): GPU queues paused", info.pid);
        match files::checkpoint(&ctx, &mut self.state, fd, id, &info) {
            Ok(stats) => {
                files::log_stats(id, info.pid, &stats, started);
                self.base.copied(id, CopyKind::Dump, stats.copy);
                files::retry_pending_dmabufs(&ctx, &mut self.state)
                    .map_err(|e| fail(e.context("dumping deferred dma-buf files")))?;
                Ok(())
            }
            Err(e) => {
                // The reason first, then the clean-up.
                let errno = e.errno.get();
                log::error!("amdgpu: file {id} (pid {}): {e}", info.pid);
                let mut restarted = None;
                if let Some(p) = self.state.paused.iter_mut().rev().find(|p| p.id == id) {
                    match files::unpause(ctx.dev, p) {
                        Ok(()) => {
                            log::info!(
                                "amdgpu: pid {}: GPU queues restarted after the failed checkpoint",
                                p.pid
                            );
                            restarted = p.guarded;
                        }
                        Err(u) => log::error!("amdgpu: {u}; will retry at the end of the dump"),
                    }
                }
                self.forget(restarted);
                Err(HookError::logged(errno))
            }
        }
    }

    /// Processes whose queues are still stopped.
    fn paused(&self) -> usize {
        self.state.paused.iter().filter(|p| p.paused).count()
    }

    /// UNPAUSE every paused process; every one is tried. Returns the failures.
    fn unpause_all(&mut self) -> usize {
        let mut failures = 0;
        let mut restarted = Vec::new();
        for p in self.state.paused.iter_mut().filter(|p| p.paused) {
            match files::unpause(self.base.dev.as_ref(), p) {
                Ok(()) => {
                    log::debug!("amdgpu: pid {}: GPU queues restarted", p.pid);
                    restarted.push(p.guarded);
                }
                Err(e) => {
                    log::error!("amdgpu: {e}");
                    failures += 1;
                }
            }
        }
        for pid in restarted {
            self.forget(pid);
        }
        failures
    }

    /// `DUMP_DEVICES_LATE`: restarts every stopped queue; fails on dma-bufs of no dumped BO.
    pub(super) fn dump_devices_late(&mut self) -> HookResult {
        if self.state.paused.is_empty() && self.state.pending_dmabufs.is_empty() {
            return Err(HookError::NotMine);
        }
        let started = Instant::now();
        let n = self.paused();
        let failures = self.unpause_all();
        if failures > 0 {
            return Err(HookError::logged(libc::EIO));
        }
        if !self.state.pending_dmabufs.is_empty() {
            let ids: Vec<u32> = self.state.pending_dmabufs.iter().map(|p| p.0).collect();
            return Err(fail(device_error(
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

    /// `DUMP_FINISH`: when the dump failed after `DUMP_DEVICES_LATE`'s turn, the tasks run on
    /// and need their queues.
    pub(super) fn dump_finish(&mut self, ret: i32) -> HookResult {
        let n = self.paused();
        if ret == 0 || n == 0 {
            return Err(HookError::NotMine);
        }
        log::info!(
            "amdgpu: DUMP_FINISH({ret}): the tasks run on; restarting the GPU queues of {n} process(es)"
        );
        if self.unpause_all() > 0 {
            return Err(fail(device_error(
                libc::EIO,
                "some GPU queues could not be restarted".to_string(),
            )));
        }
        Ok(())
    }

    /// `exit`: restarts whatever is still stopped (hosts without `DUMP_DEVICES_LATE`, failed
    /// dumps), then releases the guardian, or leaves it to try again once CRIU has ended
    /// (CRIU then no longer traces the processes).
    pub(super) fn finish(&mut self, ret: i32) {
        let n = self.paused();
        if n > 0 {
            log::info!(
                "amdgpu: dump {}: restarting the GPU queues of {n} process(es)",
                if ret != 0 { "failed" } else { "done" }
            );
            if self.unpause_all() > 0 {
                log::error!("amdgpu: some GPU queues could not be restarted");
            }
        }
        let Some(g) = self.guard.take() else {
            return;
        };
        let left = self.paused();
        if left == 0 {
            g.release();
        } else {
            log::warn!(
                "amdgpu: the GPU queues of {left} process(es) are still paused; the guardian tries again once CRIU has ended"
            );
        }
    }
}
