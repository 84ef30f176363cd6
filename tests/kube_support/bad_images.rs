//! Checkpoint images a node cannot restore for what they are, not for what the node lacks:
//! an image that says it is a checkpoint and is not, and a checkpoint image of another CPU
//! architecture. Each pod is refused with a reason `kubectl` shows, nothing of it runs, and
//! the node's other pod runs on.

use std::path::Path;

use super::pods::{CONTAINER, Extras, Pod};
use super::runtimes::Runtime;
use super::scenarios::{Cluster, Refusal, assert_refused, start};
use crate::common::foreign_arch::{MARCH_AARCH64, archive_dumped_on};
use crate::containers_support::cri::gpu_node::driver_restores;
use crate::containers_support::cri::{push_checkpoint_image, push_checkpoint_image_for};
use crate::containers_support::{self, CUDA, Workload};

/// An image that says it is a checkpoint and is not: the checkpoint annotation on a layer of
/// one ordinary file, pushed as buildah pushes a checkpoint, and a pod of it on node a (of
/// `runtime`), where a bystander runs. The pod is refused as `expected` shows through
/// `kubectl`; nothing of it runs, and the bystander counts on.
pub fn not_a_checkpoint(test: &str, runtime: &Runtime, expected: Refusal<'_>) {
    let Some(e) = start(test, Workload::Counter) else {
        return;
    };
    let c = Cluster::start(&e, Workload::Counter, &[("a", runtime)]);
    let a = &c.nodes[0];
    let bystander = c.bystander(a);
    let files = e.dir().join("not-a-checkpoint");
    std::fs::create_dir_all(&files).expect("the layer's folder");
    std::fs::write(files.join("notes.txt"), "not a checkpoint\n").expect("the layer's file");
    let archive = e.dir().join("not-a-checkpoint.tar");
    let mut tar = e.command(Path::new("tar"));
    tar.arg("-C")
        .arg(&files)
        .arg("-cf")
        .arg(&archive)
        .arg("notes.txt");
    containers_support::run_tool(e.dir(), tar, "tar").assert_ok();
    let image = push_checkpoint_image(&e, &archive, CONTAINER, &c.registry);
    let restores = driver_restores(&e);
    let refused = Pod::apply_with(
        &c.cp,
        a,
        "w",
        &image,
        Workload::Counter,
        "w",
        &Extras::default(),
    );
    assert_refused(&e, &refused, &expected, 0, restores, &bystander);
}

/// A checkpoint of another CPU architecture: a CUDA pod checkpointed through the kubelet on
/// node a, its archive made into one of arm64 ([`archive_dumped_on`]) and into a checkpoint image
/// whose configuration says `linux/arm64`, as buildah makes it on an arm64 node; the same
/// manifest with that image applied on node b of `runtime`, where a bystander runs. The pod is
/// refused as `expected` shows through `kubectl`: the plugin refuses at its start, naming both
/// architectures, before CRIU forks any task (CRIU's own check would come after). Nothing of
/// it runs, the driver is not asked to restore, the bystander counts on, and CRIU's log on
/// node b says why (the runtime must keep it).
pub fn another_cpu_architecture(test: &str, runtime: &Runtime, expected: &Refusal<'_>) {
    let Some(e) = start(test, CUDA) else {
        return;
    };
    let c = Cluster::start(&e, CUDA, &[("a", runtime), ("b", runtime)]);
    let b = &c.nodes[1];
    let bystander = c.bystander(b);
    let images = c.images();
    let pod = Pod::create(&c.cp, &c.nodes[0], "w", &images.workload, CUDA, "w");
    let k = c.checkpoint_and_delete(&pod);
    let arm64 = e.dir().join("checkpoint-arm64.tar");
    archive_dumped_on(&k.archive, &arm64, MARCH_AARCH64);
    let image = push_checkpoint_image_for(&e, &arm64, CONTAINER, &c.registry, Some("arm64"));
    let restores = driver_restores(&e);
    let refused = Pod::apply_restored(&c.cp, b, &pod, &image);
    assert_refused(&e, &refused, expected, k.marks.2, restores, &bystander);
    let log = b
        .kept_restore_log()
        .expect("CRIU's log of the refused restore");
    let want = "the checkpoint was made on aarch64 (core-1.img) and this machine is x86_64";
    assert!(log.has(want), "no `{want}` in CRIU's log: {log:?}");
    assert!(!log.has("Forking task"), "CRIU forked tasks: {log:?}");
}
