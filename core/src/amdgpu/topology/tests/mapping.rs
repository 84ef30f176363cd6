//! The mapping beyond the upstream cases: hives, the `KFD_*_CHECK`
//! switches and GPU counts.

use super::*;

// ----- hives -------------------------------------------------------------

#[test]
fn hives_are_detected_in_link_order() {
    let t = two_hives(0xA000, [0xD000, 0xD001], false);
    assert_eq!(
        t.xgmi_hives(),
        vec![
            vec![0xA000, 0xA001, 0xA002, 0xA003],
            vec![0xA014, 0xA015, 0xA016, 0xA017]
        ]
    );
    // One-way XGMI links do not make a hive.
    let mut t = Tb::default();
    t.gpu(1, 0x10, 1);
    t.gpu(2, 0x20, 1);
    t.link(1, XGMI, 2);
    assert!(t.build().xgmi_hives().is_empty());
}

#[test]
fn hives_touching_through_a_partial_mesh_merge() {
    let mut t = Tb::default();
    for i in 1..=4 {
        t.gpu(i, 0x100 + i, 1);
    }
    for (a, b) in [(1, 2), (3, 4), (2, 3)] {
        t.link_both(a, XGMI, b);
    }
    let hives = t.build().xgmi_hives();
    assert_eq!(hives.len(), 1);
    let mut members = hives[0].clone();
    members.sort_unstable();
    assert_eq!(members, vec![0x101, 0x102, 0x103, 0x104]);
}

/// 8 GPUs in two hives of 4, with a chosen device id per hive and a
/// chosen order of the hives' node ids.
fn eight_in_two_hives(base: u32, hive_nodes: [[u32; 4]; 2], dev: [u32; 2]) -> Topology {
    let mut t = Tb::default();
    t.cpu(0);
    t.cpu(1);
    for (h, nodes) in hive_nodes.iter().enumerate() {
        for &n in nodes {
            t.gpu(n, base + n, dev[h]);
            let cpu = u32::try_from(h).expect("small");
            t.link_both(n, PCIE, cpu);
        }
    }
    for nodes in &hive_nodes {
        t.full_mesh(nodes, XGMI);
    }
    // Nodes must be listed in id order like a parsed topology.
    t.nodes.sort_by_key(TopologyNode::node_id);
    t.build()
}

fn hive_of(t: &Topology, gpu_id: u32) -> usize {
    t.xgmi_hives()
        .iter()
        .position(|h| h.contains(&gpu_id))
        .expect("GPU in a hive")
}

#[test]
fn eight_gpus_two_hives_stay_together() {
    let src = eight_in_two_hives(0xA000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD000, 0xD000]);
    // Restore host: hives interleaved over the node ids.
    let dst = eight_in_two_hives(0xB000, [[2, 4, 6, 8], [3, 5, 7, 9]], [0xD000, 0xD000]);
    let map = map_gpus(&src, &dst, &CompatChecks::default()).expect("maps");
    assert_eq!(map.len(), 8);
    for hive in src.xgmi_hives() {
        let targets: BTreeSet<usize> = hive
            .iter()
            .map(|&g| hive_of(&dst, map.restore_gpu_id(g).unwrap()))
            .collect();
        assert_eq!(targets.len(), 1, "hive {hive:x?} was split");
    }
    let restored: BTreeSet<u32> = map.iter().map(|m| m.restore_gpu_id).collect();
    assert_eq!(restored.len(), 8, "one-to-one");
}

#[test]
fn eight_gpus_hive_device_ids_force_a_cross_mapping() {
    let src = eight_in_two_hives(0xA000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD000, 0xD001]);
    let dst = eight_in_two_hives(0xB000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD001, 0xD000]);
    // NUMA: checkpoint hive 0 sits on CPU 0, the matching restore hive on
    // CPU 1; the CPU mapping follows.
    let map = map_gpus(&src, &dst, &CompatChecks::default()).expect("maps");
    for n in 2..6 {
        assert!((0xB006..=0xB009).contains(&map.restore_gpu_id(0xA000 + n).unwrap()));
    }
    assert_eq!(map.cpu_mappings(), &[(0, 1), (1, 0)]);
}

#[test]
fn split_restore_hive_fails_with_named_hive() {
    let src = eight_in_two_hives(0xA000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD000, 0xD000]);
    // Eight restore GPUs, four per CPU, that the cases below join in hives.
    let restore_gpus = || {
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for n in 2..10u32 {
            let cpu = u32::from(n >= 6);
            t.gpu(n, 0xB000 + n, 0xD000);
            t.link_both(n, PCIE, cpu);
        }
        t
    };
    // Restore host: the second hive is split into two pairs, so it has
    // three hives (4 + 2 + 2) and the second checkpoint hive fits nowhere.
    let mut t = restore_gpus();
    let groups: [&[u32]; 3] = [&[2, 3, 4, 5], &[6, 7], &[8, 9]];
    for g in groups {
        t.full_mesh(g, XGMI);
    }
    // Keep the raw link count equal to the checkpoint's (it is compared
    // exactly) by adding PCIe links inside the split pairs.
    for (a, b) in [(6, 8), (6, 9), (7, 8), (7, 9)] {
        t.link_both(a, PCIE, b);
    }
    let dst = t.build();
    assert_eq!(dst.xgmi_hives().len(), 3);
    let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
    assert_eq!(
        err,
        MapError::HiveNotPlaceable {
            hive: vec![0xA006, 0xA007, 0xA008, 0xA009]
        }
    );
    assert!(
        err.to_string().contains("0xa006, 0xa007, 0xa008, 0xa009"),
        "{err}"
    );

    // Restore host: one hive of 4 and 4 loose GPUs.
    let mut t = restore_gpus();
    t.full_mesh(&[2, 3, 4, 5], XGMI);
    let err = map_gpus(&src, &t.build(), &CompatChecks::default()).unwrap_err();
    assert!(matches!(err, MapError::HiveCountMismatch { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("2 XGMI hives but this host has only 1"),
        "{err}"
    );
}

#[test]
fn backtracks_across_hives_where_the_c_search_could_not() {
    // Checkpoint hive {2,3} has 16 GiB GPUs, hive {4,5} 32 GiB GPUs.
    // Restore hive {2,3} has 32 GiB GPUs, hive {4,5} 16 GiB GPUs. The
    // first checkpoint hive fits the first restore hive (16 <= 32), which
    // leaves the second nowhere to go; it must move to the second restore
    // hive. Upstream kept the stale maps of the first try and failed.
    let build = |base: u32, small_first: bool| {
        let mut t = Tb::default();
        t.cpu(0);
        for n in 2..6u32 {
            t.gpu(n, base + n, 0xD000);
            t.link_both(n, PCIE, 0);
        }
        for node in &mut t.nodes {
            if let TopologyNode::Gpu(g) = node {
                let small = (g.node_id < 4) == small_first;
                g.vram_size = if small { 16 << 30 } else { 32 << 30 };
            }
        }
        for (a, b) in [(2, 3), (4, 5)] {
            t.link_both(a, XGMI, b);
        }
        t.build()
    };
    let (src, dst) = (build(0xA000, true), build(0xB000, false));
    let map = expect_map(
        &src,
        &dst,
        &[
            (0xA002, 0xB004),
            (0xA003, 0xB005),
            (0xA004, 0xB002),
            (0xA005, 0xB003),
        ],
    );
    assert_eq!(map.cpu_mappings(), &[(0, 0)]);
    // With the size check off the first restore hive is kept.
    let off = CompatChecks {
        vram_size: false,
        ..CompatChecks::default()
    };
    let map = map_gpus(&src, &dst, &off).unwrap();
    assert_eq!(map.restore_gpu_id(0xA002), Some(0xB002));
}

// ----- compatibility switches ---------------------------------------------

fn single(gpu: GpuNode) -> Topology {
    let node_id = gpu.node_id;
    let mut t = Tb::default();
    t.cpu(0);
    t.nodes.push(TopologyNode::Gpu(gpu));
    t.link_both(node_id, PCIE, 0);
    t.build()
}

fn base_gpu(gpu_id: u32) -> GpuNode {
    GpuNode {
        node_id: 1,
        gpu_id,
        simd_count: 416,
        mem_banks_count: 1,
        caches_count: 273,
        io_links_count: 1,
        vendor_id: 0x1002,
        device_id: 0x740f,
        fw_version: 78,
        sdma_fw_version: 8,
        num_gws: 64,
        capability: 0x2c83_2080,
        vram_public: true,
        vram_size: 64 << 30,
        drm_render_minor: 128,
        ..GpuNode::default()
    }
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let owned: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| {
        owned
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }
}

#[test]
fn firmware_mismatch_with_check_on_and_off() {
    let src = single(GpuNode {
        fw_version: 80,
        ..base_gpu(0xA000)
    });
    let dst = single(base_gpu(0xB000));
    let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            MapError::NoCompatibleGpu {
                checkpoint_gpu_id: 0xA000,
                ..
            }
        ),
        "{text}"
    );
    assert!(
        text.contains("fw_version 78") && text.contains("KFD_FW_VER_CHECK"),
        "{text}"
    );

    let off = CompatChecks::from_env(env(&[("KFD_FW_VER_CHECK", "no")]));
    assert!(!off.fw_version);
    let map = map_gpus(&src, &dst, &off).expect("maps with the check off");
    assert_eq!(map.restore_gpu_id(0xA000), Some(0xB000));
    // An older checkpoint firmware is always fine.
    let older = single(GpuNode {
        fw_version: 10,
        ..base_gpu(0xA000)
    });
    assert!(map_gpus(&older, &dst, &CompatChecks::default()).is_ok());
}

#[test]
fn each_switch_governs_its_property() {
    type Tweak = fn(&mut GpuNode);
    let cases: [(&str, Tweak); 6] = [
        ("KFD_FW_VER_CHECK", |g| g.fw_version += 1),
        ("KFD_SDMA_FW_VER_CHECK", |g| g.sdma_fw_version += 1),
        ("KFD_CACHES_COUNT_CHECK", |g| g.caches_count += 1),
        ("KFD_NUM_GWS_CHECK", |g| g.num_gws += 1),
        ("KFD_VRAM_SIZE_CHECK", |g| g.vram_size += 1),
        ("KFD_CAPABILITY_CHECK", |g| g.capability ^= 1),
    ];
    let dst = single(base_gpu(0xB000));
    for (var, tweak) in cases {
        let mut g = base_gpu(0xA000);
        tweak(&mut g);
        let src = single(g);
        let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
        assert!(err.to_string().contains(var), "{var}: {err}");
        let off = CompatChecks::from_env(env(&[(var, "0")]));
        assert!(map_gpus(&src, &dst, &off).is_ok(), "{var} off");
    }
    // A property outside the switches always has to match.
    let src = single(GpuNode {
        device_id: 0x7408,
        ..base_gpu(0xA000)
    });
    let all_off = CompatChecks::from_env(env(&CompatChecks::ENV_VARS.map(|v| (v, "NO"))));
    let err = map_gpus(&src, &dst, &all_off).unwrap_err();
    assert!(err.to_string().contains("device_id"), "{err}");
}

#[test]
fn numa_switch() {
    // Checkpoint: both GPUs on CPU 0. Restore: one GPU per CPU.
    let build = |base: u32, cpus: [u32; 2]| {
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for (i, cpu) in cpus.into_iter().enumerate() {
            let n = u32::try_from(i).unwrap() + 2;
            t.gpu(n, base + n, 0xD000);
            t.link_both(n, PCIE, cpu);
        }
        t.build()
    };
    let src = build(0xA000, [0, 0]);
    let dst = build(0xB000, [0, 1]);
    let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
    assert!(matches!(err, MapError::NoConsistentMapping { .. }), "{err}");
    let off = CompatChecks::from_env(env(&[("KFD_NUMA_CHECK", "No")]));
    let map = map_gpus(&src, &dst, &off).expect("maps without NUMA check");
    assert_eq!(map.len(), 2);
    assert!(map.cpu_mappings().is_empty());
}

#[test]
fn env_parsing_matches_upstream() {
    assert_eq!(CompatChecks::from_env(|_| None), CompatChecks::default());
    for (value, want) in [
        ("0", false),
        ("no", false),
        ("NO", false),
        ("nO", false),
        ("1", true),
        ("yes", true),
    ] {
        let c = CompatChecks::from_env(env(&[("KFD_NUMA_CHECK", value)]));
        assert_eq!(c.numa, want, "{value}");
    }
    // Invalid values keep the default (on).
    for value in ["", "false", "off", " 0", "2", "y"] {
        let c = CompatChecks::from_env(env(&[("KFD_VRAM_SIZE_CHECK", value)]));
        assert!(c.vram_size, "{value:?}");
    }
    let c = CompatChecks::from_env(env(&[
        ("KFD_FW_VER_CHECK", "0"),
        ("KFD_SDMA_FW_VER_CHECK", "0"),
        ("KFD_CACHES_COUNT_CHECK", "0"),
        ("KFD_NUM_GWS_CHECK", "0"),
        ("KFD_VRAM_SIZE_CHECK", "0"),
        ("KFD_NUMA_CHECK", "0"),
        ("KFD_CAPABILITY_CHECK", "0"),
    ]));
    assert_eq!(
        c,
        CompatChecks {
            fw_version: false,
            sdma_fw_version: false,
            caches_count: false,
            num_gws: false,
            vram_size: false,
            numa: false,
            capability: false,
        }
    );
}

// ----- counts ----------------------------------------------------------------

#[test]
fn too_few_gpus_names_what_is_missing() {
    let src = five_gpus(0xA000, [0xD000; 5], 0);
    let mut dst = five_gpus(0xB000, [0xD000; 5], 0);
    dst.retain_accessible(|g| g.gpu_id < 0xB002);
    let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
    assert_eq!(
        err,
        MapError::GpuCountMismatch {
            checkpoint: vec![0xA000, 0xA001, 0xA002, 0xA003, 0xA004],
            restore: vec![0xB000, 0xB001],
        }
    );
    let text = err.to_string();
    assert!(text.contains("used 5 GPUs"), "{text}");
    assert!(
        text.contains("0xa000, 0xa001, 0xa002, 0xa003, 0xa004"),
        "{text}"
    );
    assert!(text.contains("only 2 usable GPUs"), "{text}");
    assert!(text.contains("3 missing"), "{text}");

    let err = map_gpus(&dst, &src, &CompatChecks::default()).unwrap_err();
    assert!(err.to_string().contains("hide the extra GPUs"), "{err}");
}

#[test]
fn no_gpus_on_either_side_is_an_empty_map() {
    let mut t = Tb::default();
    t.cpu(0);
    let t = t.build();
    let map = map_gpus(&t, &t, &CompatChecks::default()).expect("trivially maps");
    assert!(map.is_empty());
}

#[test]
fn search_stays_bounded_on_many_identical_gpus() {
    // 16 identical GPUs with no way to satisfy NUMA: every checkpoint GPU
    // sits on CPU 0 but restore GPUs are spread over 2 CPUs.
    let build = |base: u32, spread: bool| {
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for n in 2..18u32 {
            let cpu = if spread { n & 1 } else { 0 };
            t.gpu(n, base + n, 0xD000);
            t.link_both(n, PCIE, cpu);
        }
        t.build()
    };
    let err = map_gpus(
        &build(0xA000, false),
        &build(0xB000, true),
        &CompatChecks::default(),
    )
    .unwrap_err();
    assert!(matches!(err, MapError::NoConsistentMapping { .. }), "{err}");
}
