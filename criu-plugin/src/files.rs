//! Reading the files a plugin depends on without letting them hang or flood CRIU.
//!
//! A settings file, an image file or a driver's `/proc` file may be anything a hostile or
//! mistaken user made it: a FIFO (an `open` for reading blocks until a writer comes, for good),
//! a device, a directory, or huge. Every file is opened with `O_NONBLOCK` (a FIFO then opens at
//! once and is refused, as is anything that is not a regular file) and read up to a limit.
//! Files a plugin writes (its images) are created the same way, never through a link.

use std::ffi::CString;
use std::io::{self, Read};
use std::os::fd::BorrowedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::fcntl::{AT_FDCWD, OFlag};
use nix::sys::stat::Mode;

/// Opens `path` (relative to `dir`, or to the working directory when `None`) for reading,
/// without blocking and only if it is a regular file. `nofollow` refuses a symbolic link as
/// the last component (image files: names that could be links to elsewhere).
pub fn open_regular(
    dir: Option<BorrowedFd<'_>>,
    path: &Path,
    nofollow: bool,
) -> io::Result<std::fs::File> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let mut flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
    if nofollow {
        flags |= OFlag::O_NOFOLLOW;
    }
    let dirfd = dir.unwrap_or(AT_FDCWD);
    let fd = nix::fcntl::openat(dirfd, c.as_c_str(), flags, Mode::empty())?;
    check_regular(std::fs::File::from(fd), path)
}

/// Creates (or empties) `name` in `dir` for writing, mode 0600, without blocking and never
/// through a symbolic link; refused unless the result is a regular file with no other hard
/// link. The file is emptied and its mode set only once that is checked, so a FIFO, a device
/// or a hard link to another file planted under the name is refused untouched, and an old
/// file's looser mode does not survive.
pub fn create_regular(dir: BorrowedFd<'_>, name: &Path) -> io::Result<std::fs::File> {
    let c = CString::new(name.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let flags =
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW;
    let fd = nix::fcntl::openat(dir, c.as_c_str(), flags, Mode::from_bits_truncate(0o600))?;
    let file = check_regular(std::fs::File::from(fd), name)?;
    use std::os::unix::fs::MetadataExt;
    if file.metadata()?.nlink() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has other hard links; refused", name.display()),
        ));
    }
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.set_len(0)?;
    Ok(file)
}

/// The refusal of a file that is not a regular file (inside an [`io::Error`] of kind
/// `InvalidInput`; tell it apart with [`is_not_regular`]).
#[derive(Debug)]
pub struct NotRegular {
    /// What the file is instead ("a FIFO", "a directory", ...).
    pub what: &'static str,
    path: String,
}

impl std::fmt::Display for NotRegular {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is not a regular file ({})", self.path, self.what)
    }
}

impl std::error::Error for NotRegular {}

/// Whether `e` is this module's refusal of a file that is not regular.
pub fn is_not_regular(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<NotRegular>())
}

fn check_regular(file: std::fs::File, path: &Path) -> io::Result<std::fs::File> {
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            NotRegular {
                what: describe(kind),
                path: path.display().to_string(),
            },
        ));
    }
    Ok(file)
}

fn describe(kind: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_symlink() {
        "a symbolic link"
    } else {
        "of another kind"
    }
}

/// Reads all of `file`, refusing more than `max` bytes.
pub fn read_bounded(file: &mut std::fs::File, what: &Path, max: u64) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    file.take(max + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is larger than {max} bytes", what.display()),
        ));
    }
    Ok(buf)
}

/// [`open_regular`] then [`read_bounded`]: the whole of a small regular file.
pub fn read_regular(
    dir: Option<BorrowedFd<'_>>,
    path: &Path,
    nofollow: bool,
    max: u64,
) -> io::Result<Vec<u8>> {
    let mut f = open_regular(dir, path, nofollow)?;
    read_bounded(&mut f, path, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("criu-plugin-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn fifos_directories_and_big_files_are_refused_at_once() {
        let d = tmp("kinds");
        let fifo = d.join("fifo");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
        let e = read_regular(None, &fifo, false, 10).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        assert!(is_not_regular(&e));
        let e = read_regular(None, &d, false, 10).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let big = d.join("big");
        std::fs::write(&big, vec![b'x'; 11]).unwrap();
        let e = read_regular(None, &big, false, 10).unwrap_err();
        assert!(e.to_string().contains("larger than 10"), "{e}");
        assert_eq!(read_regular(None, &big, false, 11).unwrap().len(), 11);
        let link = d.join("link");
        std::os::unix::fs::symlink(&big, &link).unwrap();
        assert!(read_regular(None, &link, true, 100).is_err());
        assert_eq!(read_regular(None, &link, false, 100).unwrap().len(), 11);
        let e = read_regular(None, &d.join("missing"), false, 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!is_not_regular(&e));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn files_are_created_regular_and_never_through_links_or_fifos() {
        let d = tmp("create");
        let dir = std::fs::File::open(&d).unwrap();
        let dirfd = std::os::fd::AsFd::as_fd(&dir);
        let mut f = create_regular(dirfd, Path::new("img")).unwrap();
        std::io::Write::write_all(&mut f, b"x").unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.join("img"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::os::unix::fs::symlink("/etc/passwd", d.join("link")).unwrap();
        let e = create_regular(dirfd, Path::new("link")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        nix::unistd::mkfifo(&d.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        // A FIFO without a reader: O_NONBLOCK makes the open fail at once instead of waiting.
        assert!(create_regular(dirfd, Path::new("fifo")).is_err());
        // An old file keeps neither its contents nor a looser mode.
        std::fs::write(d.join("old"), b"secret").unwrap();
        std::fs::set_permissions(d.join("old"), std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(create_regular(dirfd, Path::new("old")).unwrap());
        let m = std::fs::metadata(d.join("old")).unwrap();
        assert_eq!((m.len(), m.permissions().mode() & 0o777), (0, 0o600));
        // A hard link to another file is refused and the other file left whole.
        std::fs::write(d.join("other"), b"keep").unwrap();
        std::fs::hard_link(d.join("other"), d.join("hard")).unwrap();
        assert!(create_regular(dirfd, Path::new("hard")).is_err());
        assert_eq!(std::fs::read(d.join("other")).unwrap(), b"keep");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
