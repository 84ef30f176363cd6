//! The BO content pipeline: parallel, bounded, with device and file work overlapped.
//!
//! A copy is a list of [`Piece`]s (a BO index, an offset in the BO and a length), planned so
//! that consecutive pieces alternate between GPUs (and so between pages files). Each copy
//! thread takes the next piece, moves it into its own page-aligned staging buffer (`fill`:
//! device to host at dump, file to host at restore) and out of it (`drain`: host to file at
//! dump, host to device at restore):
//!
//! ```text
//!   thread 1:  fill p0 | drain p0 | fill p2 | drain p2 | ...
//!   thread 2:       fill p1 | drain p1 | fill p3 | drain p3 | ...
//! ```
//!
//! So one thread reads a piece from the GPU while another writes the previous one to its
//! image file, large BOs are split over several threads, and a piece never leaves the cache
//! of the core that filled it. (A design with separate fill and drain threads handing
//! buffers over was measured slower: every drained byte then comes from another core's
//! cache.) The staging memory is exactly `threads × piece size`, whatever the BO sizes (the
//! C plugin stages the largest BO whole, per GPU). The first error stops the copy: no new
//! piece is started, every thread is joined before [`run`] returns, and that error is
//! returned.

use std::io;

use memmap2::{Advice, MmapMut, MmapOptions};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

/// One piece of a BO.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The caller's index of the BO.
    pub bo: usize,
    /// Offset in the BO.
    pub offset: u64,
    /// Length in bytes (at most the piece size).
    pub len: usize,
}

/// Splits BOs `(index, size)` into pieces of at most `chunk` bytes, BO after BO.
pub fn plan(bos: impl IntoIterator<Item = (usize, u64)>, chunk: usize) -> Vec<Piece> {
    let chunk = chunk.max(1) as u64;
    let mut out = Vec::new();
    for (bo, size) in bos {
        let mut offset = 0;
        while offset < size {
            let len = (size - offset).min(chunk);
            out.push(Piece {
                bo,
                offset,
                len: len as usize,
            });
            offset += len;
        }
    }
    out
}

/// Splits the BOs of several streams (one per GPU and pages file) into pieces of at most
/// `chunk` bytes, taking one piece from each stream in turn, so that threads working on
/// consecutive pieces mostly write different files (a file's writes serialise in the kernel).
pub fn plan_interleaved(streams: &[Vec<(usize, u64)>], chunk: usize) -> Vec<Piece> {
    let mut per: Vec<std::vec::IntoIter<Piece>> = streams
        .iter()
        .map(|s| plan(s.iter().copied(), chunk).into_iter())
        .collect();
    let mut out = Vec::with_capacity(per.iter().map(|p| p.len()).sum());
    loop {
        let before = out.len();
        for p in per.iter_mut() {
            if let Some(piece) = p.next() {
                out.push(piece);
            }
        }
        if out.len() == before {
            return out;
        }
    }
}

/// What a copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CopyStats {
    /// Bytes moved.
    pub bytes: u64,
    /// Pieces moved.
    pub pieces: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Staging memory used.
    pub staging_bytes: u64,
    /// Threads on each side.
    pub threads: usize,
    /// Time spent inside `fill`, all threads together.
    pub fill_busy: Duration,
    /// Time spent inside `drain`, all threads together.
    pub drain_busy: Duration,
}

impl CopyStats {
    /// Throughput in bytes per second.
    pub fn rate(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A copy thread's whole staging allocation: page aligned and a whole number of pages, so
/// that a device can register it (userptr). The thread's pieces lie inside it.
///
/// Only `run` makes regions, one per thread, over memory that stays mapped until the
/// thread's lane is dropped (and for good once [`StagingRegion::keep_after_use`] is called).
#[derive(Debug)]
pub struct StagingRegion {
    base: *mut u8,
    len: usize,
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
struct Staging {
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
    fn new(len: usize) -> io::Result<Staging> {
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

    fn region(&self) -> StagingRegion {
        StagingRegion {
            base: self.base(),
            len: self.mapped,
            keep: Arc::clone(&self.keep),
        }
    }

    fn slice(&mut self, len: usize) -> &mut [u8] {
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Shared<'a, E> {
    pieces: &'a [Piece],
    next: AtomicUsize,
    abort: AtomicBool,
    error: Mutex<Option<E>>,
    bytes: AtomicU64,
    fill_ns: AtomicU64,
    drain_ns: AtomicU64,
}

impl<E> Shared<'_, E> {
    fn fail(&self, e: E) {
        self.abort.store(true, Ordering::SeqCst);
        let mut slot = lock(&self.error);
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

/// Moves every piece through `fill` (into a staging buffer) and then `drain` (out of it).
///
/// Each of `threads` threads (the calling one included) takes the next piece, fills its own
/// buffer of `chunk` bytes and drains it, so a piece stays in the cache of the core that
/// filled it; device and file work overlap across threads (one thread's `fill` runs while
/// another's `drain` does). Staging memory is `threads × chunk` (rounded up to pages).
/// Each thread first calls `lane` with its whole staging allocation, for per-thread state
/// (the SDMA engine registers the allocation with the GPU there), passed to every `fill`
/// and `drain` of the thread and dropped before the allocation is freed. `fill` and `drain`
/// are called concurrently for different pieces. Returns the first error; then not every
/// piece has been drained, and every thread has stopped.
pub fn run<E, L, S, F, D>(
    pieces: &[Piece],
    threads: usize,
    chunk: usize,
    lane: S,
    fill: F,
    drain: D,
) -> Result<CopyStats, E>
where
    E: Send + From<io::Error>,
    S: Fn(StagingRegion) -> Result<L, E> + Sync,
    F: Fn(&mut L, &Piece, &mut [u8]) -> Result<(), E> + Sync,
    D: Fn(&mut L, &Piece, &[u8]) -> Result<(), E> + Sync,
{
    let started = Instant::now();
    let threads = threads.clamp(1, 256).min(pieces.len().max(1));
    if let Some(p) = pieces.iter().find(|p| p.len > chunk) {
        return Err(E::from(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "piece of {} bytes exceeds the {chunk}-byte staging buffers",
                p.len
            ),
        )));
    }
    let mut stats = CopyStats {
        threads,
        ..Default::default()
    };
    if pieces.is_empty() {
        stats.elapsed = started.elapsed();
        return Ok(stats);
    }
    let shared = Shared {
        pieces,
        next: AtomicUsize::new(0),
        abort: AtomicBool::new(false),
        error: Mutex::new(None),
        bytes: AtomicU64::new(0),
        fill_ns: AtomicU64::new(0),
        drain_ns: AtomicU64::new(0),
    };
    let mut bufs = Vec::with_capacity(threads);
    for _ in 0..threads {
        bufs.push(Staging::new(chunk).map_err(E::from)?);
    }
    stats.staging_bytes = bufs.iter().map(|b| b.region().len as u64).sum();
    let work = |mut buf: Staging| {
        let mut lane = match lane(buf.region()) {
            Ok(l) => l,
            Err(e) => {
                shared.fail(e);
                return;
            }
        };
        // The lane goes before the buffer it may have registered.
        let lane = &mut lane;
        while !shared.abort.load(Ordering::SeqCst) {
            let i = shared.next.fetch_add(1, Ordering::SeqCst);
            let Some(piece) = shared.pieces.get(i) else {
                return;
            };
            let data = buf.slice(piece.len);
            let t = Instant::now();
            let r = fill(lane, piece, data);
            let t2 = Instant::now();
            shared
                .fill_ns
                .fetch_add((t2 - t).as_nanos() as u64, Ordering::Relaxed);
            if let Err(e) = r {
                shared.fail(e);
                return;
            }
            let r = drain(lane, piece, data);
            shared
                .drain_ns
                .fetch_add(t2.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match r {
                Ok(()) => {
                    shared.bytes.fetch_add(piece.len as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    shared.fail(e);
                    return;
                }
            }
        }
    };
    // Workers start with CRIU's signals blocked and are joined before this returns; a
    // worker's panic comes back as an error.
    let workers = criu_plugin::threads::scope(|w| {
        let mut bufs = bufs.into_iter();
        // The calling thread works too.
        let mine = bufs.next().expect("at least one buffer");
        for (n, buf) in bufs.enumerate() {
            let work = &work;
            if let Err(e) = w.spawn(format!("amdgpu-copy{n}"), move || work(buf)) {
                // Fewer threads: the others and this one still do every piece.
                log::debug!("amdgpu: copy thread not started: {e}");
            }
        }
        work(mine);
    });
    if let Err(panic) = workers {
        return Err(E::from(io::Error::from(panic)));
    }
    if let Some(e) = shared.error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    stats.bytes = shared.bytes.load(Ordering::Relaxed);
    stats.fill_busy = Duration::from_nanos(shared.fill_ns.load(Ordering::Relaxed));
    stats.drain_busy = Duration::from_nanos(shared.drain_ns.load(Ordering::Relaxed));
    stats.pieces = pieces.len();
    stats.elapsed = started.elapsed();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn pieces_cover_every_byte_once() {
        let p = plan([(0, 10), (3, 0), (7, 4096)], 4);
        assert_eq!(p.len(), 3 + 1024);
        assert_eq!(
            p[2],
            Piece {
                bo: 0,
                offset: 8,
                len: 2
            }
        );
        assert_eq!(
            p[3],
            Piece {
                bo: 7,
                offset: 0,
                len: 4
            }
        );
        let total: usize = p.iter().map(|p| p.len).sum();
        assert_eq!(total, 4106);
    }

    #[test]
    fn copies_everything_with_bounded_buffers() {
        let src: Vec<Vec<u8>> = (0..20u8)
            .map(|i| {
                (0..(i as usize * 1000 + 1))
                    .map(|b| (b as u8) ^ i)
                    .collect()
            })
            .collect();
        let dst: Vec<Mutex<Vec<u8>>> = src.iter().map(|s| Mutex::new(vec![0; s.len()])).collect();
        let pieces = plan(
            src.iter().enumerate().map(|(i, s)| (i, s.len() as u64)),
            4096,
        );
        let live = AtomicUsize::new(0);
        let max_live = AtomicUsize::new(0);
        let stats = run::<io::Error, (), _, _, _>(
            &pieces,
            3,
            4096,
            |_| Ok(()),
            |_, p, buf| {
                let n = live.fetch_add(1, Ordering::SeqCst) + 1;
                max_live.fetch_max(n, Ordering::SeqCst);
                let o = p.offset as usize;
                buf.copy_from_slice(&src[p.bo][o..o + p.len]);
                Ok(())
            },
            |_, p, buf| {
                live.fetch_sub(1, Ordering::SeqCst);
                let o = p.offset as usize;
                lock(&dst[p.bo])[o..o + p.len].copy_from_slice(buf);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(stats.bytes, src.iter().map(|s| s.len() as u64).sum::<u64>());
        assert_eq!(stats.staging_bytes, 3 * 8192);
        assert!(max_live.load(Ordering::SeqCst) <= 3);
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(s, &*lock(d));
        }
    }

    #[test]
    fn a_copy_thread_that_panics_fails_the_copy_without_unwinding() {
        let pieces = plan((0..64).map(|i| (i, 8192)), 4096);
        let r = run::<io::Error, (), _, _, _>(
            &pieces,
            4,
            4096,
            |_| Ok(()),
            |_, _, _| {
                let me = std::thread::current();
                if me.name().is_some_and(|n| n.starts_with("amdgpu-copy")) {
                    panic!("copy thread lost its buffer");
                }
                // The calling thread leaves pieces to the copy threads.
                std::thread::sleep(Duration::from_millis(2));
                Ok(())
            },
            |_, _, _| Ok(()),
        );
        let e = r.unwrap_err();
        assert!(e.to_string().contains("copy thread lost its buffer"), "{e}");
    }

    #[test]
    fn the_first_error_stops_the_copy_and_every_thread_is_joined() {
        let pieces = plan((0..100).map(|i| (i, 8192)), 4096);
        let drained = AtomicUsize::new(0);
        for fail_in_fill in [true, false] {
            drained.store(0, Ordering::SeqCst);
            let r = run::<io::Error, (), _, _, _>(
                &pieces,
                4,
                4096,
                |_| Ok(()),
                |_, p, _| {
                    if fail_in_fill && p.bo == 10 {
                        return Err(io::Error::other("device fault"));
                    }
                    Ok(())
                },
                |_, p, _| {
                    if !fail_in_fill && p.bo == 20 {
                        return Err(io::Error::other("disk full"));
                    }
                    drained.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                },
            );
            let e = r.unwrap_err();
            assert!(
                e.to_string()
                    .contains(if fail_in_fill { "device" } else { "disk" })
            );
            assert!(drained.load(Ordering::SeqCst) < pieces.len());
        }
    }

    /// Whether `addr` lies in a mapping of this process (adjacent anonymous mappings merge, so
    /// the region need not start a line of the maps file).
    fn mapped(addr: usize) -> bool {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(|l| {
                let range = l.split(' ').next()?;
                let (a, b) = range.split_once('-')?;
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            })
            .any(|(a, b)| a <= addr && addr < b)
    }

    #[test]
    fn kept_staging_stays_mapped() {
        let pieces = plan([(0, 8192)], 4096);
        let bases = Mutex::new(Vec::new());
        let r = run::<io::Error, StagingRegion, _, _, _>(
            &pieces,
            1,
            4096,
            |region| {
                lock(&bases).push(region.base() as usize);
                assert_eq!(region.len() % page_size(), 0);
                assert_eq!(region.base() as usize % page_size(), 0);
                Ok(region)
            },
            |region, _, _| {
                region.keep_after_use();
                Err(io::Error::from_raw_os_error(libc::ETIMEDOUT))
            },
            |_, _, _| Ok(()),
        );
        assert!(r.is_err());
        // (That an unkept region is unmapped cannot be checked without racing other test
        // threads, which may map the same addresses right away.)
        assert!(
            mapped(lock(&bases)[0]),
            "a kept staging region was unmapped"
        );
    }

    #[test]
    fn interleaved_plans_alternate_streams() {
        let p = plan_interleaved(&[vec![(0, 8), (2, 4)], vec![(1, 4)], vec![]], 4);
        let order: Vec<(usize, u64)> = p.iter().map(|p| (p.bo, p.offset)).collect();
        assert_eq!(order, vec![(0, 0), (1, 0), (0, 4), (2, 0)]);
    }

    #[test]
    fn oversized_pieces_and_empty_copies() {
        let r = run::<io::Error, (), _, _, _>(
            &[Piece {
                bo: 0,
                offset: 0,
                len: 8192,
            }],
            1,
            4096,
            |_| Ok(()),
            |_, _, _| Ok(()),
            |_, _, _| Ok(()),
        );
        assert!(r.is_err());
        let s = run::<io::Error, (), _, _, _>(
            &[],
            2,
            4096,
            |_| Ok(()),
            |_, _, _| Ok(()),
            |_, _, _| Ok(()),
        )
        .unwrap();
        assert_eq!(s.bytes, 0);
    }
}
