//! Reading checkpoint archives: tar (ustar, GNU and pax headers, read by the `tar` crate),
//! plain or compressed with gzip, zstd or xz (decompressed in process: flate2, zstd, liblzma).
//!
//! Built for hostile input. The `tar` crate checks each header (checksum, octal or base-256
//! sizes, size overflow) and applies GNU long names and pax records; what it does not bound is
//! bounded here, under it, by the byte source it reads from: the archive's whole unpacked size
//! (less for a compressed one: a decompression bomb is cut off), the time a decompressor may
//! take, and the bytes of headers, long names and pax records it may read to find one entry.
//! Entries are walked one by one (never unpacked): only those the caller asks for are read,
//! each up to its own limit; the rest are skipped (seeked past in a plain file) without being
//! kept; the entry count is bounded; a link or directory declaring data is refused, since tar
//! readers disagree on where the entry after it starts. Entries are never written anywhere, so
//! a path with `..` or a leading `/` cannot reach outside anything; the caller gets the path as
//! the archive names it and decides (see `images`).

use std::cell::{Cell, RefCell};
use std::io::{self, Read};
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant};

use tar::EntryType;

use source::{Gauge, GzipMembers, Source, Unpacked, unpack_limit};

mod source;

/// Most entries read from one archive.
pub const MAX_ENTRIES: u64 = 1_000_000;
/// Most bytes read through one archive (its whole unpacked size).
pub const MAX_ARCHIVE_BYTES: u64 = 1 << 40;
/// Most bytes a compressed archive may unpack to per byte of its own: far beyond what
/// checkpoint images compress by, while a decompression bomb (gigabytes of zeros in a few
/// megabytes) is cut off within a second or two. Larger ones can be unpacked by hand and the
/// directory inspected.
const MAX_RATIO: u64 = 256;
/// What any compressed archive may unpack to, however small it is.
const MIN_UNPACKED: u64 = 1 << 30;
/// How long a decompressor may take, whatever it unpacks.
const MAX_UNPACK_TIME: Duration = Duration::from_secs(600);
/// Most bytes the tar reader may read to find one entry: its header, the padding before it,
/// and its GNU long name, long link target and pax record (64 KiB each).
const MAX_META: u64 = 3 * 64 * 1024 + 4 * BLOCK as u64;
/// Most memory the xz decoder may take: any preset's dictionary (64 MiB at `xz -9`) fits.
const MAX_XZ_MEMORY: u64 = 1 << 30;
/// Most bytes drained after the end marker of a compressed archive (its padding).
const MAX_TRAILER: u64 = 16 << 20;
const BLOCK: usize = 512;

/// How an archive is packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    Tar,
    Gzip,
    Zstd,
    Xz,
}

impl Packing {
    pub fn name(self) -> &'static str {
        match self {
            Packing::Tar => "tar",
            Packing::Gzip => "tar.gz",
            Packing::Zstd => "tar.zst",
            Packing::Xz => "tar.xz",
        }
    }

    /// The compression's name, for messages.
    fn compression(self) -> &'static str {
        match self {
            Packing::Tar => "tar",
            Packing::Gzip => "gzip",
            Packing::Zstd => "zstd",
            Packing::Xz => "xz",
        }
    }
}

/// Tells the packing from the first bytes; `None` when it is none of the known ones.
pub fn sniff(head: &[u8]) -> Option<Packing> {
    if head.starts_with(&[0x1f, 0x8b]) {
        Some(Packing::Gzip)
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Some(Packing::Zstd)
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        Some(Packing::Xz)
    } else if head.len() >= BLOCK && (head[257..262] == *b"ustar" || checksum_ok(&head[..BLOCK])) {
        Some(Packing::Tar)
    } else {
        None
    }
}

/// Whether the 512-byte tar header `h` holds its own checksum.
fn checksum_ok(h: &[u8]) -> bool {
    let mut header = tar::Header::new_old();
    header.as_mut_bytes().copy_from_slice(h);
    let stored = header.cksum();
    header.set_cksum();
    stored.is_ok() && stored.ok() == header.cksum().ok()
}

/// One entry as the reader sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The path as the archive names it (lossy UTF-8).
    pub path: String,
    /// Declared size of its data.
    pub size: u64,
    /// A regular file (everything else, links and devices included, is only listed).
    pub regular: bool,
}

/// What the visitor wants done with an entry: skip it, or read it whole up to a limit (an
/// entry declaring more is reported through [`Data::TooLarge`] instead).
pub enum Want {
    Skip,
    Read(u64),
}

/// The data handed to the visitor after [`Want::Read`].
pub enum Data {
    Bytes(Vec<u8>),
    TooLarge { limit: u64 },
}

/// `size` rounded up to whole blocks (the tar reader has refused sizes where this overflows).
fn padded(size: u64) -> u64 {
    size.div_ceil(BLOCK as u64).saturating_mul(BLOCK as u64)
}

/// Why an archive cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// It cannot be opened (missing, not a regular file).
    #[error("cannot open {}: {err}", path.display())]
    Open {
        /// The archive.
        path: std::path::PathBuf,
        /// Why.
        err: io::Error,
    },
    /// Reading it failed.
    #[error("cannot read the archive: {0}")]
    Read(io::Error),
    /// No entry at all.
    #[error("the archive holds no entries")]
    Empty,
    /// More entries than read.
    #[error("the archive has more than {MAX_ENTRIES} entries; refused")]
    TooManyEntries,
    /// Damaged, truncated, or built to mislead a reader: what is wrong, and where.
    #[error("{0}")]
    Refused(String),
}

/// Reads the archive at `path` (packed as `packing`), calling `visit` for every entry; the
/// visitor asks for the data of the entries it needs and gets them through `take`.
pub fn read(
    path: &Path,
    packing: Packing,
    mut visit: impl FnMut(&Entry) -> Want,
    mut take: impl FnMut(&Entry, Data),
) -> Result<(), ArchiveError> {
    // Without blocking and only a regular file: a FIFO put in its place must not hang the tool.
    let file =
        criu_plugin::files::open_regular(None, path, false).map_err(|err| ArchiveError::Open {
            path: path.to_path_buf(),
            err,
        })?;
    let len = file.metadata().ok().map(|m| m.len());
    let compression = packing.compression();
    let damaged = |e: io::Error| {
        ArchiveError::Refused(format!("the archive is damaged ({compression}: {e})"))
    };
    let decoder = |decoder: Box<dyn Read>| Unpacked::Decoder {
        decoder,
        deadline: Instant::now() + MAX_UNPACK_TIME,
        compression,
    };
    let unpacked = match packing {
        Packing::Tar => Unpacked::File(file),
        Packing::Gzip => decoder(Box::new(GzipMembers::new(file))),
        Packing::Zstd => decoder(Box::new(zstd::Decoder::new(file).map_err(damaged)?)),
        Packing::Xz => {
            let stream = liblzma::stream::Stream::new_stream_decoder(
                MAX_XZ_MEMORY,
                liblzma::stream::CONCATENATED,
            )
            .map_err(|e| damaged(e.into()))?;
            decoder(Box::new(liblzma::read::XzDecoder::new_stream(file, stream)))
        }
    };
    let gauge = Rc::new(Gauge {
        pos: Cell::new(0),
        limit: Cell::new(match (&unpacked, len) {
            (Unpacked::File(_), _) => MAX_ARCHIVE_BYTES,
            (Unpacked::Decoder { .. }, Some(n)) => unpack_limit(n),
            (Unpacked::Decoder { .. }, None) => MIN_UNPACKED,
        }),
        meta_left: Cell::new(None),
        stopped: RefCell::new(None),
    });
    let seekable = matches!(unpacked, Unpacked::File(_));
    let mut archive = tar::Archive::new(Source {
        unpacked,
        gauge: gauge.clone(),
    });
    let walked = walk(
        &mut archive,
        seekable.then_some(len).flatten(),
        &gauge,
        &mut visit,
        &mut take,
    );
    // The source's own reason comes first: the tar reader only saw a failed read.
    let stopped = || gauge.stopped.borrow_mut().take().map(ArchiveError::Refused);
    walked.map_err(|e| stopped().unwrap_or(e))?;
    if !seekable {
        // What follows the end marker is a little padding (more is cut off unread); reading it
        // lets the decompressor check the end of its data (a bad checksum there fails).
        gauge
            .limit
            .set(gauge.limit.get().saturating_add(MAX_TRAILER));
        let mut rest = archive.into_inner().take(MAX_TRAILER);
        io::copy(&mut rest, &mut io::sink())
            .map_err(|e| stopped().unwrap_or_else(|| damaged(e)))?;
    }
    Ok(())
}

/// Walks the entries; `file_len` is the length of a plain (seekable) archive.
fn walk(
    archive: &mut tar::Archive<Source>,
    file_len: Option<u64>,
    gauge: &Gauge,
    visit: &mut impl FnMut(&Entry) -> Want,
    take: &mut impl FnMut(&Entry, Data),
) -> Result<(), ArchiveError> {
    let refused = ArchiveError::Refused;
    let mut entries = match file_len {
        Some(_) => archive.entries_with_seek(),
        None => archive.entries(),
    }
    .map_err(ArchiveError::Read)?;
    let mut count = 0u64;
    // What the tar reader reads past, in a stream, before the next header: the rest of the
    // entry before (in a file it seeks); and what that entry was, for messages.
    let mut pending = 0u64;
    let mut last = String::new();
    loop {
        gauge.meta_left.set(Some(MAX_META.saturating_add(pending)));
        let next = entries.next();
        gauge.meta_left.set(None);
        // An archive without its end marker still has every entry before it.
        let mut e = match next {
            None if count == 0 && gauge.pos.get() < BLOCK as u64 => {
                return Err(ArchiveError::Empty);
            }
            None => return Ok(()),
            Some(Err(e)) => {
                return Err(refused(tar_error(count + 1, &e, gauge.pos.get(), &last)));
            }
            Some(Ok(e)) => e,
        };
        count += 1;
        if count > MAX_ENTRIES {
            return Err(ArchiveError::TooManyEntries);
        }
        let kind = e.header().entry_type();
        let size = e.size();
        let entry = Entry {
            path: String::from_utf8_lossy(&e.path_bytes()).into_owned(),
            size,
            regular: matches!(kind, EntryType::Regular | EntryType::Continuous),
        };
        if size > 0
            && matches!(
                kind,
                EntryType::Link | EntryType::Symlink | EntryType::Directory
            )
        {
            return Err(refused(format!(
                "entry {count} ({}): a link or directory declaring {size} bytes of data: refused (tar readers disagree on where the next entry starts)",
                entry.path
            )));
        }
        last = format!("{} ({size} bytes)", entry.path);
        // Where its data ends in the archive: a sparse file's size is what it expands to,
        // its header's what the archive holds.
        let stored = match kind {
            EntryType::GNUSparse => e.header().entry_size().unwrap_or(size),
            _ => size,
        };
        let end = e.raw_file_position().saturating_add(padded(stored));
        if let Some(len) = file_len.filter(|&len| end > len) {
            return Err(refused(format!(
                "the archive is truncated: {last} needs {} bytes, the file has {} left",
                padded(stored),
                len.saturating_sub(e.raw_file_position())
            )));
        }
        // A global pax header is the tar reader's, not an entry of the checkpoint.
        let want = match kind {
            EntryType::XGlobalHeader => Want::Skip,
            _ => visit(&entry),
        };
        match want {
            Want::Read(limit) if size > limit => take(&entry, Data::TooLarge { limit }),
            Want::Read(_) => {
                let mut data = Vec::with_capacity(size as usize);
                e.read_to_end(&mut data).map_err(ArchiveError::Read)?;
                if data.len() as u64 != size {
                    return Err(refused(truncated(gauge.pos.get(), &last)));
                }
                take(&entry, Data::Bytes(data));
            }
            Want::Skip => {}
        }
        if file_len.is_none() {
            pending = end.saturating_sub(gauge.pos.get());
        }
    }
}

fn truncated(pos: u64, what: &str) -> String {
    format!("the archive is truncated: it ends after {pos} bytes, inside {what}")
}

/// The tar reader's refusal of entry `n` (or of the end of the one before, `last`) in words
/// that say what is wrong.
fn tar_error(n: u64, e: &io::Error, pos: u64, last: &str) -> String {
    let text = e.to_string();
    if text.contains("unexpected EOF during skip") {
        truncated(pos, last)
    } else if text.contains("checksum mismatch") {
        format!(
            "entry {n} (before byte {pos}) has a bad header checksum: not a tar archive, or a damaged one"
        )
    } else if e.kind() == io::ErrorKind::UnexpectedEof
        || text.contains("failed to read entire block")
        || text.contains("unexpected EOF")
    {
        truncated(pos, &format!("the header of entry {n}"))
    } else {
        format!("entry {n}: {text}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use criu_gpu_test_support::ustar::header;

    #[test]
    fn packings() {
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Some(Packing::Gzip));
        assert_eq!(sniff(b"hello"), None);
        assert_eq!(sniff(&header("x", 0, b'0')), Some(Packing::Tar));
        let mut v7 = header("x", 0, b'0');
        v7[257..263].fill(0);
        assert!(sniff(&v7).is_none());
    }

    /// An error as the assertions read it: its message.
    #[derive(Debug, PartialEq)]
    struct Message(String);

    impl std::ops::Deref for Message {
        type Target = str;
        fn deref(&self) -> &str {
            &self.0
        }
    }

    impl std::fmt::Display for Message {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    fn entries_of(tar: &[u8]) -> Result<Vec<(String, u64)>, Message> {
        entries_packed(tar, Packing::Tar)
    }

    fn entries_packed(bytes: &[u8], packing: Packing) -> Result<Vec<(String, u64)>, Message> {
        // One file per call: the tests run in parallel threads of one process.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "criu-gpu-archive-{}-{call}-{}",
            std::process::id(),
            packing.name()
        ));
        std::fs::write(&path, bytes).unwrap();
        let mut seen = Vec::new();
        let r = read(
            &path,
            packing,
            |e| {
                seen.push((e.path.clone(), e.size));
                Want::Skip
            },
            |_, _| {},
        );
        let _ = std::fs::remove_file(&path);
        r.map(|()| seen).map_err(|e| Message(e.to_string()))
    }

    #[test]
    fn pax_sizes_and_unknown_kinds_keep_the_walk_in_step() {
        // An entry whose size only a pax record gives (the ustar field is 0 past 8 GiB).
        let pax = b"12 size=600\n";
        let mut tar = header("./PaxHeaders/big", pax.len() as u64, b'x');
        tar.extend(pax);
        tar.resize(2 * BLOCK, 0);
        tar.extend(header("big", 0, b'0'));
        tar.extend(vec![7u8; 1024]);
        // A kind this reader does not know, whose data is a header in disguise: skipped.
        let hidden = header("checkpoint/hidden.img", 0, b'0');
        tar.extend(header("odd", hidden.len() as u64, b'Z'));
        tar.extend(&hidden);
        // A GNU long link target: read and dropped.
        tar.extend(header("././@LongLink", 5, b'K'));
        tar.extend(b"x/y/z");
        tar.resize(tar.len().div_ceil(BLOCK) * BLOCK, 0);
        tar.extend(header("link", 0, b'2'));
        tar.extend(header("last", 0, b'0'));
        tar.extend(vec![0u8; 2 * BLOCK]);
        let seen = entries_of(&tar).unwrap();
        let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["big", "odd", "link", "last"], "{seen:?}");
        assert_eq!(seen[0].1, 600);
    }

    #[test]
    fn what_the_tar_reader_would_take_is_bounded() {
        // A long name far over the bound: refused before it is read into memory.
        let mut tar = header("././@LongLink", 1 << 20, b'L');
        tar.extend(vec![b'a'; 1 << 20]);
        tar.extend(header("x", 0, b'0'));
        tar.extend(vec![0u8; 2 * BLOCK]);
        let e = entries_of(&tar).unwrap_err();
        assert!(e.contains("long names and pax records"), "{e}");
        // A link declaring data (readers disagree on where the next header is): refused.
        let mut tar = header("l", BLOCK as u64, b'1');
        tar.extend(header("hidden.img", 0, b'0'));
        tar.extend(vec![0u8; 2 * BLOCK]);
        let e = entries_of(&tar).unwrap_err();
        assert!(e.contains("a link or directory declaring 512 bytes"), "{e}");
        // A sparse kind in a POSIX header is no GNU sparse file: refused, not guessed at.
        let mut tar = header("s", 0, b'S');
        tar.extend(vec![0u8; 2 * BLOCK]);
        assert!(entries_of(&tar).is_err());
        // An empty file holds no entries; an end marker alone is an empty archive.
        assert!(entries_of(&[]).unwrap_err().contains("no entries"));
        assert_eq!(entries_of(&[0u8; 2 * BLOCK]), Ok(Vec::new()));
    }

    /// `tar` packed as `packing`, by the same crates that unpack it.
    fn pack(tar: &[u8], packing: Packing) -> Vec<u8> {
        use std::io::Write;
        match packing {
            Packing::Tar => tar.to_vec(),
            Packing::Gzip => {
                let mut w =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                w.write_all(tar).unwrap();
                w.finish().unwrap()
            }
            Packing::Zstd => zstd::encode_all(tar, 3).unwrap(),
            Packing::Xz => {
                let mut w = liblzma::write::XzEncoder::new(Vec::new(), 6);
                w.write_all(tar).unwrap();
                w.finish().unwrap()
            }
        }
    }

    #[test]
    fn every_packing_is_unpacked_in_process_and_checked_to_its_end() {
        let mut tar = header("checkpoint/inventory.img", 3, b'0');
        tar.extend(b"inv");
        tar.resize(2 * BLOCK, 0);
        tar.extend(vec![0u8; 2 * BLOCK]);
        for packing in [Packing::Tar, Packing::Gzip, Packing::Zstd, Packing::Xz] {
            let packed = pack(&tar, packing);
            assert_eq!(sniff(&packed), Some(packing));
            assert_eq!(
                entries_packed(&packed, packing),
                Ok(vec![("checkpoint/inventory.img".to_string(), 3)]),
                "{packing:?}"
            );
            if packing == Packing::Tar {
                continue;
            }
            // Damage past the end marker (the compressed data's own checksum at its end).
            let mut bad = packed.clone();
            let at = bad.len() - 2;
            bad[at] ^= 0x55;
            let e = entries_packed(&bad, packing).unwrap_err();
            assert!(
                e.contains(&format!("damaged ({}", packing.compression())),
                "{packing:?}: {e}"
            );
            // Cut short.
            let e = entries_packed(&packed[..packed.len() / 2], packing).unwrap_err();
            assert!(e.contains(packing.compression()), "{packing:?}: {e}");
        }
    }

    #[test]
    fn gzip_members_and_zero_padding_are_read_as_gzip_reads_them() {
        let mut tar = header("checkpoint/inventory.img", 3, b'0');
        tar.extend(b"inv");
        tar.resize(2 * BLOCK, 0);
        tar.extend(vec![0u8; 2 * BLOCK]);
        let want = Ok(vec![("checkpoint/inventory.img".to_string(), 3)]);
        // Two members (`cat a.gz b.gz`), the archive split between them.
        let mut two = pack(&tar[..BLOCK], Packing::Gzip);
        two.extend(pack(&tar[BLOCK..], Packing::Gzip));
        assert_eq!(entries_packed(&two, Packing::Gzip), want);
        // Padded with zeros to a block, as tape and some writers do.
        let mut padded = pack(&tar, Packing::Gzip);
        padded.resize(padded.len() + 10240, 0);
        assert_eq!(entries_packed(&padded, Packing::Gzip), want);
        // Anything else after the member is damage.
        let mut garbage = padded.clone();
        garbage.push(b'x');
        let e = entries_packed(&garbage, Packing::Gzip).unwrap_err();
        assert!(e.contains("damaged (gzip"), "{e}");
    }

    #[test]
    fn a_sparse_file_is_passed_over_as_stored_not_as_expanded() {
        // 512 bytes stored at the end of a 1 TiB sparse file.
        let mut h = tar::Header::new_gnu();
        h.set_path("s").unwrap();
        h.set_entry_type(EntryType::GNUSparse);
        h.set_size(BLOCK as u64);
        let gnu = h.as_gnu_mut().unwrap();
        // GNU base-256: numbers beyond what octal digits hold.
        let number = |f: &mut [u8; 12], v: u64| {
            f[0] = 0x80;
            f[4..].copy_from_slice(&v.to_be_bytes());
        };
        number(&mut gnu.realsize, 1 << 40);
        number(&mut gnu.sparse[0].offset, (1 << 40) - BLOCK as u64);
        number(&mut gnu.sparse[0].numbytes, BLOCK as u64);
        h.set_cksum();
        let mut tar = h.as_bytes().to_vec();
        tar.extend([1u8; BLOCK]);
        tar.extend(header("after", 0, b'0'));
        tar.extend(vec![0u8; 2 * BLOCK]);
        let want = vec![("s".to_string(), 1 << 40), ("after".to_string(), 0)];
        for packing in [Packing::Tar, Packing::Gzip] {
            let started = Instant::now();
            assert_eq!(
                entries_packed(&pack(&tar, packing), packing),
                Ok(want.clone())
            );
            assert!(started.elapsed() < Duration::from_secs(5), "{packing:?}");
        }
    }
}
