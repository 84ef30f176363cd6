//! Reading checkpoint archives: tar (ustar, GNU and pax headers), plain or compressed with
//! gzip, zstd or xz, which are decompressed by the system's `gzip`, `zstd` or `xz` (the tools
//! that made them; no decompressor is linked in).
//!
//! Built for hostile input: every header is checked (checksum, octal or base-256 sizes, name
//! lengths), long-name and pax records are bounded, only the entries the caller asks for are
//! read (each up to its own limit), the rest are skipped without being kept, and the entry
//! count and total size are bounded. Entries are never written anywhere, so a path with `..`
//! or a leading `/` cannot reach outside anything; the caller gets the normalised path and
//! decides (see `images`).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

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
/// Longest GNU long name or pax header accepted.
const MAX_META: u64 = 64 * 1024;
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

    fn tool(self) -> Option<&'static str> {
        match self {
            Packing::Tar => None,
            Packing::Gzip => Some("gzip"),
            Packing::Zstd => Some("zstd"),
            Packing::Xz => Some("xz"),
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

/// The archive's byte source: a file (seekable, so skipping is cheap) or a decompressor.
enum Source {
    File(File),
    Pipe(Child, ChildStdout, Instant),
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Source::File(f) => f.read(buf),
            Source::Pipe(_, out, deadline) => Deadlined(out, *deadline).read(buf),
        }
    }
}

/// A decompressor's output read no later than a deadline.
struct Deadlined<'a>(&'a mut ChildStdout, Instant);

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        wait_readable(self.0, self.1)?;
        self.0.read(buf)
    }
}

/// Waits until the decompressor's output can be read, at most until `deadline`.
fn wait_readable(out: &ChildStdout, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "unpacking took longer than {} s; refused",
                    MAX_UNPACK_TIME.as_secs()
                ),
            ));
        }
        let mut p = libc::pollfd {
            fd: out.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: poll(2) on one valid pollfd that lives across the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            return Ok(());
        }
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

struct Reader {
    src: Source,
    /// Bytes consumed so far.
    pos: u64,
    /// The file's length, when it is one.
    len: Option<u64>,
    /// Most bytes read through the archive: [`MAX_ARCHIVE_BYTES`], less for a compressed one.
    limit: u64,
}

impl Reader {
    fn exact(&mut self, buf: &mut [u8], what: &str) -> Result<(), String> {
        let mut got = 0;
        while got < buf.len() {
            match self.src.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(format!(
                        "the archive is truncated: it ends after {} bytes, inside {what}",
                        self.pos + got as u64
                    ));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("cannot read the archive: {e}")),
            }
        }
        self.pos += buf.len() as u64;
        if self.pos > self.limit {
            return Err(match self.src {
                Source::Pipe(..) if self.limit < MAX_ARCHIVE_BYTES => format!(
                    "the archive unpacks to more than {} bytes, over {MAX_RATIO} times its packed size: refused as a likely decompression bomb (unpack it yourself and give the directory)",
                    self.limit
                ),
                _ => format!(
                    "the archive unpacks to more than {} bytes; refused",
                    self.limit
                ),
            });
        }
        Ok(())
    }

    /// Reads one header block; `false` at a clean end of the data before it.
    fn header(&mut self, buf: &mut [u8; BLOCK]) -> Result<bool, String> {
        let n = loop {
            match self.src.read(&mut buf[..1]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("cannot read the archive: {e}")),
                Ok(n) => break n,
            }
        };
        if n == 0 {
            return Ok(false);
        }
        self.pos += 1;
        self.exact(&mut buf[1..], "an entry header")?;
        Ok(true)
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), String> {
        if let (Source::File(f), Some(len)) = (&mut self.src, self.len) {
            let end = self
                .pos
                .checked_add(n)
                .filter(|&e| e <= len)
                .ok_or_else(|| {
                    format!(
                        "the archive is truncated: {what} needs {n} bytes, the file has {} left",
                        len.saturating_sub(self.pos)
                    )
                })?;
            f.seek(SeekFrom::Start(end))
                .map_err(|e| format!("cannot read the archive: {e}"))?;
            self.pos = end;
            return Ok(());
        }
        let mut buf = vec![0u8; 64 * 1024];
        let mut left = n;
        while left > 0 {
            let k = left.min(buf.len() as u64) as usize;
            self.exact(&mut buf[..k], what)?;
            left -= k as u64;
        }
        Ok(())
    }
}

/// Largest entry size taken from a header: rounding it up to whole blocks cannot overflow.
/// (Larger archives than [`MAX_ARCHIVE_BYTES`] are refused while reading.)
const MAX_ENTRY_BYTES: u64 = u64::MAX - BLOCK as u64;

/// `size` rounded up to whole blocks; sizes above [`MAX_ENTRY_BYTES`] are refused first, so
/// this cannot overflow.
fn padded(size: u64) -> u64 {
    size.div_ceil(BLOCK as u64) * BLOCK as u64
}

fn checksum_ok(h: &[u8]) -> bool {
    let Some(stored) = octal(&h[148..156]) else {
        return false;
    };
    let sum: u64 = h
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                u64::from(b' ')
            } else {
                u64::from(b)
            }
        })
        .sum();
    sum == stored
}

/// An octal field (NUL or space terminated), or GNU base-256 when the top bit is set.
fn octal(f: &[u8]) -> Option<u64> {
    if f.first().is_some_and(|b| b & 0x80 != 0) {
        if f[0] != 0x80 || f.len() > 12 {
            return None;
        }
        return f[1..].iter().try_fold(0u64, |acc, &b| {
            acc.checked_mul(256)?.checked_add(u64::from(b))
        });
    }
    let s: Vec<u8> = f
        .iter()
        .copied()
        .take_while(|&b| b != 0)
        .filter(|&b| b != b' ')
        .collect();
    if s.is_empty() {
        return Some(0);
    }
    s.iter().try_fold(0u64, |acc, &b| {
        (b'0'..=b'7').contains(&b).then_some(())?;
        acc.checked_mul(8)?.checked_add(u64::from(b - b'0'))
    })
}

fn field_str(f: &[u8]) -> String {
    let end = f.iter().position(|&b| b == 0).unwrap_or(f.len());
    String::from_utf8_lossy(&f[..end]).into_owned()
}

/// The `path` record of a pax extended header, if any.
fn pax_path(data: &[u8]) -> Option<String> {
    pax_field(data, b"path=").map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The size a pax header gives the next entry (`size=`: the ustar field holds 0 past 8 GiB).
fn pax_size(data: &[u8]) -> Option<u64> {
    std::str::from_utf8(pax_field(data, b"size=")?)
        .ok()?
        .parse()
        .ok()
}

/// The value of the last pax record `key` (`path=`, `size=`) in `data`.
fn pax_field<'a>(data: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let mut found = None;
    let mut rest = data;
    while !rest.is_empty() {
        let sp = rest.iter().position(|&b| b == b' ')?;
        let len: usize = std::str::from_utf8(&rest[..sp]).ok()?.parse().ok()?;
        if len <= sp || len > rest.len() {
            return None;
        }
        let rec = &rest[sp + 1..len];
        let rec = rec.strip_suffix(b"\n").unwrap_or(rec);
        if let Some(v) = rec.strip_prefix(key) {
            found = Some(v);
        }
        rest = &rest[len..];
    }
    found
}

/// Reads the archive at `path` (packed as `packing`), calling `visit` for every entry; the
/// visitor asks for the data of the entries it needs and gets them through `take`.
pub fn read(
    path: &Path,
    packing: Packing,
    mut visit: impl FnMut(&Entry) -> Want,
    mut take: impl FnMut(&Entry, Data),
) -> Result<(), String> {
    // Without blocking and only a regular file: a FIFO put in its place must not hang the tool.
    let file = criu_plugin::files::open_regular(None, path, false)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let len = file.metadata().ok().map(|m| m.len());
    let src = match packing.tool() {
        None => Source::File(file),
        Some(tool) => {
            let mut child = Command::new(tool)
                .args(["-dc"])
                .stdin(file)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| {
                    format!("cannot run `{tool}` to unpack the archive ({e}): install {tool}")
                })?;
            let out = child.stdout.take().ok_or("no pipe from the decompressor")?;
            Source::Pipe(child, out, Instant::now() + MAX_UNPACK_TIME)
        }
    };
    let limit = match (&src, len) {
        (Source::File(_), _) => MAX_ARCHIVE_BYTES,
        (Source::Pipe(..), Some(n)) => unpack_limit(n),
        (Source::Pipe(..), None) => MIN_UNPACKED,
    };
    let mut r = Reader {
        len: matches!(src, Source::File(_)).then_some(len).flatten(),
        src,
        pos: 0,
        limit,
    };
    let result = walk(&mut r, &mut visit, &mut take);
    finish(r, packing, result)
}

/// What a compressed archive of `packed` bytes may unpack to.
fn unpack_limit(packed: u64) -> u64 {
    packed
        .saturating_mul(MAX_RATIO)
        .clamp(MIN_UNPACKED, MAX_ARCHIVE_BYTES)
}

/// Ends the decompressor: what follows the end marker is drained (a little padding; more is
/// cut off), its complaint is added to a failure, and a decompressor that failed after a
/// complete walk (a bad checksum at the end) fails the read.
fn finish(r: Reader, packing: Packing, result: Result<(), String>) -> Result<(), String> {
    let Source::Pipe(mut child, mut out, deadline) = r.src else {
        return result;
    };
    let mut drained = false;
    if result.is_ok() {
        // Through the deadline too: a decompressor that stalls here must not hang the tool.
        let mut rest = Deadlined(&mut out, deadline).take(16 << 20);
        drained = io::copy(&mut rest, &mut io::sink()).is_ok_and(|n| n < 16 << 20);
    }
    drop(out);
    if !drained {
        let _ = child.kill();
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = (&mut e).take(4096).read_to_string(&mut err);
    }
    let status = child.wait();
    let tool = packing.tool().unwrap_or("");
    let err = err.trim();
    match result {
        Err(e) if err.is_empty() => Err(e),
        Err(e) => Err(format!("{e} ({err})")),
        Ok(()) if drained && status.is_ok_and(|s| !s.success()) => Err(format!(
            "the archive is damaged ({})",
            if err.is_empty() {
                format!("{tool} failed")
            } else {
                err.to_string()
            }
        )),
        Ok(()) => Ok(()),
    }
}

fn walk(
    r: &mut Reader,
    visit: &mut impl FnMut(&Entry) -> Want,
    take: &mut impl FnMut(&Entry, Data),
) -> Result<(), String> {
    let mut count = 0u64;
    let mut long_name: Option<String> = None;
    let mut next_size: Option<u64> = None;
    let mut h = [0u8; BLOCK];
    loop {
        // An archive without its end marker still has every entry before it.
        if !r.header(&mut h)? {
            return if count > 0 {
                Ok(())
            } else {
                Err("the archive holds no entries".into())
            };
        }
        if h.iter().all(|&b| b == 0) {
            return Ok(());
        }
        count += 1;
        if count > MAX_ENTRIES {
            return Err(format!(
                "the archive has more than {MAX_ENTRIES} entries; refused"
            ));
        }
        if !checksum_ok(&h) {
            return Err(format!(
                "entry {count} (at byte {}) has a bad header checksum: not a tar archive, or a damaged one",
                r.pos - BLOCK as u64
            ));
        }
        let size = octal(&h[124..136])
            .ok_or_else(|| format!("entry {count} has a malformed size field"))?;
        if size > MAX_ENTRY_BYTES {
            return Err(format!(
                "entry {count} declares {size} bytes, more than a tar entry can hold; refused"
            ));
        }
        let kind = h[156];
        let what = format!("entry {count}");
        match kind {
            b'L' | b'K' | b'x' => {
                if size > MAX_META {
                    return Err(format!(
                        "entry {count}: a {} of {size} bytes (at most {MAX_META}); refused",
                        match kind {
                            b'L' => "long name",
                            b'K' => "long link target",
                            _ => "pax header",
                        }
                    ));
                }
                let mut data = vec![0u8; padded(size) as usize];
                r.exact(&mut data, &what)?;
                data.truncate(size as usize);
                match kind {
                    b'L' => long_name = Some(field_str(&data)),
                    // A link's target: nothing here reads links.
                    b'K' => {}
                    _ => {
                        long_name = pax_path(&data).or(long_name);
                        next_size = pax_size(&data).or(next_size);
                    }
                }
                continue;
            }
            b'g' => {
                r.skip(padded(size), &what)?;
                continue;
            }
            _ => {}
        }
        let size = match next_size.take() {
            Some(n) if n > MAX_ENTRY_BYTES => {
                return Err(format!(
                    "entry {count} declares {n} bytes, more than a tar entry can hold; refused"
                ));
            }
            Some(n) => n,
            None => size,
        };
        let name = match long_name.take() {
            Some(n) => n,
            // POSIX ustar only: GNU headers keep other fields there.
            None if &h[257..263] == b"ustar\0" && h[345] != 0 => {
                format!("{}/{}", field_str(&h[345..500]), field_str(&h[..100]))
            }
            None => field_str(&h[..100]),
        };
        let regular = matches!(kind, b'0' | 0 | b'7');
        // Links and directories carry no data in the archive; every other kind (sparse files,
        // kinds this reader does not know) is skipped by its size, so that the walk stays in
        // step and no entry hides in another's data.
        let size = if matches!(kind, b'1' | b'2' | b'5') {
            0
        } else {
            size
        };
        let entry = Entry {
            path: name,
            size,
            regular,
        };
        match visit(&entry) {
            Want::Read(limit) if size > limit => {
                take(&entry, Data::TooLarge { limit });
                r.skip(padded(size), &what)?;
            }
            Want::Read(_) => {
                let mut data = vec![0u8; size as usize];
                r.exact(&mut data, &format!("{} ({size} bytes)", entry.path))?;
                r.skip(padded(size) - size, &what)?;
                take(&entry, Data::Bytes(data));
            }
            Want::Skip => r.skip(padded(size), &format!("{} ({size} bytes)", entry.path))?,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields() {
        assert_eq!(octal(b"0000644\0"), Some(0o644));
        assert_eq!(octal(b"   12 \0"), Some(0o12));
        assert_eq!(octal(b"9"), None);
        assert_eq!(octal(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]), Some(256));
        assert_eq!(octal(&[0xff; 12]), None);
        assert_eq!(
            pax_path(b"30 path=checkpoint/pstree.img\n"),
            Some("checkpoint/pstree.img".into())
        );
        assert_eq!(pax_path(b"999 path=x\n"), None);
        assert_eq!(pax_size(b"19 size=8589934592\n"), Some(8 << 30));
        assert_eq!(pax_size(b"11 size=x1\n"), None);
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Some(Packing::Gzip));
        assert_eq!(sniff(b"hello"), None);
    }

    fn header(name: &str, size: u64, kind: u8) -> Vec<u8> {
        let mut h = vec![0u8; BLOCK];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..107].copy_from_slice(b"0000644");
        h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        h
    }

    fn entries_of(tar: &[u8]) -> Result<Vec<(String, u64)>, String> {
        let path =
            std::env::temp_dir().join(format!("criu-gpu-archive-{}.tar", std::process::id()));
        std::fs::write(&path, tar).unwrap();
        let mut seen = Vec::new();
        let r = read(
            &path,
            Packing::Tar,
            |e| {
                seen.push((e.path.clone(), e.size));
                Want::Skip
            },
            |_, _| {},
        );
        let _ = std::fs::remove_file(&path);
        r.map(|()| seen)
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
        tar.extend(header("odd", hidden.len() as u64, b'S'));
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
}
