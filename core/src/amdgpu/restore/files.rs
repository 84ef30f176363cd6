//! The files of a restore run ([`super::RestoreRun`]): KFD, render-node and dma-buf files
//! inside the restored task, BO contents (in the task or
//! in CRIU's main process, see [`crate::amdgpu::parallel`]), mmap offset remapping, RESUME.
//!
//! Per KFD file (`RESTORE_EXT_FILE`, in the task):
//!
//! 1. The image is read (bounded) and checked; the GPU map from the image's topology to this
//!    machine's is computed once per task and shared with the task's render-node files
//!    (whichever comes first; the C plugin assumed the KFD file came first and had no map
//!    for a render node restored before it).
//! 2. The pages files are opened and checked against the BO list *before* any kernel state
//!    is created, so a truncated or forged image fails cleanly.
//! 3. Render nodes of the mapped GPUs are opened (a failure is an error here; the C plugin
//!    passed the bad descriptor on to KFD, which then failed obscurely) and moved
//!    above every fd CRIU will restore; KFD binds the process's VMs to them.
//! 4. `RESTORE` recreates the BOs; their new mmap offsets are kept for `UPDATE_VMA_MAP`.
//! 5. The BO contents are written through the copy pipeline, or handed to CRIU's main
//!    process (parallel restore).
//!
//! No fd the plugin opens in a task may stay behind as one of the restored process's files
//! (it would be dumped with the process next time and collide or pile up): dma-bufs are
//! passed through CRIU's fdstore, and the render fds bound to the VMs are closed at the
//! task's first `UPDATE_VMA_MAP` where the task holds the same files itself.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Instant;

use kfd_sys::{kfd_criu_bo_bucket, kfd_criu_device_bucket};

use crate::amdgpu::contents;
use crate::amdgpu::copy;
use crate::amdgpu::device::{self, AllocFlags, Bytes, CriuBuffers, CriuLimits, KfdDevice};
use crate::amdgpu::error::{Error, FailureKind, Result, device_error};
use crate::amdgpu::image::{KfdCheckpoint, RenderNodeImage};
use crate::amdgpu::parallel::Handover;
use crate::amdgpu::settings::AmdgpuSettings;
use crate::amdgpu::store::ImageStore;
use crate::amdgpu::topology::{CompatChecks, GpuMap, Topology, map_gpus};
use criu_plugin::fds;

/// A device mapping whose offset changes at restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmaRemap {
    /// Start address (the BO's GPU VA, where ROCm also maps it for the CPU).
    pub addr: u64,
    /// mmap offset at checkpoint.
    pub old_offset: u64,
    /// mmap offset now.
    pub new_offset: u64,
    /// Render minor to map through (VRAM/GTT BOs); `None` for pages mapped through
    /// `/dev/kfd` (doorbells, MMIO).
    pub render_minor: Option<u32>,
}

/// State of one restored task.
#[derive(Default)]
pub struct TaskState {
    /// The GPU map of this task's process.
    pub map: Option<GpuMap>,
    /// Render nodes bound to the process's KFD VMs, by restore minor (kept open until the
    /// task holds the same file under a number of its own: [`drop_kept_renders`]).
    pub render: HashMap<u32, OwnedFd>,
    /// The task's own fd of the file a dropped entry of `render` was, by restore minor.
    pub render_own: HashMap<u32, RawFd>,
    /// Whether [`drop_kept_renders`] ran.
    pub renders_settled: bool,
    /// One above every fd number CRIU restores in the task, as far as known (the lowest
    /// number the plugin's own fds were placed at).
    pub fd_limit: std::ffi::c_int,
    /// Offset remapping for `UPDATE_VMA_MAP`.
    pub remaps: Vec<VmaRemap>,
    /// KFD files restored.
    pub kfd_files: Vec<u32>,
    /// dma-bufs of restored BOs by cross-reference key, for the task's dma-buf files (only
    /// without an fdstore, which serves them otherwise).
    pub dmabufs: HashMap<u32, OwnedFd>,
    /// dma-buf files this task was asked to restore and answered "retry", by file id.
    pub dmabuf_retries: HashMap<u32, u32>,
}

/// What the restore needs from the backend.
pub struct RestoreCtx<'a> {
    /// The kernel.
    pub dev: &'a dyn KfdDevice,
    /// Settings.
    pub settings: &'a AmdgpuSettings,
    /// Where images are.
    pub images: &'a ImageStore,
    /// Bounds for images.
    pub limits: CriuLimits,
    /// What the restore processes pass each other (the parallel restore's queue, dma-bufs
    /// published by key), when CRIU has an fdstore.
    pub handover: Option<&'a Handover>,
    /// Whether the image has dma-buf files (restored BOs are then published by key).
    pub publish_dmabufs: bool,
    /// This machine's KFD topology as CRIU's main process read it, if it did.
    pub local: Option<&'a Topology>,
}

/// Checks a KFD image for what the kernel and the copy rely on, before anything is created.
pub fn check_image(image: &KfdCheckpoint, limits: &CriuLimits) -> Result<()> {
    let gpus = image.devices.iter().filter(|d| d.gpu_id != 0).count();
    let bad = |m: String| Err(device_error(libc::EINVAL, m));
    if gpus == 0 || gpus > limits.max_devices as usize {
        return bad(format!("the image lists {gpus} GPUs"));
    }
    if gpus != image.num_of_gpus as usize {
        return bad(format!(
            "the image says {} GPUs but lists {gpus}",
            image.num_of_gpus
        ));
    }
    if image.bos.is_empty() {
        return bad("the image has no BOs; KFD cannot restore such a process".into());
    }
    if image.bos.len() > limits.max_bos as usize {
        return bad(format!(
            "the image has {} BOs, over the limit",
            image.bos.len()
        ));
    }
    if image.priv_data.is_empty() || image.priv_data.len() as u64 > limits.max_priv_data {
        return bad(format!(
            "the image's KFD private data is {} bytes",
            image.priv_data.len()
        ));
    }
    for (i, b) in image.bos.iter().enumerate() {
        if b.size == 0 || b.addr.checked_add(b.size).is_none() {
            return bad(format!("BO {i} has size {:#x} at {:#x}", b.size, b.addr));
        }
    }
    Ok(())
}

/// Reads this machine's KFD topology from where the settings say.
pub fn read_local_topology(settings: &AmdgpuSettings) -> Result<Topology> {
    let root = &settings.topology_root;
    Topology::from_sysfs(root).map_err(|e| {
        device_error(
            libc::ENODEV,
            format!(
                "cannot read this machine's KFD topology at {}: {e}",
                root.display()
            ),
        )
    })
}

/// This machine's KFD topology: as CRIU's main process read it, else read now.
fn local_topology(ctx: &RestoreCtx<'_>) -> Result<Topology> {
    match ctx.local {
        Some(t) => Ok(t.clone()),
        None => read_local_topology(ctx.settings),
    }
}

/// Computes the GPU map of `image` onto this machine.
pub fn compute_map(ctx: &RestoreCtx<'_>, image: &KfdCheckpoint) -> Result<GpuMap> {
    let mut local = local_topology(ctx)?;
    let hidden = local.retain_accessible(|g| ctx.dev.render_node_present(g.drm_render_minor));
    for g in hidden {
        log::info!("amdgpu: GPU {g:#x} has no render node here; not a restore candidate");
    }
    let map = map_onto(image, &local, &ctx.settings.checks)?;
    for m in map.iter() {
        log::info!(
            "amdgpu: GPU {:#06x} (renderD{}) restores onto {:#06x} (renderD{})",
            m.checkpoint_gpu_id,
            m.checkpoint_render_minor,
            m.restore_gpu_id,
            m.restore_render_minor
        );
    }
    Ok(map)
}

/// The GPU map of `image`'s topology onto `local` (this machine's, the GPUs the restored task
/// cannot reach already removed): the restore preflight's mapping, for the plugin and the
/// `criu-gpu check` tool alike.
pub fn map_onto(image: &KfdCheckpoint, local: &Topology, checks: &CompatChecks) -> Result<GpuMap> {
    let src = Topology::from_device_entries(&image.devices).map_err(|e| {
        Error::new(
            FailureKind::Image,
            libc::EINVAL,
            format!("the image's topology is invalid: {e}"),
        )
    })?;
    map_gpus(&src, local, checks).map_err(|e| {
        Error::new(
            FailureKind::Machine,
            libc::ENODEV,
            format!("cannot restore onto this machine's GPUs: {e}"),
        )
    })
}

/// Restores KFD file `id` (image already read) in the calling task; returns the new
/// `/dev/kfd` fd for CRIU, and the statistics of the BO content copy when the task did it
/// (`None` when it was handed to CRIU's main process).
pub fn restore_kfd(
    ctx: &RestoreCtx<'_>,
    task: &mut TaskState,
    id: u32,
    image: &KfdCheckpoint,
) -> Result<(OwnedFd, Option<copy::CopyStats>)> {
    let started = Instant::now();
    check_image(image, &ctx.limits)?;
    let kfd = ctx
        .dev
        .open_kfd()
        .map_err(|e| Error::io(&e, "cannot open /dev/kfd"))?;
    device::check_kfd_version(ctx.dev, kfd.as_fd())?;
    let map = match task.map.take() {
        Some(m) => m,
        None => compute_map(ctx, image)?,
    };
    let map = task.map.insert(map).clone();
    // Fail on a bad pages file before creating anything in the kernel.
    drop(contents::open_pages(ctx.images, id, image)?);

    let fd_min = fds::first_free_fd(image.pid);
    let mut bufs = CriuBuffers {
        num_objects: image.num_of_objects,
        priv_data: image.priv_data.clone(),
        ..Default::default()
    };
    let mut minor_of = HashMap::new();
    for d in image.devices.iter().filter(|d| d.gpu_id != 0) {
        let m = map.get(d.gpu_id).ok_or_else(|| {
            device_error(
                libc::ENODEV,
                format!("GPU {:#x} of the image is not mapped", d.gpu_id),
            )
        })?;
        minor_of.insert(d.gpu_id, m.restore_render_minor);
        let fd = open_task_render(ctx, task, m.restore_render_minor, fd_min)?;
        bufs.devices.push(kfd_criu_device_bucket {
            user_gpu_id: d.gpu_id,
            actual_gpu_id: m.restore_gpu_id,
            drm_fd: fd as u32,
            pad: 0,
        });
    }
    bufs.bos = image
        .bos
        .iter()
        .map(|b| kfd_criu_bo_bucket {
            addr: b.addr,
            size: b.size,
            offset: b.offset,
            restored_offset: 0,
            gpu_id: b.gpu_id,
            alloc_flags: b.alloc_flags,
            dmabuf_fd: kfd_sys::KFD_INVALID_FD,
            pad: 0,
        })
        .collect();
    let dmabufs = device::restore(ctx.dev, kfd.as_fd(), &mut bufs)
        .map_err(|e| Error::io(&e, "KFD RESTORE failed"))?;

    for (b, bucket) in image.bos.iter().zip(&bufs.bos) {
        if !AllocFlags::of(b.alloc_flags).intersects(AllocFlags::REMAPPED) {
            continue;
        }
        task.remaps.push(VmaRemap {
            addr: b.addr,
            old_offset: b.offset,
            new_offset: bucket.restored_offset,
            render_minor: if b.has_contents() {
                minor_of.get(&b.gpu_id).copied()
            } else {
                None
            },
        });
    }

    if ctx.publish_dmabufs {
        publish_dmabufs(ctx, task, image, &dmabufs, fd_min)?;
    }

    let bytes = image
        .content_bos()
        .fold(0u64, |a, (_, s)| a.saturating_add(s));
    let handed_over = match ctx.handover {
        Some(h) if bytes > 0 => h.hand_over(id, &minor_of, &dmabufs),
        _ => false,
    };
    let mut copied = None;
    if handed_over {
        log::info!(
            "amdgpu: file {id}: {} of BO contents handed to CRIU's main process",
            Bytes(bytes)
        );
    } else {
        let stats = contents::Contents {
            dev: ctx.dev,
            settings: ctx.settings,
            images: ctx.images,
            id,
            image,
            minor_of: &minor_of,
            dmabufs: &dmabufs,
        }
        .load()?;
        log::info!(
            "amdgpu: file {id}: {} of BO contents restored in {:.3} s ({:.0} MiB/s)",
            Bytes(stats.bytes),
            stats.elapsed.as_secs_f64(),
            stats.rate() / (1u64 << 20) as f64
        );
        copied = Some(stats);
    }
    drop(dmabufs);
    ctx.dev
        .restore_hsakmt_shared_mem(image.shared_mem_size, image.shared_mem_magic)
        .map_err(|e| Error::io(&e, "cannot recreate libhsakmt's shared memory"))?;
    task.kfd_files.push(id);
    log::info!(
        "amdgpu: file {id} (pid {}): {} GPU(s), {} BO(s) restored in {:.3} s",
        image.pid,
        minor_of.len(),
        image.bos.len(),
        started.elapsed().as_secs_f64()
    );
    Ok((kfd, copied))
}

/// Restores render-node file `id` in the calling task: a copy of the render node of the GPU
/// its image's GPU maps to, the same open file the task's KFD VM is (or will be) bound to.
pub fn restore_render(
    ctx: &RestoreCtx<'_>,
    task: &mut TaskState,
    id: u32,
    image: &RenderNodeImage,
) -> Result<OwnedFd> {
    if let Some(drm) = &image.drm {
        if !drm.bos.is_empty() {
            return Err(device_error(
                libc::EOPNOTSUPP,
                format!(
                    "render node image {id} holds {} GEM BOs allocated through the render node; restoring those is not supported",
                    drm.bos.len()
                ),
            ));
        }
    }
    let me = ctx.dev.current_task();
    let mut fd_min = fds::first_free_fd(me);
    let map = match task.map.take() {
        Some(map) => map,
        None => {
            // The map of this task's process comes from its KFD image, found by pid (CRIU
            // restores pids), whether or not that file was restored yet.
            let mut found = None;
            for kid in ctx
                .images
                .kfd_ids(crate::amdgpu::parallel::MAX_REQUESTS * 8)?
            {
                let k = ctx.images.dir()?.read_kfd(kid, &ctx.images.limits)?;
                if k.pid == me {
                    found = Some(k);
                    break;
                }
            }
            let Some(k) = found else {
                // A process with a render node but no KFD state: the same GPU, if present.
                let local = local_topology(ctx)?;
                let g = local.gpu_by_id(image.gpu_id).ok_or_else(|| {
                    device_error(
                        libc::ENODEV,
                        format!(
                            "render node image {id} is for GPU {:#x}, which this machine lacks",
                            image.gpu_id
                        ),
                    )
                })?;
                // No KFD VM to bind: CRIU gets the file, and the task keeps nothing.
                let minor = g.drm_render_minor;
                return open_render(ctx, minor);
            };
            check_image(&k, &ctx.limits)?;
            fd_min = fds::first_free_fd(k.pid);
            compute_map(ctx, &k)?
        }
    };
    let m = task.map.insert(map).get(image.gpu_id).ok_or_else(|| {
        device_error(
            libc::ENODEV,
            format!("render node image {id} is for GPU {:#x}, which the process's KFD image does not list", image.gpu_id),
        )
    })?;
    let minor = m.restore_render_minor;
    open_task_render(ctx, task, minor, fd_min)?;
    dup_for_criu(task, minor)
}

/// A copy of the task's render fd for `minor`, for CRIU to own: of the plugin's fd, to which
/// the KFD VM is bound, or, once [`drop_kept_renders`] closed that, of the task's own.
pub fn dup_for_criu(task: &TaskState, minor: u32) -> Result<OwnedFd> {
    let dup = match (task.render.get(&minor), task.render_own.get(&minor)) {
        (Some(fd), _) => fd.try_clone(),
        // SAFETY: `fd` is a number of the task's own files that CRIU restored before the
        // task's mappings and closes none of until the task runs; it is only duplicated.
        (None, Some(&fd)) => unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned(),
        (None, None) => {
            return Err(device_error(
                libc::EBADF,
                format!("renderD{minor} is not open"),
            ));
        }
    };
    dup.map_err(|e| Error::io(&e, format!("cannot duplicate the fd of renderD{minor}")))
}

/// Closes each render fd the plugin kept in the task for which the task now holds the same
/// open file under a number of its own (the program's render fd, restored by CRIU from the
/// plugin's copy). Called at the task's first `UPDATE_VMA_MAP`: CRIU restores all of a
/// task's files before its mappings. A kept fd would otherwise become one of the restored
/// process's files, one more per GPU at every restore; KFD holds its own reference to the
/// file its VM is bound to, and later mappings are given copies of the task's own fd.
pub fn drop_kept_renders(task: &mut TaskState) {
    if std::mem::replace(&mut task.renders_settled, true) || task.render.is_empty() {
        return;
    }
    // Only the numbers CRIU restored are the program's (and no /proc is needed: the task
    // may already be in a mount namespace without one).
    let limit = task.fd_limit.clamp(0, 1 << 20);
    let minors: Vec<u32> = task.render.keys().copied().collect();
    for minor in minors {
        let ours = task.render[&minor].as_raw_fd();
        if let Some(own) = (0..limit).find(|&fd| fd != ours && same_open_file(ours, fd)) {
            log::debug!("amdgpu: renderD{minor}: the task holds it as fd {own}; closing fd {ours}");
            task.render.remove(&minor);
            task.render_own.insert(minor, own);
        }
    }
}

/// Whether fds `a` and `b` of the calling process are the same open file (`kcmp`; false
/// where the kernel cannot tell).
fn same_open_file(a: RawFd, b: RawFd) -> bool {
    const KCMP_FILE: libc::c_int = 0;
    let pid = std::process::id() as libc::pid_t;
    // SAFETY: kcmp(2) with KCMP_FILE compares two fd numbers of a process; it reads and
    // writes no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            libc::c_long::from(pid),
            libc::c_long::from(pid),
            libc::c_long::from(KCMP_FILE),
            a as libc::c_ulong,
            b as libc::c_ulong,
        )
    };
    r == 0
}

/// Makes the dma-bufs of the restored BOs that have a cross-reference key available to the
/// task's dma-buf files and other tasks': through CRIU's fdstore, held by CRIU's main process
/// until CRIU exits. Only where that fails does the task keep a copy, placed at or above
/// `fd_min`: an fd the plugin holds when the task leaves CRIU's code becomes one of the
/// restored process's files, so it must not take a number CRIU restores, and it keeps the BO
/// alive, so it is kept only where nothing else can serve the task's own dma-buf files.
fn publish_dmabufs(
    ctx: &RestoreCtx<'_>,
    task: &mut TaskState,
    image: &KfdCheckpoint,
    dmabufs: &[Option<OwnedFd>],
    fd_min: std::ffi::c_int,
) -> Result<()> {
    for (b, fd) in image.bos.iter().zip(dmabufs) {
        let (Some(key), Some(fd)) = (b.handle, fd) else {
            continue;
        };
        if let Some(h) = ctx.handover {
            if h.publish(key, fd.as_fd())? {
                continue;
            }
        }
        let copy = fd
            .try_clone()
            .and_then(|c| fds::place_fd(c, fd_min))
            .map_err(|e| Error::io(&e, "cannot duplicate a dma-buf"))?;
        task.dmabufs.insert(key, copy);
    }
    Ok(())
}

/// How long a task waits for another task to restore the BO of one of its dma-buf files.
pub const DMABUF_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Restores dma-buf file `id` (key `key`): a dma-buf of the restored BO with that key, from
/// this task or another. `Ok(None)` asks CRIU to retry later (the BO is not restored yet).
///
/// CRIU runs a task's files again after a "retry" only when the task made progress with
/// others or another task sent it a file
/// ([`criu_plugin::criu_internals::RESTORE_EXT_FILE_RETRY_NEEDS_PROGRESS`]); the task
/// restoring the BO sends it none. So the
/// first answer is "retry" (the BO may be this task's own, with its KFD file further on),
/// and the second time the task waits here, bounded, for another task to publish the
/// dma-buf: answering "retry" again would leave the task, and the restore, asleep for ever.
pub fn restore_dmabuf(
    ctx: &RestoreCtx<'_>,
    task: &mut TaskState,
    id: u32,
    key: u32,
    can_retry: bool,
) -> Result<Option<OwnedFd>> {
    if let Some(fd) = task.dmabufs.get(&key) {
        return fd
            .try_clone()
            .map(Some)
            .map_err(|e| Error::io(&e, "cannot duplicate a dma-buf"));
    }
    if let Some(fd) = ctx.handover.map(|h| h.find(key)).transpose()?.flatten() {
        return Ok(Some(fd));
    }
    let asked = task.dmabuf_retries.entry(id).or_insert(0);
    *asked += 1;
    if can_retry && *asked == 1 {
        log::debug!("amdgpu: file {id}: the BO with key {key} is not restored yet; retrying later");
        return Ok(None);
    }
    if let Some(h) = ctx.handover {
        let started = std::time::Instant::now();
        while started.elapsed() < DMABUF_WAIT {
            std::thread::sleep(std::time::Duration::from_millis(5));
            if let Some(fd) = h.find(key)? {
                log::debug!(
                    "amdgpu: file {id}: the BO with key {key} was restored by another task after {:.3} s",
                    started.elapsed().as_secs_f64()
                );
                return Ok(Some(fd));
            }
        }
        return Err(device_error(
            libc::ETIMEDOUT,
            format!(
                "dma-buf file {id}: no task restored the BO it refers to (key {key}) within {} s",
                DMABUF_WAIT.as_secs()
            ),
        ));
    }
    Err(device_error(
        libc::ENOENT,
        format!(
            "dma-buf file {id}: the BO it refers to (key {key}) is not this task's, and this CRIU has no fdstore to take it from another task"
        ),
    ))
}

/// Opens (once per task) the render node `minor` the process's VM will be bound to.
fn open_task_render(
    ctx: &RestoreCtx<'_>,
    task: &mut TaskState,
    minor: u32,
    fd_min: RawFd,
) -> Result<RawFd> {
    if let Some(fd) = task.render.get(&minor) {
        return Ok(fd.as_raw_fd());
    }
    let fd = fds::place_fd(open_render(ctx, minor)?, fd_min)
        .map_err(|e| Error::io(&e, format!("cannot move the fd of renderD{minor}")))?;
    let raw = fd.as_raw_fd();
    task.fd_limit = task.fd_limit.max(fd_min);
    task.render.insert(minor, fd);
    Ok(raw)
}

/// Opens render node `minor`.
fn open_render(ctx: &RestoreCtx<'_>, minor: u32) -> Result<OwnedFd> {
    ctx.dev
        .open_render_node(minor)
        .map_err(|e| Error::io(&e, format!("cannot open render node renderD{minor}")))
}
