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
//! containerd freezes the container's cgroup around a checkpoint, which CRIU before 4.2 does
//! not thaw for plugins: with CRIU 4.1 the CUDA cases are skipped, saying so.

mod common;
#[allow(dead_code)]
mod containers_support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{CriuRun, E2e, wait_until};
use containers_support::cri::{
    CriContainer, CriNode, Images, Registry, archive_member, archive_members,
    push_checkpoint_image, push_images,
};
use containers_support::engines::ContainerdBins;
use containers_support::{
    CUDA, Output, Workload, assert_plugin_dumped, assert_plugin_restored, cycles, etc_criu,
    fake_cuda_env, lacks_cgroup2_controllers, needs_criu_4_2, private_tool, run_tool, tool_2026,
    tool_path, transitions,
};

fn runc_1_4() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_RUNC2", "bin/runc")
}

fn runc_1_3() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_RUNC13", "runc-1.3/runc")
}

fn calls(e: &E2e) -> PathBuf {
    e.dir().join("cuda-calls")
}

/// The kubelet's default checkpoint timeout is 4 hours; a test's dump takes seconds.
const CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(60);

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
    );
    if push {
        push_images(e, &n.cd, &n.images);
    }
    n
}

/// `criu-gpu` of this workspace, built when the test run did not build it.
fn criu_gpu() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let bin = profile_dir.join("criu-gpu");
    if !bin.is_file() {
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "--locked", "-p", "criu-gpu"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let ok = cmd.status().is_ok_and(|s| s.success());
        assert!(ok && bin.is_file(), "cannot build criu-gpu: {cmd:?}");
    }
    bin
}

/// The archive of a CRI checkpoint, read as an operator would: the plugin's image and log
/// lines are in it, and `checkpointctl show` and `criu-gpu inspect` read it.
fn assert_archive(e: &E2e, archive: &Path, workload: Workload, pid: i32) {
    let members = archive_members(e, archive);
    for want in [
        "dump.log",
        "config.dump",
        "spec.dump",
        "checkpoint/inventory.img",
    ] {
        assert!(
            members.iter().any(|m| m == want),
            "no {want} in the archive: {members:?}"
        );
    }
    let gpu_image = members
        .iter()
        .any(|m| m == "checkpoint/gpu-plugin-cuda.img");
    assert_eq!(
        gpu_image,
        workload.is_cuda(),
        "checkpoint/gpu-plugin-cuda.img in the archive: {members:?}"
    );
    let dump = CriuRun {
        what: "CheckpointContainer".into(),
        code: Some(0),
        log: archive_member(e, archive, "dump.log"),
        output: String::new(),
        took: Duration::ZERO,
    };
    assert_plugin_dumped(e, &dump, workload, pid);

    let mut cmd = e.command(&private_tool("checkpointctl"));
    cmd.arg("show")
        .arg(archive)
        .env("PATH", tool_path(e))
        .env("TMPDIR", e.dir());
    let show = run_tool(e.dir(), cmd, "checkpointctl show");
    show.assert_ok();
    assert!(
        show.stdout.contains("containerd"),
        "checkpointctl show: no engine containerd: {show:?}"
    );

    let mut cmd = e.command(&criu_gpu());
    cmd.arg("inspect").arg(archive);
    let inspect = run_tool(e.dir(), cmd, "criu-gpu inspect");
    inspect.assert_ok();
    let want = if workload.is_cuda() {
        "1 CUDA process(es)"
    } else {
        "no GPU state: CRIU restores this checkpoint without the GPU plugin"
    };
    assert!(
        inspect.stdout.contains(want),
        "criu-gpu inspect: no `{want}`: {inspect:?}"
    );
}

/// The checkpointed container removed, a new one created from `archive` in `pod` and started:
/// it must resume where the checkpoint (taken between output marks `low` and `high`) left it,
/// with its device memory for CUDA (`files`). Returns the restored container.
fn restore_from<'e>(
    n: &'e CriNode<'e>,
    pod: &(String, cri_client::v1::PodSandboxConfig),
    name: &str,
    image: &str,
    old: &CriContainer<'_>,
    (low, high): (usize, usize),
    files: Option<&Vec<String>>,
) -> CriContainer<'e> {
    old.remove();
    let killed = old.out.mark();
    let out = Output::new(old.out.dir.clone(), old.out.workload);
    let id = n
        .create_from_checkpoint(pod, name, image, &out)
        .unwrap_or_else(|err| panic!("CreateContainer from {image}: {err}\n{}", n.log_tail()));
    n.cri
        .start_container(&id)
        .unwrap_or_else(|err| panic!("StartContainer (restore): {err}\n{}", n.log_tail()));
    let c = CriContainer { node: n, id, out };
    let pid = c.running_pid();
    // CRIU's log of the restore, in the container's work directory.
    let log =
        n.e.dir()
            .join(&n.name)
            .join("root/io.containerd.runtime.v2.task/k8s.io")
            .join(&c.id)
            .join("restore.log");
    let restore = CriuRun {
        what: "StartContainer (restore)".into(),
        code: Some(0),
        log: std::fs::read_to_string(&log)
            .unwrap_or_else(|err| panic!("CRIU's restore log {}: {err}", log.display())),
        output: String::new(),
        took: Duration::ZERO,
    };
    assert_plugin_restored(n.e, &restore, c.out.workload);
    c.out.assert_resumes_between(low, high, killed);
    if let Some(files) = files {
        c.out.assert_gpu_restored(files, &calls(n.e), pid);
    }
    c
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
    let low = c.out.mark();
    c.checkpoint(&archive, CHECKPOINT_TIMEOUT)
        .unwrap_or_else(|err| panic!("CheckpointContainer: {err}\n{}", n.log_tail()));
    let high = c.out.mark();
    assert_eq!(c.running_pid(), pid, "the container after its checkpoint");
    c.out.assert_given_back(files.as_ref(), &calls(&e), pid);
    assert_archive(&e, &archive, workload, pid);

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

/// The freezer state of `pid`'s cgroup (cgroup v1 `freezer.state`, v2 `cgroup.freeze`).
fn freezer_state(pid: i32) -> String {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let v1 = cg
        .lines()
        .find_map(|l| l.split_once(":freezer:").map(|x| x.1.to_string()));
    let path = match v1 {
        Some(p) => format!("/sys/fs/cgroup/freezer{p}/freezer.state"),
        None => {
            let p = cg
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .unwrap_or("/");
            format!("/sys/fs/cgroup{p}/cgroup.freeze")
        }
    };
    match std::fs::read_to_string(&path).map(|s| s.trim().to_string()) {
        Ok(s) if s == "1" => "FROZEN".into(),
        Ok(s) if s == "0" => "THAWED".into(),
        Ok(s) => s,
        Err(err) => format!("{path}: {err}"),
    }
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
    c.out.wait_line("hold end");
    c.out.wait_counting(3);
    assert_eq!(
        c.out.device_files(),
        files,
        "device memory after the timeout"
    );
    c.out.verify(pid);

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
    assert_archive(&e, &archive, workload, pid);
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
    assert_archive(&e, &archive, workload, pid);
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
