//! Real CRIU with the plugin loaded, on a process tree without any GPU: the plugin must stay out
//! of the way. The tree is `tests/fixtures/e2e/tree.c` (a parent and a child, a second thread in
//! each, one shared file they append to, a pipe from parent to child carrying a counter).
//!
//! CRIU comes from `$CRIU_BIN`, `<repo>/.criu/bin/criu` (`scripts/install-criu.sh`) or `PATH`;
//! without one these tests fail, unless `GPU_PLUGIN_SKIP_E2E=1`. They need root. That a program
//! other than CRIU can load the plugin is `tests/host_harness.rs`'s business.

use criu_gpu_test_support as common;

use std::os::unix::net::UnixListener;
use std::path::Path;

use common::{CriuRun, E2e, Tree, assert_consecutive, last_values, plugin_libdir, values};

/// Environment variables of a CRIU run.
type Env = Vec<(&'static str, String)>;

/// Settings for every CRIU run here: the NVIDIA side pointed at a driver directory that does
/// not exist, so these tests mean the same on a machine with an NVIDIA GPU.
fn no_gpu_env(e: &E2e) -> Env {
    vec![(
        "CRIU_GPU_CUDA_NVIDIA_PROC",
        e.dir().join("no-nvidia-driver").display().to_string(),
    )]
}

/// Test `test`: the tree program started, and CRIU's environment on this machine without a GPU.
fn tree_without_gpu(test: &str) -> Option<(E2e, Tree, Env)> {
    let e = E2e::start(test)?;
    let tree = Tree::start(&e, "tree.out", &[]);
    let env = no_gpu_env(&e);
    Some((e, tree, env))
}

/// CRIU loaded the plugin and the plugin said hello for `stage`, and nothing of ours is an error.
fn assert_plugin_loaded(e: &E2e, run: &CriuRun, stage: &str) {
    e.assert_plugin_loaded(run, stage);
    run.assert_no_plugin_errors();
}

/// At CRIU's default verbosity a clean run shows nothing of the plugin.
fn assert_plugin_silent(run: &CriuRun) {
    let ours = run.lines_with("gpu_plugin");
    assert!(
        ours.is_empty(),
        "plugin lines at the default level {ours:#?}: {run:?}"
    );
}

fn lib() -> String {
    plugin_libdir().display().to_string()
}

/// Dump (the tree is killed), reap, restore; returns (dump, restore) runs.
fn cycle(
    e: &E2e,
    tree: &Tree,
    images: &Path,
    opts: &[&str],
    env: &[(&str, String)],
) -> (CriuRun, CriuRun) {
    let root = tree.root.to_string();
    let mut args = vec!["dump", "-t", &root];
    args.extend_from_slice(opts);
    let dump = e.criu(&args, images, "dump.log", env);
    dump.assert_ok();
    e.reap(&tree.pids());
    let dumped = tree.text();
    let mut args = vec!["restore", "-d"];
    args.extend_from_slice(opts);
    let restore = e.criu(&args, images, "restore.log", env);
    restore.assert_ok();
    tree.assert_continues(&dumped);
    (dump, restore)
}

#[test]
fn a_tree_dumped_and_restored_with_the_plugin_in_libdir_continues() {
    let Some((e, tree, env)) = tree_without_gpu("libdir") else {
        return;
    };
    let lib = lib();

    let (dump, restore) = cycle(&e, &tree, &e.images("img-v4"), &["-L", &lib, "-v4"], &env);
    assert_plugin_loaded(&e, &dump, "Dump");
    assert_plugin_loaded(&e, &restore, "Restore");

    // The restored tree once more, at CRIU's default verbosity: no noise from the plugin.
    let (dump, restore) = cycle(&e, &tree, &e.images("img-v2"), &["-L", &lib], &env);
    assert_plugin_silent(&dump);
    assert_plugin_silent(&restore);
}

#[test]
fn the_plugin_is_found_through_criu_libs_dir() {
    let Some((e, tree, mut env)) = tree_without_gpu("libs-dir-env") else {
        return;
    };
    env.push(("CRIU_LIBS_DIR", lib()));
    let (dump, restore) = cycle(&e, &tree, &e.images("img"), &["-v4"], &env);
    assert_plugin_loaded(&e, &dump, "Dump");
    assert_plugin_loaded(&e, &restore, "Restore");
}

#[test]
fn leave_running_keeps_the_tree_running_and_the_image_restores() {
    let Some((e, tree, env)) = tree_without_gpu("leave-running") else {
        return;
    };
    let lib = lib();
    let images = e.images("img");
    let root = tree.root.to_string();

    let before_dump = tree.text();
    let dump = e.criu(
        &["dump", "-t", &root, "--leave-running", "-L", &lib, "-v4"],
        &images,
        "dump.log",
        &env,
    );
    dump.assert_ok();
    assert_plugin_loaded(&e, &dump, "Dump");
    let after_dump = tree.text();
    for pid in tree.pids() {
        assert!(
            common::exists(pid),
            "pid {pid} is gone after --leave-running"
        );
    }
    tree.wait_ticks(3);
    assert_consecutive(&tree.text(), "output across a --leave-running dump");

    e.kill_and_reap(&tree.pids());
    let killed = tree.text();
    let restore = e.criu(
        &["restore", "-d", "-L", &lib, "-v4"],
        &images,
        "restore.log",
        &env,
    );
    restore.assert_ok();
    assert_plugin_loaded(&e, &restore, "Restore");
    tree.wait_ticks(3);
    let text = tree.text();
    let after = &text[killed.len()..];
    assert_consecutive(after, "output after the restore");
    // The image holds the tree as it was while CRIU dumped it: between the two snapshots.
    let (low, high) = (last_values(&before_dump), last_values(&after_dump));
    let first = values(after);
    for (i, src) in common::TREE_SOURCES.iter().enumerate() {
        let f = first[i].first().copied().unwrap_or(0);
        assert!(
            low[i] < f && f <= high[i] + 1,
            "{src}: first value after the restore {f}, but the dump happened between {} and {}",
            low[i],
            high[i]
        );
    }
}

#[test]
fn a_failed_dump_leaves_the_tree_running() {
    let Some(e) = E2e::start("failed-dump") else {
        return;
    };
    // A connected unix socket whose peer (this test) is outside the dumped tree: CRIU refuses
    // it without --ext-unix-sk.
    let sock = e.dir().join("peer.sock");
    let listener = UnixListener::bind(&sock).expect("bind the peer socket");
    let tree = Tree::start(&e, "tree.out", &["--connect", &sock.display().to_string()]);
    let (_peer, _) = listener.accept().expect("accept the tree's connection");
    let env = no_gpu_env(&e);
    let lib = lib();
    let root = tree.root.to_string();

    let dump = e.criu(
        &["dump", "-t", &root, "-L", &lib, "-v4"],
        &e.images("img"),
        "dump.log",
        &env,
    );
    dump.assert_failed();
    assert_plugin_loaded(&e, &dump, "Dump");
    assert!(
        dump.first_error().is_some_and(|l| l.contains("unix")),
        "CRIU should have refused the external unix socket: {dump:?}"
    );
    for pid in tree.pids() {
        let st = common::state_of(pid);
        assert!(
            matches!(st, Some('R' | 'S')),
            "pid {pid} is not running after the failed dump: {st:?}"
        );
    }
    tree.wait_ticks(3);
    assert_consecutive(&tree.text(), "output across the failed dump");
}

/// Bad AMD settings (in the file and in the environment) on a machine without an AMD GPU: a
/// plain tree is dumped and restored, each bad value warned about, none an error.
#[test]
fn bad_amd_settings_do_not_fail_a_run_without_amd() {
    let Some((e, tree, mut env)) = tree_without_gpu("bad-amd-settings") else {
        return;
    };
    let config = e.dir().join("gpu-plugin.conf");
    std::fs::write(
        &config,
        "amdgpu.max-buffer-size = lots\namdgpu.chunk-size = 99999999999999999999\namdgpu.parallel-restore = maybe\n",
    )
    .expect("settings file");
    env.push(("CRIU_GPU_PLUGIN_CONFIG", config.display().to_string()));
    env.push(("CRIU_GPU_AMDGPU_COPY_THREADS", "x".into()));
    env.push(("KFD_MAX_BUFFER_SIZE", "garbage".into()));
    let (dump, restore) = cycle(&e, &tree, &e.images("img"), &["-L", &lib(), "-v4"], &env);
    for run in [&dump, &restore] {
        assert!(
            run.has("amdgpu: settings: amdgpu.copy-threads = x"),
            "{run:?}"
        );
        assert!(run.has("amdgpu: settings: amdgpu.chunk-size"), "{run:?}");
        run.assert_no_plugin_errors();
    }
}
