//! The NVIDIA side's file in CRIU's image directory ([`metadata::FILE_NAME`]): opened relative
//! to CRIU's directory fd, read with a size bound, written unless CRIU streams its images.

use std::io::{Read, Write};
use std::os::fd::BorrowedFd;
use std::path::Path;

use criu_plugin::CriuSymbols;

use super::error::{Failure, FailureKind};
use super::metadata::{self, CudaMetadata};

/// CRIU's image directory, when CRIU gives one.
pub fn image_dir() -> Option<BorrowedFd<'static>> {
    CriuSymbols::get().image_dir()
}

/// Opens `name` in CRIU's image directory (relative to its fd; never a path from an image):
/// without blocking, never through a link, only a regular file.
fn open_image(name: &str, write: bool) -> std::io::Result<Option<std::fs::File>> {
    let Some(dir) = image_dir() else {
        return Ok(None);
    };
    if write {
        return criu_plugin::files::create_regular(dir, Path::new(name)).map(Some);
    }
    match criu_plugin::files::open_regular(Some(dir), Path::new(name), true) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The image's metadata; `None` when the image has none (CRIU's C plugin made it, or it holds
/// no CUDA process).
pub fn read_metadata() -> Result<Option<CudaMetadata>, Failure> {
    let mut f = match open_image(metadata::FILE_NAME, false) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(None),
        Err(e) => {
            return Err(Failure::new(
                FailureKind::Image,
                libc::EIO,
                format!("cannot open {}: {e}", metadata::FILE_NAME),
            ));
        }
    };
    let mut bytes = Vec::new();
    Read::by_ref(&mut f)
        .take(metadata::MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| {
            Failure::new(
                FailureKind::Image,
                libc::EIO,
                format!("cannot read {}: {e}", metadata::FILE_NAME),
            )
        })?;
    CudaMetadata::decode_bytes(&bytes)
        .map(Some)
        .map_err(|e| Failure::new(FailureKind::Image, libc::EINVAL, e.to_string()))
}

/// Writes the metadata `md` makes into the image directory.
pub fn write_metadata(md: impl FnOnce() -> CudaMetadata) -> std::io::Result<()> {
    // With `--stream` a file in the images directory would not be part of the stream.
    // The metadata is optional at restore (images of CRIU's C plugin have none), so the
    // checkpoint stays complete without it; only the early GPU checks are lost.
    if let Some(s) = criu_plugin::stream::image_stream() {
        log::info!(
            "cuda: CRIU streams its images ({s:?}); {} is not written, so restore skips the early GPU checks",
            metadata::FILE_NAME
        );
        return Ok(());
    }
    let md = md();
    match open_image(metadata::FILE_NAME, true)? {
        Some(mut f) => f.write_all(md.encode().as_bytes()),
        None => {
            log::warn!("cuda: CRIU gave no image directory; metadata not written");
            Ok(())
        }
    }
}
