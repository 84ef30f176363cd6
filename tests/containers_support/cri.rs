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

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cri_client::{Cri, v1};

use super::engines::{Containerd, ContainerdBins, oci_archive_of};
use super::{Output, Workload, reap_now};
use crate::common::{self, E2e, wait_until};

/// The sandbox image's process: waits, and ends on SIGTERM.
const PAUSE: &str =
    r#","Entrypoint":["/bin/sh","-c","trap 'exit 0' TERM INT; while :; do sleep 1; done"]"#;

/// The registry program: `$CRIU_GPU_TEST_REGISTRY`, else `<repo>/.registry/bin/registry`.
fn registry_program() -> PathBuf {
    let p = std::env::var_os("CRIU_GPU_TEST_REGISTRY").map_or_else(
        || Path::new(common::MANIFEST_DIR).join(".registry/bin/registry"),
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

/// One node: containerd with its CRI, and a CRI client connected to it.
pub struct CriNode<'e> {
    pub e: &'e E2e,
    pub cd: Containerd<'e>,
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
        let cri = Cri::connect(cd.socket(), CALL_TIMEOUT).expect("connect to the CRI");
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
    ) -> CriContainer<'e> {
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
    ) -> CriContainer<'e> {
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
        edit(&mut config);
        self.cri.create_container(pod, &config, sandbox)
    }

    /// The last lines of the daemon's log (for failure messages).
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.cd_log()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn cd_log(&self) -> PathBuf {
        self.e.dir().join(&self.name).join("containerd.log")
    }

    /// CRIU's log of the restore of container `id`: in the node's `CriuWorkPath`, else in
    /// the container's work directory.
    pub fn restore_log(&self, id: &str) -> PathBuf {
        match &self.criu_work {
            Some(d) => d.join("restore.log"),
            None => self
                .e
                .dir()
                .join(&self.name)
                .join("root/io.containerd.runtime.v2.task/k8s.io")
                .join(id)
                .join("restore.log"),
        }
    }

    /// The directory the node's CRI reads CDI specs from (`cdi_spec_dirs`).
    pub fn cdi_spec_dir(&self) -> PathBuf {
        self.e.dir().join(&self.name).join("cdi")
    }

    /// The cgroup (cgroupfs path) of the containers of `pod`.
    pub fn pod_cgroup(&self, pod: &str) -> String {
        format!("{}/{pod}", self.cd.cgroup.path)
    }
}

impl Drop for CriNode<'_> {
    fn drop(&mut self) {
        // As the kubelet ends pods: stop (the runtime kills the containers), then remove.
        for pod in self.pods.borrow().iter() {
            let _ = self.cri.stop_pod_sandbox(pod);
            let _ = self.cri.remove_pod_sandbox(pod);
        }
        reap_now();
        // Whatever is left in the node's cgroups (a container whose shim is gone).
        kill_cgroup_tree(&self.cd.cgroup.path);
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
pub struct CriContainer<'e> {
    pub node: &'e CriNode<'e>,
    pub id: String,
    pub out: Output,
}

impl CriContainer<'_> {
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
