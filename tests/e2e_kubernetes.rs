//! Kubernetes itself: a cluster of the test's own (etcd, kube-apiserver, and nodes "a" and
//! "b", each a kubelet 1.37 with its own containerd, runc, CRIU and the plugin from
//! `/usr/lib/criu` of the node's mount namespace), pods made with `kubectl`, checkpoints
//! through the kubelet's `POST /checkpoint/{namespace}/{pod}/{container}`. Each scenario runs
//! with a plain counter pod and with a pod of the stand-in CUDA driver whose device memory is
//! verified.
//!
//! Programs: Kubernetes and etcd from `scripts/build-upstream.sh` (`tests/kube_support`),
//! containerd 2.1, runc 1.4 and buildah from `scripts/install-runtimes-2026.sh`, the
//! registry from `scripts/install-registry.sh`, checkpointctl from
//! `scripts/install-runtimes.sh`.
//!
//! containerd freezes the container's cgroup around a checkpoint, which CRIU before 4.2 does
//! not thaw for plugins: with CRIU 4.1 the CUDA cases are skipped, saying so.

use criu_gpu_test_support as common;
#[allow(dead_code)]
mod containers_support;
#[allow(dead_code)]
mod kube_support;

use containers_support::cri::{assert_archive_of, calls, freezer_state};
use containers_support::{CUDA, Workload};
use kube_support::pods::Pod;
use kube_support::runtimes::{Runc, Runtime};
use kube_support::scenarios::{Cluster, fault_tolerance, forensic, migration, start};

fn containerd_2_1() -> Runtime {
    Runtime::containerd_2_1(Runc::V1_4)
}

#[test]
fn kubelet_forensic_checkpoint_counter() {
    forensic("k8s-forensic-counter", Workload::Counter, &containerd_2_1());
}

#[test]
fn kubelet_forensic_checkpoint_cuda() {
    forensic("k8s-forensic-cuda", CUDA, &containerd_2_1());
}

#[test]
fn kubelet_migration_to_node_b_counter() {
    let r = containerd_2_1();
    migration("k8s-migration-counter", Workload::Counter, &r, &r);
}

#[test]
fn kubelet_migration_to_node_b_cuda() {
    let r = containerd_2_1();
    migration("k8s-migration-cuda", CUDA, &r, &r);
}

#[test]
fn kubelet_fault_tolerance_counter() {
    fault_tolerance("k8s-fault-counter", Workload::Counter, &containerd_2_1());
}

#[test]
fn kubelet_fault_tolerance_cuda() {
    fault_tolerance("k8s-fault-cuda", CUDA, &containerd_2_1());
}

/// The kubelet's timeout: its checkpoint API called with `?timeout=2` while the stand-in CUDA
/// workload holds a busy section for 8 s (the plugin's lock waits for it), so the dump cannot
/// end in time. What the kubelet and containerd 2.1 do, pinned here: the kubelet hands the
/// timeout to the runtime in the request, containerd 2.1 does not use it (only the call's own
/// deadline, the kubelet's `runtimeRequestTimeout`, 4 minutes here as by default), so the
/// checkpoint runs to its end and succeeds late. The workload keeps running with its GPU state
/// given back and verified, nothing is left paused, and a later checkpoint works.
#[test]
fn kubelet_checkpoint_timeout() {
    let workload = Workload::Cuda { hold_ms: 8000 };
    let Some(e) = start("k8s-timeout", workload) else {
        return;
    };
    let c = Cluster::start(&e, workload, &[("a", &containerd_2_1())]);
    let a = &c.nodes[0];
    let pod = Pod::create(&c.cp, a, "w", &c.images().workload, workload, "w");
    let pid = pod.pid(a);
    let files = pod.out.device_files();

    assert!(common::signal(pid, libc::SIGUSR2), "SIGUSR2 to {pid}");
    pod.out.wait_line("hold begin");
    let t0 = std::time::Instant::now();
    let archive = pod.checkpoint(a, Some(2));
    let took = t0.elapsed();
    eprintln!("kubelet checkpoint with ?timeout=2: {archive:?} after {took:?}");
    let archive = archive.unwrap_or_else(|err| {
        panic!(
            "containerd 2.1 ignores the timeout and the checkpoint succeeds late; now it failed \
             ({err:?}): docs/kubernetes.md must say what happens"
        )
    });
    assert!(
        took > std::time::Duration::from_secs(5),
        "the checkpoint ended after {took:?}, before the workload's busy section did"
    );
    assert_eq!(
        pod.pid(a),
        pid,
        "the pod's process after the late checkpoint"
    );
    assert_eq!(
        freezer_state(pid),
        "THAWED",
        "the container after the checkpoint"
    );
    pod.out.assert_given_back(Some(&files), &calls(&e), pid);
    assert_archive_of(&e, "containerd", &archive, workload, pid);

    // A later checkpoint works as any.
    let archive = pod
        .checkpoint(a, Some(60))
        .unwrap_or_else(|err| panic!("kubelet checkpoint after the late one: {err:?}"));
    assert_archive_of(&e, "containerd", &archive, workload, pid);
    assert_eq!(pod.pid(a), pid, "the pod's process after its checkpoint");
    pod.out.wait_counting(3);
    pod.out.verify(pid);
}
