//! Container device lists, render-node helpers and the image form.

use super::*;

#[test]
fn gpus_hidden_by_container_device_list() {
    let host = Topology::from_sysfs(&fixture("8gpu-2hives")).expect("fixture parses");
    // The checkpoint ran in a container that saw the first hive only.
    let mut ckpt_host = host.clone();
    let visible: BTreeSet<u32> = (128..132).collect();
    let hidden = ckpt_host.retain_accessible(|g| visible.contains(&g.drm_render_minor));
    assert_eq!(hidden, vec![10086, 30511, 47612, 63009]);
    let ckpt = identity_image(&ckpt_host);
    assert_eq!(ckpt.gpu_count(), 4);
    assert_eq!(ckpt.xgmi_hives().len(), 1);
    // The CPU node 1 links to hidden GPUs only: those links are gone.
    let cpu1 = ckpt.nodes().iter().find(|n| n.node_id() == 1).unwrap();
    assert!(cpu1.io_links().is_empty());

    // Restore in a container exposing the *other* hive's render nodes.
    let mut restore = host.clone();
    let visible: BTreeSet<u32> = (132..136).collect();
    restore.retain_accessible(|g| visible.contains(&g.drm_render_minor));
    let map = map_gpus(&ckpt, &restore, &CompatChecks::default()).expect("maps");
    for m in &map {
        assert!(visible.contains(&m.restore_render_minor), "{m:?}");
        assert_eq!(
            map.get_by_checkpoint_render_minor(m.checkpoint_render_minor),
            Some(m)
        );
    }
    assert_eq!(
        map.get(7740)
            .map(|m| (m.restore_gpu_id, m.restore_render_minor)),
        Some((10086, 132))
    );
    assert_eq!(map.cpu_mappings(), &[(0, 1)]);

    // Without the device-list filter the restore host shows 8 GPUs.
    let err = map_gpus(&ckpt, &host, &CompatChecks::default()).unwrap_err();
    assert!(matches!(err, MapError::GpuCountMismatch { .. }), "{err}");
}

#[test]
fn render_minor_helpers() {
    assert_eq!(
        render_node_path(128),
        Some(PathBuf::from("/dev/dri/renderD128"))
    );
    assert_eq!(
        render_node_path(255),
        Some(PathBuf::from("/dev/dri/renderD255"))
    );
    assert_eq!(render_node_path(127), None);
    assert_eq!(render_node_path(256), None);
    assert_eq!(render_node_path(0), None);

    let dir = TempDir::new("dri");
    for name in [
        "renderD128",
        "renderD130",
        "card0",
        "renderD",
        "renderD12x",
        "renderD300",
        "by-path",
    ] {
        fs::write(dir.path().join(name), b"").unwrap();
    }
    let minors = present_render_minors(dir.path()).unwrap();
    assert_eq!(minors, BTreeSet::from([128, 130]));

    let mut t = Topology::from_sysfs(&fixture("2gpu")).unwrap();
    let removed = t.retain_accessible(|g| minors.contains(&g.drm_render_minor));
    assert_eq!(removed, vec![1266]);
    assert_eq!(t.gpus().map(|g| g.gpu_id).collect::<Vec<_>>(), vec![53109]);
}

// ----- image conversion ----------------------------------------------------

#[test]
fn device_info_round_trip() {
    let host = Topology::from_sysfs(&fixture("8gpu-2hives")).unwrap();
    let infos = host.to_device_entries(|actual| Some(actual ^ 0x8000));
    assert_eq!(infos.len(), 10);
    let cpu = &infos[0];
    assert_eq!(
        (cpu.gpu_id, cpu.cpu_cores_count, cpu.simd_count),
        (0, 64, 0)
    );
    let gpu = &infos[2];
    assert_eq!(gpu.gpu_id, 7740 ^ 0x8000);
    assert_eq!(gpu.cpu_cores_count, 0);
    assert_eq!(gpu.gds_size_in_kb, 0);
    assert_eq!(gpu.vram_public, 1);
    assert_eq!(gpu.iolinks.len(), 4);
    assert!(gpu.iolinks.contains(&EntryLink {
        link_type: 11,
        node_to_id: 3
    }));

    let back = Topology::from_device_entries(&infos).unwrap();
    assert_eq!(back.gpu_count(), 8);
    for (a, b) in host.gpus().zip(back.gpus()) {
        assert_eq!(
            GpuNode {
                gpu_id: a.gpu_id ^ 0x8000,
                ..a.clone()
            },
            *b
        );
    }
    assert_eq!(back.xgmi_hives().len(), 2);
    // Checkpoint == restore host, so the mapping is the user-id identity.
    let map = map_gpus(&back, &host, &CompatChecks::default()).unwrap();
    for m in &map {
        assert_eq!(m.checkpoint_gpu_id ^ 0x8000, m.restore_gpu_id);
        assert_eq!(m.checkpoint_render_minor, m.restore_render_minor);
    }
}

#[test]
fn gpus_not_reported_by_kfd_are_left_out_of_the_image() {
    let host = Topology::from_sysfs(&fixture("2gpu")).unwrap();
    let infos = host.to_device_entries(|actual| (actual == 1266).then_some(0x4242));
    assert_eq!(infos.len(), 2, "CPU and the reported GPU");
    assert_eq!(infos[1].gpu_id, 0x4242);
    assert_eq!(infos[1].node_id, 2);
    // The CPU's link to the left-out GPU (node 1) is dropped.
    assert_eq!(
        infos[0].iolinks,
        vec![EntryLink {
            link_type: 2,
            node_to_id: 2
        }]
    );
}

#[test]
fn device_infos_are_validated() {
    let gpu = DeviceEntry {
        node_id: 1,
        gpu_id: 0x10,
        ..DeviceEntry::default()
    };
    let err = Topology::from_device_entries(&[gpu.clone(), gpu.clone()]).unwrap_err();
    assert!(err.to_string().contains("node id 1 appears twice"), "{err}");
    let other = DeviceEntry {
        node_id: 2,
        ..gpu.clone()
    };
    let err = Topology::from_device_entries(&[gpu.clone(), other]).unwrap_err();
    assert!(
        err.to_string().contains("gpu id 0x0010 appears twice"),
        "{err}"
    );
    // Unknown link types are dropped, links to absent nodes are invalid.
    let cpu = DeviceEntry {
        node_id: 0,
        cpu_cores_count: 8,
        iolinks: vec![
            EntryLink {
                link_type: 1,
                node_to_id: 1,
            },
            EntryLink {
                link_type: 2,
                node_to_id: 7,
            },
        ],
        ..DeviceEntry::default()
    };
    let t = Topology::from_device_entries(&[cpu, gpu]).unwrap();
    assert_eq!(
        t.nodes()[0].io_links(),
        &[IoLink {
            link_type: PCIE,
            node_to: 7
        }]
    );
}
