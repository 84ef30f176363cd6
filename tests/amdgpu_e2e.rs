//! The AMD backend end to end on the KFD simulator: CRIU's hook sequences for dump and
//! restore through `GpuBackend`, onto the same and other GPU topologies, with the images
//! checked through the image module.

#[path = "amdgpu_support/mod.rs"]
mod support;

use std::os::fd::AsRawFd;

use criu_gpu_core::amdgpu::CopyKind;
use criu_gpu_core::amdgpu::device::AllocFlags;
use criu_gpu_core::amdgpu::image::{
    self, HEADER_LEN, ImageDir, KfdCheckpoint, PagesLayout, ReadLimits, open_image_dir,
};
use criu_gpu_core::backend::{GpuBackend, HookHandler};
use criu_plugin::{HookError, HostVersion, InventoryListing, Stage};
use kfd_sim::{BoSpec, ProcessSpec, SimKfd};
use support::*;

/// 200 BOs from 4 KiB to 64 MiB over the process's GPUs (about 270 MiB of contents).
fn big_spec(pid: u32, gpus: &[u32]) -> ProcessSpec {
    let mut spec = ProcessSpec::new(pid, gpus);
    for i in 0..200usize {
        let size = match i {
            7 | 111 => 64 << 20,
            23 | 77 | 150 => 16 << 20,
            42 => 32 << 20,
            _ => 4096u64 << (i % 9),
        };
        let flags = match i % 5 {
            0 | 1 | 3 => (AllocFlags::VRAM | AllocFlags::WRITABLE).bits(),
            2 => (AllocFlags::GTT | AllocFlags::WRITABLE).bits(),
            _ => (AllocFlags::USERPTR | AllocFlags::WRITABLE).bits(),
        };
        spec.bos.push(BoSpec {
            gpu: i % gpus.len(),
            size,
            flags,
        });
    }
    spec.queues_per_gpu = 3;
    spec.events = 5;
    spec.svm_ranges = 2;
    spec
}

#[test]
fn two_hundred_bos_on_two_gpus_dump_and_restore_byte_exact() {
    let (topo, sim) = fixture_sim("2gpu");
    let spec = big_spec(4242, &[53109, 1266]);
    let p = spawn(&sim, &spec);
    let images = TempDir::new("big");
    let cfg = config(
        &topo,
        "amdgpu.copy-threads = 3\namdgpu.max-buffer-size = 24M\n",
    );
    let dumped = dump(&sim, &[&p], images.path(), &cfg);
    let v = sim.process(p.pid).unwrap();
    assert!(!v.paused, "queues restarted after the dump");
    assert_no_leaks(&sim, p.render.len(), 1);

    // The images, read back through the image module.
    let k = read_kfd(images.path(), dumped[0].kfd_id);
    assert_eq!(k.num_of_gpus, 2);
    assert_eq!(k.num_of_cpus, 1);
    assert_eq!(k.bos.len(), v.bos.len());
    assert_eq!(k.num_of_objects, 3 * 2 + 5 + 2);
    for gpu in [53109u32, 1266] {
        let layout = PagesLayout::for_kfd_gpu(&k, gpu).unwrap();
        let name = image::kfd_pages_file_name(dumped[0].kfd_id, gpu);
        let len = std::fs::metadata(images.path().join(&name)).unwrap().len();
        assert_eq!(len, HEADER_LEN as u64 + layout.total(), "{name}");
    }

    // Restore onto a fresh machine with the same topology, the copy in CRIU's main process.
    let sim2 = SimKfd::from_sysfs(&topo).unwrap();
    let copies = restore(&sim2, &dumped, images.path(), &cfg, false);
    assert_same_process(&sim, &sim2, p.pid);
    assert_no_leaks(&sim2, 0, 0);
    let content = sim.content_bytes(p.pid);
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].kind, CopyKind::RestoreInMain);
    assert_eq!(copies[0].stats.bytes, content);
    // The staging memory stayed within the 24 MiB budget.
    assert!(copies[0].stats.staging_bytes <= 24 << 20);

    // And again with the copy done in the restored task, render node file first.
    let sim3 = SimKfd::from_sysfs(&topo).unwrap();
    let cfg3 = config(
        &topo,
        "amdgpu.parallel-restore = false\namdgpu.copy-threads = 1\n",
    );
    let copies = restore(&sim3, &dumped, images.path(), &cfg3, true);
    assert_same_process(&sim, &sim3, p.pid);
    assert_eq!(copies[0].kind, CopyKind::RestoreInTask);
    assert_eq!(copies[0].stats.bytes, content);
    assert_no_leaks(&sim3, 0, 0);
}

#[test]
fn images_round_trip_and_restore_from_a_criu_4_2_style_image() {
    let (topo, sim, p) = fixture_process("1gpu", 77, &[53109], 24, 1 << 20);
    let (images, dumped) = dump_new(&topo, &sim, &[&p], "compat");
    let id = dumped[0].kfd_id;
    let name = image::kfd_file_name(id);
    let bytes = std::fs::read(images.path().join(&name)).unwrap();
    let k: KfdCheckpoint = image::decode_framed(&bytes, &name, &ReadLimits::default()).unwrap();
    // Our encoding is stable: what is read back encodes to the same bytes.
    assert_eq!(image::encode_framed(&k, &name).unwrap(), bytes);
    let r: image::RenderNodeImage = {
        let n = image::render_node_file_name(dumped[0].render_ids[0].0);
        let b = std::fs::read(images.path().join(&n)).unwrap();
        image::decode_framed(&b, &n, &ReadLimits::default()).unwrap()
    };
    assert_eq!(r.gpu_id, 53109);
    assert_eq!(r.drm.as_ref().unwrap().drm_render_minor, 128);

    // CRIU 4.2's C plugin wrote no kfd_bo_entry.handle: drop the field from every BO.
    use prost::Message;
    let mut proto = image::proto::CriuKfd::decode(&bytes[HEADER_LEN..]).unwrap();
    for b in &mut proto.bo_entries {
        b.handle = None;
    }
    let payload = proto.encode_to_vec();
    let mut old = payload.len().to_ne_bytes().to_vec();
    old.extend_from_slice(&payload);
    std::fs::write(images.path().join(&name), &old).unwrap();

    restore_fresh(&sim, &topo, &dumped, images.path());
}

#[test]
fn one_gpu_restores_onto_a_gpu_with_another_id() {
    let (topo, sim, p) = fixture_process("1gpu", 500, &[53109], 40, 4 << 20);
    let (images, dumped) = dump_new(&topo, &sim, &[&p], "1to1");

    let other = edited_fixture("1gpu", &[Edit::GpuId(1, 4242)]);
    let sim2 = restore_fresh(&sim, other.path(), &dumped, images.path());
    // The process keeps its gpu id; KFD knows the new GPU behind it.
    assert_eq!(sim2.process(p.pid).unwrap().gpus, vec![(53109, 4242)]);
    // Doorbell offsets now carry the new gpu id (check_vma verified every mapping).
    let v = sim2.process(p.pid).unwrap();
    let doorbell = v
        .bos
        .iter()
        .find(|b| AllocFlags::of(b.2).intersects(AllocFlags::DOORBELL))
        .unwrap();
    assert_eq!((doorbell.4 >> 46) & 0xffff, 4242);
}

/// A restored task opens its files in its container's mount namespace, where the topology's
/// path (a setting) need not exist: the plugin maps the GPUs with the topology CRIU's main
/// process read at `init`, before the tasks were forked.
#[test]
fn tasks_that_cannot_see_the_topology_restore_with_the_one_read_at_init() {
    let (topo, sim, p) = fixture_process("2gpu", 510, &[53109, 1266], 20, 1 << 20);
    let (images, dumped) = dump_new(&topo, &sim, &[&p], "hidden-topology");
    let copy = edited_fixture("2gpu", &[]);
    let restored = SimKfd::from_sysfs(copy.path()).unwrap();
    let cfg = config(copy.path(), "");
    let gone = copy.path().with_extension("hidden");
    restore_with(&restored, &dumped, images.path(), &cfg, false, || {
        std::fs::rename(copy.path(), &gone).unwrap();
    });
    std::fs::rename(&gone, copy.path()).unwrap();
    assert_same_process(&sim, &restored, p.pid);
}

#[test]
fn two_gpus_restore_swapped() {
    // The two GPUs differ (device ids); the restore machine has them the other way round
    // and with other gpu ids, so each GPU's state must go to the other node.
    let (ckpt, rest) = swapped_gpu_topologies();
    let sim = SimKfd::from_sysfs(ckpt.path()).unwrap();
    let p = spawn(
        &sim,
        &ProcessSpec::new(600, &[53109, 1266]).with_mixed_bos(30, 2 << 20),
    );
    let (images, dumped) = dump_new(ckpt.path(), &sim, &[&p], "swap");
    let sim2 = restore_fresh(&sim, rest.path(), &dumped, images.path());
    let mut gpus = sim2.process(p.pid).unwrap().gpus;
    gpus.sort_unstable();
    // 53109 was node 1 (device 29711), now node 2 (id 0x2222); 1266 the other way round.
    assert_eq!(gpus, vec![(1266, 0x1111), (53109, 0x2222)]);
}

#[test]
fn eight_gpus_in_two_hives_restore_onto_other_ids() {
    let topo = fixture("8gpu-2hives");
    let sim = SimKfd::from_sysfs(&topo).unwrap();
    let ids: Vec<u32> = sim.gpus().iter().map(|g| g.gpu_id).collect();
    assert_eq!(ids.len(), 8);
    let p = spawn(
        &sim,
        &ProcessSpec::new(700, &ids).with_mixed_bos(64, 1 << 20),
    );
    let (images, dumped) = dump_new(&topo, &sim, &[&p], "8gpu");
    let edits: Vec<Edit> = (2..10).map(|n| Edit::GpuId(n, 0x9000 + n)).collect();
    let other = edited_fixture("8gpu-2hives", &edits);
    let sim2 = restore_fresh(&sim, other.path(), &dumped, images.path());
    let v = sim2.process(p.pid).unwrap();
    assert_eq!(v.gpus.len(), 8);
    for (user, actual) in v.gpus {
        assert!(ids.contains(&user));
        assert!((0x9002..=0x9009).contains(&actual));
    }
}

#[test]
fn a_process_restored_on_other_gpus_can_be_checkpointed_again() {
    // After a migration the user and actual gpu ids differ; a second dump must match BOs by
    // user id and name the pages files by it (the C plugin mixed the two and failed).
    let other = edited_fixture("2gpu", &[Edit::GpuId(1, 0x0aaa), Edit::GpuId(2, 0x0bbb)]);
    let sim = SimKfd::from_sysfs(other.path()).unwrap();
    let mut spec = ProcessSpec::new(800, &[0x0aaa, 0x0bbb]).with_mixed_bos(20, 1 << 20);
    spec.gpus = vec![(53109, 0x0aaa), (1266, 0x0bbb)];
    let p = spawn(&sim, &spec);
    let (images, dumped) = dump_new(other.path(), &sim, &[&p], "again");
    let k = read_kfd(images.path(), dumped[0].kfd_id);
    let mut gpus: Vec<u32> = k
        .devices
        .iter()
        .map(|d| d.gpu_id)
        .filter(|&g| g != 0)
        .collect();
    gpus.sort_unstable();
    assert_eq!(gpus, vec![1266, 53109]);
    assert!(
        images
            .path()
            .join(image::kfd_pages_file_name(dumped[0].kfd_id, 53109))
            .exists()
    );
    // And it restores onto the original ids.
    restore_fresh(&sim, &fixture("2gpu"), &dumped, images.path());
}

#[test]
fn two_processes_dump_and_restore_together() {
    let (topo, sim) = fixture_sim("2gpu");
    // Every process has every GPU of the machine (KFD gives it all it can see); this one
    // allocates on the first only.
    let mut spec_a = ProcessSpec::new(901, &[53109, 1266]).with_mixed_bos(16, 1 << 20);
    for bo in &mut spec_a.bos {
        bo.gpu = 0;
    }
    let a = spawn(&sim, &spec_a);
    let mut spec_b = ProcessSpec::new(902, &[1266, 53109]).with_mixed_bos(16, 1 << 20);
    spec_b.ns_pid = 902;
    let b = spawn(&sim, &spec_b);
    let (images, dumped) = dump_new(&topo, &sim, &[&a, &b], "two");
    restore_fresh(&sim, &topo, &dumped, images.path());
}

/// A GPU without VRAM or GTT BOs still gets its pages file, the size header of 0 and nothing
/// else, as CRIU's C plugin writes it (its restore opens the pages file of every GPU of the
/// image and fails without one); an image without that file (this plugin's, before it wrote
/// one) restores as well.
#[test]
fn a_gpu_without_bo_contents_gets_an_empty_pages_file_and_restores_without_it_too() {
    let (topo, sim) = fixture_sim("2gpu");
    // Contents on the first GPU only; the second has a userptr BO, which has none.
    let mut spec = ProcessSpec::new(903, &[53109, 1266]).with_mixed_bos(12, 1 << 20);
    for bo in &mut spec.bos {
        if AllocFlags::of(bo.flags).intersects(AllocFlags::USERPTR) {
            bo.gpu = 1;
        } else {
            bo.gpu = 0;
        }
    }
    let p = spawn(&sim, &spec);
    let (images, dumped) = dump_new(&topo, &sim, &[&p], "empty-pages");
    let id = dumped[0].kfd_id;
    let k = read_kfd(images.path(), id);
    assert!(
        k.bos
            .iter()
            .any(|b| b.gpu_id == 1266
                && AllocFlags::of(b.alloc_flags).intersects(AllocFlags::USERPTR))
    );
    assert_eq!(k.content_gpus().collect::<Vec<_>>(), [53109]);
    assert_eq!(k.gpus().collect::<Vec<_>>().len(), 2);
    let empty = images.path().join(image::kfd_pages_file_name(id, 1266));
    assert_eq!(
        std::fs::read(&empty).unwrap(),
        0usize.to_ne_bytes(),
        "the pages file of a GPU without contents is its size header of 0"
    );
    let full = images.path().join(image::kfd_pages_file_name(id, 53109));
    let layout = PagesLayout::for_kfd_gpu(&k, 53109).unwrap();
    assert!(layout.total() > 0);
    assert_eq!(
        std::fs::metadata(&full).unwrap().len(),
        HEADER_LEN as u64 + layout.total()
    );

    let sim2 = restore_fresh(&sim, &topo, &dumped, images.path());
    assert_no_leaks(&sim2, 0, 0);

    // Without the empty file, in the task and in CRIU's main process.
    std::fs::remove_file(&empty).unwrap();
    for (parallel, render_first) in [("false", true), ("true", false)] {
        let sim3 = SimKfd::from_sysfs(&topo).unwrap();
        let cfg3 = config(&topo, &format!("amdgpu.parallel-restore = {parallel}\n"));
        restore(&sim3, &dumped, images.path(), &cfg3, render_first);
        assert_same_process(&sim, &sim3, p.pid);
        assert_no_leaks(&sim3, 0, 0);
    }
}

#[test]
fn hooks_answer_not_mine_for_what_is_not_amd() {
    let (topo, sim) = fixture_sim("1gpu");
    let images = TempDir::new("notmine");
    let cfg = config(&topo, "");
    let mut b = backend(&sim, images.path());
    let c = ctx(&cfg, HostVersion::Dev, InventoryListing::NoList);
    assert_eq!(b.init(&c, Stage::Dump), Ok(true));
    // A render node of another GPU (not in the KFD topology), /dev/null, a regular file.
    assert_eq!(
        b.handle_device_vma(-1, &sim.render_stat(200)),
        Err(HookError::NotMine)
    );
    let null = std::fs::File::open("/dev/null").unwrap();
    assert_eq!(
        b.dump_ext_file(null.as_raw_fd(), 1),
        Err(HookError::NotMine)
    );
    // Nothing dumped: DUMP_DEVICES_LATE is not ours either.
    assert_eq!(b.dump_devices_late(1), Err(HookError::NotMine));
    assert_eq!(b.handle_device_vma(-1, &sim.kfd_stat()), Ok(()));
    assert_eq!(b.handle_device_vma(-1, &sim.render_stat(128)), Ok(()));
    b.exit(Stage::Dump, 0);

    // Pre-dump claims mappings but dumps nothing.
    assert_eq!(b.init(&c, Stage::PreDump), Ok(true));
    assert_eq!(b.handle_device_vma(-1, &sim.kfd_stat()), Ok(()));
    let p = spawn(
        &sim,
        &ProcessSpec::new(10, &[53109]).with_mixed_bos(4, 8192),
    );
    assert_eq!(
        b.dump_ext_file(p.kfd.as_raw_fd(), 1),
        Err(HookError::NotMine)
    );
    assert!(!sim.process(10).unwrap().paused);

    // Restore: an image that does not list the plugin leaves it out.
    let nl = ctx(&cfg, HostVersion::Dev, InventoryListing::NotListed);
    assert_eq!(b.init(&nl, Stage::Restore), Ok(false));
    let l = ctx(&cfg, HostVersion::Dev, InventoryListing::Listed);
    assert_eq!(b.init(&l, Stage::Restore), Ok(true));
    assert_eq!(b.restore_init(), Err(HookError::NotMine));
    assert_eq!(b.restore_ext_file(12345, None), Err(HookError::NotMine));
    assert_eq!(
        b.update_vma_map(c"/dev/zero", 0x1000, 0),
        Err(HookError::NotMine)
    );
    assert_eq!(
        b.update_vma_map(c"/usr/lib/libfoo.so", 0x1000, 0),
        Err(HookError::NotMine)
    );
    // A task without KFD state: RESUME finds no KFD process.
    assert_eq!(b.resume_devices_late(31337), Err(HookError::NotMine));
    b.exit(Stage::Restore, 0);

    // No /dev/kfd at all: the backend sits the dump out.
    let mut none = criu_gpu_core::amdgpu::AmdgpuBackend::with_device_factory(
        Box::new(|| Err(std::io::Error::from_raw_os_error(libc::ENOENT))),
        Default::default(),
    );
    assert_eq!(none.init(&c, Stage::Dump), Ok(false));
}

#[test]
fn without_dump_devices_late_queues_restart_at_exit() {
    let (topo, sim, p) = fixture_process("1gpu", 21, &[53109], 8, 64 << 10);
    let images = TempDir::new("v42");
    let cfg = config(&topo, "");
    let mut b = started_backend(
        &sim,
        images.path(),
        &cfg,
        HostVersion::V4_2,
        InventoryListing::NoList,
        Stage::Dump,
    );
    let dumped = dump_files(&mut b, &sim, &[&p], 3).unwrap();
    // Still evicted while CRIU dumps memory.
    assert!(sim.process(p.pid).unwrap().paused);
    b.exit(Stage::Dump, 0);
    assert!(!sim.process(p.pid).unwrap().paused);

    // A CRIU 4.0 restore: no POST_FORKING, so the task copies itself.
    let sim2 = SimKfd::from_sysfs(&topo).unwrap();
    let mut r = started_backend(
        &sim2,
        images.path(),
        &cfg,
        HostVersion::V4_0,
        InventoryListing::Listed,
        Stage::Restore,
    );
    sim2.set_current_task(p.pid);
    let fd = r.restore_ext_file(dumped[0].kfd_id, None).unwrap();
    // SAFETY: the hook returned a new fd, ours to close.
    drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
    // The contents are there before RESUME.
    assert!(
        sim.compare_contents(p.pid, &sim2, p.pid)
            .unwrap()
            .is_empty()
    );
    assert_eq!(r.post_forking(), Err(HookError::NotMine));
    r.resume_devices_late(p.pid as i32).unwrap();
    r.exit(Stage::Restore, 0);
    assert_same_process(&sim, &sim2, p.pid);
}

#[test]
fn a_container_seeing_one_of_two_gpus_dumps_and_restores_it() {
    // sysfs lists both GPUs, KFD reports only the one the container may use (the C plugin
    // failed such a dump).
    let (topo, sim) = fixture_sim("2gpu");
    sim.hide_gpu(53109);
    let p = spawn(
        &sim,
        &ProcessSpec::new(950, &[1266]).with_mixed_bos(12, 1 << 20),
    );
    let (images, dumped) = dump_new(&topo, &sim, &[&p], "cgroup");
    let k = read_kfd(images.path(), dumped[0].kfd_id);
    assert_eq!(k.num_of_gpus, 1);
    assert!(k.devices.iter().all(|d| d.gpu_id != 53109));
    // Restore into the same kind of container on another machine.
    let sim2 = SimKfd::from_sysfs(&topo).unwrap();
    sim2.hide_gpu(53109);
    restore(&sim2, &dumped, images.path(), &config(&topo, ""), false);
    assert_same_process(&sim, &sim2, p.pid);
}

#[test]
fn dma_buf_fds_follow_their_bos_within_and_across_processes() {
    let (topo, sim, a) = two_gpu_process(1001, 12, 1 << 20);
    let b = spawn(
        &sim,
        &ProcessSpec::new(1002, &[53109, 1266]).with_mixed_bos(4, 1 << 16),
    );
    // A holds a dma-buf of one of its BOs; B one of another BO of A (IPC).
    let (own_addr, ipc_addr) = (content_addr(&sim, 1001, 3), content_addr(&sim, 1001, 6));
    let own = sim.export_dmabuf(1001, own_addr).unwrap();
    let ipc = sim.export_dmabuf(1001, ipc_addr).unwrap();
    let images = TempDir::new("dmabuf");
    let cfg = config(&topo, "");
    let mut d = backend(&sim, images.path());
    let c = ctx(&cfg, HostVersion::Dev, InventoryListing::NoList);
    assert_eq!(d.init(&c, Stage::Dump), Ok(true));
    sim.seize(1001);
    sim.seize(1002);
    // B first: its dma-buf's BO is not dumped yet, so it waits.
    d.dump_ext_file(b.kfd.as_raw_fd(), 20).unwrap();
    d.dump_ext_file(ipc.as_raw_fd(), 21).unwrap();
    assert!(!images.path().join(image::dmabuf_file_name(21)).exists());
    d.dump_ext_file(a.kfd.as_raw_fd(), 30).unwrap();
    d.dump_ext_file(own.as_raw_fd(), 31).unwrap();
    d.dump_devices_late(1001).unwrap();
    d.exit(Stage::Dump, 0);
    drop((own, ipc));
    assert_no_leaks(&sim, a.render.len() + b.render.len(), 2);

    let k = read_kfd(images.path(), 30);
    let key_of = |addr: u64| {
        k.bos
            .iter()
            .find(|b| b.addr == addr)
            .unwrap()
            .handle
            .unwrap()
    };
    let dir = open_image_dir(images.path()).unwrap();
    let dir = ImageDir::new(std::os::fd::AsFd::as_fd(&dir));
    let lim = ReadLimits::default();
    assert_eq!(
        dir.read_dmabuf(31, &lim).unwrap().gem_handle,
        key_of(own_addr)
    );
    assert_eq!(
        dir.read_dmabuf(21, &lim).unwrap().gem_handle,
        key_of(ipc_addr)
    );

    // Restore: B's dma-buf comes before A's BOs exist, so CRIU is asked to retry.
    let sim2 = SimKfd::from_sysfs(&topo).unwrap();
    let mut r = backend(&sim2, images.path());
    let c = ctx(&cfg, HostVersion::Dev, InventoryListing::Listed);
    assert_eq!(r.init(&c, Stage::Restore), Ok(true));
    r.restore_init().unwrap();
    let take = |r: &mut criu_gpu_core::amdgpu::AmdgpuBackend, id: u32| {
        let mut retry = false;
        let fd = r.restore_ext_file(id, Some(&mut retry)).unwrap();
        if retry {
            None
        } else {
            // SAFETY: a new fd from the hook, ours to close.
            Some(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
        }
    };
    sim2.set_current_task(1002);
    let _kb = take(&mut r, 20).unwrap();
    assert!(take(&mut r, 21).is_none(), "retry expected");
    sim2.set_current_task(1001);
    let _ka = take(&mut r, 30).unwrap();
    let own2 = take(&mut r, 31).unwrap();
    assert!(sim2.dmabuf_is(std::os::fd::AsFd::as_fd(&own2), 1001, own_addr));
    sim2.set_current_task(1002);
    let ipc2 = take(&mut r, 21).expect("published by A's task");
    assert!(sim2.dmabuf_is(std::os::fd::AsFd::as_fd(&ipc2), 1001, ipc_addr));
    r.post_forking().unwrap();
    r.resume_devices_late(1001).unwrap();
    r.resume_devices_late(1002).unwrap();
    r.exit(Stage::Restore, 0);
    assert_same_process(&sim, &sim2, 1001);
    assert_same_process(&sim, &sim2, 1002);
}

#[test]
fn a_dma_buf_of_no_dumped_bo_fails_the_dump() {
    let (topo, sim, a) = fixture_process("1gpu", 1101, &[53109], 4, 1 << 16);
    let other = spawn(
        &sim,
        &ProcessSpec::new(1102, &[53109]).with_mixed_bos(4, 1 << 16),
    );
    let foreign = sim
        .export_dmabuf(1102, content_addr(&sim, 1102, 0))
        .unwrap();
    let images = TempDir::new("dmabuf-bad");
    let cfg = config(&topo, "");
    for host in [HostVersion::Dev, HostVersion::V4_2] {
        let mut d = backend(&sim, images.path());
        assert_eq!(
            d.init(&ctx(&cfg, host, InventoryListing::NoList), Stage::Dump),
            Ok(true)
        );
        sim.seize(1101);
        d.dump_ext_file(a.kfd.as_raw_fd(), 1).unwrap();
        let r = d.dump_ext_file(foreign.as_raw_fd(), 2);
        let r = if host == HostVersion::Dev {
            assert_eq!(r, Ok(()));
            d.dump_devices_late(1101)
        } else {
            r
        };
        assert_eq!(r, Err(HookError::logged(libc::ENOENT)));
        d.exit(Stage::Dump, -1);
        assert!(!sim.process(1101).unwrap().paused);
    }
    drop(foreign);
    assert_no_leaks(&sim, a.render.len() + other.render.len(), 2);
}
