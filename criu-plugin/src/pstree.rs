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

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const PSTREE_MAGIC: u32 = 0x5027_3030;
/// The largest `pstree.img` read (an entry is a few dozen bytes).
const MAX_BYTES: u64 = 64 << 20;
/// The largest entry accepted.
const MAX_ENTRY: usize = 1 << 20;

fn bad(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("pstree.img: {why}"))
}

/// The pids of every task in `pstree.img` of the image directory `dir`.
pub fn read_pids(dir: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let bytes = crate::files::read_regular(Some(dir), Path::new("pstree.img"), true, MAX_BYTES)?;
    parse_pids(&bytes)
}

/// The pids of the entries of a `pstree.img` held in `bytes`.
pub fn parse_pids(bytes: &[u8]) -> io::Result<Vec<u32>> {
    let u32_at = |at: usize| -> Option<u32> {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    if u32_at(0) != Some(IMG_COMMON_MAGIC) || u32_at(4) != Some(PSTREE_MAGIC) {
        return Err(bad("not a CRIU process tree image"));
    }
    let mut at = 8;
    let mut pids = Vec::new();
    while at < bytes.len() {
        let len = u32_at(at).ok_or_else(|| bad("truncated entry size"))? as usize;
        at += 4;
        if len > MAX_ENTRY {
            return Err(bad("entry too large"));
        }
        let entry = bytes
            .get(at..at + len)
            .ok_or_else(|| bad("truncated entry"))?;
        at += len;
        pids.push(entry_pid(entry).ok_or_else(|| bad("entry without a pid"))?);
    }
    Ok(pids)
}

/// Field 1 of a protobuf message, a varint; other fields are skipped by their wire type.
fn entry_pid(mut m: &[u8]) -> Option<u32> {
    fn varint(m: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = m.split_first()?;
            *m = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }
    let mut pid = None;
    while !m.is_empty() {
        let key = varint(&mut m)?;
        match (key >> 3, key & 7) {
            (1, 0) => pid = Some(u32::try_from(varint(&mut m)?).ok()?),
            (_, 0) => {
                varint(&mut m)?;
            }
            (_, 2) => {
                let n = usize::try_from(varint(&mut m)?).ok()?;
                m = m.get(n..)?;
            }
            (_, 5) => m = m.get(4..)?,
            (_, 1) => m = m.get(8..)?,
            _ => return None,
        }
    }
    pid
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(entries: &[&[u8]]) -> Vec<u8> {
        let mut v = IMG_COMMON_MAGIC.to_le_bytes().to_vec();
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
