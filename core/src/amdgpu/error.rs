//! The AMD side's failures: [`criu_plugin::Failure`] (errno for CRIU, a kind, a sentence for the
//! user), built here mostly from device operations and images.

use super::image::ImageError;

pub use criu_plugin::{Failure as Error, FailureKind};

/// A failed device operation (an ioctl, a mapping, the copy engine) with `errno` and `msg`.
pub fn device_error(errno: i32, msg: impl std::fmt::Display) -> Error {
    Error::new(FailureKind::Device, errno, msg)
}

impl From<ImageError> for Error {
    fn from(e: ImageError) -> Error {
        Error::new(FailureKind::Image, e.errno(), e)
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
