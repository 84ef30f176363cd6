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
use kube_support::amd_scenarios::amd_forensic_and_migration;
use kube_support::bad_images::{another_cpu_architecture, not_a_checkpoint};
use kube_support::gpu_scenarios::{
    Asks, RefusedBy, restore_onto_another_gpu, restore_refused_on_b,
};
use kube_support::hot_swap::{OtherPod, hot_swap};
use kube_support::runtimes::{Runc, Runtime};
use kube_support::scenarios::{
    CRIU_FAILED, Cluster, Refusal, checkpoint_past_deadline, fault_tolerance, forensic, migration,
    restore_on_an_older_driver, restore_refused, start,
};

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

/// An image that says it is a checkpoint and is not: the pod waits, refused with a reason
/// `kubectl` shows (containerd 2.1: the archive has no `spec.dump`), and the node's other pod
/// runs on.
#[test]
fn kubelet_refuses_an_image_that_is_not_a_checkpoint() {
    // containerd reads the archive's files before anything runs.
    let expected = Refusal {
        state: "waiting",
        reason: "CreateContainerError",
        says: &["failed to read \"spec.dump\"", "no such file or directory"],
    };
    not_a_checkpoint("k8s-not-a-checkpoint", &containerd_2_1(), expected);
}

/// A checkpoint of another CPU architecture (its CRIU images and its image's configuration say
/// arm64): containerd pulls the image (it does not match a single manifest's platform), and
/// the plugin refuses the restore before CRIU forks any task; `kubectl` shows containerd's
/// error, CRIU's log on the node the reason.
#[test]
fn kubelet_refuses_a_checkpoint_of_another_cpu_architecture() {
    another_cpu_architecture(
        "k8s-other-arch",
        &containerd_2_1().keeping_criu_logs(),
        &CRIU_FAILED,
    );
}

/// *AMD*: the stand-in KFD module's workload in a pod given `/dev/kfd` and the render nodes by
/// a device plugin, checkpointed through the kubelet's API and restored on node b from its
/// checkpoint image (in the test guest, where the module loads; elsewhere SKIPPED).
#[test]
fn kubelet_amd_forensic_checkpoint_and_migration() {
    amd_forensic_and_migration("k8s-amd", &containerd_2_1().keeping_criu_logs());
}

/// *Another GPU*: a restore on node b, whose device plugin gives the pod a different GPU (a
/// CDI device), goes onto that GPU with no map written.
#[test]
fn kubelet_restore_onto_the_gpu_node_bs_device_plugin_gives() {
    restore_onto_another_gpu("k8s-other-gpu", &containerd_2_1());
}

/// The same checkpoint restored from a manifest that asks for no GPU: refused before any task;
/// `kubectl` shows containerd's error, CRIU's log on the node the reason.
#[test]
fn kubelet_restore_without_a_gpu_is_refused() {
    restore_refused_on_b(
        "k8s-no-gpu",
        &containerd_2_1().keeping_criu_logs(),
        Asks::NoGpu,
        &CRIU_FAILED,
        RefusedBy::Plugin,
    );
}

/// A checkpoint of a newer driver than node b's: refused before any task; `kubectl` shows
/// containerd's error, CRIU's log on the node both driver versions.
#[test]
fn kubelet_restore_on_an_older_driver_is_refused() {
    restore_on_an_older_driver(
        "k8s-older-driver",
        &containerd_2_1().keeping_criu_logs(),
        &CRIU_FAILED,
    );
}

/// The restore pulls the checkpoint's base image (`NAME@DIGEST`, recorded in the archive) with
/// containerd's own resolver, not with the CRI's registry configuration (`config_path`,
/// `hosts.toml`): here the registry is one that node b reaches only as configured there
/// (plain HTTP at a non-local address), though a bystander pod of the same image runs on b.
/// The restore fails with the reason in the pod's status.
#[test]
fn kubelet_restore_needs_the_base_image_from_containerds_own_resolver() {
    let r = containerd_2_1();
    let expected = Refusal {
        state: "waiting",
        reason: "CreateContainerError",
        says: &[
            "failed to pull checkpoint base image",
            "server gave HTTP response to HTTPS client",
        ],
    };
    restore_refused("k8s-no-base", Workload::Counter, &r, &r, false, expected);
}

#[test]
fn kubelet_fault_tolerance_counter() {
    fault_tolerance("k8s-fault-counter", Workload::Counter, &containerd_2_1());
}

#[test]
fn kubelet_fault_tolerance_cuda() {
    fault_tolerance("k8s-fault-cuda", CUDA, &containerd_2_1());
}

/// A checkpoint whose dump outlasts `?timeout=` (`timeout`) or the kubelet's
/// `runtimeRequestTimeout` (`request_timeout_s`), but not the longer of the two, which is the
/// call's deadline: the stand-in CUDA workload holds a busy section for 9 s (the plugin's lock
/// waits for it), the call succeeds late, and the workload keeps running with its GPU state
/// given back and verified, nothing left paused.
fn late_checkpoint(test: &str, request_timeout_s: u64, timeout: u64) {
    let workload = Workload::Cuda { hold_ms: 9000 };
    let Some(e) = start(test, workload) else {
        return;
    };
    let runtime = Runtime {
        request_timeout_s,
        ..containerd_2_1()
    };
    let c = Cluster::start(&e, workload, &[("a", &runtime)]);
    let a = &c.nodes[0];
    let (pod, pid, files) = c.busy_cuda_pod(workload);
    let t0 = std::time::Instant::now();
    let archive = pod.checkpoint(a, Some(timeout));
    let took = t0.elapsed();
    eprintln!("kubelet checkpoint with ?timeout={timeout}: {archive:?} after {took:?}");
    let archive = archive.unwrap_or_else(|err| panic!("kubelet checkpoint: {err:?}"));
    assert!(
        took > std::time::Duration::from_secs(6),
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
}

/// `?timeout=2` with the kubelet's default deadline (120 s): the shorter timeout is raised to
/// the kubelet's, so the 9 s dump succeeds.
#[test]
fn kubelet_checkpoint_timeout_below_the_kubelets_deadline() {
    late_checkpoint("k8s-timeout-below", 120, 2);
}

/// `?timeout=30` with the kubelet's deadline at 5 s: the longer timeout is the deadline, so the
/// 9 s dump succeeds (what an operator does for a large GPU process).
#[test]
fn kubelet_checkpoint_timeout_above_the_kubelets_deadline() {
    late_checkpoint("k8s-timeout-above", 5, 30);
}

/// A checkpoint that outlasts the kubelet's deadline: containerd 2.1 answers the error, the
/// dump runs on and gives the GPU back, and containerd's thaw, made with the expired call's
/// context, does not happen: the container is left paused (frozen) until the operator thaws
/// it (`ctr -n k8s.io task resume ID`; README and docs/kubernetes.md say so). Thawed, the
/// workload goes on with its GPU state and a later checkpoint works.
#[test]
fn kubelet_checkpoint_past_the_kubelets_deadline() {
    let Some(left) = checkpoint_past_deadline("k8s-deadline", &containerd_2_1()) else {
        return;
    };
    assert_eq!(
        left, "FROZEN",
        "containerd 2.1 left the container paused after the kubelet's deadline; if it no \
         longer does, README and docs/kubernetes.md must say so"
    );
}

/// Hot swap on a node: `criu-gpu suspend --pod default/train` finds the training pod's
/// processes from what the kubelet leaves on the node (its pod log directory, its cgroup) and
/// takes their GPU state to host memory, the pod still running; another CUDA pod of the node is
/// left alone and computes on the GPU meanwhile; once it is gone, `criu-gpu resume --pod` gives
/// the training pod its GPU back, verified, and it counts on.
#[test]
fn criu_gpu_hot_swaps_a_pod_off_the_gpu_and_back() {
    hot_swap(
        "k8s-hot-swap",
        &containerd_2_1(),
        OtherPod::SharesItsPidNamespace,
    );
}
