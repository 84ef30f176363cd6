//! Plain structs for the AMD image messages, and their conversion to and
//! from the prost types.
//!
//! Each image type has one `validate` routine, used both when converting
//! from the wire form (after reading) and to it (before writing), so the
//! format rules live in one place.

mod dmabuf;
mod kfd;
mod render_node;

use std::fmt;

pub use dmabuf::DmabufImage;
pub use kfd::{BoEntry, DeviceEntry, IoLink, KfdCheckpoint};
pub use render_node::{DrmBoEntry, DrmVmEntry, RenderNodeDrm, RenderNodeImage};

/// A message that decodes but breaks a rule of the format.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatError {
    /// A `required` field is absent.
    MissingField {
        message: &'static str,
        field: &'static str,
    },
    /// The wire data is not well-formed protobuf.
    Malformed {
        message: &'static str,
        detail: &'static str,
    },
    /// A stored count differs from the number of entries present.
    CountMismatch {
        message: &'static str,
        field: &'static str,
        declared: u64,
        actual: u64,
    },
    /// Any other rule.
    Invalid {
        message: &'static str,
        detail: String,
    },
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingField { message, field } => {
                write!(f, "required field {message}.{field} is missing")
            }
            Self::Malformed { message, detail } => {
                write!(f, "{message} is not valid protobuf ({detail})")
            }
            Self::CountMismatch {
                message,
                field,
                declared,
                actual,
            } => write!(
                f,
                "{message}.{field} says {declared} but {actual} entries are present"
            ),
            Self::Invalid { message, detail } => write!(f, "{message}: {detail}"),
        }
    }
}

impl std::error::Error for FormatError {}

pub(super) fn invalid(message: &'static str, detail: String) -> FormatError {
    FormatError::Invalid { message, detail }
}

pub(super) fn check_count(
    message: &'static str,
    field: &'static str,
    declared: u64,
    actual: usize,
) -> Result<(), FormatError> {
    let actual = actual as u64;
    if declared != actual {
        return Err(FormatError::CountMismatch {
            message,
            field,
            declared,
            actual,
        });
    }
    Ok(())
}

/// Converts an entry count to the width of the field that stores it.
pub(super) fn count_u32(
    message: &'static str,
    field: &'static str,
    n: usize,
) -> Result<u32, FormatError> {
    u32::try_from(n).map_err(|_| invalid(message, format!("{n} entries do not fit {field}")))
}
