//! One CRIU (or `criu-gpu`) at a time per CUDA process.
//!
//! Two CRIUs dumping the same process would both lock, checkpoint and put it back, each from
//! its own idea of the state it found; interleaved, they can leave it locked for good (the
//! loser locks it, fails to seize it, then cannot unlock what the winner checkpointed). So a
//! dump holds a lock on a file named after the process (pid and start time, which survive
//! nothing but that process) from `PAUSE_DEVICES` to `exit`, and a second dump of the same
//! process is refused before it touches the driver; `criu-gpu suspend` and `resume` hold the
//! same claims. The lock is an open-file-description lock (`F_OFD_SETLK`): it is held while any
//! descriptor of that open file lives, so the guardian that puts processes back after CRIU's
//! death holds the claims it was sent until it is done, a helper child holds them only while it
//! runs (it dies with CRIU), and a holder that dies releases them by itself (the kernel). A
//! claim removes its file when it ends, and a claim taken on a file that was removed meanwhile
//! is retried on the new one.
//!
//! The file records who holds the claim ([`holders`]): the CRIU or `criu-gpu` that took it,
//! and the guardian it was handed to ([`Claim::record_holder`]). A refused claim
//! ([`ClaimError::Busy`]) names the holder and what to do: a stopped holder holds the process
//! until it is continued or ended, which the operator is told.
//!
//! Where the claims live: [`LOCK_DIR`] (`/run`, per boot and root's), or, where that cannot be
//! used (a read-only or full `/run`, something else in the directory's place), [`FALLBACK_DIR`]
//! (`/dev/shm`, a `tmpfs` of its own). Every user, whichever directory it took its claim in,
//! then looks for a lock on the same process in the other one, read-only (`F_OFD_GETLK` needs
//! no write access): a dump that could only claim in `/dev/shm` and a `criu-gpu` that claimed in
//! `/run` still see each other. Each looks after taking its own lock, so of two users at the
//! same moment at least one sees the other. A directory is used only if it is a real directory
//! of this user that no one else may write to (`/dev/shm` is everyone's). When neither can be
//! used, no claim is made and the caller refuses to act ([`ClaimError::Unavailable`]): running
//! unclaimed could race another user of the same process.

mod holders;

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag};
use nix::sys::stat::Mode;

pub use holders::{HeldBy, Holder, Role};

/// Where the lock files live: `/run` is per boot and root's.
pub const LOCK_DIR: &str = "/run/criu-gpu-plugin";
/// Where they live when [`LOCK_DIR`] cannot be used.
pub const FALLBACK_DIR: &str = "/dev/shm/criu-gpu-plugin";

/// Tries per directory when the lock file keeps being replaced under us.
const TRIES: usize = 16;

/// A held claim on one process; released on drop (once no other process holds a copy of
/// its descriptor, see [`Claim::fd`]).
#[derive(Debug)]
pub struct Claim {
    file: Option<File>,
    path: PathBuf,
    holders: Vec<Holder>,
    /// Why [`LOCK_DIR`] was not used, when the claim lives in [`FALLBACK_DIR`].
    fallback_from: Option<DirProblem>,
}

impl Claim {
    /// Lets go of this process's copy of the claim but keeps the file, for a guardian that
    /// holds the lock on it still: removing the file would let a new claim take a new one.
    /// A file left so is removed by `sweep` once its process has ended.
    pub fn leave(mut self) {
        drop(self.file.take());
        self.path = PathBuf::new();
    }

    /// The lock's descriptor: whoever holds a copy holds the claim (the guardian).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.file.as_ref().map(|f| f.as_fd())
    }

    /// Adds `holder` to the claim's record (the guardian that was handed a copy of
    /// [`Claim::fd`]), so that a refusal names it.
    pub fn record_holder(&mut self, holder: Holder) -> io::Result<()> {
        if !self.holders.contains(&holder) {
            self.holders.push(holder);
        }
        match &self.file {
            Some(f) => write_record(f, &self.holders),
            None => Err(io::Error::from_raw_os_error(libc::EBADF)),
        }
    }

    /// Why the claim is not in [`LOCK_DIR`], when it was taken in [`FALLBACK_DIR`].
    pub fn fallback_from(&self) -> Option<&DirProblem> {
        self.fallback_from.as_ref()
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Removed while still locked, then unlocked: whoever opened it meanwhile sees it gone
        // and retries on a new file.
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
        drop(self.file.take());
    }
}

/// A lock directory that could not be used, and why.
#[derive(Debug)]
pub struct DirProblem {
    pub dir: PathBuf,
    pub error: io::Error,
}

impl std::fmt::Display for DirProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.error.raw_os_error() {
            Some(n) => {
                let e = Errno::from_raw(n);
                write!(f, "{}: {} ({e:?})", self.dir.display(), e.desc())
            }
            None => write!(f, "{}: {}", self.dir.display(), self.error),
        }
    }
}

/// Why a claim was not taken.
#[derive(Debug)]
pub enum ClaimError {
    /// Someone else holds it: who, as far as its record tells.
    Busy(HeldBy),
    /// No lock directory could be used (each with why): no claim can be made on this machine.
    Unavailable(Vec<DirProblem>),
}

impl ClaimError {
    /// The directories that could not be used, in words.
    pub fn problems(problems: &[DirProblem]) -> String {
        let v: Vec<String> = problems.iter().map(ToString::to_string).collect();
        v.join("; ")
    }
}

/// Claims process `pid` (started at `start`) for this CRIU.
pub fn claim(pid: i32, start: u64) -> Result<Claim, ClaimError> {
    claim_as(pid, start, Role::Criu)
}

/// Claims process `pid` (started at `start`) for this process, recorded as `role`.
pub fn claim_as(pid: i32, start: u64, role: Role) -> Result<Claim, ClaimError> {
    let dirs = [Path::new(LOCK_DIR), Path::new(FALLBACK_DIR)];
    claim_in(&dirs, pid, start, Holder::this(role))
}

/// Claims in the first usable of `dirs`, after making sure no lock on the process is held in
/// any of the others.
fn claim_in(
    dirs: &[&Path],
    pid: i32,
    start: u64,
    taker: Option<Holder>,
) -> Result<Claim, ClaimError> {
    let mut problems = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let file = match lock_in(dir, pid, start) {
            Ok(Locked::Ours(f)) => f,
            Ok(Locked::Theirs(held)) => return Err(ClaimError::Busy(held)),
            Err(error) => {
                problems.push(DirProblem {
                    dir: dir.to_path_buf(),
                    error,
                });
                continue;
            }
        };
        let claim = Claim {
            file: Some(file),
            path: lock_path(dir, pid, start),
            holders: taker.into_iter().collect(),
            fallback_from: problems.into_iter().next(),
        };
        // Ours now; anyone who locked elsewhere before we did is seen here (and sees us if
        // they look after this).
        for (j, other) in dirs.iter().enumerate() {
            if j != i
                && let Some(held) = held_in(other, pid, start)
            {
                return Err(ClaimError::Busy(held));
            }
        }
        if let Some(f) = &claim.file
            && let Err(e) = write_record(f, &claim.holders)
        {
            log::debug!("cuda: pid {pid}: the claim's holder is not recorded ({e})");
        }
        return Ok(claim);
    }
    Err(ClaimError::Unavailable(problems))
}

fn lock_path(dir: &Path, pid: i32, start: u64) -> PathBuf {
    dir.join(format!("cuda-{pid}-{start}.lock"))
}

/// What one lock directory gave.
enum Locked {
    Ours(File),
    Theirs(HeldBy),
}

/// Takes the lock on process `pid`'s file in `dir`, made if need be.
fn lock_in(dir: &Path, pid: i32, start: u64) -> io::Result<Locked> {
    usable_dir(dir, true)?;
    let path = lock_path(dir, pid, start);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    for _ in 0..TRIES {
        // O_NOFOLLOW so that a planted link is refused.
        let flags = OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        let fd = nix::fcntl::open(
            c.as_c_str(),
            flags | OFlag::O_NONBLOCK,
            Mode::from_bits_truncate(0o600),
        )?;
        let file = File::from(fd);
        // F_OFD_SETLK does not block.
        let locked = match nix::fcntl::fcntl(&file, FcntlArg::F_OFD_SETLK(&whole(libc::F_WRLCK))) {
            Ok(_) => true,
            Err(Errno::EAGAIN | Errno::EACCES) => false,
            Err(e) => return Err(e.into()),
        };
        // The file may have been removed (a claim ending) between our open and our lock: then
        // neither a lock nor a refusal on it means anything; try the new one.
        if !still_named(&path, &file) {
            continue;
        }
        if !locked {
            return Ok(Locked::Theirs(HeldBy::from_record(&read_record(&file))));
        }
        return Ok(Locked::Ours(file));
    }
    Err(io::Error::other("the lock file keeps being replaced"))
}

/// Who holds a lock on process `pid`'s file in `dir`, looked at without writing anything;
/// `None` when no one does (or the directory is not ours, or holds no such file).
fn held_in(dir: &Path, pid: i32, start: u64) -> Option<HeldBy> {
    usable_dir(dir, false).ok()?;
    let path = lock_path(dir, pid, start);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    for _ in 0..TRIES {
        let flags = OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK;
        let file = File::from(nix::fcntl::open(c.as_c_str(), flags, Mode::empty()).ok()?);
        let mut probe = whole(libc::F_WRLCK);
        nix::fcntl::fcntl(&file, FcntlArg::F_OFD_GETLK(&mut probe)).ok()?;
        if !still_named(&path, &file) {
            continue;
        }
        if probe.l_type == libc::F_UNLCK as libc::c_short {
            return None;
        }
        return Some(HeldBy::from_record(&read_record(&file)));
    }
    None
}

/// A lock over the whole file (start 0, length 0), `l_pid` 0 as OFD locks need.
fn whole(kind: libc::c_int) -> libc::flock {
    libc::flock {
        l_type: kind as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    }
}

/// Checks that `dir` is a lock directory to trust: a real directory (no link) of this user
/// that no one else may write to; made (mode 0700) when `make` and missing.
fn usable_dir(dir: &Path, make: bool) -> io::Result<()> {
    if make {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let m = std::fs::symlink_metadata(dir)?;
    if !m.is_dir() {
        return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me || m.mode() & 0o022 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "owned by uid {} with mode {:o}, not a directory of uid {me} that only it may write",
                m.uid(),
                m.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Whether `path` still names the file `file`.
fn still_named(path: &Path, file: &File) -> bool {
    match (std::fs::symlink_metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Replaces the record in the lock file `file` with `holders`.
fn write_record(file: &File, holders: &[Holder]) -> io::Result<()> {
    let text = holders::encode(holders);
    file.set_len(0)?;
    file.write_all_at(text.as_bytes(), 0)
}

/// The record in `file`, at most [`holders::MAX_RECORD`] bytes of it.
fn read_record(file: &File) -> Vec<u8> {
    let mut buf = vec![0u8; holders::MAX_RECORD];
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    buf.truncate(n);
    buf
}

/// Removes lock files of processes that no longer exist (best effort, at most `limit` per
/// directory).
pub fn sweep(limit: usize) {
    for dir in [LOCK_DIR, FALLBACK_DIR] {
        if usable_dir(Path::new(dir), false).is_ok() {
            sweep_dir(Path::new(dir), limit);
        }
    }
}

fn sweep_dir(dir: &Path, limit: usize) {
    let Ok(rd) = std::fs::read_dir(dir) else {
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
mod tests;
