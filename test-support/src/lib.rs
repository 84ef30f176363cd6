//! What the workspace's tests share (the plugin's suites of `tests/` and `criu-gpu`'s): real
//! CRIU, the plugin built from this tree, small C programs as the processes to checkpoint, the
//! stand-in CUDA driver ([`fake_cuda`]) and the scenarios written on it ([`scenario`]).
//!
//! - CRIU is `$CRIU_BIN` (which must exist), else `<repo>/.criu/bin/criu` (made by
//!   `scripts/install-criu.sh`), else `criu` on `PATH`. Without one the tests FAIL, unless
//!   `GPU_PLUGIN_SKIP_E2E=1`.
//! - The plugin is the release cdylib, the one the package ships ([`release_plugin`]; build it
//!   with `cargo build --release -p criu-gpu-plugin --lib`), copied as `gpu_plugin.so` into a
//!   directory of its own: CRIU loads every `*.so` of its `--libdir`, which must be an
//!   absolute path.
//! - The test process is a child subreaper, and every workload is its direct child in a session
//!   of its own. After a dump kills a tree, its tasks (the root, and the rest re-parented here)
//!   are reaped until their pids are free, or `criu restore` could not recreate them ("Can't fork
//!   for PID: File exists"). A tree restored with `-d` is re-parented here too.
//! - Subreaping and reaping are process-wide, so every e2e test holds one lock ([`E2e::start`]).
//! - Everything a test starts is killed by id and every directory it made is removed when its
//!   [`E2e`] is dropped, also when an assertion fails.
//!
//! `<repo>` is the workspace root ([`REPO`]), not this crate's folder.

pub mod compile;
pub mod criu;
pub mod dirs;
pub mod e2e;
pub mod fake_cuda;
pub mod fake_cuda_build;
pub mod foreign_arch;
pub mod kfd_standin;
pub mod procs;
pub mod release_plugin;
pub mod rng;
pub mod run_leftovers;
pub mod scenario;
pub mod tree;
pub mod ustar;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use compile::{cc, fixture, tree_binary};
pub use criu::{CriuRun, bytes_contain, criu_binary, failing_post_dump_script};
pub use dirs::{OUTER_PID_VAR, TempDir, build_dir, owner_tag};
pub use e2e::{E2e, plugin_libdir, plugin_path};
pub use fake_cuda_build::{FakeCudaBuild, fake_cuda_build};
pub use procs::*;
pub use tree::*;

/// The workspace root: fixtures, `Cargo.lock` and the project's private CRIU are under it.
pub const REPO: &str = env!("CRIU_GPU_WORKSPACE");

/// How long a test waits for something a running process should do.
pub const WAIT: Duration = Duration::from_secs(20);

/// The target directory the running test executable was built in
/// (`target/<profile>/deps/<test>`).
pub fn target_dir() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        exe.ancestors()
            .nth(3)
            .expect("test executable lives in target/<profile>/deps")
            .to_path_buf()
    })
}

/// Cargo's scratch directory for tests, `target/tmp` (absolute): `CARGO_TARGET_TMPDIR` is
/// given to test targets only, not to this library.
pub fn target_tmp() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = target_dir().join("tmp");
        std::fs::create_dir_all(&tmp).expect("target/tmp");
        tmp
    })
}
