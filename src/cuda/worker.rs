//! Threads that make driver calls for CRIU's thread.
//!
//! Driver calls block CRIU's thread, and some never return: `cuCheckpointProcessGetState` and
//! `Lock` wait for a target that cannot run (stopped, frozen, or waiting on an NCCL peer that is
//! already locked), and CRIU's SIGALRM cannot break a call made inside its own process. Calls
//! that may block that way run on a worker with a deadline; a worker still stuck at its deadline
//! is abandoned, and the plugin then keeps itself loaded so that the worker, should the driver
//! ever return, does not return into unmapped code. Workers block SIGALRM, which is CRIU's.

use std::sync::mpsc;
use std::time::Duration;

/// Blocks SIGALRM in the calling thread: CRIU's timeout alarm belongs to CRIU's thread.
pub fn block_sigalrm() {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset before use; pthread_sigmask
    // changes only this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGALRM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Keeps this shared object loaded for the life of the process (`RTLD_NODELETE`).
pub fn pin_self() {
    use std::os::unix::ffi::OsStrExt;
    let Some(path) = crate::plugin::plugin_file() else {
        return;
    };
    let Ok(path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: re-opening an already loaded object by its own name with RTLD_NOLOAD only takes a
    // reference and sets RTLD_NODELETE; the handle is deliberately never closed.
    unsafe {
        libc::dlopen(
            path.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
        )
    };
}

/// Runs `f` on a worker and waits at most `deadline`; `None` if it did not finish in time (the
/// worker is then left to finish on its own).
pub fn call_with_deadline<T: Send + 'static>(
    deadline: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("cuda-call".into())
        .spawn(move || {
            block_sigalrm();
            let _ = tx.send(f());
        });
    if spawned.is_err() {
        return None;
    }
    match rx.recv_timeout(deadline) {
        Ok(v) => Some(v),
        Err(_) => {
            pin_self();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_in_time_or_gives_up() {
        assert_eq!(call_with_deadline(Duration::from_secs(5), || 7), Some(7));
        let slow = call_with_deadline(Duration::from_millis(50), || {
            std::thread::sleep(Duration::from_millis(500));
            1
        });
        assert_eq!(slow, None);
    }
}
