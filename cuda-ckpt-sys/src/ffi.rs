//! Raw C types of the CUDA driver API subset this crate uses.
//!
//! Layouts follow NVIDIA's `cuda.h` (x86_64). Every checkpoint argument struct is 64 bytes in every
//! driver version; later headers only give names to bytes that older ones reserved, so the latest
//! layout, zero-initialised, is valid on any driver that has the API (12.8 and later). The field names
//! keep the C spelling so that they can be matched against the header.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::fmt;

/// `CUresult`: the status returned by every driver call (a C enum, 4 bytes).
///
/// A transparent newtype rather than a Rust enum: the driver may return codes this crate does not
/// name, and an out-of-range value in a Rust enum would be undefined behaviour.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CUresult(pub c_int);

impl CUresult {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: Self = Self(0);
    /// `CUDA_ERROR_INVALID_VALUE`: bad argument (also a bad GPU map on restore).
    pub const INVALID_VALUE: Self = Self(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY` (e.g. restore onto a GPU without enough free memory).
    pub const OUT_OF_MEMORY: Self = Self(2);
    /// `CUDA_ERROR_NOT_INITIALIZED`: `cuInit` not called, or the target process has no CUDA state.
    pub const NOT_INITIALIZED: Self = Self(3);
    /// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down.
    pub const DEINITIALIZED: Self = Self(4);
    /// `CUDA_ERROR_NO_DEVICE`: no CUDA-capable device.
    pub const NO_DEVICE: Self = Self(100);
    /// `CUDA_ERROR_INVALID_DEVICE`: bad device ordinal.
    pub const INVALID_DEVICE: Self = Self(101);
    /// `CUDA_ERROR_INVALID_CONTEXT` (13.4+ checkpoint/restore to custom storage).
    pub const INVALID_CONTEXT: Self = Self(201);
    /// `CUDA_ERROR_OPERATING_SYSTEM`: an OS call failed (observed for a nonexistent pid, missing
    /// permissions, and every restore after a failed one).
    pub const OPERATING_SYSTEM: Self = Self(304);
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const INVALID_HANDLE: Self = Self(400);
    /// `CUDA_ERROR_ILLEGAL_STATE`: the process is not in the state the operation needs.
    pub const ILLEGAL_STATE: Self = Self(401);
    /// `CUDA_ERROR_NOT_FOUND`.
    pub const NOT_FOUND: Self = Self(500);
    /// `CUDA_ERROR_NOT_READY`: the lock timed out; the process stays running.
    pub const NOT_READY: Self = Self(600);
    /// `CUDA_ERROR_NOT_PERMITTED` (seen without persistence mode).
    pub const NOT_PERMITTED: Self = Self(800);
    /// `CUDA_ERROR_NOT_SUPPORTED` (e.g. managed memory in the target, unsupported platform).
    pub const NOT_SUPPORTED: Self = Self(801);
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
    pub const STREAM_CAPTURE_UNSUPPORTED: Self = Self(900);
    /// `CUDA_ERROR_TIMEOUT`.
    pub const TIMEOUT: Self = Self(909);
    /// `CUDA_ERROR_UNKNOWN`.
    pub const UNKNOWN: Self = Self(999);

    /// Every code named above, with its C name.
    pub const KNOWN: &'static [(CUresult, &'static str)] = &[
        (Self::SUCCESS, "CUDA_SUCCESS"),
        (Self::INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
        (Self::OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"),
        (Self::NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"),
        (Self::DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED"),
        (Self::NO_DEVICE, "CUDA_ERROR_NO_DEVICE"),
        (Self::INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"),
        (Self::INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"),
        (Self::OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM"),
        (Self::INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"),
        (Self::ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE"),
        (Self::NOT_FOUND, "CUDA_ERROR_NOT_FOUND"),
        (Self::NOT_READY, "CUDA_ERROR_NOT_READY"),
        (Self::NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"),
        (Self::NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"),
        (
            Self::STREAM_CAPTURE_UNSUPPORTED,
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        ),
        (Self::TIMEOUT, "CUDA_ERROR_TIMEOUT"),
        (Self::UNKNOWN, "CUDA_ERROR_UNKNOWN"),
    ];

    /// The raw value.
    pub const fn code(self) -> c_int {
        self.0
    }

    /// Whether this is `CUDA_SUCCESS`.
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }

    /// The C name from this crate's own table (no driver needed), if the code is one it knows.
    pub fn static_name(self) -> Option<&'static str> {
        Self::KNOWN
            .iter()
            .find(|(code, _)| *code == self)
            .map(|(_, name)| *name)
    }
}

impl fmt::Debug for CUresult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.static_name() {
            Some(name) => write!(f, "{name}({})", self.0),
            None => write!(f, "CUresult({})", self.0),
        }
    }
}

impl fmt::Display for CUresult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.static_name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "CUDA error {}", self.0),
        }
    }
}

/// `CUprocessState`: the checkpoint state of a process (a C enum, 4 bytes), kept raw because
/// CUDA 13.4 added values and later drivers may add more.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct CUprocessState(pub c_uint);

impl CUprocessState {
    /// `CU_PROCESS_STATE_RUNNING`: default.
    pub const RUNNING: Self = Self(0);
    /// `CU_PROCESS_STATE_LOCKED`: CUDA API locked; further CUDA calls in the target block.
    pub const LOCKED: Self = Self(1);
    /// `CU_PROCESS_STATE_CHECKPOINTED`: device memory copied to host, GPU resources released.
    pub const CHECKPOINTED: Self = Self(2);
    /// `CU_PROCESS_STATE_FAILED`: an uncorrectable error during checkpoint or restore.
    pub const FAILED: Self = Self(3);
    /// `CU_PROCESS_STATE_CHECKPOINTING` (13.4+, custom storage in progress).
    pub const CHECKPOINTING: Self = Self(4);
    /// `CU_PROCESS_STATE_RESTORING` (13.4+, custom storage in progress).
    pub const RESTORING: Self = Self(5);
}

/// `CUdevice`: a device ordinal handle.
pub type CUdevice = c_int;

/// `CUuuid`: 16 raw bytes identifying a GPU (`char bytes[16]` in C; same ABI as `u8`).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct CUuuid {
    /// The UUID bytes, in the order `nvidia-smi` prints them.
    pub bytes: [u8; 16],
}

/// `CUcheckpointLockArgs` (12.8+, 64 bytes). `timeoutMs` is the FIRST field.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CUcheckpointLockArgs {
    /// Milliseconds to wait for the lock; 0 waits forever. On timeout the call returns
    /// `CUDA_ERROR_NOT_READY` and the process stays running.
    pub timeoutMs: c_uint,
    /// Must be zero.
    pub reserved0: c_uint,
    /// Must be zero.
    pub reserved1: [u64; 7],
}

impl CUcheckpointLockArgs {
    /// All zero: no timeout.
    pub const fn zeroed() -> Self {
        Self {
            timeoutMs: 0,
            reserved0: 0,
            reserved1: [0; 7],
        }
    }

    /// Zeroed, with the given timeout.
    pub const fn with_timeout(timeout_ms: u32) -> Self {
        let mut args = Self::zeroed();
        args.timeoutMs = timeout_ms;
        args
    }
}

/// `CUcheckpointCheckpointArgs` (64 bytes). 13.4 names the first 8 bytes
/// `customStorageInfo_out`; NULL (zero) means "checkpoint to host memory", the only mode used here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUcheckpointCheckpointArgs {
    /// 13.4+: `CUcheckpointCustomStorageInfo **`; NULL selects host memory. Reserved before 13.4.
    pub customStorageInfo_out: *mut *mut c_void,
    /// Must be zero.
    pub reserved: [u8; 56],
}

impl CUcheckpointCheckpointArgs {
    /// All zero: checkpoint to host memory.
    pub const fn zeroed() -> Self {
        Self {
            customStorageInfo_out: std::ptr::null_mut(),
            reserved: [0; 56],
        }
    }
}

impl Default for CUcheckpointCheckpointArgs {
    fn default() -> Self {
        Self::zeroed()
    }
}

/// `CUcheckpointGpuPair` (13.0+, 32 bytes): restore what ran on `oldUuid` onto `newUuid`.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct CUcheckpointGpuPair {
    /// The GPU the process was checkpointed on.
    pub oldUuid: CUuuid,
    /// The GPU to restore it onto.
    pub newUuid: CUuuid,
}

/// `CUcheckpointRestoreArgs` (64 bytes in every version). Before 13.0 all of it is reserved; 13.0
/// added `gpuPairs`/`gpuPairsCount`; 13.4 named `padding0` and `customStorageInfo_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUcheckpointRestoreArgs {
    /// 13.0+: GPU remapping array, or NULL for "same GPUs".
    pub gpuPairs: *mut CUcheckpointGpuPair,
    /// 13.0+: entries in `gpuPairs`.
    pub gpuPairsCount: c_uint,
    /// Must be zero.
    pub padding0: c_uint,
    /// 13.4+: custom storage output; NULL restores from host memory. Reserved before 13.4.
    pub customStorageInfo_out: *mut *mut c_void,
    /// Must be zero.
    pub reserved: [u8; 40],
}

impl CUcheckpointRestoreArgs {
    /// All zero: restore onto the same GPUs, from host memory.
    pub const fn zeroed() -> Self {
        Self {
            gpuPairs: std::ptr::null_mut(),
            gpuPairsCount: 0,
            padding0: 0,
            customStorageInfo_out: std::ptr::null_mut(),
            reserved: [0; 40],
        }
    }
}

impl Default for CUcheckpointRestoreArgs {
    fn default() -> Self {
        Self::zeroed()
    }
}

/// `CUcheckpointUnlockArgs` (64 bytes, all reserved).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CUcheckpointUnlockArgs {
    /// Must be zero.
    pub reserved: [u64; 8],
}

impl CUcheckpointUnlockArgs {
    /// All zero.
    pub const fn zeroed() -> Self {
        Self { reserved: [0; 8] }
    }
}

/// `cuDriverGetVersion` (available before `cuInit`).
pub type PFN_cuDriverGetVersion = unsafe extern "C" fn(driverVersion: *mut c_int) -> CUresult;
/// `cuGetErrorName` / `cuGetErrorString` (static strings, no `cuInit` needed).
pub type PFN_cuGetErrorString =
    unsafe extern "C" fn(error: CUresult, pStr: *mut *const c_char) -> CUresult;
/// `cuInit`.
pub type PFN_cuInit = unsafe extern "C" fn(flags: c_uint) -> CUresult;
/// `cuDeviceGetCount`.
pub type PFN_cuDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> CUresult;
/// `cuDeviceGet`.
pub type PFN_cuDeviceGet = unsafe extern "C" fn(device: *mut CUdevice, ordinal: c_int) -> CUresult;
/// `cuDeviceGetUuid_v2` / `cuDeviceGetUuid`.
pub type PFN_cuDeviceGetUuid = unsafe extern "C" fn(uuid: *mut CUuuid, dev: CUdevice) -> CUresult;
/// `cuDeviceGetName`.
pub type PFN_cuDeviceGetName =
    unsafe extern "C" fn(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult;
/// `cuDeviceTotalMem_v2`.
pub type PFN_cuDeviceTotalMem = unsafe extern "C" fn(bytes: *mut usize, dev: CUdevice) -> CUresult;
/// `cuCheckpointProcessGetRestoreThreadId`.
pub type PFN_cuCheckpointProcessGetRestoreThreadId =
    unsafe extern "C" fn(pid: c_int, tid: *mut c_int) -> CUresult;
/// `cuCheckpointProcessGetState`.
pub type PFN_cuCheckpointProcessGetState =
    unsafe extern "C" fn(pid: c_int, state: *mut CUprocessState) -> CUresult;
/// `cuCheckpointProcessLock`.
pub type PFN_cuCheckpointProcessLock =
    unsafe extern "C" fn(pid: c_int, args: *mut CUcheckpointLockArgs) -> CUresult;
/// `cuCheckpointProcessCheckpoint`.
pub type PFN_cuCheckpointProcessCheckpoint =
    unsafe extern "C" fn(pid: c_int, args: *mut CUcheckpointCheckpointArgs) -> CUresult;
/// `cuCheckpointProcessRestore`.
pub type PFN_cuCheckpointProcessRestore =
    unsafe extern "C" fn(pid: c_int, args: *mut CUcheckpointRestoreArgs) -> CUresult;
/// `cuCheckpointProcessUnlock`.
pub type PFN_cuCheckpointProcessUnlock =
    unsafe extern "C" fn(pid: c_int, args: *mut CUcheckpointUnlockArgs) -> CUresult;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    const _: () = assert!(size_of::<CUresult>() == 4);
    const _: () = assert!(size_of::<CUprocessState>() == 4);
    const _: () = assert!(size_of::<CUuuid>() == 16);
    const _: () = assert!(size_of::<CUcheckpointLockArgs>() == 64);
    const _: () = assert!(size_of::<CUcheckpointCheckpointArgs>() == 64);
    const _: () = assert!(size_of::<CUcheckpointRestoreArgs>() == 64);
    const _: () = assert!(size_of::<CUcheckpointUnlockArgs>() == 64);
    const _: () = assert!(size_of::<CUcheckpointGpuPair>() == 32);
    const _: () = assert!(offset_of!(CUcheckpointLockArgs, timeoutMs) == 0);
    const _: () = assert!(offset_of!(CUcheckpointLockArgs, reserved0) == 4);
    const _: () = assert!(offset_of!(CUcheckpointLockArgs, reserved1) == 8);
    const _: () = assert!(offset_of!(CUcheckpointRestoreArgs, gpuPairs) == 0);
    const _: () = assert!(offset_of!(CUcheckpointRestoreArgs, gpuPairsCount) == 8);
    const _: () = assert!(offset_of!(CUcheckpointRestoreArgs, padding0) == 12);
    const _: () = assert!(offset_of!(CUcheckpointRestoreArgs, customStorageInfo_out) == 16);
    const _: () = assert!(offset_of!(CUcheckpointRestoreArgs, reserved) == 24);
    const _: () = assert!(offset_of!(CUcheckpointCheckpointArgs, customStorageInfo_out) == 0);
    const _: () = assert!(offset_of!(CUcheckpointGpuPair, oldUuid) == 0);
    const _: () = assert!(offset_of!(CUcheckpointGpuPair, newUuid) == 16);

    #[test]
    fn layouts() {
        assert_eq!(size_of::<CUcheckpointLockArgs>(), 64);
        assert_eq!(align_of::<CUcheckpointLockArgs>(), 8);
        assert_eq!(size_of::<CUcheckpointRestoreArgs>(), 64);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, gpuPairsCount), 8);
        assert_eq!(size_of::<CUcheckpointGpuPair>(), 32);
        assert_eq!(align_of::<CUcheckpointGpuPair>(), 1);
    }

    fn bytes_of<T>(value: &T) -> Vec<u8> {
        // SAFETY: `value` is a live, initialised `T` of `size_of::<T>()` bytes; the structs checked
        // here have no padding (asserted by their sizes), so every byte is initialised.
        unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }
            .to_vec()
    }

    #[test]
    fn zeroed_constructors_are_all_zero() {
        assert!(
            bytes_of(&CUcheckpointLockArgs::zeroed())
                .iter()
                .all(|&b| b == 0)
        );
        assert!(
            bytes_of(&CUcheckpointCheckpointArgs::zeroed())
                .iter()
                .all(|&b| b == 0)
        );
        assert!(
            bytes_of(&CUcheckpointRestoreArgs::zeroed())
                .iter()
                .all(|&b| b == 0)
        );
        assert!(
            bytes_of(&CUcheckpointUnlockArgs::zeroed())
                .iter()
                .all(|&b| b == 0)
        );
        let lock = bytes_of(&CUcheckpointLockArgs::with_timeout(0x0102_0304));
        assert_eq!(&lock[..4], &0x0102_0304u32.to_ne_bytes());
        assert!(lock[4..].iter().all(|&b| b == 0));
    }

    #[test]
    fn result_names() {
        assert_eq!(
            CUresult::NOT_READY.static_name(),
            Some("CUDA_ERROR_NOT_READY")
        );
        assert_eq!(CUresult(12345).static_name(), None);
        assert_eq!(
            CUresult::ILLEGAL_STATE.to_string(),
            "CUDA_ERROR_ILLEGAL_STATE (401)"
        );
        assert_eq!(format!("{:?}", CUresult(7)), "CUresult(7)");
    }
}
