//! Private mount namespaces for the runtimes' commands: CRIU's configuration, plugins and the
//! plugin's settings seen in the system's places without touching the system.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::tool_path;
use crate::common::E2e;

/// Bind mounts that a runtime command sees in a mount namespace of its own, so that CRIU finds
/// its configuration, plugins and the plugin's settings in the system's places (`/etc/criu`,
/// `/usr/lib/criu`) and the runtimes' own state lands in the test's directory, while the
/// system sees none of it. The namespace is made by `unshare -m` around the command: a
/// multi-threaded test process cannot unshare itself. A target that does not exist is made in
/// an overlay of its nearest existing ancestor (the upper layer in the test's directory), so
/// nothing is created in the real file system either.
#[derive(Clone, Debug, Default)]
pub struct PrivateMounts {
    binds: Vec<(PathBuf, PathBuf)>,
    cgroup2_only: bool,
    /// A network namespace the command runs in (a Kubernetes node's own).
    net_ns: Option<PathBuf>,
}

/// `prepare SRC TARGET` makes TARGET (a directory if SRC is one, else a file) where it is
/// missing, in an overlay of its nearest existing ancestor, unless that ancestor already lies in
/// an overlay made here (then it is made in that overlay's upper layer); `place SRC TARGET` binds
/// SRC on it. Every target is prepared before the first bind, shallowest ancestor first: an
/// overlay made over a directory hides what is mounted below it (a bind made earlier, or an
/// overlay of a deeper directory), and two targets missing under one directory (`/etc/criu`
/// and `/etc/containers` on a system that has neither) need one overlay, not two stacked.
/// `mount -n`: util-linux's mount would otherwise create /run/mount for its utab.
const PLACE_FN: &str = r#"O=""
prepare() {
    a=$2
    while [ ! -e "$a" ]; do a=${a%/*}; [ -n "$a" ] || a=/; done
    [ "$a" != "$2" ] || return 0
    inside=0
    for o in $O; do
        case "$a/" in "${o%/}/"*) inside=1 ;; esac
    done
    if [ "$inside" = 0 ]; then
        n=$((n + 1))
        mkdir -p "$S/u$n" "$S/w$n"
        mount -n -t overlay overlay -o "lowerdir=$a,upperdir=$S/u$n,workdir=$S/w$n" "$a"
        O="$O $a"
    fi
    if [ -d "$1" ]; then mkdir -p "$2"; else mkdir -p "${2%/*}"; : >"$2"; fi
}
place() {
    mount -n --bind "$1" "$2"
}
"#;

/// The nearest ancestor of `target` (itself included) that exists, as seen before any mount.
fn existing_ancestor(target: &Path) -> &Path {
    target
        .ancestors()
        .find(|a| a.exists())
        .unwrap_or(Path::new("/"))
}

fn sh_quote(p: &Path) -> String {
    let s = p.to_str().expect("UTF-8 path");
    assert!(!s.contains('\''), "path with a quote: {s}");
    format!("'{s}'")
}

impl PrivateMounts {
    pub fn new() -> PrivateMounts {
        PrivateMounts::default()
    }

    /// `src` (a directory or file of the test) is seen at `target`.
    pub fn bind(mut self, src: impl Into<PathBuf>, target: impl Into<PathBuf>) -> PrivateMounts {
        self.binds.push((src.into(), target.into()));
        self
    }

    /// The command sees a cgroup-v2-only system: `/sys/fs/cgroup` is a cgroup2 mount (the
    /// unified hierarchy, whose cgroups are the host's) instead of the hybrid layout's tmpfs of
    /// v1 hierarchies, so that runtimes, their cgroup managers and CRIU take their v2 paths.
    /// The controllers the host binds to v1 hierarchies (all but `hugetlb` here) are not in it.
    pub fn cgroup2_only(mut self, on: bool) -> PrivateMounts {
        self.cgroup2_only = on;
        self
    }

    /// The command runs in network namespace `ns` (its file, `/proc/PID/ns/net`).
    pub fn in_net_ns(mut self, ns: impl Into<PathBuf>) -> PrivateMounts {
        self.net_ns = Some(ns.into());
        self
    }

    /// A command running `argv` with these mounts (plainly when there are none), its overlay
    /// layers under `scratch` (a fresh directory per command), in the network namespace given.
    pub fn command(&self, e: &E2e, scratch: &Path, argv: &[OsString]) -> Command {
        let mounted = self.mounted(e, scratch, argv);
        let Some(ns) = &self.net_ns else {
            return mounted;
        };
        // nsenter first: the mount namespace is then made inside the network namespace.
        let mut cmd = e.command(Path::new("nsenter"));
        cmd.arg(format!("--net={}", ns.display()))
            .arg("--")
            .arg(mounted.get_program())
            .args(mounted.get_args());
        for (k, v) in mounted.get_envs() {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd
    }

    fn mounted(&self, e: &E2e, scratch: &Path, argv: &[OsString]) -> Command {
        let mut cmd = if self.binds.is_empty() && !self.cgroup2_only {
            e.command(Path::new(&argv[0]))
        } else {
            static N: AtomicUsize = AtomicUsize::new(0);
            let s = scratch.join(format!("ns-{}", N.fetch_add(1, Ordering::Relaxed)));
            std::fs::create_dir_all(&s).expect("overlay scratch directory");
            let mut script = format!("set -e\nS={}\nn=0\n{PLACE_FN}", sh_quote(&s));
            if self.cgroup2_only {
                script += "mount -n -t cgroup2 cgroup2 /sys/fs/cgroup\n";
            }
            let mut by_depth: Vec<&(PathBuf, PathBuf)> = self.binds.iter().collect();
            by_depth.sort_by_key(|(_, target)| existing_ancestor(target).components().count());
            for (src, target) in by_depth {
                // `prepare` keeps its overlays in a space-separated list.
                assert!(
                    !target.to_string_lossy().contains(char::is_whitespace),
                    "a target with a space: {}",
                    target.display()
                );
                script += &format!("prepare {} {}\n", sh_quote(src), sh_quote(target));
            }
            for (src, target) in &self.binds {
                script += &format!("place {} {}\n", sh_quote(src), sh_quote(target));
            }
            script += "exec \"$@\"\n";
            let mut c = e.command(Path::new("unshare"));
            c.args(["-m", "--propagation", "private", "sh", "-c", &script, "sh"])
                .arg(&argv[0]);
            c
        };
        cmd.args(&argv[1..]).env("PATH", tool_path(e));
        cmd
    }
}
