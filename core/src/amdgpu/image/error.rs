//! [`ImageError`]: what went wrong with a plugin image file, the file named in every
//! message, and the errno a hook returns for it.

use std::fmt;
use std::io;

use criu_plugin::files;

use super::{FormatError, HEADER_LEN};

/// What went wrong while reading or writing a plugin image file.
///
/// Each message names the file. [`ImageError::errno`] gives the value to
/// return (negated) through the C hook ABI.
#[derive(Debug)]
#[non_exhaustive]
pub enum ImageError {
    /// The file name is not a plain name inside the images directory.
    InvalidName { name: String },
    /// A system call on the file failed.
    Io {
        file: String,
        action: &'static str,
        source: io::Error,
    },
    /// The name exists but is not a regular file.
    NotRegularFile { file: String },
    /// The file is too short to hold the size header.
    MissingHeader { file: String, len: u64 },
    /// The header declares more payload than the file holds.
    LengthExceedsFile {
        file: String,
        declared: u64,
        available: u64,
    },
    /// The header declares a message larger than [`ReadLimits`](super::ReadLimits) allows.
    LengthExceedsLimit {
        file: String,
        declared: u64,
        limit: usize,
    },
    /// prost could not decode the message.
    Decode {
        file: String,
        message: &'static str,
        source: prost::DecodeError,
    },
    /// The message decoded but breaks the format's rules.
    Format { file: String, error: FormatError },
    /// The size header of a KFD pages file differs from the sum of the sizes
    /// of the BOs it should hold.
    PagesSizeMismatch {
        file: String,
        header: u64,
        expected: u64,
    },
    /// The pages file ends before the end of a BO's contents.
    BoTruncated {
        file: String,
        bo: usize,
        size: u64,
        present: u64,
    },
    /// A chunk lies outside the BO it addresses.
    BoRange {
        file: String,
        bo: usize,
        offset: u64,
        len: u64,
        size: u64,
    },
    /// The BO index is not one whose contents this pages file holds.
    NoSuchBo { file: String, bo: usize },
    /// A pages file was finished with a byte count written for a BO that
    /// differs from the BO's size (missing or overlapping chunks).
    BoIncomplete {
        file: String,
        bo: usize,
        written: u64,
        size: u64,
    },
}

impl ImageError {
    /// Positive errno equivalent, for the `-errno` hook return convention.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Self::MissingHeader { .. }
            | Self::LengthExceedsFile { .. }
            | Self::BoTruncated { .. }
            | Self::BoIncomplete { .. } => libc::EIO,
            Self::LengthExceedsLimit { .. } => libc::EFBIG,
            _ => libc::EINVAL,
        }
    }

    /// True when the file does not exist (the restore hook probes for the
    /// KFD, render-node and dma-buf images in turn).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }

    /// Name of the file concerned.
    pub fn file(&self) -> &str {
        match self {
            Self::InvalidName { name: file }
            | Self::Io { file, .. }
            | Self::NotRegularFile { file }
            | Self::MissingHeader { file, .. }
            | Self::LengthExceedsFile { file, .. }
            | Self::LengthExceedsLimit { file, .. }
            | Self::Decode { file, .. }
            | Self::Format { file, .. }
            | Self::PagesSizeMismatch { file, .. }
            | Self::BoTruncated { file, .. }
            | Self::BoRange { file, .. }
            | Self::NoSuchBo { file, .. }
            | Self::BoIncomplete { file, .. } => file,
        }
    }
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidName { name } => write!(
                f,
                "image file name {name:?} is not a plain file name inside the images directory"
            ),
            Self::Io {
                file,
                action,
                source,
            } => write!(f, "could not {action} image file {file}: {source}"),
            Self::NotRegularFile { file } => {
                write!(f, "image file {file} is not a regular file")
            }
            Self::MissingHeader { file, len } => write!(
                f,
                "image file {file} is {len} bytes long, too short for its {HEADER_LEN}-byte size header"
            ),
            Self::LengthExceedsFile {
                file,
                declared,
                available,
            } => write!(
                f,
                "image file {file} declares a {declared}-byte payload but only {available} bytes follow its header"
            ),
            Self::LengthExceedsLimit {
                file,
                declared,
                limit,
            } => write!(
                f,
                "image file {file} declares a {declared}-byte message, over the {limit}-byte limit"
            ),
            Self::Decode {
                file,
                message,
                source,
            } => write!(
                f,
                "image file {file} does not hold a valid {message} message: {source}"
            ),
            Self::Format { file, error } => write!(f, "image file {file} is malformed: {error}"),
            Self::PagesSizeMismatch {
                file,
                header,
                expected,
            } => write!(
                f,
                "pages file {file} says it holds {header} bytes but its BOs add up to {expected}"
            ),
            Self::BoTruncated {
                file,
                bo,
                size,
                present,
            } => write!(
                f,
                "pages file {file} is truncated: BO {bo} needs {size} bytes but only {present} are present"
            ),
            Self::BoRange {
                file,
                bo,
                offset,
                len,
                size,
            } => write!(
                f,
                "chunk of {len} bytes at offset {offset} lies outside BO {bo} ({size} bytes) in pages file {file}"
            ),
            Self::NoSuchBo { file, bo } => {
                write!(f, "pages file {file} holds no contents for BO {bo}")
            }
            Self::BoIncomplete {
                file,
                bo,
                written,
                size,
            } => write!(
                f,
                "pages file {file} was finished with {written} bytes written for BO {bo}, which has {size}"
            ),
        }
    }
}

/// The underlying error is part of the message (so that a plain `{}` log line
/// carries the errno text) and is therefore not also returned as a source.
impl std::error::Error for ImageError {}

/// The image error for a failed open of `name`: a file that is not regular, or the I/O error.
pub(super) fn not_regular_or(name: &str, op: &'static str, e: io::Error) -> ImageError {
    if files::is_not_regular(&e) {
        ImageError::NotRegularFile {
            file: name.to_owned(),
        }
    } else {
        io_error(name, op, e)
    }
}

pub(crate) fn io_error(file: &str, action: &'static str, source: io::Error) -> ImageError {
    ImageError::Io {
        file: file.to_owned(),
        action,
        source,
    }
}
