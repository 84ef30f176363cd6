//! The seeds' scenarios on a cluster of the test's own, shared by the suites that run them
//! with different runtimes: each creates its cluster, its pods with `kubectl`, and checks the
//! workload (a counter, or the stand-in CUDA program whose device memory is verified).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::control_plane::{ControlPlane, MAX_NODES};
use super::network::{LoopbackForward, NodeNet, gateway_of};
use super::node::KubeNode;
use super::pods::{CONTAINER, Pod};
use super::runtimes::{NodeEngine, Runtime};
use crate::common::{self, E2e};
use crate::containers_support::cri::gpu_node::driver_restores;
use crate::containers_support::cri::{
    Images, Registry, assert_archive_of, calls, freezer_state, push_checkpoint_image,
};
use crate::containers_support::{
    self, CUDA, Workload, assert_plugin_restored, etc_criu_settings, fake_cuda_env, needs_criu_4_2,
    transitions,
};

/// What [`Cluster::checkpoint_and_delete`] leaves of a pod.
pub struct Checkpointed {
    /// The pod's host pid, now gone.
    pub pid: i32,
    /// Its device memory files at the checkpoint (a CUDA workload's), to verify a restore by.
    pub files: Option<Vec<String>>,
    /// Its output's marks before and after the checkpoint, and once it was deleted.
    pub marks: (usize, usize, usize),
    /// The kubelet's archive.
    pub archive: PathBuf,
    /// The checkpoint image, pushed to the cluster's registry.
    pub image: String,
}

/// The test, or `None` (and a SKIPPED line) where it cannot run.
pub fn start(test: &str, workload: Workload) -> Option<E2e> {
    let e = E2e::start(test)?;
    let why = "containerd needs for a CUDA container (it freezes the container's cgroup around \
               the checkpoint; CRIU 4.1 does not thaw it for plugins)";
    (!needs_criu_4_2(&e, test, workload, why)).then_some(e)
}

/// A cluster: its control plane, the registry its nodes pull from (the test images pushed),
/// and nodes `names`, each with its runtime.
pub struct Cluster<'e> {
    /// Dropped first: each holds its node's network namespace.
    _forwards: Vec<LoopbackForward>,
    pub registry: Registry,
    pub nodes: Vec<KubeNode<'e>>,
    pub cp: ControlPlane<'e>,
}

impl<'e> Cluster<'e> {
    /// Starts the control plane, the registry and one node per `(name, runtime)` of `nodes`.
    /// The registry listens on the host's 127.0.0.1 only and is seen at 127.0.0.1 on every
    /// node, as a registry local to each.
    pub fn start(e: &'e E2e, workload: Workload, nodes: &[(&str, &Runtime)]) -> Cluster<'e> {
        Cluster::start_with(e, workload, nodes, true)
    }

    /// [`Cluster::start`]; unless `registry_on_loopback`, the registry is named by the host's
    /// address on node a's link (`10.231.1.1`), a plain-HTTP registry that only the CRI's
    /// registry configuration (`hosts.toml`) lets containerd use.
    pub fn start_with(
        e: &'e E2e,
        workload: Workload,
        nodes: &[(&str, &Runtime)],
        registry_on_loopback: bool,
    ) -> Cluster<'e> {
        let etc = etc_criu_settings(e, workload, "runc.conf");
        let envs = vec![fake_cuda_env(&calls(e)); nodes.len()];
        Cluster::start_configured(e, nodes, registry_on_loopback, &etc, &envs)
    }

    /// [`Cluster::start_with`] with CRIU's configuration `etc` and each node's environment
    /// (`envs`, in the order of `nodes`).
    pub(super) fn start_configured(
        e: &'e E2e,
        nodes: &[(&str, &Runtime)],
        registry_on_loopback: bool,
        etc: &Path,
        envs: &[Vec<(&'static str, OsString)>],
    ) -> Cluster<'e> {
        assert!(
            nodes.len() <= usize::from(MAX_NODES),
            "at most {MAX_NODES} nodes"
        );
        let cp = ControlPlane::start(e);
        let nets: Vec<NodeNet> = (1..)
            .zip(nodes)
            .map(|(i, (n, _))| NodeNet::new(e, i, n))
            .collect();
        // Listening on that one address of the host: its loopback (forwarded into each node's),
        // or node a's link, which the test and every node reach.
        let name = if registry_on_loopback {
            "127.0.0.1".to_string()
        } else {
            gateway_of(1)
        };
        let registry = Registry::start_at(e, &name, &name);
        let port: u16 = registry
            .host
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("the registry's port");
        let forwards = if registry_on_loopback {
            nets.iter()
                .map(|net| LoopbackForward::new(net, port))
                .collect()
        } else {
            Vec::new()
        };
        let nodes: Vec<KubeNode<'e>> = nets
            .into_iter()
            .zip(nodes)
            .zip(envs)
            .map(|((net, (n, runtime)), env)| {
                KubeNode::start(e, &cp, n, net, etc, env, runtime, &registry)
            })
            .collect();
        nodes[0].engine.push_images(e, &Images::of(&registry));
        Cluster {
            _forwards: forwards,
            registry,
            nodes,
            cp,
        }
    }

    pub fn images(&self) -> Images {
        Images::of(&self.registry)
    }

    /// Pod `old` (deleted, `killed` lines written) made again on `node` from its checkpoint
    /// image `image`, taken between output marks `marks`: it restores (CRIU's log on the node
    /// shows the plugin's restore), the workload resumes from a value it had during the
    /// checkpoint, one by one, with its device memory `files` recreated and verified. The
    /// restored workload's host pid.
    pub fn assert_restores(
        &self,
        node: &KubeNode<'_>,
        old: &Pod<'_, '_>,
        image: &str,
        (low, high): (usize, usize),
        killed: usize,
        files: Option<&Vec<String>>,
    ) -> i32 {
        let restored = Pod::create_restored(&self.cp, node, old, image);
        Cluster::assert_restored(node, &restored, (low, high), killed, files)
    }

    /// What [`Cluster::assert_restores`] checks of `restored`, running on `node`.
    pub fn assert_restored(
        node: &KubeNode<'_>,
        restored: &Pod<'_, '_>,
        (low, high): (usize, usize),
        killed: usize,
        files: Option<&Vec<String>>,
    ) -> i32 {
        let pid = restored.pid(node);
        let log = node.restore_log(&restored.container_id());
        assert_plugin_restored(node.e, &log, restored.out.workload);
        restored.out.assert_resumes_between(low, high, killed);
        if let Some(files) = files {
            restored.out.assert_gpu_restored(files, &calls(node.e), pid);
        }
        pid
    }

    /// Pod `w` of the stand-in CUDA `workload` on node a, held in its busy section (SIGUSR2),
    /// which a checkpoint's lock waits out: the pod, its host pid, its device memory files.
    pub fn busy_cuda_pod(&self, workload: Workload) -> (Pod<'_, 'e>, i32, Vec<String>) {
        let a = &self.nodes[0];
        let pod = Pod::create(&self.cp, a, "w", &self.images().workload, workload, "w");
        let pid = pod.pid(a);
        let files = pod.out.device_files();
        assert!(common::signal(pid, libc::SIGUSR2), "SIGUSR2 to {pid}");
        pod.out.wait_line("hold begin");
        (pod, pid, files)
    }

    /// Pod `pod` of node a checkpointed through the kubelet, the archive pushed as a checkpoint
    /// image, and the pod deleted.
    pub fn checkpoint_and_delete(&self, pod: &Pod<'_, '_>) -> Checkpointed {
        let a = &self.nodes[0];
        let pid = pod.pid(a);
        let files = pod.out.workload.is_cuda().then(|| pod.out.device_files());
        let low = pod.out.mark();
        let archive = pod
            .checkpoint(a, None)
            .unwrap_or_else(|err| panic!("kubelet checkpoint: {err:?}\n{}", a.kubelet_log_tail()));
        let high = pod.out.mark();
        let image = push_checkpoint_image(a.e, &archive, CONTAINER, &self.registry);
        eprintln!("checkpoint image: {image}");
        pod.delete(Some(pid));
        let killed = pod.out.mark();
        Checkpointed {
            pid,
            files,
            marks: (low, high, killed),
            archive,
            image,
        }
    }

    /// A pod of `workload` on node a, checkpointed through the kubelet, its checkpoint image
    /// pushed and the pod deleted; the same manifest with that image applied on node b, where
    /// a bystander runs: it must be refused as `expected` ([`assert_refused`]). The refused
    /// pod.
    pub fn assert_refused_on_b(&self, workload: Workload, expected: &Refusal<'_>) -> Pod<'_, 'e> {
        let b = &self.nodes[1];
        let bystander = self.bystander(b);
        let images = self.images();
        let pod = Pod::create(
            &self.cp,
            &self.nodes[0],
            "w",
            &images.workload,
            workload,
            "w",
        );
        let k = self.checkpoint_and_delete(&pod);
        let restores = driver_restores(b.e);
        let refused = Pod::apply_restored(&self.cp, b, &pod, &k.image);
        assert_refused(b.e, &refused, expected, k.marks.2, restores, &bystander);
        refused
    }

    /// A counter pod of the workload image on `node`, a bystander of a test.
    pub fn bystander(&self, node: &KubeNode<'_>) -> Pod<'_, 'e> {
        let name = format!("bystander-{}", node.name);
        Pod::create(
            &self.cp,
            node,
            &name,
            &self.images().workload,
            Workload::Counter,
            &name,
        )
    }
}

/// The forensic checkpoint: the kubelet's checkpoint API on a running pod; the pod keeps
/// running, untouched (same process, counting on, its GPU given back and verified), and
/// `checkpointctl` and `criu-gpu inspect` read the archive the kubelet wrote.
pub fn forensic(test: &str, workload: Workload, runtime: &Runtime) {
    let Some(e) = start(test, workload) else {
        return;
    };
    let c = Cluster::start(&e, workload, &[("a", runtime)]);
    let a = &c.nodes[0];
    let pod = Pod::create(&c.cp, a, "w", &c.images().workload, workload, "w");
    let pid = pod.pid(a);
    let files = workload.is_cuda().then(|| pod.out.device_files());
    let archive = pod
        .checkpoint(a, None)
        .unwrap_or_else(|err| panic!("kubelet checkpoint: {err:?}\n{}", a.kubelet_log_tail()));
    assert!(
        archive.starts_with(a.checkpoint_dir()),
        "the archive {} is not in the kubelet's checkpoint directory",
        archive.display()
    );
    assert_eq!(pod.pid(a), pid, "the pod's process after its checkpoint");
    assert_eq!(pod.get("/status/phase"), "Running");
    assert_eq!(
        pod.get("/status/containerStatuses/0/restartCount"),
        "0",
        "the container restarted"
    );
    pod.out.assert_given_back(files.as_ref(), &calls(&e), pid);
    assert_archive_of(&e, runtime.engine_name(), &archive, workload, pid);
}

/// The migration: checkpoint on node a through the kubelet, the archive turned into an OCI
/// checkpoint image (buildah) and pushed to the registry, the pod deleted, and a pod of the
/// same manifest with only the image changed created on node b: it restores, the counter goes
/// on from where it was and the GPU state with it.
pub fn migration(test: &str, workload: Workload, on_a: &Runtime, on_b: &Runtime) {
    let Some(e) = start(test, workload) else {
        return;
    };
    let c = Cluster::start(&e, workload, &[("a", on_a), ("b", on_b)]);
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let pod = Pod::create(&c.cp, a, "w", &c.images().workload, workload, "w");
    let k = c.checkpoint_and_delete(&pod);
    let (low, high, killed) = k.marks;
    let new_pid = c.assert_restores(b, &pod, &k.image, (low, high), killed, k.files.as_ref());
    assert_ne!(new_pid, k.pid);
}

/// Fault tolerance: a long job checkpointed through the kubelet at an interval, each
/// checkpoint pushed to the registry as it is taken (the node's disk goes with the node); node
/// a lost (its kubelet, containerd and the pod's processes killed at once); the pod, still
/// bound to a in the API, force-deleted as an operator does for a lost node, and the newest
/// checkpoint restored on node b: at most one interval of work is lost (or the time to take
/// and push a checkpoint, where that is longer).
pub fn fault_tolerance(test: &str, workload: Workload, runtime: &Runtime) {
    let Some(e) = start(test, workload) else {
        return;
    };
    let mut c = Cluster::start(&e, workload, &[("a", runtime), ("b", runtime)]);
    let pod = Pod::create(&c.cp, &c.nodes[0], "w", &c.images().workload, workload, "w");
    let pid = pod.pid(&c.nodes[0]);
    let files = workload.is_cuda().then(|| pod.out.device_files());
    // A checkpoint begins every `interval` (each pushed within it); the node is lost three
    // quarters into the interval after the third.
    let interval = std::time::Duration::from_secs(3);
    let t0 = std::time::Instant::now();
    let mut newest = None;
    for round in 1..=3u32 {
        let begin = t0 + interval * round;
        std::thread::sleep(begin.saturating_duration_since(std::time::Instant::now()));
        let low = pod.out.mark();
        let archive = pod.checkpoint(&c.nodes[0], None).unwrap_or_else(|err| {
            panic!(
                "kubelet checkpoint {round}: {err:?}\n{}",
                c.nodes[0].kubelet_log_tail()
            )
        });
        let high = pod.out.mark();
        // One image, pushed again each round: the registry holds the newest.
        let image = push_checkpoint_image(&e, &archive, "w", &c.registry);
        newest = Some((image, low, high, begin, begin.elapsed()));
    }
    let (image, low, high, taken, took) = newest.expect("a checkpoint");
    let loss = taken + interval * 3 / 4;
    std::thread::sleep(loss.saturating_duration_since(std::time::Instant::now()));
    c.nodes[0].lose();
    let lost_after = taken.elapsed();
    common::wait_until(format!("pid {pid} gone with node a"), || {
        containers_support::reap_now();
        !common::exists(pid)
    });
    let killed = pod.out.mark();
    c.cp.kubectl(&["delete", "pod", "w", "--force", "--grace-period=0"]);

    c.assert_restores(
        &c.nodes[1],
        &pod,
        &image,
        (low, high),
        killed,
        files.as_ref(),
    );
    // What the job did after the newest checkpoint began is lost: the lines from its first
    // mark to the node's loss, done within one interval.
    eprintln!(
        "node a lost {lost_after:?} after the newest checkpoint; {} lines of work lost",
        killed - low
    );
    // The node went three quarters into the interval, or as soon as the newest checkpoint was
    // pushed if that took longer: at most one interval of work, or one checkpoint's time.
    let bound = interval.max(took) + std::time::Duration::from_millis(500);
    assert!(
        lost_after <= bound,
        "node a was lost {lost_after:?} after the newest checkpoint began (taking and pushing it \
         took {took:?}), more than {bound:?}"
    );
}

/// What an operator sees of a restore the node cannot do: checkpoint on node a (`on_a`), the
/// checkpoint image pushed, the pod deleted, and the same manifest with the checkpoint image
/// created on node b (`on_b`), where a bystander pod already runs. The registry is seen at
/// 127.0.0.1 on the nodes unless `registry_on_loopback` is false (see
/// [`Cluster::start_with`]). The restored pod's container state, reason and message (from
/// `kubectl`) must be `expected`; the bystander still counts, and no process of the checkpoint
/// runs on node b.
pub fn restore_refused(
    test: &str,
    workload: Workload,
    on_a: &Runtime,
    on_b: &Runtime,
    registry_on_loopback: bool,
    expected: Refusal<'_>,
) {
    let Some(e) = start(test, workload) else {
        return;
    };
    let c = Cluster::start_with(
        &e,
        workload,
        &[("a", on_a), ("b", on_b)],
        registry_on_loopback,
    );
    c.assert_refused_on_b(workload, &expected);
}

/// What a pod its node refuses must show and leave: through `kubectl`, the pod's
/// container in `expected`'s state with its reason and message; the checkpoint's workload
/// silent since it was deleted (`killed` lines; 0 for a pod that never ran), the driver asked
/// to restore no more than before (`restores`), the node's `bystander` counting on. The
/// pod's message.
pub fn assert_refused(
    e: &E2e,
    refused: &Pod<'_, '_>,
    expected: &Refusal<'_>,
    killed: usize,
    restores: usize,
    bystander: &Pod<'_, '_>,
) -> String {
    let (state, reason, message) = refused.wait_refused();
    eprintln!("the refused pod: {state} {reason}: {message}");
    assert_eq!(
        (state.as_str(), reason.as_str()),
        (expected.state, expected.reason)
    );
    assert!(
        expected.says.iter().all(|part| message.contains(part)),
        "the pod's message: {message}"
    );
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert_eq!(
        refused.out.mark(),
        killed,
        "the checkpoint's workload wrote again after the refused restore"
    );
    assert_eq!(
        driver_restores(e),
        restores,
        "the driver was asked to restore"
    );
    bystander.out.wait_counting(3);
    assert_eq!(bystander.get("/status/phase"), "Running");
    message
}

/// How containerd 2.1 and 2.3 answer a restore CRIU fails (runc's error carries CRIU's errno
/// only); why is in CRIU's log.
pub const CRIU_FAILED: Refusal<'static> = Refusal {
    state: "terminated",
    reason: "StartError",
    says: &["OCI runtime restore failed", "criu failed"],
};

/// How a node refuses a restore, as `kubectl` shows it: the container's state (`waiting`,
/// `terminated`), its reason, and what its message must say.
pub struct Refusal<'a> {
    pub state: &'a str,
    pub reason: &'a str,
    pub says: &'a [&'a str],
}

/// A checkpoint of another driver: a CUDA pod checkpointed on node a (the stand-in driver at
/// CUDA 13.0) and restored on node b, whose driver supports CUDA 12.8 only. The plugin refuses
/// at its start, naming both, before CRIU makes any task: the driver is not asked to restore,
/// the workload does not run, node b's other pod runs on. `kubectl` shows `expected`: with
/// containerd its error ([`CRIU_FAILED`]), with CRI-O the plugin's reason, which CRI-O quotes
/// from CRIU's log. The reason is in CRIU's log on the node (a containerd `runtime` must keep
/// it).
pub fn restore_on_an_older_driver(test: &str, runtime: &Runtime, expected: &Refusal<'_>) {
    let Some(e) = start(test, CUDA) else {
        return;
    };
    let etc = etc_criu_settings(&e, CUDA, "runc.conf");
    let env = fake_cuda_env(&calls(&e));
    let mut older = env.clone();
    older.push(("FAKE_CUDA_DRIVER_VERSION", "12080".into()));
    let nodes = [("a", runtime), ("b", runtime)];
    let c = Cluster::start_configured(&e, &nodes, true, &etc, &[env, older]);
    c.assert_refused_on_b(CUDA, expected);
    let log = c.nodes[1]
        .kept_restore_log()
        .expect("CRIU's log of the refused restore");
    for want in [
        "(CUDA 13.0)",
        "this machine's driver supports only CUDA 12.8",
    ] {
        assert!(log.has(want), "no `{want}` in CRIU's log: {log:?}");
    }
    assert!(!log.has("Forking task"), "CRIU forked tasks: {log:?}");
}

/// The kubelet's deadline passing during a checkpoint: node a's kubelet gives its CRI calls 5 s
/// (`runtimeRequestTimeout`; the API's `?timeout=2` is shorter, so the 5 s hold), while the
/// stand-in CUDA workload holds a busy section for 9 s (the plugin's lock waits for it, within
/// CRIU's own 10 s timeout). The
/// call fails when the deadline passes; the dump runs on and gives the GPU back. Returns the
/// container's freezer state once the dump has ended (what the runtime left), after which the
/// test has thawed it if it was frozen (`ctr task resume`, as an operator would) and checked
/// that the workload goes on with its GPU state and that a later checkpoint works.
pub fn checkpoint_past_deadline(test: &str, runtime: &Runtime) -> Option<String> {
    let workload = Workload::Cuda { hold_ms: 9000 };
    let e = start(test, workload)?;
    let runtime = Runtime {
        request_timeout_s: 5,
        ..runtime.clone()
    };
    let c = Cluster::start(&e, workload, &[("a", &runtime)]);
    let a = &c.nodes[0];
    let (pod, pid, files) = c.busy_cuda_pod(workload);
    let t0 = std::time::Instant::now();
    let answer = pod.checkpoint(a, Some(2));
    let took = t0.elapsed();
    eprintln!("kubelet checkpoint past its deadline: {answer:?} after {took:?}");
    let (code, body) = answer.expect_err("a checkpoint that outlasts the kubelet's deadline");
    assert!(
        took < std::time::Duration::from_secs(10),
        "the kubelet kept the call {took:?}, past its 5 s deadline"
    );
    assert!(
        code >= 500 && body.contains("DeadlineExceeded"),
        "the kubelet's answer: HTTP {code}: {body}"
    );
    common::wait_until("the abandoned dump to give the GPU back", || {
        transitions(&calls(&e), pid).ends_with(&["restore=0".to_string(), "unlock=0".to_string()])
    });
    // runc runs CRIU as `criu swrk`, its options over RPC: no CRIU may still run (CRIU
    // freezes the tree itself while it dumps), and the container's freezer state must hold
    // still for 2 s before it counts as what the runtime left.
    common::wait_until("CRIU of the abandoned dump to end", criu_runs_not);
    let mut left = freezer_state(pid);
    let mut still = std::time::Instant::now();
    common::wait_until("the container's freezer state to settle", || {
        let now = freezer_state(pid);
        if now != left {
            left = now;
            still = std::time::Instant::now();
        }
        still.elapsed() >= std::time::Duration::from_secs(2)
    });
    assert_eq!(pod.pid(a), pid, "the pod's process after the deadline");
    eprintln!("after the abandoned checkpoint the container's cgroup is {left}");
    if left == "FROZEN" {
        let NodeEngine::Containerd(cd) = &a.engine else {
            panic!("CRI-O left the container frozen");
        };
        cd.ctr_in("k8s.io", &["task", "resume", &pod.container_id()])
            .assert_ok();
    }
    assert_eq!(freezer_state(pid), "THAWED");
    pod.out.assert_goes_on_after_hold(&files, pid, "deadline");
    let archive = pod
        .checkpoint(a, Some(60))
        .unwrap_or_else(|err| panic!("kubelet checkpoint after the deadline: {err:?}"));
    assert_archive_of(&e, runtime.engine_name(), &archive, workload, pid);
    assert_eq!(pod.pid(a), pid, "the pod's process after its checkpoint");
    Some(left)
}

/// No CRIU runs in `swrk` mode (as runc starts it; the tests run one at a time).
fn criu_runs_not() -> bool {
    !std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|p| {
            std::fs::read(p.path().join("cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|&b| b == 0).collect();
                args.contains(&b"swrk".as_slice())
                    && args.iter().any(|a| common::bytes_contain(a, b"criu"))
            })
        })
}
