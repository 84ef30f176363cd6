//! Parsing the sysfs fixtures and hostile sysfs trees.

use super::*;

// ----- sysfs fixtures ----------------------------------------------------------

#[test]
fn parses_one_gpu_fixture() {
    let t = Topology::from_sysfs(&fixture("1gpu")).unwrap();
    assert_eq!(t.nodes().len(), 2);
    let TopologyNode::Cpu(cpu) = &t.nodes()[0] else {
        panic!("node 0 is a CPU")
    };
    assert_eq!(cpu.cpu_cores_count, 32);
    assert_eq!(
        cpu.io_links,
        vec![IoLink {
            link_type: PCIE,
            node_to: 1
        }]
    );
    let g = t.gpu_by_id(53109).expect("GPU present");
    assert_eq!(t.gpu_by_render_minor(128), Some(g));
    let want = GpuNode {
        node_id: 1,
        gpu_id: 53109,
        simd_count: 416,
        mem_banks_count: 1,
        caches_count: 273,
        io_links_count: 1,
        max_waves_per_simd: 8,
        lds_size_in_kb: 64,
        num_gws: 64,
        wave_front_size: 64,
        array_count: 8,
        simd_arrays_per_engine: 1,
        cu_per_simd_array: 13,
        simd_per_cu: 4,
        max_slots_scratch_cu: 32,
        vendor_id: 4098,
        device_id: 29711,
        domain: 0,
        drm_render_minor: 128,
        hive_id: 0,
        num_sdma_engines: 2,
        num_sdma_xgmi_engines: 3,
        num_sdma_queues_per_engine: 8,
        num_cp_queues: 24,
        fw_version: 78,
        capability: 746824320,
        sdma_fw_version: 8,
        vram_public: true,
        vram_size: 68702699520,
        io_links: vec![IoLink {
            link_type: PCIE,
            node_to: 0,
        }],
    };
    assert_eq!(*g, want);
    assert!(t.xgmi_hives().is_empty());
    let same = identity_image(&t);
    let map = map_gpus(&same, &t, &CompatChecks::default()).unwrap();
    assert_eq!(map.restore_gpu_id(53109), Some(53109));
    assert_eq!(map.restore_gpu_id(1), None);
}

#[test]
fn parses_two_gpu_fixture_ignoring_p2p_links() {
    let t = Topology::from_sysfs(&fixture("2gpu")).unwrap();
    assert_eq!(
        t.gpus()
            .map(|g| (g.gpu_id, g.drm_render_minor))
            .collect::<Vec<_>>(),
        vec![(53109, 128), (1266, 129)]
    );
    for g in t.gpus() {
        assert_eq!(
            g.io_links,
            vec![IoLink {
                link_type: PCIE,
                node_to: 0
            }]
        );
    }
    // Two identical GPUs: checkpoint order reversed still maps cleanly,
    // searching from the last GPU as upstream does.
    let ckpt = identity_image(&t);
    let map = map_gpus(&ckpt, &t, &CompatChecks::default()).unwrap();
    assert_eq!(
        gpu_pairs(&map),
        BTreeMap::from([(53109, 53109), (1266, 1266)])
    );
}

#[test]
fn parses_eight_gpu_fixture() {
    let t = Topology::from_sysfs(&fixture("8gpu-2hives")).unwrap();
    assert_eq!(t.nodes().len(), 10);
    assert_eq!(t.gpu_count(), 8);
    assert_eq!(
        t.xgmi_hives(),
        vec![
            vec![7740, 22413, 41060, 55027],
            vec![10086, 30511, 47612, 63009]
        ]
    );
    // The CPU-to-CPU link (type 1) is dropped; the four GPU links stay.
    let TopologyNode::Cpu(cpu) = &t.nodes()[1] else {
        panic!("node 1 is a CPU")
    };
    assert_eq!(
        cpu.io_links.iter().map(|l| l.node_to).collect::<Vec<_>>(),
        vec![6, 7, 8, 9]
    );
    let g = t.gpu_by_id(22413).unwrap();
    assert_eq!(g.hive_id, 0x5A1B_2C3D_4E5F_6071);
    assert_eq!(g.vram_size, 34342961152);
    assert_eq!(g.io_links.iter().filter(|l| l.link_type == XGMI).count(), 3);
}

/// A minimal tree: CPU node 0 and GPU node 1, with `gpu_props` as the
/// GPU's properties file.
fn tree(tag: &str, gpu_props: &[u8]) -> TempDir {
    let dir = TempDir::new(tag);
    let nodes = dir.path().join("nodes");
    let write = |rel: &str, content: &[u8]| {
        let p = nodes.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    };
    write("0/gpu_id", b"0\n");
    write(
        "0/properties",
        b"cpu_cores_count 4\nthis line is never read\n",
    );
    write(
        "0/io_links/0/properties",
        b"type 2\nnode_from 0\nnode_to 1\n",
    );
    write("1/gpu_id", b"4660\n");
    write("1/properties", gpu_props);
    write(
        "1/mem_banks/0/properties",
        b"heap_type 1\nsize_in_bytes 1073741824\n",
    );
    write(
        "1/io_links/0/properties",
        b"type 2\nnode_from 1\nnode_to 0\n",
    );
    dir
}

fn parse_err(dir: &TempDir) -> String {
    let err = Topology::from_sysfs(dir.path()).unwrap_err();
    err.to_string()
}

#[test]
fn minimal_tree_parses_and_cpu_stops_early() {
    let dir = tree(
        "ok",
        b"simd_count 4\n\ndevice_id 1\nsome_future_property_with_a_long_name_31 7\n",
    );
    let t = Topology::from_sysfs(dir.path()).unwrap();
    assert_eq!(t.nodes().len(), 2);
    let g = t.gpu_by_id(4660).unwrap();
    assert_eq!((g.simd_count, g.device_id, g.vram_size), (4, 1, 1 << 30));
}

#[test]
fn hostile_values_are_errors() {
    let cases: [(&str, &[u8], &str); 8] = [
        ("nonnum", b"simd_count four\n", "not a decimal number"),
        ("negative", b"simd_count -1\n", "not a decimal number"),
        ("trailing", b"simd_count 12abc\n", "not a decimal number"),
        (
            "u64",
            b"hive_id 18446744073709551616\n",
            "does not fit in 64 bits",
        ),
        ("u32", b"device_id 4294967296\n", "does not fit in 32 bits"),
        ("pair", b"simd_count\n", "not a \"name value\" pair"),
        ("triple", b"simd_count 1 2\n", "not a \"name value\" pair"),
        ("name", &[b'x'; 65], "longer than 64"),
    ];
    for (tag, props, want) in cases {
        let mut props = props.to_vec();
        if tag == "name" {
            props.extend_from_slice(b" 1\n");
        }
        let dir = tree(tag, &props);
        let msg = parse_err(&dir);
        assert!(msg.contains(want), "{tag}: {msg}");
        assert!(msg.contains("nodes/1/properties"), "{tag}: {msg}");
    }
    // A 64-character name is fine.
    let mut ok = vec![b'y'; 64];
    ok.extend_from_slice(b" 1\n");
    let dir = tree("name64", &ok);
    assert!(Topology::from_sysfs(dir.path()).is_ok());
}

#[test]
fn huge_files_are_refused() {
    let mut huge = Vec::new();
    while huge.len() <= MAX_SYSFS_FILE_BYTES {
        huge.extend_from_slice(b"simd_count 1\n");
    }
    let dir = tree("huge", &huge);
    let err = Topology::from_sysfs(dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            TopologyError::TooLarge {
                limit: MAX_SYSFS_FILE_BYTES,
                ..
            }
        ),
        "{err}"
    );

    let dir = tree("hugeid", b"simd_count 1\n");
    fs::write(dir.path().join("nodes/1/gpu_id"), vec![b'1'; 1 << 20]).unwrap();
    let err = Topology::from_sysfs(dir.path()).unwrap_err();
    assert!(matches!(err, TopologyError::TooLarge { .. }), "{err}");

    let dir = tree("binary", b"simd_count 1\n");
    fs::write(dir.path().join("nodes/1/properties"), [0xff, 0xfe, b'\n']).unwrap();
    assert!(parse_err(&dir).contains("not valid UTF-8"));
}

#[test]
fn too_many_directory_entries_are_refused() {
    let dir = TempDir::new("many");
    for i in 0..10 {
        fs::write(dir.path().join(format!("{}", 9 - i)), b"").unwrap();
    }
    let sorted: Vec<u32> = numeric_entries_capped(dir.path(), false, 10)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    fs::write(dir.path().join("x"), b"").unwrap();
    let err = numeric_entries_capped(dir.path(), false, 10).unwrap_err();
    assert!(
        matches!(err, TopologyError::TooLarge { limit: 10, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("exceeds the limit of 10"), "{err}");
    assert!(
        numeric_entries(&dir.path().join("absent"), true)
            .unwrap()
            .is_empty()
    );
    assert!(numeric_entries(&dir.path().join("absent"), false).is_err());
}

#[test]
fn gpu_id_handling() {
    // Garbage in a readable gpu_id is an error...
    for (tag, content) in [
        ("idtext", &b"abc\n"[..]),
        ("idneg", b"-5\n"),
        ("idbig", b"99999999999\n"),
        ("idempty", b""),
    ] {
        let dir = tree(tag, b"simd_count 1\n");
        fs::write(dir.path().join("nodes/1/gpu_id"), content).unwrap();
        assert!(parse_err(&dir).contains("gpu_id"), "{tag}");
    }
    // ...while an unreadable one skips the node (cgroup masking), and so
    // does a missing one. Links to the skipped node become invalid.
    let dir = tree("idmissing", b"simd_count 1\n");
    fs::remove_file(dir.path().join("nodes/1/gpu_id")).unwrap();
    let t = Topology::from_sysfs(dir.path()).unwrap();
    assert_eq!(t.gpu_count(), 0);
    let dir = tree("iddir", b"simd_count 1\n");
    let id = dir.path().join("nodes/1/gpu_id");
    fs::remove_file(&id).unwrap();
    fs::create_dir(&id).unwrap();
    assert_eq!(Topology::from_sysfs(dir.path()).unwrap().gpu_count(), 0);
    // Duplicate gpu ids are an error.
    let dir = tree("iddup", b"simd_count 1\n");
    let src = dir.path().join("nodes/1");
    let dst = dir.path().join("nodes/2");
    fs::create_dir_all(dst.join("mem_banks/0")).unwrap();
    for f in ["gpu_id", "properties", "mem_banks/0/properties"] {
        fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    assert!(parse_err(&dir).contains("appears twice"));
}

#[test]
fn vram_and_link_rules() {
    // No FB bank.
    let dir = tree("nofb", b"simd_count 1\n");
    fs::write(
        dir.path().join("nodes/1/mem_banks/0/properties"),
        b"heap_type 0\nsize_in_bytes 5\n",
    )
    .unwrap();
    assert!(matches!(
        Topology::from_sysfs(dir.path()).unwrap_err(),
        TopologyError::NoVram { .. }
    ));
    // First FB bank of size 0.
    fs::write(
        dir.path().join("nodes/1/mem_banks/0/properties"),
        b"heap_type 2\nsize_in_bytes 0\n",
    )
    .unwrap();
    assert!(parse_err(&dir).contains("frame-buffer"));
    // A private FB bank after a system bank.
    fs::write(
        dir.path().join("nodes/1/mem_banks/0/properties"),
        b"heap_type 0\nsize_in_bytes 5\n",
    )
    .unwrap();
    fs::create_dir_all(dir.path().join("nodes/1/mem_banks/1")).unwrap();
    fs::write(
        dir.path().join("nodes/1/mem_banks/1/properties"),
        b"heap_type 2\nsize_in_bytes 7\n",
    )
    .unwrap();
    let g = Topology::from_sysfs(dir.path())
        .unwrap()
        .gpu_by_id(4660)
        .unwrap()
        .clone();
    assert_eq!((g.vram_public, g.vram_size), (false, 7));
    // Missing mem_banks on a GPU is an error.
    fs::remove_dir_all(dir.path().join("nodes/1/mem_banks")).unwrap();
    assert!(parse_err(&dir).contains("mem_banks"));

    // A missing io_links directory means no links.
    let dir = tree("nolinks", b"simd_count 1\n");
    fs::remove_dir_all(dir.path().join("nodes/1/io_links")).unwrap();
    let t = Topology::from_sysfs(dir.path()).unwrap();
    assert!(t.gpu_by_id(4660).unwrap().io_links.is_empty());
    // A kept link without node_to is an error; other types are dropped.
    let dir = tree("nodeto", b"simd_count 1\n");
    let link = dir.path().join("nodes/1/io_links/0/properties");
    fs::write(&link, b"type 11\n").unwrap();
    assert!(parse_err(&dir).contains("no node_to"));
    fs::write(&link, b"type 5\nnode_to 0\n").unwrap();
    let t = Topology::from_sysfs(dir.path()).unwrap();
    assert!(t.gpu_by_id(4660).unwrap().io_links.is_empty());
    // An unreadable properties file is an error naming the file.
    fs::remove_file(dir.path().join("nodes/1/properties")).unwrap();
    let err = Topology::from_sysfs(dir.path()).unwrap_err();
    assert!(
        matches!(err, TopologyError::Io { .. }) && err.source().is_some(),
        "{err}"
    );
    assert!(err.to_string().contains("nodes/1/properties"), "{err}");
}

#[test]
fn non_numeric_node_entries_are_ignored_and_root_must_exist() {
    let dir = tree("extra", b"simd_count 1\n");
    fs::create_dir_all(dir.path().join("nodes/foo")).unwrap();
    fs::write(dir.path().join("nodes/7"), b"not a dir").unwrap();
    assert_eq!(Topology::from_sysfs(dir.path()).unwrap().nodes().len(), 2);
    let missing = dir.path().join("absent");
    let err = Topology::from_sysfs(&missing).unwrap_err();
    assert!(err.to_string().starts_with("cannot read"), "{err}");
}
