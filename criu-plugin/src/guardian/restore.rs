//! The restore's duty, for any GPU vendor: should CRIU end before the restored tree has its GPU
//! state back, end every task CRIU forked, whole trees, so that nothing half restored runs on
//! without its GPU state or holds the image's pids, and a second restore from the same images
//! can run.
//!
//! Only processes proven to be this CRIU's forks are ever signalled ([`super::forks`]): the
//! guardian looks for them every few milliseconds while CRIU lives (each held by a pidfd from
//! then on), the plugin announces the root from CRIU's own hooks (`POST_FORKING` where CRIU has
//! it, and `RESUME_DEVICES_LATE` before any GPU work), and once CRIU has died the forks still
//! in CRIU's code are found by the marker they map.
//!
//! The plugin's word for a root ([`Watch`]): [`Watch::EndTree`] until the tree has its GPU state,
//! then [`Watch::Settled`]: a tree with its GPU state runs on whatever happens to CRIU.

use std::collections::HashSet;
use std::time::Duration;

use super::forks::CriuForks;
use super::{Duty, Watched};
use crate::proc;

/// What the plugin says of a root task (the `action` word of [`super::Guardian::watch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Watch {
    /// End the tree should CRIU end first.
    EndTree = 1,
    /// The tree has its GPU state back: leave it running.
    Settled = 2,
}

impl Watch {
    fn of(word: u32) -> Option<Watch> {
        match word {
            1 => Some(Watch::EndTree),
            2 => Some(Watch::Settled),
            _ => None,
        }
    }
}

/// What a vendor adds to the restore's duty: told of every task found, and of the moment the
/// tree has its GPU state.
pub trait RestoreTasks: Send {
    /// `pid` (started at `start`) is a task of the restore.
    fn found(&mut self, _pid: i32, _start: u64) {}
    /// The tree has its GPU state back.
    fn settled(&mut self) {}
}

impl RestoreTasks for () {}

/// How often the guardian looks for the tasks CRIU forked.
const LOOK_EVERY: Duration = Duration::from_millis(5);
/// The most tasks one restore's guardian reports to the vendor.
const MAX_TASKS: usize = 1 << 16;

/// The restore's duty.
pub struct EndRestore<T: RestoreTasks = ()> {
    forks: CriuForks,
    tasks: T,
    /// Roots found by looking (their trees are looked through at each look).
    roots: Vec<i32>,
    /// Tasks reported to the vendor already.
    seen: HashSet<i32>,
    /// The tree has its GPU state back: nothing more is looked for.
    settled: bool,
}

impl<T: RestoreTasks> EndRestore<T> {
    /// The duty for CRIU's forks `forks` (made in CRIU's process), telling `tasks` of each.
    pub fn new(forks: CriuForks, tasks: T) -> EndRestore<T> {
        EndRestore {
            forks,
            tasks,
            roots: Vec::new(),
            seen: HashSet::new(),
            settled: false,
        }
    }

    fn report_trees(&mut self) {
        self.roots.retain(|&r| proc::start_time(r).is_some());
        for &root in &self.roots {
            for pid in proc::tree(root) {
                if self.seen.len() >= MAX_TASKS || !self.seen.insert(pid) {
                    continue;
                }
                if let Some(start) = proc::start_time(pid) {
                    self.tasks.found(pid, start);
                }
            }
        }
    }
}

impl<T: RestoreTasks> Duty for EndRestore<T> {
    fn discover_every(&self) -> Option<Duration> {
        // Once the tree has its GPU state nothing more is looked for: a `criu restore` without
        // `-d` keeps its guardian as long as the tree runs, asleep.
        (!self.settled).then_some(LOOK_EVERY)
    }

    fn discover(&mut self, _criu: i32, known: &dyn Fn(i32) -> bool) -> Vec<(i32, u64, u32)> {
        if self.settled {
            return Vec::new();
        }
        let me = std::process::id() as i32;
        let found = self.forks.roots(&|p| p == me || known(p));
        for &(pid, _) in &found {
            log::debug!("guardian: task {pid} of the restore found");
            self.roots.push(pid);
        }
        self.report_trees();
        found
            .into_iter()
            .map(|(pid, start)| (pid, start, Watch::EndTree as u32))
            .collect()
    }

    fn watched(&mut self, pid: i32, action: u32) {
        match Watch::of(action) {
            Some(Watch::Settled) => {
                self.settled = true;
                self.tasks.settled();
            }
            Some(Watch::EndTree) => {
                if !self.roots.contains(&pid) {
                    self.roots.push(pid);
                }
                self.report_trees();
            }
            None => {}
        }
    }

    fn rescue(&mut self, watched: Vec<Watched>) {
        let me = std::process::id() as i32;
        let settled: Vec<i32> = watched
            .iter()
            .filter(|w| Watch::of(w.action) == Some(Watch::Settled))
            .map(|w| w.pid)
            .collect();
        let mut ended = 0;
        for w in &watched {
            match Watch::of(w.action) {
                Some(Watch::Settled) => log::info!(
                    "guardian: restored tree of pid {} has its GPU state and runs on its own; left running",
                    w.pid
                ),
                Some(Watch::EndTree) if !self.settled => {
                    ended += proc::kill_tree(w.pidfd(), w.pid);
                }
                _ => {}
            }
        }
        // Forks never watched (CRIU died before the guardian looked) that are still in CRIU's
        // code: they hold the marker wherever they were reparented to.
        if !self.settled {
            let watched_pids: HashSet<i32> = watched.iter().map(|w| w.pid).collect();
            let skip = |p: i32| p == me || watched_pids.contains(&p) || settled.contains(&p);
            for (pid, start) in self.forks.marked_anywhere(&skip) {
                if let Some(fd) = proc::pidfd_of(pid, start) {
                    ended += proc::kill_tree(&fd, pid);
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
