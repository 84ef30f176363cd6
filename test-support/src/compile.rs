//! C programs the tests run, compiled once per test process into its build directory: the
//! fixtures of `tests/fixtures`, the `tree` program, the stand-in CUDA driver.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::{REPO, build_dir};

/// Runs `cc` once per process for output `name` (in the build directory).
pub fn cc(name: &str, args: &[String]) -> PathBuf {
    static BUILT: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let out = build_dir().join(name);
    let mut guard = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !guard
        .get_or_insert_with(HashSet::new)
        .insert(name.to_string())
    {
        return out;
    }
    let result = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror"])
        .args(args)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `cc` (a C compiler is needed): {e}"));
    assert!(
        result.status.success(),
        "cc {args:?} -o {} failed:\n{}",
        out.display(),
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

/// A fixture source file.
pub fn fixture(rel: &str) -> String {
    Path::new(REPO)
        .join("tests/fixtures")
        .join(rel)
        .display()
        .to_string()
}

/// `tests/fixtures/e2e/tree.c`, built.
pub fn tree_binary() -> PathBuf {
    cc("tree", &[fixture("e2e/tree.c"), "-lpthread".into()])
}
