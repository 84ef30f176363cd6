//! The pids of the process tree CRIU is about to restore, read from its `pstree.img`.
//!
//! A plugin that keeps per-process records can check at restore `init`, before CRIU forks
//! anything, that every record names a process the restore will create: a record that matches
//! no task means a damaged or mismatched image, and finding out only after the tasks run is too
//! late to fail the restore.
//!
//! The file: two `u32` magics (`IMG_COMMON_MAGIC`, `PSTREE_MAGIC`), then entries, each a
//! little-endian `u32` length and a `pstree_entry` protobuf message whose field 1 (`pid`,
//! varint) is the task's pid in the tree's own pid namespace. Only that field is read.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use crate::image_file::{entries, varint_field};

const PSTREE_MAGIC: u32 = 0x5027_3030;
/// The largest `pstree.img` read (an entry is a few dozen bytes).
const MAX_BYTES: u64 = 64 << 20;
/// The largest entry accepted.
const MAX_ENTRY: usize = 1 << 20;

/// The pids of every task in `pstree.img` of the image directory `dir`.
pub fn read_pids(dir: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let bytes = crate::files::read_regular(Some(dir), Path::new("pstree.img"), true, MAX_BYTES)?;
    parse_pids(&bytes)
}

/// The pids of the entries of a `pstree.img` held in `bytes`.
pub fn parse_pids(bytes: &[u8]) -> io::Result<Vec<u32>> {
    entries(bytes, PSTREE_MAGIC, "pstree.img", MAX_ENTRY)?
        .map(|entry| {
            varint_field(entry?, 1)
                .and_then(|pid| u32::try_from(pid).ok())
                .ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        "pstree.img: entry without a pid",
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(entries: &[&[u8]]) -> Vec<u8> {
        let mut v = crate::image_file::IMG_COMMON_MAGIC.to_le_bytes().to_vec();
        v.extend_from_slice(&PSTREE_MAGIC.to_le_bytes());
        for e in entries {
            v.extend_from_slice(&(e.len() as u32).to_le_bytes());
            v.extend_from_slice(e);
        }
        v
    }

    #[test]
    fn pids_are_read_and_damage_is_refused() {
        // pid 300 (varint ac 02), ppid 1, pgid 300, sid 300, threads [300, 301] packed.
        let a: &[u8] = &[
            0x08, 0xac, 0x02, 0x10, 0x01, 0x18, 0xac, 0x02, 0x20, 0xac, 0x02, 0x2a, 0x04, 0xac,
            0x02, 0xad, 0x02,
        ];
        let b: &[u8] = &[0x10, 0xac, 0x02, 0x08, 0x07];
        assert_eq!(parse_pids(&image(&[a, b])).unwrap(), vec![300, 7]);
        assert!(parse_pids(&image(&[])).unwrap().is_empty());
        let mut cut = image(&[a]);
        cut.pop();
        assert!(parse_pids(&cut).is_err());
        assert!(parse_pids(&image(&[&[0x10, 0x01]])).is_err());
        assert!(parse_pids(b"not an image").is_err());
        assert!(
            parse_pids(&image(&[&[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01
            ]]))
            .is_err()
        );
    }
}
