//! How the NVIDIA side carries a failure: [`criu_plugin::Failure`] (errno, kind, message), one
//! value until it is reported.
//!
//! A failure a hook returns is logged once, where the hook returns to CRIU. The exception is an
//! answer a batch records for one process of many: CRIU stops asking after the first process
//! that fails, so later answers might never be returned; those are logged when recorded
//! ([`Report::report`]).

use std::fmt::Display;

use criu_plugin::HookError;
pub use criu_plugin::{Failure, FailureKind};
use cuda_ckpt_sys::DriverError;

/// A driver call for `pid` that failed, with the driver's errno.
pub fn driver_failure(pid: i32, e: &DriverError) -> Failure {
    Failure::new(
        FailureKind::Driver,
        -e.errno(),
        format!("cuda: pid {pid}: {e}"),
    )
}

/// A system call that failed with `e` (`EIO` when it carries no errno).
pub fn os_failure(e: &std::io::Error, message: impl Display) -> Failure {
    Failure::new(
        FailureKind::System,
        e.raw_os_error().unwrap_or(libc::EIO),
        message,
    )
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

impl From<HookFailure> for HookError {
    fn from(f: HookFailure) -> Self {
        match f {
            HookFailure::NotMine => HookError::NotMine,
            HookFailure::Failed(f) => f.into(),
        }
    }
}
