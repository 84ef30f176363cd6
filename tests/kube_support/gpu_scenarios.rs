//! The *another GPU* scenarios: nodes with two stand-in GPUs in their CDI specs, each node's
//! stand-in device plugin ([`KubeNode::start_device_plugin`]) giving pods one of them as
//! NVIDIA's device plugin does (by UUID, as a CDI name or in an annotation); a CUDA pod
//! checkpointed on node a with GPU 0 and restored on node b, where GPU 1 is given, or no GPU,
//! or where the runtime or the plugin refuses the restore ([`Asks`] says what the restored pod
//! asks for).
//!
//! [`KubeNode::start_device_plugin`]: super::node::KubeNode::start_device_plugin

use super::pods::{Extras, Pod};
use super::runtimes::Runtime;
use super::scenarios::{Checkpointed, Cluster, Refusal, assert_refused, start};
use crate::common::E2e;
use crate::containers_support::cdi::{
    NvidiaCdi, StandInGpu, assert_refused_without_gpu, workload_gpus,
};
use crate::containers_support::cri::gpu_node::driver_restores;
use crate::containers_support::cri::{archive_member, calls};
use crate::containers_support::{CUDA, etc_criu_settings, fake_cuda, fake_cuda_env};

/// How a node's device plugin names the GPU it gives a pod (NVIDIA's
/// `--device-list-strategy`).
#[derive(Clone, Copy, Debug)]
pub enum GivenBy {
    /// `cdi-cri`: the GPU's CDI name, which the kubelet puts in the request's CDI devices.
    CdiName,
    /// `cdi-annotations`: a `cdi.k8s.io/` annotation naming the GPU, which the kubelet puts
    /// among the container's annotations.
    CdiAnnotation,
}

/// Which of the stand-in GPUs each node's CDI spec lists.
#[derive(Clone, Copy, Debug)]
pub enum Specs {
    /// Both, on every node: a node's spec has the GPU its device plugin offers and the other
    /// node's (as where the two nodes are one machine's).
    BothGpus,
    /// The GPU its device plugin offers only (as on two machines, whose GPUs' UUIDs differ).
    OwnGpuOnly,
}

/// How the nodes of a cluster with the stand-in GPUs hand them out.
#[derive(Clone, Copy, Debug)]
pub struct GpuNodes {
    pub by: GivenBy,
    pub specs: Specs,
}

impl GpuNodes {
    /// NVIDIA's device plugin with `--device-list-strategy=cdi-cri`, each node's CDI spec
    /// listing both GPUs.
    pub const CDI_NAMES: GpuNodes = GpuNodes {
        by: GivenBy::CdiName,
        specs: Specs::BothGpus,
    };
}

impl<'e> Cluster<'e> {
    /// A cluster whose nodes have two stand-in GPUs: each node's CDI spec lists them as
    /// `gpus.specs` says (as `nvidia-ctk cdi generate` would), the plugin's settings name them,
    /// and the stand-in CUDA driver models them. Pods get a GPU from a node's device plugin
    /// ([`KubeNode::start_device_plugin`]), which on the first node offers GPU 0 and on the
    /// second GPU 1, naming it as `gpus.by` says: [`gpu_extras`] asks for one.
    pub fn start_with_gpus(
        e: &'e E2e,
        nodes: &[(&str, &Runtime)],
        gpus: GpuNodes,
    ) -> (Cluster<'e>, NvidiaCdi) {
        let GpuNodes { by, specs } = gpus;
        let f = fake_cuda();
        let cdi = NvidiaCdi::new(
            &e.dir().join("nvidia"),
            &f.gpus(e, 2),
            vec![(f.libcuda.clone(), "/gpu/libcuda.so.1".into())],
        );
        let etc = etc_criu_settings(e, CUDA, "runc.conf");
        cdi.write_plugin_settings(f, &etc.join("gpu-plugin.conf"));
        let mut env = fake_cuda_env(&calls(e));
        env.push(("FAKE_CUDA_GPUS", cdi.gpus.len().to_string().into()));
        let mut c = Cluster::start_configured(e, nodes, true, &etc, &vec![env; nodes.len()]);
        for (node, gpu) in c.nodes.iter_mut().zip(&cdi.gpus) {
            let listed = match specs {
                Specs::BothGpus => cdi.gpus.as_slice(),
                Specs::OwnGpuOnly => std::slice::from_ref(gpu),
            };
            cdi.write_spec_of(&node.dir.join("cdi"), listed);
            node.start_device_plugin(&c.cp, "nvidia.com/gpu", &[offered(gpu, by)]);
        }
        (c, cdi)
    }
}

/// What a pod's manifest has to get one GPU from a node's device plugin, and the environment
/// the stand-in CUDA workload needs on the stand-in GPUs.
pub fn gpu_extras(cdi: &NvidiaCdi) -> Extras {
    Extras {
        env: cdi.workload_env().to_vec(),
        limits: vec![("nvidia.com/gpu".into(), "1".into())],
        ..Extras::default()
    }
}

/// The device a node's stand-in device plugin offers for `gpu`, named as NVIDIA's plugin
/// names it: by UUID, as a CDI device or in an annotation (whose key NVIDIA's plugin makes
/// from a response ID).
fn offered(gpu: &StandInGpu, by: GivenBy) -> String {
    let name = format!("nvidia.com/gpu={}", gpu.uuid);
    match by {
        GivenBy::CdiName => format!("gpu{}=cdi:{name}", gpu.index),
        GivenBy::CdiAnnotation => format!(
            "gpu{i}=annotation:cdi.k8s.io/nvidia-device-plugin_gpu{i}={name}",
            i = gpu.index
        ),
    }
}

/// On a cluster of nodes a and b of `runtime` with the stand-in GPUs: a CUDA pod asking for
/// one GPU on node a, given GPU 0 by a's device plugin, checkpointed through the kubelet (the
/// image records GPU 0 only), its checkpoint image pushed, and deleted.
pub fn checkpoint_on_gpu0<'c, 'e>(
    e: &E2e,
    c: &'c Cluster<'e>,
    cdi: &NvidiaCdi,
) -> (Pod<'c, 'e>, Checkpointed) {
    let (gpu0, gpu1) = (&cdi.gpus[0], &cdi.gpus[1]);
    let a = &c.nodes[0];
    let pod = Pod::create_with(
        &c.cp,
        a,
        "w",
        &c.images().workload,
        CUDA,
        "w",
        &gpu_extras(cdi),
    );
    assert_eq!(
        workload_gpus(&pod.out.dir),
        [(gpu0.uuid.clone(), gpu0.index)],
        "the GPUs of the pod given GPU 0"
    );
    let k = c.checkpoint_and_delete(&pod);
    let md = archive_member(e, &k.archive, "checkpoint/gpu-plugin-cuda.img");
    assert!(
        md.contains(&gpu0.uuid) && !md.contains(&gpu1.uuid),
        "the image must record the pod's GPU only: {md}"
    );
    (pod, k)
}

/// *Another GPU*: node a's device plugin offers GPU 0, node b's GPU 1. A CUDA pod asking for
/// one GPU runs on a with GPU 0 and is checkpointed through the kubelet; the same manifest
/// with the checkpoint image, created on b, is given GPU 1 by b's device plugin (a CDI
/// device): the plugin restores the checkpoint's GPU onto it with no map written, and the
/// workload goes on there with its device memory.
pub fn restore_onto_another_gpu(test: &str, runtime: &Runtime) {
    let Some(e) = start(test, CUDA) else {
        return;
    };
    let nodes = [("a", runtime), ("b", runtime)];
    let (c, cdi) = Cluster::start_with_gpus(&e, &nodes, GpuNodes::CDI_NAMES);
    let (pod, k) = checkpoint_on_gpu0(&e, &c, &cdi);
    let (gpu0, gpu1) = (&cdi.gpus[0], &cdi.gpus[1]);
    let b = &c.nodes[1];
    let restored = Pod::create_restored(&c.cp, b, &pod, &k.image);
    let new_pid = restored.pid(b);
    let log = b.restore_log(&restored.container_id());
    let want = format!("GPU {} restores onto {}", gpu0.uuid, gpu1.uuid);
    assert!(log.has(&want), "no `{want}` in CRIU's log: {log:?}");
    let (low, high, killed) = k.marks;
    restored.out.assert_resumes_between(low, high, killed);
    let files = k.files.expect("a CUDA pod's device memory");
    restored
        .out
        .assert_gpu_restored(&files, &calls(&e), new_pid);
    assert_eq!(
        workload_gpus(&restored.out.dir),
        [(gpu1.uuid.clone(), gpu1.index)],
        "the GPUs of the restored pod, given GPU 1"
    );
}

/// Who refuses a restore on node b.
pub enum RefusedBy {
    /// The plugin, at its start in CRIU's restore: CRIU's log on the node names the
    /// checkpoint's GPU (the runtime must keep it).
    Plugin,
    /// The plugin, and the pod's message in `kubectl` names the checkpoint's GPU too (CRI-O
    /// quotes CRIU's log in its error).
    PluginNamedInKubectl,
    /// The runtime, before CRIU runs: CRI-O restores only where each bind mount of the
    /// checkpoint is in the request, and a CDI device's mounts are not (the kubelet asks for
    /// the device by its CDI name).
    Runtime,
    /// The runtime, before CRIU runs, and the pod's message in `kubectl` names the
    /// checkpoint's GPU (CRI-O injecting a CDI device node b lacks).
    RuntimeNamingTheGpu,
}

/// What the manifest of the pod restored on node b asks for.
pub enum Asks {
    /// No GPU.
    NoGpu,
    /// One GPU, as the checkpointed pod did: node b's device plugin gives GPU 1.
    OneGpu,
    /// One GPU, and the driver files of the node's CDI spec as `hostPath` volumes at the
    /// paths CDI mounts them (what CRI-O's check of the request's mounts wants).
    OneGpuAndDriverFiles,
}

impl Asks {
    /// The extras of a pod made again from `old`'s manifest that asks for this.
    pub fn extras(&self, old: &Pod<'_, '_>, cdi: &NvidiaCdi) -> Extras {
        match self {
            Asks::NoGpu => Extras {
                limits: Vec::new(),
                ..old.extras.clone()
            },
            Asks::OneGpu => old.extras.clone(),
            Asks::OneGpuAndDriverFiles => Extras {
                host_files: cdi.libraries.clone(),
                ..old.extras.clone()
            },
        }
    }
}

/// The checkpoint of [`restore_onto_another_gpu`] restored on node b from a manifest that
/// `asks` for no GPU or one: refused as `expected` shows through `kubectl`, `by` the plugin or
/// the runtime, before CRIU makes any task; the driver is not asked to restore, the
/// checkpoint's workload does not run, node b's other pod runs on. With containerd the plugin
/// refuses a pod given no GPU, and what `kubectl` shows is containerd's: runc's error carries
/// CRIU's errno only, and containerd copies a container's output only once its restore
/// succeeded (the plugin's line on CRIU's standard error is lost with it); the reason is in
/// CRIU's log on the node, which runc keeps where `CriuWorkPath` points.
pub fn restore_refused_on_b(
    test: &str,
    runtime: &Runtime,
    asks: Asks,
    expected: &Refusal<'_>,
    by: RefusedBy,
) {
    restore_refused_on_b_of(test, runtime, GpuNodes::CDI_NAMES, asks, expected, by);
}

/// [`restore_refused_on_b`] on nodes that hand out the stand-in GPUs as `gpus` says.
pub fn restore_refused_on_b_of(
    test: &str,
    runtime: &Runtime,
    gpus: GpuNodes,
    asks: Asks,
    expected: &Refusal<'_>,
    by: RefusedBy,
) {
    let Some(e) = start(test, CUDA) else {
        return;
    };
    let nodes = [("a", runtime), ("b", runtime)];
    let (c, cdi) = Cluster::start_with_gpus(&e, &nodes, gpus);
    let (pod, k) = checkpoint_on_gpu0(&e, &c, &cdi);
    let b = &c.nodes[1];
    let bystander = c.bystander(b);
    let restores = driver_restores(&e);
    let refused = Pod::apply_restored_with(&c.cp, b, &pod, &k.image, &asks.extras(&pod, &cdi));
    let message = assert_refused(&e, &refused, expected, k.marks.2, restores, &bystander);
    let gpu0 = &cdi.gpus[0].uuid;
    if let RefusedBy::Plugin | RefusedBy::PluginNamedInKubectl = by {
        let log = b
            .kept_restore_log()
            .expect("CRIU's log of the refused restore");
        assert_refused_without_gpu(&log, gpu0);
    }
    let named = match by {
        RefusedBy::PluginNamedInKubectl => Some(format!("checkpointed GPU {gpu0}")),
        RefusedBy::RuntimeNamingTheGpu => Some(format!("nvidia.com/gpu={gpu0}")),
        RefusedBy::Plugin | RefusedBy::Runtime => None,
    };
    if let Some(named) = named {
        assert!(
            message.contains(&named),
            "the pod's message does not name the checkpoint's GPU ({named}): {message}"
        );
    }
}
