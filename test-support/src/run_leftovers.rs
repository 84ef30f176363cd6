//! The processes one CRIU run leaves behind, and the check that it leaves none.
//!
//! A run's processes are told apart from every other process on the machine two ways:
//! - by their command line: CRIU's forks, its own and the plugin's (helpers, guardian), are
//!   copies of CRIU that never `exec`, so they carry CRIU's arguments, and every run checked
//!   here has an image directory and log name (`-D DIR -o LOG`) no other run has;
//! - by adoption: the test process is a child subreaper, so whatever the run started and left
//!   behind, `exec`ed or forked twice, becomes its child. A child that started since CRIU did
//!   and is no task of the workload is the run's.
//!
//! CRIU's own forks: before every dump and restore CRIU 4.1 to 4.3 probe the kernel
//! (`kerndat`), some probes with a child that CRIU ptraces or that stops itself (the
//! `PTRACE_GET_RSEQ_CONFIGURATION` probe's child sleeps in a loop until CRIU attaches; the
//! xsave, hardware-breakpoint and vDSO probes' children stop themselves with `SIGSTOP`), which
//! CRIU kills at the end of the probe. A CRIU killed in between leaves that child for good,
//! stopped or asleep, a child of init (of the test process here, a subreaper). Where `/run` is no tmpfs (this machine) CRIU keeps no
//! probe cache and runs every probe every time; with a cache it still runs the rseq one. These
//! children are forked before CRIU loads any plugin, so they never map it: that tells them
//! from the plugin's processes, which always do.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{WAIT, plugin_libdir, reap_until_gone, state_of};

/// How long a run's processes may take to go once the test has seen the run's work undone
/// (the guardian's exit, and this machine's init, which reaps 1 to 2 s late).
pub const GONE_WITHIN: Duration = Duration::from_secs(2);

/// One CRIU run: its distinctive arguments and when it started.
pub struct Run {
    /// `-D` and `-o` as CRIU got them.
    images: PathBuf,
    log: String,
    /// CRIU's start time (clock ticks since boot): its forks start at or after it.
    started: u64,
}

/// What the run left: CRIU's own forks the test killed (their state letter and description),
/// and how long the run's other processes took to go.
#[derive(Debug, Default)]
pub struct Reaped {
    pub criu_forks: Vec<(char, String)>,
    pub took: Duration,
}

impl Run {
    /// The run of CRIU process `criu`, started with `-D images -o log`. Call it while CRIU's
    /// process (or its zombie) is still there.
    pub fn new(criu: i32, images: &Path, log: &str) -> Run {
        Run {
            images: images.to_path_buf(),
            log: log.to_string(),
            started: start_time(criu).unwrap_or(0),
        }
    }

    /// Whether `pid`'s command line is this run's CRIU's.
    fn is_criu_copy(&self, pid: i32) -> bool {
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            return false;
        };
        let args: Vec<&[u8]> = raw.split(|&b| b == 0).collect();
        let images = self.images.as_os_str().as_encoded_bytes();
        let has =
            |flag: &[u8], value: &[u8]| args.windows(2).any(|w| w[0] == flag && w[1] == value);
        has(b"-D", images) && has(b"-o", self.log.as_bytes())
    }

    /// Every process of this run still there, apart from `workload`'s tasks that run as their
    /// own programs again (a restored tree CRIU let go, a dumped tree left running).
    pub fn processes(&self, workload: &[i32]) -> Vec<Left> {
        let me = std::process::id() as i32;
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut left = Vec::new();
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if pid == me {
                continue;
            }
            let copy = self.is_criu_copy(pid);
            let adopted = !workload.contains(&pid)
                && parent_of(pid) == Some(me)
                && start_time(pid).is_some_and(|s| s >= self.started);
            if copy || adopted {
                left.push(Left::of(pid, copy));
            }
        }
        left
    }

    /// Waits up to `within` for every process of the run to end and be reaped, and kills the
    /// forks of CRIU's own that the run left (see the module docs: CRIU killed during its
    /// kernel probes; nothing else would ever end them): a stopped one at once, one asleep
    /// once `within` is over. Panics, describing each, if any other process of the run is
    /// still there then.
    pub fn reap(&self, workload: &[i32], within: Duration, what: &str) -> Reaped {
        let t = Instant::now();
        let mut reaped = Reaped::default();
        let mut killed: Vec<i32> = Vec::new();
        let mut others_gone: Option<Duration> = None;
        loop {
            reap_until_gone(&[], Duration::ZERO);
            let left = self.processes(workload);
            if !left.iter().any(|l| !l.criu_own() && !l.dead()) {
                others_gone.get_or_insert(t.elapsed());
            }
            if left.is_empty() {
                reaped.took = others_gone.unwrap_or(t.elapsed());
                return reaped;
            }
            let over = t.elapsed() >= within;
            for l in &left {
                let stopped = matches!(l.state, Some('T' | 't'));
                if !l.criu_own() || killed.contains(&l.pid) || !(stopped || over) {
                    continue;
                }
                let seen = (l.state.unwrap_or('?'), l.describe());
                if self.kill_criu_fork(l.pid) {
                    killed.push(l.pid);
                    reaped.criu_forks.push(seen);
                }
            }
            let rest: Vec<String> = left
                .iter()
                .filter(|l| !killed.contains(&l.pid) && !l.dead())
                .map(Left::describe)
                .collect();
            if over && !rest.is_empty() {
                // How long they stay tells a slow end from one that never comes.
                let pids: Vec<i32> = left
                    .iter()
                    .filter(|l| !killed.contains(&l.pid))
                    .map(|l| l.pid)
                    .collect();
                let gone = reap_until_gone(&pids, WAIT);
                panic!(
                    "{what}: {} process(es) of the run still there {within:?} after it was checked ({}):\n{}",
                    rest.len(),
                    if gone {
                        format!("gone {:?} after it", t.elapsed())
                    } else {
                        format!("still there after {:?}", t.elapsed())
                    },
                    rest.join("\n")
                );
            }
            // The killed forks and the processes that ended go at once when they are this
            // process's children; init reaps the others, late on this machine.
            assert!(
                t.elapsed() < within + GONE_WITHIN,
                "{what}: CRIU's forks, killed, still there: {:?}",
                left.iter().map(Left::describe).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILLs `pid` through a pidfd, after checking (with the pidfd held, so the pid cannot
    /// be another process's) that it is still a copy of this run's CRIU without the plugin.
    fn kill_criu_fork(&self, pid: i32) -> bool {
        // SAFETY: pidfd_open takes a pid and flags; it returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return false;
        }
        // SAFETY: the kernel just made this descriptor for us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        if !self.is_criu_copy(pid) || maps_plugin(pid) {
            return false;
        }
        // SAFETY: pidfd_send_signal on a pidfd we own, without siginfo.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        r == 0
    }
}

/// What a series of runs left behind, all told.
#[derive(Default)]
pub struct Tally {
    /// CRIU's own forks the test killed, by state letter.
    pub criu_forks: std::collections::BTreeMap<char, usize>,
    /// The longest time a run's other processes took to go once checked.
    pub slowest: Duration,
}

impl Tally {
    /// [`Run::reap`] with [`GONE_WITHIN`], each of CRIU's own forks killed told on stderr.
    pub fn check(&mut self, run: &Run, workload: &[i32], what: &str) {
        let r = run.reap(workload, GONE_WITHIN, what);
        for (state, l) in &r.criu_forks {
            eprintln!("{what}: CRIU's own fork left behind, killed: {l}");
            *self.criu_forks.entry(*state).or_default() += 1;
        }
        self.slowest = self.slowest.max(r.took);
    }

    pub fn summary(&self) -> String {
        format!(
            "CRIU's own forks left by the runs and killed by the test: {} {:?}; the runs' other processes all went within {:?}",
            self.criu_forks.values().sum::<usize>(),
            self.criu_forks,
            self.slowest
        )
    }
}

/// A process of a run, as `/proc` showed it.
pub struct Left {
    pub pid: i32,
    /// Its command line is the run's CRIU's.
    pub criu_copy: bool,
    /// It maps the plugin (a copy of CRIU made after CRIU loaded it).
    pub plugin: bool,
    pub state: Option<char>,
}

impl Left {
    pub fn of(pid: i32, criu_copy: bool) -> Left {
        Left {
            pid,
            criu_copy,
            plugin: maps_plugin(pid),
            state: state_of(pid),
        }
    }

    /// Ended, only not reaped yet.
    pub fn dead(&self) -> bool {
        matches!(self.state, Some('Z' | 'X') | None)
    }

    /// A fork CRIU made for itself before it loaded the plugin (a zombie maps nothing, so it
    /// is only waited for).
    pub fn criu_own(&self) -> bool {
        self.criu_copy && !self.plugin && !self.dead()
    }

    /// What it is, what it waits on, who traces it, its signal masks and descriptors.
    pub fn describe(&self) -> String {
        let pid = self.pid;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let keep: Vec<&str> = status
            .lines()
            .filter(|l| {
                [
                    "PPid:",
                    "TracerPid:",
                    "NSsid:",
                    "SigBlk:",
                    "SigPnd:",
                    "ShdPnd:",
                ]
                .iter()
                .any(|k| l.starts_with(k))
            })
            .collect();
        let read = |f: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/{f}"))
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|l| l.display().to_string())
            .collect();
        let kind = match (self.criu_copy, self.plugin) {
            (true, false) => "CRIU's own fork (no plugin mapped)",
            (true, true) => {
                "a copy of CRIU with the plugin mapped (helper, guardian, restore task)"
            }
            (false, _) => "adopted by the test since the run started",
        };
        let threads: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| {
                let t = e.file_name().to_string_lossy().to_string();
                let f = |n: &str| read(&format!("task/{t}/{n}"));
                let stack: Vec<String> = f("stack")
                    .lines()
                    .take(5)
                    .map(|l| l.split_whitespace().last().unwrap_or("").to_string())
                    .collect();
                format!(
                    "{t} {:?}: wchan {} syscall {} stack [{}]",
                    f("comm"),
                    f("wchan"),
                    f("syscall"),
                    stack.join(" < ")
                )
            })
            .collect();
        format!(
            "pid {pid} ({kind}): state {:?} {} fds {fds:?}\n  threads: {}",
            self.state,
            keep.join(" ").replace('\t', " "),
            threads.join("\n           ")
        )
    }
}

/// Whether `pid` maps the plugin under test.
pub fn maps_plugin(pid: i32) -> bool {
    let so = plugin_libdir().join("gpu_plugin.so");
    let so = so.to_string_lossy();
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains(so.as_ref()))
}

/// Start time of `pid` (field 22 of `/proc/PID/stat`, clock ticks since boot).
pub fn start_time(pid: i32) -> Option<u64> {
    stat_field(pid, 19)
}

/// Parent of `pid` (field 4 of `/proc/PID/stat`).
pub fn parent_of(pid: i32) -> Option<i32> {
    stat_field(pid, 1).map(|p| p as i32)
}

/// Field `n` after the command name (0: the state) of `/proc/PID/stat`, as a number.
fn stat_field(pid: i32, n: usize) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?
        .1
        .split_whitespace()
        .nth(n)?
        .parse()
        .ok()
}
