//! How the NVIDIA side carries a failure: [`criu_plugin::HookError`], whose [`Failure`] (errno,
//! kind, phase, message, cause) is one value until it is reported; and, for one process of a
//! batch, a [`CallError`]: the driver's answer or the plugin's own failure around it.
//!
//! A failure a hook returns is logged once, where the hook returns to CRIU. The exception is an
//! answer a batch records for one process of many: CRIU stops asking after the first process
//! that fails, so later answers might never be returned; those are logged when recorded
//! ([`Report::report`]).

use std::fmt::Display;

use criu_plugin::HookError;
pub use criu_plugin::{Failure, FailureKind};
use cuda_ckpt_sys::DriverError;

/// Why the work on one process of a batch did not succeed: the driver's answer, or a failure
/// of the plugin's own around the driver call (its helper process, a panic, the process's
/// state), each with the errno and kind it stands for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The driver refused or failed the call.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The plugin's code around the call panicked (contained; logged with its file and line
    /// where the hook returns).
    #[error("internal error while handling pid {pid}: {message}")]
    Panic {
        /// The process being handled.
        pid: i32,
        /// The panic's message.
        message: String,
    },
    /// The helper process, or its thread, that makes the call failed or gave no answer.
    #[error("{0}")]
    Helper(String),
    /// The process is not in the state the step leaves it in, or needs.
    #[error("{0}")]
    Process(String),
    /// A system call around the driver call failed with `errno`.
    #[error("{message}")]
    System {
        /// What failed, with the system's reason.
        message: String,
        /// Its errno (positive).
        errno: i32,
    },
}

impl CallError {
    /// A panic caught while handling `pid`, from its payload.
    pub fn panic(pid: i32, payload: &(dyn std::any::Any + Send)) -> CallError {
        CallError::Panic {
            pid,
            message: criu_plugin::error::panic_message(payload),
        }
    }

    /// The errno (positive) CRIU gets for it.
    pub fn errno(&self) -> i32 {
        match self {
            CallError::Driver(e) => e.errno(),
            CallError::Panic { .. } | CallError::Helper(_) => libc::EIO,
            CallError::Process(_) => libc::EINVAL,
            CallError::System { errno, .. } => *errno,
        }
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> FailureKind {
        match self {
            CallError::Driver(_) => FailureKind::Driver,
            CallError::Panic { .. } => FailureKind::Panic,
            CallError::Helper(_) => FailureKind::Helper,
            CallError::Process(_) => FailureKind::Process,
            CallError::System { .. } => FailureKind::System,
        }
    }

    /// The driver's answer, when the driver gave it.
    pub fn driver(&self) -> Option<&DriverError> {
        match self {
            CallError::Driver(e) => Some(e),
            _ => None,
        }
    }
}

/// An error below the hooks that a hook reports: the errno and kind it stands for are decided
/// once, by its type.
pub trait Cause: std::error::Error + Send + Sync + Sized + 'static {
    /// The errno (positive) CRIU gets for it.
    fn errno(&self) -> i32;
    /// What kind of failure it is.
    fn kind(&self) -> FailureKind;
    /// The failure a hook reports: `context`, then the error's message; the error is the cause.
    fn failure(self, context: impl Display) -> Failure {
        Failure::new(self.kind(), self.errno(), format!("{context}{self}")).caused_by(self)
    }
}

/// A call for `pid` that failed, with its errno and kind, the call's error as the cause.
pub fn call_failure(pid: i32, e: &CallError) -> Failure {
    Failure::new(e.kind(), e.errno(), format!("cuda: pid {pid}: {e}")).caused_by(e.clone())
}

/// A system call that failed with `e` (`EIO` when it carries no errno); `e`, message and all,
/// is the cause.
pub fn os_failure(e: &std::io::Error, message: impl Display) -> Failure {
    let cause = match e.raw_os_error() {
        Some(n) => std::io::Error::from_raw_os_error(n),
        None => std::io::Error::new(e.kind(), e.to_string()),
    };
    Failure::new(
        FailureKind::System,
        e.raw_os_error().unwrap_or(libc::EIO),
        message,
    )
    .caused_by(cause)
}

/// Logging a failure now, for answers recorded before any hook returns them.
pub trait Report {
    /// Logs the failure and turns it into CRIU's answer, already logged.
    fn report(self) -> HookError;
}

impl Report for Failure {
    fn report(self) -> HookError {
        log::error!("{}", self.log_line());
        HookError::Errno(self.errno)
    }
}
