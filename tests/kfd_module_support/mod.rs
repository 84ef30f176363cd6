//! What the stand-in KFD module's tests share (`tests/kfd_module.rs`): the module loaded and
//! unloaded, the workload (`tests/kfd_module/workload.c`) started and asked for its status,
//! CRIU run on it, and a restored workload checked.

#![allow(dead_code)]

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::amdgpu_support::{TempDir, swapped_gpu_topologies};
use super::common;

pub const REPO: &str = env!("CARGO_MANIFEST_DIR");
pub const GPU0: u32 = 53109;
pub const GPU1: u32 = 1266;

pub type Status = HashMap<String, String>;

pub fn sh(cmd: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .status()
        .is_ok_and(|s| s.success())
}

/// The module, loaded with `ids`; unloaded again on drop.
pub struct Module;

impl Module {
    pub fn load(ko: &Path, ids: [u32; 2]) -> Module {
        let _ = sh("rmmod kfd_standin 2>/dev/null");
        assert!(sh("modprobe drm"), "modprobe drm failed");
        let arg = format!("gpu_ids={},{}", ids[0], ids[1]);
        let out = Command::new("insmod").arg(ko).arg(&arg).output().unwrap();
        assert!(
            out.status.success(),
            "insmod {} {arg}: {}",
            ko.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !Path::new("/dev/kfd").exists() || !Path::new("/dev/dri/renderD129").exists() {
            assert!(Instant::now() < deadline, "no /dev/kfd after insmod");
            std::thread::sleep(Duration::from_millis(50));
        }
        Module
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // A test that failed left its workload running: end whatever holds the module's
        // files, so that the next test finds it unloaded.
        if std::thread::panicking() {
            kill_kfd_users();
        }
        // The module stays busy until the last of its files is closed: a killed process's
        // are closed once it is reaped.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !sh("rmmod kfd_standin 2>/dev/null") && Instant::now() < deadline {
            reap();
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// What `/proc` says of `pid`: its state, tracer and where it sleeps.
pub fn task_state(pid: i32) -> String {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return "gone".into();
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map_or("?", str::trim)
            .to_string()
    };
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    format!(
        "state {}, tracer {}, waiting in {wchan:?}",
        field("State:"),
        field("TracerPid:")
    )
}

/// SIGKILLs every process with a file of the module open (`/dev/kfd`, its render nodes).
fn kill_kfd_users() {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for pid in procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
    {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        let uses = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|t| {
                t.to_str().is_some_and(|t| {
                    t.starts_with("/dev/kfd") || t.starts_with("/dev/dri/") || t.contains("dmabuf")
                })
            })
        });
        if uses && pid != std::process::id() as i32 {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Reaps every exited child (the test is the subreaper of what CRIU restores).
pub fn reap() {
    loop {
        // SAFETY: waitpid with a null status pointer has no memory-safety preconditions.
        let r = unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) };
        if r <= 0 {
            return;
        }
    }
}

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
        let file = self.dir.path().join(format!("status-{pid}"));
        let _ = std::fs::remove_file(&file);
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR1) }, 0, "signal {pid}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(text) = std::fs::read_to_string(&file) {
                return text
                    .lines()
                    .filter_map(|l| l.split_once(' '))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
            }
            assert!(
                Instant::now() < deadline,
                "no status from {pid} within 30 s ({})",
                task_state(pid)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
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
    for g in 0..2 {
        for k in ["id", "vram_addr", "gtt_addr", "vram_sum", "gtt_sum"] {
            let key = format!("gpu{g}_{k}");
            assert_eq!(after.get(&key), before.get(&key), "{what}: {key}");
        }
        for k in ["vram_pattern", "gtt_pattern"] {
            assert_eq!(after[&format!("gpu{g}_{k}")], "1", "{what}: gpu{g}_{k}");
        }
        for k in ["doorbell", "mmio"] {
            let want = format!("4b464453 {}", actual[g]);
            assert_eq!(after[&format!("gpu{g}_{k}")], want, "{what}: gpu{g}_{k}");
        }
    }
    let c0: u64 = after["gpu0_counter"].parse().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let later = b.status(pids.0);
    for g in 0..2 {
        let (a, l): (u64, u64) = (
            after[&format!("gpu{g}_counter")].parse().unwrap(),
            later[&format!("gpu{g}_counter")].parse().unwrap(),
        );
        assert!(
            l > a,
            "{what}: GPU {g}'s queue does not run after the restore ({a} -> {l})"
        );
    }
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

/// Where `<drm/drm.h>` (which `<linux/kfd_ioctl.h>` includes) is not among the system
/// headers (Debian 12's linux-libc-dev lacks it), the kernel headers' uapi folder, searched
/// after the system's (unsanitised: `__user` is defined away, as `make headers` does).
pub fn uapi_fallback() -> Vec<String> {
    if Path::new("/usr/include/drm/drm.h").exists() {
        return Vec::new();
    }
    let Ok(dirs) = std::fs::read_dir("/usr/src") else {
        return Vec::new();
    };
    dirs.flatten()
        .map(|d| d.path().join("include/uapi"))
        .filter(|u| u.join("drm/drm.h").exists())
        .take(1)
        .flat_map(|u| {
            [
                "-D__user=".to_string(),
                "-idirafter".to_string(),
                u.display().to_string(),
            ]
        })
        .collect()
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
    let ko = std::env::var_os("KFD_STANDIN_KO").map(PathBuf::from);
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
    let cc = Command::new("cc")
        .args(uapi_fallback())
        .args(["-O2", "-Wall", "-o"])
        .arg(&workload)
        .arg(Path::new(REPO).join("tests/kfd_module/workload.c"))
        .status()
        .unwrap();
    assert!(cc.success(), "cannot build the workload");
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
