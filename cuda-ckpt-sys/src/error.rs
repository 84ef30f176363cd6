//! Error types: a failed driver call ([`CudaError`]) and everything else that can go wrong between
//! the plugin and the driver ([`DriverError`]).

use std::fmt;

use crate::ffi::CUresult;

/// A driver call that returned something other than `CUDA_SUCCESS`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaError {
    /// The C function, e.g. `"cuCheckpointProcessLock"`.
    pub call: &'static str,
    /// The target process, for the `cuCheckpointProcess*` calls.
    pub pid: Option<i32>,
    /// What the driver returned.
    pub code: CUresult,
    /// `cuGetErrorName`, or this crate's own table when the driver has no name for it.
    pub name: Option<String>,
    /// `cuGetErrorString`, when the driver has one.
    pub text: Option<String>,
}

impl CudaError {
    /// The errno (positive) this failure is reported as; a hook makes it negative for CRIU.
    ///
    /// | CUDA code | errno | why |
    /// |---|---|---|
    /// | `NOT_READY`, `TIMEOUT` | `ETIMEDOUT` | lock timed out (work still running on the GPU) |
    /// | `ILLEGAL_STATE` | `EINVAL` | the process is in the wrong state for this step |
    /// | `INVALID_VALUE`, `INVALID_CONTEXT`, `INVALID_HANDLE` | `EINVAL` | bad argument, e.g. GPU map |
    /// | `OPERATING_SYSTEM` | `ESRCH` | mostly "no such process"; also permissions and a dead target |
    /// | `NOT_INITIALIZED`, `DEINITIALIZED`, `NO_DEVICE`, `INVALID_DEVICE` | `ENODEV` | no CUDA there |
    /// | `OUT_OF_MEMORY` | `ENOMEM` | not enough GPU or host memory |
    /// | `NOT_PERMITTED` | `EPERM` | e.g. persistence mode off |
    /// | `NOT_SUPPORTED`, `STREAM_CAPTURE_UNSUPPORTED` | `EOPNOTSUPP` | driver cannot checkpoint this |
    /// | `NOT_FOUND` | `ENOENT` | |
    /// | anything else | `EIO` | |
    pub fn errno(&self) -> i32 {
        cuda_errno(self.code)
    }

    /// The C name to print: the driver's, else this crate's, else a placeholder.
    pub fn display_name(&self) -> &str {
        self.name
            .as_deref()
            .or_else(|| self.code.static_name())
            .unwrap_or("unknown CUDA error")
    }
}

/// The errno (positive; 0 for success) for a CUDA code; see [`CudaError::errno`].
pub fn cuda_errno(code: CUresult) -> i32 {
    match code {
        CUresult::SUCCESS => 0,
        CUresult::NOT_READY | CUresult::TIMEOUT => libc::ETIMEDOUT,
        CUresult::ILLEGAL_STATE
        | CUresult::INVALID_VALUE
        | CUresult::INVALID_CONTEXT
        | CUresult::INVALID_HANDLE => libc::EINVAL,
        CUresult::OPERATING_SYSTEM => libc::ESRCH,
        CUresult::NOT_INITIALIZED
        | CUresult::DEINITIALIZED
        | CUresult::NO_DEVICE
        | CUresult::INVALID_DEVICE => libc::ENODEV,
        CUresult::OUT_OF_MEMORY => libc::ENOMEM,
        CUresult::NOT_PERMITTED => libc::EPERM,
        CUresult::NOT_SUPPORTED | CUresult::STREAM_CAPTURE_UNSUPPORTED => libc::EOPNOTSUPP,
        CUresult::NOT_FOUND => libc::ENOENT,
        _ => libc::EIO,
    }
}

impl fmt::Display for CudaError {
    /// `cuCheckpointProcessLock(pid 1234) failed: CUDA_ERROR_NOT_READY (600): device not ready`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.call)?;
        if let Some(pid) = self.pid {
            write!(f, "(pid {pid})")?;
        }
        write!(f, " failed: {} ({})", self.display_name(), self.code.0)?;
        if let Some(text) = &self.text {
            write!(f, ": {text}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CudaError {}

/// Anything that stops a [`crate::Driver`] operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverError {
    /// `dlopen` failed: no NVIDIA driver here (or a bad explicit path).
    Load {
        /// What was opened.
        path: String,
        /// `dlerror()`.
        reason: String,
    },
    /// The library lacks a function this operation needs (driver too old, or not libcuda).
    MissingSymbol(&'static str),
    /// The driver is older than the feature needs.
    Unsupported {
        /// The feature, e.g. `"GPU remapping on restore"`.
        what: &'static str,
        /// Minimum `cuDriverGetVersion` value.
        required: i32,
        /// What the driver reported.
        found: i32,
    },
    /// An argument this crate refuses before calling the driver.
    InvalidArgument(String),
    /// The driver returned an error.
    Cuda(CudaError),
}

impl DriverError {
    /// The errno (positive) it stands for. `Load` → `ENOENT`; `MissingSymbol`, `Unsupported`
    /// → `EOPNOTSUPP`; `InvalidArgument` → `EINVAL`; `Cuda` → [`CudaError::errno`].
    pub fn errno(&self) -> i32 {
        match self {
            Self::Load { .. } => libc::ENOENT,
            Self::MissingSymbol(_) | Self::Unsupported { .. } => libc::EOPNOTSUPP,
            Self::InvalidArgument(_) => libc::EINVAL,
            Self::Cuda(e) => e.errno(),
        }
    }

    /// The CUDA code, when the driver returned one.
    pub fn cuda_code(&self) -> Option<CUresult> {
        match self {
            Self::Cuda(e) => Some(e.code),
            _ => None,
        }
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Load { path, reason } => write!(f, "cannot load {path}: {reason}"),
            Self::MissingSymbol(name) => write!(f, "CUDA driver does not export {name}"),
            Self::Unsupported {
                what,
                required,
                found,
            } => write!(
                f,
                "{what} needs CUDA driver {} or newer, this driver is {}",
                crate::format_version(*required),
                crate::format_version(*found)
            ),
            Self::InvalidArgument(msg) => write!(f, "invalid argument: {msg}"),
            Self::Cuda(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl std::error::Error for DriverError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Cuda(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CudaError> for DriverError {
    fn from(value: CudaError) -> Self {
        Self::Cuda(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_includes_pid_name_code_text() {
        let e = CudaError {
            call: "cuCheckpointProcessLock",
            pid: Some(1234),
            code: CUresult::NOT_READY,
            name: Some("CUDA_ERROR_NOT_READY".into()),
            text: Some("device not ready".into()),
        };
        assert_eq!(
            e.to_string(),
            "cuCheckpointProcessLock(pid 1234) failed: CUDA_ERROR_NOT_READY (600): device not ready"
        );
        assert_eq!(e.errno(), libc::ETIMEDOUT);
        let bare = CudaError {
            call: "cuInit",
            pid: None,
            code: CUresult(4242),
            name: None,
            text: None,
        };
        assert_eq!(bare.to_string(), "cuInit failed: unknown CUDA error (4242)");
        assert_eq!(bare.errno(), libc::EIO);
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(cuda_errno(CUresult::SUCCESS), 0);
        assert_eq!(cuda_errno(CUresult::ILLEGAL_STATE), libc::EINVAL);
        assert_eq!(cuda_errno(CUresult::OPERATING_SYSTEM), libc::ESRCH);
        assert_eq!(cuda_errno(CUresult::NOT_INITIALIZED), libc::ENODEV);
        assert_eq!(cuda_errno(CUresult::OUT_OF_MEMORY), libc::ENOMEM);
        assert_eq!(cuda_errno(CUresult::NOT_SUPPORTED), libc::EOPNOTSUPP);
        assert_eq!(
            DriverError::MissingSymbol("cuCheckpointProcessLock").errno(),
            libc::EOPNOTSUPP
        );
        assert_eq!(
            DriverError::Unsupported {
                what: "GPU remapping on restore",
                required: 13000,
                found: 12080
            }
            .to_string(),
            "GPU remapping on restore needs CUDA driver 13.0 or newer, this driver is 12.8"
        );
    }
}
