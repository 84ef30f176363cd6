//! The threads that make driver calls for CRIU's thread within one hook.
//!
//! A batch of driver calls (checkpoint, restore, unlock of every process of a tree) runs on
//! scoped threads that the hook joins before it returns, so CRIU's process is single-threaded
//! again whenever CRIU runs. Calls that may never return do not run on these threads but in a
//! helper process ([`super::helper`]), which can be killed.

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
