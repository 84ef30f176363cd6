//! The image store: where the AMD backend's image files go, CRIU's images directory (or a
//! directory given to the backend for tests and tools), with the files written through the
//! image format ([`super::image`]) and within an optional quota.
//!
//! CRIU's directory is looked up at every use: it is a service fd, valid in CRIU's main
//! process and in every restored task, whereas a copy made before CRIU forks would be closed
//! in the tasks.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use criu_plugin::CriuSymbols;

use super::error::{Error, Result, device_error};
use super::image::{
    HEADER_LEN, ImageDir, ImageMessage, PagesLayout, PagesWriter, ReadLimits, encode_framed,
    kfd_file_id,
};

/// Which directory the store is.
pub enum StoreLocation {
    /// CRIU's (`criu_get_image_dir()`).
    Criu,
    /// A directory opened by the backend's owner.
    Owned(OwnedFd),
}

/// The images directory plus the limits for reading and an optional space quota.
pub struct ImageStore {
    location: StoreLocation,
    /// Limits for messages read back.
    pub limits: ReadLimits,
    /// Bytes still allowed to be written (`u64::MAX`: no quota). A quota simulates a full
    /// disk in tests.
    quota: AtomicU64,
}

impl ImageStore {
    /// The store at `location`, with an optional quota in bytes.
    pub fn new(location: StoreLocation, quota: Option<u64>) -> ImageStore {
        ImageStore {
            location,
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
        Ok(match &self.location {
            StoreLocation::Owned(fd) => fd.as_fd(),
            StoreLocation::Criu => {
                let raw = CriuSymbols::get().image_dir_fd().ok_or_else(|| {
                    device_error(libc::ENOENT, "CRIU did not provide an images directory")
                })?;
                // SAFETY: CRIU keeps its images directory service fd open for the whole run,
                // in its main process and in restored tasks
                // (criu_plugin::criu_internals::IMAGE_DIR_SERVICE_FD).
                unsafe { BorrowedFd::borrow_raw(raw) }
            }
        })
    }

    /// Calls `f` with the name of every entry of the directory (at most 2^20 entries).
    fn for_each_name(&self, mut f: impl FnMut(&str) -> Result<()>) -> Result<()> {
        let path = format!("/proc/self/fd/{}", self.dir_fd()?.as_raw_fd());
        let entries = std::fs::read_dir(&path)
            .map_err(|e| Error::io(&e, "cannot list the images directory"))?;
        for e in entries.take(1 << 20) {
            let e = e.map_err(|e| Error::io(&e, "cannot list the images directory"))?;
            if let Some(name) = e.file_name().to_str() {
                f(name)?;
            }
        }
        Ok(())
    }

    /// Ids of the `amdgpu-kfd-ID.img` files in the directory (at most `max`).
    pub fn kfd_ids(&self, max: usize) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        self.for_each_name(|name| {
            let Some(id) = kfd_file_id(name) else {
                return Ok(());
            };
            if ids.len() == max {
                return Err(device_error(
                    libc::E2BIG,
                    format!("more than {max} KFD images in the images directory"),
                ));
            }
            ids.push(id);
            Ok(())
        })?;
        ids.sort_unstable();
        Ok(ids)
    }

    /// Number of files whose name starts with `prefix` in the directory.
    pub fn count_prefix(&self, prefix: &str) -> Result<usize> {
        let mut n = 0;
        self.for_each_name(|name| {
            if name.starts_with(prefix) {
                n += 1;
            }
            Ok(())
        })?;
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
                return Err(device_error(
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

    /// Writes `msg` as the one message of file `name`, within the quota.
    pub fn write_message<T: ImageMessage>(&self, name: &str, msg: &T) -> Result<()> {
        let bytes = encode_framed(msg, name)?;
        self.charge(bytes.len() as u64, name)?;
        Ok(self.dir()?.write_framed(name, &bytes)?)
    }

    /// Creates `amdgpu-pages-ID-GPU.img`.
    pub fn create_pages(&self, id: u32, gpu_id: u32, layout: PagesLayout) -> Result<PagesOut<'_>> {
        let w = self.dir()?.create_kfd_pages(id, gpu_id, layout)?;
        self.charge(HEADER_LEN as u64, w.file_name())?;
        Ok(PagesOut {
            images: self,
            writer: w,
        })
    }
}

/// A pages file being written, with the quota applied.
pub struct PagesOut<'a> {
    images: &'a ImageStore,
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
