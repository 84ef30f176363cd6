//! The CPU architecture a checkpoint's task was dumped on, from its `core-PID.img`.
//!
//! CRIU restores a task only on the architecture it was dumped on, but finds out only once it
//! has forked the task ("Core march mismatch N" in its log). A plugin that restores device
//! state can look first, at restore `init`, and refuse with the names of both architectures
//! before anything is forked. Every task of a checkpoint has the same architecture: the tree's
//! root (the first of `pstree.img`) is read.
//!
//! The file: two `u32` magics (`IMG_COMMON_MAGIC`, `CORE_MAGIC`), then one entry, a `u32`
//! size and a `core_entry` protobuf message whose field 1 (`mtype`, varint) is CRIU's number
//! for the architecture. Only that field is read.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use crate::image_file::{entries, varint_field};

const CORE_MAGIC: u32 = 0x5505_3847;
/// The largest `core-PID.img` read (a task's registers, signal actions and the like take a
/// few KiB).
pub const MAX_BYTES: u64 = 16 << 20;

/// CRIU's numbers for CPU architectures (`core_entry.mtype`), with the names Linux gives the
/// machines CRIU runs on.
const MARCHES: [(u64, &str); 8] = [
    (1, "x86_64"),
    (2, "arm"),
    (3, "aarch64"),
    (4, "ppc64le"),
    (5, "s390x"),
    (6, "mips64"),
    (7, "loongarch64"),
    (8, "riscv64"),
];

/// CRIU's number for the architecture this code was built for (and so the CRIU that loads
/// it runs on); 0 for one CRIU does not know, where nothing is refused.
pub const THIS_MARCH: u64 = if cfg!(target_arch = "x86_64") {
    1
} else if cfg!(target_arch = "arm") {
    2
} else if cfg!(target_arch = "aarch64") {
    3
} else if cfg!(target_arch = "powerpc64") {
    4
} else if cfg!(target_arch = "s390x") {
    5
} else if cfg!(target_arch = "mips64") {
    6
} else if cfg!(target_arch = "loongarch64") {
    7
} else if cfg!(target_arch = "riscv64") {
    8
} else {
    0
};

/// The name of CRIU's architecture number `mtype`.
pub fn march_name(mtype: u64) -> String {
    MARCHES.iter().find(|(n, _)| *n == mtype).map_or_else(
        || format!("CRIU architecture {mtype}"),
        |(_, name)| name.to_string(),
    )
}

/// The core image of task `pid`.
pub fn file_name(pid: u32) -> String {
    format!("core-{pid}.img")
}

/// Whether `name` is a task's core image (`core-PID.img`).
pub fn is_core_file(name: &str) -> bool {
    name.strip_prefix("core-")
        .and_then(|r| r.strip_suffix(".img"))
        .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// CRIU's number for the architecture task `pid` of the image directory `dir` was dumped on.
pub fn read_march(dir: BorrowedFd<'_>, pid: u32) -> io::Result<u64> {
    let name = file_name(pid);
    let bytes = crate::files::read_regular(Some(dir), Path::new(&name), true, MAX_BYTES)?;
    parse_march(&bytes, &name)
}

/// CRIU's architecture number in the core image `bytes` (named `file` in errors).
pub fn parse_march(bytes: &[u8], file: &str) -> io::Result<u64> {
    let no_arch = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{file}: no architecture"),
        )
    };
    let first = entries(bytes, CORE_MAGIC, file, MAX_BYTES as usize)?
        .next()
        .ok_or_else(no_arch)??;
    varint_field(first, 1).ok_or_else(no_arch)
}

/// Why the image directory `dir` cannot be restored here, when the core image of the root
/// task of `tree` (its `pstree.img` pids, as read) says it was dumped on another
/// architecture; `None` when it says this one, or cannot be read (CRIU then says why).
pub fn foreign_architecture(dir: BorrowedFd<'_>, tree: &[u32]) -> Option<String> {
    if THIS_MARCH == 0 {
        return None;
    }
    let root = *tree.first()?;
    match read_march(dir, root) {
        Ok(mtype) => (mtype != THIS_MARCH).then(|| dumped_elsewhere(&file_name(root), mtype)),
        Err(e) => {
            log::debug!("architecture not checked: {}: {e}", file_name(root));
            None
        }
    }
}

/// The refusal of a checkpoint whose core image `file` says architecture `mtype`.
pub fn dumped_elsewhere(file: &str, mtype: u64) -> String {
    format!(
        "the checkpoint was made on {} ({file}) and this machine is {}: CRIU restores a process only on the CPU architecture it was dumped on",
        march_name(mtype),
        march_name(THIS_MARCH)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(entry: &[u8]) -> Vec<u8> {
        let mut v = crate::image_file::IMG_COMMON_MAGIC.to_le_bytes().to_vec();
        v.extend_from_slice(&CORE_MAGIC.to_le_bytes());
        v.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        v.extend_from_slice(entry);
        v
    }

    #[test]
    fn architecture_is_read_and_named() {
        // mtype AARCH64, then a length-delimited field 3 (tc) of two bytes.
        let arm64 = image(&[0x08, 0x03, 0x1a, 0x02, 0x08, 0x01]);
        assert_eq!(parse_march(&arm64, "core-1.img").unwrap(), 3);
        assert_eq!(march_name(3), "aarch64");
        assert_eq!(march_name(42), "CRIU architecture 42");
        assert_eq!(parse_march(&image(&[0x08, 0x01]), "core-1.img").unwrap(), 1);
        assert_ne!(
            THIS_MARCH, 0,
            "a build for an architecture CRIU does not know"
        );
        let why = dumped_elsewhere("core-7.img", 3);
        assert!(why.contains("made on aarch64 (core-7.img)"), "{why}");
        assert!(why.contains(&march_name(THIS_MARCH)), "{why}");
    }

    #[test]
    fn damaged_images_are_refused() {
        assert!(parse_march(&image(&[0x1a, 0x00]), "core-1.img").is_err());
        assert!(parse_march(&image(&[0x08]), "core-1.img").is_err());
        assert!(parse_march(b"not an image at all", "core-1.img").is_err());
        assert!(parse_march(&image(&[])[..8], "core-1.img").is_err());
        assert!(is_core_file("core-12.img") && !is_core_file("core-.img"));
        assert!(!is_core_file("core-1.img.bak") && !is_core_file("corex-1.img"));
        let mut cut = image(&[0x08, 0x01]);
        cut.pop();
        assert!(parse_march(&cut, "core-1.img").is_err());
        let mut pstree = image(&[0x08, 0x01]);
        pstree[4..8].copy_from_slice(&0x5027_3030u32.to_le_bytes());
        assert!(parse_march(&pstree, "core-1.img").is_err());
    }
}
