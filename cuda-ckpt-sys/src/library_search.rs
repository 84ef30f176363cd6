//! Finds a bare library name (`libcuda.so.1`) over absolute directories only, so that it is
//! `dlopen`ed by absolute path.
//!
//! `dlopen` of a bare name lets the dynamic loader search `LD_LIBRARY_PATH`, and the loader
//! reads an empty or relative entry there (a trailing `:`) against the working directory: for
//! CRIU that is the image directory, which whoever made the checkpoint filled. So the name is
//! looked up here instead, in the loader's order, with only absolute directories:
//!
//! 1. the absolute entries of `LD_LIBRARY_PATH` (`:` or `;` between entries), in order, unless
//!    the process runs in secure-execution mode (then the loader ignores the variable too);
//! 2. the loader cache `/etc/ld.so.cache`: its entries for this machine's ABI (the flags glibc
//!    itself accepts) without hardware-capability variants;
//! 3. the system directories.
//!
//! A candidate must be a regular file holding an ELF object of this machine's class, byte order
//! and architecture (the loader checks the same and moves on), else the search goes on.
//!
//! This runs inside CRIU's process: no thread, nothing kept between calls, every read bounded
//! (the cache at [`MAX_CACHE_BYTES`]), every offset of the cache checked, no panic.

use std::ffi::OsStr;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The loader cache glibc's `ldconfig` writes.
pub const LOADER_CACHE: &str = "/etc/ld.so.cache";

/// The largest loader cache read (a distribution's holds a few thousand entries, well under
/// 1 MiB); a larger file is not read and the search goes on without it.
pub const MAX_CACHE_BYTES: u64 = 8 << 20;

/// The longest path a cache entry may name.
const MAX_PATH: usize = 4096;

/// The system directories, in search order: the Debian-style multiarch directories, the
/// `lib64` ones of Red Hat-style systems, then plain `lib`.
#[cfg(target_arch = "x86_64")]
pub const SYSTEM_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];
/// The system directories, in search order: the Debian-style multiarch directories, the
/// `lib64` ones of Red Hat-style systems, then plain `lib`.
#[cfg(target_arch = "aarch64")]
pub const SYSTEM_DIRS: &[&str] = &[
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];
/// The system directories, in search order: the Debian-style multiarch directories, the
/// `lib64` ones of Red Hat-style systems, then plain `lib`.
#[cfg(target_arch = "powerpc64")]
pub const SYSTEM_DIRS: &[&str] = &[
    "/lib/powerpc64le-linux-gnu",
    "/usr/lib/powerpc64le-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];
/// The system directories, in search order.
#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "powerpc64"
)))]
pub const SYSTEM_DIRS: &[&str] = &["/lib64", "/usr/lib64", "/lib", "/usr/lib"];

/// The cache flags of a library for this machine: glibc's "ELF, libc6" type (3) with the ABI
/// byte `ldconfig` writes for this architecture. `None`: the cache is not read here.
#[cfg(target_arch = "x86_64")]
const CACHE_FLAGS: Option<i32> = Some(0x0303);
#[cfg(target_arch = "aarch64")]
const CACHE_FLAGS: Option<i32> = Some(0x0a03);
#[cfg(target_arch = "powerpc64")]
const CACHE_FLAGS: Option<i32> = Some(0x0503);
#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "powerpc64"
)))]
const CACHE_FLAGS: Option<i32> = None;

/// ELF `e_machine` of this architecture (`None`: not checked).
#[cfg(target_arch = "x86_64")]
const ELF_MACHINE: Option<u16> = Some(62);
#[cfg(target_arch = "aarch64")]
const ELF_MACHINE: Option<u16> = Some(183);
#[cfg(target_arch = "powerpc64")]
const ELF_MACHINE: Option<u16> = Some(21);
#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "powerpc64"
)))]
const ELF_MACHINE: Option<u16> = None;

/// ELF `EI_CLASS` of this process: 2 for 64-bit objects, 1 for 32-bit.
const ELF_CLASS: u8 = if cfg!(target_pointer_width = "64") {
    2
} else {
    1
};
/// ELF `EI_DATA` of this process: 1 little-endian, 2 big-endian.
const ELF_DATA: u8 = if cfg!(target_endian = "little") { 1 } else { 2 };

/// A bare name found nowhere; says every place searched and why candidates were passed over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotFound {
    /// The name looked for.
    pub name: String,
    /// What was searched, in order, in words.
    pub searched: Vec<String>,
}

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} not found in {} (the working directory is never searched)",
            self.name,
            self.searched.join("; ")
        )
    }
}

impl std::error::Error for NotFound {}

/// Finds `name` (a file name without `/`) as the process's environment and this machine's
/// loader cache and system directories give it: the absolute path to `dlopen`.
pub fn find(name: &str) -> Result<PathBuf, NotFound> {
    let library_path = std::env::var_os("LD_LIBRARY_PATH");
    // SAFETY: getauxval reads the auxiliary vector the kernel gave this process; no pointer.
    let secure = unsafe { libc::getauxval(libc::AT_SECURE) } != 0;
    Search {
        library_path: library_path.as_deref(),
        secure,
        cache: Path::new(LOADER_CACHE),
        system_dirs: SYSTEM_DIRS,
    }
    .find(name)
}

/// Where a search looks; [`find`] uses the process's own, tests give others.
#[derive(Clone, Copy, Debug)]
pub struct Search<'a> {
    /// `LD_LIBRARY_PATH`'s value (`None`: unset).
    pub library_path: Option<&'a OsStr>,
    /// Secure-execution mode (`AT_SECURE`: a set-user-ID program, or one given file
    /// capabilities, as an unprivileged user may run CRIU): `LD_LIBRARY_PATH`, which that user
    /// controls, is ignored, as the loader ignores it.
    pub secure: bool,
    /// The loader cache file.
    pub cache: &'a Path,
    /// The system directories, in order.
    pub system_dirs: &'a [&'a str],
}

impl Search<'_> {
    /// The absolute path of the first acceptable `name`, or everything that was searched.
    pub fn find(&self, name: &str) -> Result<PathBuf, NotFound> {
        let mut searched = Vec::new();
        let not_found = |searched| NotFound {
            name: name.to_owned(),
            searched,
        };
        if name.is_empty() || name.contains(['/', '\0']) || name == "." || name == ".." {
            return Err(not_found(vec!["nowhere: not a bare library name".into()]));
        }
        let mut passed_over = Vec::new();

        if self.secure {
            searched.push("LD_LIBRARY_PATH (ignored in secure-execution mode)".into());
        } else {
            let (dirs, skipped) = absolute_entries(self.library_path);
            let candidates = dirs.iter().map(|d| d.join(name));
            if let Some(p) = first_acceptable(candidates, &mut passed_over) {
                return Ok(p);
            }
            searched.push(describe_library_path(self.library_path, &dirs, &skipped));
        }

        let cache = format!("the loader cache {}", self.cache.display());
        match cache_paths(self.cache, name) {
            Ok(paths) => {
                if let Some(p) = first_acceptable(paths.into_iter(), &mut passed_over) {
                    return Ok(p);
                }
                searched.push(cache);
            }
            Err(why) => searched.push(format!("{cache} ({why})")),
        }

        let system = self.system_dirs.iter().map(|d| Path::new(d).join(name));
        if let Some(p) = first_acceptable(system, &mut passed_over) {
            return Ok(p);
        }
        searched.push(format!(
            "the system directories [{}]",
            self.system_dirs.join(", ")
        ));
        if !passed_over.is_empty() {
            searched.push(format!("passed over: {}", passed_over.join(", ")));
        }
        Err(not_found(searched))
    }
}

/// The absolute directories of `LD_LIBRARY_PATH`, and the entries skipped (empty or relative,
/// which the loader would read against the working directory).
fn absolute_entries(value: Option<&OsStr>) -> (Vec<PathBuf>, Vec<String>) {
    let mut dirs = Vec::new();
    let mut skipped = Vec::new();
    let Some(value) = value else {
        return (dirs, skipped);
    };
    for entry in value.as_bytes().split(|&b| b == b':' || b == b';') {
        if entry.first() == Some(&b'/') {
            dirs.push(PathBuf::from(OsStr::from_bytes(entry)));
        } else {
            skipped.push(format!("{:?}", String::from_utf8_lossy(entry)));
        }
    }
    (dirs, skipped)
}

fn describe_library_path(value: Option<&OsStr>, dirs: &[PathBuf], skipped: &[String]) -> String {
    if value.is_none() {
        return "LD_LIBRARY_PATH (unset)".into();
    }
    let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    let mut text = format!(
        "LD_LIBRARY_PATH's absolute directories [{}]",
        dirs.join(", ")
    );
    if !skipped.is_empty() {
        text.push_str(&format!(
            " (empty or relative entries skipped: {})",
            skipped.join(", ")
        ));
    }
    text
}

/// The first of `candidates` that is an ELF object for this machine; the others that exist are
/// noted in `passed_over` with the reason.
fn first_acceptable(
    candidates: impl Iterator<Item = PathBuf>,
    passed_over: &mut Vec<String>,
) -> Option<PathBuf> {
    for path in candidates {
        match acceptable(&path) {
            Ok(true) => return Some(path),
            Ok(false) => {}
            Err(why) => passed_over.push(format!("{} ({why})", path.display())),
        }
    }
    None
}

/// Why a file was passed over: a candidate library, or the loader cache.
#[derive(Debug, thiserror::Error)]
enum Unusable {
    /// A directory, a device node, a FIFO...
    #[error("not a regular file")]
    NotRegular,
    /// It cannot be looked at or read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Shorter than an ELF header.
    #[error("too short for an ELF header")]
    TooShort,
    /// No ELF magic.
    #[error("not an ELF object")]
    NotElf,
    /// An ELF object of another class or byte order.
    #[error("an ELF object of another word size or byte order")]
    OtherClass,
    /// An ELF object for another machine.
    #[error("an ELF object for machine {0}")]
    OtherMachine(u16),
    /// Larger than read.
    #[error("{0} bytes, more than the {MAX_CACHE_BYTES} read")]
    TooLarge(u64),
}

/// Why the loader cache gave no paths (the search goes on without it).
#[derive(Debug, thiserror::Error)]
enum CacheUnused {
    /// This architecture's cache flags are not known.
    #[error("not read on this architecture")]
    NotHere,
    /// There is no cache.
    #[error("absent")]
    Absent,
    /// It cannot be read.
    #[error("not read: {0}")]
    NotRead(Unusable),
    /// It is not a cache this search understands.
    #[error("ignored: {0}")]
    Malformed(BadCache),
}

/// What is wrong with the bytes of a loader cache.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
struct BadCache(&'static str);

/// `Ok(false)`: no such file. `Ok(true)`: a regular file holding an ELF object of this
/// machine's class, byte order and architecture. `Err`: something else is there.
fn acceptable(path: &Path) -> Result<bool, Unusable> {
    // stat first: a device node or FIFO is never opened.
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(Unusable::NotRegular),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    let mut file = open_regular(path)?;
    let mut header = [0u8; 20];
    file.read_exact(&mut header)
        .map_err(|_| Unusable::TooShort)?;
    elf_for_this_machine(&header).map(|()| true)
}

/// Opens `path` for reading without blocking on a FIFO, and checks (on the open file) that it
/// is a regular file.
fn open_regular(path: &Path) -> Result<File, Unusable> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    match file.metadata() {
        Ok(m) if m.is_file() => Ok(file),
        Ok(_) => Err(Unusable::NotRegular),
        Err(e) => Err(e.into()),
    }
}

/// Checks the first 20 bytes of an ELF file: magic, class, byte order, machine.
fn elf_for_this_machine(header: &[u8; 20]) -> Result<(), Unusable> {
    if header[..4] != *b"\x7fELF" {
        return Err(Unusable::NotElf);
    }
    if header[4] != ELF_CLASS || header[5] != ELF_DATA {
        return Err(Unusable::OtherClass);
    }
    let machine = u16::from_ne_bytes([header[18], header[19]]);
    match ELF_MACHINE {
        Some(m) if m != machine => Err(Unusable::OtherMachine(machine)),
        _ => Ok(()),
    }
}

/// The paths the loader cache `cache` gives for `name` on this machine, in its order. A missing
/// cache gives none; one that cannot be read or parsed is an error (the search goes on).
fn cache_paths(cache: &Path, name: &str) -> Result<Vec<PathBuf>, CacheUnused> {
    let Some(flags) = CACHE_FLAGS else {
        return Err(CacheUnused::NotHere);
    };
    let bytes = match read_cache(cache) {
        Ok(Some(b)) => b,
        Ok(None) => return Err(CacheUnused::Absent),
        Err(why) => return Err(CacheUnused::NotRead(why)),
    };
    lookup(&bytes, name.as_bytes(), flags).map_err(CacheUnused::Malformed)
}

/// The cache's bytes, at most [`MAX_CACHE_BYTES`]; `None` when there is no such file.
fn read_cache(cache: &Path) -> Result<Option<Vec<u8>>, Unusable> {
    match std::fs::metadata(cache) {
        Ok(m) if !m.is_file() => return Err(Unusable::NotRegular),
        Ok(m) if m.len() > MAX_CACHE_BYTES => return Err(Unusable::TooLarge(m.len())),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let file = open_regular(cache)?;
    let mut bytes = Vec::new();
    file.take(MAX_CACHE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CACHE_BYTES {
        return Err(Unusable::TooLarge(bytes.len() as u64));
    }
    Ok(Some(bytes))
}

/// The old format's magic (libc5 and glibc before 2.2); glibc 2.2 to 2.31 wrote it followed by
/// the new format.
const OLD_MAGIC: &[u8] = b"ld.so-1.7.0";
/// Old header: the magic padded to 12 bytes, then the entry count.
const OLD_HEADER: usize = 16;
/// Old entry: flags, key offset, value offset (string offsets from the end of the entries).
const OLD_ENTRY: usize = 12;
/// The new format's magic and version.
const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
/// New header: magic and version (20), count, string table length, flags byte, 3 padding,
/// extension offset, 12 unused.
const NEW_HEADER: usize = 48;
/// New entry: flags, key, value (string offsets from the start of the new header), OS
/// version, hardware capabilities (u64).
const NEW_ENTRY: usize = 24;
/// The new header's byte-order field: 0 unknown (older `ldconfig`), else its low two bits are
/// 2 for little-endian and 3 for big-endian.
const NEW_ORDER: u8 = if cfg!(target_endian = "little") { 2 } else { 3 };

/// The value paths of the cache entries in `data` whose key is `name` and whose flags are
/// `flags`, in file order. Entries for hardware-capability subdirectories are left out: the
/// loader takes one of those only after checking the CPU, and the search goes on to the
/// system directories without them.
fn lookup(data: &[u8], name: &[u8], flags: i32) -> Result<Vec<PathBuf>, BadCache> {
    if data.starts_with(NEW_MAGIC) {
        return lookup_new(data, 0, name, flags);
    }
    if !data.starts_with(OLD_MAGIC) {
        return Err(BadCache("not a loader cache"));
    }
    let count = u32_at(data, 12).ok_or(BadCache("truncated header"))? as usize;
    let old_end = count
        .checked_mul(OLD_ENTRY)
        .and_then(|n| n.checked_add(OLD_HEADER))
        .filter(|&end| end <= data.len())
        .ok_or(BadCache("entries run past the end of the file"))?;
    // The new table, when there, follows at the next multiple of 8.
    let new_at = old_end.checked_add(7).map_or(usize::MAX, |n| n & !7);
    if data.get(new_at..).is_some_and(|d| d.starts_with(NEW_MAGIC)) {
        return lookup_new(data, new_at, name, flags);
    }
    let mut out = Vec::new();
    for i in 0..count {
        let at = OLD_HEADER + i * OLD_ENTRY;
        let (Some(f), Some(key), Some(value)) =
            (i32_at(data, at), u32_at(data, at + 4), u32_at(data, at + 8))
        else {
            return Err(BadCache("truncated entry"));
        };
        if f == flags && key_is(data, old_end, key, name) {
            out.push(value_path(data, old_end, value)?);
        }
    }
    Ok(out)
}

/// [`lookup`] in the new-format table whose header starts at `base`.
fn lookup_new(data: &[u8], base: usize, name: &[u8], flags: i32) -> Result<Vec<PathBuf>, BadCache> {
    let (Some(count), Some(order)) = (u32_at(data, base + 20), data.get(base + 28)) else {
        return Err(BadCache("truncated header"));
    };
    if *order != 0 && order & 3 != NEW_ORDER {
        return Err(BadCache("written for another byte order"));
    }
    let count = count as usize;
    count
        .checked_mul(NEW_ENTRY)
        .and_then(|n| n.checked_add(base + NEW_HEADER))
        .filter(|&end| end <= data.len())
        .ok_or(BadCache("entries run past the end of the file"))?;
    let mut out = Vec::new();
    for i in 0..count {
        let at = base + NEW_HEADER + i * NEW_ENTRY;
        let (Some(f), Some(key), Some(value), Some(hwcap)) = (
            i32_at(data, at),
            u32_at(data, at + 4),
            u32_at(data, at + 8),
            u64_at(data, at + 16),
        ) else {
            return Err(BadCache("truncated entry"));
        };
        if f == flags && baseline(hwcap) && key_is(data, base, key, name) {
            out.push(value_path(data, base, value)?);
        }
    }
    Ok(out)
}

/// Whether an entry's hardware-capability field names no subdirectory variant: zero apart from
/// the ISA-level bits (32 to 41) that glibc 2.33 and later may set on ordinary entries.
fn baseline(hwcap: u64) -> bool {
    hwcap & !(0x3ff << 32) == 0
}

/// Whether the NUL-terminated string at `strings + offset` is `name` (reads at most
/// `name.len() + 1` bytes).
fn key_is(data: &[u8], strings: usize, offset: u32, name: &[u8]) -> bool {
    let Some(start) = strings.checked_add(offset as usize) else {
        return false;
    };
    let Some(end) = start.checked_add(name.len()) else {
        return false;
    };
    data.get(start..end) == Some(name) && data.get(end) == Some(&0)
}

/// The absolute path at `strings + offset`, NUL-terminated within [`MAX_PATH`] bytes.
fn value_path(data: &[u8], strings: usize, offset: u32) -> Result<PathBuf, BadCache> {
    let start = strings
        .checked_add(offset as usize)
        .filter(|&s| s < data.len())
        .ok_or(BadCache("an entry's path lies past the end of the file"))?;
    let tail = data.get(start..).unwrap_or_default();
    let window = tail.get(..MAX_PATH).unwrap_or(tail);
    let len = window
        .iter()
        .position(|&b| b == 0)
        .ok_or(BadCache("an entry's path is not terminated"))?;
    let path = window.get(..len).unwrap_or_default();
    if path.first() != Some(&b'/') {
        return Err(BadCache("an entry's path is not absolute"));
    }
    Ok(PathBuf::from(OsStr::from_bytes(path)))
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let bytes = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_ne_bytes(bytes.try_into().ok()?))
}

fn i32_at(data: &[u8], at: usize) -> Option<i32> {
    u32_at(data, at).map(|v| v as i32)
}

fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    let bytes = data.get(at..at.checked_add(8)?)?;
    Some(u64::from_ne_bytes(bytes.try_into().ok()?))
}

#[cfg(test)]
mod tests;
