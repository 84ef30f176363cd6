//! A Kubernetes node as far as checkpoints go: containerd 2.x with its CRI on, driven through
//! the CRI ([`cri_client`], the calls the kubelet makes), pulling its images from a registry
//! on 127.0.0.1 of the test's own.
//!
//! - [`Registry`]: Debian's docker-registry (`scripts/install-registry.sh`,
//!   `<repo>/.registry/bin/registry`, or `CRIU_GPU_TEST_REGISTRY`), storage in the test's
//!   directory. A CRI checkpoint records the image's repository digest and a restore pulls the
//!   image again: images must come from a registry, an import is not enough.
//! - [`CriNode`]: a containerd of [`Containerd::start_node`] with the CRI's plugins configured
//!   as a node needs them here: the `overlayfs` snapshotter, the pod sandbox ("pause") image
//!   pinned to one in the registry, plain HTTP to the registry (`hosts.toml`), runc with its
//!   state under the test, `restrict_oom_score_adj` (root here lacks CAP_SYS_RESOURCE), CDI
//!   specs from the node's own directory, no CNI (pods use the host's network).
//! - [`CriContainer`]: a container of a pod, its workload's [`Output`].
//! - The registry and its images are in `cri/registry.rs`; what the tests check of a checkpoint
//!   and a restore in `cri/checks.rs`.
//! - [`CriDaemon`]: what a node's runtime is besides its CRI socket, so that the same node,
//!   containers and checks serve containerd and CRI-O (`containers_support::crio`).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cri_client::{Cri, v1};

use super::engines::{Containerd, ContainerdBins, oci_archive_of};
use super::{
    Output, Workload, assert_plugin_dumped, assert_plugin_restored, private_tool, reap_now,
    run_tool, tool_path,
};
use crate::common::{self, CriuRun, E2e, wait_until};

mod checks;
pub mod gpu_node;
mod registry;

pub use checks::*;
pub use registry::*;

/// The containerd 2.x configuration of the CRI's plugins for a node whose directory is `d`.
pub fn cri_config(
    d: &Path,
    bins: &ContainerdBins,
    registry: &Registry,
    pause: &str,
    criu_work: Option<&Path>,
) -> String {
    cri_config_with(d, bins, registry, pause, criu_work, "")
}

/// [`cri_config`] with `runtime_options` (TOML lines) added to the CRI runtime plugin's table.
pub fn cri_config_with(
    d: &Path,
    bins: &ContainerdBins,
    registry: &Registry,
    pause: &str,
    criu_work: Option<&Path>,
    runtime_options: &str,
) -> String {
    let certs = d.join("certs.d");
    registry.write_hosts_toml(&certs);
    let [cni, cdi, runc_root] = ["cni", "cdi", "runc"].map(|s| d.join(s));
    for p in [&cni, &cdi, &runc_root] {
        std::fs::create_dir_all(p).expect("node directory");
    }
    let runc = bins
        .runc
        .clone()
        .unwrap_or_else(|| super::system_tool("runc"));
    format!(
        r#"[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{certs}"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]{runtime_options}
  [plugins."io.containerd.cri.v1.runtime".cni]
    conf_dir = "{cni}"
    bin_dirs = ["{cni}"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{runc_root}"
        SystemdCgroup = false{criu_work}
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
        certs = certs.display(),
        cni = cni.display(),
        cdi = cdi.display(),
        runc = runc.display(),
        runc_root = runc_root.display(),
        criu_work = criu_work
            .map(|p| format!("\n        CriuWorkPath = \"{}\"", p.display()))
            .unwrap_or_default(),
        runtime_options = runtime_options
            .lines()
            .map(|l| format!("\n  {l}"))
            .collect::<String>(),
    )
}

/// The daemon behind a node's CRI socket (containerd, CRI-O), as the tests read it beside the
/// CRI. Its state is in the node's directory, `<test dir>/<node name>`.
pub trait CriDaemon {
    /// The engine, as `checkpointctl show` names it.
    const ENGINE: &'static str;
    /// The daemon's log, in the node's directory.
    const LOG: &'static str;
    /// The CRI's unix socket.
    fn cri_socket(&self) -> &Path;
    /// The cgroup (cgroupfs path) the node's pods are created under, and removed with.
    fn cgroup_path(&self) -> &str;
    /// Where the runtime keeps CRIU's log of the restore of container `id` (`node_dir`: the
    /// node's directory).
    fn restore_log(&self, node_dir: &Path, id: &str) -> PathBuf;
    /// What the runtime needs of a container created from a checkpoint beyond what a container
    /// created from an image gets.
    fn restore_config(&self, _config: &mut v1::ContainerConfig) {}
}

impl CriDaemon for Containerd<'_> {
    const ENGINE: &'static str = "containerd";
    const LOG: &'static str = "containerd.log";

    fn cri_socket(&self) -> &Path {
        self.socket()
    }

    fn cgroup_path(&self) -> &str {
        &self.cgroup.path
    }

    fn restore_log(&self, node_dir: &Path, id: &str) -> PathBuf {
        node_dir
            .join("root/io.containerd.runtime.v2.task/k8s.io")
            .join(id)
            .join("restore.log")
    }
}

/// One node: a runtime with its CRI (containerd unless `D` says otherwise), and a CRI client
/// connected to it.
pub struct CriNode<'e, D: CriDaemon = Containerd<'e>> {
    pub e: &'e E2e,
    pub cd: D,
    pub cri: Cri,
    pub images: Images,
    pub name: String,
    /// runc's `CriuWorkPath`, if the node has one.
    pub criu_work: Option<PathBuf>,
    pods: std::cell::RefCell<Vec<String>>,
}

/// The CRI client's deadline for one call (a checkpoint's is its own timeout).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

impl<'e> CriNode<'e> {
    /// Starts node `name` (its state in `<test dir>/<name>`): containerd 2.x of `bins`, its
    /// `/etc/criu` `etc_criu`, `env` added; pulls from `registry`, whose images `images` are.
    /// CRIU's work directory for restores is each container's own (which containerd deletes
    /// with a container whose restore failed) unless `criu_work` names one (runc's
    /// `CriuWorkPath`, shared by every restore of the node).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        e: &'e E2e,
        name: &str,
        etc_criu: &Path,
        env: &[(&str, OsString)],
        bins: ContainerdBins,
        registry: &Registry,
        images: Images,
        criu_work: Option<&Path>,
    ) -> CriNode<'e> {
        assert!(bins.v2, "the CRI tests configure containerd 2.x");
        let b = bins.clone();
        let pause = images.pause.clone();
        let config = move |d: &Path| cri_config(d, &b, registry, &pause, criu_work);
        let cd = Containerd::start_node(e, name, etc_criu, env, bins, Some(&config));
        CriNode::over(e, name, cd, images, criu_work)
    }

    /// The directory the node's CRI reads CDI specs from (`cdi_spec_dirs`).
    pub fn cdi_spec_dir(&self) -> PathBuf {
        self.e.dir().join(&self.name).join("cdi")
    }
}

impl<'e, D: CriDaemon> CriNode<'e, D> {
    /// Node `name` of the started daemon `cd`, once its CRI answers; `images` are the test's,
    /// `criu_work` the restores' CRIU work directory if the node has one.
    pub fn over(
        e: &'e E2e,
        name: &str,
        cd: D,
        images: Images,
        criu_work: Option<&Path>,
    ) -> CriNode<'e, D> {
        let cri = Cri::connect(cd.cri_socket(), CALL_TIMEOUT).expect("connect to the CRI");
        let deadline = Instant::now() + common::WAIT;
        loop {
            match cri.version() {
                Ok(v) => {
                    eprintln!(
                        "node {name}: {} {} (CRI {})",
                        v.runtime_name, v.runtime_version, v.runtime_api_version
                    );
                    break;
                }
                Err(err) => assert!(Instant::now() < deadline, "CRI of node {name}: {err}"),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        CriNode {
            e,
            cd,
            cri,
            images,
            name: name.to_string(),
            criu_work: criu_work.map(Path::to_path_buf),
            pods: Default::default(),
        }
    }

    /// A host-network pod `pod` (its own cgroup under the node's): its id and configuration.
    pub fn run_pod(&self, pod: &str) -> (String, v1::PodSandboxConfig) {
        let logs = self.e.dir().join(format!("{}-logs-{pod}", self.name));
        std::fs::create_dir_all(&logs).expect("pod log directory");
        let config = cri_client::host_network_pod(
            pod,
            &format!("{}-{pod}", self.name),
            &logs,
            &self.pod_cgroup(pod),
        );
        let id = self
            .cri
            .run_pod_sandbox(&config)
            .unwrap_or_else(|err| panic!("RunPodSandbox {pod}: {err}\n{}", self.log_tail()));
        self.pods.borrow_mut().push(id.clone());
        (id, config)
    }

    /// The container configuration of `workload`: its `/out` on the host at `out`, the
    /// command of the workload, `image` (an image or a checkpoint archive).
    pub fn container_config(
        &self,
        name: &str,
        image: &str,
        workload: Workload,
        out: &Path,
    ) -> v1::ContainerConfig {
        let args = workload.args();
        v1::ContainerConfig {
            metadata: Some(v1::ContainerMetadata {
                name: name.to_string(),
                attempt: 0,
            }),
            image: Some(cri_client::image_spec(image)),
            command: args,
            envs: workload
                .env()
                .iter()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| cri_client::env(k, v))
                .collect(),
            mounts: vec![v1::Mount {
                container_path: "/out".into(),
                host_path: out.display().to_string(),
                ..Default::default()
            }],
            log_path: format!("{name}.log"),
            linux: Some(cri_client::pod_container_linux()),
            ..Default::default()
        }
    }

    /// PullImage, CreateContainer and StartContainer of `workload` named `name` in `pod`.
    pub fn start_container(
        &'e self,
        pod: &(String, v1::PodSandboxConfig),
        name: &str,
        workload: Workload,
    ) -> CriContainer<'e, D> {
        self.start_container_with(pod, name, workload, &|_| {})
    }

    /// [`CriNode::start_container`] with the container's configuration changed by `edit`
    /// (what the kubelet adds: CDI devices, a device plugin's annotations, environment).
    pub fn start_container_with(
        &'e self,
        (pod, sandbox): &(String, v1::PodSandboxConfig),
        name: &str,
        workload: Workload,
        edit: &dyn Fn(&mut v1::ContainerConfig),
    ) -> CriContainer<'e, D> {
        let out = Output::new(self.e.dir().join(format!("out-{name}")), workload);
        self.cri
            .pull_image(&self.images.workload, sandbox)
            .unwrap_or_else(|err| panic!("PullImage: {err}\n{}", self.log_tail()));
        let mut config = self.container_config(name, &self.images.workload, workload, &out.dir);
        edit(&mut config);
        let id = self
            .cri
            .create_container(pod, &config, sandbox)
            .unwrap_or_else(|err| panic!("CreateContainer {name}: {err}\n{}", self.log_tail()));
        self.cri
            .start_container(&id)
            .unwrap_or_else(|err| panic!("StartContainer {name}: {err}\n{}", self.log_tail()));
        let c = CriContainer {
            node: self,
            id,
            out,
        };
        c.out.wait_ready();
        c
    }

    /// CreateContainer in `pod` from the checkpoint `archive` (the container's image is the
    /// archive, as the kubelet passes it for a restore) writing to `out`'s directory; the
    /// container's id, or the runtime's refusal.
    pub fn create_from_checkpoint(
        &self,
        pod: &(String, v1::PodSandboxConfig),
        name: &str,
        image: &str,
        out: &Output,
    ) -> cri_client::Result<String> {
        self.create_from_checkpoint_with(pod, name, image, out, &|_| {})
    }

    /// [`CriNode::create_from_checkpoint`] with the container's configuration changed by
    /// `edit`.
    pub fn create_from_checkpoint_with(
        &self,
        (pod, sandbox): &(String, v1::PodSandboxConfig),
        name: &str,
        image: &str,
        out: &Output,
        edit: &dyn Fn(&mut v1::ContainerConfig),
    ) -> cri_client::Result<String> {
        let mut config = self.container_config(name, image, out.workload, &out.dir);
        self.cd.restore_config(&mut config);
        edit(&mut config);
        self.cri.create_container(pod, &config, sandbox)
    }

    /// StartContainer of container `id`, created from a checkpoint: the restore.
    pub fn start_restored(&self, id: &str) -> cri_client::Result<()> {
        self.cri.start_container(id)
    }

    /// The last lines of the daemon's log (for failure messages).
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.cd_log()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The daemon's log.
    pub fn cd_log(&self) -> PathBuf {
        self.e.dir().join(&self.name).join(D::LOG)
    }

    /// CRIU's log of the restore of container `id`: in the node's `CriuWorkPath`, else where
    /// the runtime keeps it for the container.
    pub fn restore_log(&self, id: &str) -> PathBuf {
        match &self.criu_work {
            Some(d) => d.join("restore.log"),
            None => self.cd.restore_log(&self.e.dir().join(&self.name), id),
        }
    }

    /// The cgroup (cgroupfs path) of the containers of `pod`.
    pub fn pod_cgroup(&self, pod: &str) -> String {
        format!("{}/{pod}", self.cd.cgroup_path())
    }
}

impl<D: CriDaemon> Drop for CriNode<'_, D> {
    fn drop(&mut self) {
        // As the kubelet ends pods: stop (the runtime kills the containers), then remove.
        for pod in self.pods.borrow().iter() {
            let _ = self.cri.stop_pod_sandbox(pod);
            let _ = self.cri.remove_pod_sandbox(pod);
        }
        reap_now();
        // Whatever is left in the node's cgroups (a container whose shim or conmon is gone).
        kill_cgroup_tree(self.cd.cgroup_path());
    }
}

/// The processes in cgroup `path` (relative to the hierarchies' roots) or below, in every
/// hierarchy.
pub fn cgroup_tree_pids(path: &str) -> Vec<i32> {
    fn walk(dir: &Path, pids: &mut Vec<i32>) {
        if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&e.path(), pids);
            }
        }
    }
    let rel = path.trim_start_matches('/');
    let mut pids = Vec::new();
    for h in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        walk(&h.path().join(rel), &mut pids);
    }
    walk(&Path::new("/sys/fs/cgroup").join(rel), &mut pids);
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// SIGKILL to every process in cgroup `path` or below, in every hierarchy, thawed first: a
/// task of a frozen cgroup (a runtime's checkpoint cut short leaves one) dies only once thawed.
pub fn kill_cgroup_tree(path: &str) {
    thaw_cgroup_tree(path);
    let pids = cgroup_tree_pids(path);
    for &p in &pids {
        common::signal(p, libc::SIGKILL);
    }
    let _ = common::reap_until_gone(&pids, common::WAIT);
}

/// Thaws cgroup `path` and every cgroup below it (v1 `freezer.state`, v2 `cgroup.freeze`).
fn thaw_cgroup_tree(path: &str) {
    fn walk(dir: &Path) {
        let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&e.path());
            }
        }
    }
    let rel = path.trim_start_matches('/');
    for root in [
        "/sys/fs/cgroup/freezer",
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup",
    ] {
        let d = Path::new(root).join(rel);
        if d.is_dir() {
            walk(&d);
        }
    }
}

/// A container of a pod on a [`CriNode`].
pub struct CriContainer<'e, D: CriDaemon = Containerd<'e>> {
    pub node: &'e CriNode<'e, D>,
    pub id: String,
    pub out: Output,
}

impl<D: CriDaemon> CriContainer<'_, D> {
    /// The CRI's state of the container and the host pid of its init (when running).
    pub fn state(&self) -> (v1::ContainerState, Option<i32>) {
        let s = self
            .node
            .cri
            .container_status(&self.id)
            .unwrap_or_else(|err| panic!("ContainerStatus {}: {err}", self.id));
        let state = s
            .status
            .as_ref()
            .and_then(|st| v1::ContainerState::try_from(st.state).ok())
            .unwrap_or(v1::ContainerState::ContainerUnknown);
        (state, cri_client::status_pid(&s))
    }

    /// The host pid of the running container's init.
    pub fn running_pid(&self) -> i32 {
        match self.state() {
            (v1::ContainerState::ContainerRunning, Some(pid)) => pid,
            other => panic!("container {} is not running: {other:?}", self.id),
        }
    }

    /// CheckpointContainer to `archive` with `timeout`, as the kubelet's checkpoint API does.
    pub fn checkpoint(&self, archive: &Path, timeout: Duration) -> cri_client::Result<()> {
        self.node
            .cri
            .checkpoint_container(&self.id, archive, timeout)
    }

    /// The kubelet's checkpoint of the running container to `archive` ([`CHECKPOINT_TIMEOUT`]):
    /// the call succeeds, the container keeps running as the same init, and it has its GPU back
    /// (device memory `files` of a CUDA workload, the driver calls of a checkpoint that leaves
    /// it running). The output's marks before and after the call.
    pub fn kubelet_checkpoint(
        &self,
        archive: &Path,
        files: Option<&Vec<String>>,
    ) -> (usize, usize) {
        let pid = self.running_pid();
        let low = self.out.mark();
        let t0 = std::time::Instant::now();
        self.checkpoint(archive, CHECKPOINT_TIMEOUT)
            .unwrap_or_else(|err| panic!("CheckpointContainer: {err}\n{}", self.node.log_tail()));
        eprintln!("CheckpointContainer: {:?}", t0.elapsed());
        let high = self.out.mark();
        assert_eq!(
            self.running_pid(),
            pid,
            "the container after its checkpoint"
        );
        self.out.assert_given_back(files, &calls(self.node.e), pid);
        (low, high)
    }

    /// StopContainer (the runtime kills it after a second) and RemoveContainer; waits for
    /// its init to be gone.
    pub fn remove(&self) {
        let pid = self.state().1;
        self.node
            .cri
            .stop_container(&self.id, Duration::from_secs(1))
            .unwrap_or_else(|err| panic!("StopContainer {}: {err}", self.id));
        if let Some(p) = pid {
            super::wait_gone(p, "the stopped container's init");
        }
        self.node
            .cri
            .remove_container(&self.id)
            .unwrap_or_else(|err| panic!("RemoveContainer {}: {err}", self.id));
    }
}
