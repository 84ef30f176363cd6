//! Render-node CRIU uAPI that is newer than the generated bindings.
//!
//! The CRIU plugin's render-node dump and restore (GEM BO listing, mapping
//! info, handle changes and VA mapping on `/dev/dri/renderD*`) rely on
//! amdgpu/DRM additions that reached Linux by **6.18** and are in neither
//! linux-libc-dev 6.1 nor libdrm 2.4.114, so bindgen cannot produce them
//! here. They are written by hand from the layouts of the uAPI headers CRIU's
//! amdgpu plugin carries (sizes and ioctl numbers measured by compiling the
//! CRIU tree's rocm-7.1.0 headers on x86-64) and are checked only by the
//! `const` assertions below, not by the C probe in `tests/layout.rs`.
//! Replace them with generated bindings once the system headers carry them.
//!
//! - `DRM_IOCTL_AMDGPU_GEM_LIST_HANDLES` lists every GEM handle of the
//!   calling DRM file. Older kernels answer `EINVAL`.
//! - `DRM_IOCTL_AMDGPU_GEM_OP` grew `num_entries` and a pad word (24 bytes
//!   instead of 16) for the new `AMDGPU_GEM_OP_GET_MAPPING_INFO` op.
//! - `DRM_IOCTL_GEM_CHANGE_HANDLE` (generic DRM) moves a GEM object to
//!   another handle number in the same file.
//! - `DRM_IOCTL_AMDGPU_GEM_VA` grew VM-timeline syncobj fields (64 bytes
//!   instead of 40); the request number 0x40406448 those headers give is
//!   this size.
//! - `AMDGPU_INFO_GPUVM_FAULT` (Linux 6.10, older than the rest but also
//!   newer than the headers): the last GPU page fault in the calling file's
//!   VM. A faulting DMA job still completes (the access goes to a dummy
//!   page), so this is how a copy engine learns that a copy went wrong.
//!
//! The DRM core looks ioctls up by command number, copies in the size the
//! request number encodes and zero-fills up to the kernel's own size, so the
//! short (6.1) and long layouts of `GEM_OP` and `GEM_VA` are both accepted
//! by old and new kernels: an old kernel ignores the extra fields, a new one
//! sees them as zero when given the short layout.

#![allow(non_camel_case_types)]

use crate::bindings::{__u32, __u64, DRM_COMMAND_BASE, DRM_IOCTL_BASE};
use crate::ioc::{iow, iowr};

/// Command number of `DRM_AMDGPU_GEM_LIST_HANDLES` (relative to
/// `DRM_COMMAND_BASE`).
pub const DRM_AMDGPU_GEM_LIST_HANDLES: u32 = 0x19;

/// `drm_amdgpu_gem_list_handles_entry.flags`: the BO was imported from a
/// dma-buf rather than created in this file.
pub const AMDGPU_GEM_LIST_HANDLES_FLAG_IS_IMPORT: u32 = 1 << 0;

/// `drm_amdgpu_gem_op.op`: return the BO's GPU VA mappings in this file's VM
/// as an array of [`drm_amdgpu_gem_vm_entry`] at `value`.
pub const AMDGPU_GEM_OP_GET_MAPPING_INFO: u32 = 2;

/// `drm_amdgpu_info.query`: the last GPU page fault of this file's VM, as a
/// [`drm_amdgpu_info_gpuvm_fault`]. Older kernels answer `EINVAL`.
pub const AMDGPU_INFO_GPUVM_FAULT: u32 = 0x23;

/// Answer to `AMDGPU_INFO_GPUVM_FAULT`; all zero while the VM never faulted.
#[repr(C)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
pub struct drm_amdgpu_info_gpuvm_fault {
    /// Faulting GPU virtual address (page granular).
    pub addr: __u64,
    /// The VM hub's fault status register.
    pub status: __u32,
    /// `AMDGPU_VMHUB_TYPE_*` and index of the hub that faulted.
    pub vmhub: __u32,
}

/// Command number of the generic `DRM_IOCTL_GEM_CHANGE_HANDLE`.
pub const DRM_GEM_CHANGE_HANDLE_NR: u32 = 0xD2;

/// Argument of `DRM_IOCTL_AMDGPU_GEM_LIST_HANDLES`.
///
/// In: `entries` points to `num_entries` [`drm_amdgpu_gem_list_handles_entry`].
/// Out: `num_entries` is the number of BOs in the file. When that exceeds the
/// room given, nothing is written and the call must be repeated with a larger
/// array.
#[repr(C)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
pub struct drm_amdgpu_gem_list_handles {
    /// User pointer to the entry array.
    pub entries: __u64,
    /// In: capacity of `entries`; out: number of BOs.
    pub num_entries: __u32,
    /// Must be zero.
    pub padding: __u32,
}

/// One BO reported by `DRM_IOCTL_AMDGPU_GEM_LIST_HANDLES`.
#[repr(C)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
pub struct drm_amdgpu_gem_list_handles_entry {
    /// GEM handle in the calling file.
    pub gem_handle: __u32,
    /// `AMDGPU_GEM_LIST_HANDLES_FLAG_*`.
    pub flags: __u32,
    /// BO size in bytes.
    pub size: __u64,
    /// `AMDGPU_GEM_DOMAIN_*` the BO was created with.
    pub preferred_domains: __u64,
    /// `AMDGPU_GEM_CREATE_*` flags (the settable subset).
    pub alloc_flags: __u64,
    /// Physical alignment requested at creation.
    pub alignment: __u64,
}

/// Argument of `DRM_IOCTL_AMDGPU_GEM_OP` in Linux ≥ 6.18 (24 bytes).
///
/// The first 16 bytes are the 6.1 [`crate::drm_amdgpu_gem_op`]; the DRM core
/// zero-extends a shorter argument, so older kernels accept this layout for
/// the ops they know and newer kernels accept the 16-byte one.
#[repr(C)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
pub struct drm_amdgpu_gem_op {
    /// GEM handle.
    pub handle: __u32,
    /// `AMDGPU_GEM_OP_*`.
    pub op: __u32,
    /// Input or output value; for `GET_MAPPING_INFO` a user pointer to an
    /// array of [`drm_amdgpu_gem_vm_entry`].
    pub value: __u64,
    /// `GET_MAPPING_INFO` in: capacity of the array; out: number of
    /// mappings (call again with a larger array when it exceeds the room).
    pub num_entries: __u32,
    /// Must be zero.
    pub padding: __u32,
}

/// One GPU VA mapping returned by `AMDGPU_GEM_OP_GET_MAPPING_INFO`.
#[repr(C)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
pub struct drm_amdgpu_gem_vm_entry {
    /// GPU virtual address of the mapping, in bytes.
    pub addr: __u64,
    /// Size of the mapping, in bytes.
    pub size: __u64,
    /// Offset of the mapping inside the BO, in bytes.
    pub offset: __u64,
    /// `AMDGPU_VM_PAGE_*` flags needed to recreate the mapping.
    pub flags: __u64,
}

/// Argument of `DRM_IOCTL_AMDGPU_GEM_VA` in newer kernels (64 bytes).
///
/// The first 40 bytes are the 6.1 [`crate::drm_amdgpu_gem_va`].
#[repr(C)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
pub struct drm_amdgpu_gem_va {
    /// GEM handle (ignored for `AMDGPU_VA_OP_CLEAR` and PRT mappings).
    pub handle: __u32,
    /// Must be zero.
    pub _pad: __u32,
    /// `AMDGPU_VA_OP_*`.
    pub operation: __u32,
    /// `AMDGPU_VM_PAGE_*` / `AMDGPU_VM_DELAY_UPDATE`.
    pub flags: __u32,
    /// GPU virtual address, page aligned.
    pub va_address: __u64,
    /// Offset inside the BO, page aligned.
    pub offset_in_bo: __u64,
    /// Size of the mapping, page aligned.
    pub map_size: __u64,
    /// Timeline point to signal on `vm_timeline_syncobj_out` (0: binary).
    pub vm_timeline_point: __u64,
    /// Syncobj handle signalled when the VM update is done (0: none).
    pub vm_timeline_syncobj_out: __u32,
    /// Number of handles at `input_fence_syncobj_handles`.
    pub num_syncobj_handles: __u32,
    /// User pointer to `num_syncobj_handles` `u32` syncobj handles to wait on.
    pub input_fence_syncobj_handles: __u64,
}

/// Argument of `DRM_IOCTL_GEM_CHANGE_HANDLE`.
#[repr(C)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
pub struct drm_gem_change_handle {
    /// Current handle of the GEM object.
    pub handle: __u32,
    /// Handle number it should have afterwards (must be free).
    pub new_handle: __u32,
}

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x19, struct drm_amdgpu_gem_list_handles)`.
///
/// Render node; any client of the file (`DRM_AUTH | DRM_RENDER_ALLOW`).
/// Linux ≥ 6.18; `EINVAL` on older kernels.
pub const DRM_IOCTL_AMDGPU_GEM_LIST_HANDLES: u32 = iowr::<drm_amdgpu_gem_list_handles>(
    DRM_IOCTL_BASE,
    DRM_COMMAND_BASE + DRM_AMDGPU_GEM_LIST_HANDLES,
);

/// `DRM_IOWR(DRM_COMMAND_BASE + 0x10, struct drm_amdgpu_gem_op)` with the
/// 24-byte ≥ 6.18 argument. Render node. See
/// [`crate::ioctls::DRM_IOCTL_AMDGPU_GEM_OP`] for the 6.1 number.
pub const DRM_IOCTL_AMDGPU_GEM_OP: u32 = iowr::<drm_amdgpu_gem_op>(
    DRM_IOCTL_BASE,
    DRM_COMMAND_BASE + crate::bindings::DRM_AMDGPU_GEM_OP,
);

/// `DRM_IOW(DRM_COMMAND_BASE + 0x08, struct drm_amdgpu_gem_va)` with the
/// 64-byte argument. Render node. See
/// [`crate::ioctls::DRM_IOCTL_AMDGPU_GEM_VA`] for the 6.1 number.
pub const DRM_IOCTL_AMDGPU_GEM_VA: u32 = iow::<drm_amdgpu_gem_va>(
    DRM_IOCTL_BASE,
    DRM_COMMAND_BASE + crate::bindings::DRM_AMDGPU_GEM_VA,
);

/// `DRM_IOWR(0xD2, struct drm_gem_change_handle)`.
///
/// Generic DRM ioctl on a render node; renumbers a GEM handle of the calling
/// file. Linux ≥ 6.18.
pub const DRM_IOCTL_GEM_CHANGE_HANDLE: u32 =
    iowr::<drm_gem_change_handle>(DRM_IOCTL_BASE, DRM_GEM_CHANGE_HANDLE_NR);

const _: () = {
    use core::mem::{offset_of, size_of};

    assert!(size_of::<drm_amdgpu_gem_list_handles>() == 16);
    assert!(offset_of!(drm_amdgpu_gem_list_handles, num_entries) == 8);
    assert!(size_of::<drm_amdgpu_gem_list_handles_entry>() == 40);
    assert!(offset_of!(drm_amdgpu_gem_list_handles_entry, size) == 8);
    assert!(offset_of!(drm_amdgpu_gem_list_handles_entry, alignment) == 32);
    assert!(size_of::<drm_amdgpu_gem_op>() == 24);
    assert!(offset_of!(drm_amdgpu_gem_op, value) == 8);
    assert!(offset_of!(drm_amdgpu_gem_op, num_entries) == 16);
    assert!(size_of::<drm_amdgpu_gem_vm_entry>() == 32);
    assert!(size_of::<drm_gem_change_handle>() == 8);
    assert!(size_of::<drm_amdgpu_info_gpuvm_fault>() == 16);
    assert!(offset_of!(drm_amdgpu_info_gpuvm_fault, vmhub) == 12);
    assert!(size_of::<drm_amdgpu_gem_va>() == 64);
    assert!(offset_of!(drm_amdgpu_gem_va, vm_timeline_point) == 40);
    assert!(offset_of!(drm_amdgpu_gem_va, vm_timeline_syncobj_out) == 48);
    assert!(offset_of!(drm_amdgpu_gem_va, input_fence_syncobj_handles) == 56);
    assert!(offset_of!(crate::bindings::drm_amdgpu_gem_va, map_size) == 32);
    assert!(size_of::<crate::bindings::drm_amdgpu_gem_va>() == 40);
    // The old op must stay a prefix of the new one.
    assert!(offset_of!(crate::bindings::drm_amdgpu_gem_op, value) == 8);
    assert!(size_of::<crate::bindings::drm_amdgpu_gem_op>() == 16);
};

// The generic ioctl layout (every architecture but powerpc, mips and sparc).
const _: () = if crate::ioc::GENERIC_LAYOUT {
    // Values computed from the CRIU tree's rocm-7.1.0 headers, generic ioctl layout.
    assert!(DRM_IOCTL_AMDGPU_GEM_LIST_HANDLES == 0xC010_6459);
    assert!(DRM_IOCTL_AMDGPU_GEM_OP == 0xC018_6450);
    assert!(DRM_IOCTL_GEM_CHANGE_HANDLE == 0xC008_64D2);
    assert!(DRM_IOCTL_AMDGPU_GEM_VA == 0x4040_6448);
};
