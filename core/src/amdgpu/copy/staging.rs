//! Staging memory of the copy threads: page-aligned anonymous mappings a device can
//! register (userptr), kept mapped for good when a device may still write them.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::{Advice, MmapMut, MmapOptions};

/// The CPU page size (staging mappings are whole pages, so the GPU can register them).
pub fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(n)
            .ok()
            .filter(|&n| n >= 4096)
            .unwrap_or(4096)
    })
}

/// Where the data starts in a staging allocation. Pages files put BO bytes 8 bytes into
/// every page (their size header), while BOs and memory are page aligned; a page-aligned
/// staging buffer then sits 8 bytes from one side of each CPU copy in the low 12 address
/// bits, and loads alias stores (4 KiB aliasing): measured 40 % slower on the dump path.
/// Half a page away from both sides, neither copy aliases.
const STAGING_DATA_OFFSET: usize = 2048;

/// A copy thread's whole staging allocation: page aligned and a whole number of pages, so
/// that a device can register it (userptr). The thread's pieces lie inside it.
///
/// Only `run` makes regions, one per thread, over memory that stays mapped until the
/// thread's lane is dropped (and for good once [`StagingRegion::keep_after_use`] is called).
#[derive(Debug)]
pub struct StagingRegion {
    base: *mut u8,
    pub(super) len: usize,
    keep: Arc<AtomicBool>,
}

impl StagingRegion {
    /// A region over page-aligned memory the caller owns and keeps mapped while a lane uses
    /// it (the SDMA engine's tests, on the simulator and in this crate).
    pub fn over_caller_memory(base: *mut u8, len: usize) -> Self {
        StagingRegion {
            base,
            len,
            keep: Arc::new(AtomicBool::new(false)),
        }
    }

    /// First byte.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length in bytes (a multiple of the page size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: it holds at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Never unmaps this memory: a device may still write it after its user gave up (a GPU
    /// copy whose completion was not seen). The pages are leaked, with a warning in the log.
    pub fn keep_after_use(&self) {
        self.keep.store(true, Ordering::SeqCst);
    }

    /// Whether [`StagingRegion::keep_after_use`] was called.
    pub fn kept(&self) -> bool {
        self.keep.load(Ordering::SeqCst)
    }
}

/// A staging buffer: an anonymous mapping of its own, page aligned and zero-filled.
///
/// Not heap memory: a device may write into it (a userptr registration). It is unmapped when
/// dropped, so no later allocation of this process gets these pages; when a device may still
/// be writing them (a GPU copy whose completion was not seen: the lane has already closed its
/// registration, after which nothing makes the kernel wait for the copy before the pages are
/// freed), the lane marks it kept and it is never unmapped. Not inherited by children, so a
/// fork of CRIU's during a copy neither copies nor waits on these pages.
pub(super) struct Staging {
    /// The mapping; taken (and leaked) on drop when kept.
    map: Option<MmapMut>,
    /// Usable bytes after `STAGING_DATA_OFFSET`.
    len: usize,
    /// Bytes mapped.
    mapped: usize,
    /// Set by [`StagingRegion::keep_after_use`]: leak instead of unmapping.
    keep: Arc<AtomicBool>,
}

impl Staging {
    pub(super) fn new(len: usize) -> io::Result<Staging> {
        let mapped = len
            .max(1)
            .checked_add(STAGING_DATA_OFFSET)
            .and_then(|n| n.checked_next_multiple_of(page_size()))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        // A private anonymous mapping (zero-filled, page aligned) of exactly `mapped` bytes.
        let map = MmapOptions::new().len(mapped).map_anon()?;
        // Failure only means children would inherit it, which is harmless for correctness.
        let _ = map.advise(Advice::DontFork);
        Ok(Staging {
            map: Some(map),
            len,
            mapped,
            keep: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The first byte, for the device (which writes through it: hence `mut`).
    fn base(&self) -> *mut u8 {
        self.map
            .as_ref()
            .map_or(std::ptr::null_mut(), |m| m.as_ptr().cast_mut())
    }

    pub(super) fn region(&self) -> StagingRegion {
        StagingRegion {
            base: self.base(),
            len: self.mapped,
            keep: Arc::clone(&self.keep),
        }
    }

    pub(super) fn slice(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.len, "piece larger than its staging buffer");
        let map = self.map.as_mut().expect("mapped until dropped");
        &mut map[STAGING_DATA_OFFSET..STAGING_DATA_OFFSET + len]
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.keep.load(Ordering::SeqCst) {
            log::warn!(
                "amdgpu: {} bytes of staging memory at {:p} stay mapped: a GPU copy that did not complete may still write them",
                self.mapped,
                self.base()
            );
            std::mem::forget(self.map.take());
        }
        // Otherwise unmapped as `map` drops.
    }
}
