//! A node of the test's cluster: containerd 2.x with its CRI (as `containers_support::cri`
//! configures it) or CRI-O (as `containers_support::crio` does), and a kubelet registered with
//! the API server, both in the node's own mount
//! namespace, where CRIU finds its configuration at `/etc/criu` and the plugin at
//! `/usr/lib/criu` (CRIU's built-in plugin directory, where the package installs it), as on
//! a node with the package installed, and in the node's own network namespace
//! (`kube_support::network`).
//!
//! The kubelet is the real one: cgroupfs driver with its QoS layout (`kubepods`,
//! `besteffort`, `pod<uid>`) under a cgroup root of the test's own, its state, pod logs and
//! checkpoints in the node's directory, x509 client authentication and webhook authorization
//! against the API server (the administrator's certificate is what the checkpoint calls use),
//! a serving certificate of the cluster's CA. Its kernel settings are checked, not written:
//! the files it reads under `/proc/sys` are the test's, bound over the host's in the node's
//! mount namespace with the values it expects, so the host's are never changed. The node has
//! no CNI: pods use the node's network (`hostNetwork`: the node's namespace, not the host's),
//! and the node reports its network as not ready, which the kubelet allows for such pods.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::control_plane::{ControlPlane, field, log_to, stop, tail, write_kubeconfig};
use super::network::NodeNet;
use super::pki::KeyPair;
use super::runtimes::{Engine, NodeEngine, Runtime};
use super::upstream;
use crate::common::{self, CriuRun, E2e};
use crate::containers_support::cri::{Registry, kill_cgroup_tree, workspace_bin};
use crate::containers_support::{PrivateMounts, reap_now};

/// The kernel settings the kubelet checks (`protectKernelDefaults`), with the values it wants.
const KERNEL_DEFAULTS: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// How many times a kubelet that ends while starting is started again.
const KUBELET_RESTARTS: u32 = 2;

/// The kubelet's state directory, its default, in the node's mount namespace (the node's
/// `kubelet` folder is mounted there).
const KUBELET_ROOT: &str = "/var/lib/kubelet";

/// How long a kubelet may take to register its node.
const REGISTERED: Duration = Duration::from_secs(180);

/// One node: its runtime and its kubelet.
pub struct KubeNode<'e> {
    pub e: &'e E2e,
    pub name: String,
    pub engine: NodeEngine<'e>,
    /// `https://NODE_IP:PORT`, the kubelet's API.
    pub kubelet_url: String,
    /// The node's network namespace.
    pub net: NodeNet,
    pub dir: PathBuf,
    kubelet: Option<i32>,
    /// The stand-in device plugin, once started.
    device_plugin: Option<i32>,
    /// Where runc keeps CRIU's logs, if the runtime says so.
    criu_work: Option<PathBuf>,
    /// The kubelet's arguments.
    kubelet_args: Vec<OsString>,
    /// The node's cgroup root (under which the kubelet makes `kubepods`).
    pub cgroup_root: String,
}

impl<'e> KubeNode<'e> {
    /// Starts node `name` (state in `<test dir>/<name>`, network namespace `net`) of `cp`'s
    /// cluster: the engine and runc of `runtime` with CRIU's configuration `etc_criu` and
    /// `env`, images from `registry`; then its kubelet, once the engine's CRI answers; returns
    /// once the node is registered.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        e: &'e E2e,
        cp: &ControlPlane<'_>,
        name: &str,
        net: NodeNet,
        etc_criu: &Path,
        env: &[(&str, OsString)],
        runtime: &Runtime,
        registry: &Registry,
    ) -> KubeNode<'e> {
        let dir = e.dir().join(name);
        let sys = dir.join("proc-sys");
        // The kubelet's state is the node's, at its usual place in the node's mount namespace:
        // its sockets (pod resources, device plugins) then have short paths, as a Unix socket
        // must (108 bytes), wherever the checkout is; the containers' log links too.
        let [var_lib_kubelet, var_log_containers] =
            ["kubelet", "var-log-containers"].map(|d| dir.join(d));
        for d in [&var_lib_kubelet, &var_log_containers] {
            std::fs::create_dir_all(d).expect("node directory");
        }
        let mut mounts = PrivateMounts::new()
            .in_net_ns(net.path())
            .bind(etc_criu, "/etc/criu")
            .bind(common::plugin_libdir(), "/usr/lib/criu")
            .bind(&var_lib_kubelet, KUBELET_ROOT)
            .bind(&var_log_containers, "/var/log/containers");
        for (key, value) in KERNEL_DEFAULTS {
            let f = sys.join(key.replace('/', "."));
            std::fs::create_dir_all(&sys).expect("kernel settings directory");
            std::fs::write(&f, format!("{value}\n")).expect("kernel setting");
            mounts = mounts.bind(f, Path::new("/proc/sys").join(key));
        }
        if matches!(runtime.engine, Engine::CriO { .. }) && hugetlb_out_of_reach() {
            // CRI-O hands runc the kubelet's huge page limits (0 for each size the node has)
            // where containerd drops them when no hugetlb hierarchy is there to set them in;
            // runc then cannot place the container. Here the kubelet sees no huge page sizes.
            let none = dir.join("no-hugepages");
            std::fs::create_dir_all(&none).expect("node directory");
            mounts = mounts.bind(none, HUGEPAGES);
        }
        let criu_work = runtime.keep_criu_logs.then(|| dir.join("criu-work"));
        if let Some(w) = &criu_work {
            std::fs::create_dir_all(w).expect("CRIU's work directory");
        }
        let engine = NodeEngine::start(
            e,
            name,
            mounts,
            env,
            runtime,
            registry,
            criu_work.as_deref(),
        );

        let cgroup_root = format!("{}/kubelet", engine.cgroup_path());
        make_cgroup(&cgroup_root);
        let (client, serving) = cp.pki.node(e, name, &net.ip);
        let kubeconfig = dir.join("kubelet.kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            &format!("https://{}:{}", net.gateway, cp.port),
            &cp.pki.ca.cert,
            &client,
            &format!("system:node:{name}"),
        );
        // The kubelet's usual port: the node's network namespace is its own.
        let port = 10250;
        let config = dir.join("kubelet.yaml");
        std::fs::write(
            &config,
            KubeletConfig {
                runtime,
                address: &net.ip,
                dir: &dir,
                port,
                cgroup_root: &cgroup_root,
                socket: engine.socket(),
                serving: &serving,
                ca: &cp.pki.ca.cert,
            }
            .render(),
        )
        .expect("kubelet configuration");
        let kubelet_args: Vec<OsString> = vec![
            format!("--config={}", config.display()).into(),
            format!("--kubeconfig={}", kubeconfig.display()).into(),
            format!("--hostname-override={name}").into(),
            format!("--node-ip={}", net.ip).into(),
            format!("--root-dir={KUBELET_ROOT}").into(),
            format!("--cert-dir={}", dir.join("kubelet-pki").display()).into(),
            "--v=2".into(),
        ];
        let mut node = KubeNode {
            e,
            name: name.to_string(),
            engine,
            kubelet_url: format!("https://{}:{port}", net.ip),
            dir,
            kubelet: None,
            device_plugin: None,
            criu_work,
            kubelet_args,
            cgroup_root,
            net,
        };
        node.spawn_kubelet();
        let t0 = Instant::now();
        let mut restarts = 0;
        while cp.get_object(&format!("/api/v1/nodes/{name}")).is_none() {
            if !node.kubelet.is_some_and(common::running) {
                // As its service manager would (kubeadm's unit: `Restart=always`): a kubelet
                // ends on some start-up races (cAdvisor's first look at the root file system
                // not yet taken) and comes up on the next try.
                let why = node.kubelet_exit_reason();
                assert!(
                    restarts < KUBELET_RESTARTS,
                    "the kubelet of node {name} ended while starting, {} times; the last \
                     time because:\n{why}\n{}",
                    restarts + 1,
                    node.kubelet_log_tail()
                );
                restarts += 1;
                let kept = node.dir.join(format!("kubelet-ended-{restarts}.log"));
                let _ = std::fs::rename(node.dir.join("kubelet.log"), &kept);
                eprintln!(
                    "the kubelet of node {name} ended while starting ({}), restarted:\n{why}",
                    kept.display()
                );
                reap_now();
                std::thread::sleep(Duration::from_secs(1));
                node.spawn_kubelet();
            }
            assert!(
                t0.elapsed() < REGISTERED,
                "node {name} is not registered after {REGISTERED:?}:\n{}",
                node.kubelet_log_tail()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        eprintln!("node {name} registered in {:?}", t0.elapsed());
        node
    }

    /// Starts the stand-in device plugin (tools/device-plugin) in the node's mount namespace,
    /// where the kubelet's device plugin directory is: it offers `resource` as `devices`
    /// (`ID=ITEM[,ITEM…]`, see the plugin), and the node's allocatable resources show them.
    pub fn start_device_plugin(
        &mut self,
        cp: &ControlPlane<'_>,
        resource: &str,
        devices: &[String],
    ) {
        let mut cmd = self.e.command(Path::new("nsenter"));
        cmd.arg(format!("--target={}", self.engine.pid()))
            .arg("--mount")
            .arg("--")
            .arg(workspace_bin("device-plugin", "stand-in-device-plugin"))
            .arg(format!("--resource={resource}"));
        for d in devices {
            cmd.arg(format!("--device={d}"));
        }
        let log = self.dir.join("device-plugin.log");
        log_to(&mut cmd, &log);
        let pid = self.e.spawn_session(cmd);
        self.device_plugin = Some(pid);
        let pointer = format!(
            "/status/allocatable/{}",
            resource.replace('~', "~0").replace('/', "~1")
        );
        let want = devices.len().to_string();
        let t0 = Instant::now();
        let node = format!("/api/v1/nodes/{}", self.name);
        while field(cp.get_object(&node).as_ref(), &pointer) != want {
            assert!(
                common::running(pid) && t0.elapsed() < REGISTERED,
                "node {}'s allocatable {resource} is not {want}:\n{}\n{}",
                self.name,
                tail(&log, 20),
                self.kubelet_log_tail()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        eprintln!(
            "node {}: {want} {resource} in {:?}",
            self.name,
            t0.elapsed()
        );
    }

    /// Starts the kubelet in the node's mount and network namespaces, its log in
    /// `kubelet.log`.
    fn spawn_kubelet(&mut self) {
        let mut cmd = self.e.command(Path::new("nsenter"));
        cmd.arg(format!("--target={}", self.engine.pid()))
            .arg("--mount")
            .arg("--net")
            .arg("--")
            .arg(upstream("kubernetes-1.37", "kubelet"))
            .args(&self.kubelet_args);
        log_to(&mut cmd, &self.dir.join("kubelet.log"));
        self.kubelet = Some(self.e.spawn_session(cmd));
    }

    /// Why the kubelet ended, as its log says: its fatal lines and the error it ended with.
    fn kubelet_exit_reason(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("kubelet.log")).unwrap_or_default();
        let said: Vec<&str> = log
            .lines()
            .filter(|l| is_fatal(l) || l.contains("\"command failed\""))
            .collect();
        if said.is_empty() {
            "(its log names no fatal error)".to_string()
        } else {
            said.join("\n")
        }
    }

    /// The last lines of the kubelet's log.
    pub fn kubelet_log_tail(&self) -> String {
        tail(&self.dir.join("kubelet.log"), 40)
    }

    /// The last lines of the runtime's log.
    pub fn runtime_log_tail(&self) -> String {
        tail(&self.dir.join(self.engine.log_name()), 40)
    }

    /// CRIU's log of the restore of container `id`, where the runtime keeps it, as a finished
    /// run.
    pub fn restore_log(&self, id: &str) -> CriuRun {
        let log = match &self.criu_work {
            Some(w) => w.join("restore.log"),
            None => self.engine.restore_log(&self.dir, id),
        };
        let text = std::fs::read_to_string(&log)
            .unwrap_or_else(|err| panic!("CRIU's restore log {}: {err}", log.display()));
        self.restore_run(format!("the restore of container {id}"), Some(0), text)
    }

    /// The newest restore's CRIU log where it is kept (runc's `<node>/criu-work`, or the
    /// test's copies of CRI-O's), as a finished run: what a pod that did not run can be told
    /// by; else nothing.
    pub fn kept_restore_log(&self) -> Option<CriuRun> {
        let path = match &self.criu_work {
            Some(w) => w.join("restore.log"),
            None => self.engine.newest_restore_log(&self.dir)?,
        };
        let log = std::fs::read_to_string(path).ok()?;
        // Its exit status is not kept with it.
        Some(self.restore_run("the newest restore".into(), None, log))
    }

    fn restore_run(&self, what: String, code: Option<i32>, log: String) -> CriuRun {
        CriuRun {
            what: format!("{what} on node {}", self.name),
            code,
            log,
            output: String::new(),
            took: Duration::ZERO,
        }
    }

    /// Where the kubelet writes the archives of its checkpoint API, as the host sees it.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.dir.join("kubelet/checkpoints")
    }

    /// Where the host sees `path`, a path in the kubelet's state as the kubelet names it.
    pub fn host_path(&self, path: &Path) -> PathBuf {
        match path.strip_prefix(KUBELET_ROOT) {
            Ok(rest) => self.dir.join("kubelet").join(rest),
            Err(_) => path.to_path_buf(),
        }
    }

    /// `curl` to the kubelet's API as the cluster's administrator: `method` on `path`; the
    /// HTTP status and the body.
    pub fn kubelet_api(
        &self,
        cp: &ControlPlane<'_>,
        method: &str,
        path: &str,
        limit: Duration,
    ) -> (u16, String) {
        let url = format!("{}{path}", self.kubelet_url);
        cp.curl_as_admin(method, &url, &format!("kubelet {}", self.name), limit)
    }

    /// Ends the node as a lost machine would: its kubelet and runtime killed, and with them
    /// (the machine is gone) every process of its pods.
    pub fn lose(&mut self) {
        if let Some(pid) = self.kubelet.take() {
            self.e.kill_and_reap(&[pid]);
        }
        self.engine.kill_now();
        kill_cgroup_tree(&self.cgroup_root);
        reap_now();
    }
}

impl Drop for KubeNode<'_> {
    fn drop(&mut self) {
        if let Some(pid) = self.device_plugin.take() {
            stop(pid);
        }
        if let Some(pid) = self.kubelet.take() {
            stop(pid);
        }
        // The kubelet leaves its pods running when it ends; the node's containers go before
        // its runtime (containerd's drop ends the shims).
        kill_cgroup_tree(&self.cgroup_root);
        reap_now();
    }
}

/// Whether `line` is one of klog's fatal lines (`F` and the date, `F1205 ...`).
fn is_fatal(line: &str) -> bool {
    let mut chars = line.chars();
    chars.next() == Some('F') && chars.take(4).filter(char::is_ascii_digit).count() == 4
}

/// Where the kernel lists its huge page sizes.
const HUGEPAGES: &str = "/sys/kernel/mm/hugepages";

/// Whether runc's cgroupfs manager has no hierarchy to set hugetlb limits in: a hybrid host
/// (as this one) whose hugetlb controller is in the unified hierarchy, not a v1 one.
fn hugetlb_out_of_reach() -> bool {
    let v2_only = Path::new("/sys/fs/cgroup/cgroup.procs").is_file();
    !v2_only && Path::new(HUGEPAGES).is_dir() && !Path::new("/sys/fs/cgroup/hugetlb").exists()
}

/// Makes cgroup `path` in every hierarchy (the kubelet wants its cgroup root to exist, and on
/// cgroup v2 with the controllers it uses: each is enabled from the root down to it); the
/// node's `Cgroup` removes it.
fn make_cgroup(path: &str) {
    let rel = path.trim_start_matches('/');
    let mut roots: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").is_file())
        .collect();
    if Path::new("/sys/fs/cgroup/cgroup.procs").is_file() {
        roots.push(PathBuf::from("/sys/fs/cgroup"));
    }
    for r in roots {
        std::fs::create_dir_all(r.join(rel))
            .unwrap_or_else(|err| panic!("cgroup {}: {err}", r.join(rel).display()));
        let Ok(controllers) = std::fs::read_to_string(r.join("cgroup.controllers")) else {
            continue;
        };
        let enable: Vec<String> = controllers
            .split_whitespace()
            .map(|c| format!("+{c}"))
            .collect();
        // From the root down to the cgroup, one controller a write: what a level cannot enable
        // (a controller its parent lacks) the kubelet names.
        let mut levels: Vec<PathBuf> = Path::new(rel).ancestors().map(|a| r.join(a)).collect();
        levels.reverse();
        for level in levels {
            for c in &enable {
                let _ = std::fs::write(level.join("cgroup.subtree_control"), c);
            }
        }
    }
}

/// What the kubelet's configuration file says of a node.
struct KubeletConfig<'a> {
    runtime: &'a Runtime,
    /// Where it serves its API.
    address: &'a str,
    /// The node's directory.
    dir: &'a Path,
    port: u16,
    cgroup_root: &'a str,
    /// The runtime's CRI socket.
    socket: &'a Path,
    serving: &'a KeyPair,
    ca: &'a Path,
}

impl KubeletConfig<'_> {
    /// The configuration file.
    fn render(&self) -> String {
        let KubeletConfig {
            runtime,
            address,
            dir,
            port,
            cgroup_root,
            socket,
            serving,
            ca,
        } = self;
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {address}
port: {port}
readOnlyPort: 0
healthzPort: 0
tlsCertFile: {cert}
tlsPrivateKeyFile: {key}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
cgroupsPerQOS: true
enforceNodeAllocatable: []
failSwapOn: false
failCgroupV1: false
protectKernelDefaults: true
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://{socket}
podLogsDir: {logs}
volumePluginDir: {volume_plugins}
resolvConf: /etc/resolv.conf
staticPodPath: ""
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
runtimeRequestTimeout: {request_timeout}s
shutdownGracePeriod: 0s
"#,
            cert = serving.cert.display(),
            key = serving.key.display(),
            ca = ca.display(),
            socket = socket.display(),
            logs = dir.join("pod-logs").display(),
            volume_plugins = dir.join("volume-plugins").display(),
            request_timeout = runtime.request_timeout_s,
            address = address,
        )
    }
}
