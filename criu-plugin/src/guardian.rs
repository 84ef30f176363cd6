//! A guardian: a process that outlives CRIU and undoes what a plugin did to other processes
//! (a GPU process locked, checkpointed, half restored) when CRIU ends before the plugin could
//! undo it itself.
//!
//! Runtimes end CRIU at any moment: the kubelet's checkpoint timeout, `timeout(1)`, Ctrl-C, a
//! runtime killing runc, the OOM killer; CRIU 4.1 even exits from its `SIGCHLD` handler, without
//! calling any plugin, when a task of the tree dies. Nothing inside CRIU's process survives
//! that, so a plugin about to change another process's state spawns a guardian
//! ([`Guardian::spawn`]) and tells it, message by message, which processes to look after and
//! what undoes its work on each ([`Guardian::watch`], [`Guardian::forget`]). When the run ends
//! well the plugin releases it ([`Guardian::release`]). When CRIU's process ends first, the
//! guardian hands every watched process that is still the same process to the plugin's
//! [`Duty::rescue`], then exits.
//!
//! The guardian:
//! - is made with `clone(2)` and no exit signal, like [`crate::child`]: CRIU's `SIGCHLD` handler
//!   never hears of it (during a restore it would take any exiting child for a dead task);
//!   [`Guardian::release`] reaps it by pid;
//! - has no parent-death signal, leaves CRIU's session and process group (`setsid`) and blocks
//!   every signal that can be blocked: a Ctrl-C or a `kill` of CRIU's process group, and CRIU's
//!   death, leave it running;
//! - learns of CRIU's end from a pidfd of CRIU's process, which turns readable when it ends,
//!   whatever ended it;
//! - replaces every descriptor it inherited with `/dev/null`, except character devices that
//!   are no terminal (a GPU driver's) and regular files (CRIU's log): a runtime waits for EOF
//!   on CRIU's pipes and sockets (and a user on a terminal), and a guardian holding copies
//!   would keep them waiting;
//! - ends itself (`_exit`) on a panic: it must never return into CRIU's code;
//! - holds every watched process by a pidfd of its own, opened when the watch arrives and
//!   checked against the start time the plugin gave, so a pid reused by another process is
//!   never acted on;
//! - keeps any descriptor sent with a watch (a claim on the process, say) until the process is
//!   forgotten or the guardian ends, so the claim outlives CRIU until the rescue is done.
//!
//! Messages travel over a `SOCK_SEQPACKET` socket pair: one fixed-size record each, with at
//! most one descriptor attached. A helper child of CRIU's (see [`crate::child`]) inherits the
//! socket and may send watches too.
//!
//! [`Guardian::spawn`] copies the calling process: call it only while that process has a single
//! thread (CRIU's does, see [`crate::child`]).

use std::collections::BTreeMap;
use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::Pid;

/// What a plugin's guardian does; it runs in the guardian's process, never in CRIU's.
pub trait Duty {
    /// Called once when the guardian starts, with the inode of CRIU's end of the guardian's
    /// socket: every process CRIU forks from then on holds that socket until it closes CRIU's
    /// descriptors, which tells a fork of this CRIU from any other process.
    fn begin(&mut self, _criu_socket_inode: u64) {}

    /// How often to call [`Duty::discover`] while CRIU lives; `None`: never.
    fn discover_every(&self) -> Option<Duration> {
        None
    }

    /// Finds processes to watch by looking (a restore's tasks, which CRIU forks without
    /// telling plugins): `(pid, start time, action)` of each. `criu` is CRIU's pid; `known`
    /// tells whether a pid is watched already.
    fn discover(&mut self, _criu: i32, _known: &dyn Fn(i32) -> bool) -> Vec<(i32, u64, u32)> {
        Vec::new()
    }

    /// A watch arrived from CRIU (`pid` is watched with `action` from now on).
    fn watched(&mut self, _pid: i32, _action: u32) {}

    /// CRIU ended without releasing the guardian: undo the plugin's work on each process (all
    /// still alive and the same processes when this is called; perhaps none).
    fn rescue(&mut self, watched: Vec<Watched>);
}

/// One process the guardian looks after.
#[derive(Debug)]
pub struct Watched {
    /// Pid in the guardian's (CRIU's) pid namespace.
    pub pid: i32,
    /// Start time (clock ticks since boot), as the plugin gave it.
    pub start: u64,
    /// The plugin's own word for what undoes its work (its bits are the plugin's).
    pub action: u32,
    pidfd: OwnedFd,
    held: Option<OwnedFd>,
}

impl Watched {
    /// Whether the process is still alive (and so still the process that was watched).
    pub fn alive(&self) -> bool {
        !readable(self.pidfd.as_fd(), 0)
    }

    /// The pidfd that holds this process.
    pub fn pidfd(&self) -> &OwnedFd {
        &self.pidfd
    }

    /// Sends `signal` to this very process (through its pidfd: never to a reused pid).
    pub fn signal(&self, signal: libc::c_int) -> io::Result<()> {
        pidfd_send_signal(&self.pidfd, signal)
    }
}

/// Message kinds.
const WATCH: u32 = 1;
const FORGET: u32 = 2;
const RELEASE: u32 = 3;

/// One message: `[op u32][action u32][pid i32][pad u32][start u64]`, little-endian.
const MSG_LEN: usize = 24;

fn encode(op: u32, action: u32, pid: i32, start: u64) -> [u8; MSG_LEN] {
    let mut m = [0u8; MSG_LEN];
    m[0..4].copy_from_slice(&op.to_le_bytes());
    m[4..8].copy_from_slice(&action.to_le_bytes());
    m[8..12].copy_from_slice(&pid.to_le_bytes());
    m[16..24].copy_from_slice(&start.to_le_bytes());
    m
}

fn decode(m: &[u8; MSG_LEN]) -> (u32, u32, i32, u64) {
    let word = |r: std::ops::Range<usize>| u32::from_le_bytes(m[r].try_into().expect("4 bytes"));
    (
        word(0..4),
        word(4..8),
        word(8..12) as i32,
        u64::from_le_bytes(m[16..24].try_into().expect("8 bytes")),
    )
}

/// How long [`Guardian::release`] waits for the guardian to end before leaving it to init.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// The most processes one guardian watches: a bound on what a hostile image can make it hold.
pub const MAX_WATCHED: usize = 1 << 16;

/// CRIU's side of a guardian.
#[derive(Debug)]
pub struct Guardian {
    sock: OwnedFd,
    pid: libc::pid_t,
    pidfd: Option<OwnedFd>,
    released: bool,
}

impl Guardian {
    /// Starts a guardian that will do `duty` should CRIU's process end before
    /// [`Guardian::release`]. The calling process must be single-threaded (module docs).
    pub fn spawn(duty: impl Duty) -> io::Result<Guardian> {
        let criu = std::process::id() as libc::pid_t;
        let criu_fd = pidfd(criu)?;
        let (ours, theirs) = nix::sys::socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        let saved = block_all_signals();
        // SAFETY: the calling process is single-threaded (module docs); the child never
        // returns from `guardian_main`.
        let (pid, pidfd) = match unsafe { crate::child::fork_quietly() } {
            Ok(crate::child::Forked::Child) => {
                let peer = inode(&ours);
                drop(ours);
                guardian_main(theirs, criu_fd, criu, peer, duty)
            }
            Ok(crate::child::Forked::Parent { pid, pidfd }) => {
                restore_mask(&saved);
                (pid, pidfd)
            }
            Err(e) => {
                restore_mask(&saved);
                return Err(e);
            }
        };
        drop(theirs);
        drop(criu_fd);
        Ok(Guardian {
            sock: ours,
            pid,
            pidfd,
            released: false,
        })
    }

    /// The guardian's pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether the guardian still runs (it can be killed like any process).
    pub fn alive(&self) -> bool {
        self.pidfd
            .as_ref()
            .is_some_and(|fd| !readable(fd.as_fd(), 0))
    }

    /// Asks the guardian to look after `pid` (started at `start`, see [`Watched`]) with
    /// `action`; `held`, if given, is kept open by the guardian while it watches the process.
    /// A second watch of the same pid replaces the action (and `held`, when one is given).
    pub fn watch(
        &self,
        pid: i32,
        start: u64,
        action: u32,
        held: Option<BorrowedFd<'_>>,
    ) -> io::Result<()> {
        self.send(&encode(WATCH, action, pid, start), held)
    }

    /// Tells the guardian that the plugin has undone its work on `pid` itself.
    pub fn forget(&self, pid: i32) -> io::Result<()> {
        self.send(&encode(FORGET, 0, pid, 0), None)
    }

    /// Ends the guardian: nothing needs undoing. Waits briefly for it to end and reaps it.
    pub fn release(mut self) {
        self.released = true;
        let sent = self.send(&encode(RELEASE, 0, 0, 0), None);
        let started = Instant::now();
        let ended = sent.is_ok()
            && self
                .pidfd
                .as_ref()
                .is_some_and(|fd| readable(fd.as_fd(), RELEASE_WAIT.as_millis() as i32));
        if !ended {
            // A guardian that did not hear its release must not act later: killed.
            log::warn!(
                "guardian {}: release not heard ({}); killing it",
                self.pid,
                sent.err()
                    .map_or("it did not end".to_string(), |e| e.to_string())
            );
            match &self.pidfd {
                Some(fd) => {
                    let _ = pidfd_send_signal(fd, libc::SIGKILL);
                }
                // Our own child, not reaped yet, so its pid is still its own.
                None => {
                    let _ = nix::sys::signal::kill(Pid::from_raw(self.pid), Signal::SIGKILL);
                }
            }
        }
        loop {
            // __WALL since it sends no exit signal.
            match crate::child::try_reap(self.pid) {
                Ok(Some(_)) => return,
                Ok(None) | Err(Errno::EINTR) => {}
                Err(_) => return,
            }
            if started.elapsed() >= 2 * RELEASE_WAIT {
                // Killed but not gone yet: reaped by init once CRIU exits.
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn send(&self, msg: &[u8; MSG_LEN], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        send_msg(self.sock.as_raw_fd(), msg, fd.map(|f| f.as_raw_fd()))
    }
}

impl Drop for Guardian {
    fn drop(&mut self) {
        // Not released: the guardian stays, waiting for CRIU's end, and then does its duty.
        if !self.released {
            log::debug!("guardian {}: left to act when CRIU ends", self.pid);
        }
    }
}

fn send_msg(sock: RawFd, msg: &[u8; MSG_LEN], fd: Option<RawFd>) -> io::Result<()> {
    let iov = [IoSlice::new(msg)];
    let fds = fd.map(|fd| [fd]);
    let cmsgs: Vec<ControlMessage<'_>> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    // Never blocks: a guardian that stopped reading (stopped by SIGSTOP, say) must not stop
    // CRIU too.
    let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
    loop {
        match nix::sys::socket::sendmsg::<()>(sock, &iov, &cmsgs, flags, None) {
            Ok(MSG_LEN) => return Ok(()),
            Ok(_) => return Err(io::Error::other("short message")),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// One message read by the guardian: `None` at EOF; messages of another size are skipped.
fn recv_msg(sock: RawFd) -> io::Result<Option<([u8; MSG_LEN], Option<OwnedFd>)>> {
    let mut msg = [0u8; MSG_LEN];
    // Room for a few descriptors: one is kept, any other is closed.
    let mut control = nix::cmsg_space!([RawFd; 4]);
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC;
    let (n, fds) = loop {
        let mut iov = [IoSliceMut::new(&mut msg)];
        match nix::sys::socket::recvmsg::<()>(sock, &mut iov, Some(&mut control), flags) {
            Ok(r) => {
                let mut fds: Vec<RawFd> = Vec::new();
                for c in r.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(mut got) = c {
                        fds.append(&mut got);
                    }
                }
                break (r.bytes, fds);
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = fds.into_iter().map(|raw| {
        // SAFETY: the kernel installed each received descriptor in this process for us.
        unsafe { OwnedFd::from_raw_fd(raw) }
    });
    // The first is kept; the others close as they drop.
    let fd = fds.next();
    drop(fds);
    if n == 0 {
        return Ok(None);
    }
    if n != MSG_LEN {
        return Ok(Some(([0u8; MSG_LEN], None)));
    }
    Ok(Some((msg, fd)))
}

/// The guardian's process: never returns.
fn guardian_main(
    sock: OwnedFd,
    criu_fd: OwnedFd,
    criu: libc::pid_t,
    peer_inode: Option<u64>,
    duty: impl Duty,
) -> ! {
    // A panic must never unwind out of here: it would return into the plugin's hook, and a
    // copy of CRIU would carry on CRIU's work.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        guard(sock, criu_fd, criu, peer_inode, duty)
    }));
    // SAFETY: ends the guardian at once, running none of CRIU's exit handlers.
    unsafe { libc::_exit(0) }
}

/// The guardian's work: returns when it is released or has done its duty.
fn guard(
    sock: OwnedFd,
    criu_fd: OwnedFd,
    criu: libc::pid_t,
    peer_inode: Option<u64>,
    mut duty: impl Duty,
) {
    // This new process leads no group, so it succeeds.
    let _ = nix::unistd::setsid();
    let (sock, criu_fd) = keep_only(sock, criu_fd);
    log::debug!("guardian: watching CRIU (pid {criu})");
    duty.begin(peer_inode.unwrap_or(0));
    let mut watched: BTreeMap<i32, Watched> = BTreeMap::new();
    let every = duty.discover_every();
    let mut released = false;
    let mut next_look = Instant::now();
    loop {
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
            match recv_msg(sock.as_raw_fd()) {
                Ok(Some((m, held))) => match decode(&m) {
                    (WATCH, action, pid, start) => {
                        add(&mut watched, pid, start, action, held);
                        duty.watched(pid, action);
                    }
                    (FORGET, _, pid, _) => {
                        watched.remove(&pid);
                    }
                    (RELEASE, ..) => released = true,
                    _ => {}
                },
                Ok(None) => {
                    eof = true;
                    break;
                }
                Err(_) => break,
            }
        }
        if released {
            return;
        }
        let criu_ended = criu_said || readable(criu_fd.as_fd(), 0);
        if criu_ended {
            break;
        }
        if eof {
            // Every sender is gone but CRIU lives (it dropped us): wait for its end alone.
            wait_for_end(criu_fd.as_fd(), &mut duty, &mut watched, criu, every);
            break;
        }
        if let Some(e) = every
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
    every: Option<Duration>,
) {
    loop {
        let ms = every.map_or(-1, |e| e.as_millis() as i32);
        if readable(criu_fd, ms) {
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
    if pid <= 0 || watched.len() >= MAX_WATCHED {
        return;
    }
    // The pidfd first, then the start time: if the start time matches, the pidfd is that
    // process's (a pid is not reused while the process it names lives).
    let Ok(pidfd) = pidfd(pid) else {
        return;
    };
    if start_time(pid) != Some(start) {
        return;
    }
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

/// The inode of the socket (or any file) behind `fd`.
fn inode(fd: &OwnedFd) -> Option<u64> {
    nix::sys::stat::fstat(fd).ok().map(|st| st.st_ino)
}

/// Whether process `pid` holds a descriptor of the socket with inode `ino` (at most 4,096 of
/// its descriptors are looked at).
pub fn holds_socket(pid: i32, ino: u64) -> bool {
    let want = format!("socket:[{ino}]");
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    rd.flatten()
        .take(4096)
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
}

/// The start time of `pid` (field 22 of `/proc/PID/stat`).
pub fn start_time(pid: i32) -> Option<u64> {
    let bytes = crate::files::read_regular(
        None,
        std::path::Path::new(&format!("/proc/{pid}/stat")),
        false,
        4096,
    )
    .ok()?;
    let text = String::from_utf8_lossy(&bytes);
    // The command name may hold spaces and parentheses: count from the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process of pidfd `fd` has ended.
pub fn ended(fd: &OwnedFd) -> bool {
    readable(fd.as_fd(), 0)
}

/// A pidfd of process `pid` (`pidfd_open(2)`, close-on-exec).
pub fn pidfd(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; it returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just created this fd for us.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    // pidfd_open's fd is close-on-exec already.
    Ok(fd)
}

/// Sends `signal` to the process of pidfd `fd`.
pub fn signal(fd: &OwnedFd, signal: libc::c_int) -> io::Result<()> {
    pidfd_send_signal(fd, signal)
}

fn pidfd_send_signal(fd: &OwnedFd, signal: libc::c_int) -> io::Result<()> {
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

/// Whether `fd` is readable within `ms` milliseconds, `-1` for no limit (a pidfd: its
/// process has ended).
fn readable(fd: BorrowedFd<'_>, ms: i32) -> bool {
    let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::NONE);
    loop {
        let mut pfd = [PollFd::new(fd, PollFlags::POLLIN)];
        match nix::poll::poll(&mut pfd, timeout) {
            Err(Errno::EINTR) => continue,
            r => return r.is_ok_and(|n| n > 0),
        }
    }
}

/// Blocks every signal that can be blocked in the calling thread; returns the mask before.
fn block_all_signals() -> SigSet {
    SigSet::all()
        .thread_swap_mask(SigmaskHow::SIG_BLOCK)
        .unwrap_or_else(|_| SigSet::thread_get_mask().unwrap_or_else(|_| SigSet::empty()))
}

fn restore_mask(old: &SigSet) {
    crate::child::restore_mask(old)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let m = encode(WATCH, 7, 1234, 99_999_999_999);
        assert_eq!(decode(&m), (WATCH, 7, 1234, 99_999_999_999));
    }

    /// A duty that writes each rescued pid into a file.
    struct Record(std::path::PathBuf);

    impl Duty for Record {
        fn rescue(&mut self, watched: Vec<Watched>) {
            let pids: Vec<String> = watched
                .iter()
                .map(|w| format!("{} {}", w.pid, w.action))
                .collect();
            let _ = std::fs::write(&self.0, pids.join("\n"));
        }
    }

    /// The guardian acts when the process that spawned it dies, and not when it is released.
    /// The "CRIU" here is a child process of the test (the test's own process has threads).
    #[test]
    fn a_guardian_acts_only_when_its_criu_ends_unreleased() {
        let dir = std::env::temp_dir().join(format!("guardian-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (released, name) in [(false, "killed"), (true, "released")] {
            let out = dir.join(name);
            let _ = std::fs::remove_file(&out);
            // A watched process: sleeps until killed.
            let mut target = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let tpid = target.id() as i32;
            let tstart = start_time(tpid).unwrap();
            let r = crate::child::run(Duration::from_secs(10), 64, || {
                let g = Guardian::spawn(Record(out.clone())).unwrap();
                g.watch(tpid, tstart, 5, None).unwrap();
                // A reused pid (wrong start time) is never watched.
                g.watch(1, 12345, 9, None).unwrap();
                if released {
                    g.release();
                } else {
                    std::mem::forget(g);
                }
                Vec::new()
            });
            assert!(r.is_ok(), "{r:?}");
            let t = Instant::now();
            while !out.exists() && t.elapsed() < Duration::from_secs(3) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if released {
                assert!(!out.exists(), "a released guardian does nothing");
            } else {
                assert_eq!(std::fs::read_to_string(&out).unwrap(), format!("{tpid} 5"));
            }
            target.kill().unwrap();
            target.wait().unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
