//! GPU memory sizes from NVML (`libnvidia-ml.so.1`), loaded at run time.
//!
//! NVML answers "how much memory does this GPU have, and how much is free" without a CUDA
//! context, which CRIU's process must not create. The plugin initialises NVML, asks, and shuts
//! it down again within one call, so no NVML state (open device files) is left in CRIU's process
//! when restore forks the tasks. Without NVML the memory figures are unknown (0) and the
//! free-memory check is skipped, with a log line saying so.

use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::os::unix::ffi::OsStrExt;

use cuda_ckpt_sys::{GpuUuid, library_search};

use super::library::{Library, LibraryError, library};

/// `nvmlMemory_t` (v1): bytes.
#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// Total and free memory of one GPU, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuMemory {
    /// Total memory.
    pub total: u64,
    /// Memory not in use.
    pub free: u64,
}

type InitFn = unsafe extern "C" fn() -> c_int;
type HandleByUuidFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
type MemoryInfoFn = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_int;

/// Why NVML could not answer.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    /// The setting names a library that may not be loaded.
    #[error(transparent)]
    Library(#[from] LibraryError),
    /// A bare name found nowhere.
    #[error(transparent)]
    NotFound(#[from] library_search::NotFound),
    /// A path with a NUL byte.
    #[error("NVML path contains NUL")]
    Nul,
    /// `dlopen` failed.
    #[error("{0} cannot be loaded")]
    Load(String),
    /// Not NVML, or too old.
    #[error("{0} lacks the functions needed")]
    Symbols(String),
    /// `nvmlInit_v2` failed.
    #[error("nvmlInit_v2 failed with NVML error {0}")]
    Init(c_int),
}

/// The image's processes need more GPU memory than the target GPUs have free.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "too little free GPU memory: the image's processes held about {} MiB, the {gpus} target GPU(s) have {} MiB free",
    need >> 20,
    free >> 20
)]
pub struct TooLittleMemory {
    /// What the checkpoint moved out of the GPUs, in bytes.
    pub need: u64,
    /// What the target GPUs have free, in bytes.
    pub free: u64,
    /// How many target GPUs.
    pub gpus: usize,
}

/// Asks NVML (library `lib`, e.g. `libnvidia-ml.so.1`) for the memory of each GPU in `uuids`.
/// Errors say why NVML could not answer; GPUs NVML does not know are left out of the map.
pub fn query_memory(
    lib: &str,
    uuids: &[GpuUuid],
) -> Result<BTreeMap<GpuUuid, GpuMemory>, NvmlError> {
    // Never a file of the working directory (the image directory) nor a FIFO: a bare name is
    // found over absolute directories only and opened by that path.
    let path = match library(lib)? {
        Library::Search(name) => library_search::find(name)?,
        Library::File(path) => path.to_path_buf(),
    };
    let name = CString::new(path.as_os_str().as_bytes()).map_err(|_| NvmlError::Nul)?;
    // SAFETY: dlopen of a NUL-terminated absolute path; the library's constructors run, as for
    // any user of NVML. The handle is never closed (NVML does not support being unloaded and
    // reloaded).
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(NvmlError::Load(path.display().to_string()));
    }
    let sym = |n: &std::ffi::CStr| {
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let p = unsafe { libc::dlsym(h, n.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let (Some(init), Some(shutdown), Some(by_uuid), Some(meminfo)) = (
        sym(c"nvmlInit_v2"),
        sym(c"nvmlShutdown"),
        sym(c"nvmlDeviceGetHandleByUUID"),
        sym(c"nvmlDeviceGetMemoryInfo"),
    ) else {
        return Err(NvmlError::Symbols(lib.to_string()));
    };
    // SAFETY: these are NVML's documented C signatures for the symbols just resolved.
    let (init, shutdown, by_uuid, meminfo) = unsafe {
        (
            std::mem::transmute::<*mut c_void, InitFn>(init),
            std::mem::transmute::<*mut c_void, InitFn>(shutdown),
            std::mem::transmute::<*mut c_void, HandleByUuidFn>(by_uuid),
            std::mem::transmute::<*mut c_void, MemoryInfoFn>(meminfo),
        )
    };
    // SAFETY: nvmlInit_v2 takes no arguments.
    let rc = unsafe { init() };
    if rc != 0 {
        return Err(NvmlError::Init(rc));
    }
    let mut out = BTreeMap::new();
    for u in uuids {
        let Ok(text) = CString::new(u.to_string()) else {
            continue;
        };
        let mut dev: *mut c_void = std::ptr::null_mut();
        // SAFETY: a NUL-terminated UUID string and a valid out pointer.
        if unsafe { by_uuid(text.as_ptr(), &mut dev) } != 0 {
            continue;
        }
        let mut m = NvmlMemory::default();
        // SAFETY: `dev` is a handle NVML just returned; `m` is a valid nvmlMemory_t.
        if unsafe { meminfo(dev, &mut m) } == 0 {
            out.insert(
                *u,
                GpuMemory {
                    total: m.total,
                    free: m.free,
                },
            );
        }
    }
    // SAFETY: balances the successful nvmlInit_v2 above.
    unsafe { shutdown() };
    Ok(out)
}

/// Refuses a restore whose processes need more GPU memory than the target GPUs have free.
/// `need` is what the checkpoint moved out of the GPUs.
pub fn check_free_memory(need: u64, free: u64, gpus: usize) -> Result<(), TooLittleMemory> {
    if need > free {
        return Err(TooLittleMemory { need, free, gpus });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_memory_check() {
        assert!(check_free_memory(8 << 30, 80 << 30, 1).is_ok());
        let e = check_free_memory(9 << 30, 8 << 30, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("9216 MiB") && e.contains("8192 MiB free"), "{e}");
    }

    #[test]
    fn missing_library_is_an_error_not_a_crash() {
        let e = query_memory("/nonexistent/libnvidia-ml.so.1", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be loaded"));
        // A bare name found nowhere says where it was looked for.
        let e = query_memory("libnot-nvml-here.so.1", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("libnot-nvml-here.so.1 not found in LD_LIBRARY_PATH"),
            "{e}"
        );
        assert!(e.contains(library_search::LOADER_CACHE), "{e}");
    }
}
