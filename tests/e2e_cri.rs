//! The Kubernetes checkpoint path: the CRI calls the kubelet makes, to containerd 2.1 (its CRI
//! plugin, its runc shim) with runc 1.4, which runs the real CRIU, which runs the plugin
//! (reached through `/etc/criu/runc.conf` of the daemon's private mount namespace, as a node's
//! configuration would have it).
//!
//! What the kubelet does for `POST /checkpoint/{namespace}/{pod}/{container}`: the runtime's
//! `CheckpointContainer` with a location and a timeout; the container keeps running and the
//! archive holds CRIU's images (the plugin's among them), `dump.log`, the container's
//! configuration and its root file system's changes. A restore is a new container whose image
//! is the archive: `CreateContainer` with the archive's path as the image, `StartContainer`.
//!
//! Programs: containerd, its shim, runc 1.4 and 1.3 and buildah from
//! `scripts/install-runtimes-2026.sh` (`CRIU_GPU_TEST_CONTAINERD2`, `CRIU_GPU_TEST_CTR2`,
//! `CRIU_GPU_TEST_RUNC2`, `CRIU_GPU_TEST_RUNC13`, `CRIU_GPU_TEST_BUILDAH2` name others), the
//! registry from `scripts/install-registry.sh` (`CRIU_GPU_TEST_REGISTRY`), checkpointctl from
//! `scripts/install-runtimes.sh`, `criu-gpu` from this workspace (built when missing). The CRI
//! client is `tools/cri-client` (why not crictl: see its crate documentation).
//!
//! GPU containers as a GPU node makes them: containerd's CRI applies the NVIDIA CDI spec itself
//! (`enable_cdi`, the node's `cdi_spec_dirs`) for a GPU given in `CDIDevices` or by a device
//! plugin's `cdi.k8s.io/` annotation; a restore into a pod given another GPU goes onto it, and
//! one whose container has no GPU (containerd 2.1.9 drops CDI annotations at restore) is refused
//! before any task runs (`docs/gpu-containers.md`).
//!
//! containerd freezes the container's cgroup around a checkpoint, which CRIU before 4.2 does
//! not thaw for plugins: with CRIU 4.1 the CUDA cases are skipped, saying so.

use criu_gpu_test_support as common;
#[allow(dead_code)]
mod containers_support;

use std::path::PathBuf;
use std::time::Duration;

use common::{CriuRun, E2e, wait_until};
use containers_support::cdi::assert_refused_without_gpu;
use containers_support::cri::gpu_node::{
    GpuBy, assert_given_gpu, driver_restores, gpu_node, gpu_request, runc_1_4,
};
use containers_support::cri::{
    CHECKPOINT_TIMEOUT, CriContainer, CriNode, Images, Registry, archive_member, assert_archive,
    calls, cgroup_tree_pids, freezer_state, push_checkpoint_image, push_images, restore_from,
    restore_from_with,
};
use containers_support::engines::ContainerdBins;
use containers_support::{
    CUDA, Output, Workload, cycles, etc_criu, fake_cuda_env, lacks_cgroup2_controllers,
    needs_criu_4_2, tool_2026, transitions,
};
use cri_client::v1;

fn runc_1_3() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_RUNC13", "runc-1.3/runc")
}

/// The test, or `None` (and a SKIPPED line) where it cannot run.
fn start(test: &str, workload: Workload) -> Option<E2e> {
    let e = E2e::start(test)?;
    let why = "containerd needs for a CUDA container (it freezes the container's cgroup around \
               the checkpoint; CRIU 4.1 does not thaw it for plugins)";
    (!needs_criu_4_2(&e, test, workload, why)).then_some(e)
}

/// Node `name` of `bins` pulling from `registry`, the test images pushed there once (by the
/// first node).
fn node<'e>(
    e: &'e E2e,
    name: &str,
    workload: Workload,
    bins: ContainerdBins,
    registry: &Registry,
    push: bool,
) -> CriNode<'e> {
    let images = Images::of(registry);
    let etc = etc_criu(e, workload, "runc.conf");
    let n = CriNode::start(
        e,
        name,
        &etc,
        &fake_cuda_env(&calls(e)),
        bins,
        registry,
        images,
        None,
    );
    if push {
        push_images(e, &n.cd, &n.images);
    }
    n
}

fn cri_cycle(test: &str, workload: Workload, bins: ContainerdBins) {
    let Some(e) = start(test, workload) else {
        return;
    };
    eprintln!("{test}: {}", bins.versions());
    let registry = Registry::start(&e);
    let n = node(&e, "node-a", workload, bins, &registry, true);
    let pod = n.run_pod("pod-a");
    let c = n.start_container(&pod, "w", workload);
    let pid = c.running_pid();
    let files = workload.is_cuda().then(|| cycles::device_memory(&c.out));

    // The kubelet's checkpoint: the container keeps running, with its GPU.
    let archive = e.dir().join("checkpoint-w.tar");
    let (low, high) = c.kubelet_checkpoint(&archive, files.as_ref());
    assert_archive(&n, &archive, workload, pid);

    // Restored as a new container of the same pod, then as one of a new pod.
    let image = archive.to_str().expect("UTF-8 path");
    let r = restore_from(
        &n,
        &pod,
        "w-restored",
        image,
        &c,
        (low, high),
        files.as_ref(),
    );
    let pod_b = n.run_pod("pod-b");
    let _r2 = restore_from(&n, &pod_b, "w", image, &r, (low, high), files.as_ref());
}

#[test]
fn cri_containerd21_runc14_counter() {
    cri_cycle(
        "cri-counter",
        Workload::Counter,
        ContainerdBins::v2026(runc_1_4()),
    );
}

/// Needs CRIU 4.2 or newer; skipped, saying so, with 4.1.
#[test]
fn cri_containerd21_runc14_cuda() {
    cri_cycle("cri-cuda", CUDA, ContainerdBins::v2026(runc_1_4()));
}

/// runc 1.3 (Debian sid's) under the same containerd.
#[test]
fn cri_containerd21_runc13_cuda() {
    cri_cycle("cri-runc13-cuda", CUDA, ContainerdBins::v2026(runc_1_3()));
}

/// On a cgroup-v2-only system (containerd 2 deprecates v1): the daemon, its shims, runc and
/// CRIU see `/sys/fs/cgroup` as a cgroup2 mount.
#[test]
fn cri_containerd21_runc14_cgroup2_cuda() {
    let test = "cri-cgroup2-cuda";
    let why = "containerd's CRI gives every pod sandbox a cpu.weight and runc writes it; on a \
               hybrid host the v1 hierarchies hold cpu";
    if lacks_cgroup2_controllers(test, &["cpu"], why) {
        return;
    }
    let bins = ContainerdBins {
        cgroup2_only: true,
        ..ContainerdBins::v2026(runc_1_4())
    };
    cri_cycle(test, CUDA, bins);
}

/// The kubelet's timeout: a CheckpointContainer whose timeout ends before the dump can (the
/// stand-in workload holds a busy section for 8 s, so the plugin's lock waits for it).
///
/// What containerd 2.1 does, seen here: the call fails when its gRPC deadline passes (the
/// request's `timeout` field is not used), but nothing stops runc or CRIU: the dump runs to
/// its end, the plugin gives the GPU back as after any `--leave-running` dump, and the
/// archive is never written. containerd froze the container before the dump and thaws it
/// afterwards with the request's context, which has expired by then: the container is left
/// frozen (paused) by containerd, not by CRIU or the plugin. The test pins down each of those
/// facts, then resumes the task as an operator would (`ctr task resume`): the workload goes on
/// with its GPU state, and a later checkpoint with time enough works.
#[test]
fn cri_containerd21_runc14_checkpoint_timeout() {
    let workload = Workload::Cuda { hold_ms: 8000 };
    let Some(e) = start("cri-timeout", workload) else {
        return;
    };
    let registry = Registry::start(&e);
    let n = node(
        &e,
        "node-a",
        workload,
        ContainerdBins::v2026(runc_1_4()),
        &registry,
        true,
    );
    let pod = n.run_pod("pod-a");
    let c = n.start_container(&pod, "w", workload);
    let pid = c.running_pid();
    let files = c.out.device_files();

    assert!(common::signal(pid, libc::SIGUSR2), "SIGUSR2 to {pid}");
    c.out.wait_line("hold begin");
    let archive = e.dir().join("checkpoint-timeout.tar");
    let t0 = std::time::Instant::now();
    let err = c
        .checkpoint(&archive, Duration::from_secs(2))
        .expect_err("a checkpoint whose timeout ends before the dump");
    let took = t0.elapsed();
    eprintln!("CheckpointContainer with a 2 s timeout: {err} after {took:?}");
    assert!(
        took < Duration::from_secs(6),
        "the runtime kept the call {took:?}, past the 2 s timeout"
    );

    // The dump goes on without its caller and ends as a `--leave-running` dump does: the GPU
    // given back (the driver's last calls for it a restore and an unlock).
    wait_until("the abandoned dump to give the GPU back", || {
        transitions(&calls(&e), pid).ends_with(&["restore=0".to_string(), "unlock=0".to_string()])
    });
    wait_until("CRIU of the abandoned dump to end", || {
        !std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .any(|p| {
                std::fs::read(p.path().join("cmdline"))
                    .is_ok_and(|c| common::bytes_contain(&c, format!("-t {pid}").as_bytes()))
            })
    });
    eprintln!(
        "the abandoned dump ended {:?} after the call; driver calls for pid {pid}: {:?}",
        t0.elapsed(),
        transitions(&calls(&e), pid)
    );
    assert!(
        !archive.exists(),
        "an archive from the abandoned checkpoint"
    );
    assert_eq!(c.running_pid(), pid, "the container after the timeout");
    // containerd's thaw came too late: the container is left paused (if containerd learns to
    // thaw it, this assertion says so, and the resume below is no longer needed).
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        freezer_state(pid),
        "FROZEN",
        "containerd 2.1 leaves the container paused after a CheckpointContainer timeout"
    );
    n.cd.ctr_in("k8s.io", &["task", "resume", &c.id])
        .assert_ok();
    assert_eq!(freezer_state(pid), "THAWED");
    c.out.assert_goes_on_after_hold(&files, pid, "timeout");

    // A second checkpoint, with time enough, works.
    let low = c.out.mark();
    c.checkpoint(&archive, CHECKPOINT_TIMEOUT)
        .unwrap_or_else(|err| {
            panic!(
                "CheckpointContainer after the timeout: {err}\n{}",
                n.log_tail()
            )
        });
    let high = c.out.mark();
    assert_archive(&n, &archive, workload, pid);
    let image = archive.to_str().expect("UTF-8 path");
    restore_from(&n, &pod, "w-restored", image, &c, (low, high), Some(&files));
}

/// The migration of the seeds' demo, as on a cluster: checkpoint on node A, the archive turned
/// into an OCI image (buildah) and pushed to the registry, the container gone from node A,
/// and on node B (a second containerd: own root, state, socket) a new pod whose container's
/// image is the checkpoint image restores the workload (PullImage, CreateContainer,
/// StartContainer), with its GPU state. Then the same from the archive copied to node B.
#[test]
fn cri_containerd21_migration_to_node_b() {
    let workload = CUDA;
    let Some(e) = start("cri-migration", workload) else {
        return;
    };
    let registry = Registry::start(&e);
    let a = node(
        &e,
        "node-a",
        workload,
        ContainerdBins::v2026(runc_1_4()),
        &registry,
        true,
    );
    let b = node(
        &e,
        "node-b",
        workload,
        ContainerdBins::v2026(runc_1_4()),
        &registry,
        false,
    );
    let pod_a = a.run_pod("pod-a");
    let c = a.start_container(&pod_a, "w", workload);
    let pid = c.running_pid();
    let files = c.out.device_files();

    let archive = e.dir().join("checkpoint-w.tar");
    let low = c.out.mark();
    c.checkpoint(&archive, CHECKPOINT_TIMEOUT)
        .unwrap_or_else(|err| panic!("CheckpointContainer: {err}\n{}", a.log_tail()));
    let high = c.out.mark();
    assert_archive(&a, &archive, workload, pid);
    let reference = push_checkpoint_image(&e, &archive, "w", &registry);
    eprintln!("checkpoint image: {reference}");

    // Node B: the image pulled as any image is, then a container created from it.
    let pod_b = b.run_pod("pod-b");
    b.cri
        .pull_image(&reference, &pod_b.1)
        .unwrap_or_else(|err| panic!("PullImage {reference}: {err}\n{}", b.log_tail()));
    let r = restore_from(&b, &pod_b, "w", &reference, &c, (low, high), Some(&files));

    // And from the archive itself, copied to node B's disk.
    let copied = e.dir().join("node-b-checkpoint.tar");
    std::fs::copy(&archive, &copied).expect("copy the archive");
    let image = copied.to_str().expect("UTF-8 path");
    let pod_b2 = b.run_pod("pod-b2");
    restore_from(&b, &pod_b2, "w", image, &r, (low, high), Some(&files));
}

// ---- GPU containers as a GPU node makes them: CDI applied by containerd's CRI --------------
// (the GPU node and what its containers must see: `containers_support/cri/gpu_node.rs`)

/// A stand-in CUDA container given GPU 0 through containerd's own CDI handling (the CRI's
/// `CDIDevices`), checkpointed through the CRI, and restored into a new pod given GPU 1 (by
/// UUID): the plugin maps the checkpoint's GPU 0 onto GPU 1, the only one the restored
/// container reaches, makes its node in the restored `/dev`, and the workload goes on, on GPU 1,
/// its device memory verified. No device map is written.
#[test]
fn cri_containerd21_cdi_restore_onto_the_new_pods_gpu() {
    let Some(e) = start("cri-cdi-other-gpu", CUDA) else {
        return;
    };
    let registry = Registry::start(&e);
    let (n, cdi) = gpu_node(&e, &registry, None);
    let (gpu0, gpu1) = (&cdi.gpus[0], &cdi.gpus[1]);
    let pod = n.run_pod("pod-a");
    let c = n.start_container_with(&pod, "w", CUDA, &gpu_request(&cdi, "0", GpuBy::CdiDevices));
    assert_given_gpu(&c, &cdi, gpu0, false);
    let pid = c.running_pid();
    let files = cycles::device_memory(&c.out);

    let archive = e.dir().join("checkpoint-w.tar");
    let (low, high) = c.kubelet_checkpoint(&archive, Some(&files));
    assert_archive(&n, &archive, CUDA, pid);
    let md = archive_member(&e, &archive, "checkpoint/gpu-plugin-cuda.img");
    assert!(
        md.contains(&gpu0.uuid) && !md.contains(&gpu1.uuid),
        "the image must record the container's GPU only: {md}"
    );

    let pod_b = n.run_pod("pod-b");
    let image = archive.to_str().expect("UTF-8 path");
    let on_gpu1 = gpu_request(&cdi, &gpu1.uuid, GpuBy::CdiDevices);
    let (r, restore) = restore_from_with(
        &n,
        &pod_b,
        "w",
        image,
        &c,
        (low, high),
        Some(&files),
        &on_gpu1,
    );
    for want in [
        format!("GPU {} restores onto {}", gpu0.uuid, gpu1.uuid),
        "made /dev/nvidia1 (195:1".to_string(),
    ] {
        assert!(restore.has(&want), "no `{want}` in CRIU's log: {restore:?}");
    }
    assert_given_gpu(&r, &cdi, gpu1, true);
    r.out.verify(r.running_pid());
}

/// The same container given GPU 0 by the device plugin's annotation, restored into a new pod
/// whose container is given GPU 1 by annotation too. containerd 2.1.9 builds the restored
/// container from the new CreateContainer request but takes its annotations from the
/// checkpoint, dropping every `cdi.k8s.io/` one: the restored container has no GPU. The plugin
/// refuses the restore at its `init`, before CRIU forks any task, naming the checkpoint's GPU;
/// StartContainer fails, nothing of the container runs, the driver is not called. The archive
/// lost nothing: restored into a third pod given GPU 1 through `CDIDevices`, it goes on.
///
/// The CRI's error is runc's, which carries CRIU's errno only; containerd deletes the failed
/// container's work directory, CRIU's log with it. The node keeps CRIU's restore logs in
/// runc's `CriuWorkPath`, which is where the refusal is read.
#[test]
fn cri_containerd21_cdi_restore_without_a_gpu_is_refused() {
    let Some(e) = start("cri-cdi-no-gpu", CUDA) else {
        return;
    };
    let registry = Registry::start(&e);
    let criu_work = e.dir().join("criu-work");
    std::fs::create_dir_all(&criu_work).expect("CRIU's work directory");
    let (n, cdi) = gpu_node(&e, &registry, Some(&criu_work));
    let (gpu0, gpu1) = (&cdi.gpus[0], &cdi.gpus[1]);
    let pod = n.run_pod("pod-a");
    let c = n.start_container_with(
        &pod,
        "w",
        CUDA,
        &gpu_request(&cdi, &gpu0.uuid, GpuBy::Annotation),
    );
    assert_given_gpu(&c, &cdi, gpu0, false);
    let files = cycles::device_memory(&c.out);
    let archive = e.dir().join("checkpoint-w.tar");
    let (low, high) = c.kubelet_checkpoint(&archive, Some(&files));
    c.remove();
    let mark = c.out.mark();
    let restores = driver_restores(&e);

    let pod_b = n.run_pod("pod-b");
    let image = archive.to_str().expect("UTF-8 path");
    let out = Output::new(c.out.dir.clone(), CUDA);
    let id = n
        .create_from_checkpoint_with(
            &pod_b,
            "w",
            image,
            &out,
            &gpu_request(&cdi, &gpu1.uuid, GpuBy::Annotation),
        )
        .unwrap_or_else(|err| panic!("CreateContainer from {image}: {err}\n{}", n.log_tail()));
    let err = n
        .cri
        .start_container(&id)
        .expect_err("a restore into a container given no GPU")
        .to_string();
    eprintln!("StartContainer (restore into a container given no GPU): {err}");
    assert!(
        err.contains("OCI runtime restore failed"),
        "StartContainer's error: {err}"
    );
    let cd_log = std::fs::read_to_string(n.cd_log()).unwrap_or_default();
    assert!(
        cd_log.contains(r#"Denying annotation \"cdi.k8s.io/nvidia-device-plugin_w\""#),
        "containerd did not drop the checkpoint's CDI annotation: {}",
        n.log_tail()
    );
    let restore = CriuRun {
        what: "StartContainer (restore into a container given no GPU)".into(),
        code: None,
        log: std::fs::read_to_string(n.restore_log(&id)).unwrap_or_default(),
        output: err.clone(),
        took: Duration::ZERO,
    };
    assert_refused_without_gpu(&restore, &gpu0.uuid);

    // Nothing half-restored: the container is not running, no process is in its cgroup, the
    // driver was not asked to restore, the workload wrote nothing.
    let failed = CriContainer {
        node: &n,
        id: id.clone(),
        out,
    };
    let (state, pid_after) = failed.state();
    assert_eq!(
        (state, pid_after),
        (v1::ContainerState::ContainerExited, None),
        "the container whose restore was refused"
    );
    let left = cgroup_tree_pids(&format!("{}/{id}", n.pod_cgroup("pod-b")));
    assert!(
        left.is_empty(),
        "processes of the refused restore: {left:?}"
    );
    assert_eq!(
        driver_restores(&e),
        restores,
        "the driver was asked to restore"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        failed.out.mark(),
        mark,
        "the workload ran after the refusal"
    );
    n.cri
        .remove_container(&id)
        .unwrap_or_else(|err| panic!("RemoveContainer {id}: {err}"));

    // The same archive into a pod given GPU 1 the way containerd applies it at a restore.
    let pod_c = n.run_pod("pod-c");
    let out = Output::new(failed.out.dir.clone(), CUDA);
    let id = n
        .create_from_checkpoint_with(
            &pod_c,
            "w",
            image,
            &out,
            &gpu_request(&cdi, &gpu1.uuid, GpuBy::CdiDevices),
        )
        .unwrap_or_else(|err| panic!("CreateContainer from {image}: {err}\n{}", n.log_tail()));
    n.cri
        .start_container(&id)
        .unwrap_or_else(|err| panic!("StartContainer (restore): {err}\n{}", n.log_tail()));
    let r = CriContainer { node: &n, id, out };
    let restore = std::fs::read_to_string(n.restore_log(&r.id)).unwrap_or_default();
    assert!(
        restore.contains(&format!("GPU {} restores onto {}", gpu0.uuid, gpu1.uuid)),
        "{restore}"
    );
    r.out.assert_resumes_between(low, high, mark);
    r.out
        .assert_gpu_restored(&files, &calls(&e), r.running_pid());
    assert_given_gpu(&r, &cdi, gpu1, true);
}
