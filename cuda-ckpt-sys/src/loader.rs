//! The run-time loader: `dlopen` of the driver library, always by a path (a bare name is found
//! first by [`crate::library_search`]), and the table of its function pointers, resolved with
//! plain `dlsym`.
//!
//! With [`crate::ffi`] this is the crate's raw layer: a pointer in [`Functions`] is called in
//! `unsafe` code, under the rules of its C prototype. [`crate::Driver`] is the safe layer
//! over it.

use std::ffi::{CStr, CString, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::DriverError;
use crate::ffi::*;
use crate::library_search;

/// Function pointers resolved from the library; `None` where the library lacks the symbol.
#[derive(Clone, Copy, Default)]
pub struct Functions {
    /// `cuDriverGetVersion`.
    pub driver_get_version: Option<PFN_cuDriverGetVersion>,
    /// `cuGetErrorName`.
    pub get_error_name: Option<PFN_cuGetErrorString>,
    /// `cuGetErrorString`.
    pub get_error_string: Option<PFN_cuGetErrorString>,
    /// `cuInit`.
    pub init: Option<PFN_cuInit>,
    /// `cuDeviceGetCount`.
    pub device_get_count: Option<PFN_cuDeviceGetCount>,
    /// `cuDeviceGet`.
    pub device_get: Option<PFN_cuDeviceGet>,
    /// `cuDeviceGetUuid_v2`, else `cuDeviceGetUuid`.
    pub device_get_uuid: Option<PFN_cuDeviceGetUuid>,
    /// `cuDeviceGetName`.
    pub device_get_name: Option<PFN_cuDeviceGetName>,
    /// `cuDeviceTotalMem_v2`.
    pub device_total_mem: Option<PFN_cuDeviceTotalMem>,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    pub get_restore_thread_id: Option<PFN_cuCheckpointProcessGetRestoreThreadId>,
    /// `cuCheckpointProcessGetState`.
    pub get_state: Option<PFN_cuCheckpointProcessGetState>,
    /// `cuCheckpointProcessLock`.
    pub lock: Option<PFN_cuCheckpointProcessLock>,
    /// `cuCheckpointProcessCheckpoint`.
    pub checkpoint: Option<PFN_cuCheckpointProcessCheckpoint>,
    /// `cuCheckpointProcessRestore`.
    pub restore: Option<PFN_cuCheckpointProcessRestore>,
    /// `cuCheckpointProcessUnlock`.
    pub unlock: Option<PFN_cuCheckpointProcessUnlock>,
}

/// Looks up `$name` in `$handle` and reinterprets it as the function pointer type `$ty`.
/// Must be used inside `unsafe`: the caller vouches that `$ty` is the symbol's C prototype.
macro_rules! resolve {
    ($handle:expr, $name:literal, $ty:ty) => {{
        let p: *mut c_void = libc::dlsym($handle, concat!($name, "\0").as_ptr().cast::<c_char>());
        if p.is_null() {
            None
        } else {
            Some(std::mem::transmute::<*mut c_void, $ty>(p))
        }
    }};
}

/// Loads `name` and resolves every function: a name without `/` is first found by
/// [`library_search::find`] (absolute directories only), a path is opened as given. See
/// [`load_path`].
pub fn load(name: &str) -> Result<Functions, DriverError> {
    if name.contains('/') {
        return load_path(Path::new(name));
    }
    let path = library_search::find(name).map_err(|e| DriverError::Load {
        path: name.to_owned(),
        reason: e.to_string(),
    })?;
    load_path(&path)
}

/// `dlopen`s the file `path` with `RTLD_NOW | RTLD_LOCAL` and resolves every function. The
/// library is never `dlclose`d, so the pointers stay valid for the life of the process. A
/// `path` without `/` would make `dlopen` search, so it is refused: bare names go through
/// [`load`].
pub fn load_path(path: &Path) -> Result<Functions, DriverError> {
    let name = path.to_string_lossy();
    let refuse = |reason: &str| DriverError::Load {
        path: name.clone().into_owned(),
        reason: reason.into(),
    };
    let bytes = path.as_os_str().as_bytes();
    if !bytes.contains(&b'/') {
        return Err(refuse("not a path (a bare name is searched for by load)"));
    }
    let cname = CString::new(bytes).map_err(|_| refuse("path contains a NUL byte"))?;
    // SAFETY: `cname` is a valid NUL-terminated string. Loading runs the library's constructors;
    // that is the point of loading a driver and cannot be made safer from here.
    let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(DriverError::Load {
            path: name.into_owned(),
            reason: last_dl_error(),
        });
    }
    // SAFETY: `handle` is a live dlopen handle that is never closed, so the pointers stay valid
    // for the life of the process. Each type below is the C prototype of that symbol in
    // NVIDIA's cuda.h (see `ffi`), so calling through it is sound.
    let functions = unsafe {
        Functions {
            driver_get_version: resolve!(handle, "cuDriverGetVersion", PFN_cuDriverGetVersion),
            get_error_name: resolve!(handle, "cuGetErrorName", PFN_cuGetErrorString),
            get_error_string: resolve!(handle, "cuGetErrorString", PFN_cuGetErrorString),
            init: resolve!(handle, "cuInit", PFN_cuInit),
            device_get_count: resolve!(handle, "cuDeviceGetCount", PFN_cuDeviceGetCount),
            device_get: resolve!(handle, "cuDeviceGet", PFN_cuDeviceGet),
            device_get_uuid: resolve!(handle, "cuDeviceGetUuid_v2", PFN_cuDeviceGetUuid)
                .or_else(|| resolve!(handle, "cuDeviceGetUuid", PFN_cuDeviceGetUuid)),
            device_get_name: resolve!(handle, "cuDeviceGetName", PFN_cuDeviceGetName),
            device_total_mem: resolve!(handle, "cuDeviceTotalMem_v2", PFN_cuDeviceTotalMem),
            get_restore_thread_id: resolve!(
                handle,
                "cuCheckpointProcessGetRestoreThreadId",
                PFN_cuCheckpointProcessGetRestoreThreadId
            ),
            get_state: resolve!(
                handle,
                "cuCheckpointProcessGetState",
                PFN_cuCheckpointProcessGetState
            ),
            lock: resolve!(
                handle,
                "cuCheckpointProcessLock",
                PFN_cuCheckpointProcessLock
            ),
            checkpoint: resolve!(
                handle,
                "cuCheckpointProcessCheckpoint",
                PFN_cuCheckpointProcessCheckpoint
            ),
            restore: resolve!(
                handle,
                "cuCheckpointProcessRestore",
                PFN_cuCheckpointProcessRestore
            ),
            unlock: resolve!(
                handle,
                "cuCheckpointProcessUnlock",
                PFN_cuCheckpointProcessUnlock
            ),
        }
    };
    Ok(functions)
}

/// `dlerror()` as a String.
fn last_dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc (thread-local in glibc),
    // valid until the next dl* call on this thread; it is copied out at once.
    unsafe {
        let p = libc::dlerror();
        if p.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}
