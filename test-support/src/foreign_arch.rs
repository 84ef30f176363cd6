//! Checkpoints made as if on another CPU architecture, for the tests of what refuses them.
//!
//! No second architecture is at hand, so a real checkpoint is changed where CRIU looks: each
//! task's `core-PID.img` holds two `u32` magics, an entry's `u32` size, then a `core_entry`
//! whose field 1 (`mtype`, CRIU's number for the architecture) protobuf-c writes first, as
//! `08 01` for x86_64. That byte is changed in place; the rest of the image (registers
//! included) stays this machine's, which CRIU never reaches once that field refuses it. The
//! checkpoints changed are this machine's, so these helpers want an x86_64 host.

use std::path::Path;

use criu_plugin::core_image::is_core_file;

/// CRIU's number for arm64 (`core_entry.mtype`, `AARCH64`).
pub const MARCH_AARCH64: u8 = 3;

const CORE_HEAD: [u8; 8] = [0x19, 0x43, 0x56, 0x54, 0x47, 0x38, 0x05, 0x55];

/// For tests whose checkpoints CRIU did not write: a `pstree.img` of one task, `pid` (below
/// 128), and its core image of nothing but its architecture, `march`, in `dir`.
pub fn bare_tree(dir: &Path, pid: u8, march: u8) {
    assert!(pid < 0x80, "a one-byte varint");
    let image = |magic: &[u8], entry: &[u8]| {
        let mut img = magic.to_vec();
        img.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        img.extend_from_slice(entry);
        img
    };
    let pstree_head = [0x19, 0x43, 0x56, 0x54, 0x30, 0x30, 0x27, 0x50];
    std::fs::write(dir.join("pstree.img"), image(&pstree_head, &[0x08, pid])).expect("pstree.img");
    std::fs::write(
        dir.join(format!("core-{pid}.img")),
        image(&CORE_HEAD, &[0x08, march]),
    )
    .expect("core image");
}

/// Sets the architecture of the core image `img` (named `file`) to `march`; panics unless it
/// starts as an x86_64 one.
fn set_march(img: &mut [u8], file: &str, march: u8) {
    assert!(
        img.len() > 13 && img[..8] == CORE_HEAD && img[12..14] == [0x08, 0x01],
        "{file} does not start as an x86_64 core image: {:02x?}",
        &img[..img.len().min(16)]
    );
    img[13] = march;
}

/// Makes every core image of the image directory `dir` say `march`; returns the originals
/// (path, contents) to put back.
pub fn dumped_on(dir: &Path, march: u8) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut saved = Vec::new();
    for e in std::fs::read_dir(dir).expect("image directory").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !is_core_file(&name) {
            continue;
        }
        let original = std::fs::read(e.path()).expect("core image");
        let mut img = original.clone();
        set_march(&mut img, &name, march);
        std::fs::write(e.path(), img).expect("core image");
        saved.push((e.path(), original));
    }
    assert!(!saved.is_empty(), "no core image in {}", dir.display());
    saved
}

/// A copy at `out` of the checkpoint archive `archive` (an uncompressed tar, as the kubelet
/// writes it) whose core images under `checkpoint/` say `march`, changed in place in the tar.
pub fn archive_dumped_on(archive: &Path, out: &Path, march: u8) {
    const BLOCK: usize = 512;
    let mut tar = std::fs::read(archive).expect("the checkpoint archive");
    let (mut at, mut changed) = (0, 0);
    while at + BLOCK <= tar.len() && tar[at..at + BLOCK].iter().any(|&b| b != 0) {
        let header = &tar[at..at + BLOCK];
        let name = String::from_utf8_lossy(&header[..100])
            .trim_end_matches('\0')
            .to_string();
        let size_field = String::from_utf8_lossy(&header[124..136]).to_string();
        let size = usize::from_str_radix(size_field.trim_matches(|c| c == '\0' || c == ' '), 8)
            .unwrap_or_else(|_| panic!("tar member {name}: size {size_field:?}"));
        let data = at + BLOCK;
        let file = name.trim_start_matches("./");
        let regular = matches!(header[156], b'0' | 0);
        if regular && file.strip_prefix("checkpoint/").is_some_and(is_core_file) {
            set_march(&mut tar[data..data + size], file, march);
            changed += 1;
        }
        at = data + size.div_ceil(BLOCK) * BLOCK;
    }
    assert!(changed > 0, "no core image in {}", archive.display());
    std::fs::write(out, tar).expect("the changed archive");
}
