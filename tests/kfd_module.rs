//! Real CRIU, the release plugin and a real kernel's `/dev/kfd`: the stand-in KFD module
//! (`tests/kfd_module/`, `docs/kfd-module.md`) in the test guest (`scripts/guest/`).
//!
//! The workload (`tests/kfd_module/workload.c`) maps its BOs through the render nodes at
//! their GPU addresses and its doorbells and MMIO pages through `/dev/kfd`, runs a queue per
//! GPU (a counter the module advances) and gives a child process a dma-buf of one BO. The
//! test dumps and restores it: contents, addresses, doorbells, running queues and the dma-buf
//! shared both ways, and again after a restore, in parallel and onto other GPUs. The tests of
//! `kills` kill CRIU in the middle of dumps and restores of it (`docs/kfd-module.md`).
//!
//! Needs root, `CRIU_BIN`, the release plugin and `KFD_STANDIN_KO` (the module built for the
//! running kernel by `scripts/guest/build-module.sh`); `scripts/test.sh` runs it in the guest.
//! Elsewhere it says SKIPPED and passes.

#![cfg(target_arch = "x86_64")]

#[path = "amdgpu_support/mod.rs"]
mod amdgpu_support;
#[path = "kfd_module_support/mod.rs"]
mod bench;
use criu_gpu_test_support as common;
#[path = "kfd_module_support/kills.rs"]
mod kills;

use bench::{GPU0, GPU1, StandInKfd, check_restored, fd_kinds, kill_both, wait_gone};

#[test]
fn stand_in_kfd_module_under_real_criu() {
    let Some(setup) = bench::setup("kfd-module") else {
        return;
    };
    let (b, ko) = (&setup.bench, &setup.ko);
    let img = |n: &str| b.dir.path().join(n);

    let module = StandInKfd::load(ko, [GPU0, GPU1]);
    // 1. Dump and restore.
    let pids = b.start();
    let kid_before = b.status(pids.1); // the child writes its first marker
    assert_eq!(
        kid_before.get("dmabuf_pattern").map(String::as_str),
        Some("1"),
        "the child's dma-buf: {kid_before:?}"
    );
    let before = b.status(pids.0);
    assert_eq!(before["marker"], kid_before["dmabuf_marker_written"]);
    let fds_start = fd_kinds(pids.0);
    b.dump(pids.0, &img("one"), false);
    b.restore(&img("one"), pids, &[]);
    check_restored(b, pids, &before, [GPU0, GPU1], "restore");
    println!("kfd_module: dump and restore: contents, addresses, doorbells, dma-buf: ok");
    let fds_one = fd_kinds(pids.0);

    // 2. The restored workload dumped again, left running, and restored from that image.
    let before = b.status(pids.0);
    b.dump(pids.0, &img("two"), true);
    // The image holds the state at the dump (`before`), not what the check changes.
    check_restored(b, pids, &before, [GPU0, GPU1], "left running");
    kill_both(pids);
    b.restore(&img("two"), pids, &[]);
    check_restored(b, pids, &before, [GPU0, GPU1], "second restore");
    println!("kfd_module: a restored workload dumped (left running) and restored again: ok");
    // No fd the plugin used stays behind as one of the process's files (dma-bufs, render
    // nodes bound to the KFD VMs).
    let fds_two = fd_kinds(pids.0);
    assert_eq!(fds_one, fds_start, "after one restore");
    assert_eq!(fds_two, fds_start, "after two restores");
    println!("kfd_module: the parent's files before, after one restore and after two: {fds_two:?}");

    // 3. The same image restored in parallel (BO contents copied by CRIU's main process).
    // CRIU before 4.2 has no POST_FORKING hook: the plugin then restores in each task and
    // says so.
    kill_both(pids);
    let log = b.restore(
        &img("two"),
        pids,
        &[("CRIU_GPU_AMDGPU_PARALLEL_RESTORE", "true")],
    );
    let mode = log
        .lines()
        .find_map(|l| l.split_once("parallel restore ").map(|(_, m)| m.trim()))
        .unwrap_or("(not logged)");
    check_restored(b, pids, &before, [GPU0, GPU1], "parallel restore");
    println!("kfd_module: restore with parallel restore asked for (the plugin: {mode}): ok");

    // 4. Onto other GPUs, the other way round: the module loaded again with other ids.
    kill_both(pids);
    wait_gone(&[pids.0, pids.1]);
    drop(module);
    let _module = StandInKfd::load(ko, [0x1111, 0x2222]);
    let rest_topo = setup.restore_topology.path().to_str().unwrap().to_string();
    b.restore(
        &img("two"),
        pids,
        &[("CRIU_GPU_AMDGPU_TOPOLOGY", rest_topo.as_str())],
    );
    check_restored(
        b,
        pids,
        &before,
        [0x2222, 0x1111],
        "restore onto swapped GPUs",
    );
    println!("kfd_module: restore onto the GPUs swapped (0x2222, 0x1111): ok");
    kill_both(pids);
    wait_gone(&[pids.0, pids.1]);
}
