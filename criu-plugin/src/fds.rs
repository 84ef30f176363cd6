//! Where a plugin puts the fds it keeps open in restored tasks: above every fd CRIU will
//! restore there, so that none takes a number CRIU restores later.

use std::ffi::c_int;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::fcntl::{FcntlArg, fcntl};
use nix::sys::resource::{Resource, getrlimit};

use crate::CriuSymbols;

/// Lowest fd number the plugin may use for fds it keeps open in restored task `pid` (its pid
/// in the image): one above every fd CRIU will restore there (CRIU's `find_unused_fd_pid`).
/// Outside CRIU, half the soft `RLIMIT_NOFILE` (at most 4096).
pub fn first_free_fd(pid: u32) -> c_int {
    let syms = CriuSymbols::get();
    if let Some(fd) = syms.unused_fd_of(pid as i32) {
        return fd;
    }
    if crate::symbols::lookup(c"find_unused_fd_pid").is_some() {
        log::warn!("CRIU knows no fds of pid {pid}; placing plugin fds high");
    }
    let soft = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) => soft.min(1 << 20) as c_int,
        Err(_) => 1024,
    };
    (soft / 2).clamp(3, 4096)
}

/// Moves `fd` to the lowest free number at or above `min` (close-on-exec), as CRIU's C
/// plugins do with `fd_next`, so it cannot take a number CRIU restores later.
pub fn place_fd(fd: OwnedFd, min: c_int) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() >= min {
        return Ok(fd);
    }
    let n = fcntl(&fd, FcntlArg::F_DUPFD_CLOEXEC(min))?;
    // SAFETY: `n` was just created by fcntl, for us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}
