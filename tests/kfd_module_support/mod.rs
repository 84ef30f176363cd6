//! What the stand-in KFD module's tests share (`tests/kfd_module.rs`): the module loaded and
//! unloaded, the workload (`tests/kfd_module/workload.c`) started and asked for its status,
//! CRIU run on it, and a restored workload checked.

#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::amdgpu_support::{TempDir, swapped_gpu_topologies};
use super::common;

pub const REPO: &str = env!("CARGO_MANIFEST_DIR");

pub use common::kfd_standin::{
    GPU0, GPU1, StandInKfd, Status, assert_bos_and_pages, assert_queues_run, module_ko, reap,
    workload_status,
};

pub fn wait_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists())
    {
        assert!(Instant::now() < deadline, "{pids:?} still there");
        reap();
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub struct Bench {
    pub criu: PathBuf,
    pub lib: PathBuf,
    pub dir: TempDir,
    pub workload: PathBuf,
    pub topology: PathBuf,
}

impl Bench {
    /// Asks the workload `pid` for its status and waits for it.
    pub fn status(&self, pid: i32) -> Status {
        workload_status(pid, &self.dir.path().join(format!("status-{pid}")))
    }

    pub fn start(&self) -> (i32, i32) {
        let log = std::fs::File::create(self.dir.path().join("workload.log")).unwrap();
        let mut cmd = Command::new(&self.workload);
        cmd.arg(self.dir.path())
            .arg("share")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // SAFETY: setsid is async-signal-safe; CRIU dumps a session leader without a terminal.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let pid = child.id() as i32;
        std::mem::forget(child); // reaped by `reap`
        let file = self.dir.path().join(format!("status-{pid}"));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !file.exists() {
            assert!(
                Instant::now() < deadline,
                "the workload did not start: {}",
                std::fs::read_to_string(self.dir.path().join("workload.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let st = self.status(pid);
        (pid, st["child"].parse().unwrap())
    }

    /// Runs CRIU and returns its log; panics with the log's errors when it fails.
    pub fn criu(
        &self,
        action: &str,
        images: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> String {
        std::fs::create_dir_all(images).unwrap();
        let log = format!("{action}.log");
        let mut cmd = Command::new(&self.criu);
        cmd.arg(action)
            .arg("-D")
            .arg(images)
            .arg("-L")
            .arg(&self.lib)
            .args(["-v4", "-o", &log])
            .args(extra)
            .env("CRIU_GPU_AMDGPU_TOPOLOGY", &self.topology);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let text = std::fs::read_to_string(images.join(&log)).unwrap_or_default();
        // The whole log outlives the test's folder and the guest in cargo's target folder
        // (its tmp/ is a tmpfs in the guest).
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap();
        let kept = target.join(format!("kfd-module/criu-{action}.log"));
        if !out.status.success() {
            let _ = std::fs::write(&kept, &text);
        }
        assert!(
            out.status.success(),
            "criu {action} failed (whole log: {}):\n{}",
            kept.display(),
            text.lines()
                .filter(|l| l.contains("Error") || l.contains("gpu_plugin"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        text
    }

    pub fn dump(&self, pid: i32, images: &Path, leave_running: bool) {
        let mut extra = vec!["-t".to_string(), pid.to_string()];
        if leave_running {
            extra.push("--leave-running".into());
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        self.criu("dump", images, &extra, &[]);
    }

    /// Restores `images` and returns CRIU's log.
    pub fn restore(&self, images: &Path, pids: (i32, i32), env: &[(&str, &str)]) -> String {
        wait_gone(&[pids.0, pids.1]);
        self.criu("restore", images, &["-d"], env)
    }
}

/// Checks a restored workload against its status before the dump: every BO the same bytes
/// at the same address, each doorbell and MMIO page of the GPU it is on now (`actual`),
/// the queues running, and the child's dma-buf the parent's GPU 0 BO, shared both ways.
pub fn check_restored(b: &Bench, pids: (i32, i32), before: &Status, actual: [u32; 2], what: &str) {
    let after = b.status(pids.0);
    assert_bos_and_pages(&after, before, actual, what);
    let c0: u64 = after["gpu0_counter"].parse().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let later = b.status(pids.0);
    assert_queues_run(&after, &later, what);
    assert!(c0 > 0);
    let kid = b.status(pids.1);
    assert_eq!(kid["dmabuf_pattern"], "1", "{what}: the child's dma-buf");
    assert_eq!(
        kid["dmabuf_sum"], before["gpu0_vram_sum"],
        "{what}: the child's dma-buf"
    );
    assert_eq!(
        kid["dmabuf_marker_seen"], before["marker"],
        "{what}: the child's dma-buf does not hold what the parent's BO held"
    );
    let parent = b.status(pids.0);
    assert_eq!(
        parent["marker"], kid["dmabuf_marker_written"],
        "{what}: the parent's BO does not see the child's write through the dma-buf"
    );
}

pub fn kill_both(pids: (i32, i32)) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pids.1, libc::SIGKILL);
        libc::kill(pids.0, libc::SIGKILL);
    }
}

/// The open files of `pid` by kind: `dmabuf`, `kfd`, `render` and `other`.
pub fn fd_kinds(pid: i32) -> std::collections::BTreeMap<&'static str, usize> {
    let mut out = std::collections::BTreeMap::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let target = std::fs::read_link(fd.path()).unwrap_or_default();
        let t = target.to_string_lossy();
        let kind = if t.contains("dmabuf") {
            "dmabuf"
        } else if t == "/dev/kfd" {
            "kfd"
        } else if t.starts_with("/dev/dri/renderD") {
            "render"
        } else {
            "other"
        };
        *out.entry(kind).or_insert(0) += 1;
    }
    out
}

/// One test's bench: the module's path, the workload built, the plugin in place, the
/// checkpoint machine's topology (and the restore machine's, the GPUs swapped); the tests
/// take turns (one module at a time).
pub struct Setup {
    pub bench: Bench,
    pub ko: PathBuf,
    pub restore_topology: TempDir,
    _checkpoint_topology: TempDir,
    _turn: MutexGuard<'static, ()>,
}

/// The bench, or `None` (after saying SKIPPED) where the test cannot run.
pub fn setup(tag: &str) -> Option<Setup> {
    static TURN: Mutex<()> = Mutex::new(());
    let ko = module_ko();
    let criu = std::env::var_os("CRIU_BIN").map(PathBuf::from);
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let (Some(ko), Some(criu), true) = (ko, criu, root) else {
        println!(
            "SKIPPED: needs root, CRIU_BIN and KFD_STANDIN_KO (scripts/test.sh runs it in the guest)"
        );
        return None;
    };
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    assert!(ko.exists(), "no module {}", ko.display());
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) has no memory-safety preconditions.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let dir = TempDir::new(tag);
    let lib = dir.path().join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::copy(
        common::release_plugin::release_plugin_path(Path::new(REPO)),
        lib.join("gpu_plugin.so"),
    )
    .unwrap();
    let workload = dir.path().join("workload");
    if let Err(e) = common::kfd_standin::build_workload(&workload) {
        panic!("cannot build the workload: {e}");
    }
    let (ckpt_topo, rest_topo) = swapped_gpu_topologies();
    Some(Setup {
        bench: Bench {
            criu,
            lib,
            workload,
            topology: ckpt_topo.path().to_path_buf(),
            dir,
        },
        ko,
        restore_topology: rest_topo,
        _checkpoint_topology: ckpt_topo,
        _turn: turn,
    })
}
