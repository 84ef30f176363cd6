//! *AMD*: the stand-in KFD kernel module loaded (`tests/kfd_module`, in the test guest), each
//! node's stand-in device plugin offering `amd.com/gpu` as AMD's device plugin does (`/dev/kfd`
//! and the render nodes, as device nodes), and a pod of the module's workload checkpointed
//! through the kubelet's API on node a, then restored from its checkpoint image on node b.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::pods::{CONTAINER, Extras, Pod};
use super::runtimes::Runtime;
use super::scenarios::{Cluster, start};
use crate::common::kfd_standin::{
    GPU0, GPU1, StandInKfd, Status, assert_bos_and_pages, assert_queues_run, module_ko,
    workload_status,
};
use crate::containers_support::Workload;
use crate::containers_support::cri::{assert_archive_of, push_checkpoint_image};

/// The one `amd.com/gpu` each node's device plugin offers: the module's `/dev/kfd` and both
/// its render nodes (the workload uses every GPU `/dev/kfd` lists).
const AMD_GPU: &str = "gpu=dev:/dev/kfd,dev:/dev/dri/renderD128,dev:/dev/dri/renderD129";

/// The module built for the running kernel (`KFD_STANDIN_KO`), or `None` after a SKIPPED line.
fn stand_in_module(test: &str) -> Option<PathBuf> {
    let ko = module_ko();
    if ko.is_none() {
        eprintln!(
            "SKIPPED {test}: needs KFD_STANDIN_KO, the stand-in KFD module built for this \
             kernel (scripts/test.sh runs it in the test guest)"
        );
    }
    ko
}

/// The GPU state of the workload of output `out` (its host pid `pid`, `inside` in its
/// container).
fn gpu_state(out: &Path, pid: i32, inside: i32) -> Status {
    workload_status(pid, &out.join(format!("status-{inside}")))
}

/// The GPU state of pod `pod`'s workload (host pid `pid`) against `before`, taken before its
/// checkpoint: on both GPUs, every BO the same bytes at the same GPU address, the doorbell and
/// MMIO pages the GPU's, and both queues running.
fn assert_gpu_state_kept(pod: &Pod<'_, '_>, pid: i32, before: &Status, what: &str) {
    let state = |p| gpu_state(&pod.out.dir, p, pod.out.pid_inside);
    let now = state(pid);
    assert_eq!(
        now.get("gpus").map(String::as_str),
        Some("2"),
        "{what}: {now:?}"
    );
    assert_bos_and_pages(&now, before, [GPU0, GPU1], what);
    std::thread::sleep(Duration::from_millis(500));
    assert_queues_run(&now, &state(pid), what);
}

/// Forensic checkpoint and migration of an AMD pod: the pod asks for one `amd.com/gpu` on node
/// a and runs the workload on both of the module's GPUs; the kubelet's checkpoint API leaves it
/// running, untouched, with its GPU state (and `checkpointctl` and `criu-gpu inspect` read the
/// archive); that archive as a checkpoint image, the pod deleted, and the same manifest with
/// only the image changed on node b: the workload goes on from where it was, its BOs the same
/// bytes at the same addresses, its queues running.
pub fn amd_forensic_and_migration(test: &str, runtime: &Runtime) {
    let Some(ko) = stand_in_module(test) else {
        return;
    };
    let Some(e) = start(test, Workload::Kfd) else {
        return;
    };
    // Dropped after the cluster: the module unloads once no pod holds its files.
    let _kfd = StandInKfd::load(&ko, [GPU0, GPU1]);
    let mut c = Cluster::start(&e, Workload::Kfd, &[("a", runtime), ("b", runtime)]);
    for node in &mut c.nodes {
        node.start_device_plugin(&c.cp, "amd.com/gpu", &[AMD_GPU.to_string()]);
    }
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let extras = Extras {
        limits: vec![("amd.com/gpu".into(), "1".into())],
        ..Extras::default()
    };
    let pod = Pod::create_with(
        &c.cp,
        a,
        "w",
        &c.images().workload,
        Workload::Kfd,
        "w",
        &extras,
    );
    let pid = pod.pid(a);
    let before = gpu_state(&pod.out.dir, pid, pod.out.pid_inside);

    let low = pod.out.mark();
    let archive = pod
        .checkpoint(a, None)
        .unwrap_or_else(|err| panic!("kubelet checkpoint: {err:?}\n{}", a.kubelet_log_tail()));
    let high = pod.out.mark();
    assert_eq!(pod.pid(a), pid, "the pod's process after its checkpoint");
    assert_eq!(
        pod.get("/status/containerStatuses/0/restartCount"),
        "0",
        "the container restarted"
    );
    pod.out.wait_counting(3);
    assert_gpu_state_kept(&pod, pid, &before, "after the kubelet's checkpoint");
    assert_archive_of(&e, runtime.engine_name(), &archive, Workload::Kfd, pid);

    let image = push_checkpoint_image(&e, &archive, CONTAINER, &c.registry);
    pod.delete(Some(pid));
    let killed = pod.out.mark();
    let new_pid = c.assert_restores(b, &pod, &image, (low, high), killed, None);
    assert_gpu_state_kept(&pod, new_pid, &before, "restored on node b");
    assert_holds_the_gpus(new_pid);
}

/// The restored workload `pid` holds the module's files again, as its container names them:
/// `/dev/kfd` and both render nodes.
fn assert_holds_the_gpus(pid: i32) {
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the restored workload's files")
        .flatten()
        .filter_map(|f| std::fs::read_link(f.path()).ok())
        .map(|t| t.display().to_string())
        .collect();
    for want in ["/dev/kfd", "/dev/dri/renderD128", "/dev/dri/renderD129"] {
        assert!(
            fds.iter().any(|f| f == want),
            "the restored workload has no {want} open: {fds:?}"
        );
    }
}
