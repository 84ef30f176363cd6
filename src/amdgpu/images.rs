//! Where the AMD backend's images go: CRIU's images directory (or a directory given to the
//! backend for tests and tools), through the image module.
//!
//! CRIU's directory is looked up at every use: it is a service fd, valid in CRIU's main
//! process and in every restored task, whereas a copy made before CRIU forks would be closed
//! in the tasks.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use criu_plugin::CriuSymbols;

use super::error::{Error, Result};
use super::image::{ImageDir, KfdCheckpoint, PagesLayout, PagesWriter, ReadLimits, encode_framed};

/// The images directory.
pub enum ImagesDir {
    /// CRIU's (`criu_get_image_dir()`).
    Criu,
    /// A directory opened by the backend's owner.
    Owned(OwnedFd),
}

/// The images directory plus the limits for reading and an optional space quota.
pub struct Images {
    dir: ImagesDir,
    /// Limits for messages read back.
    pub limits: ReadLimits,
    /// Bytes still allowed to be written (`u64::MAX`: no quota). A quota simulates a full
    /// disk in tests.
    quota: AtomicU64,
}

impl Images {
    /// Images in `dir`, with an optional quota in bytes.
    pub fn new(dir: ImagesDir, quota: Option<u64>) -> Images {
        Images {
            dir,
            limits: ReadLimits::default(),
            quota: AtomicU64::new(quota.unwrap_or(u64::MAX)),
        }
    }

    /// The directory, for the image module.
    pub fn dir(&self) -> Result<ImageDir<'_>> {
        Ok(ImageDir::new(self.dir_fd()?))
    }

    /// The directory's fd.
    pub fn dir_fd(&self) -> Result<BorrowedFd<'_>> {
        Ok(match &self.dir {
            ImagesDir::Owned(fd) => fd.as_fd(),
            ImagesDir::Criu => {
                let raw = CriuSymbols::get().image_dir_fd().ok_or_else(|| {
                    Error::new(libc::ENOENT, "CRIU did not provide an images directory")
                })?;
                // SAFETY: CRIU keeps its images directory service fd open for the whole run,
                // in its main process and in restored tasks.
                unsafe { BorrowedFd::borrow_raw(raw) }
            }
        })
    }

    /// Ids of the `amdgpu-kfd-ID.img` files in the directory (at most `max`).
    pub fn kfd_ids(&self, max: usize) -> Result<Vec<u32>> {
        let path = format!("/proc/self/fd/{}", self.dir_fd()?.as_raw_fd());
        let entries = std::fs::read_dir(&path)
            .map_err(|e| Error::io(&e, "cannot list the images directory"))?;
        let mut ids = Vec::new();
        for e in entries.take(1 << 20) {
            let e = e.map_err(|e| Error::io(&e, "cannot list the images directory"))?;
            let name = e.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_prefix("amdgpu-kfd-"))
                .and_then(|n| n.strip_suffix(".img"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if ids.len() == max {
                return Err(Error::new(
                    libc::E2BIG,
                    format!("more than {max} KFD images in the images directory"),
                ));
            }
            ids.push(id);
        }
        ids.sort_unstable();
        Ok(ids)
    }

    /// Number of files whose name starts with `prefix` in the directory.
    pub fn count_prefix(&self, prefix: &str) -> Result<usize> {
        let path = format!("/proc/self/fd/{}", self.dir_fd()?.as_raw_fd());
        let entries = std::fs::read_dir(&path)
            .map_err(|e| Error::io(&e, "cannot list the images directory"))?;
        let mut n = 0;
        for e in entries.take(1 << 20) {
            let e = e.map_err(|e| Error::io(&e, "cannot list the images directory"))?;
            if e.file_name()
                .to_str()
                .is_some_and(|s| s.starts_with(prefix))
            {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Accounts for `bytes` about to be written; `ENOSPC` when over the quota.
    pub fn charge(&self, bytes: u64, file: &str) -> Result<()> {
        let mut left = self.quota.load(Ordering::Relaxed);
        loop {
            if left == u64::MAX {
                return Ok(());
            }
            let Some(rest) = left.checked_sub(bytes) else {
                return Err(Error::new(
                    libc::ENOSPC,
                    format!("could not write image file {file}: No space left on device"),
                ));
            };
            match self
                .quota
                .compare_exchange(left, rest, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => left = now,
            }
        }
    }

    /// Writes `amdgpu-kfd-ID.img`.
    pub fn write_kfd(&self, id: u32, image: &KfdCheckpoint) -> Result<()> {
        let name = super::image::kfd_file_name(id);
        let len = encode_framed(image, &name)?.len() as u64;
        self.charge(len, &name)?;
        Ok(self.dir()?.write_kfd(id, image)?)
    }

    /// Creates `amdgpu-pages-ID-GPU.img`.
    pub fn create_pages(&self, id: u32, gpu_id: u32, layout: PagesLayout) -> Result<PagesOut<'_>> {
        let w = self.dir()?.create_kfd_pages(id, gpu_id, layout)?;
        self.charge(super::image::HEADER_LEN as u64, w.file_name())?;
        Ok(PagesOut {
            images: self,
            writer: w,
        })
    }
}

/// A pages file being written, with the quota applied.
pub struct PagesOut<'a> {
    images: &'a Images,
    writer: PagesWriter,
}

impl PagesOut<'_> {
    /// Writes a piece of BO `bo` at `offset`.
    pub fn write_chunk(&self, bo: usize, offset: u64, data: &[u8]) -> Result<()> {
        self.images
            .charge(data.len() as u64, self.writer.file_name())?;
        Ok(self.writer.write_chunk(bo, offset, data)?)
    }

    /// The file's layout.
    pub fn layout(&self) -> &PagesLayout {
        self.writer.layout()
    }

    /// Checks that every BO was written in full and closes the file.
    pub fn finish(self) -> Result<()> {
        Ok(self.writer.finish()?)
    }
}
