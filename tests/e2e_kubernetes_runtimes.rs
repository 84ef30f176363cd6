//! Today's runtimes under the kubelet, side by side (the cluster of `tests/kube_support`):
//! containerd 2.3 and 2.4, CRI-O 1.36 and runc 1.5, built from their Go modules
//! (`scripts/build-upstream.sh`), beside containerd 2.1 and runc 1.4 of `e2e_kubernetes`.
//!
//! - containerd 2.3 restores a checkpoint image through CreateContainer only where the node
//!   opts in (`enable_experimental_restore_via_create`); without it the pod is refused with
//!   containerd's reason, which `kubectl` shows. Opted in, it refuses a checkpoint the node
//!   cannot give a GPU or driver for as 2.1 does.
//! - containerd 2.4 no longer restores through CreateContainer: the kubelet's checkpoint still
//!   works; a pod made from a checkpoint image is created as an ordinary container of the
//!   image's files, which has no program to run.
//! - CRI-O 1.36 checkpoints through the kubelet and restores a checkpoint image once its base
//!   image is on the node; its errors quote CRIU's log, so `kubectl` shows why the plugin
//!   refused a restore. It does not restore a pod whose GPU came by a CDI name; one whose GPU
//!   came by a `cdi.k8s.io/` annotation gets the checkpoint's GPU back, whatever GPU the
//!   kubelet gives the new pod, and is refused where the node has no such GPU.
//!
//! containerd and CRI-O freeze the container's cgroup around a checkpoint, which CRIU before 4.2 does
//! not thaw for plugins: with CRIU 4.1 the CUDA cases are skipped, saying so.

use criu_gpu_test_support as common;
#[allow(dead_code)]
mod containers_support;
#[allow(dead_code)]
mod kube_support;

use containers_support::{CUDA, Workload};
use kube_support::bad_images::another_cpu_architecture;
use kube_support::crio_scenarios::{
    annotated_gpu_comes_back_as_the_checkpoints, migration_needs_the_base_image,
};
use kube_support::gpu_scenarios::{
    Asks, GivenBy, GpuNodes, RefusedBy, Specs, restore_refused_on_b, restore_refused_on_b_of,
};
use kube_support::hot_swap::{OtherPod, hot_swap};
use kube_support::runtimes::{Runc, Runtime};
use kube_support::scenarios::{
    CRIU_FAILED, Refusal, checkpoint_past_deadline, forensic, migration,
    restore_on_an_older_driver, restore_refused,
};

#[test]
fn containerd_2_3_runc_1_5_opted_in_migration_cuda() {
    let r = Runtime::containerd_2_3(Runc::V1_5, true);
    migration("k8s-cd23-migration-cuda", CUDA, &r, &r);
}

#[test]
fn containerd_2_3_runc_1_5_opted_in_migration_counter() {
    let r = Runtime::containerd_2_3(Runc::V1_5, true);
    migration("k8s-cd23-migration-counter", Workload::Counter, &r, &r);
}

/// Without the opt-in, containerd 2.3 refuses the restore at CreateContainer; the operator
/// reads why from the pod's status.
#[test]
fn containerd_2_3_refuses_restore_without_opt_in() {
    let r = Runtime::containerd_2_3(Runc::V1_5, false);
    let expected = Refusal {
        state: "waiting",
        reason: "CreateContainerError",
        says: &["checkpoint restore via CreateContainer is disabled by configuration"],
    };
    restore_refused("k8s-cd23-refused", CUDA, &r, &r, true, expected);
}

/// Bad input on the opted-in path: a checkpoint restored from a manifest that asks for no GPU
/// is refused before any task, as with containerd 2.1 (`kubectl` shows runc's error, CRIU's
/// log on the node the GPU the checkpoint needs), and node b's other pod runs on.
#[test]
fn containerd_2_3_runc_1_5_restore_without_a_gpu_is_refused() {
    let r = Runtime::containerd_2_3(Runc::V1_5, true).keeping_criu_logs();
    let no_gpu = Asks::NoGpu;
    restore_refused_on_b(
        "k8s-cd23-no-gpu",
        &r,
        no_gpu,
        &CRIU_FAILED,
        RefusedBy::Plugin,
    );
}

/// A checkpoint of a newer driver than node b's, on the opted-in path: refused before any
/// task, as with containerd 2.1.
#[test]
fn containerd_2_3_runc_1_5_restore_on_an_older_driver_is_refused() {
    let r = Runtime::containerd_2_3(Runc::V1_5, true).keeping_criu_logs();
    restore_on_an_older_driver("k8s-cd23-older-driver", &r, &CRIU_FAILED);
}

/// containerd 2.4: the kubelet's checkpoint works.
#[test]
fn containerd_2_4_runc_1_5_forensic_checkpoint_cuda() {
    forensic(
        "k8s-cd24-forensic-cuda",
        CUDA,
        &Runtime::containerd_2_4(Runc::V1_5),
    );
}

/// containerd 2.4: a pod made from a checkpoint image is not a restore. containerd creates an
/// ordinary container whose root file system is the image's files (CRIU's images, no
/// programs), and runc cannot start the pod's command in it.
#[test]
fn containerd_2_4_does_not_restore_a_checkpoint_image() {
    let r = Runtime::containerd_2_4(Runc::V1_5);
    let expected = Refusal {
        state: "terminated",
        reason: "StartError",
        says: &["\"/gpu/workload\": stat /gpu/workload: no such file or directory"],
    };
    restore_refused("k8s-cd24-restore", CUDA, &r, &r, true, expected);
}

/// containerd 2.3 when the kubelet's deadline passes during a checkpoint: as 2.1, the
/// container is left paused until the operator thaws it.
#[test]
fn containerd_2_3_checkpoint_past_the_kubelets_deadline() {
    let r = Runtime::containerd_2_3(Runc::V1_5, false);
    let Some(left) = checkpoint_past_deadline("k8s-cd23-deadline", &r) else {
        return;
    };
    assert_eq!(
        left, "FROZEN",
        "containerd 2.3 left the container paused after the kubelet's deadline; if it no \
         longer does, README and docs/kubernetes.md must say so"
    );
}

/// Runs `scenario` as `test` with CRI-O 1.36 and runc 1.5 on every node, where CRI-O is built
/// (else a SKIPPED line).
fn on_crio(test: &str, scenario: impl FnOnce(&str, &Runtime)) {
    if let Some(r) = Runtime::crio_1_36(Runc::V1_5, test) {
        scenario(test, &r);
    }
}

/// How CRI-O 1.36 refuses a restore whose request lacks a bind mount of the checkpoint: here
/// the stand-in driver's library, which CDI mounted with the GPU.
const CDI_MOUNTS_MISSING: Refusal<'static> = Refusal {
    state: "waiting",
    reason: "CreateContainerError",
    says: &["expects following bind mounts defined (/gpu/libcuda.so.1)"],
};

/// CRI-O 1.36 with runc 1.5 under the kubelet: a CUDA pod checkpointed through the kubelet's
/// API on node a, and its checkpoint image (CRI-O's annotation) restored on node b once the
/// base image is there.
#[test]
fn crio_1_36_runc_1_5_migration_needs_the_base_image_cuda() {
    on_crio("k8s-crio-migration-cuda", |test, r| {
        migration_needs_the_base_image(test, CUDA, r);
    });
}

/// CRI-O 1.36: the kubelet's checkpoint of a CUDA pod, which keeps running with its GPU.
#[test]
fn crio_1_36_runc_1_5_forensic_checkpoint_cuda() {
    on_crio("k8s-crio-forensic-cuda", |test, r| forensic(test, CUDA, r));
}

/// CRI-O 1.36: a checkpoint restored from a manifest that asks for no GPU is refused by CRI-O
/// before CRIU runs, naming the GPU's driver files (its CDI bind mounts) the checkpoint
/// needs; node b's other pod (whose image is the checkpoint's base) runs on.
#[test]
fn crio_1_36_runc_1_5_restore_without_a_gpu_is_refused() {
    on_crio("k8s-crio-no-gpu", |test, r| {
        restore_refused_on_b(
            test,
            r,
            Asks::NoGpu,
            &CDI_MOUNTS_MISSING,
            RefusedBy::Runtime,
        );
    });
}

/// CRI-O 1.36: a checkpoint of a newer driver than node b's is refused by the plugin before
/// any task, and `kubectl` shows the plugin's reason: CRI-O quotes CRIU's log in its error.
#[test]
fn crio_1_36_runc_1_5_restore_on_an_older_driver_is_refused() {
    let expected = Refusal {
        state: "waiting",
        reason: "RunContainerError",
        says: &[
            "container restore failed",
            "gpu_plugin: restore failed: the image was made with",
            "(CUDA 13.0); this machine's driver supports only CUDA 12.8",
        ],
    };
    on_crio("k8s-crio-older-driver", |test, r| {
        restore_on_an_older_driver(test, r, &expected);
    });
}

/// CRI-O 1.36 does not restore a pod whose GPU came by CDI, even given a GPU again: the
/// checkpoint's container had the GPU's driver files bind-mounted by CDI, the kubelet asks for
/// the GPU by its CDI name (not as mounts), and CRI-O refuses before CRIU runs. Nothing of the
/// checkpoint runs; node b's other pod runs on.
#[test]
fn crio_1_36_runc_1_5_does_not_restore_a_gpu_given_by_cdi() {
    on_crio("k8s-crio-cdi-gpu", |test, r| {
        restore_refused_on_b(
            test,
            r,
            Asks::OneGpu,
            &CDI_MOUNTS_MISSING,
            RefusedBy::Runtime,
        );
    });
}

/// CRI-O 1.36's check of the mounts passed, its restore still gives no GPU: with the CDI
/// spec's driver files as `hostPath` volumes of the restored pod, CRI-O runs the restore, but
/// builds the container from the checkpoint's configuration, which has no CDI devices, and
/// drops the request's: the container can reach no GPU. The plugin refuses before any task,
/// and `kubectl` shows its reason, the checkpoint's GPU named.
#[test]
fn crio_1_36_runc_1_5_gives_no_gpu_to_a_restore_past_its_mount_check() {
    let expected = Refusal {
        state: "waiting",
        reason: "RunContainerError",
        says: &[
            "container restore failed: gpu_plugin: restore failed: cannot restore onto the GPUs \
             reachable here",
            "has no counterpart here",
            "GPUs reachable here: none",
        ],
    };
    on_crio("k8s-crio-cdi-files", |test, r| {
        let asks = Asks::OneGpuAndDriverFiles;
        restore_refused_on_b(test, r, asks, &expected, RefusedBy::PluginNamedInKubectl);
    });
}

/// CRI-O 1.36 restores a GPU given by a device plugin's `cdi.k8s.io/` annotation as the
/// checkpoint's GPU: on node b, whose CDI spec also lists the checkpoint's GPU 0 and whose
/// device plugin gives the restored pod GPU 1, the workload goes on with its device memory on
/// GPU 0 (the driver files as `hostPath` volumes, for CRI-O's check of the mounts).
#[test]
fn crio_1_36_runc_1_5_restores_an_annotated_gpu_as_the_checkpoints() {
    on_crio("k8s-crio-cdi-annotation", |test, r| {
        annotated_gpu_comes_back_as_the_checkpoints(test, r);
    });
}

/// CRI-O 1.36: the checkpoint's annotated GPU is not on node b (each node's CDI spec lists its
/// own GPU only, as on two machines; the driver files as `hostPath` volumes, for CRI-O's check
/// of the mounts): CRI-O refuses the pod before CRIU runs, and `kubectl` names the GPU.
#[test]
fn crio_1_36_runc_1_5_refuses_an_annotated_gpu_the_node_lacks() {
    let gpus = GpuNodes {
        by: GivenBy::CdiAnnotation,
        specs: Specs::OwnGpuOnly,
    };
    let expected = Refusal {
        state: "waiting",
        reason: "CreateContainerError",
        says: &["CDI device injection failed", "unresolvable CDI devices"],
    };
    on_crio("k8s-crio-cdi-annotation-elsewhere", |test, r| {
        let (asks, by) = (Asks::OneGpuAndDriverFiles, RefusedBy::RuntimeNamingTheGpu);
        restore_refused_on_b_of(test, r, gpus, asks, &expected, by);
    });
}

/// CRI-O 1.36: hot swap on a node, `criu-gpu suspend --pod` and `resume --pod` finding the
/// training pod on a CRI-O node (CRI-O names the container's cgroup its own way); the other
/// CUDA pod uses the host's pids.
#[test]
fn crio_1_36_runc_1_5_criu_gpu_hot_swaps_a_pod_off_the_gpu_and_back() {
    on_crio("k8s-crio-hot-swap", |test, r| {
        hot_swap(test, r, OtherPod::UsesTheHostPids);
    });
}

/// CRI-O 1.36: a checkpoint of another CPU architecture (its CRIU images and its image's
/// configuration say arm64) is pulled, and the plugin refuses the restore before CRIU forks
/// any task; `kubectl` shows the plugin's reason, which CRI-O quotes from CRIU's log.
#[test]
fn crio_1_36_runc_1_5_refuses_a_checkpoint_of_another_cpu_architecture() {
    let expected = Refusal {
        state: "waiting",
        reason: "RunContainerError",
        says: &[
            "container restore failed",
            "gpu_plugin: restore failed: the checkpoint was made on aarch64 (core-1.img) and \
             this machine is x86_64",
        ],
    };
    on_crio("k8s-crio-other-arch", |test, r| {
        another_cpu_architecture(test, r, &expected);
    });
}
