//! The simulator's CRIU operations called directly, each rule of amdkfd the plugin relies on
//! (the rows of `kfd-sim/src/conformance.rs` name these tests).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use criu_gpu_core::amdgpu::device::{AllocFlags, KFD_MMAP_GPU_ID_SHIFT, KfdDevice};
use kfd_sim::{Faults, ProcessSpec, SimGpu, SimKfd};
use kfd_sys::{
    KFD_CRIU_OP_CHECKPOINT, KFD_CRIU_OP_PROCESS_INFO, KFD_CRIU_OP_RESTORE, KFD_CRIU_OP_RESUME,
    KFD_CRIU_OP_UNPAUSE, KFD_INVALID_FD, kfd_criu_bo_bucket, kfd_criu_device_bucket,
    kfd_ioctl_criu_args,
};

const PID: u32 = 40;
const CRIU: u32 = 7;

fn machine(ids: [u32; 2]) -> SimKfd {
    let gpu = |gpu_id, render_minor| SimGpu {
        gpu_id,
        render_minor,
        vram_size: 1 << 30,
        family: kfd_sys::AMDGPU_FAMILY_AI,
    };
    SimKfd::with_gpus(vec![gpu(ids[0], 128), gpu(ids[1], 129)])
}

/// A machine with GPUs 0x1000 and 0x2000 and process `PID` on both (8 BOs of every kind
/// with contents, plus its doorbells and MMIO pages), seized by `CRIU`, the current task.
fn dumped_machine() -> (SimKfd, OwnedFd) {
    let sim = machine([0x1000, 0x2000]);
    let kfd = sim
        .spawn(&ProcessSpec::new(PID, &[0x1000, 0x2000]).with_mixed_bos(8, 1 << 16))
        .unwrap();
    sim.set_current_task(CRIU);
    sim.seize(PID);
    (sim, kfd)
}

fn op(sim: &SimKfd, kfd: BorrowedFd<'_>, args: &mut kfd_ioctl_criu_args) -> Result<(), i32> {
    // SAFETY: the arrays `args` points to, if any, are live `Vec`s of the callers below,
    // sized as their counts say.
    unsafe { sim.criu_op(kfd, args) }.map_err(|e| e.raw_os_error().unwrap())
}

fn simple(sim: &SimKfd, kfd: BorrowedFd<'_>, code: u32) -> Result<kfd_ioctl_criu_args, i32> {
    let mut args = kfd_ioctl_criu_args {
        op: code,
        ..Default::default()
    };
    op(sim, kfd, &mut args).map(|()| args)
}

/// What CHECKPOINT gave: the arguments, the buckets and the private data.
struct Checkpoint {
    args: kfd_ioctl_criu_args,
    devices: Vec<kfd_criu_device_bucket>,
    bos: Vec<kfd_criu_bo_bucket>,
    priv_data: Vec<u8>,
}

impl Checkpoint {
    /// Arrays of the sizes of `info` (a PROCESS_INFO answer), `extra_bos` more BO buckets
    /// than it reported.
    fn sized(info: &kfd_ioctl_criu_args, extra_bos: u32) -> Checkpoint {
        let mut args = *info;
        args.num_bos += extra_bos;
        Checkpoint {
            devices: vec![Default::default(); args.num_devices as usize],
            bos: vec![Default::default(); args.num_bos as usize],
            priv_data: vec![0; args.priv_data_size as usize],
            args,
        }
    }

    fn run(&mut self, sim: &SimKfd, kfd: BorrowedFd<'_>, code: u32) -> Result<(), i32> {
        self.args.op = code;
        self.args.devices = self.devices.as_mut_ptr() as u64;
        self.args.bos = self.bos.as_mut_ptr() as u64;
        self.args.priv_data = self.priv_data.as_mut_ptr() as u64;
        op(sim, kfd, &mut self.args)
    }
}

fn checkpoint(sim: &SimKfd, kfd: BorrowedFd<'_>) -> Checkpoint {
    let info = simple(sim, kfd, KFD_CRIU_OP_PROCESS_INFO).unwrap();
    let mut c = Checkpoint::sized(&info, 0);
    c.run(sim, kfd, KFD_CRIU_OP_CHECKPOINT).unwrap();
    c
}

fn has(flags: u32, f: AllocFlags) -> bool {
    AllocFlags::of(flags).intersects(f)
}

#[test]
fn process_info_evicts_the_queues_and_reports_the_counts() {
    let (sim, kfd) = dumped_machine();
    let v = sim.process(PID).unwrap();
    let args = simple(&sim, kfd.as_fd(), KFD_CRIU_OP_PROCESS_INFO).unwrap();
    assert_eq!(args.num_devices, 2);
    assert_eq!(args.num_bos as usize, v.bos.len());
    // Doorbell and MMIO pages count as BOs, one each per GPU.
    assert_eq!(v.bos.len(), 8 + 2 * 2);
    assert_eq!(
        args.num_objects as usize,
        v.queues.len() + v.events.len() + v.svm.len()
    );
    assert!(args.priv_data_size > 0);
    assert_eq!(args.pid, PID);
    assert!(sim.process(PID).unwrap().paused);
}

#[test]
fn checkpoint_needs_evicted_queues_and_exactly_the_reported_sizes() {
    let (sim, kfd) = dumped_machine();
    let info = simple(&sim, kfd.as_fd(), KFD_CRIU_OP_PROCESS_INFO).unwrap();
    // Not evicted any more: CHECKPOINT is refused.
    simple(&sim, kfd.as_fd(), KFD_CRIU_OP_UNPAUSE).unwrap();
    let mut c = Checkpoint::sized(&info, 0);
    assert_eq!(
        c.run(&sim, kfd.as_fd(), KFD_CRIU_OP_CHECKPOINT),
        Err(libc::EINVAL)
    );
    let info = simple(&sim, kfd.as_fd(), KFD_CRIU_OP_PROCESS_INFO).unwrap();
    let mut more = Checkpoint::sized(&info, 1);
    assert_eq!(
        more.run(&sim, kfd.as_fd(), KFD_CRIU_OP_CHECKPOINT),
        Err(libc::EINVAL)
    );
    let mut exact = Checkpoint::sized(&info, 0);
    assert_eq!(exact.run(&sim, kfd.as_fd(), KFD_CRIU_OP_CHECKPOINT), Ok(()));
}

#[test]
fn checkpoint_exports_a_dmabuf_of_each_bo_with_contents_into_the_caller() {
    let (sim, kfd) = dumped_machine();
    let c = checkpoint(&sim, kfd.as_fd());
    let mut fds = Vec::new();
    for b in &c.bos {
        if has(b.alloc_flags, AllocFlags::WITH_CONTENTS) {
            assert_ne!(b.dmabuf_fd, KFD_INVALID_FD);
            // SAFETY: CHECKPOINT installed this fd for the caller, who owns it.
            let fd: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(b.dmabuf_fd as i32) };
            assert!(sim.identify(fd.as_fd()).unwrap().dmabuf);
            assert!(sim.dmabuf_is(fd.as_fd(), PID, b.addr));
            fds.push(fd);
        } else {
            assert_eq!(b.dmabuf_fd, KFD_INVALID_FD, "{:#x}", b.alloc_flags);
        }
    }
    assert!(!fds.is_empty());
    assert_eq!(sim.open_fds("dmabuf"), fds.len());
}

#[test]
fn a_failed_checkpoint_closes_the_dmabufs_it_installed() {
    let (sim, kfd) = dumped_machine();
    sim.set_faults(Faults {
        checkpoint_after_dmabufs: Some((2, libc::EIO)),
        ..Faults::default()
    });
    let info = simple(&sim, kfd.as_fd(), KFD_CRIU_OP_PROCESS_INFO).unwrap();
    let mut c = Checkpoint::sized(&info, 0);
    assert_eq!(
        c.run(&sim, kfd.as_fd(), KFD_CRIU_OP_CHECKPOINT),
        Err(libc::EIO)
    );
    assert_eq!(sim.open_fds("dmabuf"), 0);
    assert!(c.bos.iter().all(|b| b.dmabuf_fd == KFD_INVALID_FD));
}

#[test]
fn unpause_undoes_one_eviction_and_needs_one() {
    let (sim, kfd) = dumped_machine();
    assert_eq!(
        simple(&sim, kfd.as_fd(), KFD_CRIU_OP_UNPAUSE).map(|_| ()),
        Err(libc::EINVAL)
    );
    simple(&sim, kfd.as_fd(), KFD_CRIU_OP_PROCESS_INFO).unwrap();
    simple(&sim, kfd.as_fd(), KFD_CRIU_OP_PROCESS_INFO).unwrap();
    simple(&sim, kfd.as_fd(), KFD_CRIU_OP_UNPAUSE).unwrap();
    assert!(sim.process(PID).unwrap().paused);
    simple(&sim, kfd.as_fd(), KFD_CRIU_OP_UNPAUSE).unwrap();
    assert!(!sim.process(PID).unwrap().paused);
}

/// RESTORE of `c` in task `PID` of `sim`, each image GPU onto `onto` (actual ids); returns
/// the task's KFD file and the BO buckets as RESTORE left them.
fn restore(
    sim: &SimKfd,
    c: &Checkpoint,
    onto: [u32; 2],
) -> (OwnedFd, Result<Vec<kfd_criu_bo_bucket>, i32>) {
    sim.set_current_task(PID);
    let kfd = sim.open_kfd().unwrap();
    let mut r = Checkpoint {
        args: c.args,
        devices: c.devices.clone(),
        bos: c.bos.clone(),
        priv_data: c.priv_data.clone(),
    };
    let mut renders = Vec::new();
    for (d, actual) in r.devices.iter_mut().zip(onto) {
        let minor = sim.gpus().iter().find(|g| g.gpu_id == actual).unwrap();
        let render = sim.open_render_node(minor.render_minor).unwrap();
        d.actual_gpu_id = actual;
        d.drm_fd = render.as_raw_fd() as u32;
        renders.push(render);
    }
    let result = r.run(sim, kfd.as_fd(), KFD_CRIU_OP_RESTORE).map(|()| r.bos);
    (kfd, result)
}

#[test]
fn restore_recreates_the_bos_with_new_offsets_and_device_pages_of_the_new_gpus() {
    let (sim, kfd) = dumped_machine();
    let c = checkpoint(&sim, kfd.as_fd());
    let other = machine([0x3000, 0x4000]);
    // The image's first GPU onto the machine's second and the other way round.
    let (_restored_kfd, bos) = restore(&other, &c, [0x4000, 0x3000]);
    let bos = bos.unwrap();
    for (old, new) in c.bos.iter().zip(&bos) {
        assert_eq!((new.addr, new.size), (old.addr, old.size));
        let actual = if old.gpu_id == 0x1000 { 0x4000 } else { 0x3000 };
        if has(
            old.alloc_flags,
            AllocFlags::DOORBELL | AllocFlags::MMIO_REMAP,
        ) {
            assert_eq!(
                new.restored_offset >> KFD_MMAP_GPU_ID_SHIFT & 0xffff,
                actual
            );
        } else if has(old.alloc_flags, AllocFlags::WITH_CONTENTS) {
            assert_ne!(new.restored_offset, old.offset);
            assert_ne!(new.dmabuf_fd, KFD_INVALID_FD);
            // SAFETY: RESTORE installed this fd for the caller, who owns it.
            drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(new.dmabuf_fd as i32) });
        }
    }
    let v = other.process(PID).unwrap();
    assert!(v.restored && v.awaiting_resume && v.paused);
    assert_eq!(v.gpus, vec![(0x1000, 0x4000), (0x2000, 0x3000)]);
}

#[test]
fn restore_needs_a_fresh_kfd_process_of_the_calling_task() {
    let (sim, kfd) = dumped_machine();
    let c = checkpoint(&sim, kfd.as_fd());
    let other = machine([0x1000, 0x2000]);
    let (kfd2, first) = restore(&other, &c, [0x1000, 0x2000]);
    first.unwrap();
    // The same task again: its KFD process has its BOs already.
    let (_kfd3, again) = restore(&other, &c, [0x1000, 0x2000]);
    assert_eq!(again.map(|_| ()), Err(libc::EINVAL));
    // The file of another process.
    other.set_current_task(PID + 1);
    let mut r = Checkpoint::sized(&c.args, 0);
    assert_eq!(
        r.run(&other, kfd2.as_fd(), KFD_CRIU_OP_RESTORE),
        Err(libc::EBADF)
    );
}

#[test]
fn resume_finds_the_process_by_pid_and_starts_its_queues() {
    let (sim, kfd) = dumped_machine();
    let c = checkpoint(&sim, kfd.as_fd());
    let other = machine([0x1000, 0x2000]);
    let (_restored_kfd, bos) = restore(&other, &c, [0x1000, 0x2000]);
    drop(bos.unwrap());
    other.set_current_task(CRIU);
    let own = other.open_kfd().unwrap();
    let resume = |pid| {
        let mut args = kfd_ioctl_criu_args {
            op: KFD_CRIU_OP_RESUME,
            pid,
            ..Default::default()
        };
        op(&other, own.as_fd(), &mut args)
    };
    assert_eq!(resume(PID + 1), Err(libc::ESRCH));
    assert_eq!(resume(PID), Ok(()));
    let v = other.process(PID).unwrap();
    assert!(!v.paused && !v.awaiting_resume);
    assert_eq!(resume(PID), Err(libc::EINVAL));
}

#[test]
fn criu_operations_come_from_the_process_or_its_tracer() {
    let sim = machine([0x1000, 0x2000]);
    let kfd = sim.spawn(&ProcessSpec::new(PID, &[0x1000])).unwrap();
    let info = |sim: &SimKfd| simple(sim, kfd.as_fd(), KFD_CRIU_OP_PROCESS_INFO).map(|_| ());
    sim.set_current_task(CRIU);
    assert_eq!(
        info(&sim),
        Err(libc::EBADF),
        "neither the process nor its tracer"
    );
    sim.seize(PID);
    assert_eq!(info(&sim), Ok(()), "its tracer");
    sim.set_current_task(CRIU + 1);
    assert_eq!(info(&sim), Err(libc::EBADF), "another task");
    sim.set_current_task(PID);
    assert_eq!(info(&sim), Ok(()), "the process itself");
    sim.set_tracer(PID, None);
    sim.set_current_task(CRIU);
    assert_eq!(info(&sim), Err(libc::EBADF), "its tracer gone");
    // A file of no process yet is the caller's own.
    let own = sim.open_kfd().unwrap();
    assert_eq!(
        simple(&sim, own.as_fd(), KFD_CRIU_OP_PROCESS_INFO).map(|_| ()),
        Err(libc::EINVAL)
    );
}

#[test]
fn the_holder_of_a_kfd_file_is_found_among_the_traced_processes() {
    let sim = machine([0x1000, 0x2000]);
    let kfd = sim.spawn(&ProcessSpec::new(PID, &[0x1000])).unwrap();
    sim.set_current_task(CRIU);
    assert!(sim.kfd_holder(kfd.as_fd()).unwrap().is_none());
    sim.seize(PID);
    assert_eq!(
        sim.kfd_holder(kfd.as_fd()).unwrap().unwrap().pid,
        PID as i32
    );
    assert_eq!(sim.kfd_process(kfd.as_fd()), Some(PID));
}

#[test]
fn restore_needs_an_unbound_render_file_of_each_gpu_and_binds_it() {
    let (sim, kfd) = dumped_machine();
    let c = checkpoint(&sim, kfd.as_fd());
    let other = machine([0x1000, 0x2000]);
    let renders = [128, 129].map(|minor| other.open_render_node(minor).unwrap());
    let attempt = |task: u32, files: [usize; 2]| {
        other.set_current_task(task);
        let kfd = other.open_kfd().unwrap();
        let mut r = Checkpoint {
            args: c.args,
            devices: c.devices.clone(),
            bos: c.bos.clone(),
            priv_data: c.priv_data.clone(),
        };
        for (d, f) in r.devices.iter_mut().zip(files) {
            d.drm_fd = renders[f].as_raw_fd() as u32;
        }
        let result = r.run(&other, kfd.as_fd(), KFD_CRIU_OP_RESTORE);
        for b in r
            .bos
            .iter()
            .filter(|b| result.is_ok() && b.dmabuf_fd != KFD_INVALID_FD)
        {
            // SAFETY: RESTORE installed this fd for the caller, who owns it.
            drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(b.dmabuf_fd as i32) });
        }
        (kfd, result)
    };
    // GPU 0x1000's render file for both GPUs: the second GPU's is missing.
    assert_eq!(attempt(PID, [0, 0]).1, Err(libc::EINVAL));
    // The right files: bound to the restored process, then refused to another one.
    let (_restored_kfd, result) = attempt(PID, [0, 1]);
    assert_eq!(result, Ok(()));
    assert_eq!(
        attempt(PID + 1, [0, 1]).1,
        Err(libc::EINVAL),
        "render files bound to another process"
    );
}

#[test]
fn restore_consumes_the_private_data_exactly() {
    let (sim, kfd) = dumped_machine();
    let c = checkpoint(&sim, kfd.as_fd());
    for len in [c.priv_data.len() - 4, c.priv_data.len() + 4] {
        let other = machine([0x1000, 0x2000]);
        let mut short = Checkpoint {
            args: c.args,
            devices: c.devices.clone(),
            bos: c.bos.clone(),
            priv_data: c.priv_data.clone(),
        };
        short.priv_data.resize(len, 0);
        short.args.priv_data_size = len as u64;
        let (_kfd, r) = restore(&other, &short, [0x1000, 0x2000]);
        assert_eq!(r.map(|_| ()), Err(libc::EINVAL), "{len} bytes");
        assert!(other.process(PID).is_none());
    }
}

#[test]
fn get_version_answers_on_kfd_files_only() {
    let sim = machine([0x1000, 0x2000]);
    let kfd = sim.open_kfd().unwrap();
    assert_eq!(
        sim.get_version(kfd.as_fd()).unwrap(),
        kfd_sim::SIM_KFD_VERSION
    );
    let render = sim.open_render_node(128).unwrap();
    let e = sim.get_version(render.as_fd()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTTY));
}
