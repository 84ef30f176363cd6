//! The stand-in KFD kernel module (`tests/kfd_module/`, `docs/kfd-module.md`) as the tests
//! that run where it is loadable use it (the test guest): loaded with two GPUs and unloaded
//! again, and its workload (`tests/kfd_module/workload.c`) built.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The gpu ids the module's two GPUs get in most tests: those of the `2gpu` topology fixture
/// (`tests/fixtures/kfd-topology/2gpu`, render nodes 128 and 129).
pub const GPU0: u32 = 53109;
pub const GPU1: u32 = 1266;

/// The module built for the running kernel (`KFD_STANDIN_KO`, which `scripts/test.sh` sets
/// in the test guest), where one is given.
pub fn module_ko() -> Option<PathBuf> {
    std::env::var_os("KFD_STANDIN_KO").map(PathBuf::from)
}

fn sh(cmd: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .status()
        .is_ok_and(|s| s.success())
}

/// The module, loaded with two GPUs; unloaded again on drop.
pub struct StandInKfd;

impl StandInKfd {
    /// Loads module `ko` with gpu ids `ids`; returns once `/dev/kfd` and both render nodes
    /// exist.
    pub fn load(ko: &Path, ids: [u32; 2]) -> StandInKfd {
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
        StandInKfd
    }
}

impl Drop for StandInKfd {
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

/// Where `<drm/drm.h>` (which `<linux/kfd_ioctl.h>` includes) is not among the system
/// headers (Debian 12's linux-libc-dev lacks it), the kernel headers' uapi folder, searched
/// after the system's (unsanitised: `__user` is defined away, as `make headers` does).
fn uapi_fallback() -> Vec<String> {
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

/// Builds the module's workload (`tests/kfd_module/workload.c`) as `out`; the compiler's
/// messages if it cannot (no KFD or DRM headers here).
pub fn build_workload(out: &Path) -> Result<(), String> {
    let cc = Command::new("cc")
        .args(uapi_fallback())
        .args(["-O2", "-Wall", "-o"])
        .arg(out)
        .arg(Path::new(crate::REPO).join("tests/kfd_module/workload.c"))
        .output()
        .map_err(|e| format!("cc: {e}"))?;
    if cc.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&cc.stderr).into_owned())
    }
}

/// What the workload says at SIGUSR1: `key value` lines.
pub type Status = HashMap<String, String>;

/// Asks the workload `pid` for its status (SIGUSR1) and waits for it in `file`
/// (`<its DIR>/status-<its pid as it sees it>`).
pub fn workload_status(pid: i32, file: &Path) -> Status {
    let _ = std::fs::remove_file(file);
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR1) }, 0, "signal {pid}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(file) {
            return text
                .lines()
                .filter_map(|l| l.split_once(' '))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "no status from {pid} in {} within 30 s ({})",
            file.display(),
            task_state(pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What `/proc` says of `pid`: its state, tracer and where it sleeps.
pub fn task_state(pid: i32) -> String {
    crate::task_state_at(Path::new(&format!("/proc/{pid}")))
}

/// The workload's status `now` against `before` (an earlier one, or the one at its dump): on
/// both GPUs every BO the same bytes at the same address, and each doorbell and MMIO page of
/// the GPU it is on now (`actual`, the gpu ids the module gives).
pub fn assert_bos_and_pages(now: &Status, before: &Status, actual: [u32; 2], what: &str) {
    for (g, id) in actual.into_iter().enumerate() {
        for k in ["id", "vram_addr", "gtt_addr", "vram_sum", "gtt_sum"] {
            let key = format!("gpu{g}_{k}");
            assert_eq!(now.get(&key), before.get(&key), "{what}: {key}");
        }
        for k in ["vram_pattern", "gtt_pattern"] {
            assert_eq!(now[&format!("gpu{g}_{k}")], "1", "{what}: gpu{g}_{k}");
        }
        for k in ["doorbell", "mmio"] {
            let want = format!("4b464453 {id}");
            assert_eq!(now[&format!("gpu{g}_{k}")], want, "{what}: gpu{g}_{k}");
        }
    }
}

/// Both GPUs' queues ran between the workload's statuses `now` and `later` (its counters
/// went up).
pub fn assert_queues_run(now: &Status, later: &Status, what: &str) {
    for g in 0..2 {
        let key = format!("gpu{g}_counter");
        let (a, l): (u64, u64) = (now[&key].parse().unwrap(), later[&key].parse().unwrap());
        assert!(l > a, "{what}: GPU {g}'s queue does not run ({a} -> {l})");
    }
}
