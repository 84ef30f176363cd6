//! The workloads a container runs (a busybox counter, the stand-in CUDA program, the stand-in
//! KFD module's program) and what they write.

use super::*;

/// The busybox loop of the counter container: one number per line, one more each time.
pub const COUNTER_LOOP: &str =
    "i=0; while :; do i=$((i + 1)); echo $i >> /out/counter; usleep 20000; done";

/// What a container runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// A shell loop counting into `/out/counter`.
    Counter,
    /// `workload.c` on the stand-in CUDA driver (8 MiB of patterned device memory, one busy
    /// thread), counting into `/out/w.1`; `hold_ms` is how long SIGUSR2 holds it busy.
    Cuda { hold_ms: u64 },
    /// The stand-in KFD module's workload (`tests/kfd_module/workload.c`) on the node's
    /// `/dev/kfd` and render nodes, counting into `/out/counter` as the counter does; it writes
    /// its GPU state to `/out/status-<pid>` at SIGUSR1. Only where the module is loaded.
    Kfd,
}

pub const CUDA: Workload = Workload::Cuda { hold_ms: 3000 };

impl Workload {
    pub fn args(self) -> Vec<String> {
        match self {
            Workload::Counter => vec!["/bin/sh".into(), "-c".into(), COUNTER_LOOP.into()],
            Workload::Cuda { hold_ms } => [
                "/gpu/workload",
                "--out",
                "/out/w",
                "--mib",
                "8",
                "--threads",
                "1",
                "--hold-ms",
                &hold_ms.to_string(),
            ]
            .map(String::from)
            .to_vec(),
            Workload::Kfd => ["/kfd/workload", "/out", "count"]
                .map(String::from)
                .to_vec(),
        }
    }

    pub fn env(self) -> Vec<String> {
        vec!["PATH=/bin".into(), "FAKE_CUDA_DEVICE_DIR=/out/dev".into()]
    }

    pub fn is_cuda(self) -> bool {
        matches!(self, Workload::Cuda { .. })
    }

    pub fn is_kfd(self) -> bool {
        self == Workload::Kfd
    }
}

/// The host side of a container's `/out`: what its workload writes.
pub struct Output {
    pub dir: PathBuf,
    pub workload: Workload,
    /// The workload's pid in its container (the CUDA workload names its files after it).
    pub pid_inside: i32,
}

impl Output {
    pub fn new(dir: PathBuf, workload: Workload) -> Output {
        Output::of_pid(dir, workload, INIT_PID)
    }

    /// The output of a workload that is not its container's init but pid `pid_inside` there.
    pub fn of_pid(dir: PathBuf, workload: Workload, pid_inside: i32) -> Output {
        std::fs::create_dir_all(dir.join("dev")).expect("output directory");
        Output {
            dir,
            workload,
            pid_inside,
        }
    }

    fn file(&self) -> PathBuf {
        self.dir.join(match self.workload {
            Workload::Counter | Workload::Kfd => "counter".to_string(),
            Workload::Cuda { .. } => format!("w.{}", self.pid_inside),
        })
    }

    /// Complete lines so far.
    pub fn lines(&self) -> Vec<String> {
        let text = std::fs::read_to_string(self.file()).unwrap_or_default();
        let end = text.rfind('\n').map_or(0, |i| i + 1);
        text[..end].lines().map(str::to_owned).collect()
    }

    /// The counter values of `lines`.
    pub fn values_of(&self, lines: &[String]) -> Vec<u64> {
        lines
            .iter()
            .filter_map(|l| match self.workload {
                Workload::Counter | Workload::Kfd => l.parse().ok(),
                Workload::Cuda { .. } => l.strip_prefix("counter ")?.parse().ok(),
            })
            .collect()
    }

    pub fn values(&self) -> Vec<u64> {
        self.values_of(&self.lines())
    }

    /// Waits until the counter has moved `n` more times.
    pub fn wait_counting(&self, n: usize) {
        let before = self.values().len();
        wait_until(
            format!(
                "{n} more counts in {} ({:?})",
                self.file().display(),
                self.tail()
            ),
            || {
                reap_now();
                self.values().len() >= before + n
            },
        );
    }

    pub fn tail(&self) -> Vec<String> {
        let l = self.lines();
        l[l.len().saturating_sub(4)..].to_vec()
    }

    /// A mark for [`Output::assert_continues`]: the number of lines now.
    pub fn mark(&self) -> usize {
        self.lines().len()
    }

    /// After a restore from an image taken when the container stopped: the counter goes on
    /// from its last value before `mark`, one by one.
    pub fn assert_continues(&self, mark: usize) {
        self.wait_counting(3);
        let lines = self.lines();
        let before = self.values_of(&lines[..mark]);
        let last = *before.last().expect("counted before the checkpoint");
        let all = self.values_of(&lines);
        let after = &all[before.len()..];
        assert_eq!(
            after.first().copied(),
            Some(last + 1),
            "last count before the checkpoint {last}, counts after the restore {:?}",
            &after[..after.len().min(5)]
        );
        assert_steps_by_one(&all);
    }

    /// After a restore from an image taken while the container kept running (between marks
    /// `low` and `high`, `killed` lines when it was killed): the first count after the restore
    /// is one the container had while it was dumped, and it goes on one by one from there.
    pub fn assert_resumes_between(&self, low: usize, high: usize, killed: usize) {
        self.wait_counting(3);
        let lines = self.lines();
        let lo = self.values_of(&lines[..low]).last().copied().unwrap_or(0);
        let hi = self.values_of(&lines[..high]).last().copied().unwrap_or(0);
        let after = self.values_of(&lines[killed..]);
        let first = after.first().copied().unwrap_or(0);
        assert!(
            lo < first && first <= hi + 1,
            "first count after the restore {first}, but the checkpoint was taken between {lo} \
             and {hi}"
        );
        assert_steps_by_one(&after);
    }

    /// The fake device files (`<pid>.<index>`) of the container's workload, sorted.
    pub fn device_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.dir.join("dev"))
            .map(|it| {
                it.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| n.starts_with(&format!("{}.", self.pid_inside)))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// After a dump that left the workload (host pid `pid`) running: it counts on and, on
    /// CUDA (`files`: its device files before), holds its device memory again, verified, the
    /// driver's calls for it (log `calls`) exactly a lock, checkpoint, restore and unlock.
    pub fn assert_given_back(&self, files: Option<&Vec<String>>, calls: &Path, pid: i32) {
        self.wait_counting(3);
        if let Some(files) = files {
            assert_eq!(&self.device_files(), files, "device memory not given back");
            assert_eq!(
                transitions(calls, pid),
                ["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
                "driver calls of the dump"
            );
            self.verify(pid);
        }
    }

    /// After a restore of the CUDA workload (`files`: its device files when dumped), now host
    /// pid `pid`: its device memory recreated and verified, the driver's last calls for it
    /// (log `calls`) a restore and an unlock.
    pub fn assert_gpu_restored(&self, files: &[String], calls: &Path, pid: i32) {
        assert_eq!(self.device_files(), files, "device memory not recreated");
        self.verify(pid);
        let t = transitions(calls, pid);
        assert!(
            t.ends_with(&["restore=0".to_string(), "unlock=0".to_string()]),
            "driver calls of the restore: {t:?}"
        );
    }

    /// SIGUSR1 to the CUDA workload (host pid `pid`); its new verdict must be "verify ok" (its
    /// device memory holds the pattern, the device counter did not go back).
    pub fn verify(&self, pid: i32) {
        let verdicts = || -> Vec<String> {
            self.lines()
                .into_iter()
                .filter(|l| l.starts_with("verify"))
                .collect()
        };
        let before = verdicts().len();
        assert!(common::signal(pid, libc::SIGUSR1), "SIGUSR1 to {pid}");
        wait_until(format!("pid {pid}: a verify verdict"), || {
            verdicts().len() > before
        });
        assert_eq!(verdicts()[before], "verify ok", "pid {pid}");
        let errors: Vec<String> = self
            .lines()
            .into_iter()
            .filter(|l| l.starts_with("cuda error"))
            .collect();
        assert!(errors.is_empty(), "pid {pid}: {errors:?}");
    }

    /// After the CUDA workload's busy section (SIGUSR2) outlasted a checkpoint's `when` (a
    /// timeout, a deadline) and the container runs again: the section ends, the workload (host
    /// pid `pid`) counts on, holds its device memory `files` and verifies.
    pub fn assert_goes_on_after_hold(&self, files: &[String], pid: i32, when: &str) {
        self.wait_line("hold end");
        self.wait_counting(3);
        assert_eq!(self.device_files(), files, "device memory after the {when}");
        self.verify(pid);
    }

    /// Waits for a line `line` of the workload.
    pub fn wait_line(&self, line: &str) {
        wait_until(format!("a line `{line}` ({:?})", self.tail()), || {
            self.lines().iter().any(|l| l == line)
        });
    }

    /// The workload has started: counting (and, on CUDA, its device memory allocated).
    pub fn wait_ready(&self) {
        if self.workload.is_cuda() {
            wait_until("the CUDA workload ready", || {
                reap_now();
                let lines = self.lines();
                let failed = lines.iter().find(|l| l.starts_with("cuda error"));
                // The stand-in driver names its socket after the pid the process sees: a
                // second process with that pid in another pid namespace of this network
                // namespace (another container on the stand-in) takes the name first.
                assert!(
                    failed.is_none(),
                    "the CUDA workload failed to start: {failed:?} (is another stand-in CUDA \
                     process running as pid {INIT_PID} of a pid namespace?)"
                );
                lines.iter().any(|l| l.starts_with("ready "))
            });
        }
        self.wait_counting(3);
    }
}
