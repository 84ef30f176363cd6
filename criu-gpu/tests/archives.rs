//! `criu-gpu inspect` and `check` on archives made by hand, byte by byte: hostile ones (paths
//! out of the archive, links, sizes that lie, a decompression bomb) get clear errors, and a
//! runtime's `spec.dump` has its bind mounts checked.

mod support;

use std::path::Path;
use std::process::Command;

use criu_gpu_test_support::ustar::{entry, header};
use support::T;

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
