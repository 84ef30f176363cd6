//! ioctl request numbers, computed from the generated structures.
//!
//! `kfd_ioctl.h`, `drm.h` and `amdgpu_drm.h` define these with `_IOR` /
//! `_IOW` / `_IOWR`, which bindgen cannot evaluate. Each constant here
//! repeats the header's definition through [`crate::ioc`]; `tests/layout.rs`
//! checks every one against the value the C compiler computes from the real
//! headers, and the `const` block at the end pins the values CRIU's amdgpu
//! plugin uses.
//!
//! Which file each request is issued on:
//! - `AMDKFD_IOC_*`: a `/dev/kfd` file. KFD binds a file to the process that
//!   opened it; other processes get `EBADF`, except that CRIU ops are also
//!   accepted from the ptrace parent of the owner.
//! - `DRM_IOCTL_*`: an open DRM render node (`/dev/dri/renderD128`..`255`).
//!   GEM handles, contexts, BO lists and VM mappings belong to that open file
//!   description, not to the device.

use crate::bindings::*;
use crate::ioc::{ior, iow, iowr};

// ---------------------------------------------------------------------------
// KFD (/dev/kfd)
// ---------------------------------------------------------------------------

/// `AMDKFD_IOR(0x01, struct kfd_ioctl_get_version_args)`.
///
/// Returns the KFD interface version. Issued on any `/dev/kfd` file opened by
/// the caller; needs no privilege. The CRIU API exists from 1.7 and the
/// plugin requires `major == 1 && minor >= 8`. A dumper must use a KFD file
/// it opened itself: a file taken from the target only accepts CRIU ops.
pub const AMDKFD_IOC_GET_VERSION: u32 = ior::<kfd_ioctl_get_version_args>(AMDKFD_IOCTL_BASE, 0x01);

/// `AMDKFD_IOW(0x15, struct kfd_ioctl_acquire_vm_args)`.
///
/// Binds the process's GPU VM for `gpu_id` to the render-node file
/// `drm_fd`, so that later BOs are mmapped through that file. Issued on the
/// owner's `/dev/kfd`. (CRIU restore does the equivalent inside
/// `KFD_CRIU_OP_RESTORE` from the device buckets' `drm_fd`.)
pub const AMDKFD_IOC_ACQUIRE_VM: u32 = iow::<kfd_ioctl_acquire_vm_args>(AMDKFD_IOCTL_BASE, 0x15);

/// `AMDKFD_IOWR(0x21, struct kfd_ioctl_set_xnack_mode_args)`.
///
/// Queries (`xnack_enabled < 0`) or sets the process's XNACK mode. Setting
/// it fails while the process has user-mode queues. Issued on the owner's
/// `/dev/kfd`. The CRIU private blob carries this mode and RESTORE reapplies
/// it, so the plugin itself does not call this.
pub const AMDKFD_IOC_SET_XNACK_MODE: u32 =
    iowr::<kfd_ioctl_set_xnack_mode_args>(AMDKFD_IOCTL_BASE, 0x21);

/// `AMDKFD_IOWR(0x22, struct kfd_ioctl_criu_args)`.
///
/// Checkpoint/restore operation selected by `op` (`KFD_CRIU_OP_*`). Requires
/// `CAP_CHECKPOINT_RESTORE` or `CAP_SYS_ADMIN`. Issued on the target
/// process's `/dev/kfd` file: by the dumper through the drained fd (allowed
/// as ptrace parent) for PROCESS_INFO / CHECKPOINT / UNPAUSE, by the restored
/// task on its own file for RESTORE, and by the CRIU master for RESUME (which
/// names the process by `pid`, looked up in the caller's pid namespace).
pub const AMDKFD_IOC_CRIU_OP: u32 = iowr::<kfd_ioctl_criu_args>(AMDKFD_IOCTL_BASE, 0x22);

/// `AMDKFD_IOWR(0x23, struct kfd_ioctl_get_available_memory_args)`.
///
/// Returns the VRAM still available to the process on `gpu_id` (KFD ≥ 1.9).
/// Issued on the owner's `/dev/kfd`. Not used by the CRIU path; useful for
/// a pre-restore capacity check.
pub const AMDKFD_IOC_AVAILABLE_MEMORY: u32 =
    iowr::<kfd_ioctl_get_available_memory_args>(AMDKFD_IOCTL_BASE, 0x23);

// ---------------------------------------------------------------------------
// Generic DRM (render node)
// ---------------------------------------------------------------------------

/// `DRM_IOWR(0x00, struct drm_version)`.
///
/// Returns the driver version and, into caller buffers, its name (`"amdgpu"`),
/// date and description. Any DRM file; no privilege.
pub const DRM_IOCTL_VERSION: u32 = iowr::<drm_version>(DRM_IOCTL_BASE, 0x00);

/// `DRM_IOW(0x09, struct drm_gem_close)`.
///
/// Drops the caller's GEM handle; the BO lives on while other handles,
/// dma-bufs or mappings reference it. Render node that owns the handle.
pub const DRM_IOCTL_GEM_CLOSE: u32 = iow::<drm_gem_close>(DRM_IOCTL_BASE, 0x09);

/// `DRM_IOWR(0x2d, struct drm_prime_handle)`.
///
/// Exports the GEM handle as a dma-buf fd in the caller's fd table. `flags`
/// takes [`crate::DRM_CLOEXEC`] and [`crate::DRM_RDWR`]. Render node owning
/// the handle.
pub const DRM_IOCTL_PRIME_HANDLE_TO_FD: u32 = iowr::<drm_prime_handle>(DRM_IOCTL_BASE, 0x2d);

/// `DRM_IOWR(0x2e, struct drm_prime_handle)`.
///
/// Imports a dma-buf fd and returns a GEM handle for it in this file (the
/// same handle each time for the same buffer). Render node.
pub const DRM_IOCTL_PRIME_FD_TO_HANDLE: u32 = iowr::<drm_prime_handle>(DRM_IOCTL_BASE, 0x2e);

// ---------------------------------------------------------------------------
// amdgpu (render node, DRM_COMMAND_BASE + DRM_AMDGPU_*)
// ---------------------------------------------------------------------------

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x00, union drm_amdgpu_gem_create)`.
///
/// Allocates a BO (`bo_size`, `alignment`, `domains`, `domain_flags`) and
/// returns its GEM handle in this file. Render node.
pub const DRM_IOCTL_AMDGPU_GEM_CREATE: u32 =
    iowr::<drm_amdgpu_gem_create>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_GEM_CREATE);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x01, union drm_amdgpu_gem_mmap)`.
///
/// Returns the fake mmap offset (`out.addr_ptr`) through which the BO is
/// CPU-mapped by `mmap`ing this same render-node file. Render node.
pub const DRM_IOCTL_AMDGPU_GEM_MMAP: u32 =
    iowr::<drm_amdgpu_gem_mmap>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_GEM_MMAP);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x02, union drm_amdgpu_ctx)`.
///
/// Allocates / frees / queries a submission context (`AMDGPU_CTX_OP_*`).
/// Render node.
pub const DRM_IOCTL_AMDGPU_CTX: u32 =
    iowr::<drm_amdgpu_ctx>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_CTX);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x03, union drm_amdgpu_bo_list)`.
///
/// Creates / updates / destroys a list of BOs (`AMDGPU_BO_LIST_OP_*`) that a
/// command submission may reference. Render node.
pub const DRM_IOCTL_AMDGPU_BO_LIST: u32 =
    iowr::<drm_amdgpu_bo_list>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_BO_LIST);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x04, union drm_amdgpu_cs)`.
///
/// Submits chunks (`AMDGPU_CHUNK_ID_*`, e.g. an IB for `AMDGPU_HW_IP_DMA`)
/// on a context and returns a sequence number for `WAIT_CS`. Render node.
pub const DRM_IOCTL_AMDGPU_CS: u32 =
    iowr::<drm_amdgpu_cs>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_CS);

/// `DRM_IOW(DRM_COMMAND_BASE + 0x05, struct drm_amdgpu_info)`.
///
/// Queries device information (`AMDGPU_INFO_*`) into the buffer at
/// `return_pointer` (e.g. `AMDGPU_INFO_DEV_INFO` fills a
/// [`drm_amdgpu_info_device`], whose `family` selects the SDMA copy limit).
/// Render node.
pub const DRM_IOCTL_AMDGPU_INFO: u32 =
    iow::<drm_amdgpu_info>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_INFO);

/// `DRM_IOW(DRM_COMMAND_BASE + 0x08, struct drm_amdgpu_gem_va)`.
///
/// Maps, unmaps, clears or replaces (`AMDGPU_VA_OP_*`) a BO range at a GPU VA
/// in this file's VM. Render node. This is the 40-byte argument of the
/// generated headers; newer kernels take the 64-byte
/// [`crate::v6_18::drm_amdgpu_gem_va`] and zero-extend this one.
pub const DRM_IOCTL_AMDGPU_GEM_VA: u32 =
    iow::<drm_amdgpu_gem_va>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_GEM_VA);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x09, union drm_amdgpu_wait_cs)`.
///
/// Waits (up to an absolute timeout) for a submission returned by
/// `DRM_IOCTL_AMDGPU_CS`. Render node.
pub const DRM_IOCTL_AMDGPU_WAIT_CS: u32 =
    iowr::<drm_amdgpu_wait_cs>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_WAIT_CS);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x10, struct drm_amdgpu_gem_op)` with the
/// 16-byte argument of the generated (6.1) headers.
///
/// Per-BO operations (`AMDGPU_GEM_OP_*`). Render node. For
/// `GET_MAPPING_INFO` (Linux ≥ 6.18) use
/// [`crate::v6_18::DRM_IOCTL_AMDGPU_GEM_OP`].
pub const DRM_IOCTL_AMDGPU_GEM_OP: u32 =
    iowr::<drm_amdgpu_gem_op>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_GEM_OP);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x11, struct drm_amdgpu_gem_userptr)`.
///
/// Wraps page-aligned anonymous user memory in a BO (the plugin's staging
/// buffer). Render node.
pub const DRM_IOCTL_AMDGPU_GEM_USERPTR: u32 =
    iowr::<drm_amdgpu_gem_userptr>(DRM_IOCTL_BASE, DRM_COMMAND_BASE + DRM_AMDGPU_GEM_USERPTR);

// The generic ioctl layout (every architecture but powerpc, mips and sparc).
const _: () = if crate::ioc::GENERIC_LAYOUT {
    // Values CRIU's amdgpu plugin uses (computed from its headers), generic ioctl layout.
    assert!(AMDKFD_IOC_GET_VERSION == 0x8008_4B01);
    assert!(AMDKFD_IOC_CRIU_OP == 0xC038_4B22);
    assert!(DRM_IOCTL_AMDGPU_GEM_MMAP == 0xC008_6441);
    assert!(DRM_IOCTL_AMDGPU_GEM_CREATE == 0xC020_6440);
    assert!(DRM_IOCTL_PRIME_HANDLE_TO_FD == 0xC00C_642D);
    assert!(DRM_IOCTL_PRIME_FD_TO_HANDLE == 0xC00C_642E);
    // Computed by hand from the 6.1 headers; the C probe re-checks them.
    assert!(AMDKFD_IOC_ACQUIRE_VM == 0x4008_4B15);
    assert!(AMDKFD_IOC_SET_XNACK_MODE == 0xC004_4B21);
    assert!(AMDKFD_IOC_AVAILABLE_MEMORY == 0xC010_4B23);
    assert!(DRM_IOCTL_GEM_CLOSE == 0x4008_6409);
    // The C plugin's 0x40406448 is the 64-byte ≥ 6.18 argument (see v6_18).
    assert!(DRM_IOCTL_AMDGPU_GEM_VA == 0x4028_6448);
    assert!(DRM_IOCTL_AMDGPU_GEM_OP == 0xC010_6450);
};
