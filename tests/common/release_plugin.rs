//! The plugin the end-to-end suites load: the release cdylib, `target/release/libcriu_gpu_plugin.so`,
//! the very file `scripts/package-deb.sh` strips and ships (`scripts/test.sh` builds it before
//! the tests and checks that it is byte for byte what the package's build makes). The tests'
//! own build never touches it: the tests link the core library and the simulator, not the
//! plugin, so no feature of theirs can change the plugin under test.
//!
//! Included by path from every suite that loads the plugin (here, `tests/host_harness.rs` and
//! criu-gpu's tests); `repo` is the workspace root.

use std::path::{Path, PathBuf};

/// Where the plugin's code lives: a plugin older than any file below these is stale.
const SOURCES: &[&str] = &[
    "src",
    "core/src",
    "criu-plugin/src",
    "kfd-sys/src",
    "cuda-ckpt-sys/src",
    "Cargo.lock",
];

/// The release plugin: `$CRIU_GPU_PLUGIN_SO` if set, else `libcriu_gpu_plugin.so` in the
/// `release` directory of the target directory this test was built in. A missing or stale
/// one (older than the plugin's sources) fails the test with the command that builds it.
pub fn release_plugin_path(repo: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("CRIU_GPU_PLUGIN_SO") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/
    let target = exe
        .ancestors()
        .nth(3)
        .expect("test executable lives in target/<profile>/deps");
    let so = target.join("release/libcriu_gpu_plugin.so");
    let build = "cargo build --release --locked -p criu-gpu-plugin --lib";
    let built = std::fs::metadata(&so)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("no {}: run `{build}` first", so.display()));
    let newest = SOURCES
        .iter()
        .filter_map(|d| newest_mtime(&repo.join(d)))
        .max();
    assert!(
        newest.is_none_or(|n| n <= built),
        "{} is older than the plugin's sources: run `{build}`",
        so.display()
    );
    so
}

/// The newest modification time of `path` or of the files under it.
fn newest_mtime(path: &Path) -> Option<std::time::SystemTime> {
    let m = std::fs::metadata(path).ok()?;
    if !m.is_dir() {
        return m.modified().ok();
    }
    let mut newest = None;
    for e in std::fs::read_dir(path).ok()?.flatten() {
        newest = newest.max(newest_mtime(&e.path()));
    }
    newest
}
