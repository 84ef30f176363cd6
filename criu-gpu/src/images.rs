//! A checkpoint's files as `inspect` and `check` need them, from a CRIU image directory or a
//! checkpoint archive: the few small files the GPU side reads (each up to its own limit),
//! and the name and size of every other image file (the BO contents are never read).
//!
//! In an archive the images are those at its top or under `checkpoint/` (Podman's
//! `--export`, CRI-O and kubelet archives); other entries, and any with an absolute path or a
//! `..` component, are ignored and counted.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use criu_gpu_core::images::amd::{self as amd, DMABUF_FILE_PREFIX, KFD_FILE_PREFIX};
use criu_gpu_core::images::metadata;
use criu_plugin::core_image;

use crate::archive::{self, Data, Entry, Packing, Want};

/// Most files listed from an image directory.
const MAX_DIR_ENTRIES: usize = 100_000;
/// Longest image file name kept (a file-name component's limit on Linux).
const MAX_NAME_BYTES: usize = 255;
/// Most files read into memory.
const MAX_READ_FILES: usize = 1024;
/// Most bytes read into memory, all files together.
const MAX_READ_BYTES: u64 = 512 << 20;
/// Ignored entries named one by one in the notes.
const MAX_NOTES: usize = 8;

/// The checkpoint's files.
#[derive(Debug, Default)]
pub struct ImageSet {
    /// What was read: "directory X" or "tar.gz archive X".
    pub source: String,
    /// The contents of the files read, by name.
    pub files: BTreeMap<String, Vec<u8>>,
    /// Every image file's size, by name.
    pub sizes: BTreeMap<String, u64>,
    /// Files not read because they are larger than their limit: (name, size, limit).
    pub too_large: Vec<(String, u64, u64)>,
    /// The one `core-PID.img` read (the first seen that could be), for the CPU architecture
    /// the checkpoint was made on: every task of a checkpoint has the same.
    pub core: Option<String>,
    /// Whether more names were seen than are remembered.
    names_capped: bool,
    /// GPU-side files the plugin (and CRIU) would refuse to read: not regular files.
    pub refused: Vec<String>,
    /// What was ignored, and why.
    pub notes: Vec<String>,
    ignored: usize,
}

/// The largest size read of file `name`, if it is one the GPU side reads.
pub fn limit_for(name: &str) -> Option<u64> {
    let message = (amd::HEADER_LEN + amd::DEFAULT_MAX_MESSAGE_SIZE) as u64;
    if name == metadata::FILE_NAME {
        Some(metadata::MAX_BYTES)
    } else if name == "pstree.img" {
        Some(16 << 20)
    } else if name == "inventory.img" {
        Some(1 << 20)
    } else if name.starts_with(KFD_FILE_PREFIX) || name.starts_with("amdgpu-renderD-") {
        Some(message)
    } else if name.starts_with(DMABUF_FILE_PREFIX) {
        Some(4096)
    } else if name == crate::mounts::SPEC_FILE {
        // The container's OCI spec in a runtime's archive (`check` reads its bind mounts).
        Some(1 << 20)
    } else {
        None
    }
}

impl ImageSet {
    fn note(&mut self, what: String) {
        self.ignored += 1;
        if self.notes.len() < MAX_NOTES {
            self.notes.push(what);
        }
    }

    /// The limit to read `name` (of `size` bytes) with: a file the GPU side reads, or a core
    /// image while none has been read, if it fits (one that does not is passed over: it only
    /// tells the architecture).
    fn wants(&self, name: &str, size: u64) -> Option<u64> {
        limit_for(name).or_else(|| {
            let core = self.core.is_none()
                && core_image::is_core_file(name)
                && size <= core_image::MAX_BYTES
                && self.room_for(size);
            core.then_some(core_image::MAX_BYTES)
        })
    }

    /// Keeps file `name`'s contents.
    fn keep(&mut self, name: String, bytes: Vec<u8>) {
        if self.core.is_none() && core_image::is_core_file(&name) {
            self.core = Some(name.clone());
        }
        self.files.insert(name, bytes);
    }

    /// Whether the files read so far are within the limits.
    fn room_for(&self, size: u64) -> bool {
        self.files.len() < MAX_READ_FILES
            && self.files.values().map(|v| v.len() as u64).sum::<u64>() + size <= MAX_READ_BYTES
    }

    /// How many entries were ignored beyond those named in the notes.
    pub fn more_ignored(&self) -> usize {
        self.ignored.saturating_sub(self.notes.len())
    }
}

/// Why a file the plugin reads is refused: the plugin opens each without following links and
/// refuses anything but a regular file, so `check` must not call such an image restorable.
fn refusal(name: &str, kind: &str) -> String {
    format!(
        "{name}: {kind}, not a regular file: refused (the plugin and CRIU read only regular files), so this image cannot be restored"
    )
}

fn kind_of(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "of another kind"
    }
}

/// Why a checkpoint cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Neither an inventory nor a GPU image file.
    #[error(
        "{0} is not a CRIU checkpoint: it holds no inventory.img (nor any GPU image file); give a CRIU image directory (criu dump -D DIR) or a checkpoint archive"
    )]
    NotACheckpoint(String),
    /// Nothing to open there.
    #[error(
        "cannot open {}: {err}; give a CRIU image directory (criu dump -D DIR) or a checkpoint archive",
        path.display()
    )]
    Missing {
        /// What was given.
        path: PathBuf,
        /// Why.
        err: std::io::Error,
    },
    /// A device, a FIFO, a socket.
    #[error("{} is neither a directory nor a regular file", .0.display())]
    NotDirOrFile(PathBuf),
    /// A file cannot be read.
    #[error("cannot read {}: {err}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        err: std::io::Error,
    },
    /// A file that is no archive this tool reads.
    #[error(
        "{} is not a checkpoint archive: it starts with {head:02x?}, which is neither tar nor gzip, zstd or xz; give an image directory or a .tar, .tar.gz or .tar.zst",
        path.display()
    )]
    NotAnArchive {
        /// The file.
        path: PathBuf,
        /// Its first bytes (at most 8).
        head: Vec<u8>,
    },
    /// A directory that cannot be listed.
    #[error("cannot list {}: {err}", path.display())]
    Unlisted {
        /// The directory.
        path: PathBuf,
        /// Why.
        err: std::io::Error,
    },
    /// A directory of too many entries.
    #[error("{} has more than {MAX_DIR_ENTRIES} entries: not an image directory", .0.display())]
    TooManyEntries(PathBuf),
    /// More GPU image data than read at once.
    #[error(
        "{} holds more GPU image files than this tool reads at once ({MAX_READ_FILES} files, {MAX_READ_BYTES} bytes)",
        .0.display()
    )]
    TooMuchData(PathBuf),
    /// The archive cannot be read.
    #[error("{}: {err}", path.display())]
    Archive {
        /// The archive.
        path: PathBuf,
        /// Why.
        err: archive::ArchiveError,
    },
}

/// An archive path that is not looked at, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum IgnoredPath {
    /// It climbs up.
    #[error("{0}: a path with `..` (ignored)")]
    DotDot(String),
    /// It starts at the root.
    #[error("{0}: an absolute path (ignored)")]
    Absolute(String),
}

/// Reads the checkpoint at `path`; refuses one that holds no CRIU image at all (neither
/// `inventory.img` nor any file of the GPU side).
pub fn open(path: &Path) -> Result<ImageSet, OpenError> {
    let set = open_any(path)?;
    let any_gpu_file = set.sizes.keys().any(|n| limit_for(n).is_some());
    if !set.has_inventory() && !any_gpu_file && set.refused.is_empty() {
        return Err(OpenError::NotACheckpoint(set.source));
    }
    Ok(set)
}

impl ImageSet {
    /// Whether the checkpoint has CRIU's `inventory.img` (without it CRIU cannot restore).
    pub fn has_inventory(&self) -> bool {
        self.sizes.contains_key("inventory.img")
    }
}

fn open_any(path: &Path) -> Result<ImageSet, OpenError> {
    let meta = std::fs::metadata(path).map_err(|err| OpenError::Missing {
        path: path.to_path_buf(),
        err,
    })?;
    if meta.is_dir() {
        return open_dir(path);
    }
    if !meta.is_file() {
        return Err(OpenError::NotDirOrFile(path.to_path_buf()));
    }
    let mut head = Vec::new();
    criu_plugin::files::open_regular(None, path, false)
        .and_then(|f| f.take(512).read_to_end(&mut head))
        .map_err(|err| OpenError::Unreadable {
            path: path.to_path_buf(),
            err,
        })?;
    let packing = archive::sniff(&head).ok_or_else(|| OpenError::NotAnArchive {
        path: path.to_path_buf(),
        head: head[..head.len().min(8)].to_vec(),
    })?;
    open_archive(path, packing)
}

fn open_dir(path: &Path) -> Result<ImageSet, OpenError> {
    let mut set = ImageSet {
        source: format!("directory {}", path.display()),
        ..ImageSet::default()
    };
    let unlisted = |err| OpenError::Unlisted {
        path: path.to_path_buf(),
        err,
    };
    let dir = std::fs::read_dir(path).map_err(unlisted)?;
    for (n, ent) in dir.enumerate() {
        if n >= MAX_DIR_ENTRIES {
            return Err(OpenError::TooManyEntries(path.to_path_buf()));
        }
        let ent = ent.map_err(unlisted)?;
        let name = ent.file_name().to_string_lossy().into_owned();
        // Links are not followed: image files are regular files.
        let Ok(m) = std::fs::symlink_metadata(ent.path()) else {
            continue;
        };
        if !m.file_type().is_file() {
            if limit_for(&name).is_some() {
                set.refused.push(refusal(&name, kind_of(m.file_type())));
            }
            continue;
        }
        set.sizes.insert(name.clone(), m.len());
        let Some(limit) = set.wants(&name, m.len()) else {
            continue;
        };
        if m.len() > limit {
            set.too_large.push((name, m.len(), limit));
            continue;
        }
        if !set.room_for(m.len()) {
            return Err(OpenError::TooMuchData(path.to_path_buf()));
        }
        let bytes = match criu_plugin::files::read_regular(None, &ent.path(), true, limit) {
            Ok(b) => b,
            // It only tells the architecture; another core image may.
            Err(_) if core_image::is_core_file(&name) => continue,
            Err(err) => {
                return Err(OpenError::Unreadable {
                    path: ent.path(),
                    err,
                });
            }
        };
        set.keep(name, bytes);
    }
    Ok(set)
}

/// The image file name of an archive path, when the path lies at the top or under
/// `checkpoint/`; otherwise why it is ignored (`None` for ordinary other files).
fn image_name(path: &str) -> Result<Option<&str>, IgnoredPath> {
    let mut parts: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(IgnoredPath::DotDot(path.to_string())),
            c => parts.push(c),
        }
    }
    if path.starts_with('/') {
        return Err(IgnoredPath::Absolute(path.to_string()));
    }
    Ok(match parts.as_slice() {
        // No image file has a longer name; a longer one is not worth remembering.
        [name] | ["checkpoint", name] if name.len() > MAX_NAME_BYTES => None,
        [name] => Some(*name),
        ["checkpoint", name] => Some(*name),
        _ => None,
    })
}

fn open_archive(path: &Path, packing: Packing) -> Result<ImageSet, OpenError> {
    let set = std::cell::RefCell::new(ImageSet {
        source: format!("{} archive {}", packing.name(), path.display()),
        ..ImageSet::default()
    });
    let visit = |e: &Entry| -> Want {
        let mut s = set.borrow_mut();
        let name = match image_name(&e.path) {
            Ok(Some(n)) => n.to_string(),
            Ok(None) => return Want::Skip,
            Err(why) => {
                s.note(why.to_string());
                return Want::Skip;
            }
        };
        if !e.regular {
            if limit_for(&name).is_some() {
                let r = refusal(&e.path, "a link or special file");
                s.refused.push(r);
            }
            return Want::Skip;
        }
        // A hostile archive may list a million names: only so many are remembered.
        if s.sizes.len() >= MAX_DIR_ENTRIES && !s.sizes.contains_key(&name) {
            if !s.names_capped {
                s.names_capped = true;
                s.note(format!(
                    "more than {MAX_DIR_ENTRIES} image files: the rest are not looked at"
                ));
            }
            return Want::Skip;
        }
        s.sizes.insert(name.clone(), e.size);
        match s.wants(&name, e.size) {
            Some(limit) if s.room_for(e.size.min(limit)) => Want::Read(limit),
            Some(_) => {
                s.note(format!(
                    "{}: beyond what this tool reads at once (ignored)",
                    e.path
                ));
                Want::Skip
            }
            None => Want::Skip,
        }
    };
    let take = |e: &Entry, d: Data| {
        let Ok(Some(name)) = image_name(&e.path).map(|n| n.map(str::to_string)) else {
            return;
        };
        let mut s = set.borrow_mut();
        match d {
            Data::Bytes(b) => s.keep(name, b),
            Data::TooLarge { limit } => s.too_large.push((name, e.size, limit)),
        }
    };
    archive::read(path, packing, visit, take).map_err(|err| OpenError::Archive {
        path: path.to_path_buf(),
        err,
    })?;
    Ok(set.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_paths() {
        assert_eq!(
            image_name("./checkpoint/pstree.img"),
            Ok(Some("pstree.img"))
        );
        assert_eq!(image_name("inventory.img"), Ok(Some("inventory.img")));
        assert_eq!(image_name("rootfs-diff/etc/x"), Ok(None));
        assert!(image_name("../../etc/passwd").is_err());
        assert!(image_name("/checkpoint/pstree.img").is_err());
        assert_eq!(limit_for("gpu-plugin-cuda.img"), Some(1 << 20));
        assert_eq!(limit_for("pages-1.img"), None);
    }
}
