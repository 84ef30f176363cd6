//! One CRIU at a time per CUDA process.
//!
//! Two CRIUs dumping the same process would both lock, checkpoint and put it back, each from
//! its own idea of the state it found; interleaved, they can leave it locked for good (the
//! loser locks it, fails to seize it, then cannot unlock what the winner checkpointed). So a
//! dump holds an advisory lock (`flock`) on a file named after the process (pid and start
//! time, which survive nothing but that process) from `PAUSE_DEVICES` to `exit`, and a second
//! dump of the same process is refused before it touches the driver. The lock goes with the
//! fd, so a CRIU that dies releases it; a claim removes its file when it ends, and a claim
//! taken on a file that was removed meanwhile is retried on the new one.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where the lock files live: `/run` is per boot and root's.
const LOCK_DIR: &str = "/run/criu-gpu-plugin";

/// A held claim on one process; released on drop.
#[derive(Debug)]
pub struct Claim {
    fd: Option<OwnedFd>,
    path: PathBuf,
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Removed while still locked, then unlocked: whoever opened it meanwhile sees it gone
        // and retries on a new file.
        let _ = std::fs::remove_file(&self.path);
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
        let fd = lock_file(&c)?;
        // The file may have been removed (a claim ending) between our open and our lock.
        let same = match (std::fs::metadata(&path), fd_metadata(&fd)) {
            (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
            _ => false,
        };
        if same {
            return Ok(Claim { fd: Some(fd), path });
        }
    }
    Err(ClaimError::Unavailable(io::Error::other(
        "the lock file keeps being replaced",
    )))
}

fn fd_metadata(fd: &OwnedFd) -> io::Result<std::fs::Metadata> {
    std::fs::File::from(fd.try_clone()?).metadata()
}

/// Opens and locks the lock file `c`.
fn lock_file(c: &std::ffi::CStr) -> Result<OwnedFd, ClaimError> {
    // SAFETY: open with a NUL-terminated path; O_NOFOLLOW so that a planted link is refused.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            0o600,
        )
    };
    if fd < 0 {
        return Err(ClaimError::Unavailable(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            ClaimError::Busy
        } else {
            ClaimError::Unavailable(e)
        });
    }
    Ok(fd)
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

    #[test]
    fn a_second_claim_is_refused_until_the_first_ends() {
        let dir = std::env::temp_dir().join(format!("cuda-claims-{}", std::process::id()));
        let a = claim_in(&dir, 42, 7).unwrap();
        assert!(matches!(claim_in(&dir, 42, 7), Err(ClaimError::Busy)));
        // Another process (or the same pid reused) is another claim.
        let b = claim_in(&dir, 42, 8).unwrap();
        drop(a);
        assert!(
            !lock_path(&dir, 42, 7).exists(),
            "an ended claim leaves no file"
        );
        let _c = claim_in(&dir, 42, 7).unwrap();
        drop(b);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
