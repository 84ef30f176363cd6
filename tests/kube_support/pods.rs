//! Pods as a user makes them: a manifest applied with `kubectl`, the pod bound to its node by
//! `spec.nodeName`; what the tests read back (phase, container, host pid) comes from the API
//! server (a `GET` of the pod) and the node's runtime; checkpoints through the kubelet's API.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cri_client::Cri;

use super::control_plane::{ControlPlane, field};
use super::node::KubeNode;
use crate::common::{self, wait_until};
use crate::containers_support::{Output, Workload};

/// How long a pod may take to run (image pulls from the local registry, a restore).
const RUNNING: Duration = Duration::from_secs(120);

/// The container's name in every pod of the tests.
pub const CONTAINER: &str = "w";

/// A string as a YAML (JSON) double-quoted scalar.
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// What a pod of the tests has beyond its workload.
#[derive(Clone, Debug, Default)]
pub struct Extras {
    /// YAML lines at the level of `nodeName`, added to the pod's spec.
    pub spec: String,
    /// More of the container's environment, `KEY=VALUE`.
    pub env: Vec<String>,
    /// The container's resource limits (an extended resource such as `nvidia.com/gpu`).
    pub limits: Vec<(String, String)>,
    /// Host files bound into the container, read-only (`hostPath` volumes): host path, path
    /// in the container.
    pub host_files: Vec<(PathBuf, String)>,
}

impl Extras {
    /// `spec` added to the pod's spec.
    pub fn spec(spec: &str) -> Extras {
        Extras {
            spec: spec.to_string(),
            ..Extras::default()
        }
    }
}

/// The manifest of pod `name` on node `node` running `workload` from `image`, its `/out` the
/// host directory `out` (a `hostPath` volume), with `extras`. The restore of a checkpoint is
/// the same manifest with the checkpoint image as `image`.
pub fn manifest(
    name: &str,
    node: &str,
    image: &str,
    workload: Workload,
    out: &Path,
    extras: &Extras,
) -> String {
    let command: Vec<String> = workload.args().iter().map(|a| quoted(a)).collect();
    let env: String = workload
        .env()
        .iter()
        .chain(&extras.env)
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| format!("    - name: {k}\n      value: {}\n", quoted(v)))
        .collect();
    let mut resources = String::new();
    if !extras.limits.is_empty() {
        resources.push_str("    resources:\n      limits:\n");
        for (k, v) in &extras.limits {
            resources.push_str(&format!("        {k}: {}\n", quoted(v)));
        }
    }
    let (mut file_mounts, mut file_volumes) = (String::new(), String::new());
    for (i, (host, inside)) in extras.host_files.iter().enumerate() {
        file_mounts.push_str(&format!(
            "    - name: file-{i}\n      mountPath: {}\n      readOnly: true\n",
            quoted(inside)
        ));
        file_volumes.push_str(&format!(
            "  - name: file-{i}\n    hostPath:\n      path: {}\n      type: File\n",
            quoted(&host.to_string_lossy())
        ));
    }
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n{spec}  \
         nodeName: {node}\n  hostNetwork: true\n  restartPolicy: Never\n  \
         terminationGracePeriodSeconds: 1\n  containers:\n  - name: {CONTAINER}\n    image: \
         {image}\n    imagePullPolicy: IfNotPresent\n    command: [{command}]\n    env:\n{env}\
         {resources}    volumeMounts:\n    - name: out\n      mountPath: /out\n{file_mounts}  \
         volumes:\n  - name: out\n    hostPath:\n      path: {out}\n      type: Directory\n\
         {file_volumes}",
        spec = extras.spec,
        command = command.join(", "),
        out = out.display(),
    )
}

/// A pod of the test on one node.
pub struct Pod<'c, 'e> {
    pub cp: &'c ControlPlane<'e>,
    pub name: String,
    pub out: Output,
    /// What its manifest has beyond the workload (a restore's manifest has it too).
    pub extras: Extras,
}

impl<'c, 'e> Pod<'c, 'e> {
    /// Creates pod `name` on `node` running `workload` from `image` (`kubectl apply`), its
    /// output in `<test dir>/out-<out>`; returns once the pod runs and its workload is ready.
    pub fn create(
        cp: &'c ControlPlane<'e>,
        node: &KubeNode<'_>,
        name: &str,
        image: &str,
        workload: Workload,
        out: &str,
    ) -> Pod<'c, 'e> {
        Pod::create_with(cp, node, name, image, workload, out, &Extras::default())
    }

    /// Applies pod `name`'s manifest (see [`Pod::create_with`]) without waiting: for a pod its
    /// node refuses.
    pub fn apply_with(
        cp: &'c ControlPlane<'e>,
        node: &KubeNode<'_>,
        name: &str,
        image: &str,
        workload: Workload,
        out: &str,
        extras: &Extras,
    ) -> Pod<'c, 'e> {
        let out = Output::new(node.e.dir().join(format!("out-{out}")), workload);
        cp.apply(
            name,
            &manifest(name, &node.name, image, workload, &out.dir, extras),
        );
        Pod {
            cp,
            name: name.to_string(),
            out,
            extras: extras.clone(),
        }
    }

    /// [`Pod::create`] with `extras` (see [`manifest`]). The CUDA
    /// workload's pid in its container (what its files are named after) is found from what it
    /// writes: 1 unless the pod shares one pid namespace between its containers.
    pub fn create_with(
        cp: &'c ControlPlane<'e>,
        node: &KubeNode<'_>,
        name: &str,
        image: &str,
        workload: Workload,
        out: &str,
        extras: &Extras,
    ) -> Pod<'c, 'e> {
        let mut pod = Pod::apply_with(cp, node, name, image, workload, out, extras);
        let dir = pod.out.dir.clone();
        pod.wait_running(node);
        if workload.is_cuda() {
            let mut inside = None;
            wait_until(format!("pod {name}'s CUDA workload writing"), || {
                inside = std::fs::read_dir(&dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .find_map(|e| e.file_name().to_str()?.strip_prefix("w.")?.parse().ok());
                inside.is_some()
            });
            pod.out = Output::of_pid(dir, workload, inside.expect("a pid"));
        }
        pod.out.wait_ready();
        pod
    }

    /// Pod `old`'s manifest with the checkpoint image `image` instead of its own, created on
    /// `node` under `old`'s name (`old` deleted): returns once it runs; its output goes on in
    /// `old`'s.
    pub fn create_restored(
        cp: &'c ControlPlane<'e>,
        node: &KubeNode<'_>,
        old: &Pod<'_, '_>,
        image: &str,
    ) -> Pod<'c, 'e> {
        let pod = Pod::apply_restored(cp, node, old, image);
        pod.wait_running(node);
        pod
    }

    /// [`Pod::create_restored`] without waiting: for a restore the node refuses.
    pub fn apply_restored(
        cp: &'c ControlPlane<'e>,
        node: &KubeNode<'_>,
        old: &Pod<'_, '_>,
        image: &str,
    ) -> Pod<'c, 'e> {
        Pod::apply_restored_with(cp, node, old, image, &old.extras)
    }

    /// [`Pod::apply_restored`] with `extras` instead of `old`'s.
    pub fn apply_restored_with(
        cp: &'c ControlPlane<'e>,
        node: &KubeNode<'_>,
        old: &Pod<'_, '_>,
        image: &str,
        extras: &Extras,
    ) -> Pod<'c, 'e> {
        let out = Output::new(old.out.dir.clone(), old.out.workload);
        cp.apply(
            &format!("{}-restored", old.name),
            &manifest(&old.name, &node.name, image, out.workload, &out.dir, extras),
        );
        Pod {
            cp,
            name: old.name.clone(),
            out,
            extras: extras.clone(),
        }
    }

    /// Waits until the pod's container is refused or has failed, as the operator sees it
    /// through `kubectl`: its state (`waiting` or `terminated`), reason and message. Panics if
    /// it runs.
    pub fn wait_refused(&self) -> (String, String, String) {
        let t0 = Instant::now();
        loop {
            let pod = self.object();
            let at = |f: &str| {
                field(
                    pod.as_ref(),
                    &format!("/status/containerStatuses/0/state/{f}"),
                )
            };
            for state in ["waiting", "terminated"] {
                let reason = at(&format!("{state}/reason"));
                let transient = ["", "ContainerCreating", "PodInitializing"];
                if !transient.contains(&reason.as_str()) {
                    return (state.to_string(), reason, at(&format!("{state}/message")));
                }
            }
            assert!(
                at("running/startedAt").is_empty(),
                "pod {} runs, but its node should refuse it:\n{}",
                self.name,
                self.describe()
            );
            assert!(
                t0.elapsed() < RUNNING,
                "pod {} neither runs nor failed after {RUNNING:?}:\n{}",
                self.name,
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// The pod as the API server has it now; `None` when it has none.
    pub fn object(&self) -> Option<serde_json::Value> {
        self.cp
            .get_object(&format!("/api/v1/namespaces/default/pods/{}", self.name))
    }

    /// The pod's field at JSON pointer `pointer` (`/status/phase`), "" when absent.
    pub fn get(&self, pointer: &str) -> String {
        field(self.object().as_ref(), pointer)
    }

    /// `kubectl describe pod` (for failure messages).
    pub fn describe(&self) -> String {
        let r = self.cp.kubectl_quiet(&["describe", "pod", &self.name]);
        format!("{}{}", r.stdout, r.stderr)
    }

    /// Waits until the pod's phase is Running and its container started; panics at once if it
    /// fails.
    pub fn wait_running(&self, node: &KubeNode<'_>) {
        let t0 = Instant::now();
        loop {
            let pod = self.object();
            let phase = field(pod.as_ref(), "/status/phase");
            let started = field(
                pod.as_ref(),
                "/status/containerStatuses/0/state/running/startedAt",
            );
            if phase == "Running" && !started.is_empty() {
                eprintln!("pod {} running in {:?}", self.name, t0.elapsed());
                return;
            }
            assert!(
                phase != "Failed" && phase != "Succeeded" && t0.elapsed() < RUNNING,
                "pod {} is {phase:?} after {:?}:\n{}\n{}\n{}\n{}",
                self.name,
                t0.elapsed(),
                self.describe(),
                node.kubelet_log_tail(),
                node.runtime_log_tail(),
                node.kept_restore_log()
                    .map(|run| format!("{run:?}"))
                    .unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// The runtime's id of the pod's container (`containerd://ID` in the pod's status).
    pub fn container_id(&self) -> String {
        let id = self.get("/status/containerStatuses/0/containerID");
        id.split_once("://")
            .map(|(_, id)| id.to_string())
            .unwrap_or_else(|| panic!("pod {}: no container id in {id:?}", self.name))
    }

    /// The host pid of the container's init, as the node's runtime reports it.
    pub fn pid(&self, node: &KubeNode<'_>) -> i32 {
        let cri = Cri::connect(node.engine.socket(), Duration::from_secs(30)).expect("CRI");
        let status = cri
            .container_status(&self.container_id())
            .expect("ContainerStatus");
        cri_client::status_pid(&status).expect("a running container's pid")
    }

    /// `POST /checkpoint/default/<pod>/w` on `node`'s kubelet, with `timeout` (seconds) if
    /// given: the archive's path, or the kubelet's status and answer.
    pub fn checkpoint(
        &self,
        node: &KubeNode<'_>,
        timeout: Option<u64>,
    ) -> Result<PathBuf, (u16, String)> {
        let mut path = format!("/checkpoint/default/{}/{CONTAINER}", self.name);
        if let Some(t) = timeout {
            path += &format!("?timeout={t}");
        }
        let t0 = Instant::now();
        let (code, body) = node.kubelet_api(self.cp, "POST", &path, Duration::from_secs(300));
        eprintln!(
            "kubelet checkpoint of pod {}: HTTP {code} in {:?}: {}",
            self.name,
            t0.elapsed(),
            body.trim()
        );
        if code != 200 {
            return Err((code, body));
        }
        // {"items":["<path>"]}
        let archive = body
            .split('"')
            .find(|s| s.starts_with('/') && s.ends_with(".tar"))
            .ok_or((code, body.clone()))?;
        Ok(node.host_path(Path::new(archive)))
    }

    /// `kubectl delete pod`, waiting until it is gone and its container's init with it.
    pub fn delete(&self, pid: Option<i32>) {
        self.cp.kubectl(&[
            "delete",
            "pod",
            &self.name,
            "--grace-period=1",
            "--wait=true",
            "--timeout=40s",
        ]);
        if let Some(pid) = pid {
            wait_until(format!("pod {}'s pid {pid} gone", self.name), || {
                crate::containers_support::reap_now();
                !common::exists(pid)
            });
        }
    }
}
