//! Other processes, as a plugin sees them: pidfds, start times and bounded `/proc` reads.
//!
//! A pid names a process only while that process lives; a pidfd names it for good. Whatever
//! acts on another process (the guardian, a helper) holds it by a pidfd opened *before* it
//! checks the process's start time: when the start time matches, the pidfd is that process's,
//! since a pid is not reused while the process it names lives.

use std::io;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};

/// The most bytes read of one small `/proc` file (`stat`, `status`, `children`).
const SMALL: u64 = 64 * 1024;
/// The most bytes of a `maps` file looked at.
const MAX_MAPS_BYTES: u64 = 64 << 20;
/// The most entries of one `/proc` listing looked at (threads, children, processes).
pub const MAX_LISTED: usize = 1 << 16;

/// A small `/proc` file as text (at most 64 KiB); bytes that are no UTF-8 (a command name is
/// any bytes, and the kernel cuts it at 15 bytes, in the middle of a character too) become
/// U+FFFD, never a failure.
pub fn read_small(path: &Path) -> Option<String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(SMALL).read_to_end(&mut bytes))
        .ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The value of line `field` (with its colon, e.g. `"PPid:"`) of `/proc/PID/status`, trimmed.
pub fn status_field(pid: i32, field: &str) -> Option<String> {
    let text = read_small(Path::new(&format!("/proc/{pid}/status")))?;
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().to_string())
}

/// The fields of `/proc/PID/stat` after the command name (which may hold spaces and
/// parentheses: they follow the last `)`), the state first.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let text = read_small(Path::new(&format!("/proc/{pid}/stat")))?;
    let rest = &text[text.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// The start time of `pid` (field 22 of `/proc/PID/stat`, clock ticks since boot): with the
/// pid, it names one process even after its pid is reused.
pub fn start_time(pid: i32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// The one-letter scheduler state of `pid` (`R`, `S`, `T` stopped, `t` traced, `Z`, ...).
pub fn state(pid: i32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

/// Whether `pid` is stopped by a signal (`SIGSTOP` and the like: state `T`): it does nothing
/// until someone continues it.
pub fn stopped(pid: i32) -> bool {
    state(pid) == Some('T')
}

/// The parent of `pid`.
pub fn parent(pid: i32) -> Option<i32> {
    status_field(pid, "PPid:")?.parse().ok()
}

/// The process's tracer, 0 when none.
pub fn tracer(pid: i32) -> Option<i32> {
    status_field(pid, "TracerPid:")?.parse().ok()
}

/// The children of every thread of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten().take(MAX_LISTED) {
        let Some(children) = read_small(&t.path().join("children")) else {
            continue;
        };
        out.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok()),
        );
        if out.len() >= MAX_LISTED {
            break;
        }
    }
    out
}

/// `pid` and all its descendants, root first (at most [`MAX_LISTED`]).
pub fn tree(pid: i32) -> Vec<i32> {
    let mut out = vec![pid];
    let mut seen = std::collections::HashSet::from([pid]);
    let mut i = 0;
    while i < out.len() && out.len() < MAX_LISTED {
        let p = out[i];
        i += 1;
        for c in children(p) {
            if seen.insert(c) {
                out.push(c);
            }
        }
    }
    out
}

/// Every pid in `/proc` (at most [`MAX_LISTED`]).
pub fn all_pids() -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .take(MAX_LISTED)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .collect()
}

/// Whether `pid` maps the file with inode `ino` whose path (as `maps` shows it) starts with
/// `prefix`.
pub fn maps_file(pid: i32, ino: u64, prefix: &str) -> bool {
    let Ok(f) = std::fs::File::open(format!("/proc/{pid}/maps")) else {
        return false;
    };
    let want = ino.to_string();
    let reader = io::BufReader::new(f.take(MAX_MAPS_BYTES));
    io::BufRead::split(reader, b'\n')
        .map_while(Result::ok)
        .any(|line| {
            let text = String::from_utf8_lossy(&line);
            // address perms offset dev inode path
            let mut f = text.splitn(6, ' ');
            let inode = f.nth(4);
            let path = f.next().map(str::trim_start);
            inode == Some(want.as_str()) && path.is_some_and(|p| p.starts_with(prefix))
        })
}

/// A pidfd of process `pid` (`pidfd_open(2)`, close-on-exec).
pub fn pidfd(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; it returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just created this fd for us; pidfd_open's fd is close-on-exec.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A pidfd of `pid` that is known to name the process that started at `start`.
pub fn pidfd_of(pid: i32, start: u64) -> Option<OwnedFd> {
    if pid <= 0 {
        return None;
    }
    let fd = pidfd(pid).ok()?;
    (start_time(pid) == Some(start)).then_some(fd)
}

/// Sends `signal` to the process of pidfd `fd` (never to a reused pid).
pub fn signal(fd: &OwnedFd, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: pidfd_send_signal on a pidfd we own, without siginfo.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0 as libc::c_uint,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the process of pidfd `fd` has ended.
pub fn ended(fd: &OwnedFd) -> bool {
    readable(fd.as_fd(), 0)
}

/// Whether `fd` is readable within `ms` milliseconds, `-1` for no limit (a pidfd: its
/// process has ended).
pub fn readable(fd: BorrowedFd<'_>, ms: i32) -> bool {
    let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::NONE);
    loop {
        let mut pfd = [PollFd::new(fd, PollFlags::POLLIN)];
        match nix::poll::poll(&mut pfd, timeout) {
            Err(Errno::EINTR) => continue,
            r => return r.is_ok_and(|n| n > 0),
        }
    }
}

/// Kills `root` and every descendant of it with `SIGKILL`. Each child is held by a pidfd, then
/// checked to be still the child of a process held before it, so nothing reparented meanwhile
/// escapes notice and no reused pid is hit. Returns how many were signalled.
pub fn kill_tree(root: &OwnedFd, root_pid: i32) -> usize {
    let mut held: Vec<(i32, OwnedFd)> = Vec::new();
    let mut queue = vec![root_pid];
    while let Some(parent_pid) = queue.pop() {
        for c in children(parent_pid) {
            if held.len() >= MAX_LISTED || c == root_pid || held.iter().any(|(p, _)| *p == c) {
                continue;
            }
            let Ok(fd) = pidfd(c) else {
                continue;
            };
            if parent(c) == Some(parent_pid) {
                held.push((c, fd));
                queue.push(c);
            }
        }
    }
    let mut ended = usize::from(signal(root, libc::SIGKILL).is_ok());
    for (_, fd) in &held {
        ended += usize::from(signal(fd, libc::SIGKILL).is_ok());
    }
    ended
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = std::process::id() as i32;
        assert!(start_time(me).is_some());
        assert_eq!(start_time(-1), None);
        assert!(matches!(state(me), Some('R' | 'S')));
        assert!(!stopped(me));
        assert_eq!(tracer(me), Some(0));
        assert!(parent(me).is_some());
        assert!(all_pids().contains(&me));
        assert!(pidfd_of(me, start_time(me).unwrap()).is_some());
        assert!(pidfd_of(me, start_time(me).unwrap() + 1).is_none());
    }

    #[test]
    fn a_command_name_that_is_no_utf8_is_read() {
        // A name cut in the middle of a character, as the kernel cuts at 15 bytes.
        let name = b"abcdefghijklmn\xc3";
        let me = std::process::id() as i32;
        let r = crate::child::run(std::time::Duration::from_secs(10), 64, || {
            let mut buf = [0u8; 16];
            buf[..name.len()].copy_from_slice(name);
            // SAFETY: PR_SET_NAME reads at most 16 bytes of a NUL-terminated buffer.
            unsafe { libc::prctl(libc::PR_SET_NAME, buf.as_ptr()) };
            let me = std::process::id() as i32;
            vec![u8::from(start_time(me).is_some() && parent(me).is_some())]
        });
        assert_eq!(r.unwrap(), vec![1], "pid {me}'s child");
    }

    #[test]
    fn a_tree_is_killed_whole() {
        // sh starts a sleep and waits: a root with a child.
        let mut root = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let pid = root.id() as i32;
        let t = std::time::Instant::now();
        while children(pid).is_empty() && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let kids = children(pid);
        assert_eq!(kids.len(), 1, "{kids:?}");
        assert_eq!(tree(pid), vec![pid, kids[0]]);
        let fd = pidfd(pid).unwrap();
        assert_eq!(kill_tree(&fd, pid), 2);
        root.wait().unwrap();
        // The orphaned sleep is reaped by init, which may take a moment here.
        assert!(readable(fd.as_fd(), 1000));
    }
}
