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

use super::procfs;

/// Action bit: restore the process if it is checkpointed.
pub const RESTORE: u32 = 1;
/// Action bit: unlock the process if it is locked.
pub const UNLOCK: u32 = 2;
/// Action bit: kill the process and every descendant of it.
pub const END_TREE: u32 = 4;
/// Action bit: the tree has its GPU state back; kill it only if a task of it is still stuck
/// in CRIU's restore (CRIU ended before it let the tasks go).
pub const END_IF_STUCK: u32 = 8;

/// The dump's duty: put every watched process back as the dump found it.
pub struct PutBack<'a> {
    /// The run's driver (the guardian's copy of it).
    pub driver: &'a Driver,
}

impl Duty for PutBack<'_> {
    fn rescue(&mut self, watched: Vec<Watched>) {
        let driver = self.driver;
        // Outside CRIU threads are free: every process at once.
        std::thread::scope(|s| {
            for w in &watched {
                s.spawn(move || {
                    let unlock = w.action & UNLOCK != 0;
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
                });
            }
        });
    }
}

fn needs_init(r: &Result<(), DriverError>) -> bool {
    matches!(r, Err(DriverError::Cuda(e)) if e.code == CUresult::NOT_PERMITTED)
}

/// Whether `pid` still waits inside CRIU's restore code: CRIU's restorer blocks every signal
/// until the task's own mask comes back with its registers, at the very end; a program that
/// runs blocks fewer (SIGKILL and SIGSTOP never count).
fn in_restore(pid: i32) -> bool {
    const ALL_BLOCKABLE: u64 = !((1 << (libc::SIGKILL - 1)) | (1 << (libc::SIGSTOP - 1)));
    procfs::blocked_signals(pid).is_some_and(|m| m & ALL_BLOCKABLE == ALL_BLOCKABLE)
}

/// The restore's duty: end every task CRIU forked. It also claims each task it finds
/// ([`super::exclusive`]), so that a dump started while the restore runs refuses the tree
/// instead of dumping half-restored tasks as processes without CUDA.
pub struct EndRestore {
    /// The claims on the tasks found, held until the guardian ends.
    pub claims: Vec<super::exclusive::Claim>,
    /// The tasks found by [`Duty::discover`] whose trees are claimed.
    pub roots: Vec<i32>,
    /// Pids claimed already.
    pub claimed: std::collections::BTreeSet<i32>,
    /// The tree has its GPU state back: nothing more is claimed.
    pub settled: bool,
    /// CRIU's start time: tasks it forked started at or after it.
    pub criu_start: u64,
    /// CRIU's lowest mapping with its address: a task CRIU forked has the same until its
    /// restore replaces its memory; another CRIU started beside it has another address.
    pub criu_image: Option<String>,
}

impl EndRestore {
    /// Kills the copies of CRIU that CRIU forked after the last look (so they were never
    /// watched) and left behind: processes started since CRIU with CRIU's lowest mapping at
    /// its address, which only a fork of this CRIU has. Returns how many were killed.
    fn end_unseen_copies(&self, watched: &[Watched]) -> usize {
        let (Some(image), me) = (&self.criu_image, std::process::id() as i32) else {
            return 0;
        };
        if self.settled {
            return 0;
        }
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
            let young = procfs::start_time(pid).is_some_and(|s| s >= self.criu_start);
            if !young || procfs::first_mapping(pid).as_ref() != Some(image) {
                continue;
            }
            let Ok(fd) = criu_plugin::guardian::pidfd(pid) else {
                continue;
            };
            if criu_plugin::guardian::signal(&fd, libc::SIGKILL).is_ok() {
                ended += 1;
            }
        }
        ended
    }
}

/// The most tasks of a restore the guardian claims.
const MAX_CLAIMS: usize = 4096;

impl EndRestore {
    /// Claims every task of the trees found (the children each forks come later: looked for
    /// again at every look).
    fn claim_trees(&mut self) {
        self.roots.retain(|&r| procfs::start_time(r).is_some());
        for &root in &self.roots {
            for pid in procfs::tree(root) {
                if self.claimed.len() >= MAX_CLAIMS || self.claimed.contains(&pid) {
                    continue;
                }
                let Some(start) = procfs::start_time(pid) else {
                    continue;
                };
                self.claimed.insert(pid);
                if let Ok(c) = super::exclusive::claim(pid, start) {
                    self.claims.push(c);
                }
            }
        }
    }
}

/// How often the restore's guardian looks for the tasks CRIU forked.
const LOOK_EVERY: Duration = Duration::from_millis(5);

impl EndRestore {
    /// The duty for the CRIU this process is.
    pub fn for_this_criu() -> EndRestore {
        let me = std::process::id() as i32;
        EndRestore {
            claims: Vec::new(),
            roots: Vec::new(),
            claimed: Default::default(),
            settled: false,
            criu_start: procfs::start_time(me).unwrap_or(0),
            criu_image: procfs::first_mapping(me),
        }
    }
}

/// The children of every thread of `pid`.
fn children(pid: i32) -> Vec<i32> {
    let tree = procfs::children(pid);
    tree.into_iter().filter(|&c| c != pid).collect()
}

impl Duty for EndRestore {
    fn discover_every(&self) -> Option<Duration> {
        Some(LOOK_EVERY)
    }

    fn discover(&mut self, criu: i32, known: &dyn Fn(i32) -> bool) -> Vec<(i32, u64, u32)> {
        let me = std::process::id() as i32;
        let mut found = Vec::new();
        let direct = children(criu);
        // With --restore-sibling the root task is a child of CRIU's parent.
        let parent = procfs::parent(criu).filter(|&p| p > 1);
        let siblings = parent.map(children).unwrap_or_default();
        for pid in direct.iter().copied().chain(siblings.iter().copied()) {
            if pid == me || pid == criu || known(pid) {
                continue;
            }
            let Some(start) = procfs::start_time(pid) else {
                continue;
            };
            if start < self.criu_start {
                continue;
            }
            let forked_by_criu = direct.contains(&pid)
                || (self.criu_image.is_some() && procfs::first_mapping(pid) == self.criu_image);
            if forked_by_criu {
                found.push((pid, start, END_TREE));
                self.roots.push(pid);
            }
        }
        if !self.settled {
            self.claim_trees();
        }
        found
    }

    fn watched(&mut self, _pid: i32, action: u32) {
        // The tree has its GPU state back: a dump of it may run from now on (a CRIU that
        // waits for its restored tree keeps this guardian until the tree ends).
        if action & END_IF_STUCK != 0 {
            self.settled = true;
            self.claims.clear();
        }
    }

    fn rescue(&mut self, watched: Vec<Watched>) {
        let mut ended = self.end_unseen_copies(&watched);
        for root in watched
            .iter()
            .filter(|w| w.action & (END_TREE | END_IF_STUCK) != 0)
        {
            // Each descendant is held by a pidfd before the first signal, so nothing
            // reparented meanwhile escapes and no reused pid is hit.
            let tree = procfs::tree(root.pid);
            if root.action & END_TREE == 0 && !tree.iter().any(|&p| in_restore(p)) {
                log::info!(
                    "guardian: restored tree of pid {} runs on its own; left running",
                    root.pid
                );
                continue;
            }
            let held: Vec<_> = tree
                .iter()
                .skip(1)
                .filter_map(|&p| criu_plugin::guardian::pidfd(p).ok().map(|fd| (p, fd)))
                .collect();
            if root.signal(libc::SIGKILL).is_ok() {
                ended += 1;
            }
            for (_, fd) in &held {
                if criu_plugin::guardian::signal(fd, libc::SIGKILL).is_ok() {
                    ended += 1;
                }
            }
        }
        if ended > 0 {
            log::warn!(
                "guardian: the restore was cut short; {ended} half-restored task(s) killed, the images are unchanged for another restore"
            );
        }
    }
}
