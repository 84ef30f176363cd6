//! Today's runtimes beside the Debian 12 ones of `tests/e2e_containers.rs`, from
//! `scripts/install-runtimes-2026.sh` (`<repo>/.runtimes-2026`), each against the real CRIU of
//! `CRIU_BIN` with the plugin. Environment variables name other programs:
//!
//! | variable | default (under `.runtimes-2026/`) | what |
//! |---|---|---|
//! | `CRIU_GPU_TEST_CONTAINERD2` | `bin/containerd` | containerd 2.1 (its shim found beside it) |
//! | `CRIU_GPU_TEST_CTR2` | `bin/ctr` | containerd 2.1's ctr |
//! | `CRIU_GPU_TEST_RUNC2` | `bin/runc` | runc 1.4 |
//! | `CRIU_GPU_TEST_RUNC13` | `runc-1.3/runc` | runc 1.3 |
//! | `CRIU_GPU_TEST_CRUN2` | `bin/crun` | crun 1.28 |
//! | `CRIU_GPU_TEST_PODMAN2` | `bin/podman` | Podman 5.8 |
//! | `CRIU_GPU_TEST_PODMAN61` | `podman-6.1/podman` | Podman 6.1 |
//! | `CRIU_GPU_TEST_CONMON2` | `bin/conmon` | conmon 2.1 |
//! | `CRIU_GPU_TEST_CHECKPOINTCTL2` | `bin/checkpointctl` | checkpointctl 1.3 |
//! | `CRIU_GPU_TEST_DOCKERD2` | `bin/dockerd` | dockerd 28.5 (finds containerd and runc beside it) |
//! | `CRIU_GPU_TEST_DOCKER2` | `bin/docker` | docker 28.5's client |
//! | `CRIU_GPU_TEST_BUILDAH2` | `bin/buildah` | buildah 1.43 |
//! | `CRIU_GPU_TEST_SKOPEO2` | `bin/skopeo` | skopeo 1.22 |
//!
//! Every runtime command runs as in `tests/e2e_containers.rs` (private mount namespace with the
//! test's `/etc/criu`, state under the test's directory, the CRIU of `CRIU_BIN` first on
//! `PATH`); the plugin is reached through `/etc/criu/runc.conf` (runc, containerd, Podman,
//! docker) or `/etc/criu/crun.conf` (crun 1.28 hands CRIU that file when it exists).
//!
//! - containerd 2.1 with runc 1.4 and with runc 1.3, a plain container (busybox counter) and one
//!   running the stand-in CUDA workload: `ctr task checkpoint` (the task keeps running, with its
//!   GPU), `ctr container checkpoint --task --rw`, the container removed, `ctr container restore
//!   --live --rw`, and the workload goes on where it was, its device memory recreated and
//!   checked. containerd freezes the task's cgroup around a checkpoint, which CRIU before 4.2
//!   does not thaw for plugins: with CRIU 4.1 the CUDA case is skipped, saying so
//!   (`tests/e2e_containers.rs` checks the plugin's refusal there).
//! - runc 1.4 and 1.3 driven directly: `runc checkpoint` (the container goes) and `runc
//!   restore`; runc 1.4 also `checkpoint --leave-running` and a restore of that image.
//! - Podman 5.8 with conmon and runc 1.4: `container checkpoint --export`, checkpointctl reads
//!   the archive, `rm`, `container restore --import`.
//! - Podman 6.1 the same, on a cgroup-v2-only system: Podman 6 refuses cgroup v1, and this
//!   host's hierarchy is hybrid, so its commands (and the runc and CRIU under them) see
//!   `/sys/fs/cgroup` as a cgroup2 mount of their own mount namespace
//!   ([`containers_support::PrivateMounts::cgroup2_only`]).
//! - crun 1.28: checkpoint and restore, only ever as pid 1 of a pid namespace of the test's own:
//!   on some cgroup v1 and hybrid hosts crun's restore SIGKILLs every process it can see
//!   (`docs/crun-restore-kills.md`). The test runs itself again in a new pid namespace, every
//!   crun command refuses to run outside it (and, on a host known to trigger that, anywhere),
//!   and a bystander process there makes the test fail, naming the step, if it is killed.
//! - docker 28.5 (`dockerd --experimental`, its own data-root, exec-root and socket, its own
//!   containerd): `docker checkpoint create`, `docker start --checkpoint` of a plain container.
//! - buildah 1.43 and skopeo 1.22 run (`--version`), for turning checkpoint archives into images.

use criu_gpu_test_support as common;
#[allow(dead_code)]
mod containers_support;

use std::path::PathBuf;

use common::E2e;
use containers_support::docker::{Docker, DockerBins};
use containers_support::engines::{Containerd, ContainerdBins, Podman, PodmanBins};
use containers_support::oci::{Oci, OciRuntime};
use containers_support::pidns::{Bystander, rerun_in_own_pid_namespace};
use containers_support::{
    CUDA, PrivateMounts, Workload, assert_plugin_dumped, assert_plugin_restored, cycles, etc_criu,
    fake_cuda_env, needs_criu_4_2, run_tool, tool_2026, version_line,
};

fn calls(e: &E2e) -> PathBuf {
    e.dir().join("cuda-calls")
}

fn runc_1_4() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_RUNC2", "bin/runc")
}

fn runc_1_3() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_RUNC13", "runc-1.3/runc")
}

fn crun_1_28() -> PathBuf {
    tool_2026("CRIU_GPU_TEST_CRUN2", "bin/crun")
}

// ---- containerd 2.1 -----------------------------------------------------------------------

fn containerd2_cycle(test: &str, runc: fn() -> PathBuf, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let why = "containerd needs for a CUDA container (it freezes the task's cgroup around the \
               checkpoint; CRIU 4.1 does not thaw it for plugins)";
    if needs_criu_4_2(&e, test, workload, why) {
        return;
    }
    let bins = ContainerdBins::v2026(runc());
    eprintln!("{test}: {}", bins.versions());
    let etc_criu = etc_criu(&e, workload, "runc.conf");
    let cd = Containerd::start_with(&e, &etc_criu, &fake_cuda_env(&calls(&e)), bins);
    cd.import_image();
    let c = cd.start_container("c", workload);
    let pid = c.running_pid();
    let files = workload.is_cuda().then(|| cycles::device_memory(&c.out));

    // `ctr task checkpoint` keeps CRIU's log (in its work path) and leaves the task running.
    let dump = c.task_checkpoint(&e.images("task-img"), &e.dir().join("task-dump"));
    assert_plugin_dumped(&e, &dump, workload, pid);
    assert_eq!(c.running_pid(), pid, "the task after its checkpoint");
    c.out.assert_given_back(files.as_ref(), &calls(&e), pid);

    // The container's checkpoint image (the task keeps running), the container gone, restored.
    c.checkpoint_remove_restore("localhost/criu-gpu-e2e-checkpoint:2026", files, &calls(&e));
}

#[test]
fn containerd2_runc14_counter_checkpoint_and_restore() {
    containerd2_cycle("containerd2-counter", runc_1_4, Workload::Counter);
}

/// Needs CRIU 4.2 or newer; skipped, saying so, with 4.1.
#[test]
fn containerd2_runc14_cuda_checkpoint_and_restore() {
    containerd2_cycle("containerd2-cuda", runc_1_4, CUDA);
}

#[test]
fn containerd2_runc13_counter_checkpoint_and_restore() {
    containerd2_cycle("containerd2-runc13-counter", runc_1_3, Workload::Counter);
}

/// Needs CRIU 4.2 or newer; skipped, saying so, with 4.1.
#[test]
fn containerd2_runc13_cuda_checkpoint_and_restore() {
    containerd2_cycle("containerd2-runc13-cuda", runc_1_3, CUDA);
}

// ---- runc 1.4 and 1.3 directly ------------------------------------------------------------

/// runc `bin` with the plugin through the test's `/etc/criu/runc.conf`, the plugin's settings
/// there (runc passes its environment to CRIU, the fake driver's part of it included).
fn runc_2026<'e>(e: &'e E2e, bin: PathBuf, workload: Workload) -> OciRuntime<'e> {
    let etc = etc_criu(e, workload, "runc.conf");
    let mut rt = OciRuntime::with_program(
        e,
        Oci::Runc,
        bin,
        PrivateMounts::new().bind(etc, "/etc/criu"),
    );
    for (k, v) in fake_cuda_env(&calls(e)) {
        rt = rt.env(k, v);
    }
    let rt = rt.unset("CRIU_GPU_PLUGIN_CONFIG");
    eprintln!("{}", rt.version());
    rt
}

fn runc_cycle(test: &str, runc: fn() -> PathBuf, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let rt = runc_2026(&e, runc(), workload);
    cycles::oci_checkpoint_restore(&e, &rt, workload, &[], "c", &calls(&e), &|_| {});
}

#[test]
fn runc14_counter_checkpoint_and_restore() {
    runc_cycle("runc14-counter", runc_1_4, Workload::Counter);
}

#[test]
fn runc14_cuda_checkpoint_and_restore() {
    runc_cycle("runc14-cuda", runc_1_4, CUDA);
}

#[test]
fn runc13_counter_checkpoint_and_restore() {
    runc_cycle("runc13-counter", runc_1_3, Workload::Counter);
}

#[test]
fn runc13_cuda_checkpoint_and_restore() {
    runc_cycle("runc13-cuda", runc_1_3, CUDA);
}

fn runc_leave_running(test: &str, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let rt = runc_2026(&e, runc_1_4(), workload);
    cycles::oci_leave_running_restore(&e, &rt, workload, &[], &calls(&e), &|_| {});
}

#[test]
fn runc14_counter_leave_running_and_restore() {
    runc_leave_running("runc14-counter-leave-running", Workload::Counter);
}

#[test]
fn runc14_cuda_leave_running_and_restore() {
    runc_leave_running("runc14-cuda-leave-running", CUDA);
}

// ---- Podman 5.8 ---------------------------------------------------------------------------

fn podman_cycle(test: &str, workload: Workload, bins: PodmanBins) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let etc = etc_criu(&e, workload, "runc.conf");
    eprintln!("{test}: {}", bins.versions());
    let cgroup2_only = bins.cgroup2_only;
    let pm = Podman::with_bins(&e, &etc, bins);
    if cgroup2_only {
        let info = pm.run(&["info", "--format", "{{.Host.CgroupsVersion}}"]);
        info.assert_ok();
        assert_eq!(info.stdout.trim(), "v2", "Podman's cgroup version");
    }
    let checkpointctl = tool_2026("CRIU_GPU_TEST_CHECKPOINTCTL2", "bin/checkpointctl");
    cycles::podman_export_import(&e, &pm, workload, &checkpointctl);
}

#[test]
fn podman58_counter_export_and_import() {
    let bins = PodmanBins::v2026(runc_1_4());
    podman_cycle("podman58-counter", Workload::Counter, bins);
}

#[test]
fn podman58_cuda_export_and_import() {
    podman_cycle("podman58-cuda", CUDA, PodmanBins::v2026(runc_1_4()));
}

// ---- Podman 6.1, cgroup v2 only -----------------------------------------------------------

#[test]
fn podman61_cgroup2_counter_export_and_import() {
    let bins = PodmanBins::v6_1(runc_1_4());
    podman_cycle("podman61-cgroup2-counter", Workload::Counter, bins);
}

#[test]
fn podman61_cgroup2_cuda_export_and_import() {
    podman_cycle("podman61-cgroup2-cuda", CUDA, PodmanBins::v6_1(runc_1_4()));
}

// ---- crun 1.28, in a pid namespace of the test's own ---------------------------------------

/// Runs the whole test as pid 1 of a new pid namespace (see the top): checkpoint, restore,
/// removal of the restored container, a bystander process checked after each.
fn crun128_cycle(test: &str, name: &str, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    if rerun_in_own_pid_namespace(&e, name) {
        return;
    }
    let etc = etc_criu(&e, workload, "crun.conf");
    let mut rt = OciRuntime::with_program(
        &e,
        Oci::Crun,
        crun_1_28(),
        PrivateMounts::new().bind(etc, "/etc/criu"),
    )
    .only_in_own_pid_namespace()
    .unset("CRIU_GPU_PLUGIN_CONFIG");
    for (k, v) in fake_cuda_env(&calls(&e)) {
        rt = rt.env(k, v);
    }
    eprintln!("{test}: {}", rt.version());
    let bystander = Bystander::start(&e);
    cycles::oci_checkpoint_restore(&e, &rt, workload, &[], "c", &calls(&e), &|step| {
        bystander.assert_alive(step)
    });
    bystander.assert_alive("end of the test");
}

#[test]
fn crun128_counter_checkpoint_and_restore_in_own_pid_namespace() {
    crun128_cycle(
        "crun128-counter",
        "crun128_counter_checkpoint_and_restore_in_own_pid_namespace",
        Workload::Counter,
    );
}

#[test]
fn crun128_cuda_checkpoint_and_restore_in_own_pid_namespace() {
    crun128_cycle(
        "crun128-cuda",
        "crun128_cuda_checkpoint_and_restore_in_own_pid_namespace",
        CUDA,
    );
}

// ---- docker 28.5 -------------------------------------------------------------------------

/// `docker checkpoint create` (the container stops), `docker start --checkpoint`: the counter
/// goes on where it was.
#[test]
fn docker28_counter_checkpoint_and_start() {
    let Some(e) = E2e::start("docker28-counter") else {
        return;
    };
    let workload = Workload::Counter;
    let etc = etc_criu(&e, workload, "runc.conf");
    let bins = DockerBins::v2026();
    eprintln!("docker28-counter: {}", version_line(&bins.dockerd));
    let dk = Docker::start(&e, &etc, bins);
    dk.import_image();
    let c = dk.start_container("counter", workload);
    let pid = c.running_pid();

    let dump = c.checkpoint("ck", &e.dir().join("dump.log"));
    assert_plugin_dumped(&e, &dump, workload, pid);
    c.wait_stopped();
    containers_support::wait_gone(pid, "the checkpointed container's init");
    let mark = c.out.mark();

    let restore = c.start_from("ck", &e.dir().join("restore.log"));
    assert_plugin_restored(&e, &restore, workload);
    c.running_pid();
    c.out.assert_continues(mark);
}

// ---- buildah and skopeo -------------------------------------------------------------------

/// buildah and skopeo of the prefix run (nothing here uses them yet beyond that).
#[test]
fn buildah_and_skopeo_run() {
    let Some(e) = E2e::start("buildah-skopeo") else {
        return;
    };
    for (var, rel, want) in [
        (
            "CRIU_GPU_TEST_BUILDAH2",
            "bin/buildah",
            "buildah version 1.43.",
        ),
        (
            "CRIU_GPU_TEST_SKOPEO2",
            "bin/skopeo",
            "skopeo version 1.22.",
        ),
    ] {
        let bin = tool_2026(var, rel);
        let mut cmd = e.command(&bin);
        cmd.arg("--version");
        let run = run_tool(e.dir(), cmd, &format!("{} --version", bin.display()));
        run.assert_ok();
        assert!(run.stdout.starts_with(want), "{run:?}");
    }
}
