//! Failure paths of AMD dumps on the KFD simulator: every failed dump leaves the process
//! running (queues unpaused) with nothing leaked. Failed restores and hostile images are in
//! `amdgpu_restore_failures.rs`.

#[path = "amdgpu_support/mod.rs"]
mod support;

use std::os::fd::AsFd;

use criu_gpu_core::amdgpu::AmdgpuBackend;
use criu_gpu_core::amdgpu::image::HEADER_LEN;
use criu_gpu_core::backend::{GpuBackend, HookHandler};
use criu_plugin::{HookError, HostVersion, InventoryListing, Stage};
use kfd_sim::{Fault, Faults, SimKfd};
use support::*;

/// Runs a dump of one process with `faults` injected; returns the DUMP_EXT_FILE result of the
/// KFD file (and DUMP_DEVICES_LATE's when the files went through), then ends the dump as
/// CRIU does (exit with the result) and checks that the process runs and nothing leaked.
fn failing_dump(faults: Faults, quota: Option<u64>) -> (Result<(), HookError>, SimKfd) {
    let (topo, sim) = fixture_sim("2gpu");
    let pid = 100;
    let p = spawn(&sim, &failure_spec(pid));
    let images = TempDir::new("fail");
    let cfg = config(
        &topo,
        "amdgpu.copy-threads = 3\namdgpu.max-buffer-size = 1M\n",
    );
    let mut b = backend_with(&sim, images.path(), quota);
    init_ok(
        &mut b,
        &cfg,
        HostVersion::Dev,
        InventoryListing::NoList,
        Stage::Dump,
    );
    sim.set_faults(faults);
    let r = dump_files(&mut b, &sim, &[&p], 1)
        .map(|_| ())
        .and_then(|()| b.dump_devices_late(pid as i32));
    b.exit(Stage::Dump, if r.is_ok() { 0 } else { -1 });
    let v = sim.process(pid).unwrap();
    assert!(!v.paused, "queues still evicted after {r:?}: {v:?}");
    assert_eq!(v.evictions, 0);
    assert_no_leaks(&sim, p.render.len(), 1);
    (r, sim)
}

/// A simulator running the process `failing_dump` dumps, to learn its layout.
fn probe() -> SimKfd {
    let (_, probe) = fixture_sim("2gpu");
    drop(probe.spawn(&failure_spec(100)).unwrap());
    probe
}

#[test]
fn process_info_failure_fails_the_dump_and_leaves_the_process_running() {
    let (r, _) = failing_dump(
        faults(|f| f.process_info = Some(Fault::always(libc::ENOMEM))),
        None,
    );
    assert_eq!(r, Err(HookError::logged(libc::ENOMEM)));
}

#[test]
fn checkpoint_failure_unpauses() {
    let (r, _) = failing_dump(
        faults(|f| f.checkpoint = Some(Fault::once(libc::EFAULT))),
        None,
    );
    assert_eq!(r, Err(HookError::logged(libc::EFAULT)));
}

#[test]
fn checkpoint_failing_after_exporting_dmabufs_leaks_nothing() {
    let (r, _) = failing_dump(
        faults(|f| f.checkpoint_after_dmabufs = Some((5, libc::EMFILE))),
        None,
    );
    assert_eq!(r, Err(HookError::logged(libc::EMFILE)));
}

#[test]
fn a_bo_read_failure_mid_copy_unpauses_and_closes_everything() {
    // The address of a BO in the middle of the process's BO list.
    let probe = probe();
    let addr = content_addr(&probe, 100, 17);
    let (r, _) = failing_dump(faults(|f| f.download_at = Some((addr, libc::EIO))), None);
    assert_eq!(r, Err(HookError::logged(libc::EIO)));
}

#[test]
fn sdma_failures_fail_the_dump_and_leave_the_process_running() {
    for (faults, errno) in [
        // The command submission refused by the kernel.
        (
            faults(|f| f.sdma_submit = Some(Fault::once(libc::ENOMEM))),
            libc::ENOMEM,
        ),
        // Staging memory that cannot be registered with the GPU (#1927's "Device or
        // resource busy").
        (
            faults(|f| f.userptr = Some(Fault::always(libc::EBUSY))),
            libc::EBUSY,
        ),
        // GPU work that never completes: the wait gives up instead of hanging CRIU.
        (faults(|f| f.sdma_hang = true), libc::ETIMEDOUT),
    ] {
        let (r, _) = failing_dump(faults, None);
        assert_eq!(r, Err(HookError::logged(errno)));
    }
}

#[test]
fn a_full_disk_during_image_writes_unpauses() {
    // 3 MiB fit; the process has about 20 MiB of contents.
    let (r, _) = failing_dump(Faults::default(), Some(3 << 20));
    assert_eq!(r, Err(HookError::logged(libc::ENOSPC)));
    // The same with room for the contents but not the KFD image: the last write fails.
    let probe = probe();
    let contents = probe.content_bytes(100);
    let (r, _) = failing_dump(
        Faults::default(),
        Some(contents + 2 * HEADER_LEN as u64 + 100),
    );
    assert_eq!(r, Err(HookError::logged(libc::ENOSPC)));
}

#[test]
fn an_unpause_failure_is_retried_at_exit() {
    let (r, _) = failing_dump(faults(|f| f.unpause = Some(Fault::once(libc::EBUSY))), None);
    assert_eq!(r, Err(HookError::logged(libc::EIO)));
}

/// Two processes on the two-GPU machine and a dump of them begun on a criu-dev host.
fn dump_of_two(pids: [u32; 2], tag: &str) -> (SimKfd, [Proc; 2], TempDir, AmdgpuBackend) {
    let (topo, sim) = fixture_sim("2gpu");
    let procs = pids.map(|pid| spawn(&sim, &failure_spec(pid)));
    let images = TempDir::new(tag);
    let b = dump_backend(&sim, images.path(), &config(&topo, ""));
    (sim, procs, images, b)
}

#[test]
fn every_process_is_unpaused_even_when_one_unpause_fails() {
    let (sim, [a, b2], _images, mut b) = dump_of_two([201, 202], "unpause");
    dump_files(&mut b, &sim, &[&a, &b2], 1).unwrap();
    // The first UNPAUSE fails for good: the C plugin stopped there and left the second
    // process evicted too.
    sim.update_faults(|f| f.unpause = Some(Fault::once(libc::EBUSY)));
    assert_eq!(b.dump_devices_late(201), Err(HookError::logged(libc::EIO)));
    let paused: Vec<bool> = [201, 202]
        .iter()
        .map(|&p| sim.process(p).unwrap().paused)
        .collect();
    assert_eq!(paused, vec![true, false]);
    // exit retries.
    b.exit(Stage::Dump, -1);
    assert!(!sim.process(201).unwrap().paused);
    assert_no_leaks(&sim, a.render.len() + b2.render.len(), 2);
}

#[test]
fn a_failure_in_a_later_process_unpauses_the_earlier_ones() {
    let (sim, [a, c], _images, mut b) = dump_of_two([301, 302], "later");
    dump_files(&mut b, &sim, &[&a], 1).unwrap();
    let addr = content_addr(&sim, 302, 3);
    sim.update_faults(|f| f.download_at = Some((addr, libc::EIO)));
    assert!(dump_files(&mut b, &sim, &[&c], 10).is_err());
    // The failed one is running already; the first still waits for CRIU's verdict.
    assert!(!sim.process(302).unwrap().paused);
    assert!(sim.process(301).unwrap().paused);
    b.exit(Stage::Dump, -1);
    assert!(!sim.process(301).unwrap().paused);
    assert_no_leaks(&sim, a.render.len() + c.render.len(), 2);
}

#[test]
fn render_node_gem_bos_fail_the_dump_instead_of_being_lost() {
    let (topo, sim) = fixture_sim("2gpu");
    let pid = 120;
    let p = spawn(&sim, &failure_spec(pid));
    // A buffer allocated through the process's render node, not through KFD.
    sim.alloc_render_bo(p.render[1].1.as_fd(), 1 << 20).unwrap();
    let images = TempDir::new("gem");
    let cfg = config(&topo, "");
    let e = refused_dump(&sim, &[&p], images.path(), &cfg);
    assert_eq!(e, HookError::logged(libc::EOPNOTSUPP));
    assert!(!sim.process(pid).unwrap().paused);
    assert_eq!(sim.open_fds("dmabuf"), 0);

    // A kernel that cannot list them (before 6.18): the dump goes on, as it must there.
    let sim = SimKfd::from_sysfs(&topo).unwrap();
    sim.update_faults(|f| f.no_gem_list = true);
    let p = spawn(&sim, &failure_spec(pid));
    sim.alloc_render_bo(p.render[1].1.as_fd(), 1 << 20).unwrap();
    let images = TempDir::new("gem-old");
    dump(&sim, &[&p], images.path(), &cfg);
    assert!(!sim.process(pid).unwrap().paused);
}

/// A bad AMD setting keeps its default and fails only what needs AMD: the dump of a KFD
/// process is refused (its queues running), its restore too; `init` itself succeeds.
#[test]
fn a_bad_amd_setting_fails_only_runs_that_need_amd() {
    let (topo, sim) = fixture_sim("2gpu");
    let pid = 130;
    let p = spawn(&sim, &failure_spec(pid));
    let good = TempDir::new("bad-setting-good");
    dump(&sim, &[&p], good.path(), &config(&topo, ""));
    for bad in [
        "amdgpu.copy-threads = x\n",
        "amdgpu.copy-threads = 0\n",
        "amdgpu.max-buffer-size = lots\n",
        "amdgpu.chunk-size = 99999999999999999999\n",
        "amdgpu.parallel-restore = maybe\n",
    ] {
        let cfg = config(&topo, bad);
        let images = TempDir::new("bad-setting");
        let e = refused_dump(&sim, &[&p], images.path(), &cfg);
        assert_eq!(e, HookError::logged(libc::EINVAL), "{bad}");
        assert!(!sim.process(pid).unwrap().paused, "{bad}");

        let sim2 = SimKfd::from_sysfs(&topo).unwrap();
        let mut r = backend(&sim2, good.path());
        assert_eq!(
            r.init(
                &ctx(&cfg, HostVersion::Dev, InventoryListing::Listed),
                Stage::Restore
            ),
            Err(HookError::logged(libc::EINVAL)),
            "{bad}"
        );
        // An image that does not need AMD restores whatever the AMD settings say.
        let plain = TempDir::new("bad-setting-plain");
        let mut r = backend(&sim2, plain.path());
        assert_eq!(
            r.init(
                &ctx(&cfg, HostVersion::Dev, InventoryListing::NotListed),
                Stage::Restore
            ),
            Ok(false),
            "{bad}"
        );
    }
}

/// CRIU 4.3's `DUMP_FINISH` with a non-zero result (a failing post-dump script): the GPU queues
/// run again before the tasks are released, and a second call changes nothing.
#[test]
fn dump_finish_after_a_failure_restarts_the_queues() {
    let (topo, sim) = fixture_sim("2gpu");
    let pid = 140;
    let p = spawn(&sim, &failure_spec(pid));
    let images = TempDir::new("dump-finish");
    let mut b = dump_backend(&sim, images.path(), &config(&topo, ""));
    dump_files(&mut b, &sim, &[&p], 1).expect("dump");
    assert!(sim.process(pid).unwrap().paused);
    assert_eq!(b.dump_finish(0), Err(HookError::NotMine));
    assert!(sim.process(pid).unwrap().paused, "ret 0 is no rollback");
    assert_eq!(b.dump_finish(1), Ok(()));
    assert!(!sim.process(pid).unwrap().paused);
    assert_eq!(b.dump_finish(1), Err(HookError::NotMine));
    b.exit(Stage::Dump, 0);
    assert!(!sim.process(pid).unwrap().paused);
}
