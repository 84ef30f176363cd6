//! What the `criu-gpu` tests share: the stand-in CUDA driver and NVML of the repository's
//! `tests/fixtures/fake-cuda` built once, workload trees on it (killed by process group when
//! the test ends), the tool run with the fake's settings, and real CRIU with the release plugin
//! to make images (both found by `criu-gpu-test-support`). The tests need root and `cc`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use criu_gpu_test_support::{FakeCudaBuild, fake_cuda_build};
pub use criu_gpu_test_support::{build_dir, wait_until};

/// Builds (once per test binary) the stand-in driver, NVML and their programs.
fn fake_build() -> FakeCudaBuild {
    fake_cuda_build()
}

/// One test: the test lock (the fake's sockets and device files are global), a work
/// directory and device directory of its own, and the processes it started.
pub struct T {
    pub dir: PathBuf,
    pub dev: PathBuf,
    pub nv: PathBuf,
    groups: Mutex<Vec<i32>>,
    _lock: MutexGuard<'static, ()>,
}

impl T {
    pub fn start(name: &str) -> T {
        static LOCK: Mutex<()> = Mutex::new(());
        let lock = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "these tests need root");
        let dir = build_dir().join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("work dir");
        let dev = Path::new("/dev/shm").join(format!("criu-gpu-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dev);
        std::fs::create_dir_all(&dev).expect("device dir");
        let t = T {
            nv: dir.join("nv"),
            dir,
            dev,
            groups: Mutex::new(Vec::new()),
            _lock: lock,
        };
        let gpus = t.gpus(1, 0);
        t.nvidia_proc("nv", &[("0000:00:06.0", &gpus[0].1, &gpus[0].0)]);
        t
    }

    /// The fake's GPUs as (uuid, model) under `FAKE_CUDA_GPUS=count`, `..._SEED=seed`.
    pub fn gpus(&self, count: u32, seed: u64) -> Vec<(String, String)> {
        let out = Command::new(&fake_build().gpu_list)
            .env("FAKE_CUDA_GPUS", count.to_string())
            .env("FAKE_CUDA_GPU_UUID_SEED", seed.to_string())
            .env("FAKE_CUDA_DEVICE_DIR", &self.dev)
            .output()
            .expect("gpu_list");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                let (u, m) = l.split_once(' ').expect("uuid name");
                (u.to_string(), m.to_string())
            })
            .collect()
    }

    /// A `/proc/driver/nvidia/gpus`-like directory listing (bus, model, uuid).
    pub fn nvidia_proc(&self, name: &str, gpus: &[(&str, &str, &str)]) -> PathBuf {
        let dir = self.dir.join(name);
        for (bus, model, uuid) in gpus {
            std::fs::create_dir_all(dir.join(bus)).expect("nv");
            std::fs::write(
                dir.join(bus).join("information"),
                format!("Model: \t\t {model}\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"),
            )
            .expect("nv");
        }
        dir
    }

    /// The settings the tool (and CRIU's plugin) get: the fake driver, its GPU list, NVML.
    pub fn env(&self) -> Vec<(String, String)> {
        let b = fake_build();
        vec![
            (
                "CRIU_GPU_PLUGIN_CONFIG".into(),
                self.dir.join("none.conf").display().to_string(),
            ),
            ("CRIU_GPU_LIBCUDA".into(), b.libcuda.display().to_string()),
            ("CRIU_GPU_NVML".into(), b.nvml.display().to_string()),
            (
                "CRIU_GPU_CUDA_NVIDIA_PROC".into(),
                self.nv.display().to_string(),
            ),
            (
                "FAKE_CUDA_LOG".into(),
                self.dir.join("calls").display().to_string(),
            ),
            ("FAKE_CUDA_CALL_TIMEOUT_MS".into(), "15000".into()),
        ]
    }

    /// Runs `criu-gpu ARGS` with [`T::env`] plus `extra`.
    pub fn tool(&self, args: &[&str], extra: &[(&str, &str)]) -> Run {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_criu-gpu"));
        cmd.args(args).stdin(Stdio::null());
        for (k, _) in std::env::vars() {
            if k.starts_with("CRIU_GPU_") || k.starts_with("FAKE_CUDA_") {
                cmd.env_remove(k);
            }
        }
        for (k, v) in self.env() {
            cmd.env(k, v);
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run criu-gpu");
        let run = Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        eprintln!(
            "criu-gpu {args:?}: exit {:?}\n{}{}",
            run.code, run.stdout, run.stderr
        );
        run
    }

    /// Starts `program args` in a session of its own; killed with its group at the end.
    pub fn spawn(&self, program: &Path, args: &[&str]) -> i32 {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("FAKE_CUDA_DEVICE_DIR", &self.dev)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: `own_session` calls only setsid(2) and close_range(2) in the child before
        // exec, which touch no memory of the parent.
        unsafe {
            cmd.pre_exec(|| criu_gpu_test_support::e2e::own_session(true));
        }
        let child = cmd.spawn().expect("spawn");
        let pid = child.id() as i32;
        std::mem::forget(child);
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pid);
        pid
    }

    /// A workload tree with `children` children, each ready and counting; (root, all pids).
    pub fn workload(&self, name: &str, children: u32, mib: u32) -> Workload {
        self.workload_via(&[], name, children, mib)
    }

    /// [`T::workload`], started through `launcher` (a command that execs the rest of its
    /// arguments in the same process, as `nsenter` does).
    pub fn workload_via(&self, launcher: &[&str], name: &str, children: u32, mib: u32) -> Workload {
        let out = self.dir.join(name);
        let program = fake_build().workload.display().to_string();
        let (out_s, mib_s, children_s) = (
            out.display().to_string(),
            mib.to_string(),
            children.to_string(),
        );
        let mut args: Vec<&str> = launcher.iter().skip(1).copied().collect();
        if !launcher.is_empty() {
            args.push(&program);
        }
        args.extend(["--out", &out_s, "--mib", &mib_s, "--children", &children_s]);
        let first = launcher.first().copied().unwrap_or(&program);
        let root = self.spawn(Path::new(first), &args);
        let mut w = Workload {
            out,
            pids: vec![root],
        };
        w.wait_line(root, "ready ");
        let kids: Vec<i32> = w
            .lines(root)
            .iter()
            .filter_map(|l| l.strip_prefix("child ")?.parse().ok())
            .collect();
        for &c in &kids {
            w.wait_line(c, "ready ");
            w.pids.push(c);
        }
        for &p in &w.pids {
            w.wait_counting(p);
        }
        w
    }

    /// Device files of `pid` in the fake's device directory.
    pub fn device_files(&self, pid: i32) -> usize {
        let prefix = format!("{pid}.");
        std::fs::read_dir(&self.dev)
            .map(|it| {
                it.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .count()
            })
            .unwrap_or(0)
    }

    /// The fake's logged state changes of `pid`, as `op=rc`.
    pub fn transitions(&self, pid: i32) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("calls"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let op = it.next()?;
                let p: i32 = it.next()?.strip_prefix("pid=")?.parse().ok()?;
                let rc = it.next()?.strip_prefix("result=")?;
                (p == pid && matches!(op, "lock" | "checkpoint" | "restore" | "unlock"))
                    .then(|| format!("{op}={rc}"))
            })
            .collect()
    }

    pub fn clear_calls(&self) {
        let _ = std::fs::remove_file(self.dir.join("calls"));
    }
}

impl Drop for T {
    fn drop(&mut self) {
        for g in self
            .groups
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            // SAFETY: kill(2) of the process group of a session this test started.
            unsafe { libc::kill(-g, libc::SIGKILL) };
            // SAFETY: waitpid on our own child; the status is not needed.
            unsafe { libc::waitpid(g, std::ptr::null_mut(), 0) };
        }
        let _ = std::fs::remove_dir_all(&self.dev);
    }
}

/// One finished run of the tool.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// A workload tree.
pub struct Workload {
    pub out: PathBuf,
    pub pids: Vec<i32>,
}

impl Workload {
    pub fn root(&self) -> i32 {
        self.pids[0]
    }

    pub fn lines(&self, pid: i32) -> Vec<String> {
        std::fs::read_to_string(format!("{}.{pid}", self.out.display()))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    pub fn wait_line(&self, pid: i32, prefix: &str) {
        wait_until(format!("pid {pid}: {prefix}"), || {
            self.lines(pid).iter().any(|l| l.starts_with(prefix))
        });
    }

    fn last_counter(&self, pid: i32) -> u64 {
        self.lines(pid)
            .iter()
            .rev()
            .find_map(|l| l.strip_prefix("counter ")?.parse().ok())
            .unwrap_or(0)
    }

    /// The device counter of `pid` goes up.
    pub fn wait_counting(&self, pid: i32) {
        let c0 = self.last_counter(pid);
        wait_until(format!("pid {pid} counting"), || {
            self.last_counter(pid) >= c0 + 3
        });
    }

    /// The counter of `pid` stays put for a while (its CUDA calls wait).
    pub fn assert_frozen(&self, pid: i32) {
        let c0 = self.last_counter(pid);
        std::thread::sleep(Duration::from_millis(150));
        assert!(self.last_counter(pid) <= c0 + 1, "pid {pid} still counts");
    }

    /// SIGUSR1: the process checks its device memory; the verdict must be "verify ok".
    pub fn verify(&self, pid: i32) {
        let n = |w: &Workload| {
            w.lines(pid)
                .iter()
                .filter(|l| l.starts_with("verify"))
                .count()
        };
        let before = n(self);
        // SAFETY: kill(2) of a workload this test started.
        unsafe { libc::kill(pid, libc::SIGUSR1) };
        wait_until(format!("pid {pid} verify"), || n(self) > before);
        let v: Vec<String> = self
            .lines(pid)
            .into_iter()
            .filter(|l| l.starts_with("verify"))
            .collect();
        assert_eq!(v[before], "verify ok", "pid {pid}");
    }

    /// Every process runs with its GPU memory intact.
    pub fn assert_running(&self) {
        for &p in &self.pids {
            self.wait_counting(p);
            self.verify(p);
        }
    }
}

/// A cgroup made for a test under a mounted hierarchy; its processes are moved back to the
/// hierarchy's root and the directories removed when dropped.
pub struct Cgroup {
    pub root: PathBuf,
    pub dir: PathBuf,
}

impl Cgroup {
    /// `hierarchy` is e.g. `/sys/fs/cgroup/pids` (v1) or `/sys/fs/cgroup/unified` (v2).
    pub fn new(hierarchy: &str, name: &str) -> Option<Cgroup> {
        let root = PathBuf::from(hierarchy);
        if !root.join("cgroup.procs").is_file() {
            eprintln!("no cgroup hierarchy at {hierarchy}; skipped");
            return None;
        }
        let dir = root.join(format!("criu-gpu-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir cgroup");
        Some(Cgroup { root, dir })
    }

    pub fn add(&self, sub: bool, pid: i32) {
        let d = if sub {
            self.dir.join("sub")
        } else {
            self.dir.clone()
        };
        std::fs::write(d.join("cgroup.procs"), pid.to_string()).expect("move into cgroup");
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for d in [self.dir.join("sub"), self.dir.clone()] {
            let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
            for p in procs.split_whitespace() {
                let _ = std::fs::write(self.root.join("cgroup.procs"), p);
            }
            let _ = std::fs::remove_dir(&d);
        }
    }
}
