//! A guardian: a process that outlives CRIU and undoes what a plugin did to other processes
//! (a GPU process locked, checkpointed, half restored) when CRIU ends before the plugin could
//! undo it itself.
//!
//! Runtimes end CRIU at any moment: the kubelet's checkpoint timeout, `timeout(1)`, Ctrl-C, a
//! runtime killing runc, the OOM killer; CRIU 4.1 even exits from its `SIGCHLD` handler, without
//! calling any plugin, when a task of the tree dies. Nothing inside CRIU's process survives
//! that, so a plugin about to change another process's state spawns a guardian
//! ([`Guardian::spawn`]) and tells it, message by message ([`protocol`]), which processes to
//! look after and what undoes its work on each ([`Guardian::watch`], [`Guardian::forget`]).
//! When the run ends well the plugin releases it ([`Guardian::release`]). When CRIU's process
//! ends first, the guardian hands every watched process that is still the same process to the
//! plugin's [`Duty::rescue`], then exits. [`restore::EndRestore`] is the duty of a restore.
//!
//! The guardian:
//! - is never CRIU's child: a short-lived child of CRIU's (made with `clone(2)` and no exit
//!   signal, like [`crate::child`], reaped at once by pid) forks it and exits, so it is
//!   adopted by init (or the nearest subreaper) at once; CRIU never sees it end, be stopped or
//!   become a zombie, whichever CRIU release it is;
//! - leaves CRIU's session and process group (`setsid`) and blocks every signal that can be
//!   blocked: a Ctrl-C or a `kill` of CRIU's process group, and CRIU's death, leave it running;
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
//! A guardian can be stopped (`SIGSTOP`) or killed like any process: [`Guardian::stopped`] and
//! [`Guardian::alive`] tell, and a plugin must not start what only a working guardian could
//! undo.
//!
//! [`Guardian::spawn`] copies the calling process: call it only while that process has a single
//! thread (CRIU's does, see [`crate::child`]).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow};
use nix::sys::socket::{AddressFamily, SockFlag, SockType};

use crate::proc;

pub mod forks;
pub mod protocol;
pub mod restore;
mod run;

use protocol::{Message, Received};

/// What a plugin's guardian does; it runs in the guardian's process, never in CRIU's.
pub trait Duty {
    /// How often to call [`Duty::discover`] while CRIU lives; `None`: not now (asked again
    /// after each message and each look).
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
        !proc::ended(&self.pidfd)
    }

    /// The pidfd that holds this process.
    pub fn pidfd(&self) -> &OwnedFd {
        &self.pidfd
    }

    /// Sends `signal` to this very process (through its pidfd: never to a reused pid).
    pub fn signal(&self, signal: libc::c_int) -> io::Result<()> {
        proc::signal(&self.pidfd, signal)
    }
}

/// How long [`Guardian::release`] waits for the guardian to end before killing it.
const RELEASE_WAIT: Duration = Duration::from_secs(2);
/// How long [`Guardian::spawn`] waits for the guardian's pid.
const START_WAIT: Duration = Duration::from_secs(5);

/// The most processes one guardian watches: a bound on what a hostile image can make it hold.
pub const MAX_WATCHED: usize = 1 << 16;

/// CRIU's side of a guardian.
#[derive(Debug)]
pub struct Guardian {
    sock: OwnedFd,
    pid: libc::pid_t,
    pidfd: OwnedFd,
    released: bool,
}

impl Guardian {
    /// Starts a guardian that will do `duty` should CRIU's process end before
    /// [`Guardian::release`]. The calling process must be single-threaded (module docs).
    pub fn spawn(duty: impl Duty) -> io::Result<Guardian> {
        let criu = std::process::id() as libc::pid_t;
        if criu == 1 {
            // The init of its pid namespace (`criu-ns`, `unshare -fp criu ...`, CRIU as a
            // container's first process) adopts every orphan there: the guardian would be
            // CRIU's child after all, and it would die with the namespace, when it is needed.
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "CRIU is the init of its pid namespace, where a guardian would be its child",
            ));
        }
        let criu_fd = proc::pidfd(criu)?;
        let (ours, theirs) = nix::sys::socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        let saved = block_all_signals();
        // SAFETY: the calling process is single-threaded (module docs); the child never
        // returns from `start_guardian`.
        let forked = unsafe { crate::child::fork_quietly() };
        let starter = match forked {
            Ok(crate::child::Forked::Child) => {
                drop(ours);
                run::start_guardian(theirs, criu_fd, criu, duty)
            }
            Ok(crate::child::Forked::Parent { pid, .. }) => pid,
            Err(e) => {
                crate::child::restore_mask(&saved);
                return Err(e);
            }
        };
        crate::child::restore_mask(&saved);
        drop(theirs);
        drop(criu_fd);
        // The starter exits as soon as the guardian runs: reaped here (__WALL: it sends no
        // SIGCHLD), so CRIU never sees it.
        let started = Instant::now();
        while !matches!(crate::child::try_reap(starter), Ok(Some(_)) | Err(_)) {
            if started.elapsed() >= START_WAIT {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(starter),
                    nix::sys::signal::Signal::SIGKILL,
                );
                let _ = crate::child::try_reap(starter);
                return Err(io::Error::other("the guardian's starter did not end"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Two messages come, in either order: the starter's `Started` (the guardian's pid and
        // pidfd) and the guardian's `Ready`: it has let go of every socket and pipe it
        // inherited from CRIU, and only then may CRIU go on. A guardian that does not say so in
        // time (stopped or ended in its first instructions) is killed, and the start fails
        // before the plugin has done anything to a process.
        let mut started_as: Option<(i32, OwnedFd)> = None;
        let mut ready = false;
        while started_as.is_none() || !ready {
            let left = START_WAIT.saturating_sub(started.elapsed());
            if !crate::child::poll_in(ours.as_fd(), left).unwrap_or(false) {
                break;
            }
            match protocol::recv(ours.as_raw_fd()) {
                Ok(Received::Message(Message::Started { pid }, Some(pidfd))) => {
                    started_as = Some((pid, pidfd));
                }
                Ok(Received::Message(Message::Ready, None)) => ready = true,
                other => {
                    if let Some((_, pidfd)) = &started_as {
                        let _ = proc::signal(pidfd, libc::SIGKILL);
                    }
                    return Err(io::Error::other(format!(
                        "the guardian did not start ({other:?})"
                    )));
                }
            }
        }
        let Some((pid, pidfd)) = started_as else {
            return Err(io::Error::other(
                "the guardian did not start (no word of it)",
            ));
        };
        if !ready {
            let _ = proc::signal(&pidfd, libc::SIGKILL);
            return Err(io::Error::other(format!(
                "the guardian (pid {pid}) did not let go of CRIU's descriptors within {} s",
                START_WAIT.as_secs()
            )));
        }
        let g = Guardian {
            sock: ours,
            pid,
            pidfd,
            released: false,
        };
        // Until this arrives the guardian acts on nothing: one whose start failed here (this
        // end dropped) ends quietly.
        g.send(Message::Armed, None)?;
        Ok(g)
    }

    /// The guardian's pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether the guardian still runs (it can be killed like any process).
    pub fn alive(&self) -> bool {
        !proc::ended(&self.pidfd)
    }

    /// Whether the guardian is stopped (`SIGSTOP`): until it is continued it undoes nothing.
    pub fn stopped(&self) -> bool {
        self.alive() && proc::stopped(self.pid)
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
        self.send(Message::Watch { pid, start, action }, held)
    }

    /// Tells the guardian that the plugin has undone its work on `pid` itself.
    pub fn forget(&self, pid: i32) -> io::Result<()> {
        self.send(Message::Forget { pid }, None)
    }

    /// Ends the guardian: nothing needs undoing. Waits briefly for it to end; one that does not
    /// hear the release (stopped, say) is killed, so that it never acts later.
    pub fn release(mut self) {
        self.released = true;
        let sent = self.send(Message::Release, None);
        let ended =
            sent.is_ok() && proc::readable(self.pidfd.as_fd(), RELEASE_WAIT.as_millis() as i32);
        if !ended {
            log::warn!(
                "guardian {}: release not heard ({}); killing it",
                self.pid,
                sent.err()
                    .map_or("it did not end".to_string(), |e| e.to_string())
            );
            let _ = proc::signal(&self.pidfd, libc::SIGKILL);
        }
        // Not our child: init (or the subreaper that adopted it) reaps it.
    }

    fn send(&self, msg: Message, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        protocol::send(self.sock.as_raw_fd(), msg, fd.map(|f| f.as_raw_fd()))
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

/// Whether [`Guardian::spawn`] failed because no guardian can run here at all (a kernel without
/// pidfds, CRIU the init of its pid namespace): the run goes on unguarded, with a warning,
/// rather than failing.
pub fn unavailable_here(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSYS) || e.kind() == io::ErrorKind::Unsupported
}

/// Blocks every signal that can be blocked in the calling thread; returns the mask before.
fn block_all_signals() -> SigSet {
    SigSet::all()
        .thread_swap_mask(SigmaskHow::SIG_BLOCK)
        .unwrap_or_else(|_| SigSet::thread_get_mask().unwrap_or_else(|_| SigSet::empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A duty that writes each rescued pid into a file.
    struct Record(std::path::PathBuf);

    impl Duty for Record {
        fn rescue(&mut self, watched: Vec<Watched>) {
            let pids: Vec<String> = watched
                .iter()
                .map(|w| format!("{} {}", w.pid, w.action))
                .collect();
            // Written whole, then named: the test reads it as soon as the name exists.
            let tmp = self.0.with_extension("tmp");
            let _ = std::fs::write(&tmp, pids.join("\n"));
            let _ = std::fs::rename(&tmp, &self.0);
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
            let tstart = proc::start_time(tpid).unwrap();
            let r = crate::child::run(Duration::from_secs(10), 64, || {
                let g = Guardian::spawn(Record(out.clone())).unwrap();
                // Never the spawning process's child.
                let adopted = proc::parent(g.pid()) != Some(std::process::id() as i32);
                g.watch(tpid, tstart, 5, None).unwrap();
                // A reused pid (wrong start time) is never watched.
                g.watch(1, 12345, 9, None).unwrap();
                if released {
                    g.release();
                } else {
                    std::mem::forget(g);
                }
                vec![u8::from(adopted)]
            });
            assert_eq!(r.unwrap(), vec![1], "the guardian was its CRIU's child");
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
