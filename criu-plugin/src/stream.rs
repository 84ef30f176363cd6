//! Whether CRIU streams its images (`criu dump --stream`, `criu restore --stream`).
//!
//! With `--stream`, CRIU sends every image through `criu-image-streamer` instead of writing
//! files: at start it connects to the streamer's socket in the images directory,
//! `streamer-capture.sock` when dumping and `streamer-serve.sock` when restoring, and keeps
//! that connection open. A plugin that writes its own files into the images directory would
//! leave them out of the stream, so that the dump looks complete but cannot be restored.
//!
//! The option itself lives deep in CRIU's `struct cr_options`, whose layout changes between
//! releases, so it is not read. Instead the connection is found: a socket among this
//! process's file descriptors whose peer is bound to one of those two names.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use nix::sys::socket::UnixAddr;

/// Basename of the streamer's socket CRIU connects to when dumping.
pub const CAPTURE_SOCKET: &str = "streamer-capture.sock";
/// Basename of the streamer's socket CRIU connects to when restoring.
pub const SERVE_SOCKET: &str = "streamer-serve.sock";

/// Which way CRIU's images stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageStream {
    /// Dump: images go to the streamer (`streamer-capture.sock` at this path).
    Capture(PathBuf),
    /// Restore: images come from the streamer (`streamer-serve.sock` at this path).
    Serve(PathBuf),
}

/// The path a connected UNIX socket's peer is bound to, if `fd` is one.
fn peer_path(fd: libc::c_int) -> Option<PathBuf> {
    // Fails harmlessly on fds that are not sockets, and on sockets of another family.
    let addr: UnixAddr = nix::sys::socket::getpeername(fd).ok()?;
    // Abstract and unnamed sockets have no file name; a path ends at its first NUL.
    let path = addr.path()?.as_os_str().as_bytes();
    let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
    (end > 0).then(|| PathBuf::from(OsStr::from_bytes(&path[..end])))
}

/// Finds CRIU's connection to an image streamer among this process's fds.
pub fn image_stream() -> Option<ImageStream> {
    let dir = std::fs::read_dir("/proc/self/fd").ok()?;
    for entry in dir.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<libc::c_int>().ok())
        else {
            continue;
        };
        // Only sockets: their links read `socket:[inode]`.
        let is_socket = std::fs::read_link(entry.path())
            .map(|l| l.as_os_str().as_encoded_bytes().starts_with(b"socket:"))
            .unwrap_or(false);
        if !is_socket {
            continue;
        }
        let Some(path) = peer_path(fd) else { continue };
        match path.file_name().and_then(|n| n.to_str()) {
            Some(CAPTURE_SOCKET) => return Some(ImageStream::Capture(path)),
            Some(SERVE_SOCKET) => return Some(ImageStream::Serve(path)),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::{UnixListener, UnixStream};

    #[test]
    fn a_connection_to_the_streamer_is_found_and_others_are_not() {
        let dir = std::env::temp_dir().join(format!("criu-plugin-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Another named socket and an unnamed pair are not a streamer.
        let other = UnixListener::bind(dir.join("other.sock")).unwrap();
        let c_other = UnixStream::connect(dir.join("other.sock")).unwrap();
        let (_a, _b) = UnixStream::pair().unwrap();
        assert_eq!(image_stream(), None);
        for (name, want) in [
            (
                CAPTURE_SOCKET,
                ImageStream::Capture(dir.join(CAPTURE_SOCKET)),
            ),
            (SERVE_SOCKET, ImageStream::Serve(dir.join(SERVE_SOCKET))),
        ] {
            let l = UnixListener::bind(dir.join(name)).unwrap();
            let c = UnixStream::connect(dir.join(name)).unwrap();
            assert_eq!(image_stream(), Some(want));
            drop(c);
            drop(l);
            std::fs::remove_file(dir.join(name)).unwrap();
            assert_eq!(image_stream(), None);
        }
        drop((c_other, other));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
