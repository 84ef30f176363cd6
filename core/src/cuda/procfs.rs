//! What `/proc` says about the processes the backend handles. Every read is bounded.

use std::io::Read;
use std::path::Path;

use criu_plugin::proc::{read_small, status_field};
pub use criu_plugin::proc::{start_time, tracer, tree};

/// Resident memory of a process in bytes (0 when it cannot be read).
pub fn rss_bytes(pid: i32) -> u64 {
    status_field(pid, "VmRSS:")
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// The pid as the process's own (innermost) pid namespace sees it: what stays the same when a
/// container is restored into a new pid namespace, while the host pid changes.
pub fn ns_pid(pid: i32) -> Option<i32> {
    status_field(pid, "NSpid:")?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// How long ago the process started (clock-tick resolution, 10 ms on most kernels).
pub fn age(pid: i32) -> Option<std::time::Duration> {
    let start = start_time(pid)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let uptime: f64 = read_small(Path::new("/proc/uptime"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let started = start as f64 / hz.max(1) as f64;
    Some(std::time::Duration::from_secs_f64(
        (uptime - started).max(0.0),
    ))
}

/// The one-letter scheduler state of thread `tid` of `pid` (`R`, `S`, `T`, `t`, `Z`, ...).
pub fn thread_state(pid: i32, tid: i32) -> Option<char> {
    let stat = read_small(Path::new(&format!("/proc/{pid}/task/{tid}/stat")))?;
    // The command name may hold spaces and parentheses: the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// The frozen cgroup (v2 `cgroup.events` says `frozen 1`, v1 freezer says `FROZEN`) the process
/// is in, if any.
pub fn frozen_cgroup(pid: i32) -> Option<String> {
    let cgroups = read_small(Path::new(&format!("/proc/{pid}/cgroup")))?;
    for line in cgroups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        if path.contains("..") {
            continue;
        }
        if controllers.is_empty() {
            let events = format!("/sys/fs/cgroup{path}/cgroup.events");
            if read_small(Path::new(&events)).is_some_and(|t| t.lines().any(|l| l == "frozen 1")) {
                return Some(path.to_string());
            }
        } else if controllers.split(',').any(|c| c == "freezer") {
            let state = format!("/sys/fs/cgroup/freezer{path}/freezer.state");
            if read_small(Path::new(&state)).is_some_and(|t| t.trim() == "FROZEN") {
                return Some(path.to_string());
            }
        }
    }
    None
}

/// The thread ids of `pid` (empty when it is gone).
pub fn threads(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|it| {
            it.flatten()
                .take(1 << 16)
                .filter_map(|t| t.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Most descriptors and `maps` bytes looked at for NVIDIA devices: a bound on what a hostile
/// or huge process costs, far above what a CUDA process has.
const MAX_FDS_SCANNED: usize = 1 << 20;
const MAX_MAPS_BYTES: u64 = 64 << 20;

/// The first NVIDIA device (`/dev/nvidia*`) that `pid` has open or mapped, `None` when it has
/// none (or is gone). The driver is not asked: this is for runs where it cannot be.
pub fn nvidia_device(pid: i32) -> std::io::Result<Option<String>> {
    let is_nvidia = |p: &str| p.starts_with("/dev/nvidia");
    let fds = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    for fd in fds.take(MAX_FDS_SCANNED).flatten() {
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let target = target.to_string_lossy();
            if is_nvidia(&target) {
                return Ok(Some(target.into_owned()));
            }
        }
    }
    // A mapping outlives its descriptor (the driver's memory maps of /dev/nvidia*).
    let maps = match std::fs::File::open(format!("/proc/{pid}/maps")) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let reader = std::io::BufReader::new(maps.take(MAX_MAPS_BYTES));
    for line in std::io::BufRead::split(reader, b'\n') {
        let line = line?;
        // The path is the sixth field; it may hold spaces.
        let text = String::from_utf8_lossy(&line);
        if let Some(pos) = text.find(" /dev/nvidia") {
            return Ok(Some(text[pos + 1..].trim_end().to_string()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = std::process::id() as i32;
        assert!(rss_bytes(me) > 0);
        assert!(ns_pid(me).is_some());
        assert_eq!(tracer(me), Some(0));
        assert!(matches!(thread_state(me, me), Some('R' | 'S')));
        assert_eq!(tree(me)[0], me);
        assert!(threads(me).contains(&me));
        assert!(threads(-1).is_empty());
        assert!(start_time(me).is_some());
        assert_eq!(start_time(-1), None);
        assert_eq!(rss_bytes(-1), 0);
        assert_eq!(ns_pid(-1), None);
    }

    #[test]
    fn nvidia_devices_are_found_open_or_mapped() {
        let me = std::process::id() as i32;
        assert_eq!(nvidia_device(me).unwrap(), None);
        assert_eq!(nvidia_device(-1).unwrap(), None);
        // Root may create a file of that name in /dev; elsewhere the positive case is left to
        // tests/e2e_cuda_fake.rs.
        let path = format!("/dev/nvidia-gpu-plugin-unit-{me}");
        let Ok(f) = std::fs::File::create(&path) else {
            return;
        };
        let _ = std::fs::remove_file(&path);
        let found = nvidia_device(me).unwrap();
        assert_eq!(found.as_deref(), Some(format!("{path} (deleted)").as_str()));
        drop(f);
        assert_eq!(nvidia_device(me).unwrap(), None);
    }

    #[test]
    fn children_are_found() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let me = std::process::id() as i32;
        let t = tree(me);
        assert!(t.contains(&(child.id() as i32)), "{t:?}");
        assert_eq!(frozen_cgroup(child.id() as i32), None);
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
