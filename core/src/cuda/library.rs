//! Where a library the settings name (`libcuda`, `nvml`) may be loaded from.

use std::path::Path;

/// Why a library setting is refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LibraryError {
    /// An empty value.
    #[error("an empty library name")]
    Empty,
    /// A relative path.
    #[error(
        "{0} is a relative path, which would be looked up from CRIU's working directory (the image directory); give an absolute path or a bare library name"
    )]
    Relative(String),
    /// Not a regular file (a FIFO, a directory, a device).
    #[error("{0} is not a regular file")]
    NotAFile(String),
}

/// How a library named in the settings (`libcuda`, `nvml`) is loaded.
#[derive(Debug, PartialEq, Eq)]
pub enum Library<'a> {
    /// A bare name: found by [`cuda_ckpt_sys::library_search`] over absolute directories only
    /// (`LD_LIBRARY_PATH`'s absolute entries, the loader cache, the system directories) and
    /// loaded by that absolute path.
    Search(&'a str),
    /// An absolute path to a regular file.
    File(&'a Path),
}

/// Where a configured library may be loaded from. CRIU's working directory is the image
/// directory, which an imported checkpoint fills: code is never loaded from a path it could
/// supply. So a bare name is searched for over absolute directories only (an empty or relative
/// `LD_LIBRARY_PATH` entry, which the loader would read against the working directory, is
/// skipped), a relative path is refused, and an absolute one must be a regular file (`dlopen`
/// of a FIFO blocks for good).
pub fn library(value: &str) -> Result<Library<'_>, LibraryError> {
    if value.is_empty() {
        return Err(LibraryError::Empty);
    }
    if !value.contains('/') {
        return Ok(Library::Search(value));
    }
    let path = Path::new(value);
    if !path.is_absolute() {
        return Err(LibraryError::Relative(value.to_string()));
    }
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(LibraryError::NotAFile(value.to_string())),
        _ => Ok(Library::File(path)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_come_from_the_loader_search_or_an_absolute_path_only() {
        assert_eq!(library("libcuda.so.1"), Ok(Library::Search("libcuda.so.1")));
        for rel in ["./libcuda.so.1", "lib/libcuda.so.1", "../x.so"] {
            let e = library(rel).unwrap_err().to_string();
            assert!(
                e.contains("relative path") && e.contains("image directory"),
                "{e}"
            );
        }
        assert!(library("").is_err());
        assert_eq!(
            library("/nonexistent/libcuda.so.1"),
            Ok(Library::File(Path::new("/nonexistent/libcuda.so.1")))
        );
        assert_eq!(
            library("/dev/zero").map_err(|e| e.to_string()),
            Err("/dev/zero is not a regular file".into())
        );
        assert!(
            library("/")
                .unwrap_err()
                .to_string()
                .contains("not a regular file")
        );
    }
}
