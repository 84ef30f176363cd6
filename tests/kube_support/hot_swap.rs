//! *Hot swap on a node*: `criu-gpu suspend --pod NAMESPACE/NAME` takes a training pod's GPU
//! state to host memory while another pod of the node uses the GPU, and `criu-gpu resume --pod`
//! gives it back. The tool finds the pod from what the kubelet leaves on the node (its pod log
//! directory, its cgroup), whatever the node's runtime.

use std::path::Path;

use super::pods::{Extras, Pod};
use super::runtimes::Runtime;
use super::scenarios::{Cluster, start};
use crate::containers_support::cri::{calls, criu_gpu};
use crate::containers_support::{CUDA, fake_cuda_env, run_tool, transitions};

/// How the other CUDA pod of the node keeps its workload from being pid 1 of a pid namespace,
/// as the training pod's is: the stand-in driver names its socket in the node's network
/// namespace after that pid, so two such workloads would share one.
#[derive(Clone, Copy, Debug)]
pub enum OtherPod {
    /// `shareProcessNamespace: true`: the pod's pause or infra process is pid 1.
    SharesItsPidNamespace,
    /// `hostPID: true`: the workload has its host pid (for CRI-O on this host, where a pod
    /// that shares its pid namespace does not start: its infra container needs
    /// `CAP_SYS_RESOURCE`).
    UsesTheHostPids,
}

impl OtherPod {
    fn extras(self) -> Extras {
        Extras::spec(match self {
            OtherPod::SharesItsPidNamespace => "  shareProcessNamespace: true\n",
            OtherPod::UsesTheHostPids => "  hostPID: true\n",
        })
    }
}

/// Hot swap on node a of `runtime`: pod `train` suspended off the GPU by `criu-gpu suspend
/// --pod default/train`, still running; pod `other` (made as `other_pod` says) left alone,
/// computing on the GPU meanwhile, then deleted; `criu-gpu resume --pod default/train` gives
/// `train` its device memory back, verified, and it counts on.
pub fn hot_swap(test: &str, runtime: &Runtime, other_pod: OtherPod) {
    let Some(e) = start(test, CUDA) else {
        return;
    };
    let c = Cluster::start(&e, CUDA, &[("a", runtime)]);
    let a = &c.nodes[0];
    let train = Pod::create(&c.cp, a, "train", &c.images().workload, CUDA, "train");
    let pid = train.pid(a);
    let files = train.out.device_files();
    assert!(!files.is_empty(), "the training pod holds no device memory");
    // On the node: in its network namespace (the stand-in driver's sockets are there).
    let tool = |command: &str| {
        let mut cmd = e.command(Path::new("nsenter"));
        cmd.arg(format!("--net={}", a.net.path().display()))
            .arg("--")
            .arg(criu_gpu())
            .args([command, "--pod", "default/train", "--pod-logs"])
            .arg(a.dir.join("pod-logs"))
            .env(
                "CRIU_GPU_PLUGIN_CONFIG",
                e.dir().join("etc-criu/gpu-plugin.conf"),
            );
        for (k, v) in fake_cuda_env(&calls(&e)) {
            cmd.env(k, v);
        }
        run_tool(
            e.dir(),
            cmd,
            &format!("criu-gpu {command} --pod default/train"),
        )
    };

    // Another pod on the node, with its own GPU memory: the suspend must leave it alone.
    let other = Pod::create_with(
        &c.cp,
        a,
        "other",
        &c.images().workload,
        CUDA,
        "other",
        &other_pod.extras(),
    );
    let other_pid = other.pid(a);
    let other_files = other.out.device_files();
    assert!(!other_files.is_empty());

    let s = tool("suspend");
    eprintln!(
        "criu-gpu suspend --pod default/train:\n{}{}",
        s.stdout, s.stderr
    );
    s.assert_ok();
    assert!(
        train.out.device_files().is_empty(),
        "GPU memory not freed: {s:?}"
    );
    assert_eq!(transitions(&calls(&e), pid), ["lock=0", "checkpoint=0"]);
    assert_eq!(
        train.pid(a),
        pid,
        "the training pod's process after the suspend"
    );
    assert_eq!(train.get("/status/phase"), "Running");
    assert!(
        transitions(&calls(&e), other_pid).is_empty(),
        "the suspend of pod train touched pod other"
    );
    assert_eq!(other.out.device_files(), other_files);

    // The other pod computes on the GPU meanwhile, then ends.
    other.out.verify(other_pid);
    other.delete(Some(other_pid));

    let r = tool("resume");
    r.assert_ok();
    assert_eq!(
        train.out.device_files(),
        files,
        "device memory not given back: {r:?}"
    );
    assert_eq!(
        transitions(&calls(&e), pid),
        ["lock=0", "checkpoint=0", "restore=0", "unlock=0"]
    );
    train.out.wait_counting(3);
    train.out.verify(pid);
}
