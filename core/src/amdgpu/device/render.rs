//! The amdgpu render-node side of the kernel interface: what a GPU reports
//! (`AMDGPU_INFO`), GEM buffers, GPU VA mappings, submission contexts and DMA submissions,
//! from which the SDMA copy engine is built.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use memmap2::{MmapMut, MmapOptions};

/// What the copy engine needs to know about a GPU, from `AMDGPU_INFO_DEV_INFO` on a render
/// node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenderInfo {
    /// `AMDGPU_FAMILY_*`: selects the SDMA packet encoding.
    pub family: u32,
    /// First GPU virtual address a render-node file may map BOs at.
    pub va_start: u64,
    /// End (exclusive) of that range.
    pub va_end: u64,
}

/// What a render-node file's VM says about GPU page faults (`AMDGPU_INFO_GPUVM_FAULT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmFaultState {
    /// The kernel cannot tell (before Linux 6.10).
    Unknown,
    /// No fault since the file was opened.
    Clean,
    /// The last fault.
    Faulted {
        /// Faulting GPU address (page granular).
        addr: u64,
        /// The VM hub's fault status.
        status: u32,
    },
}

/// The GEM BOs a render-node file holds (`DRM_IOCTL_AMDGPU_GEM_LIST_HANDLES`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemCensus {
    /// BOs with a handle in the file.
    pub bos: usize,
    /// Of those, BOs the kernel flags as imports: dma-bufs of other devices (a dma-buf of
    /// the same GPU imported into the file is the same BO and is not flagged).
    pub imported: usize,
}

/// Memory of this process mapped from a file (a GEM BO through its render node, or a
/// simulator's memfd); unmapped when dropped.
pub struct HostMapping {
    map: MmapMut,
}

impl HostMapping {
    /// Maps `len` bytes of `fd` at `offset`, shared and read-write.
    ///
    /// # Safety
    ///
    /// `fd` must be a file whose range may be mapped shared (for a render node: `offset` is
    /// the fake offset of a BO of at least `len` bytes); the mapping must not alias memory
    /// that Rust code accesses otherwise.
    pub unsafe fn map(fd: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<HostMapping> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a new shared read-write mapping chosen by the kernel; the caller vouches for
        // fd and range. The length is given, so the file (a device node) is not asked its size.
        let map = unsafe {
            MmapOptions::new()
                .offset(offset)
                .len(len)
                .map_mut(fd.as_raw_fd())?
        };
        Ok(HostMapping { map })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping is empty (never: mappings have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Writes `dwords` little-endian from the start of the mapping.
    pub fn write_dwords(&mut self, dwords: &[u32]) -> io::Result<()> {
        if dwords.len() * 4 > self.map.len() {
            return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
        }
        let base = self.map.as_mut_ptr();
        for (i, d) in dwords.iter().enumerate() {
            // SAFETY: `i * 4 + 4 <= len` (checked above), inside the live mapping, which
            // `&mut self` borrows exclusively. Volatile: the device reads it, not Rust.
            unsafe {
                base.add(i * 4)
                    .cast::<[u8; 4]>()
                    .write_volatile(d.to_le_bytes())
            };
        }
        Ok(())
    }
}

impl fmt::Debug for HostMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "HostMapping({:p}, {})",
            self.map.as_ptr(),
            self.map.len()
        )
    }
}

/// The amdgpu render-node operations the SDMA copy engine ([`crate::amdgpu::sdma`]) is built from:
/// GEM objects, GPU virtual memory and command submission on the DMA ring, each on an
/// explicit render-node file (never libdrm's deduplicated one). One method per ioctl, so
/// that the engine's logic is the same on the kernel and on the simulator.
pub trait AmdgpuRender {
    /// `AMDGPU_INFO` / `AMDGPU_INFO_DEV_INFO`: family and usable VA range.
    fn render_info(&self, render: BorrowedFd<'_>) -> io::Result<RenderInfo>;

    /// `DRM_IOCTL_AMDGPU_GEM_LIST_HANDLES` (Linux 6.18) on a process's render-node file:
    /// the GEM BOs allocated or imported through it; `None` when the kernel lacks the ioctl
    /// (older kernels cannot say).
    fn gem_census(&self, render: BorrowedFd<'_>) -> io::Result<Option<GemCensus>>;

    /// `DRM_IOCTL_PRIME_FD_TO_HANDLE`: the GEM handle of the BO behind `dmabuf` in file
    /// `render` (the same handle every time for the same BO and file).
    fn gem_import(&self, render: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32>;

    /// `DRM_IOCTL_AMDGPU_GEM_USERPTR`: a GEM BO over `size` bytes of this process's memory at
    /// `addr` (both page aligned).
    ///
    /// # Safety
    ///
    /// The memory must be anonymous memory of this process that stays allocated until the
    /// handle is closed; the GPU reads and writes it behind Rust's back while work that
    /// uses the BO runs.
    unsafe fn gem_userptr(
        &self,
        render: BorrowedFd<'_>,
        addr: *mut u8,
        size: u64,
    ) -> io::Result<u32>;

    /// `DRM_IOCTL_AMDGPU_GEM_CREATE` of a GTT BO of `size` bytes, mapped for the CPU
    /// (`GEM_MMAP` and `mmap`): command buffers.
    fn gem_create_mapped(
        &self,
        render: BorrowedFd<'_>,
        size: u64,
    ) -> io::Result<(u32, HostMapping)>;

    /// `DRM_IOCTL_GEM_CLOSE`.
    fn gem_close(&self, render: BorrowedFd<'_>, handle: u32) -> io::Result<()>;

    /// `DRM_IOCTL_AMDGPU_GEM_VA`: maps (`map`) or unmaps `size` bytes of BO `handle` at GPU
    /// address `va` of the file's VM, readable, writable and executable.
    fn gem_va(
        &self,
        render: BorrowedFd<'_>,
        handle: u32,
        va: u64,
        size: u64,
        map: bool,
    ) -> io::Result<()>;

    /// `DRM_IOCTL_AMDGPU_CTX` ALLOC: a submission context.
    fn ctx_create(&self, render: BorrowedFd<'_>) -> io::Result<u32>;

    /// `DRM_IOCTL_AMDGPU_CTX` FREE.
    fn ctx_free(&self, render: BorrowedFd<'_>, ctx: u32) -> io::Result<()>;

    /// `DRM_IOCTL_AMDGPU_CS`: runs the IB of `ib_bytes` at `ib_va` on ring 0 of the DMA IP
    /// (SDMA), with the BOs `bos` resident; returns the submission's sequence number.
    fn submit_dma(
        &self,
        render: BorrowedFd<'_>,
        ctx: u32,
        bos: &[u32],
        ib_va: u64,
        ib_bytes: u32,
    ) -> io::Result<u64>;

    /// `AMDGPU_INFO_GPUVM_FAULT`: the last GPU page fault in the file's VM. A DMA job whose
    /// addresses fault still completes (reads return a dummy page, writes are dropped), so
    /// its fence says nothing about it.
    fn vm_fault(&self, render: BorrowedFd<'_>) -> io::Result<VmFaultState>;

    /// `DRM_IOCTL_AMDGPU_WAIT_CS`: waits up to `timeout` for submission `seq`; `Ok(true)`
    /// when it completed, `Ok(false)` when still running, an error when it failed.
    fn wait_dma(
        &self,
        render: BorrowedFd<'_>,
        ctx: u32,
        seq: u64,
        timeout: std::time::Duration,
    ) -> io::Result<bool>;
}
