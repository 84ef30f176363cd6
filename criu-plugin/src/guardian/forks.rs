//! A restore's tasks, told apart from every other process by proof, never by likeness.
//!
//! CRIU forks a restore's tasks from its own process and tells plugins of none of them before
//! the end of the restore. A process started since CRIU is one of this CRIU's forks when:
//!
//! - it is a child of CRIU's process (the root task of a plain restore, or of one into a new
//!   pid namespace), for as long as CRIU lives;
//! - it is a child of CRIU's parent that CRIU traces: with `--restore-sibling` (how runc
//!   restores) CRIU forks the root task with `CLONE_PARENT` and seizes it with `ptrace` at
//!   once, and traces it until it lets the restored tree go
//!   ([`crate::criu_internals::RESTORE_SIBLING_ROOT_SEIZED`]);
//! - it maps the run's [`ForkMarker`], a shared page CRIU's process mapped before forking
//!   anything: every fork inherits it, until CRIU's restorer code unmaps CRIU's memory in it
//!   just before the task becomes the restored program again
//!   ([`crate::criu_internals::RESTORER_UNMAPS_CRIU_MEMORY`]). No other process can map it.
//!   This one still holds after CRIU has died.
//!
//! And the descendants of such a process are the restore's tasks too (found through the
//! kernel's `children` lists, each held by a pidfd before it is checked). Where the restore
//! shares CRIU's pid namespace its tasks get the image's pids, but a pid says nothing here:
//! another process (another CRIU restoring the same images, a daemon that took the pid) may
//! hold it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::proc;

/// The name the marker's memory file shows in `/proc/PID/maps` (after `/memfd:`).
const MARKER_NAME: &str = "criu-gpu-plugin-restore";

/// The marker's identity, as `/proc/PID/maps` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkerId {
    inode: u64,
}

/// A page of shared memory mapped in CRIU's process for one restore: the processes CRIU forks
/// from then on inherit it (see the module docs). Unmapped when dropped.
#[derive(Debug)]
pub struct ForkMarker {
    addr: std::ptr::NonNull<libc::c_void>,
    len: usize,
    id: MarkerId,
}

// SAFETY: the mapping is never read or written through `addr`; the pointer only unmaps it.
unsafe impl Send for ForkMarker {}

impl ForkMarker {
    /// Maps the marker in the calling process (CRIU's, before it forks the restore's tasks).
    pub fn create() -> io::Result<ForkMarker> {
        let name = std::ffi::CString::new(MARKER_NAME).map_err(io::Error::other)?;
        // SAFETY: memfd_create takes a NUL-terminated name and flags; returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just created this fd for us.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sysconf has no preconditions.
        let len = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .unwrap_or(4096)
            .max(4096);
        nix::unistd::ftruncate(&fd, len as libc::off_t)?;
        let inode = nix::sys::stat::fstat(&fd)?.st_ino;
        // SAFETY: a new shared, read-only mapping of our own memory file, at an address the
        // kernel chooses; nothing in this process reads or writes it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let addr = std::ptr::NonNull::new(addr).ok_or_else(|| io::Error::other("mmap gave 0"))?;
        // The mapping keeps the file; the descriptor closes here, so no fork inherits it.
        drop(fd);
        Ok(ForkMarker {
            addr,
            len,
            id: MarkerId { inode },
        })
    }

    /// What identifies the marker in other processes.
    pub fn id(&self) -> MarkerId {
        self.id
    }
}

impl Drop for ForkMarker {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `create` made, which nothing else refers to.
        unsafe { libc::munmap(self.addr.as_ptr(), self.len) };
    }
}

/// Whether `pid` maps the marker `id`.
pub fn holds_marker(pid: i32, id: MarkerId) -> bool {
    proc::maps_file(pid, id.inode, &format!("/memfd:{MARKER_NAME}"))
}

/// One CRIU's forks.
#[derive(Debug, Clone)]
pub struct CriuForks {
    /// CRIU's pid.
    pub criu: i32,
    /// CRIU's start time: its forks started at or after it.
    pub criu_start: u64,
    /// The run's marker (`None`: none could be made; then only ancestry proves).
    pub marker: Option<MarkerId>,
}

impl CriuForks {
    /// For the calling process (CRIU's), with `marker` mapped in it.
    pub fn of_this_process(marker: Option<&ForkMarker>) -> CriuForks {
        let criu = std::process::id() as i32;
        CriuForks {
            criu,
            criu_start: proc::start_time(criu).unwrap_or(u64::MAX),
            marker: marker.map(ForkMarker::id),
        }
    }

    fn started_since(&self, pid: i32) -> Option<u64> {
        proc::start_time(pid).filter(|&s| s >= self.criu_start)
    }

    /// Whether `pid` maps this run's marker (and started since CRIU).
    pub fn marked(&self, pid: i32) -> bool {
        self.marker.is_some_and(|id| {
            pid != self.criu && self.started_since(pid).is_some() && holds_marker(pid, id)
        })
    }

    /// The roots of what CRIU has forked so far, `(pid, start)`: its children, and its
    /// parent's children that it traces or that hold the marker. Valid while CRIU lives.
    /// `skip` leaves pids out (the caller's own, those known already).
    pub fn roots(&self, skip: &dyn Fn(i32) -> bool) -> Vec<(i32, u64)> {
        let mut found = Vec::new();
        for pid in proc::children(self.criu) {
            if pid == self.criu || skip(pid) {
                continue;
            }
            if let Some(start) = self.started_since(pid) {
                found.push((pid, start));
            }
        }
        // With --restore-sibling the root task is a child of CRIU's parent. Not looked for
        // where that parent is init: every orphan on the host would be a candidate.
        let Some(parent) = proc::parent(self.criu).filter(|&p| p > 1) else {
            return found;
        };
        for pid in proc::children(parent) {
            if pid == self.criu || skip(pid) {
                continue;
            }
            let Some(start) = self.started_since(pid) else {
                continue;
            };
            if proc::tracer(pid) == Some(self.criu) || self.marked(pid) {
                found.push((pid, start));
            }
        }
        found
    }

    /// Every process that still maps the marker (the forks still in CRIU's code, whoever
    /// their parent is now), but those `skip` leaves out.
    pub fn marked_anywhere(&self, skip: &dyn Fn(i32) -> bool) -> Vec<(i32, u64)> {
        if self.marker.is_none() {
            return Vec::new();
        }
        proc::all_pids()
            .into_iter()
            .filter(|&p| !skip(p) && self.marked(p))
            .filter_map(|p| Some((p, proc::start_time(p)?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_holds_the_marker_and_an_exec_does_not() {
        let marker = ForkMarker::create().unwrap();
        let me = std::process::id() as i32;
        assert!(holds_marker(me, marker.id()));
        // A program started by exec has a new address space: no marker.
        let mut other = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = other.id() as i32;
        assert!(!holds_marker(pid, marker.id()));
        let forks = CriuForks::of_this_process(Some(&marker));
        // A child of this process started since it: a root, but no marker.
        assert!(forks.roots(&|_| false).iter().any(|&(p, _)| p == pid));
        assert!(!forks.marked(pid));
        // (Other tests of this binary fork it meanwhile: their forks hold the marker.)
        assert!(
            !forks
                .marked_anywhere(&|p| p == me)
                .iter()
                .any(|&(p, _)| p == pid)
        );
        other.kill().unwrap();
        other.wait().unwrap();
        drop(marker);
        // Unmapped: the marker is gone from this process too.
        let id = forks.marker.unwrap();
        assert!(!holds_marker(me, id));
    }
}
