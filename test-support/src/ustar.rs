//! Tar archives written byte by byte, for tests of what reads them: headers whose fields say
//! what the test wants (a size that lies, a link, a GNU or pax kind), which no tar tool writes.

/// A tar block.
pub const BLOCK: usize = 512;

/// A ustar header for `name` of entry kind `kind` (`b'0'` a file, `b'2'` a symlink, ...)
/// declaring `size` bytes (base-256 when it does not fit the octal field), its checksum right.
pub fn header(name: &str, size: u64, kind: u8) -> Vec<u8> {
    let mut h = vec![0u8; BLOCK];
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

/// A regular file `name` holding `data`: its header and its data padded to whole blocks.
pub fn entry(name: &str, data: &[u8]) -> Vec<u8> {
    let mut v = header(name, data.len() as u64, b'0');
    v.extend_from_slice(data);
    v.resize(v.len().div_ceil(BLOCK) * BLOCK, 0);
    v
}
