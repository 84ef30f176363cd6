//! The GPU listing and the restore's GPU map.

use super::*;

fn uuid(n: u8) -> GpuUuid {
    GpuUuid([n; 16])
}

fn gpu(n: u8, model: &str) -> Gpu {
    Gpu {
        uuid: uuid(n),
        model: model.into(),
        bus: format!("0000:00:0{n}.0"),
        memory: 0,
        minor: None,
    }
}

#[test]
fn reads_the_kernel_driver_listing() {
    let dir = std::env::temp_dir().join(format!("nv-gpus-{}", std::process::id()));
    for (bus, n) in [("0000:00:07.0", 2u8), ("0000:00:06.0", 1)] {
        std::fs::create_dir_all(dir.join(bus)).unwrap();
        std::fs::write(
            dir.join(bus).join("information"),
            format!(
                "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nGPU UUID: \t {}\nBus Location: \t {bus}\n",
                uuid(n)
            ),
        )
        .unwrap();
    }
    let gpus = read_gpus(&dir, Path::new("/dev")).unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0].bus, "0000:00:06.0");
    assert_eq!(gpus[0].uuid, uuid(1));
    assert_eq!(gpus[1].model, "NVIDIA H100 80GB HBM3");
    // A GPU whose device node is missing (a container's device list) is left out.
    let info = format!("Model: M\nGPU UUID: {}\nDevice Minor: 7\n", uuid(1));
    std::fs::write(dir.join("0000:00:06.0/information"), info).unwrap();
    let gpus = read_gpus(&dir, &dir).unwrap();
    assert_eq!(gpus.len(), 1);
    assert_eq!(gpus[0].uuid, uuid(2));
    std::fs::write(dir.join("0000:00:06.0/information"), "Model: X\n").unwrap();
    assert!(
        read_gpus(&dir, Path::new("/dev"))
            .unwrap_err()
            .to_string()
            .contains("no `GPU UUID`")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn device_map_syntax() {
    let m = parse_device_map(&format!("{}={}, {}={}", uuid(1), uuid(2), uuid(3), uuid(4))).unwrap();
    assert_eq!(m.len(), 2);
    assert_eq!((m[1].old, m[1].new), (uuid(3), uuid(4)));
    assert!(parse_device_map("GPU-1").is_err());
    assert!(parse_device_map(&format!("{0}={1},{0}={1}", uuid(1), uuid(2))).is_err());
    assert_eq!(parse_device_map(" ").unwrap(), vec![]);
}

#[test]
fn same_machine_maps_to_itself() {
    let here = vec![gpu(1, "H100"), gpu(2, "H100")];
    let map = plan_gpu_map(&here, &here, &[]).unwrap();
    assert!(is_identity(&map));
    assert_eq!(map.len(), 2);
}

#[test]
fn explicit_pairs_then_same_model_in_order() {
    let ckpt = vec![gpu(1, "H100"), gpu(2, "H100")];
    let here = vec![gpu(7, "H100"), gpu(8, "H100"), gpu(9, "H100")];
    let explicit = [GpuPair {
        old: uuid(2),
        new: uuid(7),
    }];
    let map = plan_gpu_map(&ckpt, &here, &explicit).unwrap();
    assert_eq!(map[0].new, uuid(8));
    assert_eq!(map[1].new, uuid(7));
    assert!(!is_identity(&map));
}

#[test]
fn a_container_given_another_gpu_is_mapped_onto_it() {
    // Checkpointed on GPU 1 of a two-GPU host; the restored container reaches GPU 2 only
    // (GPU 1 is left out of the reachable list, whatever the host has).
    let map = plan_gpu_map(&[gpu(1, "H100")], &[gpu(2, "H100")], &[]).unwrap();
    assert_eq!((map[0].old, map[0].new), (uuid(1), uuid(2)));
    // Two checkpointed GPUs onto the two the container reaches, in PCI order.
    let map = plan_gpu_map(
        &[gpu(1, "H100"), gpu(2, "H100")],
        &[gpu(3, "H100"), gpu(4, "H100")],
        &[],
    )
    .unwrap();
    assert_eq!(
        map.iter().map(|p| p.new).collect::<Vec<_>>(),
        [uuid(3), uuid(4)]
    );
    // A GPU kept where reachable, the other moved.
    let map = plan_gpu_map(
        &[gpu(1, "H100"), gpu(2, "H100")],
        &[gpu(2, "H100"), gpu(5, "H100")],
        &[],
    )
    .unwrap();
    assert_eq!((map[0].new, map[1].new), (uuid(5), uuid(2)));
}

#[test]
fn the_device_map_wins_but_never_names_an_unreachable_gpu() {
    let here = [gpu(1, "H100"), gpu(2, "H100")];
    // The map sends GPU 1 to GPU 2 although GPU 1 is reachable; GPU 2 then goes to 1.
    let explicit = [GpuPair {
        old: uuid(1),
        new: uuid(2),
    }];
    let map = plan_gpu_map(&here, &here, &explicit).unwrap();
    assert_eq!((map[0].new, map[1].new), (uuid(2), uuid(1)));
    // GPU 3 exists on the host but the container cannot reach it: not in `local`.
    let explicit = [GpuPair {
        old: uuid(1),
        new: uuid(3),
    }];
    let err = plan_gpu_map(&here[..1], &here[1..], &explicit)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not among the GPUs reachable here"), "{err}");
}

#[test]
fn another_machines_gpus_are_refused_whole_naming_the_gpu() {
    // Of two checkpointed GPUs, one has a counterpart and one not: nothing is planned.
    let err = plan_gpu_map(
        &[gpu(1, "H100"), gpu(2, "A100")],
        &[gpu(7, "H100"), gpu(8, "L4")],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(&format!("checkpointed GPU {} (A100)", uuid(2))),
        "{err}"
    );
    assert!(err.contains(&format!("free: [{} (L4)]", uuid(8))), "{err}");
    // No GPU reachable at all (a container given none).
    let err = plan_gpu_map(&[gpu(1, "H100")], &[], &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("0 reachable here"), "{err}");
}

#[test]
fn a_listing_says_why_gpus_are_left_out() {
    let dir = std::env::temp_dir().join(format!("nv-listing-{}", std::process::id()));
    for (bus, n, minor) in [("0000:00:06.0", 1u8, "0"), ("0000:00:07.0", 2, "")] {
        std::fs::create_dir_all(dir.join(bus)).unwrap();
        let minor = if minor.is_empty() {
            String::new()
        } else {
            format!("Device Minor: \t {minor}\n")
        };
        std::fs::write(
            dir.join(bus).join("information"),
            format!("Model: M\nGPU UUID: {}\n{minor}", uuid(n)),
        )
        .unwrap();
    }
    // No node for minor 0 in `dir`: GPU 1 is left out, GPU 2 (no minor) counts.
    let l = read_listing(&dir, &dir).unwrap();
    assert_eq!(l.reachable.len(), 1);
    assert_eq!(l.reachable[0].uuid, uuid(2));
    assert_eq!(l.left_out.len(), 1);
    let text = l.describe();
    assert!(
        text.contains(&format!(
            "GPUs reachable here: {} (M, 0000:00:07.0)",
            uuid(2)
        )),
        "{text}"
    );
    assert!(text.contains("nvidia0 does not exist"), "{text}");
    assert!(
        GpuListing::default()
            .describe()
            .contains("here: none; not reachable: none")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn refusals_say_what_is_wrong() {
    let ckpt = vec![gpu(1, "H100"), gpu(2, "H100")];
    let err = plan_gpu_map(&ckpt, &[gpu(1, "H100")], &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no counterpart")
            && err.contains("2 GPU(s) checkpointed [")
            && err.contains("1 reachable here"),
        "{err}"
    );
    let err = plan_gpu_map(&ckpt[..1], &[gpu(5, "A100")], &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("no counterpart"), "{err}");
    let explicit = [GpuPair {
        old: uuid(1),
        new: uuid(5),
    }];
    let err = plan_gpu_map(&ckpt[..1], &[gpu(5, "A100")], &explicit)
        .unwrap_err()
        .to_string();
    assert!(err.contains("same model"), "{err}");
    let explicit = [GpuPair {
        old: uuid(9),
        new: uuid(1),
    }];
    assert!(
        plan_gpu_map(&ckpt, &ckpt, &explicit)
            .unwrap_err()
            .to_string()
            .contains("did not use")
    );
    let mut small = gpu(1, "H100");
    small.memory = 40 << 30;
    let mut big = gpu(1, "H100");
    big.memory = 80 << 30;
    assert!(
        plan_gpu_map(&[big], &[small], &[])
            .unwrap_err()
            .to_string()
            .contains("less than")
    );
}
