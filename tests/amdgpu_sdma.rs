//! AMD BO contents through the SDMA engine on the KFD simulator: each GPU family's packet
//! encoding copies every byte, and a GPU without a supported engine fails the dump clearly.

#[path = "amdgpu_support/mod.rs"]
mod support;

use criu_gpu_core::amdgpu::device::AllocFlags;
use criu_plugin::HookError;
use kfd_sim::{BoSpec, ProcessSpec, SimKfd};
use support::*;

/// A process whose BO sizes cross the SDMA packet limits (2 MiB, 2 MiB − 1) and the copy
/// pieces at odd places, so that an extra or missing byte per packet shows.
fn packet_edge_spec(pid: u32) -> ProcessSpec {
    let mut spec = ProcessSpec::new(pid, &[53109, 1266]);
    for (i, size) in [
        4096u64,
        (2 << 20) - 4096,
        2 << 20,
        (2 << 20) + 4096,
        (5 << 20) + 8192,
        12 << 20,
        3 << 12,
    ]
    .into_iter()
    .enumerate()
    {
        spec.bos.push(BoSpec {
            gpu: i % 2,
            size,
            flags: (if i % 3 == 2 {
                AllocFlags::GTT
            } else {
                AllocFlags::VRAM
            } | AllocFlags::WRITABLE)
                .bits(),
        });
    }
    spec
}

#[test]
fn contents_go_through_sdma_with_each_family_packet_encoding() {
    use criu_gpu_core::amdgpu::topology::Topology;
    let topo = fixture("2gpu");
    let t = Topology::from_sysfs(&topo).unwrap();
    // VI writes the byte count, Vega and Navi the count minus one (the C plugin writes the
    // byte count on every family).
    for family in [
        kfd_sys::AMDGPU_FAMILY_VI,
        kfd_sys::AMDGPU_FAMILY_AI,
        kfd_sys::AMDGPU_FAMILY_NV,
    ] {
        let sim = SimKfd::from_topology_with_family(&t, family);
        let p = spawn(&sim, &packet_edge_spec(900));
        let images = TempDir::new("sdma");
        // Pieces of 3 MiB: one and a half packets each.
        let cfg = config(
            &topo,
            "amdgpu.copy-threads = 2\namdgpu.chunk-size = 3M\namdgpu.max-buffer-size = 6M\n",
        );
        let dumped = dump(&sim, &[&p], images.path(), &cfg);
        let content = sim.content_bytes(900);
        let s = sim.sdma_stats();
        assert_eq!(s.bytes, content, "family {family}: {s:?}");
        assert!(s.packets > s.submissions, "{s:?}");
        // One context and one staging registration per thread and GPU, not per piece.
        assert!(s.contexts <= 4 && s.userptrs == s.contexts, "{s:?}");
        assert_no_leaks(&sim, p.render.len(), 1);

        let sim2 = SimKfd::from_topology_with_family(&t, family);
        restore(&sim2, &dumped, images.path(), &cfg, false);
        assert_same_process(&sim, &sim2, 900);
        assert_eq!(sim2.sdma_stats().bytes, content);
        assert_no_leaks(&sim2, 0, 0);
    }
}

#[test]
fn a_gpu_without_a_supported_sdma_engine_fails_the_dump_clearly() {
    use criu_gpu_core::amdgpu::topology::Topology;
    let topo = fixture("1gpu");
    let t = Topology::from_sysfs(&topo).unwrap();
    let sim = SimKfd::from_topology_with_family(&t, kfd_sys::AMDGPU_FAMILY_SI);
    let p = spawn(
        &sim,
        &ProcessSpec::new(901, &[53109]).with_mixed_bos(6, 1 << 20),
    );
    let images = TempDir::new("si");
    let e = refused_dump(&sim, &[&p], images.path(), &config(&topo, ""));
    assert_eq!(e, HookError::logged(libc::EOPNOTSUPP));
    assert!(!sim.process(901).unwrap().paused);
    assert_no_leaks(&sim, p.render.len(), 1);
}
