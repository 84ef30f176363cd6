//! The AMD backend's error: an errno for CRIU and a sentence for the user.

use std::fmt;
use std::io;

use super::image::ImageError;

/// A failure with the errno the hook returns and a message that says what failed and why.
#[derive(Debug)]
pub struct Error {
    /// Positive errno.
    pub errno: i32,
    /// What went wrong, most specific part last.
    pub msg: String,
}

impl Error {
    /// An error with `errno` and `msg`.
    pub fn new(errno: i32, msg: impl Into<String>) -> Error {
        Error {
            errno,
            msg: msg.into(),
        }
    }

    /// An I/O error with what was being done.
    pub fn io(e: &io::Error, what: impl fmt::Display) -> Error {
        Error {
            errno: errno_of(e),
            msg: format!("{what}: {e}"),
        }
    }

    /// Prefixes the message with what was being done.
    pub fn context(mut self, what: impl fmt::Display) -> Error {
        self.msg = format!("{what}: {}", self.msg);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

/// The errno of an I/O error; for errors made with a message, the one its kind stands for.
pub fn errno_of(e: &io::Error) -> i32 {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        io::ErrorKind::PermissionDenied => libc::EPERM,
        io::ErrorKind::NotFound => libc::ENOENT,
        io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData => libc::EINVAL,
        io::ErrorKind::OutOfMemory => libc::ENOMEM,
        io::ErrorKind::Unsupported => libc::EOPNOTSUPP,
        _ => libc::EIO,
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Error {
        Error {
            errno: errno_of(&e),
            msg: e.to_string(),
        }
    }
}

impl From<ImageError> for Error {
    fn from(e: ImageError) -> Error {
        Error {
            errno: e.errno(),
            msg: e.to_string(),
        }
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
