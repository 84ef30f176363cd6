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

/// The sandbox image's process: waits, and ends on SIGTERM.
const PAUSE: &str =
    r#","Entrypoint":["/bin/sh","-c","trap 'exit 0' TERM INT; while :; do sleep 1; done"]"#;

/// The registry program: `$CRIU_GPU_TEST_REGISTRY`, else `<repo>/.registry/bin/registry`.
fn registry_program() -> PathBuf {
    let p = std::env::var_os("CRIU_GPU_TEST_REGISTRY").map_or_else(
        || Path::new(common::REPO).join(".registry/bin/registry"),
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "{} is missing: run scripts/install-registry.sh (scripts/setup.sh does), set \
         CRIU_GPU_TEST_REGISTRY, or set GPU_PLUGIN_SKIP_E2E=1 to skip the end-to-end tests",
        p.display()
    );
    p
}

/// A container image registry on 127.0.0.1, its storage in the test's directory.
pub struct Registry {
    pid: i32,
    /// `127.0.0.1:PORT`.
    pub host: String,
}

impl Registry {
    pub fn start(e: &E2e) -> Registry {
        let dir = e.dir().join("registry");
        std::fs::create_dir_all(dir.join("storage")).expect("registry directory");
        // A port nobody uses now; the registry takes it a moment later.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let host = format!("127.0.0.1:{port}");
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  \
                 delete:\n    enabled: true\nhttp:\n  addr: {host}\n",
                dir.join("storage").display()
            ),
        )
        .expect("registry config");
        let mut cmd = e.command(&registry_program());
        cmd.arg("serve").arg(&config);
        let log = std::fs::File::create(dir.join("registry.log")).expect("registry log");
        cmd.stdout(log.try_clone().expect("log")).stderr(log);
        let pid = e.spawn_session(cmd);
        let r = Registry { pid, host };
        let deadline = Instant::now() + common::WAIT;
        while r.get("/v2/").is_none() {
            assert!(
                Instant::now() < deadline && common::exists(pid),
                "the registry did not come up: {}",
                std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    /// The status line and body of `GET path`, if the registry answers.
    pub fn get(&self, path: &str) -> Option<String> {
        let mut s = TcpStream::connect(&self.host).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.0\r\nHost: {}\r\nAccept: application/vnd.oci.image.index.v1+json, \
             application/vnd.oci.image.manifest.v1+json\r\n\r\n",
            self.host
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.starts_with("HTTP/").then_some(out)
    }

    /// `hosts.toml` of a containerd registry configuration directory for this registry
    /// (plain HTTP).
    pub fn write_hosts_toml(&self, certs_d: &Path) {
        let d = certs_d.join(&self.host);
        std::fs::create_dir_all(&d).expect("certs.d");
        std::fs::write(
            d.join("hosts.toml"),
            format!(
                "server = \"http://{h}\"\n[host.\"http://{h}\"]\n  capabilities = [\"pull\", \
                 \"resolve\", \"push\"]\n  skip_verify = true\n",
                h = self.host
            ),
        )
        .expect("hosts.toml");
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        common::signal(self.pid, libc::SIGKILL);
        let _ = common::reap_until_gone(&[self.pid], common::WAIT);
    }
}

/// The names of the images the CRI tests pull from the registry.
pub struct Images {
    /// The root file system with the workloads.
    pub workload: String,
    /// The pod sandbox image.
    pub pause: String,
}

impl Images {
    /// The images' names in `registry`.
    pub fn of(registry: &Registry) -> Images {
        Images {
            workload: format!("{}/criu-gpu-e2e/workload:1", registry.host),
            pause: format!("{}/criu-gpu-e2e/pause:1", registry.host),
        }
    }
}

/// Builds the test's two `images` and pushes them to their registry through `cd` (any
/// containerd; its `ctr`, plain HTTP).
pub fn push_images(e: &E2e, cd: &Containerd<'_>, images: &Images) {
    for (stem, name, config) in [
        ("workload-image", &images.workload, ""),
        ("pause-image", &images.pause, PAUSE),
    ] {
        let archive = oci_archive_of(e, stem, name, config);
        cd.ctr(&["image", "import", archive.to_str().expect("UTF-8 path")])
            .assert_ok();
        cd.ctr(&["image", "push", "--plain-http", name]).assert_ok();
    }
}

/// The containerd 2.x configuration of the CRI's plugins for a node whose directory is `d`.
fn cri_config(
    d: &Path,
    bins: &ContainerdBins,
    registry: &Registry,
    pause: &str,
    criu_work: Option<&Path>,
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
  cdi_spec_dirs = ["{cdi}"]
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
    /// `start` (the StartContainer of a container created from a checkpoint), with whatever
    /// the runtime needs done meanwhile for [`CriDaemon::restore_log`] to be readable after.
    fn around_restore(
        &self,
        _node_dir: &Path,
        _id: &str,
        start: &dyn Fn() -> cri_client::Result<()>,
    ) -> cri_client::Result<()> {
        start()
    }
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
        let dir = self.e.dir().join(&self.name);
        self.cd
            .around_restore(&dir, id, &|| self.cri.start_container(id))
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

/// SIGKILL to every process in cgroup `path` or below, in every hierarchy.
fn kill_cgroup_tree(path: &str) {
    let pids = cgroup_tree_pids(path);
    for &p in &pids {
        common::signal(p, libc::SIGKILL);
    }
    let _ = common::reap_until_gone(&pids, common::WAIT);
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

// ---- what the tests check of a CRI checkpoint and restore -------------------------------

/// The stand-in CUDA driver's log of its calls (`FAKE_CUDA_LOG` of the node's CRIU).
pub fn calls(e: &E2e) -> PathBuf {
    e.dir().join("cuda-calls")
}

/// The kubelet's default checkpoint timeout is 4 hours; a test's dump takes seconds.
pub const CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(60);

/// `criu-gpu` of this workspace, built when the test run did not build it.
pub fn criu_gpu() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let bin = profile_dir.join("criu-gpu");
    if !bin.is_file() {
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "--locked", "-p", "criu-gpu"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let ok = cmd.status().is_ok_and(|s| s.success());
        assert!(ok && bin.is_file(), "cannot build criu-gpu: {cmd:?}");
    }
    bin
}

/// The archive of a CRI checkpoint, read as an operator would: the plugin's image and log
/// lines are in it, and `checkpointctl show` (which names node `n`'s engine) and `criu-gpu
/// inspect` read it.
pub fn assert_archive<D: CriDaemon>(
    n: &CriNode<'_, D>,
    archive: &Path,
    workload: Workload,
    pid: i32,
) {
    let e = n.e;
    let members = archive_members(e, archive);
    for want in [
        "dump.log",
        "config.dump",
        "spec.dump",
        "checkpoint/inventory.img",
    ] {
        assert!(
            members.iter().any(|m| m == want),
            "no {want} in the archive: {members:?}"
        );
    }
    let gpu_image = members
        .iter()
        .any(|m| m == "checkpoint/gpu-plugin-cuda.img");
    assert_eq!(
        gpu_image,
        workload.is_cuda(),
        "checkpoint/gpu-plugin-cuda.img in the archive: {members:?}"
    );
    let dump = CriuRun {
        what: "CheckpointContainer".into(),
        code: Some(0),
        log: archive_member(e, archive, "dump.log"),
        output: String::new(),
        took: Duration::ZERO,
    };
    assert_plugin_dumped(e, &dump, workload, pid);

    let mut cmd = e.command(&private_tool("checkpointctl"));
    cmd.arg("show")
        .arg(archive)
        .env("PATH", tool_path(e))
        .env("TMPDIR", e.dir());
    let show = run_tool(e.dir(), cmd, "checkpointctl show");
    show.assert_ok();
    assert!(
        show.stdout.contains(D::ENGINE),
        "checkpointctl show: no engine {}: {show:?}",
        D::ENGINE
    );

    let mut cmd = e.command(&criu_gpu());
    cmd.arg("inspect").arg(archive);
    let inspect = run_tool(e.dir(), cmd, "criu-gpu inspect");
    inspect.assert_ok();
    let want = if workload.is_cuda() {
        "1 CUDA process(es)"
    } else {
        "no GPU state: CRIU restores this checkpoint without the GPU plugin"
    };
    assert!(
        inspect.stdout.contains(want),
        "criu-gpu inspect: no `{want}`: {inspect:?}"
    );
}

/// The checkpointed container removed, a new one created from `archive` in `pod` and started:
/// it must resume where the checkpoint (taken between output marks `low` and `high`) left it,
/// with its device memory for CUDA (`files`). Returns the restored container.
pub fn restore_from<'e, D: CriDaemon>(
    n: &'e CriNode<'e, D>,
    pod: &(String, v1::PodSandboxConfig),
    name: &str,
    image: &str,
    old: &CriContainer<'_, D>,
    marks: (usize, usize),
    files: Option<&Vec<String>>,
) -> CriContainer<'e, D> {
    restore_from_with(n, pod, name, image, old, marks, files, &|_| {}).0
}

/// [`restore_from`] with the new container's configuration changed by `edit`; also returns
/// CRIU's log of the restore.
#[allow(clippy::too_many_arguments)]
pub fn restore_from_with<'e, D: CriDaemon>(
    n: &'e CriNode<'e, D>,
    pod: &(String, v1::PodSandboxConfig),
    name: &str,
    image: &str,
    old: &CriContainer<'_, D>,
    (low, high): (usize, usize),
    files: Option<&Vec<String>>,
    edit: &dyn Fn(&mut v1::ContainerConfig),
) -> (CriContainer<'e, D>, CriuRun) {
    old.remove();
    let killed = old.out.mark();
    let out = Output::new(old.out.dir.clone(), old.out.workload);
    let id = n
        .create_from_checkpoint_with(pod, name, image, &out, edit)
        .unwrap_or_else(|err| panic!("CreateContainer from {image}: {err}\n{}", n.log_tail()));
    n.start_restored(&id)
        .unwrap_or_else(|err| panic!("StartContainer (restore): {err}\n{}", n.log_tail()));
    let c = CriContainer { node: n, id, out };
    let pid = c.running_pid();
    // CRIU's log of the restore, in the container's work directory.
    let log = n.restore_log(&c.id);
    let restore = CriuRun {
        what: "StartContainer (restore)".into(),
        code: Some(0),
        log: std::fs::read_to_string(&log)
            .unwrap_or_else(|err| panic!("CRIU's restore log {}: {err}", log.display())),
        output: String::new(),
        took: Duration::ZERO,
    };
    assert_plugin_restored(n.e, &restore, c.out.workload);
    c.out.assert_resumes_between(low, high, killed);
    if let Some(files) = files {
        c.out.assert_gpu_restored(files, &calls(n.e), pid);
    }
    (c, restore)
}

/// The member names of tar archive `archive` (through `tar -t`).
pub fn archive_members(e: &E2e, archive: &Path) -> Vec<String> {
    let mut cmd = e.command(Path::new("tar"));
    cmd.arg("-tf").arg(archive);
    let run = super::run_tool(e.dir(), cmd, "tar -t");
    run.assert_ok();
    run.stdout
        .lines()
        .map(|l| l.trim_start_matches("./").to_string())
        .collect()
}

/// Member `name` of tar archive `archive`, as text.
pub fn archive_member(e: &E2e, archive: &Path, name: &str) -> String {
    let mut cmd = e.command(Path::new("tar"));
    cmd.arg("-xOf").arg(archive).arg(name);
    let run = super::run_tool(e.dir(), cmd, "tar -xO");
    run.assert_ok();
    run.stdout
}

/// Waits until `pid` is gone and reaped.
pub fn wait_pid_gone(pid: i32) {
    wait_until(format!("pid {pid} gone"), || {
        reap_now();
        !common::exists(pid)
    });
}

/// The annotation by which containerd 2.x (and CRI-O, under its own name) recognises a
/// checkpoint image: the name of the checkpointed container.
pub const CHECKPOINT_ANNOTATIONS: [&str; 2] = [
    "org.criu.checkpoint.container.name",
    "io.kubernetes.cri-o.annotations.checkpoint.name",
];

/// Turns the CRI checkpoint `archive` of container `container` into an OCI image and pushes
/// it to `registry` as `<registry>/criu-gpu-e2e/checkpoint-<container>:1`, the way the
/// Kubernetes documentation does it with buildah (`from scratch`, `add` the archive, the
/// checkpoint annotation, `commit`, `push`). buildah is `CRIU_GPU_TEST_BUILDAH2`, else
/// `<repo>/.runtimes-2026/bin/buildah`; its storage (vfs) is in the test's directory.
pub fn push_checkpoint_image(
    e: &E2e,
    archive: &Path,
    container: &str,
    registry: &Registry,
) -> String {
    let buildah = super::tool_2026("CRIU_GPU_TEST_BUILDAH2", "bin/buildah");
    let d = e.dir().join("buildah");
    let [root, runroot, varlib] = ["root", "run", "var-lib-containers"].map(|s| d.join(s));
    for p in [&root, &runroot, &varlib] {
        std::fs::create_dir_all(p).expect("buildah directory");
    }
    let policy = d.join("policy.json");
    std::fs::write(
        &policy,
        r#"{"default":[{"type":"insecureAcceptAnything"}]}"#,
    )
    .expect("policy.json");
    // buildah looks for netavark even when it runs nothing: the prefix's.
    let prefix = buildah
        .parent()
        .and_then(Path::parent)
        .expect("<prefix>/bin/buildah");
    let conf = d.join("containers.conf");
    std::fs::write(
        &conf,
        format!(
            "[engine]\nhelper_binaries_dir = [\"{}\"]\n[network]\nnetwork_backend = \"netavark\"\n",
            prefix.join("usr/lib/podman").display()
        ),
    )
    .expect("containers.conf");
    let mounts = super::PrivateMounts::new().bind(&varlib, "/var/lib/containers");
    let reference = format!("{}/criu-gpu-e2e/checkpoint-{container}:1", registry.host);
    let run = |args: &[&str]| -> String {
        let mut argv: Vec<OsString> = vec![
            buildah.clone().into(),
            "--root".into(),
            root.clone().into(),
            "--runroot".into(),
            runroot.clone().into(),
            "--storage-driver".into(),
            "vfs".into(),
        ];
        argv.extend(args.iter().map(OsString::from));
        let what = super::describe(&argv);
        let mut cmd = mounts.command(e, e.dir(), &argv);
        cmd.env("TMPDIR", e.dir()).env("CONTAINERS_CONF", &conf);
        let r = super::run_tool(e.dir(), cmd, &what);
        r.assert_ok();
        r.stdout.trim().to_string()
    };
    let policy = policy.to_str().expect("UTF-8 path");
    let ctr = run(&["from", "--signature-policy", policy, "scratch"]);
    run(&["add", &ctr, archive.to_str().expect("UTF-8 path"), "/"]);
    let mut config = vec!["config".to_string()];
    for a in CHECKPOINT_ANNOTATIONS {
        config.push(format!("--annotation={a}={container}"));
    }
    config.push(ctr.clone());
    run(&config.iter().map(String::as_str).collect::<Vec<_>>());
    let image = format!("localhost/criu-gpu-e2e-checkpoint-{container}:1");
    run(&["commit", "--signature-policy", policy, &ctr, &image]);
    run(&[
        "push",
        "--signature-policy",
        policy,
        "--tls-verify=false",
        &image,
        &format!("docker://{reference}"),
    ]);
    reference
}
