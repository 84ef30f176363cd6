//! GPU containers as a GPU node makes them, for tests/e2e_cri.rs: a node with stand-in GPUs and
//! their CDI spec, the kubelet's GPU request (CDI devices or an annotation), and what a
//! container given a GPU must see.

use std::path::{Path, PathBuf};

use cri_client::v1;

use super::super::cdi::{NVIDIA_MAJOR, NvidiaCdi, StandInGpu, rdev_of, workload_gpus};
use super::super::engines::ContainerdBins;
use super::super::{etc_criu_loading_plugin, fake_cuda, fake_cuda_env, tool_2026};
use super::{CriContainer, CriNode, Images, Registry, calls, push_images};
use crate::common::{self, E2e};

/// runc 1.4 of today's runtimes.
pub fn runc_1_4() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_RUNC2", "bin/runc")
}

/// How the kubelet hands the runtime a container's GPU, as the NVIDIA device plugin's two CDI
/// strategies have it: `cdi-cri` (the CRI's `CDIDevices`) or `cdi-annotations` (an annotation
/// `cdi.k8s.io/nvidia-device-plugin_<id>` naming the device).
#[derive(Clone, Copy, Debug)]
pub enum GpuBy {
    CdiDevices,
    Annotation,
}

/// Node A with two stand-in GPUs (`containers_support::cdi`), its CDI spec where the node's
/// CRI reads CDI specs, the plugin's settings for them, and the test images in `registry`;
/// CRIU's restores work in `criu_work` if given (runc's `CriuWorkPath`).
pub fn gpu_node<'e>(
    e: &'e E2e,
    registry: &Registry,
    criu_work: Option<&Path>,
) -> (CriNode<'e>, NvidiaCdi) {
    let f = fake_cuda();
    let cdi = NvidiaCdi::new(
        &e.dir().join("nvidia"),
        &f.gpus(e, 2),
        vec![(f.libcuda.clone(), "/gpu/libcuda.so.1".into())],
    );
    let etc = etc_criu_loading_plugin(e, "runc.conf");
    cdi.write_plugin_settings(f, &etc.join("gpu-plugin.conf"));
    let mut env = fake_cuda_env(&calls(e));
    env.push(("FAKE_CUDA_GPUS", cdi.gpus.len().to_string().into()));
    let n = CriNode::start(
        e,
        "node-a",
        &etc,
        &env,
        ContainerdBins::v2026(runc_1_4()),
        registry,
        Images::of(registry),
        criu_work,
    );
    push_images(e, &n.cd, &n.images);
    let spec = cdi.write_spec(&n.cdi_spec_dir());
    eprintln!("CDI spec {}", spec.display());
    (n, cdi)
}

/// The kubelet's additions to a stand-in CUDA container's configuration for CDI device
/// `nvidia.com/gpu=<device>` passed `by`, and the workload's environment on the stand-in GPUs.
pub fn gpu_request<'a>(
    cdi: &'a NvidiaCdi,
    device: &'a str,
    by: GpuBy,
) -> impl Fn(&mut v1::ContainerConfig) + 'a {
    move |c| {
        c.envs.extend(
            cdi.workload_env()
                .iter()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| cri_client::env(k, v)),
        );
        let name = format!("nvidia.com/gpu={device}");
        match by {
            GpuBy::CdiDevices => c.cdi_devices.push(v1::CdiDevice { name }),
            GpuBy::Annotation => {
                c.annotations
                    .insert("cdi.k8s.io/nvidia-device-plugin_w".into(), name);
            }
        }
    }
}

/// The rules of `pid`'s device cgroup (cgroup v1 `devices.list`; `None` on v2, where they are
/// an eBPF program).
pub fn device_cgroup_rules(pid: i32) -> Option<Vec<String>> {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let path = cg.lines().find_map(|l| l.split_once(":devices:"))?.1;
    let list =
        std::fs::read_to_string(format!("/sys/fs/cgroup/devices{path}/devices.list")).ok()?;
    Some(list.lines().map(str::to_string).collect())
}

/// A running container given GPU `gpu` alone by the CDI spec: its workload runs on it, its
/// `/dev` has the GPU's node and the control nodes and (unless `restored`) no other GPU's, its
/// device cgroup allows its GPU only, the driver's library is bind-mounted, the spec's
/// environment is set and its `createContainer` hooks ran.
pub fn assert_given_gpu(c: &CriContainer<'_>, cdi: &NvidiaCdi, gpu: &StandInGpu, restored: bool) {
    let pid = c.running_pid();
    assert_eq!(
        workload_gpus(&c.out.dir),
        [(gpu.uuid.clone(), gpu.index)],
        "the GPUs of the workload of a container given GPU {}",
        gpu.index
    );
    let dev = PathBuf::from(format!("/proc/{pid}/root/dev"));
    assert_eq!(
        rdev_of(&dev.join(format!("nvidia{}", gpu.index))),
        (NVIDIA_MAJOR, gpu.index)
    );
    // A restored `/dev` is the checkpoint's, with the old GPU's node: the device cgroup is
    // what keeps the container off it.
    for other in cdi.gpus.iter().filter(|g| g.index != gpu.index) {
        let p = dev.join(format!("nvidia{}", other.index));
        assert!(
            restored || !p.exists(),
            "{} in a container given GPU {}",
            p.display(),
            gpu.index
        );
    }
    if let Some(rules) = device_cgroup_rules(pid) {
        let rule = |minor: u32| format!("c {NVIDIA_MAJOR}:{minor} rwm");
        assert!(rules.contains(&rule(gpu.index)), "{rules:?}");
        for other in cdi.gpus.iter().filter(|g| g.index != gpu.index) {
            assert!(!rules.contains(&rule(other.index)), "{rules:?}");
        }
    }
    for n in [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia-modeset",
    ] {
        assert_eq!(
            rdev_of(&dev.join(n)),
            rdev_of(&cdi.dev_dir.join(n)),
            "/dev/{n}"
        );
    }
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    assert!(
        mounts
            .lines()
            .any(|l| l.split(' ').nth(4) == Some("/gpu/libcuda.so.1")),
        "the spec's library mount is not in the container: {mounts}"
    );
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
    assert!(
        common::bytes_contain(&environ, b"NVIDIA_VISIBLE_DEVICES=void"),
        "the spec's environment is not the container's"
    );
    let hooks = std::fs::read_to_string(&cdi.hook_log).unwrap_or_default();
    assert!(
        hooks.contains("update-ldcache") && hooks.contains("create-symlinks"),
        "the CDI spec's createContainer hooks did not run: {hooks:?}"
    );
}

/// The driver's restore calls so far (for every process).
pub fn driver_restores(e: &E2e) -> usize {
    std::fs::read_to_string(calls(e))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("restore "))
        .count()
}
