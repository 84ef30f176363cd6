//! A Kubernetes pod of this node, found without an API server or a CRI client: the kubelet
//! keeps each pod's container logs in `<podLogsDir>/<namespace>_<name>_<uid>`, and names the
//! pod's cgroup after the uid (`pod<uid>` with the cgroupfs driver,
//! `kubepods[-<qos>]-pod<uid with '_' for '-'>.slice` with the systemd driver).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

use crate::targets::{MAX_CGROUPS, MAX_DEPTH};

/// The kubelet's default podLogsDir.
pub const DEFAULT_POD_LOGS: &str = "/var/log/pods";
/// Most entries read from the podLogsDir (a node runs a few hundred pods at most).
const MAX_LOG_ENTRIES: usize = 100_000;
/// Longest pod uid taken from a log directory's name (a UUID, or a static pod's hash).
const MAX_UID_BYTES: usize = 128;
/// Longest namespace or pod name Kubernetes allows.
const MAX_NAME_BYTES: usize = 253;

/// Why a pod's cgroup cannot be found.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// No log directory of the pod.
    #[error(
        "no pod {namespace}/{name} on this node: no directory {namespace}_{name}_UID in {} (the kubelet's podLogsDir); the pod may run on another node (`kubectl get pod -n {namespace} {name} -o wide` names it), or give --pod-logs DIR if this kubelet's podLogsDir is elsewhere",
        logs.display()
    )]
    NotOnThisNode {
        namespace: String,
        name: String,
        logs: PathBuf,
    },
    /// Log directories, but no cgroup for any of them.
    #[error(
        "pod {namespace}/{name} has no cgroup under {} (its logs: {}): the pod has ended, or the kubelet's cgroup root is not under /sys/fs/cgroup (then give --cgroup PATH)",
        root.display(), list(dirs)
    )]
    Ended {
        namespace: String,
        name: String,
        dirs: Vec<PathBuf>,
        root: PathBuf,
    },
    /// More than one log directory whose cgroup exists.
    #[error(
        "pod {namespace}/{name} has more than one log directory with a live cgroup: {}; give --cgroup PATH with the one meant",
        found.iter().map(|(d, c)| format!("{} (cgroup {})", d.display(), c.display())).collect::<Vec<_>>().join(", ")
    )]
    Ambiguous {
        namespace: String,
        name: String,
        /// Each log directory with its cgroup.
        found: Vec<(PathBuf, PathBuf)>,
    },
    /// The podLogsDir cannot be listed.
    #[error(
        "cannot read {} (the kubelet's podLogsDir; give --pod-logs DIR if it is elsewhere): {err}",
        logs.display()
    )]
    LogsUnreadable { logs: PathBuf, err: std::io::Error },
    /// The podLogsDir holds more entries than any kubelet leaves.
    #[error(
        "{} has more than {MAX_LOG_ENTRIES} entries; is it the kubelet's podLogsDir?",
        .0.display()
    )]
    TooManyLogEntries(PathBuf),
    /// No cgroup hierarchy to search.
    #[error(
        "no cgroup hierarchy in {}: it is no cgroup2 mount and has none of pids, memory, cpu,cpuacct",
        .0.display()
    )]
    NoHierarchy(PathBuf),
    /// The search gave up before it found the pod's cgroup.
    #[error(
        "searched {MAX_CGROUPS} cgroups under {} without finding pod {namespace}/{name}'s; give --cgroup PATH with its cgroup",
        root.display()
    )]
    SearchTooLarge {
        namespace: String,
        name: String,
        root: PathBuf,
    },
}

fn list(dirs: &[PathBuf]) -> String {
    let names: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    names.join(", ")
}

/// Whether `s` is a DNS-1123 subdomain, as Kubernetes requires of namespaces and pod names:
/// dot-separated labels of lowercase letters, digits and '-', each starting and ending with a
/// letter or digit, at most 253 bytes in all. Such a name has no '_', so the log directory's
/// name splits one way only.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= MAX_NAME_BYTES
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            matches!((b.first(), b.last()), (Some(&f), Some(&l)) if alnum(f) && alnum(l))
                && b.iter().all(|&c| alnum(c) || c == b'-')
        })
}

/// The hierarchy searched below `base` (normally `/sys/fs/cgroup`): `base` itself when it is a
/// cgroup2 mount, else the first of its v1 hierarchies the kubelet makes pod cgroups in.
pub fn hierarchy(base: &Path) -> Result<PathBuf, PodError> {
    if base.join("cgroup.procs").is_file() {
        return Ok(base.to_path_buf());
    }
    ["pids", "memory", "cpu,cpuacct"]
        .iter()
        .map(|h| base.join(h))
        .find(|d| d.join("cgroup.procs").is_file())
        .ok_or_else(|| PodError::NoHierarchy(base.to_path_buf()))
}

/// The uids of the log directories `<namespace>_<name>_<uid>` in `logs`, with each directory.
fn log_dirs(namespace: &str, name: &str, logs: &Path) -> Result<Vec<(String, PathBuf)>, PodError> {
    let unreadable = |err| PodError::LogsUnreadable {
        logs: logs.to_path_buf(),
        err,
    };
    let prefix = format!("{namespace}_{name}_");
    let mut found = Vec::new();
    let entries = match std::fs::read_dir(logs) {
        // No podLogsDir: no kubelet here, or one that keeps it elsewhere.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        r => r.map_err(unreadable)?,
    };
    for (n, entry) in entries.enumerate() {
        if n >= MAX_LOG_ENTRIES {
            return Err(PodError::TooManyLogEntries(logs.to_path_buf()));
        }
        let entry = entry.map_err(unreadable)?;
        let file_name = entry.file_name();
        let Some(uid) = file_name.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        // A uid is a UUID or a hash: anything else is not the kubelet's.
        let uid_like = !uid.is_empty()
            && uid.len() <= MAX_UID_BYTES
            && uid.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
        if uid_like && entry.file_type().is_ok_and(|t| t.is_dir()) {
            found.push((uid.to_string(), entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// Whether cgroup directory `dir_name` is the kubelet's cgroup of the pod with `uid`:
/// `pod<uid>` (cgroupfs), or a slice ending in `-pod<uid with '_' for '-'>.slice` whose
/// prefix names `kubepods` (systemd: `kubepods-besteffort-pod...`, `kubepods-pod...` for
/// guaranteed pods, `kubelet-kubepods-burstable-pod...` under a cgroup root `/kubelet`).
fn is_pod_cgroup(dir_name: &str, uid: &str) -> bool {
    if dir_name.strip_prefix("pod") == Some(uid) {
        return true;
    }
    let Some((prefix, u)) = dir_name
        .strip_suffix(".slice")
        .and_then(|r| r.rsplit_once("-pod"))
    else {
        return false;
    };
    // systemd reads '-' in a slice name as nesting, so the kubelet writes the uid with '_'.
    prefix.split('-').any(|p| p == "kubepods")
        && u.len() == uid.len()
        && u.bytes().eq(uid.bytes().map(dash_to_underscore))
}

fn dash_to_underscore(c: u8) -> u8 {
    if c == b'-' { b'_' } else { c }
}

/// The cgroup of pod `namespace/name`: its log directories in `logs`, and for each the first
/// cgroup named after its uid below the hierarchy [`hierarchy`] picks in `cgroup_base`,
/// breadth first, without following links. Of several log directories (a pod made again under
/// the same name leaves the old logs for a while), the one whose cgroup exists.
pub fn pod_cgroup(
    namespace: &str,
    name: &str,
    logs: &Path,
    cgroup_base: &Path,
) -> Result<PathBuf, PodError> {
    let dirs = log_dirs(namespace, name, logs)?;
    if dirs.is_empty() {
        return Err(PodError::NotOnThisNode {
            namespace: namespace.to_string(),
            name: name.to_string(),
            logs: logs.to_path_buf(),
        });
    }
    let root = hierarchy(cgroup_base)?;
    let mut cgroups: Vec<Option<PathBuf>> = vec![None; dirs.len()];
    let mut todo = VecDeque::from([(root.clone(), 0usize)]);
    let mut seen = 0usize;
    while let Some((d, depth)) = todo.pop_front() {
        if cgroups.iter().all(Option::is_some) {
            break;
        }
        seen += 1;
        if seen > MAX_CGROUPS {
            // What was found so far stands; nothing found is an error.
            if cgroups.iter().any(Option::is_some) {
                break;
            }
            return Err(PodError::SearchTooLarge {
                namespace: namespace.to_string(),
                name: name.to_string(),
                root,
            });
        }
        if depth >= MAX_DEPTH {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            // A cgroup is a directory; a link is not followed.
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let file_name = e.file_name();
            let Some(cg_name) = file_name.to_str() else {
                continue;
            };
            match dirs.iter().position(|(uid, _)| is_pod_cgroup(cg_name, uid)) {
                // The pod's sub-cgroups are its containers: nothing more to find there.
                Some(i) => {
                    cgroups[i].get_or_insert_with(|| e.path());
                }
                None => todo.push_back((e.path(), depth + 1)),
            }
        }
    }
    let mut live: Vec<(PathBuf, PathBuf)> = dirs
        .iter()
        .zip(cgroups)
        .filter_map(|((_, dir), cg)| cg.map(|cg| (dir.clone(), cg)))
        .collect();
    match live.len() {
        0 => Err(PodError::Ended {
            namespace: namespace.to_string(),
            name: name.to_string(),
            dirs: dirs.into_iter().map(|(_, d)| d).collect(),
            root,
        }),
        1 => Ok(live.remove(0).1),
        _ => Err(PodError::Ambiguous {
            namespace: namespace.to_string(),
            name: name.to_string(),
            found: live,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    const OLD_UID: &str = "11111111-2222-3333-4444-555555555555";

    /// A fresh directory for one test, with `logs/` and `cgroup/` (a cgroup2 mount's stand-in).
    fn tree(test: &str) -> (PathBuf, PathBuf) {
        let d = std::env::temp_dir().join(format!("criu-gpu-pods-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let (logs, cg) = (d.join("logs"), d.join("cgroup"));
        std::fs::create_dir_all(&logs).unwrap();
        cgroup(&cg);
        (logs, cg)
    }

    fn cgroup(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("cgroup.procs"), "").unwrap();
    }

    fn pod_logs(logs: &Path, uid: &str) -> PathBuf {
        let d = logs.join(format!("default_train_{uid}"));
        std::fs::create_dir_all(d.join("worker")).unwrap();
        d
    }

    #[test]
    fn names() {
        for good in [
            "default",
            "kube-system",
            "a",
            "my.app-1",
            "0",
            &"a".repeat(253),
        ] {
            assert!(is_dns1123_subdomain(good), "{good}");
        }
        for bad in [
            "",
            "Default",
            "a_b",
            "-a",
            "a-",
            "a..b",
            ".a",
            "a.",
            "a/b",
            "é",
            &"a".repeat(254),
        ] {
            assert!(!is_dns1123_subdomain(bad), "{bad}");
        }
    }

    #[test]
    fn cgroupfs_name_on_cgroup2() {
        let (logs, cg) = tree("cgroupfs");
        pod_logs(&logs, UID);
        // Another pod whose name begins the same, and a file, are not this pod's.
        std::fs::write(logs.join("default_train_file"), "").unwrap();
        std::fs::create_dir_all(logs.join(format!("default_train-2_{OLD_UID}"))).unwrap();
        let pod = cg.join("kubepods/burstable").join(format!("pod{UID}"));
        cgroup(&pod);
        cgroup(&pod.join("c0ffee"));
        assert_eq!(pod_cgroup("default", "train", &logs, &cg).unwrap(), pod);
    }

    #[test]
    fn systemd_name_on_v1() {
        let (logs, base) = tree("systemd");
        std::fs::remove_file(base.join("cgroup.procs")).unwrap();
        pod_logs(&logs, UID);
        let slice = format!("kubepods-besteffort-pod{}.slice", UID.replace('-', "_"));
        // pids comes before memory; a directory without cgroup.procs is no mounted hierarchy.
        std::fs::create_dir_all(base.join("cpu,cpuacct")).unwrap();
        cgroup(&base.join("memory"));
        cgroup(&base.join("pids"));
        let mem = base.join("memory/kubepods.slice/kubepods-besteffort.slice");
        cgroup(&mem.join(&slice));
        let pids = base.join("pids/kubepods.slice/kubepods-besteffort.slice");
        cgroup(&pids.join(&slice));
        assert_eq!(hierarchy(&base).unwrap(), base.join("pids"));
        assert_eq!(
            pod_cgroup("default", "train", &logs, &base).unwrap(),
            pids.join(&slice)
        );
        let guaranteed = format!("kubepods-pod{}.slice", UID.replace('-', "_"));
        assert!(is_pod_cgroup(&guaranteed, UID));
        assert!(!is_pod_cgroup(&format!("kubepods-pod{UID}.slice"), UID));
        let under_root = format!(
            "kubelet-kubepods-burstable-pod{}.slice",
            UID.replace('-', "_")
        );
        assert!(is_pod_cgroup(&under_root, UID));
        let not_kubelets = format!("system-pod{}.slice", UID.replace('-', "_"));
        assert!(!is_pod_cgroup(&not_kubelets, UID));
        assert!(!is_pod_cgroup(&format!("pod{OLD_UID}"), UID));
    }

    #[test]
    fn stale_logs_are_passed_over_and_two_live_ones_named() {
        let (logs, cg) = tree("stale");
        pod_logs(&logs, OLD_UID);
        pod_logs(&logs, UID);
        let pod = cg.join("kubepods").join(format!("pod{UID}"));
        cgroup(&pod);
        assert_eq!(pod_cgroup("default", "train", &logs, &cg).unwrap(), pod);
        cgroup(&cg.join("kubepods").join(format!("pod{OLD_UID}")));
        let e = pod_cgroup("default", "train", &logs, &cg).unwrap_err();
        assert!(matches!(e, PodError::Ambiguous { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains(UID) && e.contains(OLD_UID), "{e}");
    }

    #[test]
    fn missing_pod_ended_pod_and_unreadable_logs() {
        let (logs, cg) = tree("missing");
        let e = pod_cgroup("default", "train", &logs, &cg).unwrap_err();
        assert!(matches!(e, PodError::NotOnThisNode { .. }), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("another node") && e.contains("--pod-logs"),
            "{e}"
        );
        let dir = pod_logs(&logs, UID);
        let e = pod_cgroup("default", "train", &logs, &cg).unwrap_err();
        assert!(matches!(e, PodError::Ended { .. }), "{e}");
        assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
        let e = pod_cgroup("default", "train", &logs.join("nope"), &cg).unwrap_err();
        assert!(matches!(e, PodError::NotOnThisNode { .. }), "{e}");
        // A file is no podLogsDir.
        std::fs::write(dir.join("worker/0.log"), "").unwrap();
        let e = pod_cgroup("default", "train", &dir.join("worker/0.log"), &cg).unwrap_err();
        assert!(matches!(e, PodError::LogsUnreadable { .. }), "{e}");
        let e = pod_cgroup("default", "train", &logs, &logs).unwrap_err();
        assert!(matches!(e, PodError::NoHierarchy(_)), "{e}");
    }

    #[test]
    fn links_are_not_followed() {
        let (logs, cg) = tree("links");
        pod_logs(&logs, UID);
        let elsewhere = cg.join("..").join("elsewhere");
        cgroup(&elsewhere.join(format!("pod{UID}")));
        std::os::unix::fs::symlink(&elsewhere, cg.join("kubepods")).unwrap();
        let e = pod_cgroup("default", "train", &logs, &cg).unwrap_err();
        assert!(matches!(e, PodError::Ended { .. }), "{e}");
    }
}
