//! The parallel restore's request queue: fixed slots in memory shared by CRIU's main process
//! and every restored task (mapped before CRIU forks), published with atomics and woken with
//! a futex. A request is whole or not there; nothing is read partially.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
#[cfg(test)]
use std::time::Duration;

/// Requests the queue holds (restored processes with KFD state).
pub const MAX_REQUESTS: usize = 512;
/// GPUs per request.
pub const MAX_GPUS: usize = 64;
/// dma-buf fds over all requests.
pub const MAX_FDS: usize = 1 << 20;

const MAGIC: u64 = 0x4b46_4450_4152_5131; // "KFDPARQ1"

const FREE: u32 = 0;
const RESERVED: u32 = 1;
const READY: u32 = 2;
const TAKEN: u32 = 3;
const DONE: u32 = 4;
const FAILED: u32 = 5;
const ABANDONED: u32 = 6;

#[repr(C)]
struct Slot {
    state: AtomicU32,
    file_id: AtomicU32,
    n_gpus: AtomicU32,
    first_fd: AtomicU32,
    n_fds: AtomicU32,
    errno: AtomicI32,
    gpus: [[AtomicU32; 2]; MAX_GPUS],
}

#[repr(C)]
struct Header {
    magic: AtomicU64,
    wake: AtomicU32,
    quit: AtomicU32,
    next_slot: AtomicU32,
    next_fd: AtomicU32,
    slots: [Slot; MAX_REQUESTS],
    fds: [AtomicI32; MAX_FDS],
}

/// A place in the queue, reserved by a task before it stores its fds.
#[derive(Debug)]
pub struct Reservation {
    slot: usize,
    first_fd: usize,
    n_fds: usize,
}

/// A request taken by the server (CRIU's main process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Queue slot.
    pub slot: usize,
    /// CRIU file id of the KFD image.
    pub file_id: u32,
    /// (user gpu id, restore render minor) of each GPU.
    pub gpus: Vec<(u32, u32)>,
    /// fdstore ids of the dma-bufs of the image's VRAM/GTT BOs, in image order.
    pub fds: Vec<i32>,
}

/// How the queued requests ended.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct QueueOutcome {
    /// Requests completed.
    pub done: usize,
    /// (file id, errno) of requests that failed or were never completed.
    pub failed: Vec<(u32, i32)>,
}

/// The request queue in memory shared by CRIU's main process and every restored task.
pub struct RestoreQueue {
    hdr: NonNull<Header>,
}

// SAFETY: the header consists of atomics only; every access goes through them.
unsafe impl Send for RestoreQueue {}
// SAFETY: see `Send`.
unsafe impl Sync for RestoreQueue {}

impl RestoreQueue {
    /// Maps a new queue. Must happen before CRIU forks the tasks that use it.
    pub fn create() -> io::Result<RestoreQueue> {
        let len = std::mem::size_of::<Header>();
        // Mapped by hand, not with memmap2: its anonymous mappings are private (MAP_PRIVATE),
        // and this one must stay shared with the tasks CRIU forks after it is made.
        // SAFETY: an anonymous shared mapping; no fd or existing memory involved.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let hdr = NonNull::new(p.cast::<Header>()).expect("mmap succeeded");
        let q = RestoreQueue { hdr };
        q.h().magic.store(MAGIC, Ordering::Release);
        Ok(q)
    }

    fn h(&self) -> &Header {
        // SAFETY: the mapping is page aligned, as large as `Header`, zero-filled (a valid
        // value of every atomic in it) and lives until `self` is dropped.
        unsafe { self.hdr.as_ref() }
    }

    /// Reserves a slot and `n_fds` fd ids; `None` when the queue is full.
    pub fn reserve(&self, n_fds: usize) -> Option<Reservation> {
        let h = self.h();
        let slot = h.next_slot.fetch_add(1, Ordering::AcqRel) as usize;
        if slot >= MAX_REQUESTS {
            return None;
        }
        let first = h.next_fd.fetch_add(n_fds as u32, Ordering::AcqRel) as usize;
        let s = &h.slots[slot];
        if n_fds > MAX_FDS || first + n_fds > MAX_FDS {
            s.state.store(ABANDONED, Ordering::Release);
            return None;
        }
        s.state.store(RESERVED, Ordering::Release);
        Some(Reservation {
            slot,
            first_fd: first,
            n_fds,
        })
    }

    /// Publishes a reserved request and wakes a waiting server.
    pub fn publish(
        &self,
        r: Reservation,
        file_id: u32,
        gpus: &[(u32, u32)],
        fds: &[i32],
    ) -> io::Result<()> {
        let h = self.h();
        let s = &h.slots[r.slot];
        if gpus.len() > MAX_GPUS || fds.len() != r.n_fds {
            s.state.store(ABANDONED, Ordering::Release);
            return Err(io::Error::from_raw_os_error(libc::E2BIG));
        }
        s.file_id.store(file_id, Ordering::Relaxed);
        s.n_gpus.store(gpus.len() as u32, Ordering::Relaxed);
        for (g, &(user, minor)) in s.gpus.iter().zip(gpus) {
            g[0].store(user, Ordering::Relaxed);
            g[1].store(minor, Ordering::Relaxed);
        }
        s.first_fd.store(r.first_fd as u32, Ordering::Relaxed);
        s.n_fds.store(r.n_fds as u32, Ordering::Relaxed);
        for (slot, &id) in h.fds[r.first_fd..r.first_fd + r.n_fds].iter().zip(fds) {
            slot.store(id, Ordering::Relaxed);
        }
        s.state.store(READY, Ordering::Release);
        h.wake.fetch_add(1, Ordering::AcqRel);
        futex_wake(&h.wake);
        Ok(())
    }

    /// Gives a reservation up (the task does the copy itself).
    pub fn abandon(&self, r: Reservation) {
        self.h().slots[r.slot]
            .state
            .store(ABANDONED, Ordering::Release);
    }

    /// Takes the next ready request.
    pub fn take(&self) -> Option<Request> {
        let h = self.h();
        let n = (h.next_slot.load(Ordering::Acquire) as usize).min(MAX_REQUESTS);
        for (i, s) in h.slots[..n].iter().enumerate() {
            if s.state
                .compare_exchange(READY, TAKEN, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            let n_gpus = (s.n_gpus.load(Ordering::Relaxed) as usize).min(MAX_GPUS);
            let first = s.first_fd.load(Ordering::Relaxed) as usize;
            let n_fds = s.n_fds.load(Ordering::Relaxed) as usize;
            let fds = h
                .fds
                .get(first..first.saturating_add(n_fds))
                .map(|ids| ids.iter().map(|a| a.load(Ordering::Relaxed)).collect())
                .unwrap_or_default();
            return Some(Request {
                slot: i,
                file_id: s.file_id.load(Ordering::Relaxed),
                gpus: s.gpus[..n_gpus]
                    .iter()
                    .map(|g| (g[0].load(Ordering::Relaxed), g[1].load(Ordering::Relaxed)))
                    .collect(),
                fds,
            });
        }
        None
    }

    /// Records the result of a taken request (0 or a positive errno).
    pub fn complete(&self, slot: usize, errno: i32) {
        let s = &self.h().slots[slot];
        s.errno.store(errno, Ordering::Relaxed);
        s.state
            .store(if errno == 0 { DONE } else { FAILED }, Ordering::Release);
    }

    /// The value to pass to [`Self::wait`]: read it before looking for work.
    #[cfg(test)]
    pub fn wake_seq(&self) -> u32 {
        self.h().wake.load(Ordering::Acquire)
    }

    /// Sleeps until a request is published after `seq` was read, or `quit`, or `timeout`.
    #[cfg(test)]
    pub fn wait(&self, seq: u32, timeout: Duration) {
        futex_wait(&self.h().wake, seq, timeout);
    }

    /// Tells a waiting server to stop once no ready request is left.
    #[cfg(test)]
    pub fn quit(&self) {
        let h = self.h();
        h.quit.store(1, Ordering::Release);
        h.wake.fetch_add(1, Ordering::AcqRel);
        futex_wake(&h.wake);
    }

    /// Whether [`Self::quit`] was called.
    #[cfg(test)]
    pub fn quitting(&self) -> bool {
        self.h().quit.load(Ordering::Acquire) != 0
    }

    /// How the requests ended (once they were served).
    pub fn outcome(&self) -> QueueOutcome {
        let h = self.h();
        let n = (h.next_slot.load(Ordering::Acquire) as usize).min(MAX_REQUESTS);
        let mut out = QueueOutcome::default();
        for s in &h.slots[..n] {
            let file_id = s.file_id.load(Ordering::Relaxed);
            match s.state.load(Ordering::Acquire) {
                DONE => out.done += 1,
                FAILED => out.failed.push((file_id, s.errno.load(Ordering::Relaxed))),
                RESERVED | READY | TAKEN => out.failed.push((file_id, libc::EIO)),
                FREE | ABANDONED => {}
                _ => out.failed.push((file_id, libc::EIO)),
            }
        }
        out
    }
}

impl Drop for RestoreQueue {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `create`, once.
        unsafe { libc::munmap(self.hdr.as_ptr().cast(), std::mem::size_of::<Header>()) };
    }
}
fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 in a shared mapping (no PRIVATE flag: other
    // processes wait on it too).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

// A worker loop: only the unit tests run one (CRIU's main process serves the queue itself).
#[cfg(test)]
fn futex_wait(word: &AtomicU32, seq: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 with a relative timeout; it returns at once
    // if the word no longer holds `seq`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seq,
            &ts as *const libc::timespec,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amdgpu::parallel::tests::exited_zero;

    #[test]
    fn requests_cross_a_fork_and_come_back_whole() {
        let q = RestoreQueue::create().unwrap();
        let fds: Vec<i32> = (0..5000).collect();
        // SAFETY: the child only touches the shared mapping and calls _exit.
        let fork = unsafe { nix::unistd::fork() }.unwrap();
        if fork.is_child() {
            let ok = (|| {
                let r = q.reserve(fds.len())?;
                q.publish(r, 7, &[(0x1234, 129), (0x5678, 128)], &fds)
                    .ok()?;
                let r = q.reserve(1)?;
                q.abandon(r);
                Some(())
            })();
            // SAFETY: _exit ends the forked child without running the parent's destructors.
            unsafe { libc::_exit(if ok.is_some() { 0 } else { 1 }) };
        }
        exited_zero(fork);
        let r = q.take().expect("a ready request");
        assert_eq!(r.file_id, 7);
        assert_eq!(r.gpus, vec![(0x1234, 129), (0x5678, 128)]);
        assert_eq!(r.fds, fds);
        assert!(q.take().is_none());
        q.complete(r.slot, 0);
        assert_eq!(
            q.outcome(),
            QueueOutcome {
                done: 1,
                failed: vec![]
            }
        );
    }

    #[test]
    fn unfinished_and_failed_requests_are_reported() {
        let q = RestoreQueue::create().unwrap();
        let a = q.reserve(1).unwrap();
        q.publish(a, 1, &[], &[5]).unwrap();
        let _pending = q.reserve(2).unwrap();
        let r = q.take().unwrap();
        q.complete(r.slot, libc::EIO);
        let o = q.outcome();
        assert_eq!(o.done, 0);
        assert_eq!(o.failed.len(), 2);
        assert!(q.reserve(MAX_FDS + 1).is_none());
    }

    #[test]
    fn a_waiting_server_wakes_for_work_and_for_quit() {
        let q = RestoreQueue::create().unwrap();
        std::thread::scope(|s| {
            let h = s.spawn(|| {
                let mut seen = 0;
                loop {
                    let seq = q.wake_seq();
                    if let Some(r) = q.take() {
                        seen += r.fds.len();
                        q.complete(r.slot, 0);
                        continue;
                    }
                    if q.quitting() {
                        return seen;
                    }
                    q.wait(seq, Duration::from_secs(5));
                }
            });
            for i in 0..10 {
                let r = q.reserve(3).unwrap();
                q.publish(r, i, &[], &[1, 2, 3]).unwrap();
            }
            q.quit();
            assert_eq!(h.join().unwrap(), 30);
        });
        assert_eq!(q.outcome().done, 10);
    }
}
