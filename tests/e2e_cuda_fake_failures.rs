//! The NVIDIA path end to end when something goes wrong, on the harness and stand-in CUDA driver
//! of `tests/e2e_cuda_fake.rs` (its header describes them): a lock that times out, a checkpoint
//! or restore the driver fails, a stopped process, settings that cannot be read, FIFOs where
//! files should be, hook orders CRIU does not make, two CRIUs at once and a failing action
//! script.
//!
//! CRIU comes from `$CRIU_BIN`, `<repo>/.criu/bin/criu` (`scripts/install-criu.sh`) or `PATH`;
//! without one these tests fail, unless `GPU_PLUGIN_SKIP_E2E=1`. They need root and `cc`.

use criu_gpu_test_support as common;

use std::path::Path;
use std::time::Duration;

use common::fake_cuda::*;
use common::scenario::*;
use common::{CriuRun, Tree, cc, plugin_libdir, wait_until};

// ---- the tests ----------------------------------------------------------------------------

#[test]
fn a_lock_timeout_fails_the_dump_and_leaves_the_process_running() {
    let Some(f) = OneGpu::start("cuda-lock-timeout") else {
        return;
    };
    let w = f.workload(&["--mib", "8", "--threads", "1", "--hold-ms", "8000"]);
    let pid = w.root();
    assert!(common::signal(pid, libc::SIGUSR2), "SIGUSR2");
    w.wait_line(pid, "hold begin");

    let root = pid.to_string();
    let dump = f.dump(&root, &["--timeout", "2"], &f.env("dump.calls"));
    dump.assert_failed();
    // The lock timeout came from CRIU's --timeout (2 s), not from the plugin's default (10 s),
    // and the dump did not wait for the busy section to end.
    dump.assert_lock_timed_out(Duration::from_secs(6));
    assert!(
        !w.lines(pid).iter().any(|l| l == "hold end"),
        "the busy section ended before the dump gave up"
    );
    let calls = f.calls("dump.calls");
    let t = calls.transitions(pid);
    assert!(
        t.len() == 1 && t[0].starts_with("lock=") && t[0] != "lock=0",
        "expected one failed lock: {calls:?}"
    );

    w.wait_line(pid, "hold end");
    w.assert_all_running("after a lock timeout");
}

#[test]
fn a_checkpoint_failure_half_way_puts_every_process_back() {
    let Some(f) = OneGpu::start("cuda-half-way") else {
        return;
    };
    let w = f.workload(&TREE_OF_3);
    let files = f.device_memory(&w);
    let second_child = w.pids[2];
    let mut env = f.env("dump.calls");
    env.push(("FAKE_CUDA_FAIL", format!("checkpoint@{second_child}")));
    let root = w.root().to_string();
    let dump = f.dump(&root, &[], &env);
    dump.assert_failed();
    let first = dump.first_error().unwrap_or_default();
    assert!(
        first.contains("gpu_plugin") && first.contains(&format!("pid {second_child}")),
        "the first error must name the process whose checkpoint failed: {dump:?}"
    );
    let calls = f.calls("dump.calls");
    for &p in &w.pids {
        let expected: &[&str] = if p == second_child {
            &["lock=0", "checkpoint=999", "unlock=0"]
        } else {
            &["lock=0", "checkpoint=0", "restore=0", "unlock=0"]
        };
        assert_eq!(calls.transitions(p), expected, "pid {p}: {calls:?}");
        assert_eq!(
            f.device_files(p),
            files[&p],
            "pid {p}: device memory not back"
        );
    }
    w.assert_all_running("after a failed checkpoint");
}

#[test]
fn a_stopped_cuda_process_is_refused_clearly() {
    let Some(f) = OneGpu::start("cuda-stopped") else {
        return;
    };
    let w = f.workload(&["--mib", "8", "--children", "2", "--threads", "1"]);
    let files = f.device_memory(&w);
    let stopped = w.pids[1];
    assert!(common::signal(stopped, libc::SIGSTOP), "SIGSTOP {stopped}");
    wait_until(format!("pid {stopped} stopped"), || {
        common::state_of(stopped) == Some('T')
    });
    // Stopped: continued whatever happens, so that the checks below and the clean-up work.
    struct Cont(i32);
    impl Drop for Cont {
        fn drop(&mut self) {
            common::signal(self.0, libc::SIGCONT);
        }
    }
    let cont = Cont(stopped);

    let root = w.root().to_string();
    let dump = f.dump(&root, &["--timeout", "10"], &f.env("dump.calls"));
    dump.assert_failed();
    let first = dump.first_error().unwrap_or_default();
    assert!(
        first.contains("gpu_plugin")
            && first.contains(&format!("pid {stopped} "))
            && first.contains("stopped"),
        "the first error must say that pid {stopped} is stopped: {dump:?}"
    );
    // Refused up front, not after a driver call that waits for the stopped process.
    assert!(
        dump.took.as_secs_f64() < 5.0,
        "the dump took {:?} (CRIU's timeout is 10 s): {dump:?}",
        dump.took
    );
    let calls = f.calls("dump.calls");
    assert!(
        !calls
            .0
            .iter()
            .any(|(op, p, _)| *p == stopped && op == "lock"),
        "the stopped pid {stopped} was asked to lock: {calls:?}"
    );
    for &p in &w.pids {
        let t = calls.transitions(p);
        assert!(
            t.is_empty() || (p != stopped && t == ["lock=0", "unlock=0"]),
            "pid {p} must be left unlocked: {calls:?}"
        );
        assert_eq!(f.device_files(p), files[&p], "pid {p}: device memory");
    }

    drop(cont);
    wait_until(format!("pid {stopped} continued"), || {
        common::state_of(stopped) != Some('T')
    });
    w.assert_all_running("after a dump refused for a stopped process");
}

/// A plain (non-CUDA) tree dumps and restores while `CRIU_GPU_PLUGIN_CONFIG` names a settings
/// file that cannot be read (`make` makes it so): the plugin says so and sits the run out.
fn unreadable_settings_do_not_break_a_plain_tree(test: &str, make: fn(&Path)) {
    let Some(f) = Fake::start(test) else {
        return;
    };
    let gpu = &f.gpus(1, 0)[0];
    let nv = one_gpu(&f, "nv", "0000:00:06.0", &gpu.model, gpu);
    let config = f.e.dir().join("gpu-plugin.conf");
    make(&config);
    let env = |calls: &str| {
        let mut env = f.env(&nv, calls);
        env.push(("CRIU_GPU_PLUGIN_CONFIG", config.display().to_string()));
        env
    };
    let tree = Tree::start(&f.e, "tree.out", &[]);
    let lib = lib();
    let images = f.e.images("img");
    let root = tree.root.to_string();
    let settings_error = |run: &CriuRun| {
        let ours: Vec<&str> = run
            .errors()
            .into_iter()
            .filter(|l| l.contains("gpu_plugin"))
            .collect();
        assert!(
            !ours.is_empty()
                && ours.iter().all(|l| {
                    l.contains("gpu_plugin: settings: ")
                        && l.contains(&config.display().to_string())
                }),
            "expected the plugin's settings error (and no other plugin error): {run:?}"
        );
    };

    let dump = f.criu(
        &["dump", "-t", &root, "-L", &lib, "-v4"],
        &images,
        "dump.log",
        &env("dump.calls"),
    );
    dump.assert_ok();
    f.e.reap(&tree.pids());
    settings_error(&dump);
    let calls = f.calls("dump.calls");
    assert!(
        calls.0.is_empty(),
        "driver calls with GPU support off: {calls:?}"
    );
    let dumped = tree.text();

    let restore = f.criu(
        &["restore", "-d", "-L", &lib, "-v4"],
        &images,
        "restore.log",
        &env("restore.calls"),
    );
    restore.assert_ok();
    settings_error(&restore);
    tree.assert_continues(&dumped);
    let calls = f.calls("restore.calls");
    assert!(
        calls.0.is_empty(),
        "driver calls with GPU support off: {calls:?}"
    );
}

#[test]
fn a_settings_path_that_is_a_directory_does_not_break_a_plain_dump() {
    unreadable_settings_do_not_break_a_plain_tree("settings-dir", |p| {
        std::fs::create_dir(p).expect("settings directory");
    });
}

#[test]
fn a_settings_file_of_invalid_utf8_does_not_break_a_plain_dump() {
    unreadable_settings_do_not_break_a_plain_tree("settings-utf8", |p| {
        std::fs::write(p, b"cuda.parallel = \xff\xfe yes\n").expect("settings file");
    });
}

#[test]
fn a_settings_file_that_is_a_fifo_does_not_hang_criu() {
    unreadable_settings_do_not_break_a_plain_tree("settings-fifo", common::mkfifo);
}

/// FIFOs where the driver's files, the configured libcuda and the plugin's own image should
/// be: nothing blocks on them. Files the plugin cannot use switch the NVIDIA side off for a
/// run that does not need it; a restore that needs the unreadable image fails, naming it; a
/// FIFO of our image name in an image that does not need the plugin is never opened.
#[test]
fn fifos_in_place_of_driver_files_and_images_do_not_hang_criu() {
    let Some(f) = Fake::start("fifos") else {
        return;
    };
    let gpu = &f.gpus(1, 0)[0];
    let lib = lib();
    let tree = Tree::start(&f.e, "tree.out", &[]);
    let root = tree.root.to_string();

    // The GPU's `information` file, and then the configured libcuda, are FIFOs.
    let fifo_info = f.e.dir().join("nv-fifo");
    std::fs::create_dir_all(fifo_info.join("0000:00:06.0")).unwrap();
    common::mkfifo(&fifo_info.join("0000:00:06.0/information"));
    let fifo_lib = f.e.dir().join("libcuda-fifo.so.1");
    common::mkfifo(&fifo_lib);
    let nv = one_gpu(&f, "nv", "0000:00:06.0", &gpu.model, gpu);
    let mut with_fifo_lib = f.env(&nv, "dump2.calls");
    with_fifo_lib.retain(|(k, _)| *k != "CRIU_GPU_LIBCUDA");
    with_fifo_lib.push(("CRIU_GPU_LIBCUDA", fifo_lib.display().to_string()));
    for (n, env, why) in [
        (
            1,
            f.env(&fifo_info, "dump1.calls"),
            "information is not a regular file (a FIFO)",
        ),
        (2, with_fifo_lib, "libcuda-fifo.so.1 is not a regular file"),
    ] {
        let images = f.e.images(&format!("img{n}"));
        let dump = f.criu(
            &["dump", "-t", &root, "--leave-running", "-L", &lib, "-v4"],
            &images,
            "dump.log",
            &env,
        );
        dump.assert_ok();
        assert!(dump.has(why), "{why}: {dump:?}");
        dump.assert_no_plugin_errors();
    }

    // The driver's `version` file is a FIFO: the release is unknown, the dump goes on.
    common::mkfifo(&f.e.dir().join("version"));
    let w = Workload::start(&f, "w", &["--mib", "8"]);
    let images = f.e.images("img-cuda");
    let dump = f.criu(
        &["dump", "-t", &w.root().to_string(), "-L", &lib, "-v4"],
        &images,
        "dump.log",
        &f.env(&nv, "dump3.calls"),
    );
    dump.assert_ok();
    f.e.reap(&w.pids);
    assert!(dump.has("cuda: driver of unknown release"), "{dump:?}");

    // The image needs cuda_plugin but its metadata is a FIFO: the restore fails at once.
    let md = images.join("gpu-plugin-cuda.img");
    std::fs::remove_file(&md).unwrap();
    common::mkfifo(&md);
    let restore = f.criu(
        &["restore", "-d", "-L", &lib, "-v4"],
        &images,
        "restore.log",
        &f.env(&nv, "restore3.calls"),
    );
    restore.assert_failed();
    assert!(
        restore.has("cannot open gpu-plugin-cuda.img") && restore.has("a FIFO"),
        "{restore:?}"
    );
    for &p in &w.pids {
        assert!(!common::exists(p), "pid {p} restored without its GPU state");
    }

    // A plain image (no cuda_plugin in its inventory) with a FIFO and then garbage of our
    // image name: the plugin never reads it, the restore succeeds.
    tree.wait_ticks(2);
    let images = f.e.images("img-plain");
    let dump = f.criu(
        &["dump", "-t", &root, "-L", &lib, "-v4"],
        &images,
        "dump.log",
        &f.env(&nv, "dump4.calls"),
    );
    dump.assert_ok();
    f.e.reap(&tree.pids());
    let dumped = tree.text();
    common::mkfifo(&images.join("gpu-plugin-cuda.img"));
    let restore = f.criu(
        &["restore", "-d", "-L", &lib, "-v4"],
        &images,
        "restore.log",
        &f.env(&nv, "restore4.calls"),
    );
    restore.assert_ok();
    restore.assert_no_plugin_errors();
    tree.assert_continues(&dumped);
}

/// Restores that cannot give every CUDA process its GPU state back never end in a reported
/// success with processes frozen for good: an image whose metadata records no process, or a
/// process the image's tree does not hold, is refused before anything is forked; a driver
/// restore that fails at RESUME_DEVICES_LATE (whose result CRIU ignores) ends the restored
/// processes, and CRIU then fails the restore. The image stays usable: restored again with a
/// working driver, the workload continues.
#[test]
fn a_restore_that_cannot_give_the_gpu_state_back_fails() {
    let Some(f) = OneGpu::start("cuda-false-success") else {
        return;
    };
    let w = f.workload(&["--mib", "8", "--children", "1"]);
    let lib = lib();
    let images = &f.images;
    let dump = f.criu(
        &["dump", "-t", &w.root().to_string(), "-L", &lib, "-v4"],
        images,
        "dump.log",
        &f.env("dump.calls"),
    );
    dump.assert_ok();
    f.e.reap(&w.pids);
    let marks = w.marks();
    let md_path = images.join("gpu-plugin-cuda.img");
    let md = std::fs::read_to_string(&md_path).unwrap();
    let assert_nothing_restored = |run: &CriuRun, why: &str| {
        run.assert_failed();
        assert!(run.has(why), "{why}: {run:?}");
        assert!(
            common::reap_until_gone(&w.pids, std::time::Duration::from_secs(10)),
            "processes left after the failed restore: {run:?}"
        );
    };

    let no_records: String = md
        .lines()
        .filter(|l| !l.starts_with("process "))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&md_path, resealed_metadata(&no_records)).unwrap();
    let r = f.restore("r1.log", &f.env("r1.calls"));
    assert_nothing_restored(&r, "records no CUDA process");

    let stranger: String = md
        .lines()
        .map(|l| match l.strip_prefix("process ") {
            Some(rest) if rest.starts_with(&format!("{} ", w.pids[1])) => {
                format!("process 999999{}\n", &rest[w.pids[1].to_string().len()..])
            }
            _ => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&md_path, resealed_metadata(&stranger)).unwrap();
    let r = f.restore("r2.log", &f.env("r2.calls"));
    assert_nothing_restored(
        &r,
        "CUDA process(es) 999999 that the image's process tree does not hold",
    );
    assert!(
        f.calls("r2.calls").0.is_empty(),
        "driver calls after a refused image"
    );

    // Sizes that wrap to 0 when added: 2^64 - 1 bytes for one process, 1 for the other.
    let mut sizes = ["18446744073709551615", "1"].into_iter();
    let wrapping: String = md
        .lines()
        .map(|l| match l.strip_prefix("process ") {
            Some(rest) => {
                let mut f: Vec<&str> = rest.split(' ').collect();
                let last = f.len() - 1;
                f[last] = sizes.next().unwrap_or("1");
                format!("process {}\n", f.join(" "))
            }
            None => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&md_path, resealed_metadata(&wrapping)).unwrap();
    let r = f.restore("r-wrap.log", &f.env("r-wrap.calls"));
    assert_nothing_restored(&r, "too little free GPU memory");

    std::fs::write(&md_path, &md).unwrap();
    let mut env = f.env("r3.calls");
    env.push(("FAKE_CUDA_FAIL", format!("restore@{}", w.pids[1])));
    let r = f.restore("r3.log", &env);
    assert_nothing_restored(
        &r,
        "so that the restore fails instead of leaving them frozen",
    );
    assert!(!r.has("Restore finished successfully"), "{r:?}");

    let r = f.restore("r4.log", &f.env("r4.calls"));
    r.assert_ok();
    r.assert_no_plugin_errors();
    w.assert_all_running("after the second restore");
    w.assert_continues(&marks);
}

/// `cuda.lock-timeout-ms = 0` with `criu dump --timeout 0` (no alarm) would ask the driver to
/// wait for good: the setting is refused with a warning and the default used.
#[test]
fn a_lock_timeout_of_zero_never_reaches_the_driver() {
    let Some(f) = OneGpu::start("cuda-lock-zero") else {
        return;
    };
    let w = f.workload(&["--mib", "8"]);
    let mut env = f.env("dump.calls");
    env.push(("CRIU_GPU_CUDA_LOCK_TIMEOUT_MS", "0".into()));
    let dump = f.criu(
        &[
            "dump",
            "-t",
            &w.root().to_string(),
            "--leave-running",
            "--timeout",
            "0",
            "-L",
            &lib(),
            "-v4",
        ],
        &f.e.images("img"),
        "dump.log",
        &env,
    );
    dump.assert_ok();
    assert!(
        dump.has("cuda.lock-timeout-ms = 0 would wait for good; using 10000"),
        "{dump:?}"
    );
    dump.assert_no_plugin_errors();
    w.assert_all_running("after --leave-running");
}

/// Hook orders CRIU does not make but a host may (a CRIU service process, plain `dlopen`, a
/// future CRIU), driven by the emulated 4.1 host's `--script`: a second `init` without
/// `exit`, an `exit` with an unknown stage, and `CHECKPOINT_DEVICES` of a process paused but
/// never seized. Each time the workload is unlocked again, nothing stays locked.
#[test]
fn odd_hook_orders_never_leave_a_process_locked() {
    let Some(f) = OneGpu::start("cuda-hook-orders") else {
        return;
    };
    let host = cc(
        "criu_host_41_script",
        &[
            "-std=gnu11".into(),
            "-DHOST_HOOKS=12".into(),
            "-DHOST_V41_API=1".into(),
            "-rdynamic".into(),
            format!("-I{}/include", env!("CARGO_MANIFEST_DIR")),
            format!("{}/tests/host/criu_host.c", env!("CARGO_MANIFEST_DIR")),
            "-ldl".into(),
        ],
    );
    let w = f.workload(&["--mib", "8"]);
    let pid = w.root();
    let plugin = plugin_libdir().join("gpu_plugin.so");
    for (n, script) in [
        "init:dump,pause:P,init:dump,exit:1:0",
        "init:dump,pause:P,exit:99:0",
        "init:dump,pause:P,checkpoint:P,exit:1:0",
    ]
    .iter()
    .enumerate()
    {
        let script = script.replace('P', &pid.to_string());
        let calls = format!("script{n}.calls");
        let images = f.e.images(&format!("img{n}"));
        let out =
            f.e.command(&host)
                .args(["--images".as_ref(), images.as_os_str()])
                .args(["--script".as_ref(), plugin.as_os_str(), script.as_ref()])
                .envs(f.env(&calls))
                .stdout(std::process::Stdio::piped())
                .output()
                .expect("run the emulated host");
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(report.contains("result ok"), "{script}: {report}");
        assert!(
            !images.join("gpu-plugin-cuda.img").exists(),
            "{script}: metadata written for a dump that checkpointed nothing"
        );
        assert_eq!(
            f.calls(&calls).transitions(pid),
            ["lock=0", "unlock=0"],
            "{script}: {report}"
        );
        w.assert_all_running(&script);
    }
}

/// Two CRIUs dumping the same CUDA process with `--leave-running` at the same time: each round
/// at most one of them checkpoints it (the other is refused, or comes after), and the process
/// always ends running with its GPU state.
#[test]
fn concurrent_dumps_of_one_process_never_leave_it_locked() {
    let Some(f) = OneGpu::start("cuda-concurrent") else {
        return;
    };
    let w = f.workload(&["--mib", "8"]);
    let root = w.root().to_string();
    let lib = lib();
    let mut refused = 0;
    for round in 0..8 {
        let runs: Vec<CriuRun> = std::thread::scope(|s| {
            let handles: Vec<_> = ["a", "b"]
                .iter()
                .map(|who| {
                    let (f, root, lib) = (&f, &root, &lib);
                    s.spawn(move || {
                        f.criu(
                            &["dump", "-t", root, "--leave-running", "-L", lib, "-v4"],
                            &f.e.images(&format!("img-{round}-{who}")),
                            "dump.log",
                            &f.env(&format!("{round}-{who}.calls")),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &runs {
            if !r.ok() {
                refused += 1;
                assert!(
                    r.has("right now (a dump or restore of it is under way)")
                        || r.has("is held by another CRIU or criu-gpu right now")
                        || r.has("Can't seize")
                        || r.has("already traced"),
                    "round {round}: a failure other than the other CRIU's claim: {r:?}"
                );
            }
        }
        assert!(
            runs.iter().any(|r| r.ok()),
            "round {round}: neither dump worked: {runs:?}"
        );
        w.assert_all_running(&format!("round {round}"));
    }
    eprintln!("{refused} of 16 dumps refused");
}

/// A post-dump action script that fails makes CRIU resume the dumped tasks. From CRIU 4.3 on,
/// `DUMP_FINISH` says so, and every process goes back running with its GPU state (older CRIUs
/// tell plugins nothing: see the README's limitations).
#[test]
fn a_failing_post_dump_script_gives_every_process_its_gpu_back() {
    let Some(f) = Fake::start("cuda-dump-finish") else {
        return;
    };
    if f.e.criu_release().is_none_or(|r| r < (4, 3)) {
        eprintln!("CRIU before 4.3 has no DUMP_FINISH: skipped");
        return;
    }
    let gpu = &f.gpus(1, 0)[0];
    let nv = one_gpu(&f, "nv", "0000:00:06.0", &gpu.model, gpu);
    let w = Workload::start(&f, "w", &["--mib", "8", "--children", "1"]);
    let script = common::failing_post_dump_script(f.e.dir());
    let dump = f.criu(
        &[
            "dump",
            "-t",
            &w.root().to_string(),
            "--action-script",
            &script.display().to_string(),
            "-L",
            &lib(),
            "-v4",
        ],
        &f.e.images("img"),
        "dump.log",
        &f.env(&nv, "dump.calls"),
    );
    dump.assert_failed();
    assert!(dump.has("DUMP_FINISH("), "{dump:?}");
    dump.assert_no_plugin_errors();
    let calls = f.calls("dump.calls");
    for &p in &w.pids {
        assert_eq!(
            calls.transitions(p),
            ["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
            "pid {p}: {calls:?}"
        );
    }
    w.assert_all_running("after the failed post-dump script");
}
