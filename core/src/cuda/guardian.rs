//! What the NVIDIA side's guardian ([`criu_plugin::guardian`]) does when CRIU ends before a run
//! is done.
//!
//! - Dump ([`PutBack`]): each process the dump locked or checkpointed is restored (if
//!   checkpointed) and unlocked (if the dump locked it), as the dump found it. CRIU's end
//!   detaches its ptrace from the tasks, so their restore threads run and the driver answers.
//!   A lock helper announces a process before it asks the driver to lock it, so a CRIU killed
//!   in the middle of a lock is covered too.
//! - Restore ([`EndRestore`]): the tasks CRIU forked are killed, whole trees, so that nothing
//!   half restored stays behind holding the image's pids, and a second restore from the same
//!   images can run. The guardian finds them itself, by looking at CRIU's children (and, with
//!   `--restore-sibling` as runc uses, at the children of CRIU's parent that are copies of
//!   CRIU), since CRIU tells plugins of no task before the end of a restore.

use std::time::Duration;

use criu_plugin::guardian::{Duty, Watched};
use cuda_ckpt_sys::{CUresult, Driver, DriverError};

use super::error::CallError;

use super::procfs;

bitflags::bitflags! {
    /// What the guardian does for a watched process (the `action` word of [`Watched`]).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Action: u32 {
        /// Restore the process if it is checkpointed.
        const RESTORE = 1;
        /// Unlock the process if it is locked.
        const UNLOCK = 2;
        /// Kill the process and every descendant of it.
        const END_TREE = 4;
        /// The tree has its GPU state back; kill it only if a task of it is still stuck in
        /// CRIU's restore (CRIU ended before it let the tasks go).
        const END_IF_STUCK = 8;
    }
}

impl Action {
    /// The action of a guardian's word (bits this side does not name are dropped).
    fn of(word: u32) -> Action {
        Action::from_bits_truncate(word)
    }
}

/// The dump's duty: put every watched process back as the dump found it.
pub struct PutBack<'a> {
    /// The run's driver (the guardian's copy of it).
    pub driver: &'a Driver,
}

impl Duty for PutBack<'_> {
    fn rescue(&mut self, watched: Vec<Watched>) {
        let driver = self.driver;
        // Every process at once, on workers as inside CRIU (the guardian's own thread takes
        // its signals).
        let done = criu_plugin::threads::scope(|s| {
            for w in &watched {
                let put_back_one = move || {
                    let unlock = Action::of(w.action).contains(Action::UNLOCK);
                    let mut r = super::put_back(driver, w.pid, unlock);
                    if needs_init(&r) && driver.init().is_ok() {
                        r = super::put_back(driver, w.pid, unlock);
                    }
                    match r {
                        Ok(()) => log::warn!(
                            "guardian: pid {} put back as the dump found it (its GPU state restored)",
                            w.pid
                        ),
                        Err(e) => log::error!(
                            "guardian: pid {} could not be put back: {e}; run `criu-gpu resume {}`",
                            w.pid,
                            w.pid
                        ),
                    }
                };
                // No thread to be had: this one does it, after the others.
                if let Err(e) = s.spawn(format!("put-back-{}", w.pid), put_back_one) {
                    log::debug!("guardian: no thread for pid {} ({e})", w.pid);
                    put_back_one();
                }
            }
        });
        if let Err(panic) = done {
            log::error!("guardian: {panic}");
        }
    }
}

fn needs_init(r: &Result<(), CallError>) -> bool {
    matches!(r, Err(CallError::Driver(DriverError::Cuda(e))) if e.code == CUresult::NOT_PERMITTED)
}

/// Whether `pid` still waits inside CRIU's restore code: CRIU blocks every signal in the tasks
/// it forks, `SIGCHLD` aside, until a task's own mask comes back with its registers at the very
/// end (seen: `SigBlk` of a task left in CRIU's restorer is `fffffffe7ffafeff`). A program that
/// runs does not block all of signals 1 to 31 (`SIGKILL` and `SIGSTOP` never count).
fn in_restore(pid: i32) -> bool {
    const STANDARD: u64 = 0x7fff_ffff;
    let bit = |sig: libc::c_int| 1u64 << (sig - 1);
    let never = bit(libc::SIGKILL) | bit(libc::SIGSTOP) | bit(libc::SIGCHLD);
    procfs::blocked_signals(pid).is_some_and(|m| (m | never) & STANDARD == STANDARD)
}

/// The restore's duty: end every task CRIU forked. It also claims each task it finds
/// ([`super::exclusive`]), so that a dump started while the restore runs refuses the tree
/// instead of dumping half-restored tasks as processes without CUDA.
#[derive(Default)]
pub struct EndRestore {
    /// CRIU's start time: tasks it forked started at or after it.
    criu_start: u64,
    /// The inode of CRIU's end of the guardian's socket: a process CRIU forked holds it until
    /// the restore closes CRIU's descriptors in it; no other process does.
    marker: u64,
    /// The roots found (CRIU's children, or copies of CRIU beside it).
    roots: Vec<i32>,
    /// The claims on the tasks found, held until the tree has its GPU state back.
    claims: Vec<super::exclusive::Claim>,
    /// Pids claimed already.
    claimed: std::collections::HashSet<i32>,
    /// The tree has its GPU state back (`RESUME_DEVICES_LATE`): nothing more is claimed.
    settled: Option<i32>,
    /// CRIU let the settled tree go (its root is no longer CRIU's tracee): never killed then.
    let_go: bool,
    /// The pids of the image's tasks (`pstree.img`): where the restore shares CRIU's pid
    /// namespace, its tasks get exactly these.
    image_pids: Vec<i32>,
}

/// How often the restore's guardian looks for the tasks CRIU forked.
const LOOK_EVERY: Duration = Duration::from_millis(5);
/// The most tasks of a restore the guardian claims.
const MAX_CLAIMS: usize = 4096;

impl EndRestore {
    /// The duty for the CRIU this process is.
    pub fn for_this_criu(image_pids: Vec<i32>) -> EndRestore {
        let me = std::process::id() as i32;
        EndRestore {
            criu_start: procfs::start_time(me).unwrap_or(0),
            image_pids,
            ..EndRestore::default()
        }
    }

    /// Whether `pid` is a fork of this CRIU: started since CRIU and holding the marker socket.
    fn forked_by_criu(&self, pid: i32) -> bool {
        self.marker != 0
            && procfs::start_time(pid).is_some_and(|s| s >= self.criu_start)
            && criu_plugin::guardian::holds_socket(pid, self.marker)
    }

    /// Claims every task of the trees found (the children each forks come later: looked for
    /// again at every look).
    fn claim_trees(&mut self) {
        self.roots.retain(|&r| procfs::start_time(r).is_some());
        for &root in &self.roots {
            for pid in procfs::tree(root) {
                if self.claimed.len() >= MAX_CLAIMS || !self.claimed.insert(pid) {
                    continue;
                }
                if let Some(start) = procfs::start_time(pid)
                    && let Ok(c) = super::exclusive::claim(pid, start)
                {
                    self.claims.push(c);
                }
            }
        }
    }

    /// Kills what CRIU left behind that was never watched (forked after the last look, or
    /// missed by a guardian that did not get the processor in time): the forks of CRIU that
    /// still hold the marker socket, and the tasks with the image's pids that started since
    /// CRIU and still wait inside its restore code. Each is held by a pidfd before it is
    /// checked, so no reused pid is hit.
    fn end_unseen(&self, watched: &[Watched]) -> usize {
        let me = std::process::id() as i32;
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return 0;
        };
        let mut ended = 0;
        for e in rd.flatten().take(1 << 16) {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if pid == me || watched.iter().any(|w| w.pid == pid) {
                continue;
            }
            let Ok(fd) = criu_plugin::guardian::pidfd(pid) else {
                continue;
            };
            let restored_here = self.image_pids.contains(&pid)
                && procfs::start_time(pid).is_some_and(|s| s >= self.criu_start)
                && in_restore(pid);
            if restored_here || self.forked_by_criu(pid) {
                ended += end_tree(pid, &fd);
            }
        }
        ended
    }
}

/// Kills `root` and every descendant of it. Each child is held by a pidfd, then checked to be
/// still the child of a process held before it, so nothing reparented meanwhile escapes and no
/// reused pid is hit. Returns how many were signalled.
fn end_tree(root: i32, root_fd: &std::os::fd::OwnedFd) -> usize {
    let mut held: Vec<(i32, std::os::fd::OwnedFd)> = Vec::new();
    let mut queue = vec![root];
    while let Some(parent) = queue.pop() {
        for c in procfs::children(parent) {
            if held.len() >= 1 << 16 || held.iter().any(|(p, _)| *p == c) {
                continue;
            }
            let Ok(fd) = criu_plugin::guardian::pidfd(c) else {
                continue;
            };
            if procfs::parent(c) == Some(parent) {
                held.push((c, fd));
                queue.push(c);
            }
        }
    }
    let mut ended = usize::from(criu_plugin::guardian::signal(root_fd, libc::SIGKILL).is_ok());
    for (_, fd) in &held {
        ended += usize::from(criu_plugin::guardian::signal(fd, libc::SIGKILL).is_ok());
    }
    ended
}

impl Duty for EndRestore {
    fn begin(&mut self, marker: u64) {
        self.marker = marker;
    }

    fn discover_every(&self) -> Option<Duration> {
        Some(LOOK_EVERY)
    }

    fn discover(&mut self, criu: i32, known: &dyn Fn(i32) -> bool) -> Vec<(i32, u64, u32)> {
        if let Some(root) = self.settled {
            // Watched until CRIU lets the tree go; then nothing is left to look at.
            if !self.let_go && procfs::tracer(root) != Some(criu) {
                self.let_go = true;
            }
            return Vec::new();
        }
        let me = std::process::id() as i32;
        let mut found = Vec::new();
        let direct = procfs::children(criu);
        // With --restore-sibling the root task is a child of CRIU's parent.
        let parent = procfs::parent(criu).filter(|&p| p > 1);
        let siblings = parent.map(procfs::children).unwrap_or_default();
        for pid in direct.iter().copied().chain(siblings) {
            if pid == me || pid == criu || known(pid) {
                continue;
            }
            let Some(start) = procfs::start_time(pid) else {
                continue;
            };
            let ours = if direct.contains(&pid) {
                start >= self.criu_start
            } else {
                self.forked_by_criu(pid)
            };
            if ours {
                log::debug!("guardian: task {pid} of the restore found");
                found.push((pid, start, Action::END_TREE.bits()));
                self.roots.push(pid);
            }
        }
        self.claim_trees();
        found
    }

    fn watched(&mut self, pid: i32, action: u32) {
        // The tree has its GPU state back: a dump of it may run from now on (a CRIU that
        // waits for its restored tree keeps this guardian until the tree ends).
        if Action::of(action).contains(Action::END_IF_STUCK) {
            self.settled = Some(pid);
            self.claims.clear();
        }
    }

    fn rescue(&mut self, watched: Vec<Watched>) {
        log::debug!(
            "guardian: restore rescue: {} watched, {} image pid(s), settled {:?}",
            watched.len(),
            self.image_pids.len(),
            self.settled
        );
        let mut ended = if self.settled.is_none() {
            self.end_unseen(&watched)
        } else {
            0
        };
        for root in watched
            .iter()
            .filter(|w| Action::of(w.action).intersects(Action::END_TREE | Action::END_IF_STUCK))
        {
            // A settled tree is ended only if CRIU died before it let the tree go and a task
            // still waits inside CRIU's restore code.
            let stuck = || procfs::tree(root.pid).iter().any(|&p| in_restore(p));
            if !Action::of(root.action).contains(Action::END_TREE) && (self.let_go || !stuck()) {
                log::info!(
                    "guardian: restored tree of pid {} runs on its own; left running",
                    root.pid
                );
                continue;
            }
            ended += end_tree(root.pid, root.pidfd());
        }
        if ended > 0 {
            log::warn!(
                "guardian: the restore was cut short; {ended} half-restored task(s) killed, the images are unchanged for another restore"
            );
        }
    }
}
