//! `criu-gpu inspect` and `check` on images real CRIU wrote with the plugin (on the stand-in
//! CUDA driver), on tar, tar.gz and tar.zst archives of them (Podman's `checkpoint/` layout),
//! on AMD images written by the plugin's own image writer, and on hostile archives.

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

/// A ustar header for `name` declaring `size` bytes (base-256 when it does not fit octal).
fn header(name: &str, size: u64, kind: u8) -> Vec<u8> {
    let mut h = vec![0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h[100..107].copy_from_slice(b"0000644");
    if size < 0o77777777777 {
        h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
    } else {
        h[124] = 0x80;
        h[128..136].copy_from_slice(&size.to_be_bytes());
    }
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    h
}

fn entry(name: &str, data: &[u8]) -> Vec<u8> {
    let mut v = header(name, data.len() as u64, b'0');
    v.extend_from_slice(data);
    v.resize(v.len().div_ceil(512) * 512, 0);
    v
}

#[test]
fn hostile_archives_get_clear_errors() {
    let t = T::start("img-hostile");
    let write = |name: &str, bytes: &[u8]| {
        let p = t.dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p.display().to_string()
    };
    let run = |p: &str| t.tool(&["inspect", p], &[]);

    // Wrong magic.
    let r = run(&write(
        "junk.bin",
        b"this is not an archive at all, just text",
    ));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.contains("is not a checkpoint archive"),
        "{}",
        r.stderr
    );

    // Traversal and absolute paths are ignored, never read; a metadata file beside them is.
    let md = "gpu-plugin-cuda 1\ndriver 13000 580.1\n";
    let mut tar = entry("../../etc/gpu-plugin-cuda.img", b"gpu-plugin-cuda 9\n");
    tar.extend(entry("/checkpoint/pstree.img", b"x"));
    tar.extend(entry("checkpoint/gpu-plugin-cuda.img", md.as_bytes()));
    tar.extend(header("checkpoint/inventory.img", 0, b'2'));
    tar.extend([0u8; 1024]);
    let r = run(&write("traversal.tar", &tar));
    // A link in place of inventory.img is no image CRIU restores.
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stdout.contains("a path with `..` (ignored)"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("an absolute path (ignored)"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(
            "checkpoint/inventory.img: a link or special file, not a regular file: refused"
        ),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("NVIDIA: driver 580.1 (CUDA 13.0), 0 GPU(s)"),
        "{}",
        r.stdout
    );

    // A huge declared entry: refused by size, never allocated; the archive then ends early.
    let mut tar = header("checkpoint/gpu-plugin-cuda.img", 1 << 50, b'0');
    tar.extend([0u8; 512]);
    let r = run(&write("huge.tar", &tar));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("truncated"), "{}", r.stderr);
    // Huge but skipped (not a file the tool reads): the same, clearly.
    let mut tar = header("checkpoint/pages-1.img", 1 << 50, b'0');
    tar.extend([0u8; 512]);
    let r = run(&write("huge-other.tar", &tar));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("truncated"), "{}", r.stderr);
    // A metadata file larger than the plugin reads, present in full.
    let big = vec![b'x'; (1 << 20) + 10];
    let mut tar = entry("gpu-plugin-cuda.img", &big);
    tar.extend([0u8; 1024]);
    let r = run(&write("big.tar", &tar));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stdout
            .contains("gpu-plugin-cuda.img is 1048586 bytes, more than the 1048576"),
        "{}",
        r.stdout
    );

    // A bad header checksum.
    let mut tar = entry("checkpoint/gpu-plugin-cuda.img", md.as_bytes());
    tar[0] ^= 1;
    let r = run(&write("badsum.tar", &tar));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.contains("not a checkpoint archive") || r.stderr.contains("bad header checksum"),
        "{}",
        r.stderr
    );
    let mut tar = entry("checkpoint/gpu-plugin-cuda.img", md.as_bytes());
    tar.extend(entry("checkpoint/x", b"y"));
    tar[512 + 512] ^= 1;
    let r = run(&write("badsum2.tar", &tar));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.contains("entry 2") && r.stderr.contains("bad header checksum"),
        "{}",
        r.stderr
    );

    // Truncated inside an entry, plain and gzip-compressed.
    let mut tar = entry("checkpoint/gpu-plugin-cuda.img", &vec![b'a'; 4000]);
    tar.extend([0u8; 1024]);
    let cut = write("cut.tar", &tar[..2000]);
    let r = run(&cut);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("truncated"), "{}", r.stderr);
    let full = write("full.tar", &tar);
    assert!(
        Command::new("gzip")
            .args(["-kf", &full])
            .status()
            .unwrap()
            .success()
    );
    let gz = std::fs::read(format!("{full}.gz")).unwrap();
    let r = run(&write("cut.tar.gz", &gz[..gz.len() / 2]));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("gzip"), "{}", r.stderr);
    // gzip magic followed by garbage.
    let r = run(&write(
        "bad.gz",
        &[0x1f, 0x8b, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    ));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("gzip"), "{}", r.stderr);

    // A damaged metadata file inside a valid archive is named.
    let mut tar = entry("gpu-plugin-cuda.img", b"gpu-plugin-cuda 1\nprocess x\n");
    tar.extend([0u8; 1024]);
    let r = run(&write("badmd.tar", &tar));
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stdout.contains("error: gpu-plugin-cuda.img line 2"),
        "{}",
        r.stdout
    );
}

/// What the plugin refuses, `check` refuses: a FIFO or a link (to `/dev/zero`) in place of
/// the metadata, a FIFO in place of `pstree.img`. A directory that holds no checkpoint is no
/// image at all.
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

/// A decompression bomb (zstd frames of zeros, 8 GiB unpacked from a few hundred KiB) is
/// refused within seconds, its decompressor killed.
#[test]
fn a_decompression_bomb_is_refused_quickly() {
    let t = T::start("img-bomb");
    let zstd = |data: &[u8]| -> Vec<u8> {
        let mut c = Command::new("zstd")
            .args(["-q", "-c", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("zstd");
        let mut stdin = c.stdin.take().unwrap();
        let data = data.to_vec();
        let feeder = std::thread::spawn(move || {
            use std::io::Write;
            stdin.write_all(&data).unwrap();
        });
        let out = c.wait_with_output().unwrap();
        feeder.join().unwrap();
        out.stdout
    };
    let mut bomb = zstd(&header("checkpoint/pages-1.img", 8 << 30, b'0'));
    let zeros = zstd(&vec![0u8; 64 << 20]);
    for _ in 0..128 {
        bomb.extend_from_slice(&zeros);
    }
    let p = t.dir.join("bomb.tar.zst");
    std::fs::write(&p, &bomb).unwrap();
    let started = std::time::Instant::now();
    let r = t.tool(&["inspect", p.to_str().unwrap()], &[]);
    let took = started.elapsed();
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("decompression bomb"), "{}", r.stderr);
    assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
}

/// A runtime's archive (`spec.dump` beside `checkpoint/`): `check` names each bind mount whose
/// host path is a symlink here, which CRIU's default mount engine cannot restore; a mount of
/// the file itself is not named, and a spec that is not JSON is a note, not a failure.
#[test]
fn check_names_bind_mounts_whose_host_path_is_a_symlink() {
    let t = T::start("img-spec");
    let real = t.dir.join("10_nvidia.json");
    std::fs::write(&real, "{}").unwrap();
    let link = t.dir.join("link.json");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let spec = |source: &Path| {
        format!(
            r#"{{"ociVersion": "1.2.0", "mounts": [
  {{"destination": "/proc", "type": "proc", "source": "proc"}},
  {{"destination": "/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "type": "bind",
    "source": "{}", "options": ["ro", "rbind"]}}]}}"#,
            source.display()
        )
    };
    let archive = |name: &str, spec: &[u8]| {
        let mut tar = entry("spec.dump", spec);
        tar.extend(entry("checkpoint/inventory.img", b""));
        tar.extend([0u8; 1024]);
        let p = t.dir.join(name);
        std::fs::write(&p, tar).unwrap();
        p.display().to_string()
    };

    let r = t.tool(
        &["check", &archive("link.tar", spec(&link).as_bytes())],
        &[],
    );
    assert_eq!(r.code, Some(1), "{r:?}");
    let said = format!(
        "bind mount /usr/share/glvnd/egl_vendor.d/10_nvidia.json: its host path {} is a \
         symlink here (to {})",
        link.display(),
        std::fs::canonicalize(&real).unwrap().display()
    );
    assert!(r.stdout.contains(&said), "{}", r.stdout);
    assert!(r.stdout.contains("mntns-compat-mode"), "{}", r.stdout);

    let r = t.tool(
        &["check", &archive("file.tar", spec(&real).as_bytes())],
        &[],
    );
    assert!(!r.stdout.contains("is a symlink here"), "{}", r.stdout);

    let r = t.tool(&["check", &archive("junk.tar", b"{not json")], &[]);
    assert!(r.stdout.contains("spec.dump is not JSON"), "{}", r.stdout);
}
