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

mod staging;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use staging::Staging;
pub use staging::{StagingRegion, page_size};

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
mod tests;
