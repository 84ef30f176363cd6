//! Failure paths of AMD restores on the KFD simulator: a failed driver step is reported
//! and leaves nothing behind, a hand-over to CRIU's main process completes, and hostile
//! images fail the restore with a clear error, without panics and without unbounded
//! allocation.

#[path = "amdgpu_support/mod.rs"]
mod support;

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;

use criu_gpu_core::amdgpu::AmdgpuBackend;
use criu_gpu_core::amdgpu::image::{self, HEADER_LEN};
use criu_gpu_core::backend::{GpuBackend, HookHandler};
use criu_plugin::{HookError, HostVersion, InventoryListing, Stage};
use kfd_sim::{Fault, Faults, SimKfd};
use support::*;

/// A good dump of one process, for the restore failure tests.
fn dumped_images(pid: u32) -> (SimKfd, TempDir, Vec<Dumped>) {
    let (topo, sim) = fixture_sim("2gpu");
    let p = spawn(&sim, &failure_spec(pid));
    let images = TempDir::new("rst");
    let dumped = dump(&sim, &[&p], images.path(), &config(&topo, ""));
    (sim, images, dumped)
}

/// A backend restoring `images` on a criu-dev host into a fresh simulator with `faults`, in
/// the task `pid`, after init.
fn restore_backend(
    images: &Path,
    pid: u32,
    faults: Faults,
    parallel: bool,
) -> (SimKfd, AmdgpuBackend) {
    let (topo, sim) = fixture_sim("2gpu");
    sim.set_faults(faults);
    sim.set_current_task(pid);
    let cfg = config(
        &topo,
        if parallel {
            ""
        } else {
            "amdgpu.parallel-restore = off\n"
        },
    );
    let b = started_backend(
        &sim,
        images,
        &cfg,
        HostVersion::Dev,
        InventoryListing::Listed,
        Stage::Restore,
    );
    (sim, b)
}

/// Restores KFD file `id` from `images` into a fresh simulator with `faults`; returns
/// RESTORE_INIT's and RESTORE_EXT_FILE's results and the simulator, after exit.
fn try_restore(
    images: &Path,
    id: u32,
    pid: u32,
    faults: Faults,
    parallel: bool,
) -> (Result<(), HookError>, Result<(), HookError>, SimKfd) {
    let (sim, mut b) = restore_backend(images, pid, faults, parallel);
    let pre = b.restore_init();
    let r = b.restore_ext_file(id, None).map(|fd| {
        // SAFETY: a new fd from the hook, ours to close.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    });
    let r = r.and_then(|()| {
        b.post_forking()
            .or(Ok(()))
            .and_then(|()| b.resume_devices_late(pid as i32))
    });
    b.exit(Stage::Restore, if r.is_ok() { 0 } else { -1 });
    assert_no_leaks(&sim, 0, 0);
    (pre, r, sim)
}

#[test]
fn restore_failures_are_reported() {
    let (src, images, dumped) = dumped_images(400);
    let id = dumped[0].kfd_id;
    // The restore of the one KFD file with `faults`, without or with parallel restore:
    // RESTORE_EXT_FILE's result and the simulator.
    let restore_with = |faults: Faults, parallel: bool| {
        let (_, r, sim) = try_restore(images.path(), id, 400, faults, parallel);
        (r, sim)
    };
    // RESTORE refused by the kernel.
    let (r, sim) = restore_with(
        faults(|f| f.restore = Some(Fault::always(libc::EINVAL))),
        false,
    );
    assert_eq!(r, Err(HookError::logged(libc::EINVAL)));
    assert!(sim.process(400).is_none());
    // A render node that cannot be opened: reported, not passed on to KFD as a bad fd (as
    // the C plugin does).
    let (r, _) = restore_with(faults(|f| f.open_render = Some((129, libc::EACCES))), false);
    assert_eq!(r, Err(HookError::logged(libc::EACCES)));
    // Writing BO contents fails, in the task.
    let addr = content_addr(&src, 400, 9);
    let (r, sim) = restore_with(faults(|f| f.upload_at = Some((addr, libc::EIO))), false);
    assert_eq!(r, Err(HookError::logged(libc::EIO)));
    assert!(sim.process(400).unwrap().awaiting_resume);
    // ... and in CRIU's main process: the process is not resumed.
    let (r, sim) = restore_with(faults(|f| f.upload_at = Some((addr, libc::EIO))), true);
    assert_eq!(r, Err(HookError::logged(libc::EIO)));
    let v = sim.process(400).unwrap();
    assert!(v.awaiting_resume && v.paused && v.resumed == 0);
    // SDMA work that never completes, in the task and in CRIU's main process.
    for parallel in [false, true] {
        let (r, sim) = restore_with(faults(|f| f.sdma_hang = true), parallel);
        // CRIU's main process reports a failed hand-over as EIO at RESUME_DEVICES_LATE.
        let errno = if parallel { libc::EIO } else { libc::ETIMEDOUT };
        assert_eq!(r, Err(HookError::logged(errno)));
        assert_eq!(sim.process(400).unwrap().resumed, 0);
    }
    // RESUME refused.
    let (r, _) = restore_with(faults(|f| f.resume = Some(Fault::always(libc::EIO))), true);
    assert_eq!(r, Err(HookError::logged(libc::EIO)));
}

/// A parallel restore of a good dump of `pid`, in the task `pid`, past RESTORE_EXT_FILE: the
/// task has handed its copy over. Returns the dumped simulator, the images, the restored one
/// and the backend.
fn restore_handed_over(pid: u32) -> (SimKfd, TempDir, SimKfd, AmdgpuBackend) {
    let (src, images, dumped) = dumped_images(pid);
    let (sim, mut b) = restore_backend(images.path(), pid, Faults::default(), true);
    restore_file(&mut b, dumped[0].kfd_id);
    (src, images, sim, b)
}

#[test]
fn parallel_restore_hands_the_copy_to_the_main_process() {
    let (src, _images, sim, mut b) = restore_handed_over(410);
    // Not copied yet: the task handed it over.
    assert!(!src.compare_contents(410, &sim, 410).unwrap().is_empty());
    b.post_forking().unwrap();
    b.resume_devices_late(410).unwrap();
    assert!(src.compare_contents(410, &sim, 410).unwrap().is_empty());
    b.exit(Stage::Restore, 0);
    assert_no_leaks(&sim, 0, 0);
    // The comparison sees a single changed byte.
    sim.scribble(410, content_addr(&sim, 410, 2), 4095, &[0x5a])
        .unwrap();
    assert_eq!(
        src.compare_contents(410, &sim, 410).unwrap(),
        vec![content_addr(&sim, 410, 2)]
    );
}

/// Writes a hostile KFD image and checks that the restore fails with an error, creating
/// nothing in the kernel.
fn hostile(tag: &str, edit: impl FnOnce(&Path, u32)) {
    let (_, images, dumped) = dumped_images(500);
    let id = dumped[0].kfd_id;
    edit(images.path(), id);
    let (pre, r, sim) = try_restore(images.path(), id, 500, Faults::default(), true);
    for (hook, res) in [("RESTORE_INIT", pre), ("RESTORE_EXT_FILE", r)] {
        match res {
            Err(h) if h != HookError::NotMine => {
                let e = h.errno();
                assert!(
                    [libc::EINVAL, libc::EIO, libc::EFBIG, libc::ENODEV].contains(&e),
                    "{tag}: {hook} failed with errno {e}"
                )
            }
            other => panic!("{tag}: {hook} gave {other:?}"),
        }
    }
    assert!(
        sim.process(500).is_none(),
        "{tag}: kernel state was created"
    );
}

/// CRIU 4.1 and 4.2 call no RESTORE_INIT: a hostile image is refused by `init`, which they
/// call before forking the tasks, and a good one still restores past it.
#[test]
fn without_restore_init_hostile_images_are_refused_before_criu_forks() {
    for host in [HostVersion::V4_0, HostVersion::V4_2] {
        let (_, images, dumped) = dumped_images(500);
        let id = dumped[0].kfd_id;
        let (topo, sim) = fixture_sim("2gpu");
        let cfg = config(&topo, "");
        let mut b = backend(&sim, images.path());
        assert_eq!(
            b.init(&ctx(&cfg, host, InventoryListing::Listed), Stage::Restore),
            Ok(true),
            "{host:?}: a good image"
        );
        b.exit(Stage::Restore, -1);
        let mut out = 64usize.to_ne_bytes().to_vec();
        out.extend((0..64u8).map(|i| i.wrapping_mul(37) | 0x80));
        std::fs::write(images.path().join(image::kfd_file_name(id)), out).unwrap();
        let mut b = backend(&sim, images.path());
        match b.init(&ctx(&cfg, host, InventoryListing::Listed), Stage::Restore) {
            Err(h) if h != HookError::NotMine => {
                assert!([libc::EINVAL, libc::EIO].contains(&h.errno()), "{h:?}")
            }
            other => panic!("{host:?}: init of a hostile image gave {other:?}"),
        }
        assert_no_leaks(&sim, 0, 0);
        assert!(sim.process(500).is_none());
    }
}

#[test]
fn hostile_images_fail_cleanly() {
    // A BO claiming 2^60 bytes of VRAM.
    hostile("huge BO", |dir, id| {
        let mut k = read_kfd(dir, id);
        let i = k.bos.iter().position(|b| b.has_contents()).unwrap();
        k.bos[i].size = 1 << 60;
        write_kfd(dir, id, &k);
    });
    // BO sizes adding up past the size header.
    hostile("overflowing BOs", |dir, id| {
        let mut k = read_kfd(dir, id);
        for b in k.bos.iter_mut().filter(|b| b.has_contents()) {
            b.size = u64::MAX / 4;
        }
        write_kfd(dir, id, &k);
    });
    // num_of_bos says 10^9.
    hostile("num_of_bos", |dir, id| {
        use prost::Message;
        let name = image::kfd_file_name(id);
        let bytes = std::fs::read(dir.join(&name)).unwrap();
        let mut p = image::proto::CriuKfd::decode(&bytes[HEADER_LEN..]).unwrap();
        p.num_of_bos = 1_000_000_000;
        let payload = p.encode_to_vec();
        let mut out = payload.len().to_ne_bytes().to_vec();
        out.extend_from_slice(&payload);
        std::fs::write(dir.join(&name), out).unwrap();
    });
    // A size header claiming 2^62 bytes.
    hostile("header", |dir, id| {
        let name = image::kfd_file_name(id);
        let mut bytes = std::fs::read(dir.join(&name)).unwrap();
        bytes[..HEADER_LEN].copy_from_slice(&(1usize << 62).to_ne_bytes());
        std::fs::write(dir.join(&name), bytes).unwrap();
    });
    // Garbage instead of protobuf.
    hostile("garbage", |dir, id| {
        let mut out = 64usize.to_ne_bytes().to_vec();
        out.extend((0..64u8).map(|i| i.wrapping_mul(37) | 0x80));
        std::fs::write(dir.join(image::kfd_file_name(id)), out).unwrap();
    });
    // A truncated pages file, and one whose header disagrees with the BOs.
    hostile("truncated pages", |dir, id| {
        let p = dir.join(image::kfd_pages_file_name(id, 1266));
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len - 1)
            .unwrap();
    });
    hostile("pages header", |dir, id| {
        let p = dir.join(image::kfd_pages_file_name(id, 53109));
        let mut bytes = std::fs::read(&p).unwrap();
        let h = usize::from_ne_bytes(bytes[..HEADER_LEN].try_into().unwrap()) + 4096;
        bytes[..HEADER_LEN].copy_from_slice(&h.to_ne_bytes());
        std::fs::write(&p, bytes).unwrap();
    });
    // No BOs, no private data, too many GPUs, a GPU this machine does not have.
    hostile("no BOs", |dir, id| {
        let mut k = read_kfd(dir, id);
        k.bos.clear();
        write_kfd(dir, id, &k);
    });
    hostile("no private data", |dir, id| {
        let mut k = read_kfd(dir, id);
        k.priv_data.clear();
        write_kfd(dir, id, &k);
    });
    hostile("65 GPUs", |dir, id| {
        let mut k = read_kfd(dir, id);
        let gpu = k.devices.iter().find(|d| d.gpu_id != 0).unwrap().clone();
        for i in 0..63 {
            let mut g = gpu.clone();
            g.gpu_id = 0x100 + i;
            g.node_id = 100 + i;
            k.devices.push(g);
        }
        k.num_of_gpus += 63;
        write_kfd(dir, id, &k);
    });
    hostile("other GPU", |dir, id| {
        let mut k = read_kfd(dir, id);
        for d in k.devices.iter_mut().filter(|d| d.gpu_id != 0) {
            d.device_id ^= 0xffff;
        }
        write_kfd(dir, id, &k);
    });
}

/// A checkpoint whose task's core image says arm64 is refused at RESTORE_INIT, before CRIU
/// would fork the task; nothing is created in the kernel. The same images with a core image
/// of this machine's architecture restore.
#[test]
fn a_checkpoint_of_another_cpu_architecture_is_refused_at_restore_init() {
    use criu_gpu_test_support::foreign_arch::{MARCH_AARCH64, bare_tree};
    let (_, images, dumped) = dumped_images(110);
    let id = dumped[0].kfd_id;
    bare_tree(images.path(), 110, MARCH_AARCH64);
    let (sim, mut b) = restore_backend(images.path(), 110, Faults::default(), true);
    let pre = b.restore_init();
    b.exit(Stage::Restore, -1);
    assert_eq!(pre.map_err(|h| h.errno()), Err(libc::EINVAL));
    assert_no_leaks(&sim, 0, 0);
    assert!(sim.process(110).is_none(), "kernel state was created");
    bare_tree(
        images.path(),
        110,
        criu_plugin::core_image::THIS_MARCH as u8,
    );
    let (pre, r, _) = try_restore(images.path(), id, 110, Faults::default(), true);
    assert_eq!((pre, r), (Ok(()), Ok(())));
}

#[test]
fn a_missing_kfd_fails_restore_init_clearly() {
    let (_, images, _) = dumped_images(600);
    let topo = fixture("2gpu");
    let cfg = config(&topo, "");
    let mut b = criu_gpu_core::amdgpu::AmdgpuBackend::with_device_factory(
        Box::new(|| Err(std::io::Error::from_raw_os_error(libc::ENOENT))),
        criu_gpu_core::amdgpu::BackendOptions {
            images_dir: Some(images.path().to_path_buf()),
            ..Default::default()
        },
    );
    let r = b.init(
        &ctx(&cfg, HostVersion::Dev, InventoryListing::Listed),
        Stage::Restore,
    );
    assert_eq!(r, Err(HookError::logged(libc::ENODEV)));
}

#[test]
fn handed_over_copies_are_done_even_if_post_forking_never_comes() {
    let (src, _images, sim, mut b) = restore_handed_over(420);
    b.resume_devices_late(420).unwrap();
    assert!(src.compare_contents(420, &sim, 420).unwrap().is_empty());
    assert_eq!(sim.process(420).unwrap().resumed, 1);
    b.exit(Stage::Restore, 0);
    assert_no_leaks(&sim, 0, 0);
}
