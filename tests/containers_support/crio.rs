//! A Kubernetes node run by CRI-O: `crio` with runc, driven through the CRI by the node, pod
//! and container helpers of `containers_support::cri` ([`CriNode`] over a [`CriO`]).
//!
//! CRI-O is not packaged by Debian: `scripts/build-upstream.sh cri-o-1.36` builds it from its
//! Go module into `<repo>/.upstream/cri-o-1.36` (crio, pinns, Debian 12's conmon), as
//! `scripts/test.sh` does. Where it is not built the CRI-O tests print a SKIPPED line and pass
//! ([`crio_prefix`]).
//!
//! The daemon runs in a private mount namespace (`PrivateMounts`: the test's `/etc/criu`, its
//! own `/etc/containers/policy.json` and `/var/lib/containers`), with every path of its state
//! (root, runroot, socket, logs, exits, namespaces) in the node's directory, vfs storage,
//! cgroupfs, no CNI (pods on the host's network), no NRI. Images come from the test's registry
//! on 127.0.0.1 over plain HTTP (`insecure` in a `registries.conf` of the node's, given with
//! `--registries-conf`); they are pushed there with skopeo ([`push_images`]).
//!
//! What reaches CRIU: CRI-O runs runc (and conmon, which runs runc for a restore) with an
//! environment of its own making, not its own: the runtime handler's `monitor_env`, `PATH`,
//! `XDG_RUNTIME_DIR` and `CRI_O_EXTERNAL=1`. Anything CRIU or the plugin must see from the
//! environment (the stand-in driver's call log here) goes in `monitor_env`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cri_client::v1;

use super::cri::{CriDaemon, Images, Registry};
use super::engines::oci_archive_of;
use super::{Cgroup, PrivateMounts, reap_now, run_tool, tool_2026};
use crate::common::{self, E2e, REPO, TempDir};

/// CRI-O's prefix (`bin/crio`, `bin/conmon`, `bin/pinns`): `$CRIU_GPU_TEST_CRIO`, else
/// `<repo>/.upstream/cri-o-1.36`; `None`, with a SKIPPED line for `test`, when it has no
/// `bin/crio`.
pub fn crio_prefix(test: &str) -> Option<PathBuf> {
    let prefix = std::env::var_os("CRIU_GPU_TEST_CRIO").map_or_else(
        || Path::new(REPO).join(".upstream/cri-o-1.36"),
        PathBuf::from,
    );
    if prefix.join("bin/crio").is_file() {
        return Some(prefix);
    }
    eprintln!(
        "SKIPPED {test}: no CRI-O at {} (CRI-O is not in Debian; scripts/build-upstream.sh \
         cri-o-1.36 builds it there from its Go module; CRIU_GPU_TEST_CRIO names another prefix)",
        prefix.join("bin/crio").display()
    );
    None
}

/// The sandbox image's process, as `containers_support::cri` makes it for containerd.
const PAUSE: &str =
    r#","Entrypoint":["/bin/sh","-c","trap 'exit 0' TERM INT; while :; do sleep 1; done"]"#;

/// A command in the workload image's configuration: CRI-O builds a restored container's
/// process from the image (the checkpoint's process replaces it), and refuses an image with
/// none ("no command specified").
const WORKLOAD_CMD: &str = r#","Cmd":["/bin/sh"]"#;

/// Builds the test's `images` and pushes them to their registry with skopeo (`.runtimes-2026`,
/// or `CRIU_GPU_TEST_SKOPEO2`), plain HTTP. Its `/var/lib/containers` (where it keeps a blob
/// cache) is the test's.
pub fn push_images(e: &E2e, images: &Images) {
    let skopeo = tool_2026("CRIU_GPU_TEST_SKOPEO2", "bin/skopeo");
    let policy = insecure_policy(e);
    let var_lib = e.dir().join("skopeo-var-lib-containers");
    std::fs::create_dir_all(&var_lib).expect("skopeo directory");
    let mounts = PrivateMounts::new().bind(&var_lib, "/var/lib/containers");
    for (stem, name, config) in [
        ("crio-workload-image", &images.workload, WORKLOAD_CMD),
        ("crio-pause-image", &images.pause, PAUSE),
    ] {
        let archive = oci_archive_of(e, stem, name, config);
        let argv: Vec<OsString> = vec![
            skopeo.clone().into(),
            "--policy".into(),
            policy.clone().into(),
            "copy".into(),
            "--dest-tls-verify=false".into(),
            format!("oci-archive:{}", archive.display()).into(),
            format!("docker://{name}").into(),
        ];
        let mut cmd = mounts.command(e, e.dir(), &argv);
        cmd.env("TMPDIR", e.dir());
        run_tool(e.dir(), cmd, &format!("skopeo copy {name}")).assert_ok();
    }
}

/// A signature policy accepting every image, in the test's directory.
fn insecure_policy(e: &E2e) -> PathBuf {
    let p = e.dir().join("policy.json");
    std::fs::write(&p, r#"{"default":[{"type":"insecureAcceptAnything"}]}"#).expect("policy.json");
    p
}

/// A running `crio`, its state in `<test dir>/<node>`.
pub struct CriO {
    /// The `unshare` whose exec became the daemon.
    daemon: i32,
    sock: PathBuf,
    /// The parent of the node's pods' cgroups.
    pub cgroup: Cgroup,
    /// Keeps CRIU's restore logs (see [`RestoreLogKeeper`]).
    _logs: RestoreLogKeeper,
    /// Holds the socket; removed after the daemon is gone.
    _short: TempDir,
}

impl CriO {
    /// Starts node `node` from `prefix` (see [`crio_prefix`]) with `runc`; `mounts` (the test's
    /// `/etc/criu` and what else CRIU is to find in system places) and CRI-O's own are in its
    /// mount namespace, `monitor_env` reaches runc and CRIU, images come from `registry`
    /// (`images.pause` is the pod sandbox image).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        e: &E2e,
        node: &str,
        prefix: &Path,
        runc: &Path,
        mounts: PrivateMounts,
        monitor_env: &[(&str, OsString)],
        registry: &Registry,
        images: &Images,
    ) -> CriO {
        let d = e.dir().join(node);
        let dirs = [
            "root", "run", "log", "runc", "cni", "cdi", "hooks", "conf.d", "keys", "reg.d",
        ]
        .map(|s| d.join(s));
        for p in &dirs {
            std::fs::create_dir_all(p).expect("CRI-O directory");
        }
        let var_lib_containers = d.join("var-lib-containers");
        std::fs::create_dir_all(&var_lib_containers).expect("CRI-O directory");
        let registries = d.join("registries.conf");
        std::fs::write(
            &registries,
            format!(
                "[[registry]]\nlocation = \"{}\"\ninsecure = true\n",
                registry.host
            ),
        )
        .expect("registries.conf");
        // A unix socket path has at most 107 bytes.
        let short = TempDir::new_in(Path::new("/tmp"), "crio");
        let sock = short.join("crio.sock");
        let cgroup = Cgroup::new();
        let env_list = monitor_env
            .iter()
            .map(|(k, v)| format!("{:?}", format!("{k}={}", v.to_string_lossy())))
            .collect::<Vec<_>>()
            .join(", ");
        let [
            root,
            run,
            log,
            runc_root,
            cni,
            cdi,
            hooks,
            conf_d,
            keys,
            reg_d,
        ] = dirs.map(|p| p.display().to_string());
        let config = d.join("crio.conf");
        std::fs::write(
            &config,
            format!(
                r#"[crio]
root = "{root}"
runroot = "{run}"
storage_driver = "vfs"
log_dir = "{log}"
version_file = "{run}/version"
version_file_persist = "{root}/version"
clean_shutdown_file = "{root}/clean.shutdown"
[crio.api]
listen = "{sock}"
stream_address = "127.0.0.1"
stream_port = "0"
[crio.runtime]
default_runtime = "runc"
cgroup_manager = "cgroupfs"
conmon_cgroup = "pod"
container_exits_dir = "{run}/exits"
container_attach_socket_dir = "{run}/attach"
namespaces_dir = "{run}/ns"
pinns_path = "{pinns}"
hooks_dir = ["{hooks}"]
cdi_spec_dirs = ["{cdi}"]
default_mounts_file = ""
decryption_keys_path = "{keys}"
irqbalance_config_file = ""
irqbalance_config_restore_file = "disable"
enable_criu_support = true
[crio.runtime.runtimes.runc]
runtime_path = "{runc}"
runtime_root = "{runc_root}"
monitor_path = "{conmon}"
monitor_env = [{env_list}]
[crio.image]
pause_image = "{pause}"
pause_command = ""
[crio.network]
network_dir = "{cni}"
plugin_dirs = ["{cni}"]
[crio.nri]
enable_nri = false
"#,
                sock = sock.display(),
                pinns = prefix.join("bin/pinns").display(),
                conmon = prefix.join("bin/conmon").display(),
                runc = runc.display(),
                pause = images.pause,
            ),
        )
        .expect("crio.conf");
        let mounts = mounts
            .bind(insecure_policy(e), "/etc/containers/policy.json")
            .bind(&var_lib_containers, "/var/lib/containers");
        let argv: Vec<OsString> = vec![
            prefix.join("bin/crio").into(),
            "--config".into(),
            config.into(),
            "--config-dir".into(),
            conf_d.into(),
            "--registries-conf".into(),
            registries.into(),
            "--registries-conf-dir".into(),
            reg_d.into(),
            "--log-level".into(),
            "info".into(),
        ];
        let mut cmd = mounts.command(e, e.dir(), &argv);
        cmd.env_remove("CRIU_GPU_PLUGIN_CONFIG");
        let log = d.join(<CriO as CriDaemon>::LOG);
        cmd.stdout(std::fs::File::create(&log).expect("crio log"));
        cmd.stderr(std::fs::File::create(&log).expect("crio log"));
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        let child = cmd.spawn().expect("start crio");
        let daemon = child.id() as i32;
        // Reaped through waitpid(-1), never by std.
        drop(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !sock.exists() {
            assert!(
                Instant::now() < deadline && common::exists(daemon),
                "crio did not come up: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            reap_now();
            std::thread::sleep(Duration::from_millis(100));
        }
        CriO {
            daemon,
            sock,
            cgroup,
            _logs: RestoreLogKeeper::start(&d),
            _short: short,
        }
    }

    /// The daemon's pid (its mount namespace is the node's).
    pub fn pid(&self) -> i32 {
        self.daemon
    }

    /// SIGKILL to the daemon (as when the machine is lost), reaped; its conmons are in the
    /// pods' cgroups.
    pub fn kill_now(&self) {
        common::signal(self.daemon, libc::SIGKILL);
        let _ = common::reap_until_gone(&[self.daemon], common::WAIT);
    }
}

/// Where [`RestoreLogKeeper`] keeps CRIU's restore logs of node `node_dir`, `<id>.log` each.
fn kept_restore_logs(node_dir: &Path) -> PathBuf {
    node_dir.join("restore-logs")
}

/// The newest of the restore logs kept for node `node_dir`, if any.
pub fn newest_kept_restore_log(node_dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(kept_restore_logs(node_dir))
        .ok()?
        .flatten()
        .filter_map(|f| Some((f.metadata().ok()?.modified().ok()?, f.path())))
        .max()
        .map(|(_, p)| p)
}

/// CRI-O has conmon run `runc restore` in the container's bundle (vfs storage's
/// `<runroot>/vfs-containers/<id>/userdata`), where CRIU writes `restore.log`, and deletes
/// that log once the restore has succeeded. A thread of the test hard-links each such log to
/// [`kept_restore_logs`] as soon as it appears, so that it outlives CRI-O's deletion (the
/// kubelet's restores are not the test's calls to wait around).
struct RestoreLogKeeper {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RestoreLogKeeper {
    /// How often the bundles are looked at: a restore's log lives far longer.
    const EVERY: Duration = Duration::from_millis(3);

    fn start(node_dir: &Path) -> RestoreLogKeeper {
        let bundles = node_dir.join("run/vfs-containers");
        let kept = kept_restore_logs(node_dir);
        std::fs::create_dir_all(&kept).expect("restore log directory");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                for c in std::fs::read_dir(&bundles).into_iter().flatten().flatten() {
                    let to = kept.join(format!("{}.log", c.file_name().to_string_lossy()));
                    if !to.exists() {
                        let _ = std::fs::hard_link(c.path().join("userdata/restore.log"), &to);
                    }
                }
                std::thread::sleep(Self::EVERY);
            }
        });
        RestoreLogKeeper {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for RestoreLogKeeper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl CriDaemon for CriO {
    const ENGINE: &'static str = "CRI-O";
    const LOG: &'static str = "crio.log";

    fn cri_socket(&self) -> &Path {
        &self.sock
    }

    fn cgroup_path(&self) -> &str {
        &self.cgroup.path
    }

    /// Where [`RestoreLogKeeper`] keeps it.
    fn restore_log(&self, node_dir: &Path, id: &str) -> PathBuf {
        kept_restore_logs(node_dir).join(format!("{id}.log"))
    }

    /// CRI-O bind-mounts the host's `/etc/hosts` into a container of a host-network pod, and
    /// restores a checkpoint only if every bind mount of it is in the request
    /// ("expects following bind mounts defined (/etc/hosts)").
    fn restore_config(&self, config: &mut v1::ContainerConfig) {
        if !config
            .mounts
            .iter()
            .any(|m| m.container_path == "/etc/hosts")
        {
            config.mounts.push(v1::Mount {
                container_path: "/etc/hosts".into(),
                host_path: "/etc/hosts".into(),
                ..Default::default()
            });
        }
    }
}

impl Drop for CriO {
    fn drop(&mut self) {
        common::signal(self.daemon, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while common::exists(self.daemon) && Instant::now() < deadline {
            reap_now();
            std::thread::sleep(Duration::from_millis(20));
        }
        common::signal(self.daemon, libc::SIGKILL);
        let _ = common::reap_until_gone(&[self.daemon], common::WAIT);
    }
}
