//! What CRI-O (1.36) under the kubelet does beyond containerd:
//!
//! - A restore from a checkpoint image uses the checkpoint's base image by its ID on the node
//!   and never pulls it. On a node that has never run the image the pod is refused until the
//!   image is there (pulled with `crictl`, or there for another pod); then the kubelet's next
//!   try restores.
//! - A restored container's annotations are the checkpoint's, so a GPU a device plugin gave
//!   by a `cdi.k8s.io/` annotation comes back as the checkpoint's GPU, whatever GPU the node's
//!   device plugin gives the new pod (where the node has no such GPU, CRI-O refuses the pod,
//!   naming it: [`super::gpu_scenarios::restore_refused_on_b_of`]).

use super::control_plane::tail;
use super::gpu_scenarios::{Asks, GivenBy, GpuNodes, Specs, checkpoint_on_gpu0};
use super::node::KubeNode;
use super::pods::Pod;
use super::runtimes::Runtime;
use super::scenarios::{Cluster, start};
use super::upstream;
use crate::containers_support::cdi::workload_gpus;
use crate::containers_support::cri::gpu_node::driver_restores;
use crate::containers_support::{CUDA, Workload, run_tool};

/// The migration on CRI-O nodes: checkpoint on node a through the kubelet, the checkpoint
/// image pushed, the pod deleted, and the same manifest with the checkpoint image applied on
/// node b, which has never pulled the workload's image. CRI-O refuses it
/// (`CreateContainerError`, the base image's ID "not known"), nothing of it runs and the
/// driver is not asked to restore. The operator pulls the image on node b (`crictl pull`);
/// the kubelet's next try restores, and the workload goes on from where it was with its GPU
/// state.
pub fn migration_needs_the_base_image(test: &str, workload: Workload, runtime: &Runtime) {
    let Some(e) = start(test, workload) else {
        return;
    };
    let c = Cluster::start(&e, workload, &[("a", runtime), ("b", runtime)]);
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let base = c.images().workload;
    let pod = Pod::create(&c.cp, a, "w", &base, workload, "w");
    let k = c.checkpoint_and_delete(&pod);
    let (low, high, killed) = k.marks;
    let restores = driver_restores(&e);

    let restored = Pod::apply_restored(&c.cp, b, &pod, &k.image);
    let (state, reason, message) = restored.wait_refused();
    eprintln!("the pod on node b before its base image is there: {state} {reason}: {message}");
    assert_eq!(
        (state.as_str(), reason.as_str()),
        ("waiting", "CreateContainerError")
    );
    assert!(
        message.contains("locating image with ID") && message.contains("image not known"),
        "the pod's message: {message}"
    );
    assert_eq!(restored.out.mark(), killed, "the workload wrote on node b");
    assert_eq!(
        driver_restores(&e),
        restores,
        "the driver was asked to restore"
    );

    crictl_pull(b, &base);
    restored.wait_running(b);
    let new_pid = Cluster::assert_restored(b, &restored, (low, high), killed, k.files.as_ref());
    assert_ne!(new_pid, k.pid);
}

/// A GPU given by a `cdi.k8s.io/` annotation (NVIDIA's `cdi-annotations` strategy), on CRI-O
/// nodes whose CDI specs both list both stand-in GPUs (on hardware: a restore on the node the
/// checkpoint was made on). A CUDA pod given GPU 0 on node a is checkpointed through the
/// kubelet; the same manifest with the checkpoint image, and with the driver files as
/// `hostPath` volumes (CRI-O's check of the request's mounts wants them), is created on node b,
/// whose device plugin gives the new pod GPU 1. CRI-O builds the restored container's
/// annotations from the checkpoint's, injects GPU 0 from them and not GPU 1, and the workload
/// goes on with its device memory on a GPU the kubelet did not give the pod.
pub fn annotated_gpu_comes_back_as_the_checkpoints(test: &str, runtime: &Runtime) {
    let Some(e) = start(test, CUDA) else {
        return;
    };
    let nodes = [("a", runtime), ("b", runtime)];
    let gpus = GpuNodes {
        by: GivenBy::CdiAnnotation,
        specs: Specs::BothGpus,
    };
    let (c, cdi) = Cluster::start_with_gpus(&e, &nodes, gpus);
    let (pod, k) = checkpoint_on_gpu0(&e, &c, &cdi);
    let gpu0 = &cdi.gpus[0];
    let b = &c.nodes[1];
    // Its image is the checkpoint's base, which CRI-O needs on the node.
    let _bystander = c.bystander(b);
    let extras = Asks::OneGpuAndDriverFiles.extras(&pod, &cdi);
    let restored = Pod::apply_restored_with(&c.cp, b, &pod, &k.image, &extras);
    restored.wait_running(b);
    let allocated = std::fs::read_to_string(b.dir.join("device-plugin.log")).unwrap_or_default();
    assert!(
        allocated.contains(r#"Allocate ["gpu1"]"#),
        "node b's device plugin did not give the restored pod GPU 1: {allocated}"
    );
    let (low, high, killed) = k.marks;
    Cluster::assert_restored(b, &restored, (low, high), killed, k.files.as_ref());
    assert_eq!(
        workload_gpus(&restored.out.dir),
        [(gpu0.uuid.clone(), gpu0.index)],
        "the GPUs of the restored pod: CRI-O gives the checkpoint's annotated GPU 0, not the \
         GPU 1 the kubelet allocated; if that changed, docs/kubernetes.md and docs/cri-o.md \
         must say so"
    );
}

/// `crictl pull image` against `node`'s CRI, as an operator would on the node.
fn crictl_pull(node: &KubeNode<'_>, image: &str) {
    let endpoint = format!("unix://{}", node.engine.socket().display());
    let mut cmd = node.e.command(&upstream("crictl-1.37", "crictl"));
    cmd.args([
        "--runtime-endpoint",
        &endpoint,
        "--image-endpoint",
        &endpoint,
    ])
    .args(["pull", image]);
    let r = run_tool(
        node.e.dir(),
        cmd,
        &format!("crictl pull {image} on node {}", node.name),
    );
    assert!(
        r.ok(),
        "crictl pull {image}: {}{}\n{}",
        r.stdout,
        r.stderr,
        tail(&node.dir.join(node.engine.log_name()), 20)
    );
}
