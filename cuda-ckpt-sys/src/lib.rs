//! The CUDA driver's process-checkpoint API (`cuCheckpointProcess*`), loaded at run time.
//!
//! # Two layers
//! - The raw layer, what the `-sys` name promises: [`ffi`] (the C types, constants and
//!   function-pointer types of `cuda.h`) and [`loader`] (the run-time `dlopen` and the table of
//!   resolved function pointers). Calling through it is `unsafe`, under the C rules.
//! - The safe layer over it: [`Driver`], one method per driver call, with [`ProcessState`],
//!   [`GpuUuid`]/[`GpuPair`] and the errors ([`DriverError`], [`CudaError`]). The plugin uses
//!   only this layer.
//!
//! # What is loaded
//! [`Driver::open_default`] `dlopen`s `libcuda.so.1` (the soname NVIDIA's own `cuda-checkpoint`
//! links against) with `RTLD_NOW | RTLD_LOCAL`, by the absolute path [`library_search`] finds
//! (never a name the loader would search for itself: an empty `LD_LIBRARY_PATH` entry would
//! make it look in the working directory); [`Driver::open`] takes an explicit path instead, so
//! the plugin can be pointed at a stand-in driver in tests. Symbols are found with plain `dlsym`
//! (the checkpoint functions are exported under their plain names; no `_v2` variants exist):
//!
//! - `cuDriverGetVersion`, `cuGetErrorName`, `cuGetErrorString` (usable before `cuInit`);
//! - `cuInit`, `cuDeviceGetCount`, `cuDeviceGet`, `cuDeviceGetUuid_v2` (else `cuDeviceGetUuid`),
//!   `cuDeviceGetName`, `cuDeviceTotalMem_v2` (device inventory for GPU remapping);
//! - `cuCheckpointProcessGetRestoreThreadId`, `...GetState`, `...Lock`, `...Checkpoint`,
//!   `...Restore`, `...Unlock`.
//!
//! A symbol that is missing is not fatal at load time: the operation that needs it returns
//! [`DriverError::MissingSymbol`].
//!
//! # Why at run time
//! The plugin must load into CRIU on machines without an NVIDIA driver (AMD-only hosts, CI). Linking
//! against `libcuda.so.1` would make CRIU fail to load the plugin there; `dlopen` failing is just
//! "no NVIDIA here" ([`DriverError::Load`]).
//!
//! # Versions
//! `cuDriverGetVersion` reports `1000 * major + 10 * minor`:
//! - [`MIN_CHECKPOINT_VERSION`] = 12080 (CUDA 12.8, driver branch r570): first release with the
//!   `cuCheckpointProcess*` functions in the driver API. Older drivers are treated as unsupported
//!   even if they happen to export the names ([`Driver::check_checkpoint_support`]).
//! - [`GPU_PAIRS_VERSION`] = 13000 (CUDA 13.0, r580): `CUcheckpointRestoreArgs` gained
//!   `gpuPairs`/`gpuPairsCount` (restore onto different GPUs). [`Driver::restore`] refuses a
//!   non-empty GPU map on older drivers rather than pass fields those drivers treat as reserved.
//! - [`CUSTOM_STORAGE_VERSION`] = 13040 (CUDA 13.4): custom-storage checkpoints and the states
//!   `CHECKPOINTING`/`RESTORING`; not used here, but the states decode.
//!
//! # How the driver works (what callers must respect)
//! The work of lock/checkpoint/restore is done inside the *target* process by libcuda's restore
//! thread (comm `cuda` followed by hex digits; [`Driver::restore_thread_id`]). A target whose
//! threads are all stopped makes these calls block, so a ptrace-based caller such as CRIU must let
//! that one thread run around each call. State machine:
//! `RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING`;
//! a wrong transition gives `CUDA_ERROR_ILLEGAL_STATE`; a lock timeout gives
//! `CUDA_ERROR_NOT_READY` and leaves the process running.
//!
//! Seen with this crate on driver 580.159.04 (H200): `cuInit` alone already starts the restore
//! thread (comm `cuda00001400006`; a context adds `cuda-EvtHandlr`, which is not it), so a process
//! that only called `cuInit` (the plugin's own, too) is a target in state RUNNING.
//! `GetRestoreThreadId` answers for a SIGSTOPped target while `GetState` and `Lock` hang there; a
//! lock abandoned that way has no effect after SIGCONT. A TID is accepted as the pid. A non-zero
//! reserved field gives `CUDA_ERROR_INVALID_VALUE`. A live process without CUDA gives
//! `CUDA_ERROR_NOT_INITIALIZED`, a nonexistent pid `CUDA_ERROR_OPERATING_SYSTEM`. A GPU map naming an
//! unknown old or new GPU gives `CUDA_ERROR_INVALID_VALUE` and leaves the process CHECKPOINTED.
//! Timings for 1 GiB: checkpoint 1.8 s, restore 0.56 s, the other calls under 1.5 ms.

pub mod error;
pub mod ffi;
pub mod library_search;
pub mod loader;

mod driver;
mod uuid;

pub use driver::{DEFAULT_LIBRARY, DeviceInfo, Driver, ProcessState, Result};
pub use error::{CudaError, DriverError, cuda_errno};
pub use ffi::{CUprocessState, CUresult};
pub use uuid::{GpuPair, GpuUuid, ParseUuidError};

/// First driver version (CUDA 12.8) with the `cuCheckpointProcess*` driver API.
pub const MIN_CHECKPOINT_VERSION: i32 = 12080;
/// First driver version (CUDA 13.0) that accepts GPU pairs on restore.
pub const GPU_PAIRS_VERSION: i32 = 13000;
/// First driver version (CUDA 13.4) with custom-storage checkpoints and states 4 and 5.
pub const CUSTOM_STORAGE_VERSION: i32 = 13040;

/// `13000` → `"13.0"`, `12080` → `"12.8"` (the patch digit, when not zero, is appended).
pub fn format_version(version: i32) -> String {
    // No CUDA release is numbered like this: show the raw number rather than a made-up one.
    if !(1000..1_000_000).contains(&version) {
        return format!("version number {version}");
    }
    let major = version / 1000;
    let minor = (version % 1000) / 10;
    let patch = version % 10;
    if patch == 0 {
        format!("{major}.{minor}")
    } else {
        format!("{major}.{minor}.{patch}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn versions_format() {
        assert_eq!(super::format_version(12080), "12.8");
        assert_eq!(super::format_version(13000), "13.0");
        assert_eq!(super::format_version(13040), "13.4");
        assert_eq!(super::format_version(12035), "12.3.5");
        assert_eq!(super::format_version(i32::MAX), "version number 2147483647");
        assert_eq!(super::format_version(-1), "version number -1");
    }
}
