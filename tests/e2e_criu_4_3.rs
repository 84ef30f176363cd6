//! What CRIU 4.3 adds, end to end with the real `criu` and the stand-in CUDA driver: plugin
//! options (a GPU map handed over per restore, in this plugin's names and in the C cuda
//! plugin's), and hooks broadcast to every plugin (`DUMP_DEVICES_LATE`, `DUMP_FINISH`,
//! `RESTORE_INIT`, `POST_FORKING`) with a second plugin in the same directory.
//!
//! With an older CRIU these tests say so and pass: `scripts/test.sh` runs every end-to-end
//! suite again against CRIU 4.3 (`CRIU_BIN=.criu-4.3/bin/criu`), where they run.

use criu_gpu_test_support as common;

use std::path::{Path, PathBuf};

use common::fake_cuda::*;
use common::scenario::*;
use common::{cc, fixture, plugin_path};

/// Whether CRIU is 4.3 or later; says the test is skipped (it passes) where not.
fn criu_4_3(f: &Fake, test: &str) -> bool {
    let new_enough = f.e.criu_release().is_some_and(|r| r >= (4, 3));
    if !new_enough {
        eprintln!(
            "SKIPPED {test}: CRIU {:?} is older than 4.3 (run with CRIU_BIN=.criu-4.3/bin/criu)",
            f.e.criu_release()
        );
    }
    new_enough
}

/// A test on one stand-in GPU, where CRIU is 4.3 or later.
fn start(test: &str) -> Option<OneGpu> {
    OneGpu::start(test).filter(|f| criu_4_3(f, test))
}

/// A plugin directory holding this plugin and the every-hook plugin of
/// `tests/fixtures/other-plugin`.
fn libdir_with_another_plugin(f: &Fake) -> PathBuf {
    let other = cc(
        "every_hook_plugin.so",
        &[
            "-shared".into(),
            "-fPIC".into(),
            format!("-I{}/include", common::REPO),
            fixture("other-plugin/every_hook_plugin.c"),
        ],
    );
    let dir = f.e.dir().join("two-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(plugin_path(), dir.join("gpu_plugin.so")).unwrap();
    std::fs::copy(other, dir.join("every_hook_plugin.so")).unwrap();
    dir
}

fn other_calls(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The other plugin got each of `hooks` (by the start of its log lines); its log is then
/// removed, for the next step.
fn assert_other_plugin_got(log: &Path, hooks: &[&str]) {
    let seen = other_calls(log);
    for hook in hooks {
        assert!(
            seen.iter().any(|l| l.starts_with(hook)),
            "the other plugin did not get {hook}: {seen:?}"
        );
    }
    std::fs::remove_file(log).unwrap();
}

#[test]
fn another_plugin_in_the_directory_gets_the_broadcast_hooks_and_the_gpu_state_survives() {
    let Some(mut f) = start("criu43-two-plugins") else {
        return;
    };
    let w = f.workload(&["--mib", "8", "--children", "1"]);
    f.lib = libdir_with_another_plugin(&f).display().to_string();
    let other_log = f.e.dir().join("other.log");
    let env = |calls: &str| {
        f.env_with(
            calls,
            &[("OTHER_PLUGIN_LOG", &other_log.display().to_string())],
        )
    };
    let root = w.root().to_string();

    let dump = f.dump(&root, &[], &env("dump.calls"));
    dump.assert_ok();
    f.e.reap(&w.pids);
    dump.assert_no_plugin_errors();
    let calls = f.calls("dump.calls");
    calls.assert_transitions(&w.pids, &["lock=0", "checkpoint=0"]);
    assert_other_plugin_got(&other_log, &["DUMP_DEVICES_LATE", "DUMP_FINISH 0"]);

    let marks = w.marks();
    let restore = f.restore("restore.log", &env("restore.calls"));
    restore.assert_ok();
    restore.assert_no_plugin_errors();
    let calls = f.calls("restore.calls");
    calls.assert_transitions(&w.pids, &["restore=0", "unlock=0"]);
    assert_other_plugin_got(&other_log, &["RESTORE_INIT", "POST_FORKING"]);
    w.assert_all_running("after the restore beside another plugin");
    w.assert_continues(&marks);

    // A failing post-dump script: both plugins hear DUMP_FINISH with the failure, and the
    // GPU plugin gives every process its GPU back although the other one answered first.
    let script = common::failing_post_dump_script(f.e.dir());
    let script = script.display().to_string();
    let failed = f.dump_logged(
        &f.e.images("img2"),
        "dump2.log",
        &root,
        &["--action-script", &script],
        &env("dump2.calls"),
    );
    failed.assert_failed();
    failed.assert_no_plugin_errors();
    let calls = f.calls("dump2.calls");
    calls.assert_transitions(
        &w.pids,
        &["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
    );
    let seen = other_calls(&other_log);
    assert!(
        seen.iter()
            .any(|l| l.starts_with("DUMP_FINISH ") && l != "DUMP_FINISH 0"),
        "the other plugin did not hear the failure: {seen:?}"
    );
    w.assert_all_running("after the failed post-dump script");
}

#[test]
fn a_gpu_map_given_as_a_plugin_option_is_used_and_a_missing_gpu_is_refused_before_forking() {
    let Some(f) = start("criu43-map-option") else {
        return;
    };
    let gpus = f.gpus(2, 0);
    let (a, b) = (&gpus[0], &gpus[1]);
    let nv_ab = f.two_gpus_listed("nv-ab", a, b);
    let w = f.workload(&["--mib", "8"]);
    let pid = w.root();
    f.dumped(&w);
    f.clear_device_dir();
    let pairs = f.dev.join(format!("restore-pairs.{pid}"));
    let expected_pairs = format!("{} {}\n", a.uuid, b.uuid);
    // The environment names a map too: the option wins over it.
    let restore_env = |calls: &str| {
        let mut env = f.f.env(&nv_ab, calls);
        env.push(("FAKE_CUDA_GPUS", "2".into()));
        env.push(("CRIU_GPU_CUDA_DEVICE_MAP", format!("{}={}", a.uuid, a.uuid)));
        env
    };

    // A map to a GPU this machine lacks: refused in init, before anything is forked, with a
    // message naming that GPU.
    let missing = "GPU-0badc0de-0000-4000-8000-000000000000";
    let refused = f.criu(
        &[
            "restore",
            "-d",
            "-L",
            &f.lib,
            "-v4",
            &format!(
                "--plugin-option=gpu_plugin.cuda.device-map={}={missing}",
                a.uuid
            ),
        ],
        &f.images,
        "restore-missing.log",
        &restore_env("missing.calls"),
    );
    refused.assert_failed();
    let first = refused.first_error().unwrap_or_default();
    assert!(
        first.contains("gpu_plugin") && first.contains(missing),
        "the first error must name the missing GPU: {refused:?}"
    );
    // Logged once, where the hook returned to CRIU, with its kind.
    assert!(first.ends_with("[machine]"), "{refused:?}");
    assert_eq!(
        refused
            .log
            .lines()
            .filter(|l| l.contains(missing) && l.contains("Error"))
            .count(),
        1,
        "{refused:?}"
    );
    assert!(
        !refused.has("Forking task"),
        "CRIU forked tasks: {refused:?}"
    );
    assert!(
        f.calls("missing.calls").0.is_empty(),
        "driver calls in a refused restore"
    );
    assert!(
        !common::exists(pid),
        "pid {pid} exists after the refused restore"
    );

    // This plugin's option name, then the C cuda plugin's: the same map either way.
    for (n, option) in [
        format!("gpu_plugin.cuda.device-map={}={}", a.uuid, b.uuid),
        format!("cuda_plugin.device-map={}={}", a.uuid, b.uuid),
    ]
    .iter()
    .enumerate()
    {
        let marks = if n == 0 {
            w.marks()
        } else {
            Default::default()
        };
        let run = f.criu(
            &[
                "restore",
                "-d",
                "-L",
                &f.lib,
                "-v4",
                &format!("--plugin-option={option}"),
            ],
            &f.images,
            &format!("restore-{n}.log"),
            &restore_env(&format!("map{n}.calls")),
        );
        run.assert_ok();
        run.assert_no_plugin_errors();
        let name = option.split('=').next().unwrap();
        assert!(
            run.has(&format!("(plugin option {name})")),
            "the settings line must say the map came from {name}: {run:?}"
        );
        assert_eq!(
            std::fs::read_to_string(&pairs).unwrap_or_default(),
            expected_pairs,
            "GPU pairs with {option}: {run:?}"
        );
        w.assert_all_running("after a restore with a GPU map option");
        // The second restore replays the same images: the counter starts again from them.
        if n == 0 {
            w.assert_continues(&marks);
        }
        f.e.kill_and_reap(&w.pids);
        f.clear_device_dir();
        let _ = std::fs::remove_file(&pairs);
    }
}

/// `cuda_plugin.backend=cuda-checkpoint` (the C plugin's mode that runs NVIDIA's utility) is not
/// this plugin's: a dump of a CUDA process fails with an error saying so, before the process is
/// touched, while a tree without CUDA still dumps (with a warning).
#[test]
fn the_cuda_checkpoint_backend_option_fails_a_cuda_dump_clearly_and_nothing_else() {
    let Some(f) = start("criu43-backend-option") else {
        return;
    };
    let option = "--plugin-option=cuda_plugin.backend=cuda-checkpoint";

    let w = f.workload(&["--mib", "8"]);
    let refused = f.dump(w.root(), &[option], &f.env("dump.calls"));
    refused.assert_failed();
    let first = refused.first_error().unwrap_or_default();
    assert!(
        first.contains("gpu_plugin")
            && first.contains("cuda.backend = cuda-checkpoint (plugin option cuda_plugin.backend)")
            && first.contains("use auto or driver-api")
            && first.ends_with("[settings]"),
        "the first error must say why: {refused:?}"
    );
    let calls = f.calls("dump.calls");
    assert!(
        calls.transitions(w.root()).is_empty(),
        "the process was touched: {calls:?}"
    );
    w.assert_all_running("after the refused dump");
    f.e.kill_and_reap(&w.pids);

    let tree = common::Tree::start(&f.e, "tree.out", &[]);
    let plain = f.dump_logged(
        &f.e.images("img-plain"),
        "plain.log",
        tree.root,
        &[option],
        &f.env("plain.calls"),
    );
    plain.assert_ok();
    plain.assert_no_plugin_errors();
    assert!(
        plain.has("a dump or restore of CUDA processes fails until it is fixed"),
        "{plain:?}"
    );
    f.e.reap(&tree.pids());
}
