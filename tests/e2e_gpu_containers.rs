//! GPU containers as a GPU node makes them, checkpointed and restored onto another GPU with no
//! device map written by hand: runc 1.4 (`<repo>/.runtimes-2026`, `CRIU_GPU_TEST_RUNC2`) with
//! the CRIU under test and the stand-in CUDA driver, on a host of two stand-in GPUs
//! (`containers_support::cdi`: device nodes, a `/proc/driver/nvidia/gpus` listing with device
//! minors, a CDI spec as the NVIDIA Container Toolkit writes it).
//!
//! The container is created with the OCI edits CDI gives for `nvidia.com/gpu=0` (its `/dev`
//! holds `nvidia0`, its device cgroup allows 195:0 only) and checkpointed; the stand-in driver
//! sees only GPU 0 in it, as the real one does. Then:
//! - restored into a container given `nvidia.com/gpu=1`'s edits only: runc runs CRIU in the new
//!   container's cgroup, the plugin finds GPU 1 the only one it can reach, maps GPU 0 onto it,
//!   gives the restored `/dev` (which CRIU brings back from the checkpoint, with `nvidia0`) the
//!   node `nvidia1`, and the workload goes on, on GPU 1 (the stand-in driver records the GPU it
//!   was restored on, having opened its node inside the container);
//! - restored into a container given no GPU: refused at the plugin's `init`, before CRIU forks
//!   any task, naming the checkpointed GPU and why no GPU here can be reached;
//! - restored into a container given GPU 1 while the plugin cannot tie GPUs to device nodes (a
//!   listing without device minors): every GPU then counts as reachable, GPU 0 restores onto
//!   itself, and the driver's restore fails inside the container (its device cgroup refuses
//!   195:0, as it did the field reports' restores), so the restored tree is ended;
//! - restored from a CDI spec whose library mount has a host path that is a symlink (as NVIDIA's
//!   specs can have: `docs/kubernetes.md`): CRIU's default mount engine fails while it rebuilds
//!   the mounts, the driver not asked (runc hands CRIU the link, CRIU binds the link itself), on
//!   every CRIU release; restored with `mntns-compat-mode` given to CRIU for that restore, it
//!   goes on with its GPU state; a dump given that option is refused by CRIU and the container
//!   runs on. Pinned here as the behaviour of runc and CRIU the docs describe: if a release
//!   changes it, the docs must too.

use criu_gpu_test_support as common;
#[allow(dead_code)]
mod containers_support;

use std::path::Path;

use common::E2e;
use containers_support::cdi::{
    NvidiaCdi, OciEdits, assert_refused_without_gpu, rdev_of, workload_gpus,
};
use containers_support::oci::{Oci, OciContainer, OciRuntime};
use containers_support::{
    CUDA, PrivateMounts, assert_plugin_dumped, assert_plugin_restored, etc_criu_loading_plugin,
    fake_cuda, fake_cuda_env, tool_2026, transitions,
};

/// Where the restored container is put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// Given `nvidia.com/gpu=1` only.
    OtherGpu,
    /// Given no GPU.
    NoGpu,
    /// Given `nvidia.com/gpu=1`, with a GPU listing that has no device minors.
    OtherGpuUnknownMinors,
    /// Given `nvidia.com/gpu=0` again, from a spec that mounts a library by a symlinked path.
    SymlinkedHostPath,
}

fn gpu_container_cycle(test: &str, target: Target) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let f = fake_cuda();
    let mut libcuda = f.libcuda.clone();
    if target == Target::SymlinkedHostPath {
        let link = e.dir().join("libcuda-link.so.1");
        std::os::unix::fs::symlink(&f.libcuda, &link).expect("symlink to libcuda");
        libcuda = link;
    }
    let cdi = NvidiaCdi::new(
        &e.dir().join("nvidia"),
        &f.gpus(&e, 2),
        vec![(libcuda, "/gpu/libcuda.so.1".into())],
    );
    let spec = cdi.write_spec(&e.dir().join("etc-cdi"));
    let (gpu0, gpu1) = (&cdi.gpus[0], &cdi.gpus[1]);

    let etc_criu = etc_criu_loading_plugin(&e, "runc.conf");
    cdi.write_plugin_settings(f, &etc_criu.join("gpu-plugin.conf"));
    let calls = e.dir().join("cuda-calls");
    let mut rt = OciRuntime::with_program(
        &e,
        Oci::Runc,
        tool_2026("CRIU_GPU_TEST_RUNC2", "bin/runc"),
        PrivateMounts::new().bind(&etc_criu, "/etc/criu"),
    )
    .unset("CRIU_GPU_PLUGIN_CONFIG")
    .env("FAKE_CUDA_GPUS", "2");
    // CRIU reads the file CRIU_CONFIG_FILE names where it exists: written for one restore.
    let criu_conf = e.dir().join("criu-restore.conf");
    if target == Target::SymlinkedHostPath {
        rt = rt.env("CRIU_CONFIG_FILE", &criu_conf);
    }
    for (k, v) in fake_cuda_env(&calls) {
        rt = rt.env(k, v);
    }

    let mut on_gpu0 = cdi.oci_edits(&["0"]);
    on_gpu0.env.extend(cdi.workload_env());
    let c = rt.start_with("gpu", CUDA, &[], &on_gpu0, None);
    let pid = c.pid();
    assert_eq!(
        workload_gpus(&c.out.dir),
        [(gpu0.uuid.clone(), 0)],
        "the workload of a container given GPU 0 (CDI spec {})",
        spec.display()
    );
    let hooks = std::fs::read_to_string(&cdi.hook_log).unwrap_or_default();
    assert!(
        hooks.contains("update-ldcache") && hooks.contains("create-symlinks"),
        "the CDI spec's createContainer hooks did not run: {hooks:?}"
    );

    let images = e.images("gpu-img");
    let dump = c.checkpoint(&images, &e.dir().join("gpu-dump"), false);
    assert_plugin_dumped(&e, &dump, CUDA, pid);
    c.assert_gone(pid);
    let md = std::fs::read_to_string(images.join("gpu-plugin-cuda.img")).expect("metadata");
    assert!(
        md.contains(&gpu0.uuid) && !md.contains(&gpu1.uuid),
        "the image must record the container's GPU only: {md}"
    );
    let mark = c.out.mark();
    if target == Target::OtherGpuUnknownMinors {
        cdi.hide_minors();
    }

    let work = e.dir().join("gpu-restore");
    match target {
        Target::OtherGpuUnknownMinors => {
            let mut on_gpu1 = cdi.oci_edits(&["1"]);
            on_gpu1.env.extend(cdi.workload_env());
            c.respec(&on_gpu1);
            let restore = c.restore(&images, &work);
            restore.assert_failed();
            assert!(
                restore.has("CUDA_ERROR_NOT_SUPPORTED"),
                "the driver's restore must fail in a container that cannot open GPU 0: {restore:?}"
            );
            assert!(
                !restore.has("restores onto"),
                "no GPU map without device minors: {restore:?}"
            );
            let restores: Vec<String> = std::fs::read_to_string(&calls)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with("restore "))
                .map(str::to_string)
                .collect();
            assert!(
                restores.len() == 1 && restores[0].ends_with("result=801"),
                "{restores:?}"
            );
            assert_eq!(c.state(), None, "runc kept a container after the failure");
        }
        Target::OtherGpu => {
            let mut on_gpu1 = cdi.oci_edits(&[&gpu1.uuid]);
            on_gpu1.env.extend(cdi.workload_env());
            c.respec(&on_gpu1);
            let restore = c.restore(&images, &work);
            assert_plugin_restored(&e, &restore, CUDA);
            assert!(
                restore.has(&format!("GPU {} restores onto {}", gpu0.uuid, gpu1.uuid)),
                "{restore:?}"
            );
            assert!(restore.has("made /dev/nvidia1 (195:1"), "{restore:?}");
            let restored = c.pid();
            c.out.assert_continues(mark);
            assert_eq!(
                workload_gpus(&c.out.dir),
                [(gpu1.uuid.clone(), 1)],
                "the workload after its restore into a container given GPU 1"
            );
            assert_eq!(
                transitions(&calls, restored),
                ["restore=0", "unlock=0"],
                "driver calls of the restore"
            );
            assert_eq!(
                rdev_of(Path::new(&format!("/proc/{restored}/root/dev/nvidia1"))),
                (195, 1)
            );
            c.out.verify(restored);
        }
        Target::SymlinkedHostPath => {
            let restore = c.restore(&images, &work);
            restore.assert_failed();
            assert!(
                restore.has("with MS_PRIVATE: Invalid argument"),
                "CRIU's default mount engine restored a bind mount of a symlinked host path; \
                 docs/kubernetes.md and README say it cannot: {restore:?}"
            );
            assert_restored_nothing(&c, &calls, mark, "failure");

            std::fs::write(&criu_conf, "mntns-compat-mode\n").expect("CRIU configuration");
            let restore = c.restore(&images, &e.dir().join("gpu-restore-compat"));
            assert_plugin_restored(&e, &restore, CUDA);
            let restored = c.pid();
            c.out.assert_continues(mark);
            c.out.verify(restored);

            let dump = c.checkpoint(
                &e.images("gpu-img-compat"),
                &e.dir().join("gpu-dump-compat"),
                true,
            );
            dump.assert_failed();
            assert!(
                dump.has("Option --mntns-compat-mode is only valid on restore"),
                "{dump:?}"
            );
            assert_eq!(c.pid(), restored, "the container after the refused dump");
            c.out.verify(restored);
        }
        Target::NoGpu => {
            let mut no_gpu = OciEdits::no_devices();
            no_gpu.env.extend(cdi.workload_env());
            c.respec(&no_gpu);
            let restore = c.restore(&images, &work);
            restore.assert_failed();
            assert_refused_without_gpu(&restore, &gpu0.uuid);
            assert_restored_nothing(&c, &calls, mark, "refusal");
        }
    }
}

/// After a restore that ended in a `what` before the workload ran again: runc keeps no
/// container, the driver was never asked to restore, and the workload wrote nothing since
/// `mark`.
fn assert_restored_nothing(c: &OciContainer<'_>, calls: &Path, mark: usize, what: &str) {
    assert_eq!(c.state(), None, "runc kept a container after the {what}");
    assert!(
        !std::fs::read_to_string(calls)
            .unwrap_or_default()
            .lines()
            .any(|l| l.starts_with("restore ")),
        "the driver was asked to restore"
    );
    assert_eq!(c.out.mark(), mark, "the workload ran after the {what}");
}

#[test]
fn runc14_cuda_container_restored_onto_the_gpu_its_new_spec_gives() {
    gpu_container_cycle("gpu-container-other-gpu", Target::OtherGpu);
}

#[test]
fn runc14_cuda_container_restored_onto_an_unmapped_gpu_fails_in_the_driver() {
    gpu_container_cycle(
        "gpu-container-unknown-minors",
        Target::OtherGpuUnknownMinors,
    );
}

#[test]
fn runc14_cuda_container_restored_without_a_gpu_is_refused_before_any_task() {
    gpu_container_cycle("gpu-container-no-gpu", Target::NoGpu);
}

#[test]
fn runc14_cuda_container_with_a_symlinked_cdi_host_path_restores_only_in_compat_mode() {
    gpu_container_cycle("gpu-container-symlink", Target::SymlinkedHostPath);
}
