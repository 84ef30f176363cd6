//! The guardian's own process: how it starts, its loop, and what it does when CRIU ends.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::time::Instant;

use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::stat::{Mode, SFlag};

use super::protocol::{self, Message, Received};
use super::{Duty, MAX_WATCHED, Watched};
use crate::proc;

/// The starter: a short-lived child of CRIU's that forks the guardian (an ordinary child, so
/// that whoever adopts it reaps it), tells CRIU its pid with a pidfd attached, and exits.
/// Never returns.
pub(super) fn start_guardian(
    sock: OwnedFd,
    criu_fd: OwnedFd,
    criu: libc::pid_t,
    duty: impl Duty,
) -> ! {
    // A session of its own before the guardian exists: a signal to CRIU's process group (a
    // SIGSTOP, say) never reaches the guardian, not even in its first instructions. The starter
    // is no group leader, so this succeeds.
    let _ = nix::unistd::setsid();
    let mut pidfd: libc::c_int = -1;
    // SAFETY: clone without CLONE_VM and without a new stack is fork(2), here with SIGCHLD as
    // the exit signal; the starter has one thread (a copy of single-threaded CRIU). The new
    // process continues below into `guardian_main`, which never returns. CLONE_PIDFD stores a
    // pidfd of it in `pidfd`.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PIDFD | libc::SIGCHLD) as libc::c_ulong,
            0 as libc::c_ulong,
            &mut pidfd as *mut libc::c_int,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if pid == 0 {
        guardian_main(sock, criu_fd, criu, duty);
    }
    if pid > 0 && pidfd >= 0 {
        // SAFETY: the kernel just created this fd for us.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
        let _ = protocol::send(
            sock.as_raw_fd(),
            Message::Started { pid: pid as i32 },
            Some(pidfd.as_raw_fd()),
        );
    }
    // SAFETY: ends the starter at once, running none of CRIU's exit handlers; the guardian is
    // adopted by init (or the nearest subreaper).
    unsafe { libc::_exit(0) }
}

/// The guardian's process: never returns.
fn guardian_main(sock: OwnedFd, criu_fd: OwnedFd, criu: libc::pid_t, duty: impl Duty) -> ! {
    // A panic must never unwind out of here: it would return into the plugin's hook, and a
    // copy of CRIU would carry on CRIU's work.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        guard(sock, criu_fd, criu, duty)
    }));
    // SAFETY: ends the guardian at once, running none of CRIU's exit handlers.
    unsafe { libc::_exit(0) }
}

/// The guardian's work: returns when it is released or has done its duty.
fn guard(sock: OwnedFd, criu_fd: OwnedFd, criu: libc::pid_t, mut duty: impl Duty) {
    // A session of its own (the starter's, which it was born in, ends with the starter).
    let _ = nix::unistd::setsid();
    let (sock, criu_fd) = keep_only(sock, criu_fd);
    // CRIU waits for this before it goes on (see `Message::Ready`).
    let _ = protocol::send(sock.as_raw_fd(), Message::Ready, None);
    log::debug!("guardian: watching CRIU (pid {criu})");
    let mut watched: BTreeMap<i32, Watched> = BTreeMap::new();
    let mut released = false;
    // Nothing is done before CRIU says it has this guardian (see `Message::Armed`).
    let mut armed = false;
    let mut next_look = Instant::now();
    loop {
        // Asked each time: a duty with nothing left to look for (a restore whose tree has its
        // GPU state) stops the guardian's waking.
        let every = duty.discover_every();
        let wait = every.map_or(PollTimeout::NONE, |e| {
            let left = next_look.saturating_duration_since(Instant::now());
            PollTimeout::try_from(left.min(e)).unwrap_or(PollTimeout::MAX)
        });
        let mut pfds = [
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(criu_fd.as_fd(), PollFlags::POLLIN),
        ];
        let _ = nix::poll::poll(&mut pfds, wait);
        let criu_said = pfds[1].revents().is_some_and(|r| !r.is_empty());
        // Every message sent before CRIU ended is read before CRIU's end is acted on.
        let mut eof = false;
        loop {
            match protocol::recv(sock.as_raw_fd()) {
                Ok(Received::Message(m, held)) => match m {
                    Message::Watch { pid, start, action } => {
                        add(&mut watched, pid, start, action, held);
                        duty.watched(pid, action);
                    }
                    Message::Forget { pid } => {
                        watched.remove(&pid);
                    }
                    Message::Release => released = true,
                    Message::Armed => armed = true,
                    Message::Started { .. } | Message::Ready => {}
                },
                Ok(Received::Unreadable) => continue,
                Ok(Received::Eof) => {
                    eof = true;
                    break;
                }
                Ok(Received::Empty) | Err(_) => break,
            }
        }
        if released {
            return;
        }
        let criu_ended = criu_said || proc::readable(criu_fd.as_fd(), 0);
        if !armed && (eof || criu_ended) {
            // CRIU never took this guardian on (its start failed there): not ours to act.
            log::debug!("guardian: never armed by CRIU (pid {criu}); ending without acting");
            return;
        }
        if criu_ended {
            break;
        }
        if eof {
            // Every sender is gone but CRIU lives (it dropped us): wait for its end alone.
            wait_for_end(criu_fd.as_fd(), &mut duty, &mut watched, criu);
            break;
        }
        if let Some(e) = every
            && armed
            && Instant::now() >= next_look
        {
            look(&mut duty, &mut watched, criu);
            next_look = Instant::now() + e;
        }
    }
    let count = watched.len();
    let alive: Vec<Watched> = std::mem::take(&mut watched)
        .into_values()
        .filter(Watched::alive)
        .collect();
    log::debug!(
        "guardian: CRIU (pid {criu}) ended; {count} process(es) watched, {} alive",
        alive.len()
    );
    if !alive.is_empty() {
        log::warn!(
            "guardian: CRIU (pid {criu}) ended before its run was done; undoing the plugin's work on {} process(es)",
            alive.len()
        );
    }
    // Also with nothing watched: a duty may find what it never got to watch.
    duty.rescue(alive);
}

/// After every sender has closed the socket: only CRIU's end (or nothing) remains to wait for.
fn wait_for_end(
    criu_fd: BorrowedFd<'_>,
    duty: &mut impl Duty,
    watched: &mut BTreeMap<i32, Watched>,
    criu: i32,
) {
    loop {
        let every = duty.discover_every();
        let ms = every.map_or(-1, |e| e.as_millis() as i32);
        if proc::readable(criu_fd, ms) {
            return;
        }
        if every.is_some() {
            look(duty, watched, criu);
        }
    }
}

fn look(duty: &mut impl Duty, watched: &mut BTreeMap<i32, Watched>, criu: i32) {
    let found = {
        let known = |pid: i32| watched.contains_key(&pid);
        duty.discover(criu, &known)
    };
    for (pid, start, action) in found {
        add(watched, pid, start, action, None);
    }
}

fn add(
    watched: &mut BTreeMap<i32, Watched>,
    pid: i32,
    start: u64,
    action: u32,
    held: Option<OwnedFd>,
) {
    if let Some(w) = watched.get_mut(&pid)
        && w.start == start
    {
        w.action = action;
        if held.is_some() {
            w.held = held;
        }
        return;
    }
    if watched.len() >= MAX_WATCHED {
        return;
    }
    let Some(pidfd) = proc::pidfd_of(pid, start) else {
        return;
    };
    watched.insert(
        pid,
        Watched {
            pid,
            start,
            action,
            pidfd,
            held,
        },
    );
}

/// Points every inherited descriptor at `/dev/null` but the two given, character devices that
/// are no terminal, and regular files. Returns the two kept.
fn keep_only(sock: OwnedFd, criu_fd: OwnedFd) -> (OwnedFd, OwnedFd) {
    let keep = [sock.as_raw_fd(), criu_fd.as_raw_fd()];
    let mut fds: Vec<RawFd> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc/self/fd") {
        for e in rd.flatten() {
            if let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<RawFd>().ok()) {
                fds.push(fd);
            }
        }
    }
    let null = nix::fcntl::open(
        c"/dev/null",
        OFlag::O_RDWR | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok();
    let null_raw = null.as_ref().map(|n| n.as_raw_fd());
    for raw in fds {
        if keep.contains(&raw) || Some(raw) == null_raw {
            continue;
        }
        // SAFETY: this new process owns every descriptor it inherited, and nothing in it uses
        // them but this loop (one that is no longer open just fails the calls below).
        let mut fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let kind = nix::sys::stat::fstat(&fd)
            .ok()
            .map(|st| SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()));
        // A terminal is a character device a user waits on (ssh -t): not kept.
        let tty = nix::unistd::isatty(&fd).unwrap_or(false);
        let harmless = !tty && matches!(kind, Some(SFlag::S_IFCHR | SFlag::S_IFREG));
        if harmless {
            // Left open, as inherited.
            let _ = fd.into_raw_fd();
            continue;
        }
        // /dev/null in its place, not a hole: a library of CRIU's that still counts on the
        // number (libcuda's, say) then reaches nothing, rather than whatever is opened next.
        // Closed instead when /dev/null cannot be opened (the drop).
        if let Some(null) = &null
            && nix::unistd::dup2(null, &mut fd).is_ok()
        {
            let _ = fd.into_raw_fd();
        }
    }
    // Our own /dev/null descriptor closes here (the ones put in place are duplicates).
    drop(null);
    (sock, criu_fd)
}
