//! The Kubernetes checkpoint path on a CRI-O node: the CRI calls the kubelet makes, to CRI-O
//! (1.36, built from its Go module by `scripts/build-upstream.sh cri-o-1.36`) with runc 1.4,
//! which runs the real CRIU, which runs the plugin. The same calls and checks as
//! `tests/e2e_cri.rs` makes of containerd (`containers_support::cri`), on a node of
//! `containers_support::crio`. Where CRI-O is not built, each test prints a SKIPPED line saying
//! how to build it, and passes.
//!
//! CRI-O's checkpoint: `CheckpointContainer` pauses the container (cgroup freezer), runs `runc
//! checkpoint --leave-running`, unpauses it, and writes the archive (CRIU's images, `dump.log`,
//! the container's configuration, its root file system's changes) to the location. A restore
//! is a new container whose image is the archive; CRI-O builds it from the checkpoint's
//! configuration, not the request's, except the bind mounts, which the request must define
//! again, and has conmon run `runc restore`.
//!
//! How CRIU finds the plugin on a CRI-O node, each tried here in CRI-O's private mount
//! namespace: `libdir` in `/etc/criu/runc.conf` (runc passes that file to CRIU), `libdir` in
//! `/etc/criu/default.conf` (CRIU reads it in runc's RPC mode too), or the plugin in CRIU's
//! built-in `/usr/lib/criu`. The plugin's settings are `/etc/criu/gpu-plugin.conf`: CRI-O does
//! not hand its own environment to runc (`containers_support::crio`), so the stand-in driver's
//! call log reaches CRIU through the runtime handler's `monitor_env`.
//!
//! CRI-O freezes the container around the checkpoint, which CRIU before 4.2 does not thaw for
//! plugins: with CRIU 4.1 the CUDA cases are skipped, saying so.

use criu_gpu_test_support as common;
#[allow(dead_code)]
mod containers_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{E2e, plugin_libdir, wait_until};
use containers_support::cri::{
    CriNode, Images, Registry, assert_archive, calls, push_checkpoint_image, restore_from,
};
use containers_support::crio::{CriO, crio_prefix, push_images};
use containers_support::{
    CUDA, PrivateMounts, Workload, cycles, etc_criu, fake_cuda_env, needs_criu_4_2, tool_2026,
    transitions, write_settings,
};

fn runc_1_4() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_RUNC2", "bin/runc")
}

/// How CRIU, run by runc for CRI-O, finds the plugin.
#[derive(Clone, Copy, Debug)]
enum Reach {
    /// `libdir` in `/etc/criu/runc.conf`.
    RuncConf,
    /// `libdir` in `/etc/criu/default.conf`.
    DefaultConf,
    /// The plugin in CRIU's built-in directory, `/usr/lib/criu`.
    DefaultDir,
}

/// The daemon's private mounts for `reach`: the test's `/etc/criu` (CRIU's configuration, the
/// plugin's settings for `workload`), and for [`Reach::DefaultDir`] the plugin's directory
/// over `/usr/lib/criu`.
fn mounts_for(e: &E2e, reach: Reach, workload: Workload) -> PrivateMounts {
    let etc = match reach {
        Reach::RuncConf => etc_criu(e, workload, "runc.conf"),
        Reach::DefaultConf => etc_criu(e, workload, "default.conf"),
        Reach::DefaultDir => {
            let dir = e.dir().join("etc-criu");
            write_settings(e, workload, &dir.join("gpu-plugin.conf"));
            dir
        }
    };
    let m = PrivateMounts::new().bind(etc, "/etc/criu");
    match reach {
        Reach::DefaultDir => m.bind(plugin_libdir(), "/usr/lib/criu"),
        _ => m,
    }
}

/// The test and CRI-O's prefix, or `None` (and a SKIPPED line) where it cannot run.
fn start(test: &str, workload: Workload) -> Option<(E2e, PathBuf)> {
    let prefix = crio_prefix(test)?;
    let e = E2e::start(test)?;
    let why = "CRI-O needs for a CUDA container (it freezes the container's cgroup around the \
               checkpoint; CRIU 4.1 does not thaw it for plugins)";
    (!needs_criu_4_2(&e, test, workload, why)).then_some((e, prefix))
}

/// Node `name`: CRI-O from `prefix` with runc 1.4, the plugin reached by `reach`, pulling from
/// `registry`, the test images pushed there.
fn node<'e>(
    e: &'e E2e,
    prefix: &Path,
    workload: Workload,
    reach: Reach,
    registry: &Registry,
) -> CriNode<'e, CriO> {
    let images = Images::of(registry);
    push_images(e, &images);
    let crio = CriO::start(
        e,
        "node-a",
        prefix,
        &runc_1_4(),
        mounts_for(e, reach, workload),
        &fake_cuda_env(&calls(e)),
        registry,
        &images,
    );
    CriNode::over(e, "node-a", crio, images, None)
}

/// The kubelet's checkpoint of a running container, then restores from the archive as a new
/// container of the same pod and as one of a new pod.
fn crio_cycle(test: &str, workload: Workload, reach: Reach) {
    let Some((e, prefix)) = start(test, workload) else {
        return;
    };
    eprintln!("{test}: plugin by {reach:?}");
    let registry = Registry::start(&e);
    let n = node(&e, &prefix, workload, reach, &registry);
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
    let t0 = Instant::now();
    let r = restore_from(
        &n,
        &pod,
        "w-restored",
        image,
        &c,
        (low, high),
        files.as_ref(),
    );
    eprintln!(
        "restore in the same pod (with the checks): {:?}",
        t0.elapsed()
    );
    let pod_b = n.run_pod("pod-b");
    let t0 = Instant::now();
    let _r2 = restore_from(&n, &pod_b, "w", image, &r, (low, high), files.as_ref());
    eprintln!("restore in a new pod (with the checks): {:?}", t0.elapsed());
}

#[test]
fn crio_runc14_counter() {
    crio_cycle("crio-counter", Workload::Counter, Reach::RuncConf);
}

/// Needs CRIU 4.2 or newer; skipped, saying so, with 4.1.
#[test]
fn crio_runc14_cuda() {
    crio_cycle("crio-cuda", CUDA, Reach::RuncConf);
}

/// The plugin by `/etc/criu/default.conf`, which CRIU reads whoever runs it.
#[test]
fn crio_runc14_cuda_default_conf() {
    crio_cycle("crio-cuda-default-conf", CUDA, Reach::DefaultConf);
}

/// The plugin where a package installs it, `/usr/lib/criu`, with no CRIU configuration.
#[test]
fn crio_runc14_cuda_usr_lib_criu() {
    crio_cycle("crio-cuda-usr-lib-criu", CUDA, Reach::DefaultDir);
}

/// Restore from an OCI checkpoint image, as on a cluster: the archive turned into an image by
/// buildah (`containers_support::cri::push_checkpoint_image`, with CRI-O's annotation
/// `io.kubernetes.cri-o.annotations.checkpoint.name`), pushed to the registry, pulled as any
/// image is (PullImage), and a new pod's container created from it; the workload goes on with
/// its GPU state.
#[test]
fn crio_runc14_cuda_from_checkpoint_image() {
    let workload = CUDA;
    let Some((e, prefix)) = start("crio-checkpoint-image", workload) else {
        return;
    };
    let registry = Registry::start(&e);
    let n = node(&e, &prefix, workload, Reach::RuncConf, &registry);
    let pod = n.run_pod("pod-a");
    let c = n.start_container(&pod, "w", workload);
    let pid = c.running_pid();
    let files = cycles::device_memory(&c.out);
    let archive = e.dir().join("checkpoint-w.tar");
    let (low, high) = c.kubelet_checkpoint(&archive, Some(&files));
    assert_archive(&n, &archive, workload, pid);
    let reference = push_checkpoint_image(&e, &archive, "w", &registry);
    eprintln!("checkpoint image: {reference}");

    let pod_b = n.run_pod("pod-b");
    n.cri
        .pull_image(&reference, &pod_b.1)
        .unwrap_or_else(|err| panic!("PullImage {reference}: {err}\n{}", n.log_tail()));
    restore_from(&n, &pod_b, "w", &reference, &c, (low, high), Some(&files));
}

/// The kubelet's timeout: a CheckpointContainer whose timeout ends before the dump can (the
/// stand-in workload holds a busy section for 8 s, so the plugin's lock waits for it).
///
/// What CRI-O does, seen here (1.36 and 1.37): the call fails when its deadline passes (CRI-O does not
/// read the request's `timeout` field), but CRI-O goes on without its caller. The dump runs to
/// its end, the plugin gives the GPU back as after any `--leave-running` dump, CRI-O thaws the
/// container and writes the archive to the location anyway. Unlike containerd 2.1 (see
/// `tests/e2e_cri.rs`) nothing is left paused. The test pins each of those facts, then restores
/// the archive the abandoned call left into a new pod: the workload goes on with its GPU state.
#[test]
fn crio_runc14_checkpoint_timeout() {
    let workload = Workload::Cuda { hold_ms: 8000 };
    let Some((e, prefix)) = start("crio-timeout", workload) else {
        return;
    };
    let registry = Registry::start(&e);
    let n = node(&e, &prefix, workload, Reach::RuncConf, &registry);
    let pod = n.run_pod("pod-a");
    let c = n.start_container(&pod, "w", workload);
    let pid = c.running_pid();
    let files = c.out.device_files();

    assert!(common::signal(pid, libc::SIGUSR2), "SIGUSR2 to {pid}");
    c.out.wait_line("hold begin");
    let archive = e.dir().join("checkpoint-timeout.tar");
    let low = c.out.mark();
    let t0 = Instant::now();
    let err = c
        .checkpoint(&archive, Duration::from_secs(2))
        .expect_err("a checkpoint whose timeout ends before the dump");
    let took = t0.elapsed();
    eprintln!("CheckpointContainer with a 2 s timeout: {err} after {took:?}");
    assert!(
        took < Duration::from_secs(6),
        "the runtime kept the call {took:?}, past the 2 s timeout"
    );
    assert!(!archive.exists(), "an archive when the call failed");

    // The dump goes on without its caller and ends as a `--leave-running` dump does.
    wait_until("the abandoned dump to give the GPU back", || {
        transitions(&calls(&e), pid).ends_with(&["restore=0".to_string(), "unlock=0".to_string()])
    });
    let high = c.out.mark();
    // CRI-O logs this once the archive is written.
    wait_until("CRI-O to write the abandoned checkpoint's archive", || {
        std::fs::read_to_string(n.cd_log()).is_ok_and(|l| l.contains("Checkpointed container"))
    });
    eprintln!(
        "the abandoned checkpoint's archive written {:?} after the call began",
        t0.elapsed()
    );
    assert_eq!(
        transitions(&calls(&e), pid),
        ["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
        "driver calls of the abandoned dump"
    );
    // Thawed: the workload counts on, with its device memory.
    assert_eq!(c.running_pid(), pid, "the container after the timeout");
    c.out.assert_goes_on_after_hold(&files, pid, "timeout");

    // The archive is a whole checkpoint: it restores.
    assert_archive(&n, &archive, workload, pid);
    let pod_b = n.run_pod("pod-b");
    let image = archive.to_str().expect("UTF-8 path");
    restore_from(&n, &pod_b, "w", image, &c, (low, high), Some(&files));
}
