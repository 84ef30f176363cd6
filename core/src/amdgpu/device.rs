//! The one place where the AMD backend meets the kernel.
//!
//! Everything the dump and restore paths ask of amdkfd and of the amdgpu render nodes goes
//! through [`KfdDevice`]: the KFD CRIU operation (`AMDKFD_IOC_CRIU_OP` with the real
//! [`kfd_ioctl_criu_args`] and bucket arrays of `kfd-sys`), `AMDKFD_IOC_GET_VERSION`, opening
//! `/dev/kfd` and render nodes, telling what a file descriptor is, telling BOs apart by
//! importing their dma-bufs ([`KfdDevice::buffer_key`]), libhsakmt's shared memory file, and
//! the render-node GEM and command-submission operations ([`AmdgpuRender`]) from which the
//! SDMA engine that copies buffer-object (BO) contents is built.
//!
//! Two implementations exist: `kernel::KernelKfd` (the real kernel, `/dev/kfd` and
//! `/dev/dri/renderD*`) and, for tests and benchmarks, the `kfd-sim` crate's `SimKfd`, which
//! follows the kernel's CRIU semantics with BOs held in host memory; a test hands it to
//! [`super::AmdgpuBackend::with_device_factory`]. The backend's dump and restore
//! code is the same for both.
//!
//! The free functions of this module ([`process_info`], [`checkpoint`], [`unpause`],
//! [`restore`], [`resume`]) are the safe layer over [`KfdDevice::criu_op`]: they size the
//! bucket arrays, point the argument at them, and take ownership of the dma-buf fds the
//! kernel installs.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use memmap2::{MmapMut, MmapOptions};

use super::error::{Error, device_error};
use kfd_sys::{
    KFD_CRIU_OP_CHECKPOINT, KFD_CRIU_OP_PROCESS_INFO, KFD_CRIU_OP_RESTORE, KFD_CRIU_OP_RESUME,
    KFD_CRIU_OP_UNPAUSE, KFD_INVALID_FD, kfd_criu_bo_bucket, kfd_criu_device_bucket,
    kfd_ioctl_criu_args,
};

/// Major number of DRM character devices (`DRM_MAJOR`, fixed by Linux).
pub const DRM_MAJOR: u32 = 226;
pub use super::topology::{RENDER_MINOR_FIRST, RENDER_MINOR_LAST};

/// Oldest KFD interface with the CRIU operations the backend needs (1.8: dma-bufs for GTT
/// BOs as well as VRAM).
pub const MIN_KFD_VERSION: (u32, u32) = (1, 8);

/// Mmap offset type of a doorbell page (`KFD_MMAP_TYPE_DOORBELL`, bits 63:62).
pub const KFD_MMAP_TYPE_DOORBELL: u64 = 3 << 62;
/// Mmap offset type of the events page (`KFD_MMAP_TYPE_EVENTS`).
pub const KFD_MMAP_TYPE_EVENTS: u64 = 2 << 62;
/// Mmap offset type of the MMIO remap page (`KFD_MMAP_TYPE_MMIO`).
pub const KFD_MMAP_TYPE_MMIO: u64 = 0;
/// Shift of the gpu id inside a KFD mmap offset (`KFD_MMAP_GPU_ID_SHIFT`).
pub const KFD_MMAP_GPU_ID_SHIFT: u32 = 46;

bitflags::bitflags! {
    /// KFD BO allocation flags (`KFD_IOC_ALLOC_MEM_FLAGS_*`, the `alloc_flags` word of the
    /// kernel and of the image), named where the backend looks at them; the kernel's other bits
    /// are kept as they are.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AllocFlags: u32 {
        /// VRAM.
        const VRAM = kfd_sys::KFD_IOC_ALLOC_MEM_FLAGS_VRAM;
        /// GTT (system memory mapped for the GPU).
        const GTT = kfd_sys::KFD_IOC_ALLOC_MEM_FLAGS_GTT;
        /// User memory registered with the GPU.
        const USERPTR = kfd_sys::KFD_IOC_ALLOC_MEM_FLAGS_USERPTR;
        /// A doorbell page.
        const DOORBELL = kfd_sys::KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL;
        /// The MMIO remap page.
        const MMIO_REMAP = kfd_sys::KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP;
        /// Writable by the GPU.
        const WRITABLE = kfd_sys::KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE;
        /// BOs whose contents the plugin copies (VRAM or GTT).
        const WITH_CONTENTS = Self::VRAM.bits() | Self::GTT.bits();
        /// BOs the process maps for CPU access and whose mmap offset changes at restore.
        const REMAPPED = Self::WITH_CONTENTS.bits() | Self::DOORBELL.bits() | Self::MMIO_REMAP.bits();
        // Every other bit of the kernel's word.
        const _ = !0;
    }
}

impl AllocFlags {
    /// The flags of an `alloc_flags` word, every bit kept.
    pub const fn of(word: u32) -> AllocFlags {
        AllocFlags::from_bits_retain(word)
    }

    /// A short name for the kind of BO these flags make, for messages.
    pub fn kind(self) -> &'static str {
        [
            (AllocFlags::VRAM, "VRAM"),
            (AllocFlags::GTT, "GTT"),
            (AllocFlags::USERPTR, "userptr"),
            (AllocFlags::DOORBELL, "doorbell"),
            (AllocFlags::MMIO_REMAP, "MMIO"),
        ]
        .into_iter()
        .find_map(|(f, name)| self.intersects(f).then_some(name))
        .unwrap_or("other")
    }
}

/// A BO as error messages name it: kind, index, size, address and GPU.
pub fn describe_bo(bo: &super::image::BoEntry, index: usize) -> String {
    format!(
        "{} BO {index} ({} at {:#x}) of GPU {:#x}",
        bo_kind(bo.alloc_flags),
        Bytes(bo.size),
        bo.addr,
        bo.gpu_id
    )
}

/// A short name for a BO's kind, for messages.
pub fn bo_kind(flags: u32) -> &'static str {
    AllocFlags::of(flags).kind()
}

/// What `fstat` and `/proc/self/fd` say about a file descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// `st_mode`.
    pub mode: u32,
    /// `st_rdev`.
    pub rdev: u64,
    /// Whether the fd is a dma-buf (its link reads `/dmabuf:...`).
    pub dmabuf: bool,
}

/// What a file the backend is offered is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// `/dev/kfd`.
    Kfd,
    /// A DRM render node (`/dev/dri/renderD<minor>`).
    RenderNode {
        /// The node's minor, 128..=255.
        minor: u32,
    },
    /// A dma-buf.
    DmaBuf,
    /// Anything else: not the AMD backend's.
    Other,
}

/// Classifies a file from its identity: `/dev/kfd` has the major of `kfd_rdev` and minor 0;
/// render nodes have the DRM major and a minor in 128..=255 (checked against the fixed DRM
/// major, not by `stat`ing `renderD128`, which a container may lack; the C plugin fails the
/// dump then).
pub fn classify(id: &FileIdentity, kfd_rdev: Option<u64>) -> FileKind {
    if id.dmabuf {
        return FileKind::DmaBuf;
    }
    if id.mode & libc::S_IFMT != libc::S_IFCHR {
        return FileKind::Other;
    }
    let (major, minor) = (libc::major(id.rdev), libc::minor(id.rdev));
    if let Some(kfd) = kfd_rdev {
        if major == libc::major(kfd) && minor == 0 {
            return FileKind::Kfd;
        }
    }
    if major == DRM_MAJOR && (RENDER_MINOR_FIRST..=RENDER_MINOR_LAST).contains(&minor) {
        return FileKind::RenderNode { minor };
    }
    FileKind::Other
}

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

/// The amdgpu render-node operations the SDMA copy engine ([`super::sdma`]) is built from:
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

/// The kernel interface the AMD backend uses: amdkfd's CRIU operations and the amdgpu render
/// nodes, as seen from the calling process.
pub trait KfdDevice: AmdgpuRender + Send + Sync {
    /// A one-line description for logs ("amdkfd", "KFD simulator ...").
    fn describe(&self) -> String;

    /// `st_rdev` of `/dev/kfd`; an error when there is no KFD on this machine.
    fn kfd_rdev(&self) -> io::Result<u64>;

    /// What `fd` is (mode, device number, whether it is a dma-buf).
    fn identify(&self, fd: BorrowedFd<'_>) -> io::Result<FileIdentity>;

    /// Opens a new `/dev/kfd` file in the calling process (a KFD process for the caller's
    /// address space is created on first use).
    fn open_kfd(&self) -> io::Result<OwnedFd>;

    /// `AMDKFD_IOC_GET_VERSION` on `kfd`: (major, minor).
    fn get_version(&self, kfd: BorrowedFd<'_>) -> io::Result<(u32, u32)>;

    /// `AMDKFD_IOC_CRIU_OP` on `kfd` with `args` (operation in `args.op`).
    ///
    /// # Safety
    ///
    /// The same contract as [`kfd_sys::criu_op`]: for CHECKPOINT and RESTORE, `args.devices`
    /// must point to `args.num_devices` writable device buckets, `args.bos` to `args.num_bos`
    /// writable BO buckets and `args.priv_data` to `args.priv_data_size` writable bytes, all
    /// valid for the whole call. A successful CHECKPOINT or RESTORE installs dma-buf fds in
    /// the calling process that the caller then owns.
    unsafe fn criu_op(&self, kfd: BorrowedFd<'_>, args: &mut kfd_ioctl_criu_args)
    -> io::Result<()>;

    /// Whether render node `minor` can be opened here (it exists in this mount namespace).
    fn render_node_present(&self, minor: u32) -> bool;

    /// Opens render node `minor` read-write.
    fn open_render_node(&self, minor: u32) -> io::Result<OwnedFd>;

    /// Imports the BO behind `dmabuf` into render-node file `render` and returns its GEM
    /// handle there. The same BO gives the same handle in the same file for as long as the
    /// file is open, so handles identify BOs across dma-buf fds (the dump's cross-reference
    /// key for dma-buf files). A BO of another device gets a handle of its own.
    fn buffer_key(&self, render: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32>;

    /// Size and first four bytes of libhsakmt's shared memory file
    /// (`/dev/shm/hsakmt_shared_mem`), `None` when it does not exist.
    fn hsakmt_shared_mem(&self) -> io::Result<Option<(u64, u32)>>;

    /// Recreates libhsakmt's shared memory file (when missing) with `size` bytes starting with
    /// `magic`, and its semaphore.
    fn restore_hsakmt_shared_mem(&self, size: u64, magic: u32) -> io::Result<()>;

    /// The pid of the calling task as its own pid namespace sees it (`getpid()`): the key of
    /// per-task restore state.
    fn current_task(&self) -> u32;

    /// The process that holds the KFD file `kfd` (a file CRIU took from a process it dumps),
    /// among the processes the caller traces; `None` when none of them does.
    fn kfd_holder(&self, kfd: BorrowedFd<'_>) -> io::Result<Option<KfdHolder>>;

    /// Restarts the queues of `holder` from a process that is neither it nor its tracer (the
    /// dump's guardian, once CRIU has ended): UNPAUSE on the process's own KFD file until
    /// KFD answers that nothing is paused (`EINVAL`), a few times at most, with whatever
    /// amdkfd asks of such a caller. `pidfd`, when the caller holds one, names the process
    /// exactly. Returns how many UNPAUSEs went through (0: the queues were running).
    fn unpause_holder(&self, holder: &KfdHolder, pidfd: Option<BorrowedFd<'_>>) -> io::Result<u32>;
}

/// A process that holds a KFD file, as a dump's guardian needs to find it again: the file
/// CRIU hands the dump is a copy, and the process is not named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KfdHolder {
    /// Pid in the caller's pid namespace.
    pub pid: i32,
    /// Start time (clock ticks since boot): with the pid, it names one process.
    pub start: u64,
    /// The number under which the process holds the file.
    pub fd: i32,
}

/// What PROCESS_INFO reports about a process (its queues are now evicted).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ProcessInfo {
    /// GPUs the process uses.
    pub num_devices: u32,
    /// BOs.
    pub num_bos: u32,
    /// Queues, events and SVM ranges in the private data.
    pub num_objects: u32,
    /// Bytes of private data CHECKPOINT will write.
    pub priv_data_size: u64,
    /// The process's pid in its own pid namespace.
    pub pid: u32,
}

/// The largest counts and sizes the backend accepts from PROCESS_INFO or an image, so that a
/// bogus number cannot make it allocate without bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CriuLimits {
    /// GPUs per process (KFD supports at most 64 per process, `MAX_GPU_INSTANCE`).
    pub max_devices: u32,
    /// BOs per process.
    pub max_bos: u32,
    /// Private data bytes.
    pub max_priv_data: u64,
}

impl Default for CriuLimits {
    fn default() -> Self {
        Self {
            max_devices: 64,
            max_bos: 1 << 22,
            max_priv_data: 1 << 30,
        }
    }
}

/// The arrays of one CHECKPOINT or RESTORE call.
#[derive(Debug, Default)]
pub struct CriuBuffers {
    /// Device buckets.
    pub devices: Vec<kfd_criu_device_bucket>,
    /// BO buckets.
    pub bos: Vec<kfd_criu_bo_bucket>,
    /// The opaque private data.
    pub priv_data: Vec<u8>,
    /// Number of objects in the private data.
    pub num_objects: u32,
}

impl CriuBuffers {
    /// Zeroed arrays sized as PROCESS_INFO said, after checking the sizes against `limits`.
    pub fn for_checkpoint(info: &ProcessInfo, limits: &CriuLimits) -> io::Result<CriuBuffers> {
        if info.num_devices > limits.max_devices
            || info.num_bos > limits.max_bos
            || info.priv_data_size > limits.max_priv_data
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "KFD reports {} devices, {} BOs and {} bytes of private data, beyond the limits ({}, {}, {})",
                    info.num_devices,
                    info.num_bos,
                    info.priv_data_size,
                    limits.max_devices,
                    limits.max_bos,
                    limits.max_priv_data
                ),
            ));
        }
        Ok(CriuBuffers {
            devices: vec![kfd_criu_device_bucket::default(); info.num_devices as usize],
            bos: vec![kfd_criu_bo_bucket::default(); info.num_bos as usize],
            priv_data: vec![0; info.priv_data_size as usize],
            num_objects: info.num_objects,
        })
    }

    fn args(&mut self, op: u32, pid: u32) -> io::Result<kfd_ioctl_criu_args> {
        let too_many = || io::Error::from_raw_os_error(libc::E2BIG);
        Ok(kfd_ioctl_criu_args {
            devices: self.devices.as_mut_ptr() as u64,
            bos: self.bos.as_mut_ptr() as u64,
            priv_data: self.priv_data.as_mut_ptr() as u64,
            priv_data_size: self.priv_data.len() as u64,
            num_devices: u32::try_from(self.devices.len()).map_err(|_| too_many())?,
            num_bos: u32::try_from(self.bos.len()).map_err(|_| too_many())?,
            num_objects: self.num_objects,
            pid,
            op,
        })
    }
}

/// dma-buf fds installed by CHECKPOINT or RESTORE, one slot per BO bucket.
pub type DmabufFds = Vec<Option<OwnedFd>>;

/// Takes ownership of the dma-buf fds the kernel wrote into `bos` (after a successful
/// CHECKPOINT or RESTORE). Fails when a value is not a plausible fd or appears twice, after
/// closing the valid ones (nothing is leaked and nothing is closed twice).
fn take_dmabufs(bos: &[kfd_criu_bo_bucket]) -> io::Result<DmabufFds> {
    let mut seen = std::collections::HashSet::new();
    let mut bad = None;
    let mut out: DmabufFds = Vec::with_capacity(bos.len());
    for (i, b) in bos.iter().enumerate() {
        if b.dmabuf_fd == KFD_INVALID_FD {
            out.push(None);
            continue;
        }
        let fd = b.dmabuf_fd as RawFd;
        if fd < 0 || !seen.insert(fd) {
            bad.get_or_insert(i);
            out.push(None);
            continue;
        }
        // SAFETY: per the criu_op contract the kernel installed this fd for the caller, who
        // owns it from now on; uniqueness was checked above, so it is wrapped once.
        out.push(Some(unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    match bad {
        None => Ok(out),
        Some(i) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "KFD returned an invalid dma-buf fd {} for BO {i}",
                bos[i].dmabuf_fd as i32
            ),
        )),
    }
}

/// PROCESS_INFO: evicts the process's queues and reports its sizes.
pub fn process_info(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> io::Result<ProcessInfo> {
    let mut args = kfd_ioctl_criu_args {
        op: KFD_CRIU_OP_PROCESS_INFO,
        ..Default::default()
    };
    // SAFETY: PROCESS_INFO reads no user pointers (all are null) and only writes `args`.
    unsafe { dev.criu_op(kfd, &mut args) }?;
    Ok(ProcessInfo {
        num_devices: args.num_devices,
        num_bos: args.num_bos,
        num_objects: args.num_objects,
        priv_data_size: args.priv_data_size,
        pid: args.pid,
    })
}

/// CHECKPOINT into `bufs` (sized by [`CriuBuffers::for_checkpoint`]); returns the dma-buf fds
/// the kernel created in this process, one slot per BO.
pub fn checkpoint(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    bufs: &mut CriuBuffers,
) -> io::Result<DmabufFds> {
    criu_op_on_buffers(dev, kfd, bufs, KFD_CRIU_OP_CHECKPOINT)
}

/// The CRIU operation `op` (CHECKPOINT or RESTORE) over the arrays of `bufs`; returns the
/// dma-buf fds the kernel installed, one slot per BO.
fn criu_op_on_buffers(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    bufs: &mut CriuBuffers,
    op: u32,
) -> io::Result<DmabufFds> {
    for b in &mut bufs.bos {
        b.dmabuf_fd = KFD_INVALID_FD;
    }
    let mut args = bufs.args(op, 0)?;
    // SAFETY: `args` points at the three vectors of `bufs`, whose lengths are the counts and
    // size in `args`; they are exclusively borrowed and outlive the call.
    unsafe { dev.criu_op(kfd, &mut args) }?;
    take_dmabufs(&bufs.bos)
}

/// UNPAUSE: restarts the queues evicted by PROCESS_INFO.
pub fn unpause(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> io::Result<()> {
    let mut args = kfd_ioctl_criu_args {
        op: KFD_CRIU_OP_UNPAUSE,
        ..Default::default()
    };
    // SAFETY: UNPAUSE uses no user pointers.
    unsafe { dev.criu_op(kfd, &mut args) }
}

/// RESTORE from `bufs` on the calling task's own `kfd`; fills `restored_offset` and returns
/// the dma-buf fds of the new BOs.
pub fn restore(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    bufs: &mut CriuBuffers,
) -> io::Result<DmabufFds> {
    for b in &mut bufs.bos {
        b.restored_offset = 0;
    }
    criu_op_on_buffers(dev, kfd, bufs, KFD_CRIU_OP_RESTORE)
}

/// RESUME of process `pid` (as the caller's pid namespace sees it).
pub fn resume(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>, pid: u32) -> io::Result<()> {
    let mut args = kfd_ioctl_criu_args {
        op: KFD_CRIU_OP_RESUME,
        pid,
        ..Default::default()
    };
    // SAFETY: RESUME uses no user pointers.
    unsafe { dev.criu_op(kfd, &mut args) }
}

/// Checks that the kernel's KFD interface, asked through `kfd` (a `/dev/kfd` the caller
/// opened itself), has the CRIU operations the backend needs.
pub fn check_kfd_version(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> Result<(u32, u32), Error> {
    let v = dev
        .get_version(kfd)
        .map_err(|e| Error::io(&e, "cannot query the KFD version"))?;
    if v.0 != MIN_KFD_VERSION.0 || v.1 < MIN_KFD_VERSION.1 {
        return Err(device_error(
            libc::EOPNOTSUPP,
            format!(
                "the kernel's KFD interface is {}.{}; checkpointing needs {}.{} or a later 1.x",
                v.0, v.1, MIN_KFD_VERSION.0, MIN_KFD_VERSION.1
            ),
        ));
    }
    Ok(v)
}

/// Human-readable byte counts for logs.
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b >= 1 << 30 {
            write!(f, "{:.2} GiB", b as f64 / (1u64 << 30) as f64)
        } else if b >= 1 << 20 {
            write!(f, "{:.1} MiB", b as f64 / (1u64 << 20) as f64)
        } else if b >= 1 << 10 {
            write!(f, "{:.1} KiB", b as f64 / 1024.0)
        } else {
            write!(f, "{b} B")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chr(major: u32, minor: u32) -> FileIdentity {
        FileIdentity {
            mode: libc::S_IFCHR | 0o666,
            rdev: libc::makedev(major, minor),
            dmabuf: false,
        }
    }

    #[test]
    fn files_are_classified_by_device_number() {
        let kfd = Some(libc::makedev(238, 0));
        assert_eq!(classify(&chr(238, 0), kfd), FileKind::Kfd);
        assert_eq!(classify(&chr(238, 1), kfd), FileKind::Other);
        assert_eq!(classify(&chr(DRM_MAJOR, 127), kfd), FileKind::Other);
        assert_eq!(
            classify(&chr(DRM_MAJOR, 128), kfd),
            FileKind::RenderNode { minor: 128 }
        );
        assert_eq!(
            classify(&chr(DRM_MAJOR, 255), kfd),
            FileKind::RenderNode { minor: 255 }
        );
        assert_eq!(classify(&chr(DRM_MAJOR, 256), kfd), FileKind::Other);
        assert_eq!(classify(&chr(DRM_MAJOR, 0), kfd), FileKind::Other);
        // Without /dev/kfd, render nodes are still recognised and KFD-looking ones are not.
        assert_eq!(classify(&chr(238, 0), None), FileKind::Other);
        assert_eq!(
            classify(&chr(DRM_MAJOR, 130), None),
            FileKind::RenderNode { minor: 130 }
        );
        let mut reg = chr(238, 0);
        reg.mode = libc::S_IFREG | 0o600;
        assert_eq!(classify(&reg, kfd), FileKind::Other);
        reg.dmabuf = true;
        assert_eq!(classify(&reg, kfd), FileKind::DmaBuf);
    }

    #[test]
    fn oversized_process_info_is_refused_before_allocating() {
        let info = ProcessInfo {
            num_devices: 2,
            num_bos: u32::MAX,
            num_objects: 1,
            priv_data_size: 16,
            pid: 1,
        };
        assert!(CriuBuffers::for_checkpoint(&info, &CriuLimits::default()).is_err());
        let info = ProcessInfo {
            priv_data_size: 1 << 40,
            num_bos: 1,
            ..info
        };
        assert!(CriuBuffers::for_checkpoint(&info, &CriuLimits::default()).is_err());
    }

    #[test]
    fn duplicate_dmabuf_fds_are_refused_without_double_close() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::IntoRawFd;
        let fa = a.into_raw_fd();
        let mut bos = vec![kfd_criu_bo_bucket::default(); 3];
        bos[0].dmabuf_fd = fa as u32;
        bos[1].dmabuf_fd = fa as u32;
        bos[2].dmabuf_fd = KFD_INVALID_FD;
        // The fd is wrapped (and closed) once; the duplicate is reported.
        assert!(take_dmabufs(&bos).is_err());
        drop(b);
    }
}
