//! A restore run ([`RestoreRun`], one restore's state from `init` to `exit`, laid out as
//! CUDA's): the hooks of CRIU's main process (`RESTORE_INIT`, `POST_FORKING`,
//! `RESUME_DEVICES_LATE`, `exit`) and of the restored tasks (`RESTORE_EXT_FILE`,
//! `UPDATE_VMA_MAP`) over what [`files`] does per file, with the state each task keeps, the
//! parallel restore's outcome and the restore's guardian ([`crate::restore_guardian`]): should
//! CRIU end before every KFD process has its queues resumed, it ends the tasks CRIU forked.

pub(crate) mod files;

use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::os::fd::{AsFd, IntoRawFd, OwnedFd, RawFd};
use std::time::Instant;

use criu_plugin::{HookError, HookResult, VmaUpdate};

use super::contents;
use super::device;
use super::error::{Error, FailureKind, device_error};
use super::parallel::{Handover, QueueOutcome};
use super::run::{CopyKind, MAX_KFD_IMAGES, RunBase, fail};
use super::topology::Topology;
use crate::restore_guardian::{RestoreGuardian, Watch};
use files::{RestoreCtx, TaskState};

/// The state of a restore run, in CRIU's main process and (as forked copies) in every
/// restored task.
pub(super) struct RestoreRun {
    base: RunBase,
    /// What the restore processes pass each other (set up before CRIU forks), when CRIU has
    /// an fdstore.
    handover: Option<Handover>,
    /// Whether the image has dma-buf files (restored BOs are then published by key).
    publish_dmabufs: bool,
    /// How the parallel restore ended, once it did.
    outcome: Option<QueueOutcome>,
    /// Per-task state, by the task's pid.
    tasks: HashMap<u32, TaskState>,
    /// The `/dev/kfd` RESUME goes through, opened on first use.
    resume_kfd: Option<OwnedFd>,
    /// Whether to start a guardian at the preflight.
    want_guardian: bool,
    /// Ends the tasks CRIU forked should CRIU end before the tree has its GPU state.
    guardian: Option<RestoreGuardian>,
    /// The processes with KFD state in the image (distinct pids of the KFD images).
    kfd_processes: usize,
    /// The tasks RESUME went through for.
    resumed: HashSet<i32>,
    /// The first task `RESUME_DEVICES_LATE` came for: the root (CRIU calls it for the root
    /// first: [`criu_plugin::criu_internals::RESUME_DEVICES_LATE_ROOT_FIRST`]).
    root: Option<i32>,
    /// This machine's KFD topology, read in CRIU's main process before it forks the tasks
    /// (when the images hold KFD files and it was readable): a task restoring its files
    /// sees its container's file system, where the topology's path need not exist.
    local: Option<Topology>,
}

impl RestoreRun {
    pub(super) fn new(
        base: RunBase,
        handover: Option<Handover>,
        publish_dmabufs: bool,
        want_guardian: bool,
    ) -> RestoreRun {
        let has_kfd = base
            .images
            .kfd_ids(MAX_KFD_IMAGES)
            .is_ok_and(|ids| !ids.is_empty());
        // Unreadable: the preflight and the tasks read it again and say why.
        let local = has_kfd
            .then(|| files::read_local_topology(&base.settings).ok())
            .flatten();
        RestoreRun {
            local,
            base,
            handover,
            publish_dmabufs,
            outcome: None,
            tasks: HashMap::new(),
            resume_kfd: None,
            want_guardian,
            guardian: None,
            kfd_processes: 0,
            resumed: HashSet::new(),
            root: None,
        }
    }

    fn restore_ctx(&self) -> RestoreCtx<'_> {
        RestoreCtx {
            dev: self.base.dev.as_ref(),
            settings: &self.base.settings,
            images: &self.base.images,
            limits: self.base.limits,
            handover: self.handover.as_ref(),
            publish_dmabufs: self.publish_dmabufs,
            local: self.local.as_ref(),
        }
    }

    /// `RESTORE_INIT`: every KFD image readable and its GPUs mappable onto this machine,
    /// before anything is forked.
    pub(super) fn preflight(&mut self) -> HookResult {
        let ids = self
            .base
            .images
            .kfd_ids(MAX_KFD_IMAGES)
            .map_err(|e| fail(e.context("restore preflight")))?;
        if ids.is_empty() {
            return Err(HookError::NotMine);
        }
        // The architecture, before the GPUs are mapped (another machine's topology would fail
        // first) and before CRIU forks the tasks (its own check comes only after); the process
        // tree it needs is read once, for the guardian too.
        let dir = self.base.images.dir_fd().ok();
        let image_pids = match dir.map(criu_plugin::pstree::read_pids) {
            Some(Ok(pids)) => pids,
            Some(Err(e)) => {
                log::debug!("amdgpu: process tree not read: {e}");
                Vec::new()
            }
            None => Vec::new(),
        };
        if let Some(why) =
            dir.and_then(|dir| criu_plugin::core_image::foreign_architecture(dir, &image_pids))
        {
            return Err(fail(Error::new(FailureKind::Image, libc::EINVAL, why)));
        }
        let ctx = self.restore_ctx();
        let mut pids = HashSet::new();
        for id in &ids {
            let image = ctx
                .images
                .dir()
                .and_then(|d| Ok(d.read_kfd(*id, &ctx.images.limits)?))
                .map_err(|e| fail(e.context("restore preflight")))?;
            files::check_image(&image, &ctx.limits)
                .and_then(|()| files::compute_map(&ctx, &image))
                .and_then(|_| contents::open_pages(ctx.images, *id, &image).map(drop))
                .map_err(|e| fail(e.context(format!("restore preflight of KFD file {id}"))))?;
            pids.insert(image.pid);
        }
        self.kfd_processes = pids.len();
        log::info!("amdgpu: {} KFD file(s) can be restored here", ids.len());
        self.start_guardian(&image_pids)
    }

    /// Starts the restore's guardian (once; before CRIU forks the tasks, which the preflight
    /// is): no KFD process is restored unless something outside CRIU ends the tree should
    /// CRIU end before the queues are resumed.
    fn start_guardian(&mut self, image_pids: &[u32]) -> HookResult {
        if !self.want_guardian || self.guardian.is_some() {
            return Ok(());
        }
        match RestoreGuardian::spawn("amdgpu", image_pids, || ()) {
            Ok(g) => {
                self.guardian = g;
                Ok(())
            }
            Err(why) => Err(fail(device_error(libc::EAGAIN, why))),
        }
    }

    /// `RESTORE_EXT_FILE`, in the task that owns file `id`.
    pub(super) fn restore_ext_file(
        &mut self,
        id: u32,
        retry: Option<&mut bool>,
    ) -> HookResult<RawFd> {
        let me = self.base.dev.current_task();
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
                let (fd, copied) = files::restore_kfd(&ctx, task, id, &image)
                    .map_err(|e| fail(e.context(format!("restoring KFD file {id}"))))?;
                if let Some(stats) = copied {
                    self.base.copied(id, CopyKind::RestoreInTask, stats);
                }
                return Ok(fd.into_raw_fd());
            }
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(fail(Error::from(e))),
        }
        match dir.read_render_node(id, &ctx.images.limits) {
            Ok(image) => {
                let fd = files::restore_render(&ctx, task, id, &image)
                    .map_err(|e| fail(e.context(format!("restoring render node file {id}"))))?;
                return Ok(fd.into_raw_fd());
            }
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(fail(Error::from(e))),
        }
        match dir.read_dmabuf(id, &ctx.images.limits) {
            Ok(image) => {
                let can_retry = retry.is_some();
                match files::restore_dmabuf(&ctx, task, id, image.gem_handle, can_retry) {
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

    /// `UPDATE_VMA_MAP`: the new mmap offset (and the render fd) of a KFD or render-node
    /// mapping of the calling task.
    pub(super) fn update_vma_map(
        &mut self,
        path: &CStr,
        addr: u64,
        old_pgoff: u64,
    ) -> HookResult<VmaUpdate> {
        let Some(kind) = mapped_path(path) else {
            return Err(HookError::NotMine);
        };
        let me = self.base.dev.current_task();
        if let Some(t) = self.tasks.get_mut(&me) {
            files::drop_kept_renders(t);
        }
        let found = self.tasks.get(&me).and_then(|t| {
            let at_va = t
                .remaps
                .iter()
                .find(|r| r.addr == addr && r.old_offset == old_pgoff);
            // libhsakmt maps doorbells and MMIO pages at their BO's GPU address; a program
            // that maps them elsewhere is found by the offset, which names the page's kind
            // and GPU and so is one BO's alone.
            let by_offset = || {
                if kind != MappedPath::Kfd {
                    return None;
                }
                let mut same = t
                    .remaps
                    .iter()
                    .filter(|r| r.render_minor.is_none() && r.old_offset == old_pgoff);
                match (same.next(), same.next()) {
                    (Some(r), None) => Some(r),
                    _ => None,
                }
            };
            at_va.or_else(by_offset).map(|r| (t, r))
        });
        let Some((task, r)) = found else {
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
                let fd = files::dup_for_criu(task, minor).map_err(fail)?;
                Some(fd.into_raw_fd())
            }
            _ => None,
        };
        Ok(VmaUpdate {
            new_pgoff: r.new_offset,
            plugin_fd,
        })
    }

    /// `POST_FORKING`: tells the guardian of the root task; claims the parallel restore.
    pub(super) fn post_forking(&mut self) -> HookResult {
        if let Some(g) = &self.guardian {
            g.announce_roots();
        }
        if !self.handover.as_ref().is_some_and(Handover::parallel) {
            return Err(HookError::NotMine);
        }
        // A thread serving the queue from here on would still run when CRIU enters the
        // restored tree's mount namespace, which the kernel refuses to a multi-threaded
        // process (criu_internals::MOUNT_NS_ENTERED_AFTER_POST_FORKING): the copies wait for
        // RESUME_DEVICES_LATE.
        Ok(())
    }

    /// `RESUME_DEVICES_LATE` of `pid`: the first call tells the guardian of the root and does
    /// the copies tasks handed over; then RESUME. Once every KFD process of the image has
    /// been resumed, the guardian leaves the tree running.
    pub(super) fn resume(&mut self, pid: i32) -> HookResult {
        let r = self.resume_one(pid);
        if r.is_ok() {
            self.resumed.insert(pid);
            if self.resumed.len() == self.kfd_processes
                && let (Some(g), Some(root)) = (&self.guardian, self.root)
            {
                g.watch_root(root, Watch::Settled);
            }
        }
        r
    }

    fn resume_one(&mut self, pid: i32) -> HookResult {
        if self.root.is_none() {
            self.root = Some(pid);
            // Before any GPU work: should CRIU end from here on, the guardian ends the tree.
            if let Some(g) = &self.guardian {
                g.watch_root(pid, Watch::EndTree);
            }
        }
        self.serve_handed_over_copies();
        if let Some(o) = &self.outcome {
            if !o.failed.is_empty() {
                // CRIU before 4.3 ignores this hook's errors (criu_internals::
                // RESUME_DEVICES_LATE_FAILURE), so the process would run on with missing GPU
                // memory; its queues stay evicted instead.
                log::error!(
                    "amdgpu: BO contents of KFD file(s) {:?} could not be restored; pid {pid} is left with its GPU queues stopped",
                    o.failed.iter().map(|f| f.0).collect::<Vec<_>>()
                );
                return Err(HookError::logged(libc::EIO));
            }
        }
        let dev = self.base.dev.as_ref();
        let kfd = match self.resume_kfd.take() {
            Some(fd) => fd,
            None => dev
                .open_kfd()
                .map_err(|e| fail(Error::io(&e, "cannot open /dev/kfd")))?,
        };
        let kfd: &OwnedFd = self.resume_kfd.insert(kfd);
        let started = Instant::now();
        match device::resume(dev, kfd.as_fd(), pid as u32) {
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

    /// `exit`: the copies a failed restore left, then the fdstore is cleared. A restore that
    /// succeeded releases the guardian; one that failed leaves it to end what CRIU leaves
    /// behind once CRIU has ended.
    pub(super) fn finish(&mut self, ret: i32) {
        self.serve_handed_over_copies();
        if let Some(h) = &self.handover {
            h.clear();
        }
        if ret == 0
            && let Some(g) = self.guardian.take()
        {
            g.release();
        }
    }

    /// Ends the parallel restore: serves every request the tasks handed over, here in CRIU's
    /// main process (with the copy pipeline's threads, joined before it returns), logs what
    /// was done and keeps the outcome.
    fn serve_handed_over_copies(&mut self) {
        let Some(h) = &self.handover else {
            return;
        };
        if !h.parallel() || self.outcome.is_some() {
            return;
        }
        let started = Instant::now();
        let served = h.serve_ready(
            self.base.dev.as_ref(),
            &self.base.settings,
            &self.base.images,
        );
        for s in &served {
            if let Ok(stats) = &s.result {
                self.base.copied(s.file_id, CopyKind::RestoreInMain, *stats);
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
        let o = h.outcome().unwrap_or_default();
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

/// Kind of a mapped device path (`UPDATE_VMA_MAP`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MappedPath {
    /// `/dev/kfd`.
    Kfd,
    /// `/dev/dri/renderD<minor>`.
    Render,
}

/// Classifies a mapping's path, with repeated slashes collapsed (CRIU may record
/// `//dev//dri/renderD128`). Other paths are not the backend's.
pub fn mapped_path(path: &CStr) -> Option<MappedPath> {
    let raw = path.to_bytes();
    let mut norm = Vec::with_capacity(raw.len());
    for &c in raw {
        if c == b'/' && norm.last() == Some(&b'/') {
            continue;
        }
        norm.push(c);
    }
    if norm == b"/dev/kfd" {
        Some(MappedPath::Kfd)
    } else if let Some(rest) = norm.strip_prefix(b"/dev/dri/renderD") {
        (!rest.is_empty() && rest.iter().all(u8::is_ascii_digit)).then_some(MappedPath::Render)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_paths_are_normalised() {
        assert_eq!(mapped_path(c"/dev/kfd"), Some(MappedPath::Kfd));
        assert_eq!(mapped_path(c"//dev//kfd"), Some(MappedPath::Kfd));
        assert_eq!(
            mapped_path(c"/dev/dri/renderD128"),
            Some(MappedPath::Render)
        );
        assert_eq!(
            mapped_path(c"//dev//dri/renderD130"),
            Some(MappedPath::Render)
        );
        assert_eq!(mapped_path(c"/dev/dri/renderD"), None);
        assert_eq!(mapped_path(c"/dev/dri/card0"), None);
        assert_eq!(mapped_path(c"/dev/kfd2"), None);
        assert_eq!(mapped_path(c"/dev/zero"), None);
    }
}
