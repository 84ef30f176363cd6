//! Streaming access to BO contents ("pages" files).
//!
//! A pages file is the usual size header followed by the contents of one or
//! more BOs back to back. [`PagesLayout`] says which BOs a file holds and where;
//! [`PagesWriter`] and [`PagesReader`] move chunks in and out at validated
//! positions with positional I/O (`pwrite`/`pread`), so they take `&self` and
//! several threads may share one (for example one thread per BO or per
//! range). Nothing here allocates in proportion to a BO's size: the caller
//! provides the buffers.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::model::{FormatError, KfdCheckpoint};
use super::{HEADER_LEN, ImageDir, ImageError, io_error};

/// Where one BO's contents lie in a pages file's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BoSpan {
    /// Index of the BO in its image (`KfdCheckpoint::bos` or
    /// `RenderNodeDrm::bos`).
    pub bo: usize,
    /// Byte offset in the payload (the file offset is `HEADER_LEN` more).
    pub offset: u64,
    /// Size of the BO in bytes.
    pub size: u64,
}

impl BoSpan {
    /// Splits the BO into `(offset_in_bo, len)` pieces of at most `chunk`
    /// bytes (a `chunk` of 0 is taken as 1), for use with
    /// [`PagesWriter::write_chunk`] and [`PagesReader::read_chunk`].
    pub fn chunks(&self, chunk: usize) -> impl Iterator<Item = (u64, usize)> + use<> {
        let chunk = chunk.max(1) as u64;
        let size = self.size;
        (0..size.div_ceil(chunk)).map(move |i| {
            let start = i * chunk;
            // At most `chunk`, which came from a usize.
            (start, (size - start).min(chunk) as usize)
        })
    }
}

/// The BOs a pages file holds, in file order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PagesLayout {
    spans: Vec<BoSpan>,
    total: u64,
}

impl PagesLayout {
    /// Layout of `amdgpu-pages-ID-GPU.img` for `gpu_id` (the user gpu_id):
    /// the BOs of that GPU with VRAM or GTT contents, in image order.
    pub fn for_kfd_gpu(image: &KfdCheckpoint, gpu_id: u32) -> Result<Self, FormatError> {
        Self::from_sizes(
            image
                .bos
                .iter()
                .enumerate()
                .filter(|(_, bo)| bo.gpu_id == gpu_id && bo.has_contents())
                .map(|(i, bo)| (i, bo.size)),
        )
    }

    /// Layout of BOs `(index, size)` stored back to back. Indices must be
    /// strictly increasing, and the total must fit the size header.
    pub fn from_sizes(bos: impl IntoIterator<Item = (usize, u64)>) -> Result<Self, FormatError> {
        let mut spans = Vec::new();
        let mut total = 0u64;
        for (bo, size) in bos {
            if spans.last().is_some_and(|s: &BoSpan| s.bo >= bo) {
                return Err(FormatError::Invalid {
                    message: "pages layout",
                    detail: format!("BO {bo} is out of order"),
                });
            }
            spans.push(BoSpan {
                bo,
                offset: total,
                size,
            });
            total = total
                .checked_add(size)
                .filter(|t| {
                    usize::try_from(*t).is_ok() && t.checked_add(HEADER_LEN as u64).is_some()
                })
                .ok_or_else(|| FormatError::Invalid {
                    message: "pages layout",
                    detail: format!("BO sizes add up past the limit of the size header at BO {bo}"),
                })?;
        }
        Ok(Self { spans, total })
    }

    /// Payload size: the sum of the BO sizes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The BOs in file order.
    pub fn spans(&self) -> &[BoSpan] {
        &self.spans
    }

    /// Position in [`Self::spans`] and span of BO `bo`.
    pub fn find(&self, bo: usize) -> Option<(usize, &BoSpan)> {
        let i = self.spans.binary_search_by_key(&bo, |s| s.bo).ok()?;
        Some((i, &self.spans[i]))
    }
}

/// Validates a chunk against its file's layout; returns the span position
/// and the absolute file offset.
fn locate(
    layout: &PagesLayout,
    file: &str,
    bo: usize,
    offset: u64,
    len: usize,
) -> Result<(usize, u64), ImageError> {
    let (i, span) = layout.find(bo).ok_or_else(|| ImageError::NoSuchBo {
        file: file.to_owned(),
        bo,
    })?;
    let len = len as u64;
    if offset.checked_add(len).is_none_or(|end| end > span.size) {
        return Err(ImageError::BoRange {
            file: file.to_owned(),
            bo,
            offset,
            len,
            size: span.size,
        });
    }
    // Cannot overflow: the layout checked HEADER_LEN + total.
    Ok((i, HEADER_LEN as u64 + span.offset + offset))
}

/// Writes BO contents into a new pages file.
///
/// The file is created with its header and its full length up front; chunks
/// may then be written in any order, from any number of threads
/// (`PagesWriter` is `Sync`). [`Self::finish`] checks that every byte of
/// every BO was written exactly once (by byte count).
#[derive(Debug)]
pub struct PagesWriter {
    file: File,
    name: String,
    layout: PagesLayout,
    written: Vec<AtomicU64>,
}

impl PagesWriter {
    pub(crate) fn create(
        dir: &ImageDir<'_>,
        name: String,
        layout: PagesLayout,
    ) -> Result<Self, ImageError> {
        let file = dir.create(&name)?;
        // PagesLayout guarantees the total fits a usize.
        let header = (layout.total as usize).to_ne_bytes();
        file.write_all_at(&header, 0)
            .map_err(|e| io_error(&name, "write", e))?;
        file.set_len(HEADER_LEN as u64 + layout.total)
            .map_err(|e| io_error(&name, "resize", e))?;
        let written = layout.spans.iter().map(|_| AtomicU64::new(0)).collect();
        Ok(Self {
            file,
            name,
            layout,
            written,
        })
    }

    /// Writes `data` at byte `offset` of BO `bo`.
    pub fn write_chunk(&self, bo: usize, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        let (i, at) = locate(&self.layout, &self.name, bo, offset, data.len())?;
        self.file
            .write_all_at(data, at)
            .map_err(|e| io_error(&self.name, "write", e))?;
        self.written[i].fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Checks that each BO received exactly its size in bytes, and closes
    /// the file.
    pub fn finish(self) -> Result<(), ImageError> {
        for (span, written) in self.layout.spans.iter().zip(&self.written) {
            let written = written.load(Ordering::Relaxed);
            if written != span.size {
                return Err(ImageError::BoIncomplete {
                    file: self.name,
                    bo: span.bo,
                    written,
                    size: span.size,
                });
            }
        }
        Ok(())
    }

    /// The file's layout.
    pub fn layout(&self) -> &PagesLayout {
        &self.layout
    }

    /// The file's name in the images directory.
    pub fn file_name(&self) -> &str {
        &self.name
    }
}

/// Reads BO contents from a pages file, chunk by chunk into caller buffers.
/// `Sync`: several threads may read different BOs or ranges at once.
#[derive(Debug)]
pub struct PagesReader {
    file: File,
    name: String,
    layout: PagesLayout,
}

impl PagesReader {
    pub(crate) fn open(
        dir: &ImageDir<'_>,
        name: String,
        layout: PagesLayout,
        check_header: bool,
    ) -> Result<Self, ImageError> {
        let file = dir.open_read(&name)?;
        let len = file
            .metadata()
            .map_err(|e| io_error(&name, "inspect", e))?
            .len();
        if len < HEADER_LEN as u64 {
            return Err(ImageError::MissingHeader { file: name, len });
        }
        let mut header = [0u8; HEADER_LEN];
        file.read_exact_at(&mut header, 0)
            .map_err(|e| io_error(&name, "read", e))?;
        let header = usize::from_ne_bytes(header) as u64;
        if check_header && header != layout.total {
            return Err(ImageError::PagesSizeMismatch {
                file: name,
                header,
                expected: layout.total,
            });
        }
        let available = len - HEADER_LEN as u64;
        if let Some(span) = layout.spans.iter().find(|s| s.offset + s.size > available) {
            return Err(ImageError::BoTruncated {
                file: name,
                bo: span.bo,
                size: span.size,
                present: available.saturating_sub(span.offset),
            });
        }
        if available > layout.total {
            log::warn!(
                "pages file {name} has {} bytes after the contents of its BOs; ignoring them",
                available - layout.total
            );
        }
        Ok(Self { file, name, layout })
    }

    /// Fills `buf` from byte `offset` of BO `bo`.
    pub fn read_chunk(&self, bo: usize, offset: u64, buf: &mut [u8]) -> Result<(), ImageError> {
        let (i, at) = locate(&self.layout, &self.name, bo, offset, buf.len())?;
        self.file.read_exact_at(buf, at).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                // The file shrank after it was opened.
                let span = self.layout.spans[i];
                let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
                ImageError::BoTruncated {
                    file: self.name.clone(),
                    bo,
                    size: span.size,
                    present: len.saturating_sub(HEADER_LEN as u64 + span.offset),
                }
            } else {
                io_error(&self.name, "read", e)
            }
        })
    }

    /// The file's layout.
    pub fn layout(&self) -> &PagesLayout {
        &self.layout
    }

    /// The file's name in the images directory.
    pub fn file_name(&self) -> &str {
        &self.name
    }
}
