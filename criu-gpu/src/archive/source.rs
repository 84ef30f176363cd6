//! The archive's bytes as the tar reader sees them: the file, or what a decompressor makes of
//! it (gzip members one after another, zstd, xz), each read counted and bounded by the limits
//! of [`super`].

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::rc::Rc;
use std::time::Instant;

use super::{MAX_ARCHIVE_BYTES, MAX_META, MAX_RATIO, MAX_UNPACK_TIME, MIN_UNPACKED};

/// What the byte source counts and bounds, shared with the walk over the entries.
pub(super) struct Gauge {
    /// Bytes read so far (in a plain file: the position reached).
    pub(super) pos: Cell<u64>,
    /// Most bytes read: [`MAX_ARCHIVE_BYTES`], less for a compressed archive.
    pub(super) limit: Cell<u64>,
    /// While the tar reader looks for the next entry: the bytes it may still read.
    pub(super) meta_left: Cell<Option<u64>>,
    /// Why the source failed a read, when it did: the real cause under the tar reader's error.
    pub(super) stopped: RefCell<Option<String>>,
}

impl Gauge {
    pub(super) fn stop(&self, why: String) -> io::Error {
        let e = io::Error::other(why.clone());
        self.stopped.borrow_mut().get_or_insert(why);
        e
    }

    pub(super) fn count(&self, n: u64, compressed: bool) -> io::Result<()> {
        self.pos.set(self.pos.get().saturating_add(n));
        if self.pos.get() > self.limit.get() {
            let limit = self.limit.get();
            return Err(self.stop(if compressed && limit < MAX_ARCHIVE_BYTES {
                format!(
                    "the archive unpacks to more than {limit} bytes, over {MAX_RATIO} times its packed size: refused as a likely decompression bomb (unpack it yourself and give the directory)"
                )
            } else {
                format!("the archive unpacks to more than {limit} bytes; refused")
            }));
        }
        if let Some(left) = self.meta_left.get() {
            let left = left.checked_sub(n).ok_or_else(|| {
                self.stop(format!(
                    "headers, long names and pax records of more than {MAX_META} bytes before one entry; refused"
                ))
            })?;
            self.meta_left.set(Some(left));
        }
        Ok(())
    }
}

/// The archive's bytes as the tar reader sees them: the file (seekable, so that skipping is
/// cheap) or what a decompressor makes of it, each read counted and bounded.
pub(super) struct Source {
    pub(super) unpacked: Unpacked,
    pub(super) gauge: Rc<Gauge>,
}

pub(super) enum Unpacked {
    File(File),
    Decoder {
        decoder: Box<dyn Read>,
        deadline: Instant,
        compression: &'static str,
    },
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let g = &self.gauge;
        let (n, compressed) = match &mut self.unpacked {
            Unpacked::File(f) => (f.read(buf)?, false),
            Unpacked::Decoder {
                decoder,
                deadline,
                compression,
            } => {
                if Instant::now() > *deadline {
                    return Err(g.stop(format!(
                        "unpacking took longer than {} s; refused",
                        MAX_UNPACK_TIME.as_secs()
                    )));
                }
                match decoder.read(buf) {
                    Ok(n) => (n, true),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(e),
                    Err(e) => {
                        return Err(g.stop(format!("the archive is damaged ({compression}: {e})")));
                    }
                }
            }
        };
        g.count(n as u64, compressed)?;
        Ok(n)
    }
}

impl Seek for Source {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        match &mut self.unpacked {
            Unpacked::File(f) => {
                let p = f.seek(to)?;
                self.gauge.pos.set(p);
                self.gauge.count(0, false)?;
                Ok(p)
            }
            Unpacked::Decoder { .. } => Err(io::ErrorKind::Unsupported.into()),
        }
    }
}

/// What a compressed archive of `packed` bytes may unpack to.
pub(super) fn unpack_limit(packed: u64) -> u64 {
    packed
        .saturating_mul(MAX_RATIO)
        .clamp(MIN_UNPACKED, MAX_ARCHIVE_BYTES)
}

/// The gzip members of a file one after another, as `gzip -dc` reads them: after the last,
/// zero bytes (tape or block padding some writers add) end the data; anything else is damage.
/// flate2's own multi-member reader takes padding for a member with a bad header.
pub(super) struct GzipMembers {
    member: Option<flate2::bufread::GzDecoder<io::BufReader<File>>>,
}

impl GzipMembers {
    pub(super) fn new(file: File) -> GzipMembers {
        let input = io::BufReader::new(file);
        GzipMembers {
            member: Some(flate2::bufread::GzDecoder::new(input)),
        }
    }

    /// After a member: whether another follows (else only zeros, up to the end, do).
    fn another_member(input: &mut io::BufReader<File>) -> io::Result<bool> {
        use std::io::BufRead;
        loop {
            let buf = input.fill_buf()?;
            let Some(&first) = buf.first() else {
                return Ok(false);
            };
            if first == 0x1f {
                return Ok(true);
            }
            if buf.iter().any(|&b| b != 0) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "what follows a gzip member is neither another member nor zero padding",
                ));
            }
            let n = buf.len();
            input.consume(n);
        }
    }
}

impl Read for GzipMembers {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while let Some(member) = self.member.as_mut() {
            let n = member.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            let mut input = self.member.take().expect("a member").into_inner();
            if GzipMembers::another_member(&mut input)? {
                self.member = Some(flate2::bufread::GzDecoder::new(input));
            }
        }
        Ok(0)
    }
}
