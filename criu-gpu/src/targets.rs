//! Which processes a command acts on: a pid with its descendants (every thread's
//! `/proc/PID/task/TID/children`), or every pid of a cgroup and its sub-cgroups
//! (`cgroup.procs`, v1 or v2), or of a pod's cgroup (found in [`crate::pods`]).

use std::path::{Path, PathBuf};

use criu_gpu_core::session;

use crate::args::Target;
use crate::pods::{self, PodError};

/// Most cgroups walked below the one named.
pub(crate) const MAX_CGROUPS: usize = 10_000;
/// Deepest sub-cgroup walked.
pub(crate) const MAX_DEPTH: usize = 32;
/// Largest `cgroup.procs` read.
const MAX_PROCS_BYTES: u64 = 4 << 20;
/// Where cgroup hierarchies are mounted; a relative `--cgroup` path is taken below it.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Why a target's processes cannot be found.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// No such process.
    #[error("no process {0} (check the pid with `ps -p {0}`; in a container, give the host's pid)")]
    NoProcess(i32),
    /// The path is no cgroup.
    #[error(
        "{} is not a cgroup (no cgroup.procs there); give its directory, e.g. /sys/fs/cgroup/unified/NAME (v2) or /sys/fs/cgroup/pids/NAME (v1), or a path relative to {CGROUP_ROOT}",
        .0.display()
    )]
    NotACgroup(PathBuf),
    /// Too many sub-cgroups to walk.
    #[error("{} has more than {MAX_CGROUPS} sub-cgroups; name a smaller one", .0.display())]
    TooManyCgroups(PathBuf),
    /// A `cgroup.procs` cannot be read.
    #[error("cannot read {}: {err}", path.display())]
    Unreadable {
        /// The `cgroup.procs` file.
        path: PathBuf,
        /// Why.
        err: std::io::Error,
    },
    /// The pod's cgroup cannot be found.
    #[error(transparent)]
    Pod(#[from] PodError),
}

/// The pids of `target`, in order (root first for a tree, ascending for a cgroup), without
/// this process.
pub fn resolve(target: &Target) -> Result<Vec<i32>, TargetError> {
    let me = std::process::id() as i32;
    let mut pids = match target {
        Target::Pid(pid) => {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return Err(TargetError::NoProcess(*pid));
            }
            session::process_tree(*pid)
        }
        Target::Cgroup(path) => cgroup_pids(&cgroup_dir(path)?)?,
        Target::Pod {
            namespace,
            name,
            logs,
        } => {
            let cgroup = pods::pod_cgroup(namespace, name, logs, Path::new(CGROUP_ROOT))?;
            log::info!("pod {namespace}/{name}: cgroup {}", cgroup.display());
            cgroup_pids(&cgroup)?
        }
    };
    pids.retain(|&p| p != me);
    Ok(pids)
}

/// The cgroup directory `path` names: as given, or below `/sys/fs/cgroup` when relative.
pub fn cgroup_dir(path: &Path) -> Result<PathBuf, TargetError> {
    let candidates: Vec<PathBuf> = if path.is_absolute() {
        vec![path.to_path_buf()]
    } else {
        vec![path.to_path_buf(), Path::new(CGROUP_ROOT).join(path)]
    };
    candidates
        .iter()
        .find(|d| d.join("cgroup.procs").is_file())
        .cloned()
        .ok_or_else(|| TargetError::NotACgroup(path.to_path_buf()))
}

/// Every pid of cgroup `dir` and of its sub-cgroups, ascending.
pub fn cgroup_pids(dir: &Path) -> Result<Vec<i32>, TargetError> {
    let mut pids = Vec::new();
    let mut todo = vec![(dir.to_path_buf(), 0usize)];
    let mut seen = 0usize;
    while let Some((d, depth)) = todo.pop() {
        seen += 1;
        if seen > MAX_CGROUPS {
            return Err(TargetError::TooManyCgroups(dir.to_path_buf()));
        }
        let procs = d.join("cgroup.procs");
        let bytes = criu_plugin::files::read_regular(None, &procs, false, MAX_PROCS_BYTES)
            .map_err(|err| TargetError::Unreadable {
                path: procs.clone(),
                err,
            })?;
        pids.extend(
            String::from_utf8_lossy(&bytes)
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .filter(|&p| p > 0),
        );
        if depth >= MAX_DEPTH {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            // Sub-cgroups are directories; a link is not followed.
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push((e.path(), depth + 1));
            }
        }
    }
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_never_a_target() {
        let me = std::process::id() as i32;
        let pids = resolve(&Target::Pid(me)).unwrap();
        assert!(!pids.contains(&me));
        assert!(
            resolve(&Target::Pid(i32::MAX))
                .unwrap_err()
                .to_string()
                .contains("no process")
        );
        let e = resolve(&Target::Cgroup("/nonexistent-cg".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a cgroup"), "{e}");
    }
}
