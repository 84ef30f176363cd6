//! The engine against the simulator's SDMA model, which executes IBs as the hardware of each
//! family reads them.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::os::fd::{AsFd, OwnedFd};

use criu_gpu_core::amdgpu::StagingRegion;
use criu_gpu_core::amdgpu::device::AllocFlags;
use criu_gpu_core::amdgpu::sdma::SdmaEngines;
use kfd_sim::{BoSpec, ProcessSpec, SimGpu, SimKfd};
use kfd_sys::AMDGPU_FAMILY_AI;

const BO_SIZE: u64 = (3 << 20) + 4096;

/// Page-aligned memory standing in for a copy thread's staging buffer.
struct Staging(*mut u8, Layout);

impl Staging {
    fn new(len: usize) -> Staging {
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size.
        Staging(unsafe { alloc_zeroed(layout) }, layout)
    }
    fn region(&self) -> StagingRegion {
        StagingRegion::over_caller_memory(self.0, self.1.size())
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the whole allocation, zeroed, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1.size()) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.0, self.1) };
    }
}

/// A machine of `family` with one process holding one VRAM BO filled with a pattern;
/// returns the simulator, the BO's dma-buf and the pattern.
fn machine(family: u32) -> (SimKfd, OwnedFd, Vec<u8>) {
    let sim = SimKfd::with_gpus(vec![SimGpu {
        gpu_id: 0x1000,
        render_minor: 128,
        vram_size: 1 << 30,
        family,
    }]);
    let mut spec = ProcessSpec::new(7, &[0x1000]);
    spec.bos.push(BoSpec {
        gpu: 0,
        size: BO_SIZE,
        flags: (AllocFlags::VRAM | AllocFlags::WRITABLE).bits(),
    });
    drop(sim.spawn(&spec).unwrap());
    let v = sim.process(7).unwrap();
    let addr = v
        .bos
        .iter()
        .find(|b| AllocFlags::of(b.2).intersects(AllocFlags::VRAM))
        .unwrap()
        .0;
    let pattern: Vec<u8> = (0..BO_SIZE).map(|i| (i * 7 + i / 4099) as u8).collect();
    sim.scribble(7, addr, 0, &pattern).unwrap();
    let dmabuf = sim.export_dmabuf(7, addr).unwrap();
    (sim, dmabuf, pattern)
}

#[test]
fn lanes_copy_exact_ranges_both_ways_on_every_family() {
    for family in [
        kfd_sys::AMDGPU_FAMILY_CI,
        kfd_sys::AMDGPU_FAMILY_VI,
        AMDGPU_FAMILY_AI,
        kfd_sys::AMDGPU_FAMILY_NV,
    ] {
        let (sim, dmabuf, pattern) = machine(family);
        let mut engines = SdmaEngines::new(&sim);
        let bo = engines.import(128, dmabuf.as_fd(), BO_SIZE).unwrap();
        let mut staging = Staging::new(4 << 20);
        let region = staging.region();
        // SAFETY: `staging` outlives the lane.
        let mut lane = unsafe { engines.lane(region) };
        // A download into the middle of the staging buffer, with guard bytes around it.
        let (at, off, len) = (100usize, 4093u64, (2 << 20) + 5);
        staging.bytes().fill(0xAA);
        lane.download(bo, off, &mut staging.bytes()[at..at + len])
            .unwrap();
        let got = staging.bytes();
        assert_eq!(
            &got[at..at + len],
            &pattern[off as usize..off as usize + len]
        );
        assert_eq!(
            got[at - 1],
            0xAA,
            "family {family}: byte before overwritten"
        );
        assert_eq!(
            got[at + len],
            0xAA,
            "family {family}: byte after overwritten"
        );
        // An upload of the tail of the BO, up to its last byte.
        let tail = 4096 + 3;
        got[..tail].fill(0x5C);
        lane.upload(bo, BO_SIZE - tail as u64, &staging.bytes()[..tail])
            .unwrap();
        staging.bytes().fill(0);
        lane.download(bo, 0, &mut staging.bytes()[..BO_SIZE as usize])
            .unwrap();
        let got = &staging.bytes()[..BO_SIZE as usize];
        let cut = BO_SIZE as usize - tail;
        assert_eq!(&got[..cut], &pattern[..cut], "family {family}");
        assert!(got[cut..].iter().all(|&b| b == 0x5C), "family {family}");
        // Outside the staging buffer or the BO: refused before any GPU work.
        let mut elsewhere = vec![0u8; 16];
        assert!(lane.download(bo, 0, &mut elsewhere).is_err());
        assert!(
            lane.download(bo, BO_SIZE - 8, &mut staging.bytes()[..16])
                .is_err()
        );
        drop(lane);
        drop(engines);
        assert_eq!(sim.gem_objects(), 0);
    }
}

#[test]
fn a_count_off_by_one_is_a_page_fault_the_engine_reports() {
    // The C plugin's encoding (the byte count itself) on a Vega-class GPU, copying the
    // last piece of the BO out: the extra byte lies past the BO's mapping. As on hardware,
    // the job completes and only the VM's fault query tells.
    let (sim, dmabuf, _) = machine(AMDGPU_FAMILY_AI);
    let mut engines = SdmaEngines::new(&sim);
    let bo = engines.import(128, dmabuf.as_fd(), BO_SIZE).unwrap();
    engines.packet_format_mut(128).unwrap().count_minus_one = false;
    let mut staging = Staging::new(1 << 20);
    // SAFETY: `staging` outlives the lane.
    let mut lane = unsafe { engines.lane(staging.region()) };
    // Inside the BO: the extra byte lands in the staging buffer, unnoticed (the wrong
    // count does no harm between pieces, only at the end of a BO).
    lane.download(bo, 0, &mut staging.bytes()[..4096]).unwrap();
    let e = lane
        .download(bo, BO_SIZE - 4096, &mut staging.bytes()[..4096])
        .unwrap_err();
    assert_eq!(e.errno.get(), libc::EFAULT);
    assert!(e.message.contains("page fault"), "{e}");
    drop(lane);
    drop(engines);
    assert_eq!(sim.gem_objects(), 0);
}

#[test]
fn a_timed_out_copy_keeps_the_staging_memory_and_fails() {
    let (sim, dmabuf, _) = machine(AMDGPU_FAMILY_AI);
    let mut engines = SdmaEngines::new(&sim);
    let bo = engines.import(128, dmabuf.as_fd(), BO_SIZE).unwrap();
    let mut staging = Staging::new(1 << 20);
    // SAFETY: `staging` outlives the lane; the simulated engine does nothing after a
    // wait that timed out, so freeing it at the end of the test is harmless.
    let mut lane = unsafe { engines.lane(staging.region()) };
    lane.download(bo, 0, &mut staging.bytes()[..4096]).unwrap();
    assert!(!lane.staging().kept());
    sim.update_faults(|f| f.sdma_hang = true);
    let e = lane
        .download(bo, 0, &mut staging.bytes()[..4096])
        .unwrap_err();
    assert_eq!(e.errno.get(), libc::ETIMEDOUT);
    assert!(lane.staging().kept());
}

#[test]
fn a_fault_seen_only_after_the_last_fence_fails_the_copy() {
    let (sim, dmabuf, _) = machine(AMDGPU_FAMILY_AI);
    let mut engines = SdmaEngines::new(&sim);
    engines.import(128, dmabuf.as_fd(), BO_SIZE).unwrap();
    engines.finish().unwrap();
    sim.record_page_fault(engines.render_fd(128).unwrap(), 0x1234_5000)
        .unwrap();
    let e = engines.finish().unwrap_err();
    assert_eq!(e.errno.get(), libc::EFAULT);
    assert!(e.message.contains("0x12345000"), "{e}");
}

#[test]
fn the_same_bo_imported_twice_is_one_mapping() {
    let (sim, dmabuf, _) = machine(AMDGPU_FAMILY_AI);
    let mut engines = SdmaEngines::new(&sim);
    let a = engines.import(128, dmabuf.as_fd(), BO_SIZE).unwrap();
    let b = engines.import(128, dmabuf.as_fd(), BO_SIZE).unwrap();
    assert_eq!(a, b);
    assert!(engines.import(128, dmabuf.as_fd(), 4096).is_err());
    drop(engines);
    assert_eq!(sim.gem_objects(), 0);
}
