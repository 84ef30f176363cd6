//! The process behind a KFD file, and its queues restarted from outside CRIU, on the real
//! kernel: what [`super::kernel::KernelKfd`] answers to [`KfdDevice::kfd_holder`] and
//! [`KfdDevice::unpause_holder`].
//!
//! CRIU hands a dump a copy of the process's KFD file, not the process. The process is found
//! among those CRIU traces (`TracerPid` in `/proc/PID/status`: the dumped tasks) by comparing
//! their open files with that copy (`kcmp`), before PROCESS_INFO pauses its queues, so that
//! the guardian hears of the process before there is anything to undo.
//!
//! amdkfd accepts a CRIU operation on a process's KFD file only from the process itself or
//! from the tracer of its main thread (`ptrace_parent(lead_thread) == current`). A CRIU that
//! ended lets its tracees go; the guardian then takes the file from the process
//! (`pidfd_getfd`), becomes the tracer of its main thread (`PTRACE_SEIZE`, which does not
//! stop it) on a thread of its own, issues UNPAUSE there, and ends that thread: the kernel lets
//! a tracee go when its tracer thread ends.
//!
//! [`KfdDevice::kfd_holder`]: super::device::KfdDevice::kfd_holder
//! [`KfdDevice::unpause_holder`]: super::device::KfdDevice::unpause_holder

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use nix::sys::ptrace;
use nix::unistd::Pid;

use super::device::KfdHolder;

/// The most files of one process compared with the KFD file.
const MAX_FDS: usize = 1 << 16;
/// The most UNPAUSEs issued for one process (amdkfd needs one; each PROCESS_INFO of the
/// stand-in module counts one more).
pub const MAX_UNPAUSES: u32 = 8;

/// The processes the calling process traces, as found at the last look: CRIU's tracees do not
/// change during a dump, so one look serves every KFD file.
#[derive(Debug, Default)]
pub struct Tracees(Mutex<Vec<i32>>);

/// Thread-group leaders whose tracer is this process (its main thread: CRIU's).
fn traced_by_me() -> Vec<i32> {
    let me = std::process::id() as i32;
    // `/proc` lists thread-group leaders only.
    criu_plugin::proc::all_pids()
        .into_iter()
        .filter(|&pid| criu_plugin::proc::tracer(pid) == Some(me))
        .collect()
}

/// Whether fd `a` of this process and fd `b` of `pid` are the same open file.
fn same_file(pid: i32, a: RawFd, b: RawFd) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    let me = libc::c_long::from(std::process::id() as i32);
    // SAFETY: kcmp(2) compares two processes' fds by number; it touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            me,
            libc::c_long::from(pid),
            KCMP_FILE,
            a as libc::c_ulong,
            b as libc::c_ulong,
        )
    };
    r == 0
}

/// The fd numbers of `pid` (at most [`MAX_FDS`]).
fn fds_of(pid: i32) -> Vec<RawFd> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.flatten()
                .take(MAX_FDS)
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

impl Tracees {
    /// The traced process that holds `file` (an open file of this process), and the number it
    /// holds it under; the processes are looked up again when none of the last look does.
    pub fn holder_of(&self, file: BorrowedFd<'_>) -> Option<KfdHolder> {
        let mut known = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for fresh in [false, true] {
            if fresh {
                *known = traced_by_me();
            }
            for &pid in known.iter() {
                let Some(fd) = fds_of(pid)
                    .into_iter()
                    .find(|&fd| same_file(pid, file.as_raw_fd(), fd))
                else {
                    continue;
                };
                let start = criu_plugin::proc::start_time(pid)?;
                return Some(KfdHolder { pid, start, fd });
            }
        }
        None
    }
}

/// The number of the first `/dev/kfd` file (device `kfd_rdev`) `pid` holds.
pub fn kfd_fd_number(pid: i32, kfd_rdev: u64) -> Option<RawFd> {
    fds_of(pid).into_iter().find(|fd| {
        nix::sys::stat::stat(format!("/proc/{pid}/fd/{fd}").as_str())
            .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFCHR && st.st_rdev == kfd_rdev)
    })
}

/// A copy of fd `fd` of the process of `pidfd`.
fn take_fd(pidfd: BorrowedFd<'_>, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd(2) takes a pidfd, an fd number of that process and flags; it
    // returns a new fd of ours (close-on-exec) or -1.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_getfd,
            pidfd.as_raw_fd(),
            fd,
            0 as libc::c_uint,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just installed this fd for us.
    Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

fn is_kfd(file: &OwnedFd, kfd_rdev: u64) -> bool {
    nix::sys::stat::fstat(file)
        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFCHR && st.st_rdev == kfd_rdev)
}

/// The process's KFD file: its fd `holder.fd`, or else the first `/dev/kfd` file it holds
/// (the number may have changed hands once the process ran again).
fn kfd_file_of(pidfd: BorrowedFd<'_>, holder: &KfdHolder, kfd_rdev: u64) -> io::Result<OwnedFd> {
    if let Ok(f) = take_fd(pidfd, holder.fd)
        && is_kfd(&f, kfd_rdev)
    {
        return Ok(f);
    }
    for fd in fds_of(holder.pid) {
        if let Ok(f) = take_fd(pidfd, fd)
            && is_kfd(&f, kfd_rdev)
        {
            return Ok(f);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("pid {} holds no /dev/kfd file any more", holder.pid),
    ))
}

/// Whether the process of `pidfd` has ended (its pidfd is readable).
fn ended(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = [nix::poll::PollFd::new(pidfd, nix::poll::PollFlags::POLLIN)];
    nix::poll::poll(&mut p, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0)
}

/// Restarts `holder`'s queues from a process that is neither it nor its tracer: UNPAUSE
/// (`unpause`, on the process's own KFD file) until KFD answers `EINVAL` (nothing paused) or
/// [`MAX_UNPAUSES`] went through, from a thread that traces the process meanwhile. Returns how
/// many went through.
pub fn unpause_from_outside(
    holder: &KfdHolder,
    pidfd: Option<BorrowedFd<'_>>,
    kfd_rdev: u64,
    unpause: &(dyn Fn(BorrowedFd<'_>) -> io::Result<()> + Sync),
) -> io::Result<u32> {
    let own;
    let pidfd = match pidfd {
        Some(p) => p,
        None => {
            own = criu_plugin::proc::pidfd(holder.pid)?;
            if criu_plugin::proc::start_time(holder.pid) != Some(holder.start) {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            own.as_fd()
        }
    };
    let file = kfd_file_of(pidfd, holder, kfd_rdev)?;
    let pid = holder.pid;
    let traced = || -> io::Result<u32> {
        ptrace::seize(Pid::from_raw(pid), ptrace::Options::empty()).map_err(|e| {
            let by = criu_plugin::proc::tracer(pid)
                .filter(|&t| t != 0)
                .map_or(String::new(), |t| format!(" (traced by pid {t})"));
            io::Error::new(
                io::Error::from(e).kind(),
                format!("cannot trace pid {pid}, which amdkfd requires: {e}{by}"),
            )
        })?;
        // The pid was the process's when the file was taken; it still is while it lives.
        if ended(pidfd) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        let mut done = 0;
        while done < MAX_UNPAUSES {
            match unpause(file.as_fd()) {
                Ok(()) => done += 1,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(e) if done == 0 => return Err(e),
                Err(_) => break,
            }
        }
        Ok(done)
    };
    // The thread's end lets the process go (no stop, no PTRACE_DETACH needed).
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name(format!("unpause-{pid}"))
            .spawn_scoped(s, traced)?
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the UNPAUSE thread panicked")))
    })
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use super::*;

    /// A child process of the test plays CRIU (the test's own process has threads, and a
    /// tracer is one thread): it starts a process holding one of its open files, and finds it
    /// by that file only once it traces it.
    #[test]
    fn the_traced_process_holding_the_same_open_file_is_found() {
        let reply = criu_plugin::child::run(Duration::from_secs(20), 512, || {
            let file = std::fs::File::open("/dev/null").unwrap();
            let other = std::fs::File::open("/dev/null").unwrap();
            let mut target = Command::new("sleep")
                .arg("30")
                .stdin(Stdio::from(file.try_clone().unwrap()))
                .spawn()
                .unwrap();
            let pid = target.id() as i32;
            let untraced = Tracees::default().holder_of(file.as_fd());
            ptrace::seize(Pid::from_raw(pid), ptrace::Options::empty()).unwrap();
            let tracees = Tracees::default();
            let found = tracees.holder_of(file.as_fd());
            let not_held = tracees.holder_of(other.as_fd());
            let start = criu_plugin::proc::start_time(pid);
            let _ = target.kill();
            let _ = target.wait();
            format!("{pid} {start:?} {untraced:?} {found:?} {not_held:?}").into_bytes()
        })
        .unwrap();
        let reply = String::from_utf8(reply).unwrap();
        let (pid, rest) = reply.split_once(' ').unwrap();
        let (start, rest) = rest.split_once(' ').unwrap();
        let start = start.trim_start_matches("Some(").trim_end_matches(')');
        let want = format!("KfdHolder {{ pid: {pid}, start: {start}, fd: 0 }}");
        assert_eq!(rest, format!("None Some({want}) None"), "{reply}");
    }
}
