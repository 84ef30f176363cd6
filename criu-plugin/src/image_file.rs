//! CRIU's protobuf image files, as far as the plugin reads them: two little-endian `u32`
//! magics (`IMG_COMMON_MAGIC`, then the file's own), then entries, each a little-endian `u32`
//! size and a protobuf message. Only varint fields of a message are read; the others are
//! skipped by their wire type.

use std::io;

/// The first magic of every image file but the inventory's and the raw ones.
pub(crate) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;

fn bad(file: &str, why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{file}: {why}"))
}

/// The entries of an image file of magic `magic` held in `bytes` (`file` names it in errors),
/// each at most `max_entry` bytes.
pub(crate) fn entries<'a>(
    bytes: &'a [u8],
    magic: u32,
    file: &str,
    max_entry: usize,
) -> io::Result<Vec<&'a [u8]>> {
    let u32_at = |at: usize| -> Option<u32> {
        bytes
            .get(at..at.checked_add(4)?)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    if u32_at(0) != Some(IMG_COMMON_MAGIC) || u32_at(4) != Some(magic) {
        return Err(bad(file, "not the CRIU image it should be"));
    }
    let mut at = 8;
    let mut out = Vec::new();
    while at < bytes.len() {
        let len = u32_at(at).ok_or_else(|| bad(file, "truncated entry size"))? as usize;
        at += 4;
        if len > max_entry {
            return Err(bad(file, "entry too large"));
        }
        let entry = bytes
            .get(at..at + len)
            .ok_or_else(|| bad(file, "truncated entry"))?;
        at += len;
        out.push(entry);
    }
    Ok(out)
}

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

/// Varint field `field` of protobuf message `m` (its last occurrence, as protobuf reads it);
/// `None` when absent or when the message is malformed.
pub(crate) fn varint_field(mut m: &[u8], field: u64) -> Option<u64> {
    let mut found = None;
    while !m.is_empty() {
        let key = varint(&mut m)?;
        match (key >> 3, key & 7) {
            (f, 0) if f == field => found = Some(varint(&mut m)?),
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
    found
}
