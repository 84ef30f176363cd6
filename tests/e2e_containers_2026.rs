//! Today's runtimes beside the Debian 12 ones of `tests/e2e_containers.rs`: containerd 2.1 (its
//! runc shim, driven through its `ctr`) with runc 1.4, from `scripts/install-runtimes-2026.sh`
//! (`<repo>/.runtimes-2026/bin`; `CRIU_GPU_TEST_CONTAINERD2`, `CRIU_GPU_TEST_CTR2` and
//! `CRIU_GPU_TEST_RUNC2` name other programs; containerd's shim is found beside containerd).
//! Every runtime command is run as in `tests/e2e_containers.rs` (private mount namespace with
//! the test's `/etc/criu`, state under the test's directory, the CRIU of `CRIU_BIN` first on
//! `PATH`); the plugin is reached through `/etc/criu/runc.conf`.
//!
//! A plain container (busybox counter) and one running the stand-in CUDA workload: `ctr task
//! checkpoint` (the task keeps running, with its GPU), `ctr container checkpoint --task --rw`,
//! the container removed, `ctr container restore --live --rw`, and the workload goes on where
//! it was, its device memory recreated and checked. containerd freezes the task's cgroup around
//! a checkpoint, which CRIU before 4.2 does not thaw for plugins: with CRIU 4.1 the CUDA case is
//! skipped, saying so (`tests/e2e_containers.rs` checks the plugin's refusal there).

mod common;
#[allow(dead_code)]
mod containers_support;

use std::path::PathBuf;

use common::{E2e, plugin_libdir};
use containers_support::engines::{Containerd, ContainerdBins};
use containers_support::{
    CUDA, Workload, assert_plugin_dumped, fake_cuda_env, transitions, write_settings,
};

fn calls(e: &E2e) -> PathBuf {
    e.dir().join("cuda-calls")
}

fn containerd2_cycle(test: &str, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    if workload.is_cuda() && e.criu_release().is_some_and(|v| v < (4, 2)) {
        eprintln!(
            "SKIPPED {test}: CRIU {:?} is older than 4.2, which containerd needs for a CUDA \
             container (it freezes the task's cgroup around the checkpoint; CRIU 4.1 does not \
             thaw it for plugins). Run with CRIU_BIN pointing at CRIU 4.2 or newer.",
            e.criu_release()
        );
        return;
    }
    let bins = ContainerdBins::v2026();
    eprintln!("{test}: {}", bins.versions());

    let etc_criu = e.dir().join("etc-criu");
    std::fs::create_dir_all(&etc_criu).expect("etc/criu");
    std::fs::write(
        etc_criu.join("runc.conf"),
        format!("libdir {}\n", plugin_libdir().display()),
    )
    .expect("runc.conf");
    write_settings(&e, workload, &etc_criu.join("gpu-plugin.conf"));

    let cd = Containerd::start_with(&e, &etc_criu, &fake_cuda_env(&calls(&e)), bins);
    cd.import_image();
    let c = cd.start_container("c", workload);
    let pid = c.running_pid();
    let files = workload.is_cuda().then(|| {
        let f = c.out.device_files();
        assert_eq!(f.len(), 2, "counter + one chunk: {f:?}");
        f
    });

    // `ctr task checkpoint` keeps CRIU's log (in its work path) and leaves the task running.
    let dump = c.task_checkpoint(&e.images("task-img"), &e.dir().join("task-dump"));
    assert_plugin_dumped(&e, &dump, workload, pid);
    assert_eq!(c.running_pid(), pid, "the task after its checkpoint");
    c.out.wait_counting(3);
    if let Some(files) = &files {
        assert_eq!(&c.out.device_files(), files, "device memory not given back");
        assert_eq!(
            transitions(&calls(&e), pid),
            ["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
            "driver calls of the dump"
        );
        c.out.verify(pid);
    }

    // The container's checkpoint image (the task keeps running), the container gone, restored.
    c.checkpoint_remove_restore("localhost/criu-gpu-e2e-checkpoint:2026", files, &calls(&e));
}

#[test]
fn containerd2_runc14_counter_checkpoint_and_restore() {
    containerd2_cycle("containerd2-counter", Workload::Counter);
}

/// Needs CRIU 4.2 or newer; skipped, saying so, with 4.1.
#[test]
fn containerd2_runc14_cuda_checkpoint_and_restore() {
    containerd2_cycle("containerd2-cuda", CUDA);
}
