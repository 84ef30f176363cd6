//! Parallel restore of BO contents: restored tasks hand the copy to CRIU's main process
//! (CRIU 4.2 and later), which does it at the first `RESUME_DEVICES_LATE` (or at `exit`, when
//! the restore failed before that). No thread serves the queue between hooks: CRIU enters the
//! restored tree's mount namespace after `POST_FORKING`, and the kernel refuses that to a
//! multi-threaded process.
//!
//! The C plugin does this over an abstract UNIX socket (which breaks when a task already
//! lives in another network namespace, and reads it with single `recv`s, which a stream
//! socket may answer short when there are many BOs). Here the
//! request travels through shared memory mapped before CRIU forks ([`RestoreQueue`]), with a
//! futex to wake a waiting server, and the dma-buf fds through CRIU's fdstore, a service socket
//! every restore process keeps. Nothing is bound to a name or a namespace, and a request is
//! never read partially. Offsets in the pages files come from each GPU's own layout (the C
//! plugin sums them over all GPUs, so a second GPU's reads miss its data), and the main
//! process closes every fd it receives (the C plugin keeps them open until CRIU exits).
//!
//! A task that cannot hand its copy over (no POST_FORKING on this host, the queue is full, the fdstore
//! refuses an fd) does the copy itself, as without parallel restore.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
#[cfg(test)]
use std::time::Duration;

use super::contents;
use super::copy::CopyStats;
use super::device::KfdDevice;
use super::error::{Error, Result, device_error};
use super::settings::AmdgpuSettings;
use super::store::ImageStore;

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

/// Passes fds between CRIU's restore processes.
pub trait FdStore: Send + Sync {
    /// Stores a copy of `fd`; returns its id.
    fn add(&self, fd: BorrowedFd<'_>) -> io::Result<i32>;
    /// A new fd for the file stored under `id`.
    fn get(&self, id: i32) -> io::Result<OwnedFd>;
    /// Forgets every stored fd, at the end of a restore (CRIU's fdstore goes with CRIU).
    fn clear(&self) {}
}

/// CRIU's fdstore (`fdstore_add`/`fdstore_get`, resolved at run time by `criu_plugin`).
pub struct CriuFdStore {
    syms: &'static criu_plugin::CriuSymbols,
}

impl CriuFdStore {
    /// The fdstore of the CRIU that loaded the plugin, if there is one.
    pub fn resolve() -> Option<CriuFdStore> {
        let syms = criu_plugin::CriuSymbols::get();
        syms.has_fdstore().then_some(CriuFdStore { syms })
    }
}

impl FdStore for CriuFdStore {
    fn add(&self, fd: BorrowedFd<'_>) -> io::Result<i32> {
        self.syms.fdstore_add(fd)
    }

    fn get(&self, id: i32) -> io::Result<OwnedFd> {
        self.syms.fdstore_get(id)
    }
}

/// An fdstore inside one process (no CRIU; tests and tools).
#[derive(Default)]
pub struct LocalFdStore {
    fds: Mutex<Vec<OwnedFd>>,
}

impl FdStore for LocalFdStore {
    fn add(&self, fd: BorrowedFd<'_>) -> io::Result<i32> {
        let copy = fd.try_clone_to_owned()?;
        let mut fds = self.fds.lock().unwrap_or_else(|e| e.into_inner());
        fds.push(copy);
        Ok((fds.len() - 1) as i32)
    }

    fn get(&self, id: i32) -> io::Result<OwnedFd> {
        let fds = self.fds.lock().unwrap_or_else(|e| e.into_inner());
        let fd = usize::try_from(id)
            .ok()
            .and_then(|i| fds.get(i))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        fd.try_clone()
    }

    fn clear(&self) {
        self.fds.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

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

/// Entries of a [`KeyTable`].
pub const MAX_KEYS: usize = 1 << 16;

#[repr(C)]
struct KeySlot {
    /// Key + 1 (0: free).
    key: AtomicU32,
    /// fdstore id + 1 (0: not yet published).
    id: AtomicI32,
}

/// dma-bufs of restored BOs by cross-reference key (the image's GEM handle), published by
/// the task that restored the BO for the tasks that restore dma-buf fds of it: an open
/// addressing table in memory shared by every restore process, mapped before CRIU forks.
pub struct KeyTable {
    slots: NonNull<[KeySlot; MAX_KEYS]>,
}

// SAFETY: the table consists of atomics only.
unsafe impl Send for KeyTable {}
// SAFETY: see `Send`.
unsafe impl Sync for KeyTable {}

impl KeyTable {
    /// Maps a new, empty table.
    pub fn create() -> io::Result<KeyTable> {
        // Shared across CRIU's forks, so mapped by hand as the queue is (RestoreQueue::create).
        // SAFETY: an anonymous shared mapping; no fd or existing memory involved.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                std::mem::size_of::<[KeySlot; MAX_KEYS]>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(KeyTable {
            slots: NonNull::new(p.cast()).expect("mmap succeeded"),
        })
    }

    fn slots(&self) -> &[KeySlot; MAX_KEYS] {
        // SAFETY: the mapping is page aligned, as large as the array, zero-filled (valid
        // atomics) and lives until `self` is dropped.
        unsafe { self.slots.as_ref() }
    }

    fn home(key: u32) -> usize {
        (key.wrapping_mul(0x9E37_79B9) as usize) % MAX_KEYS
    }

    /// Publishes fdstore id `id` for `key`; false when the table is full or `key` is
    /// already published.
    pub fn insert(&self, key: u32, id: i32) -> bool {
        if key == u32::MAX || id < 0 {
            return false;
        }
        let slots = self.slots();
        let h = Self::home(key);
        for n in 0..MAX_KEYS {
            let s = &slots[(h + n) % MAX_KEYS];
            match s
                .key
                .compare_exchange(0, key + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    s.id.store(id + 1, Ordering::Release);
                    return true;
                }
                Err(k) if k == key + 1 => return false,
                Err(_) => continue,
            }
        }
        false
    }

    /// The fdstore id published for `key`.
    pub fn get(&self, key: u32) -> Option<i32> {
        if key == u32::MAX {
            return None;
        }
        let slots = self.slots();
        let h = Self::home(key);
        for n in 0..MAX_KEYS {
            let s = &slots[(h + n) % MAX_KEYS];
            match s.key.load(Ordering::Acquire) {
                0 => return None,
                k if k == key + 1 => {
                    let id = s.id.load(Ordering::Acquire);
                    return (id > 0).then(|| id - 1);
                }
                _ => {}
            }
        }
        None
    }
}

impl Drop for KeyTable {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `create`, once.
        unsafe {
            libc::munmap(
                self.slots.as_ptr().cast(),
                std::mem::size_of::<[KeySlot; MAX_KEYS]>(),
            )
        };
    }
}

/// What restore processes pass each other, set up in CRIU's main process before it forks:
/// CRIU's fdstore and, over it, the parallel-restore queue and the table of published
/// dma-bufs.
pub struct Handover {
    store: Arc<dyn FdStore>,
    queue: Option<RestoreQueue>,
    keys: Option<KeyTable>,
}

impl Handover {
    /// The queue (when `parallel`) and the key table (when `dmabufs`) over `store`; what
    /// cannot be mapped is left out, with a warning.
    pub fn create(store: Arc<dyn FdStore>, parallel: bool, dmabufs: bool) -> Handover {
        let queue = if parallel {
            RestoreQueue::create()
                .map_err(|e| log::warn!("amdgpu: no parallel restore: {e}"))
                .ok()
        } else {
            None
        };
        let keys = if dmabufs {
            KeyTable::create()
                .map_err(|e| log::warn!("amdgpu: dma-bufs only within a task: {e}"))
                .ok()
        } else {
            None
        };
        Handover { store, queue, keys }
    }

    /// Whether tasks may hand their copies to CRIU's main process.
    pub fn parallel(&self) -> bool {
        self.queue.is_some()
    }

    /// Forgets every fd passed, at the end of the restore.
    pub fn clear(&self) {
        self.store.clear();
    }

    /// Hands the copy of KFD file `id` (its GPUs `minor_of`: user gpu id → restore minor,
    /// and the dma-bufs of its BOs) to CRIU's main process; false when that is not possible
    /// (the caller then copies itself).
    pub fn hand_over(
        &self,
        id: u32,
        minor_of: &HashMap<u32, u32>,
        dmabufs: &[Option<OwnedFd>],
    ) -> bool {
        let Some(q) = &self.queue else {
            return false;
        };
        let fds: Vec<&OwnedFd> = dmabufs.iter().flatten().collect();
        let Some(r) = q.reserve(fds.len()) else {
            log::info!("amdgpu: file {id}: parallel restore queue full; copying in the task");
            return false;
        };
        let mut ids = Vec::with_capacity(fds.len());
        for fd in fds {
            match self.store.add(fd.as_fd()) {
                Ok(n) => ids.push(n),
                Err(e) => {
                    log::warn!("amdgpu: file {id}: {e}; copying in the task");
                    q.abandon(r);
                    return false;
                }
            }
        }
        let mut gpus: Vec<(u32, u32)> = minor_of.iter().map(|(&u, &m)| (u, m)).collect();
        gpus.sort_unstable();
        match q.publish(r, id, &gpus, &ids) {
            Ok(()) => true,
            Err(e) => {
                log::warn!("amdgpu: file {id}: {e}; copying in the task");
                false
            }
        }
    }

    /// Publishes the dma-buf `fd` of the restored BO with cross-reference key `key` for
    /// every task; false when it could not be (no key table, or the table is full).
    pub fn publish(&self, key: u32, fd: BorrowedFd<'_>) -> Result<bool> {
        let Some(table) = &self.keys else {
            return Ok(false);
        };
        let id = self
            .store
            .add(fd)
            .map_err(|e| Error::io(&e, "cannot pass a dma-buf to CRIU's fdstore"))?;
        if !table.insert(key, id) {
            log::warn!("amdgpu: dma-buf key {key} published twice or table full");
            return Ok(false);
        }
        Ok(true)
    }

    /// A dma-buf of the BO with key `key` that another task published; `None` when none did
    /// (yet).
    pub fn find(&self, key: u32) -> Result<Option<OwnedFd>> {
        let Some(sid) = self.keys.as_ref().and_then(|t| t.get(key)) else {
            return Ok(None);
        };
        self.store
            .get(sid)
            .map(Some)
            .map_err(|e| Error::io(&e, "cannot take a dma-buf from CRIU's fdstore"))
    }

    /// Serves every request ready in the queue now, here (CRIU's main process).
    pub fn serve_ready(
        &self,
        dev: &dyn KfdDevice,
        settings: &AmdgpuSettings,
        images: &ImageStore,
    ) -> Vec<Served> {
        let mut out = Vec::new();
        let Some(queue) = &self.queue else {
            return out;
        };
        while let Some(req) = queue.take() {
            let result = self.serve(dev, settings, images, &req);
            queue.complete(
                req.slot,
                result.as_ref().err().map(|e| e.errno.get()).unwrap_or(0),
            );
            out.push(Served {
                file_id: req.file_id,
                result,
            });
        }
        out
    }

    /// How the queued requests ended; `None` without a parallel restore.
    pub fn outcome(&self) -> Option<QueueOutcome> {
        self.queue.as_ref().map(RestoreQueue::outcome)
    }

    /// Does the copy of one request.
    fn serve(
        &self,
        dev: &dyn KfdDevice,
        settings: &AmdgpuSettings,
        images: &ImageStore,
        req: &Request,
    ) -> Result<CopyStats> {
        let image = images.dir()?.read_kfd(req.file_id, &images.limits)?;
        let minor_of: HashMap<u32, u32> = req.gpus.iter().copied().collect();
        let content: Vec<usize> = image.content_bos().map(|(i, _)| i).collect();
        if content.len() != req.fds.len() {
            return Err(device_error(
                libc::EINVAL,
                format!(
                    "the request for file {} carries {} dma-bufs for {} BOs with contents",
                    req.file_id,
                    req.fds.len(),
                    content.len()
                ),
            ));
        }
        let mut dmabufs: Vec<Option<OwnedFd>> = (0..image.bos.len()).map(|_| None).collect();
        for (&i, &fid) in content.iter().zip(&req.fds) {
            dmabufs[i] = Some(
                self.store
                    .get(fid)
                    .map_err(|e| Error::io(&e, "cannot take a dma-buf from CRIU's fdstore"))?,
            );
        }
        contents::Contents {
            dev,
            settings,
            images,
            id: req.file_id,
            image: &image,
            minor_of: &minor_of,
            dmabufs: &dmabufs,
        }
        .load()
    }
}

/// The result of one parallel-restore request.
pub struct Served {
    /// KFD file id.
    pub file_id: u32,
    /// What the copy did, or why it failed.
    pub result: Result<CopyStats>,
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
    use std::os::fd::AsRawFd;

    /// Waits for the child of `fork` (the parent's side) and checks it exited with 0.
    fn exited_zero(fork: nix::unistd::ForkResult) {
        let nix::unistd::ForkResult::Parent { child } = fork else {
            unreachable!("only the parent gets here");
        };
        let st = nix::sys::wait::waitpid(child, None).unwrap();
        assert_eq!(st, nix::sys::wait::WaitStatus::Exited(child, 0));
    }

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

    #[test]
    fn keys_are_found_across_a_fork() {
        let t = KeyTable::create().unwrap();
        // SAFETY: the child only touches the shared mapping and calls _exit.
        let fork = unsafe { nix::unistd::fork() }.unwrap();
        if fork.is_child() {
            let ok = (1..=2000u32).all(|k| t.insert(k * 7, k as i32)) && !t.insert(7, 99);
            // SAFETY: _exit ends the forked child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        exited_zero(fork);
        assert_eq!(t.get(7), Some(1));
        assert_eq!(t.get(14000), Some(2000));
        assert_eq!(t.get(8), None);
        assert_eq!(t.get(u32::MAX), None);
    }

    #[test]
    fn the_local_fdstore_hands_out_copies() {
        let store = LocalFdStore::default();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsFd;
        let id = store.add(a.as_fd()).unwrap();
        drop(a);
        let c = store.get(id).unwrap();
        assert!(c.as_raw_fd() >= 0);
        assert!(store.get(id + 1).is_err());
    }
}
