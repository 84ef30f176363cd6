//! The NVIDIA path end to end: real CRIU, the plugin built from this tree, and the stand-in CUDA
//! driver of `tests/fixtures/fake-cuda` (its header comments describe it). The workload processes
//! keep "device memory" in files of `FAKE_CUDA_DEVICE_DIR`, which a checkpoint deletes and a
//! restore recreates; SIGUSR1 makes each check its memory ("verify ok"), SIGUSR2 makes it hold a
//! busy section.
//!
//! The plugin finds the driver through `CRIU_GPU_LIBCUDA` and the GPU list through
//! `CRIU_GPU_CUDA_NVIDIA_PROC`, a directory written here in the layout of
//! `/proc/driver/nvidia/gpus`. Everything reaches the plugin and the fake's controller side
//! through CRIU's environment, set on each CRIU command only.
//!
//! CRIU comes from `$CRIU_BIN`, `<repo>/.criu/bin/criu` (`scripts/install-criu.sh`) or `PATH`;
//! without one these tests fail, unless `GPU_PLUGIN_SKIP_E2E=1`. They need root and `cc`.
//!
//! What goes wrong (lock timeouts, failing driver calls, stopped processes, unreadable settings,
//! odd hook orders, concurrent dumps) is in `tests/e2e_cuda_fake_failures.rs`.

use criu_gpu_test_support as common;

use std::collections::BTreeMap;
use std::path::Path;

use common::fake_cuda::*;
use common::scenario::*;
use common::{Tree, children_of, comm_of, ns_pid_of, pid_ns_of};

// ---- the tests ----------------------------------------------------------------------------

#[test]
fn a_cuda_tree_is_dumped_and_restored() {
    let Some(f) = OneGpu::start("cuda-tree") else {
        return;
    };
    let w = f.workload(&TREE_OF_3);
    assert_eq!(w.pids.len(), 3);
    let files = f.device_memory(&w);
    for (p, v) in &files {
        assert_eq!(v.len(), 3, "pid {p}: counter + 2 chunks: {v:?}");
    }
    let images = &f.images;

    let dump = f.dumped(&w);
    dump.assert_no_plugin_errors();
    for &p in &w.pids {
        assert!(
            dump.log.lines().any(|l| l.contains(&format!("gpu_plugin: cuda: pid {p} ")) && l.contains("paused")),
            "pid {p} not paused: {dump:?}"
        );
        assert!(
            f.device_files(p).is_empty(),
            "pid {p}: device files left after the checkpoint"
        );
    }
    assert!(
        dump.has("gpu_plugin: cuda: checkpoint phase: 3 process(es)"),
        "{dump:?}"
    );
    let calls = f.calls("dump.calls");
    calls.assert_transitions(&w.pids, &["lock=0", "checkpoint=0"]);
    assert!(
        images.join("gpu-plugin-cuda.img").is_file(),
        "no gpu-plugin-cuda.img"
    );
    let inventory = std::fs::read(images.join("inventory.img")).expect("inventory.img");
    assert!(
        common::bytes_contain(&inventory, b"cuda_plugin"),
        "inventory.img does not record cuda_plugin"
    );
    let marks = w.marks();

    let restore = f.restore("restore.log", &f.env("restore.calls"));
    restore.assert_ok();
    restore.assert_no_plugin_errors();
    assert!(
        restore.has("gpu_plugin: cuda: restore phase: 3 process(es)"),
        "{restore:?}"
    );
    let calls = f.calls("restore.calls");
    calls.assert_transitions(&w.pids, &["restore=0", "unlock=0"]);
    f.assert_device_memory(&files, "device files not recreated");
    w.assert_all_running("after the restore");
    w.assert_continues(&marks);
}

/// NVML's lingering thread and libcuda's `cuInit` threads stay out of CRIU's process: every
/// hook returns with CRIU single-threaded (the plugin's own check after each hook reports
/// otherwise at ERROR), while NVML did answer and a restore that needs `cuInit` still works.
#[test]
fn criu_keeps_one_thread_with_nvml_and_a_restore_that_needs_cuinit() {
    let Some(f) = OneGpu::start("cuda-one-thread") else {
        return;
    };
    let w = f.workload(&["--mib", "8", "--children", "1"]);
    let dump = f.dumped(&w);
    dump.assert_no_plugin_errors();
    assert!(!dump.has("left CRIU's process with"), "{dump:?}");
    let nvml_log = std::fs::read_to_string(f.e.dir().join("nvml.log")).unwrap_or_default();
    assert!(
        nvml_log.lines().any(|l| l.contains("threads=2")),
        "NVML was not asked, or its thread did not start: {nvml_log:?}"
    );
    let marks = w.marks();
    let mut env = f.env("restore.calls");
    env.push(("FAKE_CUDA_RESTORE_NEEDS_INIT", "1".into()));
    let restore = f.restore("restore.log", &env);
    restore.assert_ok();
    restore.assert_no_plugin_errors();
    assert!(!restore.has("left CRIU's process with"), "{restore:?}");
    assert!(
        restore.has("from a helper process that calls cuInit"),
        "{restore:?}"
    );
    let calls = f.calls("restore.calls");
    calls.assert_transitions(&w.pids, &["restore=800", "restore=0", "unlock=0"]);
    w.assert_all_running("after the restore");
    w.assert_continues(&marks);
}

#[test]
fn leave_running_gives_every_process_its_gpu_back() {
    let Some(f) = OneGpu::start("cuda-leave-running") else {
        return;
    };
    let w = f.workload(&TREE_OF_3);
    let files = f.device_memory(&w);
    let root = w.root().to_string();
    let dump = f.dump(&root, &["--leave-running"], &f.env("dump.calls"));
    dump.assert_ok();
    dump.assert_no_plugin_errors();
    let calls = f.calls("dump.calls");
    calls.assert_transitions(
        &w.pids,
        &["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
    );
    f.assert_device_memory(&files, "device memory not back");
    w.assert_all_running("after a --leave-running dump");
}

#[test]
fn an_image_from_other_gpus_is_refused_early_or_mapped() {
    let Some(f) = OneGpu::start("cuda-gpu-map") else {
        return;
    };
    // GPU 0 (A) is what the workload runs on; GPU 1 (B) exists only for the restoring driver.
    let gpus = f.gpus(2, 0);
    let (a, b) = (&gpus[0], &gpus[1]);
    assert_eq!(f.gpu.uuid, a.uuid);
    let nv_pro = one_gpu(&f, "nv-pro", "0000:00:07.0", "Fake GPU Pro", b);
    let nv_b = one_gpu(&f, "nv-b", "0000:00:07.0", "Fake GPU", b);
    let nv_ab = f.two_gpus_listed("nv-ab", a, b);
    let w = f.workload(&["--mib", "8"]);
    let pid = w.root();
    f.dumped(&w);
    f.clear_device_dir();
    let restore_env = |nv: &Path, calls: &str, map: Option<String>| {
        let mut env = f.f.env(nv, calls);
        env.push(("FAKE_CUDA_GPUS", "2".into()));
        if let Some(m) = map {
            env.push(("CRIU_GPU_CUDA_DEVICE_MAP", m));
        }
        env
    };
    let pairs = f.dev.join(format!("restore-pairs.{pid}"));
    let expected_pairs = format!("{} {}\n", a.uuid, b.uuid);

    // Only a GPU of another model here: refused before anything is forked.
    let refused = f.restore("restore-pro.log", &restore_env(&nv_pro, "pro.calls", None));
    refused.assert_failed();
    let first = refused.first_error().unwrap_or_default();
    assert!(
        first.contains("gpu_plugin") && first.contains(&a.uuid) && first.contains("no counterpart"),
        "the first error must name the GPU without a counterpart: {refused:?}"
    );
    assert_nothing_restored(&refused, &w.pids);
    let calls = f.calls("pro.calls");
    assert!(
        calls.0.is_empty(),
        "driver calls in a refused restore: {calls:?}"
    );

    // A GPU of the same model with another UUID: mapped automatically.
    let marks = w.marks();
    let mapped = f.restore("restore-auto.log", &restore_env(&nv_b, "auto.calls", None));
    mapped.assert_ok();
    mapped.assert_no_plugin_errors();
    assert_eq!(
        std::fs::read_to_string(&pairs).unwrap_or_default(),
        expected_pairs,
        "GPU pairs of the automatic mapping: {mapped:?}"
    );
    w.assert_all_running("after a restore onto another GPU");
    w.assert_continues(&marks);
    f.e.kill_and_reap(&w.pids);
    f.clear_device_dir();

    // Both GPUs here, and an explicit map from A to B.
    let explicit = f.restore(
        "restore-map.log",
        &restore_env(&nv_ab, "map.calls", Some(format!("{}={}", a.uuid, b.uuid))),
    );
    explicit.assert_ok();
    explicit.assert_no_plugin_errors();
    assert_eq!(
        std::fs::read_to_string(&pairs).unwrap_or_default(),
        expected_pairs,
        "GPU pairs of the explicit map: {explicit:?}"
    );
    w.assert_all_running("after a restore with an explicit GPU map");
}

#[test]
fn an_image_without_plugin_metadata_restores() {
    let Some(f) = OneGpu::start("cuda-no-metadata") else {
        return;
    };
    let w = f.workload(&["--mib", "16", "--chunk-mib", "8", "--children", "1"]);
    let files = f.device_memory(&w);
    let images = &f.images;
    f.dumped(&w);
    // What CRIU's C plugin leaves: the inventory entry, no file of ours.
    std::fs::remove_file(images.join("gpu-plugin-cuda.img")).expect("gpu-plugin-cuda.img");
    let marks = w.marks();
    let restore = f.restore("restore.log", &f.env("restore.calls"));
    restore.assert_ok();
    restore.assert_no_plugin_errors();
    let calls = f.calls("restore.calls");
    calls.assert_transitions(&w.pids, &["restore=0", "unlock=0"]);
    f.assert_device_memory(&files, "device files not recreated");
    w.assert_all_running("after a restore without metadata");
    w.assert_continues(&marks);
}

#[test]
fn a_cuda_image_needs_the_cuda_side() {
    let Some(f) = OneGpu::start("cuda-disabled") else {
        return;
    };
    let w = f.workload(&["--mib", "8"]);
    f.dumped(&w);
    let mut env = f.env("restore.calls");
    env.push(("CRIU_GPU_DISABLE", "cuda".into()));
    let restore = f.restore("restore.log", &env);
    restore.assert_failed();
    assert!(
        restore.has("Missing required plugin: cuda_plugin"),
        "{restore:?}"
    );
    assert!(
        restore.has("gpu_plugin: cuda: disabled by settings"),
        "{restore:?}"
    );
    assert_nothing_restored(&restore, &w.pids);
    let calls = f.calls("restore.calls");
    assert!(
        calls.0.is_empty(),
        "driver calls with CUDA disabled: {calls:?}"
    );
}

#[test]
fn a_process_without_cuda_is_left_to_criu() {
    let Some(f) = OneGpu::start("cuda-not-mine") else {
        return;
    };
    let tree = Tree::start(&f.e, "tree.out", &[]);
    let images = &f.images;
    let root = tree.root.to_string();
    let dump = f.dump(&root, &[], &f.env("dump.calls"));
    dump.assert_ok();
    f.e.reap(&tree.pids());
    dump.assert_no_plugin_errors();
    // The NVIDIA side was on, and asked.
    assert!(dump.has("gpu_plugin: cuda: driver "), "{dump:?}");
    let calls = f.calls("dump.calls");
    assert!(
        calls.ops().iter().all(|op| *op == "get_restore_tid"),
        "only restore-thread queries expected: {calls:?}"
    );
    for pid in tree.pids() {
        assert!(
            calls
                .0
                .iter()
                .any(|(op, p, rc)| op == "get_restore_tid" && *p == pid && *rc != 0),
            "pid {pid} was not asked about: {calls:?}"
        );
    }
    assert!(
        !dump
            .lines_with("gpu_plugin: cuda: pid")
            .iter()
            .any(|l| l.contains("paused")),
        "the plugin took on a process without CUDA: {dump:?}"
    );
    assert!(
        !images.join("gpu-plugin-cuda.img").exists(),
        "metadata for no CUDA process"
    );
    let inventory = std::fs::read(images.join("inventory.img")).expect("inventory.img");
    assert!(
        !common::bytes_contain(&inventory, b"cuda_plugin"),
        "inventory.img records cuda_plugin for a tree without CUDA"
    );
    let dumped = tree.text();
    let restore = f.restore("restore.log", &f.env("restore.calls"));
    restore.assert_ok();
    restore.assert_no_plugin_errors();
    tree.assert_continues(&dumped);
    // Each restored task is asked whether it is a CUDA process (a checkpointed one must not
    // run on frozen, whatever the inventory says), and nothing more.
    let calls = f.calls("restore.calls");
    assert!(
        calls.ops().iter().all(|op| *op == "get_restore_tid"),
        "only restore-thread queries expected restoring a tree without CUDA: {calls:?}"
    );
}

#[test]
fn a_container_in_its_own_pid_namespace_gets_its_gpu_back_under_new_host_pids() {
    let Some(f) = OneGpu::start("cuda-pid-ns") else {
        return;
    };
    let (mut w, unshare) = Workload::start_in_pid_ns(&f, "w", &ROOT_AND_CHILD);
    let dumped = w.pids.clone();
    assert_eq!(w.ns_pids, [1, 2]);
    assert_ne!(
        pid_ns_of(w.root()),
        pid_ns_of(std::process::id() as i32),
        "the tree must run in a pid namespace of its own"
    );
    // Device files are named by the pid each process sees.
    let files: BTreeMap<i32, Vec<String>> =
        w.ns_pids.iter().map(|&p| (p, f.device_files(p))).collect();
    for (p, v) in &files {
        assert_eq!(v.len(), 3, "pid {p}: counter + 2 chunks: {v:?}");
    }
    let images = &f.images;
    let root = w.root().to_string();

    let dump = f.dump(&root, &[], &f.env("dump.calls"));
    dump.assert_ok();
    // `unshare` exits with its child; every pid is free again.
    f.e.reap(&[dumped.as_slice(), &[unshare]].concat());
    dump.assert_no_plugin_errors();
    for &p in &dumped {
        assert!(
            dump.lines_with(&format!("gpu_plugin: cuda: pid {p} "))
                .iter()
                .any(|l| l.contains("paused")),
            "pid {p} not paused: {dump:?}"
        );
    }
    assert!(
        dump.has("gpu_plugin: cuda: checkpoint phase: 2 process(es)"),
        "{dump:?}"
    );
    let calls = f.calls("dump.calls");
    calls.assert_transitions(&dumped, &["lock=0", "checkpoint=0"]);
    for &p in &w.ns_pids {
        assert!(
            f.device_files(p).is_empty(),
            "pid {p} of the namespace: device files left after the checkpoint"
        );
    }
    // The metadata records each process by the pid it sees, which the restore keeps.
    let md =
        std::fs::read_to_string(images.join("gpu-plugin-cuda.img")).expect("gpu-plugin-cuda.img");
    let recorded: Vec<&str> = md
        .lines()
        .filter_map(|l| l.strip_prefix("process ")?.split_whitespace().next())
        .collect();
    assert_eq!(recorded, ["1", "2"], "processes in the metadata:\n{md}");
    let marks = w.marks();

    let restore = f.restore("restore.log", &f.env("restore.calls"));
    // The restored init is re-parented here (this process is a subreaper): adopt the new
    // namespace before anything can fail, so that it is killed in any case.
    let new_root = children_of(std::process::id() as i32)
        .into_iter()
        .find(|&p| ns_pid_of(p) == Some(1) && comm_of(p).as_deref() == Some("workload"));
    let new_child = new_root.and_then(|r| {
        children_of(r)
            .into_iter()
            .find(|&p| ns_pid_of(p) == Some(2))
    });
    if let Some(r) = new_root {
        f.e.adopt(r, r);
        if let Some(c) = new_child {
            f.e.adopt(r, c);
        }
    }
    restore.assert_ok();
    let (Some(new_root), Some(new_child)) = (new_root, new_child) else {
        panic!("restored tree not found (init {new_root:?}, its pid 2 {new_child:?}): {restore:?}");
    };
    let restored = vec![new_root, new_child];
    for (old, new) in dumped.iter().zip(&restored) {
        assert_ne!(
            old, new,
            "the restored process has its old host pid: {restore:?}"
        );
    }
    // (Not compared with the dumped namespace: that one is gone, and its inode number may be
    // given to the new one.)
    let new_ns = pid_ns_of(new_root).expect("the restored tree's pid namespace");
    assert_ne!(
        Some(&new_ns),
        pid_ns_of(std::process::id() as i32).as_ref(),
        "the restored tree must run in a pid namespace of its own"
    );
    assert_eq!(pid_ns_of(new_child).as_ref(), Some(&new_ns));
    restore.assert_no_plugin_errors();
    assert!(
        restore.has("gpu_plugin: cuda: restore phase: 2 process(es)"),
        "{restore:?}"
    );
    let calls = f.calls("restore.calls");
    calls.assert_transitions(&restored, &["restore=0", "unlock=0"]);
    for &p in &dumped {
        assert!(
            calls.transitions(p).is_empty(),
            "driver calls for the dumped host pid {p}: {calls:?}"
        );
    }
    for (p, v) in &files {
        assert_eq!(
            &f.device_files(*p),
            v,
            "pid {p} of the namespace: device files not recreated"
        );
    }
    w.moved_to(restored);
    w.assert_all_running("after the restore into a new pid namespace");
    w.assert_continues(&marks);
}
