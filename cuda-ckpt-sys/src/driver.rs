//! [`Driver`]: the crate's safe layer. Every call goes through the function table that
//! [`crate::loader`] resolved, with its arguments set up and its result turned into a
//! [`DriverError`].

use std::ffi::{CStr, c_char, c_int};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{CudaError, DriverError};
use crate::ffi::*;
use crate::loader::{self, Functions};
use crate::uuid::{GpuPair, GpuUuid};
use crate::{GPU_PAIRS_VERSION, MIN_CHECKPOINT_VERSION};

/// Result of a [`Driver`] operation.
pub type Result<T> = std::result::Result<T, DriverError>;

/// The soname [`Driver::open_default`] loads.
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// A process's checkpoint state, decoded from [`CUprocessState`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ProcessState {
    /// Normal operation.
    Running,
    /// CUDA API locked, GPU work drained.
    Locked,
    /// GPU state copied into host memory, GPU resources released.
    Checkpointed,
    /// A checkpoint or restore failed; the driver does not roll back.
    Failed,
    /// 13.4+: a custom-storage checkpoint waits for `cuCheckpointOperationComplete`.
    Checkpointing,
    /// 13.4+: a custom-storage restore waits for `cuCheckpointOperationComplete`.
    Restoring,
    /// A value this crate does not know (a newer driver).
    Unknown(u32),
}

impl From<CUprocessState> for ProcessState {
    fn from(value: CUprocessState) -> Self {
        match value {
            CUprocessState::RUNNING => Self::Running,
            CUprocessState::LOCKED => Self::Locked,
            CUprocessState::CHECKPOINTED => Self::Checkpointed,
            CUprocessState::FAILED => Self::Failed,
            CUprocessState::CHECKPOINTING => Self::Checkpointing,
            CUprocessState::RESTORING => Self::Restoring,
            CUprocessState(n) => Self::Unknown(n),
        }
    }
}

impl From<ProcessState> for CUprocessState {
    fn from(value: ProcessState) -> Self {
        match value {
            ProcessState::Running => Self::RUNNING,
            ProcessState::Locked => Self::LOCKED,
            ProcessState::Checkpointed => Self::CHECKPOINTED,
            ProcessState::Failed => Self::FAILED,
            ProcessState::Checkpointing => Self::CHECKPOINTING,
            ProcessState::Restoring => Self::RESTORING,
            ProcessState::Unknown(n) => Self(n),
        }
    }
}

impl fmt::Display for ProcessState {
    /// The words `cuda-checkpoint --get-state` prints (`running`, `locked`, ...).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Running => f.write_str("running"),
            Self::Locked => f.write_str("locked"),
            Self::Checkpointed => f.write_str("checkpointed"),
            Self::Failed => f.write_str("failed"),
            Self::Checkpointing => f.write_str("checkpointing"),
            Self::Restoring => f.write_str("restoring"),
            Self::Unknown(n) => write!(f, "unknown({n})"),
        }
    }
}

/// One GPU as the driver enumerates it (after `cuInit`, honouring `CUDA_VISIBLE_DEVICES`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA device ordinal.
    pub ordinal: i32,
    /// `cuDeviceGetUuid_v2`.
    pub uuid: GpuUuid,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceTotalMem_v2`, bytes.
    pub total_mem: u64,
}

/// `libcuda.so.1` (or a stand-in), loaded with `dlopen(RTLD_NOW | RTLD_LOCAL)`.
///
/// Holds only function pointers, so it is `Send + Sync`; the driver API itself is thread-safe. The
/// library is never `dlclose`d: a driver that has been initialised runs threads from its own code,
/// and unloading it under them would crash the process. Opening the same path again is cheap
/// (`dlopen` reference count).
#[derive(Clone)]
pub struct Driver {
    path: String,
    syms: Functions,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.path)
            .field("checkpoint_api", &self.has_checkpoint_api())
            .finish_non_exhaustive()
    }
}

/// Checks at compile time that [`Driver`] can be shared between threads.
const _: fn() = || {
    fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<Driver>();
};

impl Driver {
    /// Opens [`DEFAULT_LIBRARY`] as [`Driver::open_search`] finds it.
    pub fn open_default() -> Result<Self> {
        Self::open_search(DEFAULT_LIBRARY)
    }

    /// Opens library `name` (a file name without `/`, such as `libcuda.so.1`), found by
    /// [`crate::library_search::find`] over absolute directories only (`LD_LIBRARY_PATH`'s
    /// absolute entries, the loader cache, the system directories; never the working
    /// directory) and loaded by that absolute path. A name holding `/` is refused: it is a
    /// path, for [`Driver::open`]. Not found: [`DriverError::Load`] naming what was searched.
    pub fn open_search(name: &str) -> Result<Self> {
        if name.contains('/') || name.is_empty() {
            return Err(DriverError::Load {
                path: name.to_owned(),
                reason: "not a bare library name (a path goes to Driver::open)".into(),
            });
        }
        let path = crate::library_search::find(name).map_err(|e| DriverError::Load {
            path: name.to_owned(),
            reason: e.to_string(),
        })?;
        Self::open_path(&path)
    }

    /// Opens an explicit file, e.g. a stand-in driver for tests. A path containing `/` is
    /// opened as given; a bare name is taken as a file of the working directory, so a caller
    /// that must not load code from there uses [`Driver::open_search`] for bare names.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.as_os_str().as_bytes().contains(&b'/') {
            Self::open_path(path)
        } else {
            Self::open_path(&Path::new(".").join(path))
        }
    }

    fn open_path(path: &Path) -> Result<Self> {
        Ok(Self {
            path: path.to_string_lossy().into_owned(),
            syms: loader::load_path(path)?,
        })
    }

    /// The raw function table behind this driver, for calls this wrapper does not offer.
    pub fn functions(&self) -> &Functions {
        &self.syms
    }

    /// What was opened.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether all six `cuCheckpointProcess*` functions were found.
    pub fn has_checkpoint_api(&self) -> bool {
        let s = &self.syms;
        s.get_restore_thread_id.is_some()
            && s.get_state.is_some()
            && s.lock.is_some()
            && s.checkpoint.is_some()
            && s.restore.is_some()
            && s.unlock.is_some()
    }

    /// Checks that this driver can checkpoint processes: version at least
    /// [`MIN_CHECKPOINT_VERSION`] and all six functions exported. Returns the driver version.
    pub fn check_checkpoint_support(&self) -> Result<i32> {
        let version = self.driver_version()?;
        if version < MIN_CHECKPOINT_VERSION {
            return Err(DriverError::Unsupported {
                what: "the checkpoint API",
                required: MIN_CHECKPOINT_VERSION,
                found: version,
            });
        }
        let s = &self.syms;
        let needed = [
            (
                s.get_restore_thread_id.is_some(),
                "cuCheckpointProcessGetRestoreThreadId",
            ),
            (s.get_state.is_some(), "cuCheckpointProcessGetState"),
            (s.lock.is_some(), "cuCheckpointProcessLock"),
            (s.checkpoint.is_some(), "cuCheckpointProcessCheckpoint"),
            (s.restore.is_some(), "cuCheckpointProcessRestore"),
            (s.unlock.is_some(), "cuCheckpointProcessUnlock"),
        ];
        match needed.iter().find(|(present, _)| !present) {
            Some((_, name)) => Err(DriverError::MissingSymbol(name)),
            None => Ok(version),
        }
    }

    /// `cuGetErrorName` for `code`, if the driver knows it.
    pub fn error_name(&self, code: CUresult) -> Option<String> {
        error_text(self.syms.get_error_name, code)
    }

    /// `cuGetErrorString` for `code`, if the driver knows it.
    pub fn error_string(&self, code: CUresult) -> Option<String> {
        error_text(self.syms.get_error_string, code)
    }

    fn check(&self, rc: CUresult, call: &'static str, pid: Option<i32>) -> Result<()> {
        if rc.is_success() {
            return Ok(());
        }
        Err(DriverError::Cuda(CudaError {
            call,
            pid,
            code: rc,
            name: self
                .error_name(rc)
                .or_else(|| rc.static_name().map(str::to_owned)),
            text: self.error_string(rc),
        }))
    }

    /// `cuDriverGetVersion`: `1000 * major + 10 * minor` of the newest CUDA the driver supports
    /// (13000 for CUDA 13.0). Needs no `cuInit`.
    pub fn driver_version(&self) -> Result<i32> {
        let f = self
            .syms
            .driver_get_version
            .ok_or(DriverError::MissingSymbol("cuDriverGetVersion"))?;
        let mut version: c_int = 0;
        // SAFETY: `f` is cuDriverGetVersion; it writes one int through the valid pointer.
        let rc = unsafe { f(&mut version) };
        self.check(rc, "cuDriverGetVersion", None)?;
        Ok(version)
    }

    /// `cuInit(0)` in this process. The checkpoint calls do not need it, but restore "requires
    /// persistence mode to be enabled or cuInit to have been called", and device queries need it.
    pub fn init(&self) -> Result<()> {
        let f = self.syms.init.ok_or(DriverError::MissingSymbol("cuInit"))?;
        // SAFETY: `f` is cuInit; flags must be 0.
        let rc = unsafe { f(0) };
        self.check(rc, "cuInit", None)
    }

    /// `cuDeviceGetCount` (after [`Driver::init`]).
    pub fn device_count(&self) -> Result<i32> {
        let f = self
            .syms
            .device_get_count
            .ok_or(DriverError::MissingSymbol("cuDeviceGetCount"))?;
        let mut count: c_int = 0;
        // SAFETY: `f` is cuDeviceGetCount; it writes one int through the valid pointer.
        let rc = unsafe { f(&mut count) };
        self.check(rc, "cuDeviceGetCount", None)?;
        Ok(count)
    }

    /// Ordinal, UUID, name and memory size of one device (after [`Driver::init`]).
    pub fn device(&self, ordinal: i32) -> Result<DeviceInfo> {
        let get = self
            .syms
            .device_get
            .ok_or(DriverError::MissingSymbol("cuDeviceGet"))?;
        let get_uuid = self
            .syms
            .device_get_uuid
            .ok_or(DriverError::MissingSymbol("cuDeviceGetUuid_v2"))?;
        let get_name = self
            .syms
            .device_get_name
            .ok_or(DriverError::MissingSymbol("cuDeviceGetName"))?;
        let total_mem = self
            .syms
            .device_total_mem
            .ok_or(DriverError::MissingSymbol("cuDeviceTotalMem_v2"))?;

        let mut dev: CUdevice = 0;
        // SAFETY: `get` is cuDeviceGet; it writes one CUdevice through the valid pointer.
        let rc = unsafe { get(&mut dev, ordinal) };
        self.check(rc, "cuDeviceGet", None)?;

        let mut uuid = CUuuid::default();
        // SAFETY: `get_uuid` is cuDeviceGetUuid(_v2); it writes 16 bytes into `uuid`.
        let rc = unsafe { get_uuid(&mut uuid, dev) };
        self.check(rc, "cuDeviceGetUuid_v2", None)?;

        let mut name = [0 as c_char; 256];
        // SAFETY: `get_name` is cuDeviceGetName; it writes at most `len` bytes, NUL included, into
        // the buffer, whose length is passed.
        let rc = unsafe { get_name(name.as_mut_ptr(), name.len() as c_int, dev) };
        self.check(rc, "cuDeviceGetName", None)?;
        // Force termination in case a driver filled the whole buffer.
        name[name.len() - 1] = 0;
        // SAFETY: `name` is NUL-terminated (last byte set above) and outlives the borrow.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();

        let mut bytes: usize = 0;
        // SAFETY: `total_mem` is cuDeviceTotalMem_v2; it writes one size_t through the pointer.
        let rc = unsafe { total_mem(&mut bytes, dev) };
        self.check(rc, "cuDeviceTotalMem_v2", None)?;

        Ok(DeviceInfo {
            ordinal,
            uuid: uuid.into(),
            name,
            total_mem: bytes as u64,
        })
    }

    /// Calls `cuInit(0)` and describes every visible device.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>> {
        self.init()?;
        let count = self.device_count()?;
        (0..count).map(|ordinal| self.device(ordinal)).collect()
    }

    /// `cuCheckpointProcessGetState`. A process without CUDA gives `CUDA_ERROR_NOT_INITIALIZED`,
    /// a nonexistent one `CUDA_ERROR_OPERATING_SYSTEM`. Blocks while the target cannot run (the work
    /// is done by the target's restore thread).
    pub fn process_state(&self, pid: i32) -> Result<ProcessState> {
        let f = self
            .syms
            .get_state
            .ok_or(DriverError::MissingSymbol("cuCheckpointProcessGetState"))?;
        let mut state = CUprocessState::default();
        // SAFETY: `f` is cuCheckpointProcessGetState; it writes one CUprocessState through the
        // valid pointer.
        let rc = unsafe { f(pid, &mut state) };
        self.check(rc, "cuCheckpointProcessGetState", Some(pid))?;
        Ok(state.into())
    }

    /// `cuCheckpointProcessGetRestoreThreadId`: the TID of the target's CUDA restore thread (comm
    /// `cuda` + hex digits), which must be allowed to run for the other checkpoint calls to finish.
    /// Unlike them it answers while the target is stopped.
    pub fn restore_thread_id(&self, pid: i32) -> Result<i32> {
        let f = self
            .syms
            .get_restore_thread_id
            .ok_or(DriverError::MissingSymbol(
                "cuCheckpointProcessGetRestoreThreadId",
            ))?;
        let mut tid: c_int = 0;
        // SAFETY: `f` is cuCheckpointProcessGetRestoreThreadId; it writes one int through the
        // valid pointer.
        let rc = unsafe { f(pid, &mut tid) };
        self.check(rc, "cuCheckpointProcessGetRestoreThreadId", Some(pid))?;
        Ok(tid)
    }

    /// `cuCheckpointProcessLock`: RUNNING → LOCKED, once the GPU work already submitted is done.
    /// `timeout_ms == 0` waits forever; on timeout the driver returns `CUDA_ERROR_NOT_READY` and the
    /// process stays RUNNING. The timeout only counts while the target's restore thread runs: on a
    /// stopped target the call hangs.
    pub fn lock(&self, pid: i32, timeout_ms: u32) -> Result<()> {
        let f = self
            .syms
            .lock
            .ok_or(DriverError::MissingSymbol("cuCheckpointProcessLock"))?;
        let mut args = CUcheckpointLockArgs::with_timeout(timeout_ms);
        // SAFETY: `f` is cuCheckpointProcessLock; `args` is a valid, zero-reserved 64-byte struct
        // that lives across the call.
        let rc = unsafe { f(pid, &mut args) };
        self.check(rc, "cuCheckpointProcessLock", Some(pid))
    }

    /// `cuCheckpointProcessCheckpoint`: LOCKED → CHECKPOINTED (device memory into the target's
    /// host memory).
    pub fn checkpoint(&self, pid: i32) -> Result<()> {
        let f = self
            .syms
            .checkpoint
            .ok_or(DriverError::MissingSymbol("cuCheckpointProcessCheckpoint"))?;
        let mut args = CUcheckpointCheckpointArgs::zeroed();
        // SAFETY: `f` is cuCheckpointProcessCheckpoint; `args` is a valid all-zero 64-byte struct
        // (host-memory checkpoint) that lives across the call.
        let rc = unsafe { f(pid, &mut args) };
        self.check(rc, "cuCheckpointProcessCheckpoint", Some(pid))
    }

    /// `cuCheckpointProcessRestore`: CHECKPOINTED → LOCKED. With an empty `gpu_pairs` the
    /// process goes back onto the same GPUs (same type, order and count). A non-empty map must
    /// name every GPU the process was checkpointed on; it needs driver [`GPU_PAIRS_VERSION`] or
    /// newer, which is checked first.
    pub fn restore(&self, pid: i32, gpu_pairs: &[GpuPair]) -> Result<()> {
        let f = self
            .syms
            .restore
            .ok_or(DriverError::MissingSymbol("cuCheckpointProcessRestore"))?;
        let mut pairs: Vec<CUcheckpointGpuPair> = gpu_pairs.iter().map(|&p| p.into()).collect();
        let mut args = CUcheckpointRestoreArgs::zeroed();
        if !pairs.is_empty() {
            let version = self.driver_version()?;
            if version < GPU_PAIRS_VERSION {
                return Err(DriverError::Unsupported {
                    what: "GPU remapping on restore",
                    required: GPU_PAIRS_VERSION,
                    found: version,
                });
            }
            args.gpuPairsCount = u32::try_from(pairs.len())
                .map_err(|_| DriverError::InvalidArgument(format!("{} GPU pairs", pairs.len())))?;
            args.gpuPairs = pairs.as_mut_ptr();
        }
        // SAFETY: `f` is cuCheckpointProcessRestore; `args` is a valid 64-byte struct whose
        // `gpuPairs`, when set, points at `gpuPairsCount` initialised pairs in `pairs`, which
        // outlives the call.
        let rc = unsafe { f(pid, &mut args) };
        self.check(rc, "cuCheckpointProcessRestore", Some(pid))
    }

    /// `cuCheckpointProcessUnlock`: LOCKED → RUNNING.
    pub fn unlock(&self, pid: i32) -> Result<()> {
        let f = self
            .syms
            .unlock
            .ok_or(DriverError::MissingSymbol("cuCheckpointProcessUnlock"))?;
        let mut args = CUcheckpointUnlockArgs::zeroed();
        // SAFETY: `f` is cuCheckpointProcessUnlock; `args` is a valid all-zero 64-byte struct that
        // lives across the call.
        let rc = unsafe { f(pid, &mut args) };
        self.check(rc, "cuCheckpointProcessUnlock", Some(pid))
    }
}

/// Calls `cuGetErrorName`/`cuGetErrorString` and copies the static string out.
fn error_text(f: Option<PFN_cuGetErrorString>, code: CUresult) -> Option<String> {
    let f = f?;
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: `f` is cuGetErrorName or cuGetErrorString; it stores a pointer to a static string
    // (or NULL) through the valid out-pointer.
    let rc = unsafe { f(code, &mut p) };
    if !rc.is_success() || p.is_null() {
        return None;
    }
    // SAFETY: on success the driver returned a NUL-terminated string with static lifetime.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_value() {
        let err = Driver::open("/nonexistent/libcuda.so.1").unwrap_err();
        match &err {
            DriverError::Load { path, reason } => {
                assert_eq!(path, "/nonexistent/libcuda.so.1");
                assert!(!reason.is_empty());
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(err.errno(), libc::ENOENT);
    }

    #[test]
    fn a_search_name_is_never_a_path() {
        for bad in ["./libcuda.so.1", "lib/libcuda.so.1", "/x/libcuda.so.1", ""] {
            assert!(Driver::open_search(bad).is_err(), "{bad:?}");
        }
        // Found over absolute directories, opened by that absolute path.
        let libc = Driver::open_search("libc.so.6").expect("libc.so.6");
        assert!(libc.path().starts_with('/'), "{}", libc.path());
        let missing = Driver::open_search("libnot-a-driver.so.1").unwrap_err();
        match &missing {
            DriverError::Load { path, reason } => {
                assert_eq!(path, "libnot-a-driver.so.1");
                assert!(reason.contains("LD_LIBRARY_PATH"), "{reason}");
                assert!(reason.contains("never searched"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn library_without_cuda_symbols_reports_missing_symbol() {
        // libc is loaded in every process and exports none of the CUDA names.
        let driver = Driver::open_search("libc.so.6").expect("libc.so.6 loads");
        assert!(!driver.has_checkpoint_api());
        assert_eq!(
            driver.lock(1, 0),
            Err(DriverError::MissingSymbol("cuCheckpointProcessLock"))
        );
        assert_eq!(
            driver.driver_version(),
            Err(DriverError::MissingSymbol("cuDriverGetVersion"))
        );
        assert_eq!(
            driver.check_checkpoint_support(),
            Err(DriverError::MissingSymbol("cuDriverGetVersion"))
        );
        assert_eq!(driver.error_name(CUresult::NOT_READY), None);
    }

    #[test]
    fn state_round_trip() {
        for raw in 0..8u32 {
            let state = ProcessState::from(CUprocessState(raw));
            assert_eq!(CUprocessState::from(state), CUprocessState(raw));
        }
        assert_eq!(
            ProcessState::from(CUprocessState(7)),
            ProcessState::Unknown(7)
        );
        assert_eq!(ProcessState::Checkpointed.to_string(), "checkpointed");
    }
}
