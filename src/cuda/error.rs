//! How the NVIDIA side carries a failure: the log line and the errno CRIU gets, together.
//!
//! A failure is a value until it is reported, and [`Failure::report`] logs it exactly once: at
//! the hook that returns it, or, for an answer a batch records for a process (CRIU stops asking
//! after the first process that fails, so later answers might never be returned), when the
//! batch records it.

use std::fmt::Display;

use criu_plugin::HookError;
use cuda_ckpt_sys::DriverError;

/// One failure, not yet logged.
#[derive(Debug)]
#[must_use = "a failure is logged only by `report`"]
pub struct Failure {
    /// Positive errno for CRIU.
    errno: i32,
    /// The log line, as it is written.
    message: String,
}

impl Failure {
    /// A failure with `errno` (positive) and the line to log.
    pub fn new(errno: i32, message: impl Display) -> Failure {
        Failure {
            errno,
            message: message.to_string(),
        }
    }

    /// A driver call for `pid` that failed, with the driver's errno.
    pub fn driver(pid: i32, e: &DriverError) -> Failure {
        Failure::new(-e.errno(), format!("cuda: pid {pid}: {e}"))
    }

    /// A system call that failed with `e` (`EIO` when it carries no errno).
    pub fn os(e: &std::io::Error, message: impl Display) -> Failure {
        Failure::new(e.raw_os_error().unwrap_or(libc::EIO), message)
    }

    /// Logs the failure and turns it into CRIU's answer.
    pub fn report(self) -> HookError {
        log::error!("{}", self.message);
        HookError::Errno(self.errno)
    }
}

/// Why a hook that can also decline did not succeed.
#[derive(Debug)]
pub enum HookFailure {
    /// Not this backend's process: CRIU asks the next plugin.
    NotMine,
    /// A failure, not yet logged.
    Failed(Failure),
}

impl From<Failure> for HookFailure {
    fn from(f: Failure) -> Self {
        HookFailure::Failed(f)
    }
}

impl HookFailure {
    /// CRIU's answer; a failure is logged on the way.
    pub fn report(self) -> HookError {
        match self {
            HookFailure::NotMine => HookError::NotMine,
            HookFailure::Failed(f) => f.report(),
        }
    }
}
