//! A hook's failure as a value: the errno CRIU gets, what kind of failure it is, and the
//! sentence for CRIU's log, carried up to the hook and logged there once.
//!
//! Plugins build a [`Failure`] where they learn what went wrong and return it through
//! [`crate::HookError::Failed`]; the trampoline that returns to CRIU writes it to CRIU's log at
//! ERROR, with its kind, so that a failure is never logged twice (once where it happened and
//! again on every level it passes) nor lost.

use std::fmt;

/// What a failure is about, in the terms an operator sorts failures by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// A setting (file, environment or plugin option) with a bad value.
    Settings,
    /// An image that is missing, unreadable, damaged or hostile.
    Image,
    /// The GPU driver refused or failed a call.
    Driver,
    /// A device operation (ioctl, mapping, copy engine) failed.
    Device,
    /// The process is in a state that cannot be checkpointed or restored (stopped, busy,
    /// another CRIU at it).
    Process,
    /// This machine cannot take the checkpoint: driver too old, GPUs missing or of another
    /// model, too little memory.
    Machine,
    /// A system call failed.
    System,
    /// A bug of the plugin (a panic, a broken invariant).
    Internal,
}

impl FailureKind {
    /// The kind as one lower-case word, for log lines.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Settings => "settings",
            FailureKind::Image => "image",
            FailureKind::Driver => "driver",
            FailureKind::Device => "device",
            FailureKind::Process => "process",
            FailureKind::Machine => "machine",
            FailureKind::System => "system",
            FailureKind::Internal => "internal",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One failure, not yet logged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Positive errno for CRIU.
    pub errno: i32,
    /// What it is about.
    pub kind: FailureKind,
    /// What failed and why, most specific part last.
    pub message: String,
}

impl Failure {
    /// A failure of `kind` with `errno` (positive) and `message`.
    pub fn new(kind: FailureKind, errno: i32, message: impl fmt::Display) -> Failure {
        Failure {
            errno,
            kind,
            message: message.to_string(),
        }
    }

    /// A failed system call: its errno (`EIO` when it carries none) and what was being done.
    pub fn io(e: &std::io::Error, what: impl fmt::Display) -> Failure {
        Failure::new(FailureKind::System, errno_of(e), format!("{what}: {e}"))
    }

    /// Prefixes the message with what was being done.
    pub fn context(mut self, what: impl fmt::Display) -> Failure {
        self.message = format!("{what}: {}", self.message);
        self
    }

    /// The same failure as another kind.
    pub fn with_kind(mut self, kind: FailureKind) -> Failure {
        self.kind = kind;
        self
    }

    /// The line CRIU's log gets.
    pub fn log_line(&self) -> String {
        format!("{} [{}]", self.message, self.kind)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        Failure::new(FailureKind::System, errno_of(&e), e.to_string())
    }
}

/// The errno of an I/O error; for errors made with a message, the one its kind stands for.
pub fn errno_of(e: &std::io::Error) -> i32 {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        std::io::ErrorKind::PermissionDenied => libc::EPERM,
        std::io::ErrorKind::NotFound => libc::ENOENT,
        std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => libc::EINVAL,
        std::io::ErrorKind::OutOfMemory => libc::ENOMEM,
        std::io::ErrorKind::Unsupported => libc::EOPNOTSUPP,
        _ => libc::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_says_what_kind_it_is() {
        let f = Failure::new(FailureKind::Machine, libc::ENODEV, "no such GPU").context("restore");
        assert_eq!(f.log_line(), "restore: no such GPU [machine]");
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        let f = Failure::io(&io, "open x");
        assert_eq!((f.errno, f.kind), (libc::ENOENT, FailureKind::System));
        let custom = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad");
        assert_eq!(errno_of(&custom), libc::EINVAL);
    }
}
