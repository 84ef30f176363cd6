//! What CRI-O (1.36) under the kubelet asks of the operator beyond containerd: a restore from
//! a checkpoint image uses the checkpoint's base image by its ID on the node and never pulls
//! it. On a node that has never run the image the pod is refused until the image is there
//! (pulled with `crictl`, or there for another pod); then the kubelet's next try restores.

use super::control_plane::tail;
use super::node::KubeNode;
use super::pods::Pod;
use super::runtimes::Runtime;
use super::scenarios::{Cluster, start};
use super::upstream;
use crate::containers_support::cri::gpu_node::driver_restores;
use crate::containers_support::{Workload, run_tool};

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
