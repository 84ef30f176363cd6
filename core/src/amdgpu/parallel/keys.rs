//! The table of published dma-bufs: restored BOs by cross-reference key, in memory shared by
//! every restore process.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amdgpu::parallel::tests::exited_zero;

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
}
