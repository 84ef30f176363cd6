//! One CRIU at a time per CUDA process.
//!
//! Two CRIUs dumping the same process would both lock, checkpoint and put it back, each from
//! its own idea of the state it found; interleaved, they can leave it locked for good (the
//! loser locks it, fails to seize it, then cannot unlock what the winner checkpointed). So a
//! dump holds a lock on a file named after the process (pid and start time, which survive
//! nothing but that process) from `PAUSE_DEVICES` to `exit`, and a second dump of the same
//! process is refused before it touches the driver. The lock is an open-file-description lock
//! (`F_OFD_SETLK`): it is held while any descriptor of that open file lives, so the guardian
//! that puts processes back after CRIU's death holds the claims it was sent until it is done,
//! and a helper child holds them only while it runs (it dies with CRIU). A claim removes its
//! file when it ends, and a claim taken on a file that was removed meanwhile is retried on the
//! new one.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag};
use nix::sys::stat::Mode;

/// Where the lock files live: `/run` is per boot and root's.
const LOCK_DIR: &str = "/run/criu-gpu-plugin";

/// A held claim on one process; released on drop (once no other process holds a copy of
/// its descriptor, see [`Claim::fd`]).
#[derive(Debug)]
pub struct Claim {
    fd: Option<OwnedFd>,
    path: PathBuf,
}

impl Claim {
    /// Lets go of this process's copy of the claim but keeps the file, for a guardian that
    /// holds the lock on it still: removing the file would let a new claim take a new one.
    /// A file left so is removed by `sweep` once its process has ended.
    pub fn leave(mut self) {
        drop(self.fd.take());
        self.path = PathBuf::new();
    }

    /// The lock's descriptor: whoever holds a copy holds the claim (the guardian).
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.fd.as_ref().map(|f| f.as_fd())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Removed while still locked, then unlocked: whoever opened it meanwhile sees it gone
        // and retries on a new file.
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
        drop(self.fd.take());
    }
}

/// Why a claim was not taken.
#[derive(Debug)]
pub enum ClaimError {
    /// Another CRIU holds it.
    Busy,
    /// No lock could be made here (read-only `/run`, ...): the dump goes on unguarded.
    Unavailable(io::Error),
}

fn lock_path(dir: &Path, pid: i32, start: u64) -> PathBuf {
    dir.join(format!("cuda-{pid}-{start}.lock"))
}

/// Claims process `pid` (started at `start`) for this CRIU.
pub fn claim(pid: i32, start: u64) -> Result<Claim, ClaimError> {
    claim_in(Path::new(LOCK_DIR), pid, start)
}

fn claim_in(dir: &Path, pid: i32, start: u64) -> Result<Claim, ClaimError> {
    use std::os::unix::fs::DirBuilderExt;
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true).mode(0o700);
    b.create(dir).map_err(ClaimError::Unavailable)?;
    let path = lock_path(dir, pid, start);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| ClaimError::Unavailable(io::Error::other(e)))?;
    for _ in 0..16 {
        let (fd, locked) = lock_file(&c)?;
        // The file may have been removed (a claim ending) between our open and our lock: then
        // neither a lock nor a refusal on it means anything; try the new one.
        if !still_named(&path, &fd) {
            continue;
        }
        if !locked {
            return Err(ClaimError::Busy);
        }
        return Ok(Claim { fd: Some(fd), path });
    }
    Err(ClaimError::Unavailable(io::Error::other(
        "the lock file keeps being replaced",
    )))
}

/// Device and inode of the file behind `fd`, from the fd itself.
fn fd_metadata(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    let st = nix::sys::stat::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// Whether `path` still names the file behind `fd`.
fn still_named(path: &Path, fd: &OwnedFd) -> bool {
    match (std::fs::metadata(path), fd_metadata(fd)) {
        (Ok(a), Ok((dev, ino))) => a.dev() == dev && a.ino() == ino,
        _ => false,
    }
}

/// Opens the lock file `c` and tries to lock it: the fd, and whether the lock was taken.
fn lock_file(c: &std::ffi::CStr) -> Result<(OwnedFd, bool), ClaimError> {
    // O_NOFOLLOW so that a planted link is refused.
    let flags = OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
    let fd = nix::fcntl::open(
        c,
        flags | OFlag::O_NONBLOCK,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(|e| ClaimError::Unavailable(e.into()))?;
    // The whole file (start 0, length 0), l_pid 0 as OFD locks need.
    let fl = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    // F_OFD_SETLK does not block.
    match nix::fcntl::fcntl(&fd, FcntlArg::F_OFD_SETLK(&fl)) {
        Ok(_) => Ok((fd, true)),
        Err(Errno::EAGAIN | Errno::EACCES) => Ok((fd, false)),
        Err(e) => Err(ClaimError::Unavailable(e.into())),
    }
}

/// Removes lock files of processes that no longer exist (best effort, at most `limit`).
pub fn sweep(limit: usize) {
    let Ok(rd) = std::fs::read_dir(LOCK_DIR) else {
        return;
    };
    for e in rd.flatten().take(limit) {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("cuda-"))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // A file whose process is gone can be held by nobody who still needs it.
        let stale = e
            .metadata()
            .map(|m| m.nlink() == 1 && !Path::new(&format!("/proc/{pid}")).exists())
            .unwrap_or(false);
        if stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether another process (a helper child, as a second CRIU would be) gets the claim.
    fn busy_elsewhere(dir: &Path, pid: i32, start: u64) -> bool {
        let r = criu_plugin::child::run(std::time::Duration::from_secs(10), 8, || {
            vec![matches!(claim_in(dir, pid, start), Err(ClaimError::Busy)) as u8]
        })
        .unwrap();
        r == [1]
    }

    #[test]
    fn a_second_claim_is_refused_until_the_first_ends() {
        let dir = std::env::temp_dir().join(format!("cuda-claims-{}", std::process::id()));
        let a = claim_in(&dir, 42, 7).unwrap();
        assert!(busy_elsewhere(&dir, 42, 7));
        // Another process (or the same pid reused) is another claim.
        assert!(!busy_elsewhere(&dir, 42, 8));
        drop(a);
        assert!(
            !lock_path(&dir, 42, 7).exists(),
            "an ended claim leaves no file"
        );
        assert!(!busy_elsewhere(&dir, 42, 7));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
