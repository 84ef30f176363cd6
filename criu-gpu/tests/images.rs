//! `criu-gpu inspect` and `check` on images real CRIU wrote with the plugin (on the stand-in
//! CUDA driver), on tar, tar.gz and tar.zst archives of them (Podman's `checkpoint/` layout),
//! on AMD images written by the plugin's own image writer (hand-made archives: `archives.rs`).

mod support;

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use criu_gpu_core::images::amd::{
    self as amd, BoEntry, DeviceEntry, ImageDir, KfdCheckpoint, PagesLayout,
};
use criu_gpu_core::images::metadata::CudaMetadata;
use criu_gpu_test_support::foreign_arch;
use support::T;

/// Dumps a CUDA tree of 2 processes with real CRIU and the plugin; returns the image dir.
fn cuda_images(t: &T) -> PathBuf {
    let w = t.workload("w", 1, 4);
    let images = t.dir.join("img");
    std::fs::create_dir_all(&images).unwrap();
    let mut cmd = Command::new(criu_gpu_test_support::criu_binary());
    cmd.args(["dump", "-t", &w.root().to_string(), "-L"])
        .arg(criu_gpu_test_support::plugin_libdir())
        .arg("-D")
        .arg(&images)
        .args(["-o", "dump.log", "-v4"]);
    for (k, v) in t.env() {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run criu (set CRIU_BIN)");
    let log = std::fs::read_to_string(images.join("dump.log")).unwrap_or_default();
    assert!(out.status.success(), "criu dump failed: {out:?}\n{log}");
    assert!(images.join("gpu-plugin-cuda.img").is_file(), "{log}");
    images
}

/// `tar` of `dir` with the images under `checkpoint/`, as Podman exports them.
fn archive(t: &T, dir: &Path, name: &str, compress: Option<&str>) -> PathBuf {
    let stage = t.dir.join(format!("stage-{name}"));
    std::fs::create_dir_all(stage.join("checkpoint")).unwrap();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        std::fs::copy(e.path(), stage.join("checkpoint").join(e.file_name())).unwrap();
    }
    std::fs::write(stage.join("config.dump"), "{}").unwrap();
    let out = t.dir.join(name);
    let mut cmd = Command::new("tar");
    cmd.arg("-C").arg(&stage).arg("-cf").arg(&out);
    if let Some(c) = compress {
        cmd.arg(c);
    }
    cmd.args(["checkpoint", "config.dump"]);
    assert!(cmd.status().unwrap().success());
    out
}

#[test]
fn a_cuda_checkpoint_is_inspected_and_checked_from_a_directory_and_archives() {
    let t = T::start("img-cuda");
    let images = cuda_images(&t);
    let gpu = t.gpus(1, 0).remove(0);

    let i = t.tool(&["inspect", images.to_str().unwrap()], &[]);
    assert_eq!(i.code, Some(0), "{i:?}");
    assert!(i.stdout.contains("NVIDIA: driver"), "{}", i.stdout);
    assert!(
        i.stdout.contains("1 GPU(s), 2 CUDA process(es)"),
        "{}",
        i.stdout
    );
    assert!(i.stdout.contains(&gpu.0), "{}", i.stdout);
    assert_eq!(
        i.stdout.matches("running when dumped").count(),
        2,
        "{}",
        i.stdout
    );
    assert!(i.stdout.contains("process tree: 2 task(s)"), "{}", i.stdout);
    assert!(i.stdout.contains("made on: x86_64 (core-"), "{}", i.stdout);

    let c = t.tool(&["check", images.to_str().unwrap()], &[]);
    assert_eq!(c.code, Some(0), "{c:?}");
    assert!(
        c.stdout
            .contains(&format!("map: NVIDIA GPU {0} -> {0}", gpu.0)),
        "{}",
        c.stdout
    );
    assert!(c.stdout.contains("verdict: would restore"), "{}", c.stdout);

    // Another machine: its one GPU is of another model. Every reason is listed.
    let other = t.nvidia_proc(
        "nv-other",
        &[(
            "0000:00:07.0",
            "NVIDIA A100",
            "GPU-11111111-2222-3333-4444-555555555555",
        )],
    );
    let env = [
        ("CRIU_GPU_CUDA_NVIDIA_PROC", other.to_str().unwrap()),
        ("FAKE_CUDA_DRIVER_VERSION", "12080"),
    ];
    let c = t.tool(&["check", images.to_str().unwrap(), "--json"], &env);
    assert_eq!(c.code, Some(1), "{c:?}");
    assert!(
        c.stdout.contains(r#""would_restore":false"#),
        "{}",
        c.stdout
    );
    assert!(
        c.stdout
            .contains("this machine's driver supports only CUDA 12.8"),
        "{}",
        c.stdout
    );
    assert!(c.stdout.contains("no counterpart"), "{}", c.stdout);
    // Too little free GPU memory on the right model, for processes recorded with 2 GiB each
    // (the stand-in driver's device memory is file-backed, so the dump recorded little).
    let big = t.dir.join("img-big");
    std::fs::create_dir_all(&big).unwrap();
    for e in std::fs::read_dir(&images).unwrap().flatten() {
        std::fs::copy(e.path(), big.join(e.file_name())).unwrap();
    }
    let md = std::fs::read(big.join("gpu-plugin-cuda.img")).unwrap();
    let mut md = CudaMetadata::decode_bytes(&md).unwrap();
    for p in &mut md.processes {
        p.host_bytes = 2 << 30;
    }
    let md = md.encode();
    std::fs::write(big.join("gpu-plugin-cuda.img"), md).unwrap();
    let c = t.tool(
        &["check", big.to_str().unwrap()],
        &[("FAKE_NVML_USED_MIB", "79872")],
    );
    assert_eq!(c.code, Some(1), "{c:?}");
    assert!(
        c.stdout.contains("too little free GPU memory"),
        "{}",
        c.stdout
    );
    // A device map naming a GPU the checkpoint did not use.
    let c = t.tool(
        &[
            "check",
            images.to_str().unwrap(),
            "--device-map",
            "GPU-11111111-2222-3333-4444-555555555555=GPU-11111111-2222-3333-4444-555555555556",
        ],
        &[],
    );
    assert_eq!(c.code, Some(1), "{c:?}");
    assert!(c.stdout.contains("did not use"), "{}", c.stdout);

    for (name, flag) in [
        ("c.tar", None),
        ("c.tar.gz", Some("-z")),
        ("c.tar.zst", Some("--zstd")),
    ] {
        let a = archive(&t, &images, name, flag);
        let i = t.tool(&["inspect", a.to_str().unwrap(), "--json"], &[]);
        assert_eq!(i.code, Some(0), "{name}: {i:?}");
        assert!(
            i.stdout.contains(&format!(r#""uuid":"{}""#, gpu.0)),
            "{name}: {}",
            i.stdout
        );
        assert_eq!(
            i.stdout.matches(r#""state":"running""#).count(),
            2,
            "{name}: {}",
            i.stdout
        );
        assert!(i.stdout.contains(r#""tasks":2"#), "{name}: {}", i.stdout);
        assert!(
            i.stdout.contains(r#""architecture":"x86_64""#),
            "{name}: {}",
            i.stdout
        );
        let c = t.tool(&["check", a.to_str().unwrap()], &[]);
        assert_eq!(c.code, Some(0), "{name}: {c:?}");
    }
}

/// A checkpoint whose core images say arm64 (`criu_gpu_test_support::foreign_arch`):
/// `inspect` names the architecture, and `check` of the directory and of an archive says it
/// would not restore here, naming both architectures.
#[test]
fn a_checkpoint_of_another_cpu_architecture_fails_the_check() {
    let t = T::start("img-other-arch");
    let images = cuda_images(&t);
    foreign_arch::dumped_on(&images, foreign_arch::MARCH_AARCH64);
    let i = t.tool(&["inspect", images.to_str().unwrap()], &[]);
    assert_eq!(i.code, Some(0), "{i:?}");
    assert!(i.stdout.contains("made on: aarch64 (core-"), "{}", i.stdout);
    let a = archive(&t, &images, "arm64.tar", None);
    for source in [&images, &a] {
        let c = t.tool(&["check", source.to_str().unwrap()], &[]);
        assert_eq!(c.code, Some(1), "{c:?}");
        for want in [
            "the checkpoint was made on aarch64 (core-",
            "this machine is x86_64",
            "verdict: would NOT restore",
        ] {
            assert!(c.stdout.contains(want), "no `{want}`: {}", c.stdout);
        }
    }
}

/// A KFD image of one GPU with a VRAM, a GTT and a doorbell BO, and its pages file, written
/// by the plugin's image writer.
fn amd_images(t: &T) -> PathBuf {
    let dir = t.dir.join("amd");
    std::fs::create_dir_all(&dir).unwrap();
    let fd = amd::open_image_dir(&dir).unwrap();
    let d = ImageDir::new(fd.as_fd());
    let gpu = 0x1234;
    let img = KfdCheckpoint {
        pid: 77,
        num_of_gpus: 1,
        num_of_cpus: 1,
        devices: vec![
            DeviceEntry {
                node_id: 0,
                cpu_cores_count: 8,
                ..DeviceEntry::default()
            },
            DeviceEntry {
                node_id: 1,
                gpu_id: gpu,
                simd_count: 240,
                simd_per_cu: 4,
                device_id: 0x740f,
                vendor_id: 0x1002,
                drm_render_minor: 128,
                vram_size: 64 << 30,
                ..DeviceEntry::default()
            },
        ],
        bos: vec![
            BoEntry {
                addr: 0x1000_0000,
                size: 2 << 20,
                alloc_flags: amd::KFD_ALLOC_MEM_FLAGS_VRAM,
                gpu_id: gpu,
                ..BoEntry::default()
            },
            BoEntry {
                addr: 0x2000_0000,
                size: 1 << 20,
                alloc_flags: amd::KFD_ALLOC_MEM_FLAGS_GTT,
                gpu_id: gpu,
                ..BoEntry::default()
            },
            BoEntry {
                addr: 0x3000_0000,
                size: 4096,
                alloc_flags: criu_gpu_core::amdgpu::device::AllocFlags::DOORBELL.bits(),
                gpu_id: gpu,
                ..BoEntry::default()
            },
        ],
        num_of_objects: 3,
        priv_data: vec![7; 256],
        ..KfdCheckpoint::default()
    };
    d.write_kfd(5, &img).unwrap();
    let layout = PagesLayout::for_kfd_gpu(&img, gpu).unwrap();
    let w = d.create_kfd_pages(5, gpu, layout.clone()).unwrap();
    for (bo, size) in img.content_bos() {
        w.write_chunk(bo, 0, &vec![0xab; size as usize]).unwrap();
    }
    w.finish().unwrap();
    std::fs::write(dir.join("pages-1.img"), b"not read").unwrap();
    // What CRIU writes beside them (the tool looks only at the plugin names in it).
    std::fs::write(dir.join("inventory.img"), b"\x16\x31\x31\x58amdgpu_plugin").unwrap();
    dir
}

#[test]
fn an_amd_checkpoint_is_inspected_and_checked() {
    let t = T::start("img-amd");
    let dir = amd_images(&t);
    let i = t.tool(&["inspect", dir.to_str().unwrap()], &[]);
    assert_eq!(i.code, Some(0), "{i:?}");
    assert!(
        i.stdout.contains(
            "AMD: amdgpu-kfd-5.img (pid 77): 1 GPU(s), 3 BO(s), 3 queue/event/SVM object(s)"
        ),
        "{}",
        i.stdout
    );
    assert!(
        i.stdout
            .contains("GPU 0x1234: device 0x740f, renderD128, 65536.0 MiB VRAM, 60 CU(s)"),
        "{}",
        i.stdout
    );
    assert!(i.stdout.contains("VRAM: 1 BO(s), 2.0 MiB"), "{}", i.stdout);
    assert!(i.stdout.contains("GTT: 1 BO(s), 1.0 MiB"), "{}", i.stdout);
    assert!(i.stdout.contains("doorbell: 1 BO(s)"), "{}", i.stdout);
    let j = t.tool(&["inspect", dir.to_str().unwrap(), "--json"], &[]);
    assert!(
        j.stdout
            .contains(r#""kind":"VRAM","count":1,"bytes":2097152"#),
        "{}",
        j.stdout
    );

    // No KFD here (or a topology root that does not exist): refused with the reason.
    let env = [("CRIU_GPU_AMDGPU_TOPOLOGY", "/nonexistent/topology")];
    let c = t.tool(&["check", dir.to_str().unwrap()], &env);
    assert_eq!(c.code, Some(1), "{c:?}");
    assert!(
        c.stdout
            .contains("KFD topology cannot be read at /nonexistent/topology"),
        "{}",
        c.stdout
    );

    // A truncated pages file is named.
    let pages = dir.join(amd::kfd_pages_file_name(5, 0x1234));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&pages)
        .unwrap();
    f.set_len(1000).unwrap();
    let i = t.tool(&["inspect", dir.to_str().unwrap()], &[]);
    assert_eq!(i.code, Some(1), "{i:?}");
    assert!(
        i.stdout
            .contains("amdgpu-pages-5-1234.img is 1000 bytes, less than the"),
        "{}",
        i.stdout
    );
}

#[test]
fn check_refuses_what_the_plugin_refuses() {
    let t = T::start("img-kinds");
    let images = cuda_images(&t);
    let variant = |name: &str, file: &str, make: &dyn Fn(&Path)| -> String {
        let d = t.dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(&images).unwrap().flatten() {
            if e.file_name() != file {
                std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
            }
        }
        make(&d.join(file));
        d.display().to_string()
    };
    let fifo = |p: &Path| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    };
    let zero = |p: &Path| std::os::unix::fs::symlink("/dev/zero", p).unwrap();
    for (name, file, make, kind) in [
        (
            "md-fifo",
            "gpu-plugin-cuda.img",
            &fifo as &dyn Fn(&Path),
            "a FIFO",
        ),
        ("md-zero", "gpu-plugin-cuda.img", &zero, "a symbolic link"),
        ("pstree-fifo", "pstree.img", &fifo, "a FIFO"),
    ] {
        let dir = variant(name, file, make);
        let c = t.tool(&["check", &dir], &[]);
        assert_eq!(c.code, Some(1), "{name}: {c:?}");
        assert!(
            c.stdout
                .contains(&format!("{file}: {kind}, not a regular file: refused")),
            "{name}: {}",
            c.stdout
        );
        assert!(
            !c.stdout.contains("verdict: would restore"),
            "{name}: {}",
            c.stdout
        );
    }
    let r = t.tool(&["inspect", "/"], &[]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.contains("/ is not a CRIU checkpoint"),
        "{}",
        r.stderr
    );
    let r = t.tool(&["check", "/"], &[]);
    assert_eq!(r.code, Some(1), "{r:?}");
}
