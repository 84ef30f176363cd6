//! The plugin the end-to-end suites load: the release cdylib, `target/release/libcriu_gpu_plugin.so`,
//! the very file `scripts/package-deb.sh` ships (the release profile strips it).
//! `scripts/test.sh` builds it before the tests and checks that it is byte for byte what the
//! package's build makes; `scripts/test-deb.sh` checks the installed file is this one. The
//! tests' own build never touches it: the tests link the core library and the simulator, not
//! the plugin, so no feature of theirs can change the plugin under test.
//!
//! Every suite that loads the plugin finds it here (through [`crate::plugin_path`] or
//! directly); `repo` is the workspace root.

use std::path::{Path, PathBuf};

/// The release plugin: `$CRIU_GPU_PLUGIN_SO` if set, else `libcriu_gpu_plugin.so` in the
/// `release` directory of the target directory this test was built in. A missing or stale
/// one fails the test with the command that builds it: stale is older than `Cargo.lock` or
/// than any source file cargo's dep-info (`libcriu_gpu_plugin.d`) says it was built from.
pub fn release_plugin_path(repo: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("CRIU_GPU_PLUGIN_SO") {
        return PathBuf::from(p);
    }
    let target = crate::target_dir();
    let so = target.join("release/libcriu_gpu_plugin.so");
    let build = "cargo build --release --locked -p criu-gpu-plugin --lib";
    let built = std::fs::metadata(&so)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("no {}: run `{build}` first", so.display()));
    let dep_info = std::fs::read_to_string(target.join("release/libcriu_gpu_plugin.d"))
        .unwrap_or_else(|_| panic!("no dep-info beside {}: run `{build}`", so.display()));
    // `target: source source ...` (no path here has a space).
    let sources = dep_info
        .lines()
        .next()
        .and_then(|l| l.split_once(": "))
        .map_or("", |(_, s)| s);
    let newest = sources
        .split_whitespace()
        .map(PathBuf::from)
        .chain([repo.join("Cargo.lock")])
        .filter_map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .max();
    assert!(
        newest.is_none_or(|n| n <= built),
        "{} is older than the plugin's sources: run `{build}`",
        so.display()
    );
    so
}
