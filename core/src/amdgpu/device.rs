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

mod criu_op;
mod render;

use std::fmt;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use kfd_sys::kfd_ioctl_criu_args;

pub use criu_op::{
    CriuBuffers, CriuLimits, DmabufFds, ProcessInfo, check_kfd_version, checkpoint, process_info,
    restore, resume, unpause,
};
pub use render::{AmdgpuRender, GemCensus, HostMapping, RenderInfo, VmFaultState};

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
}
