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

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    bytes
        .get(at..at.checked_add(4)?)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
}

/// The entries of an image file, one at a time: nothing is collected, so a caller stops at
/// the first it needs or the first that is damaged.
pub(crate) struct Entries<'a> {
    bytes: &'a [u8],
    at: usize,
    file: &'a str,
    max_entry: usize,
}

/// The entries of an image file of magic `magic` held in `bytes` (`file` names it in
/// errors), each at most `max_entry` bytes; a file of other magics is refused.
pub(crate) fn entries<'a>(
    bytes: &'a [u8],
    magic: u32,
    file: &'a str,
    max_entry: usize,
) -> io::Result<Entries<'a>> {
    let (common, own) = (u32_at(bytes, 0), u32_at(bytes, 4));
    if common != Some(IMG_COMMON_MAGIC) || own != Some(magic) {
        let found = match (common, own) {
            (Some(c), Some(o)) => format!("magics {c:#010x} {o:#010x}"),
            _ => format!("{} bytes", bytes.len()),
        };
        return Err(bad(
            file,
            &format!("{found}, not a CRIU image of magic {magic:#010x}"),
        ));
    }
    Ok(Entries {
        bytes,
        at: 8,
        file,
        max_entry,
    })
}

impl<'a> Iterator for Entries<'a> {
    type Item = io::Result<&'a [u8]>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.bytes.len() {
            return None;
        }
        let entry = (|| {
            let len = u32_at(self.bytes, self.at)
                .ok_or_else(|| bad(self.file, "truncated entry size"))?
                as usize;
            if len > self.max_entry {
                return Err(bad(self.file, "entry too large"));
            }
            let start = self.at + 4;
            let entry = self
                .bytes
                .get(start..start + len)
                .ok_or_else(|| bad(self.file, "truncated entry"))?;
            self.at = start + len;
            Ok(entry)
        })();
        if entry.is_err() {
            // Nothing after a damaged entry can be found.
            self.at = self.bytes.len();
        }
        Some(entry)
    }
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
