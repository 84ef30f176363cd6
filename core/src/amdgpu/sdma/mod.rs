//! BO contents through the GPU's system DMA engine (SDMA), as CRIU's C plugin copies them,
//! but from several copy threads at once.
//!
//! Every copy is GPU work: the BO (imported from the dma-buf KFD exported for it) and the
//! copy thread's staging memory (registered as a userptr BO) are mapped into the GPU
//! virtual memory of a render-node file the engine opened itself, and an indirect buffer
//! (IB) of `COPY_LINEAR` packets is submitted to the DMA ring. This reaches every VRAM BO,
//! including those without CPU access (most `hipMalloc` memory), which a CPU mapping cannot.
//!
//! # Packets
//!
//! `COPY_LINEAR`, 7 dwords:
//!
//! | dword | contents |
//! |---|---|
//! | 0 | header: op `SDMA_OP_COPY` (1) in bits 7:0, sub-op `COPY_LINEAR` (0) in bits 15:8 |
//! | 1 | byte count: **count − 1** on SDMA 4 and later (family ≥ `AMDGPU_FAMILY_AI`, Vega), the count itself on SDMA 2/3 (CIK, VI) |
//! | 2 | parameters (endian swap): 0 |
//! | 3, 4 | source address, low and high 32 bits |
//! | 5, 6 | destination address, low and high 32 bits |
//!
//! A `NOP` is one zero dword; the IB is padded with them to a multiple of 8 dwords. The C
//! plugin writes the count itself on every family: the kernel's own copies
//! (`sdma_v4_0_emit_copy_buffer` and later) write count − 1, so on Vega and later each of
//! its packets copies one byte more than asked. A packet carries at most 2 MiB (2 MiB − 1
//! before Vega), within every kernel's own limit. SI's DMA engine has other packets and KFD
//! does not support it: it is refused.
//!
//! A job whose addresses fault still completes on amdgpu (reads hit a dummy page, writes are
//! dropped), so after each fence, and once more after the last copy
//! ([`SdmaEngines::finish`]: a fault's interrupt may be handled after the fence), the engine
//! asks the VM for page faults (`AMDGPU_INFO_GPUVM_FAULT`, Linux 6.10): its VM holds only its
//! own mappings, so any fault is a failed copy. Older kernels cannot tell; a line in the log
//! says so.
//!
//! # Engine, lanes and buffers
//!
//! [`SdmaEngines`] holds one render-node file per GPU, opened for the copy only: its VM is
//! the engine's own, so the VAs it hands out cannot collide with the process's (the C
//! plugin maps staging into the process's own VM through libdrm's allocator, which knows
//! nothing of KFD's, so they may collide). [`SdmaEngines::import`] maps a BO into that VM.
//! Each copy thread gets a [`Lane`] over its staging buffer: per GPU it touches, a
//! submission context, a command buffer and the staging buffer registered as a userptr BO,
//! all created once and
//! reused for every piece (the C plugin creates a context per chunk and registers staging
//! per BO). A piece is one submission and one fence wait; the threads' submissions go to
//! ring 0 of the DMA IP through contexts of their own, which the kernel's scheduler spreads
//! over the GPU's SDMA engines. A submission that does not complete within
//! [`FENCE_TIMEOUT`] fails the copy instead of hanging CRIU; as after any submission whose
//! completion was not seen, the lane's staging memory is then never unmapped (see
//! [`StagingRegion::keep_after_use`]).

mod lane;
mod packets;

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;
use std::time::Duration;

use super::copy::StagingRegion;
use super::device::{Bytes, KfdDevice, VmFaultState};
use super::error::{Error, Result, device_error};
use super::image::BoEntry;
pub use lane::Lane;
use lane::release;
pub use packets::{
    HEADER_COPY_LINEAR, IB_ALIGN_DWORDS, NOP, PACKET_DWORDS, PacketFormat, pad, push_copy,
};

/// Longest wait for one submission.
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(60);

/// The CPU page size: userptr ranges and GPU VA mappings must be aligned to it.
fn page() -> u64 {
    super::copy::page_size() as u64
}
/// Alignment of the VAs the engine hands out for large mappings (the GPU's large pages).
const VA_ALIGN_LARGE: u64 = 2 << 20;

fn round_up(v: u64, to: u64) -> Option<u64> {
    v.checked_next_multiple_of(to)
}

/// A bump allocator over a GPU VM range: VAs are never reused while the engine lives.
#[derive(Debug)]
struct VaSpace {
    next: u64,
    end: u64,
}

impl VaSpace {
    fn alloc(&mut self, size: u64) -> Option<u64> {
        let align = if size >= VA_ALIGN_LARGE {
            VA_ALIGN_LARGE
        } else {
            page()
        };
        let va = round_up(self.next, align)?;
        let end = va.checked_add(size)?;
        if end > self.end {
            return None;
        }
        self.next = end;
        Some(va)
    }
}

/// The engine of one GPU: a render-node file of the engine's own and its VM.
struct GpuEngine {
    minor: u32,
    render: OwnedFd,
    format: PacketFormat,
    va: Mutex<VaSpace>,
    /// Whether the kernel reports the VM's page faults (Linux 6.10 and later).
    faults_reported: bool,
}

impl GpuEngine {
    /// Fails when the engine's VM recorded a GPU page fault: one of its copies went wrong.
    fn check_faults(&self, dev: &dyn KfdDevice) -> Result<()> {
        if !self.faults_reported {
            return Ok(());
        }
        match dev.vm_fault(self.render.as_fd()) {
            Ok(VmFaultState::Faulted { addr, status }) => Err(device_error(
                libc::EFAULT,
                format!(
                    "GPU page fault at {addr:#x} (status {status:#x}) during an SDMA copy on renderD{}: the copied data cannot be trusted",
                    self.minor
                ),
            )),
            Ok(_) => Ok(()),
            Err(e) => Err(Error::io(
                &e,
                format!("cannot query GPU page faults of renderD{}", self.minor),
            )),
        }
    }

    fn alloc_va(&self, size: u64) -> Result<u64> {
        let mut va = self.va.lock().unwrap_or_else(|e| e.into_inner());
        va.alloc(size).ok_or_else(|| {
            device_error(
                libc::ENOSPC,
                format!(
                    "no GPU address space left for {} in the copy engine's VM of renderD{}",
                    Bytes(size),
                    self.minor
                ),
            )
        })
    }
}

/// A BO mapped into an engine's VM.
#[derive(Debug)]
struct MappedBo {
    gpu: usize,
    handle: u32,
    va: u64,
    size: u64,
    mapped: u64,
}

/// A BO that [`SdmaEngines::import`] made reachable by the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferId(usize);

/// The SDMA engines of the GPUs one copy uses, and the BOs it reaches.
pub struct SdmaEngines<'d> {
    dev: &'d dyn KfdDevice,
    gpus: Vec<GpuEngine>,
    by_minor: HashMap<u32, usize>,
    bos: Vec<MappedBo>,
    timeout: Duration,
}

impl<'d> SdmaEngines<'d> {
    /// The render file of the GPU with render minor `minor`, once an import opened it.
    pub fn render_fd(&self, minor: u32) -> Option<BorrowedFd<'_>> {
        let i = *self.by_minor.get(&minor)?;
        Some(self.gpus[i].render.as_fd())
    }

    /// The `COPY_LINEAR` encoding used for the GPU with render minor `minor`, once an import
    /// opened it; changing it makes the engine write what another family reads (the
    /// simulator's tests write the C plugin's count on a Vega-class GPU).
    pub fn packet_format_mut(&mut self, minor: u32) -> Option<&mut PacketFormat> {
        let i = *self.by_minor.get(&minor)?;
        Some(&mut self.gpus[i].format)
    }

    /// No GPU yet; render nodes are opened by the first [`SdmaEngines::import`] of each.
    pub fn new(dev: &'d dyn KfdDevice) -> SdmaEngines<'d> {
        SdmaEngines {
            dev,
            gpus: Vec::new(),
            by_minor: HashMap::new(),
            bos: Vec::new(),
            timeout: FENCE_TIMEOUT,
        }
    }

    fn gpu(&mut self, minor: u32) -> Result<usize> {
        if let Some(&i) = self.by_minor.get(&minor) {
            return Ok(i);
        }
        let render = self
            .dev
            .open_render_node(minor)
            .map_err(|e| Error::io(&e, format!("cannot open render node renderD{minor}")))?;
        let info = self
            .dev
            .render_info(render.as_fd())
            .map_err(|e| Error::io(&e, format!("cannot query the GPU of renderD{minor}")))?;
        let format = PacketFormat::for_family(info.family)
            .map_err(|e| e.context(format!("renderD{minor}")))?;
        let start = round_up(info.va_start.max(page()), VA_ALIGN_LARGE).unwrap_or(u64::MAX);
        let faults_reported = match self.dev.vm_fault(render.as_fd()) {
            Ok(VmFaultState::Clean) => true,
            Ok(VmFaultState::Unknown) => {
                log::info!(
                    "amdgpu: renderD{minor}: the kernel does not report GPU page faults (before Linux 6.10); SDMA copies are checked by their fences only"
                );
                false
            }
            Ok(VmFaultState::Faulted { addr, .. }) => {
                return Err(device_error(
                    libc::EFAULT,
                    format!(
                        "renderD{minor}: a new VM already reports a GPU page fault at {addr:#x}"
                    ),
                ));
            }
            Err(e) => {
                return Err(Error::io(
                    &e,
                    format!("cannot query GPU page faults of renderD{minor}"),
                ));
            }
        };
        self.gpus.push(GpuEngine {
            minor,
            render,
            format,
            va: Mutex::new(VaSpace {
                next: start,
                end: info.va_end,
            }),
            faults_reported,
        });
        self.by_minor.insert(minor, self.gpus.len() - 1);
        Ok(self.gpus.len() - 1)
    }

    /// Makes the BO behind `dmabuf` (`size` bytes) reachable through the SDMA engine of
    /// render node `minor` (the BO's own GPU). The dma-buf fd may be closed afterwards.
    pub fn import(&mut self, minor: u32, dmabuf: BorrowedFd<'_>, size: u64) -> Result<BufferId> {
        let gpu = self.gpu(minor)?;
        let g = &self.gpus[gpu];
        let mapped = round_up(size, page()).filter(|&m| m > 0).ok_or_else(|| {
            device_error(libc::EINVAL, format!("BO size {size} cannot be mapped"))
        })?;
        let handle = self.dev.gem_import(g.render.as_fd(), dmabuf).map_err(|e| {
            Error::io(
                &e,
                format!("cannot import the BO's dma-buf into renderD{minor}"),
            )
        })?;
        // The same BO imported again has the same handle: reuse its mapping (and never close
        // a handle an earlier import still uses).
        if let Some(i) = self
            .bos
            .iter()
            .position(|b| b.gpu == gpu && b.handle == handle)
        {
            if self.bos[i].size != size {
                return Err(device_error(
                    libc::EINVAL,
                    format!(
                        "a dma-buf of {} resolves to a BO already imported with {}",
                        Bytes(size),
                        Bytes(self.bos[i].size)
                    ),
                ));
            }
            return Ok(BufferId(i));
        }
        let mapped_at = g.alloc_va(mapped).and_then(|va| {
            self.dev
                .gem_va(g.render.as_fd(), handle, va, mapped, true)
                .map(|()| va)
                .map_err(|e| {
                    Error::io(
                        &e,
                        format!("cannot map the BO at GPU address {va:#x} of renderD{minor}"),
                    )
                })
        });
        let va = match mapped_at {
            Ok(va) => va,
            Err(e) => {
                let _ = self.dev.gem_close(g.render.as_fd(), handle);
                return Err(e);
            }
        };
        self.bos.push(MappedBo {
            gpu,
            handle,
            va,
            size,
            mapped,
        });
        Ok(BufferId(self.bos.len() - 1))
    }

    /// Imports every BO of `bos` that has contents (VRAM/GTT), the BO behind `dmabufs[i]`
    /// for entry `i`, through the engine of its GPU's render node (`minor_of`: image gpu id
    /// → render minor); `what` names the BOs in errors ("", "restored "). Returns one slot per
    /// entry and the largest size imported.
    pub fn import_contents(
        &mut self,
        bos: &[BoEntry],
        dmabufs: &[Option<OwnedFd>],
        minor_of: &HashMap<u32, u32>,
        what: &str,
    ) -> Result<(Vec<Option<BufferId>>, u64)> {
        let mut buffers = Vec::with_capacity(bos.len());
        let mut largest = 0;
        for (i, b) in bos.iter().enumerate() {
            if !b.has_contents() {
                buffers.push(None);
                continue;
            }
            largest = largest.max(b.size);
            let minor = *minor_of.get(&b.gpu_id).ok_or_else(|| {
                device_error(
                    libc::EINVAL,
                    format!("BO {i} is on unmapped GPU {:#x}", b.gpu_id),
                )
            })?;
            let dmabuf = dmabufs.get(i).and_then(|d| d.as_ref()).ok_or_else(|| {
                device_error(libc::EINVAL, format!("KFD gave no dma-buf for BO {i}"))
            })?;
            let buf = self
                .import(minor, dmabuf.as_fd(), b.size)
                .map_err(|e| e.context(format!("cannot access {what}{}", b.describe(i))))?;
            buffers.push(Some(buf));
        }
        Ok((buffers, largest))
    }

    /// Checks every GPU's VM once more for page faults, after the last copy: a fault's
    /// interrupt may be handled after the fence of the copy that caused it has signalled.
    pub fn finish(&self) -> Result<()> {
        self.gpus.iter().try_for_each(|g| g.check_faults(self.dev))
    }

    /// A copy thread's lane over its staging memory `staging`.
    ///
    /// # Safety
    ///
    /// `staging` must describe anonymous memory of this process that stays mapped while the
    /// lane lives, and for good once the lane calls [`StagingRegion::keep_after_use`]: the
    /// lane registers it with the GPU, which writes it behind Rust's back. The regions
    /// `copy::run` hands to its lane factory are such memory.
    pub unsafe fn lane(&self, staging: StagingRegion) -> Lane<'_, 'd> {
        Lane {
            engines: self,
            staging,
            gpus: (0..self.gpus.len()).map(|_| None).collect(),
            ib: Vec::new(),
        }
    }
}

impl Drop for SdmaEngines<'_> {
    fn drop(&mut self) {
        // Closing the render files would release all of it too; this leaves nothing behind
        // even while a file is shared.
        for bo in self.bos.drain(..).rev() {
            let g = &self.gpus[bo.gpu];
            release(
                self.dev,
                g.render.as_fd(),
                None,
                &[(bo.handle, Some((bo.va, bo.mapped)))],
            );
        }
    }
}

#[cfg(test)]
mod tests;
