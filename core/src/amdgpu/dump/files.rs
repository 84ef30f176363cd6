//! The files of a dump run ([`super::DumpRun`]): `/dev/kfd`, render-node and dma-buf files of
//! a process, and their BO contents.
//!
//! Per KFD file (`DUMP_EXT_FILE`):
//!
//! 1. `GET_VERSION` on a `/dev/kfd` of the dumper's own (the drained fd accepts only CRIU
//!    operations); 1.8 or later is required.
//! 2. `PROCESS_INFO` on the drained fd: the process's queues are now evicted. From here on the
//!    file is on the backend's "paused" list, so every later failure restarts the queues
//!    (the C plugin leaves them evicted when a dump fails, so the process goes on without
//!    its GPU work); the dump's guardian ([`crate::amdgpu::guardian`]), told of the process just
//!    before, restarts them should CRIU end first.
//! 3. `CHECKPOINT` into arrays sized from PROCESS_INFO (bounded by [`CriuLimits`]).
//! 4. The image: one device entry per topology node that the process uses, recorded under
//!    the process's *user* gpu ids (BOs are matched and pages files named by the user id,
//!    render nodes opened by the actual id, so a process restored onto other GPUs can be
//!    dumped again; the C plugin mixed the two ids and failed there); GPUs that sysfs shows
//!    but KFD did not report for the process, as in a container limited to some GPUs, are
//!    left out (the C plugin failed the dump).
//! 5. BO contents of VRAM/GTT BOs, read by each GPU's SDMA engine ([`crate::amdgpu::sdma`]) through
//!    the copy pipeline ([`crate::amdgpu::contents`], [`crate::amdgpu::copy`]) into one pages file per GPU, every
//!    thread's error
//!    propagated (the C plugin's copy loses submission, fence and file errors).
//! 6. `amdgpu-kfd-ID.img`, its write error reported (the C plugin drops it).
//!
//! Each VRAM/GTT BO gets a cross-reference key (the image's `handle`): the GEM handle its
//! dma-buf gets when imported into a render node the dumper opened for that purpose, mapped
//! to a number unique in the dump. A dma-buf file the process holds is matched by importing
//! it the same way; it is written as `amdgpu-dmabuf_ID.img` with the key, or kept (a copy of
//! the fd, not CRIU's fd number, which CRIU closes, and may reuse, once the hook returns)
//! until its BO's process is dumped. Nothing is imported into the target's own files (which
//! would give the checkpointed process new GEM handles).
//!
//! The queues are restarted with UNPAUSE once every file of every process is dumped (see
//! [`crate::amdgpu::backend`]).

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use crate::amdgpu::contents;
use crate::amdgpu::copy;
use crate::amdgpu::device::{self, Bytes, CriuBuffers, CriuLimits, KfdDevice};
use crate::amdgpu::error::{Error, Result, device_error};
use crate::amdgpu::image::{
    BoEntry, DmabufImage, KfdCheckpoint, RenderNodeDrm, RenderNodeImage, dmabuf_file_name,
    kfd_file_name, render_node_file_name,
};
use crate::amdgpu::settings::AmdgpuSettings;
use crate::amdgpu::store::ImageStore;
use crate::amdgpu::topology::Topology;

/// A KFD file whose process's queues this dump evicted.
pub struct PausedKfd {
    /// CRIU file id.
    pub id: u32,
    /// The process's pid in its own namespace.
    pub pid: u32,
    /// A copy of the drained fd, to UNPAUSE through.
    pub fd: OwnedFd,
    /// Whether the queues are still evicted.
    pub paused: bool,
    /// The process's pid in CRIU's namespace, when the guardian watches it.
    pub guarded: Option<i32>,
}

/// What the dumper keeps between files.
#[derive(Default)]
pub struct DumpState {
    /// The machine's topology, read on first use.
    pub topology: Option<Topology>,
    /// KFD files whose queues were evicted, in dump order.
    pub paused: Vec<PausedKfd>,
    /// User gpu id of each actual gpu id, from the KFD files dumped so far.
    pub user_ids: HashMap<u32, u32>,
    /// Render-node files dumped.
    pub render_files: usize,
    /// Render nodes opened only to tell BOs apart (GEM handles of imported dma-bufs), by
    /// minor; open until the end of the dump so that handles stay unique.
    pub key_render: HashMap<u32, OwnedFd>,
    /// Cross-reference key of each (render minor, GEM handle in `key_render`) seen.
    pub keys: HashMap<(u32, u32), u32>,
    /// Last key given out.
    pub last_key: u32,
    /// dma-buf files whose BO was not dumped yet: (file id, copy of the fd).
    pub pending_dmabufs: Vec<(u32, OwnedFd)>,
    /// dma-buf files dumped.
    pub dmabuf_files: usize,
}

/// What the dump needs from the backend.
pub struct DumpCtx<'a> {
    /// The kernel.
    pub dev: &'a dyn KfdDevice,
    /// Settings.
    pub settings: &'a AmdgpuSettings,
    /// Where images go.
    pub images: &'a ImageStore,
    /// Bounds on what PROCESS_INFO may ask for.
    pub limits: CriuLimits,
}

impl DumpCtx<'_> {
    fn topology<'s>(&self, state: &'s mut DumpState) -> Result<&'s Topology> {
        let topology = match state.topology.take() {
            Some(t) => t,
            None => {
                let root = &self.settings.topology_root;
                Topology::from_sysfs(root).map_err(|e| {
                    device_error(
                        libc::EIO,
                        format!("cannot read the KFD topology at {}: {e}", root.display()),
                    )
                })?
            }
        };
        Ok(state.topology.insert(topology))
    }
}

fn render_fd<'s>(
    ctx: &DumpCtx<'_>,
    cache: &'s mut HashMap<u32, OwnedFd>,
    minor: u32,
) -> Result<BorrowedFd<'s>> {
    let fd: &OwnedFd = match cache.entry(minor) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(
            ctx.dev
                .open_render_node(minor)
                .map_err(|e| Error::io(&e, format!("cannot open render node renderD{minor}")))?,
        ),
    };
    Ok(fd.as_fd())
}

/// Evicts the queues of the process behind the drained KFD fd `fd` (PROCESS_INFO) and
/// records it in `state.paused` (`guarded`: its pid, when the guardian watches it). Returns
/// the process information.
pub fn pause(
    ctx: &DumpCtx<'_>,
    state: &mut DumpState,
    fd: BorrowedFd<'_>,
    id: u32,
    guarded: Option<i32>,
) -> Result<device::ProcessInfo> {
    // Copy the fd first: once the queues are evicted, nothing may stop us restarting them.
    let keep = fd
        .try_clone_to_owned()
        .map_err(|e| Error::io(&e, "cannot duplicate the KFD fd"))?;
    let info =
        device::process_info(ctx.dev, fd).map_err(|e| Error::io(&e, "KFD PROCESS_INFO failed"))?;
    state.paused.push(PausedKfd {
        id,
        pid: info.pid,
        fd: keep,
        paused: true,
        guarded,
    });
    Ok(info)
}

/// What [`checkpoint`] did.
pub struct KfdDumpStats {
    /// GPUs.
    pub gpus: usize,
    /// BOs.
    pub bos: usize,
    /// Copy statistics.
    pub copy: copy::CopyStats,
}

/// CHECKPOINT of a paused process and everything written for it. On error the caller must
/// UNPAUSE.
pub fn checkpoint(
    ctx: &DumpCtx<'_>,
    state: &mut DumpState,
    fd: BorrowedFd<'_>,
    id: u32,
    info: &device::ProcessInfo,
) -> Result<KfdDumpStats> {
    let mut bufs = CriuBuffers::for_checkpoint(info, &ctx.limits)
        .map_err(|e| Error::io(&e, "KFD PROCESS_INFO"))?;
    // The dma-bufs are closed when `dmabufs` drops, on every path (also when this fails).
    let dmabufs = device::checkpoint(ctx.dev, fd, &mut bufs)
        .map_err(|e| Error::io(&e, "KFD CHECKPOINT failed"))?;

    // actual gpu id -> user gpu id, from the device buckets.
    let mut user_of = HashMap::new();
    for d in &bufs.devices {
        if user_of.insert(d.actual_gpu_id, d.user_gpu_id).is_some() {
            return Err(device_error(
                libc::EINVAL,
                format!("KFD reported GPU {:#x} twice", d.actual_gpu_id),
            ));
        }
    }
    let topo = ctx.topology(state)?.clone();
    for d in &bufs.devices {
        if topo.gpu_by_id(d.actual_gpu_id).is_none() {
            return Err(device_error(
                libc::ENODEV,
                format!(
                    "KFD reports GPU {:#x} for the process but the topology at {} does not list it",
                    d.actual_gpu_id,
                    ctx.settings.topology_root.display()
                ),
            ));
        }
    }
    let devices = topo.to_device_entries(|actual| user_of.get(&actual).copied());
    let num_of_gpus = devices.iter().filter(|d| d.gpu_id != 0).count() as u32;
    let num_of_cpus = devices.len() as u32 - num_of_gpus;

    let mut actual_of = HashMap::new();
    for (a, u) in &user_of {
        actual_of.insert(*u, *a);
    }
    let bos: Vec<BoEntry> = bufs
        .bos
        .iter()
        .map(|b| BoEntry {
            addr: b.addr,
            size: b.size,
            offset: b.offset,
            alloc_flags: b.alloc_flags,
            gpu_id: b.gpu_id,
            handle: None,
        })
        .collect();
    for (i, b) in bos.iter().enumerate() {
        if !actual_of.contains_key(&b.gpu_id) {
            return Err(device_error(
                libc::EINVAL,
                format!(
                    "KFD put BO {i} on GPU {:#x}, which it did not report",
                    b.gpu_id
                ),
            ));
        }
        if b.has_contents() && dmabufs[i].is_none() {
            return Err(device_error(
                libc::EINVAL,
                format!(
                    "KFD gave no dma-buf for {} BO {i} at {:#x}",
                    device::bo_kind(b.alloc_flags),
                    b.addr
                ),
            ));
        }
    }
    for (&a, &u) in &user_of {
        state.user_ids.insert(a, u);
    }
    // The render node of each GPU: for the cross-reference keys, and for the copies, which
    // go through the SDMA engine of each BO's actual GPU (in render-node files of the
    // engine's own).
    let mut minor_of = HashMap::new();
    for (&user, &actual) in &actual_of {
        let minor = topo
            .gpu_by_id(actual)
            .map(|g| g.drm_render_minor)
            .ok_or_else(|| {
                device_error(libc::ENODEV, format!("GPU {actual:#x} has no render node"))
            })?;
        minor_of.insert(user, minor);
    }
    // Cross-reference keys, so that dma-buf fds of these BOs can be matched to them.
    let mut bos = bos;
    for (i, b) in bos.iter_mut().enumerate() {
        let Some(fd) = &dmabufs[i] else {
            continue;
        };
        let minor = minor_of[&b.gpu_id];
        match bo_key(ctx, state, minor, fd.as_fd(), true) {
            Ok(k) => b.handle = k,
            Err(e) => log::warn!("amdgpu: BO {i} at {:#x}: no dma-buf key: {e}", b.addr),
        }
    }
    let (shared_mem_size, shared_mem_magic) = ctx
        .dev
        .hsakmt_shared_mem()
        .map_err(|e| Error::io(&e, "cannot read /dev/shm/hsakmt_shared_mem"))?
        .unwrap_or((0, 0));
    let image = KfdCheckpoint {
        pid: info.pid,
        num_of_gpus,
        num_of_cpus,
        devices,
        bos,
        num_of_objects: bufs.num_objects,
        shared_mem_size,
        shared_mem_magic,
        priv_data: std::mem::take(&mut bufs.priv_data),
    };
    image.validate().map_err(|e| {
        device_error(
            libc::EINVAL,
            format!("KFD state does not fit the image format: {e}"),
        )
    })?;

    let copy = contents::Contents {
        dev: ctx.dev,
        settings: ctx.settings,
        images: ctx.images,
        id,
        image: &image,
        minor_of: &minor_of,
        dmabufs: &dmabufs,
    }
    .save()?;
    drop(dmabufs);
    ctx.images.write_message(&kfd_file_name(id), &image)?;
    Ok(KfdDumpStats {
        gpus: num_of_gpus as usize,
        bos: image.bos.len(),
        copy,
    })
}

/// The cross-reference key of the BO behind `dmabuf` on the GPU of render node `minor`: a
/// new key for a BO not seen before when `assign`, else `None` for an unknown BO.
fn bo_key(
    ctx: &DumpCtx<'_>,
    state: &mut DumpState,
    minor: u32,
    dmabuf: BorrowedFd<'_>,
    assign: bool,
) -> Result<Option<u32>> {
    let render = render_fd(ctx, &mut state.key_render, minor)?;
    let handle = ctx
        .dev
        .buffer_key(render, dmabuf)
        .map_err(|e| Error::io(&e, format!("cannot import a dma-buf into renderD{minor}")))?;
    if let Some(k) = state.keys.get(&(minor, handle)) {
        return Ok(Some(*k));
    }
    if !assign {
        return Ok(None);
    }
    state.last_key += 1;
    state.keys.insert((minor, handle), state.last_key);
    Ok(Some(state.last_key))
}

/// Dumps dma-buf file `id` if its BO belongs to a KFD process dumped so far; `Ok(false)`
/// when it does not (yet).
pub fn dump_dmabuf(
    ctx: &DumpCtx<'_>,
    state: &mut DumpState,
    id: u32,
    fd: BorrowedFd<'_>,
) -> Result<bool> {
    let minors: Vec<u32> = ctx
        .topology(state)?
        .gpus()
        .map(|g| g.drm_render_minor)
        .collect();
    for minor in minors {
        // A BO of another GPU or device is not found in this GPU's file; import errors
        // (another driver's dma-buf) mean the same.
        let Ok(Some(key)) = bo_key(ctx, state, minor, fd, false) else {
            continue;
        };
        let image = DmabufImage { gem_handle: key };
        ctx.images.write_message(&dmabuf_file_name(id), &image)?;
        state.dmabuf_files += 1;
        log::info!("amdgpu: file {id}: dma-buf of the BO with key {key} (renderD{minor})");
        return Ok(true);
    }
    Ok(false)
}

/// Dumps the deferred dma-buf files whose BO is known now.
pub fn retry_pending_dmabufs(ctx: &DumpCtx<'_>, state: &mut DumpState) -> Result<()> {
    let pending = std::mem::take(&mut state.pending_dmabufs);
    for (id, fd) in pending {
        if !dump_dmabuf(ctx, state, id, fd.as_fd())? {
            state.pending_dmabufs.push((id, fd));
        }
    }
    Ok(())
}

/// Restarts the queues of a paused file. Returns whether they run again.
pub fn unpause(dev: &dyn KfdDevice, p: &mut PausedKfd) -> Result<()> {
    if !p.paused {
        return Ok(());
    }
    device::unpause(dev, p.fd.as_fd()).map_err(|e| {
        Error::io(
            &e,
            format!(
                "could not restart the GPU queues of pid {} (KFD UNPAUSE)",
                p.pid
            ),
        )
    })?;
    p.paused = false;
    Ok(())
}

/// Dumps render node `minor` opened by the process as file `id` (`fd`, drained from the
/// process). `None` when the node is not a KFD GPU's (another driver's render node is not
/// this backend's).
///
/// GEM BOs allocated or imported through the render node itself (not through KFD) are not
/// dumped by this backend; rather than lose them silently (the process would be restored
/// without them), a file holding any fails the dump. Kernels before 6.18 cannot list them.
pub fn dump_render_node(
    ctx: &DumpCtx<'_>,
    state: &mut DumpState,
    fd: BorrowedFd<'_>,
    id: u32,
    minor: u32,
) -> Result<Option<u32>> {
    let topo = ctx.topology(state)?;
    let Some(gpu) = topo.gpu_by_render_minor(minor) else {
        return Ok(None);
    };
    match ctx.dev.gem_census(fd) {
        Ok(Some(c)) if c.bos > 0 => {
            return Err(device_error(
                libc::EOPNOTSUPP,
                format!(
                    "renderD{minor} holds {} GEM BO(s) the process allocated or imported through the render node rather than KFD ({} of them imports from other devices); dumping those is not supported, and leaving them out would restore the process without them",
                    c.bos, c.imported
                ),
            ));
        }
        Ok(Some(_)) => {}
        Ok(None) => log::debug!(
            "amdgpu: renderD{minor}: the kernel cannot list GEM BOs (before Linux 6.18); assuming none"
        ),
        Err(e) => {
            return Err(Error::io(
                &e,
                format!("cannot list the GEM BOs of renderD{minor}"),
            ));
        }
    }
    let actual = gpu.gpu_id;
    // The process's own id for the GPU when a KFD file told it; otherwise the GPU was never
    // migrated for this process and the ids agree (the C plugin failed here when the
    // process had no KFD file dumped before, e.g. a process using only render nodes).
    let user = state.user_ids.get(&actual).copied().unwrap_or(actual);
    let image = RenderNodeImage {
        gpu_id: user,
        drm: Some(RenderNodeDrm {
            id,
            drm_render_minor: minor,
            bos: Vec::new(),
        }),
    };
    ctx.images
        .write_message(&render_node_file_name(id), &image)?;
    state.render_files += 1;
    Ok(Some(user))
}

/// Logs what a KFD dump did.
pub fn log_stats(id: u32, pid: u32, s: &KfdDumpStats, started: Instant) {
    let c = &s.copy;
    log::info!(
        "amdgpu: file {id} (pid {pid}): {} GPU(s), {} BO(s), {} of contents in {:.3} s ({:.0} MiB/s, {} copy threads, {} staging), total {:.3} s",
        s.gpus,
        s.bos,
        Bytes(c.bytes),
        c.elapsed.as_secs_f64(),
        c.rate() / (1u64 << 20) as f64,
        c.threads,
        Bytes(c.staging_bytes),
        started.elapsed().as_secs_f64()
    );
}
