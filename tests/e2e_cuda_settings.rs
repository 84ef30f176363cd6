//! Settings that keep the NVIDIA side from running, against real CRIU and the stand-in driver
//! (`common::fake_cuda`): a dump of a process that holds an NVIDIA device fails, naming the
//! key and where its value came from, and leaves the process running; a process without one
//! still dumps. And no library is ever loaded from CRIU's working directory (the image
//! directory), whatever `libcuda`, `nvml` and `LD_LIBRARY_PATH` say.
//!
//! "Holds an NVIDIA device" is what the plugin reads from `/proc/PID/fd` and `/proc/PID/maps`:
//! a path under `/dev/nvidia`. The stand-in driver opens no such device, so the process here
//! holds a file `/dev/nvidia-gpu-plugin-test-*` open (root may create one in devtmpfs).
//!
//! Needs root, `cc` and CRIU as `tests/e2e_cuda_fake.rs` does.

use criu_gpu_test_support as common;

use std::path::{Path, PathBuf};

use common::fake_cuda::*;
use common::scenario::*;
use common::{CriuRun, Tree, cc, comm_of, fixture};
use cuda_ckpt_sys::library_search::{LOADER_CACHE, SYSTEM_DIRS, Search};

/// CRIU's environment.
type Env = Vec<(&'static str, String)>;

/// A file under `/dev/nvidia*`, removed on drop.
struct NvidiaNode(PathBuf);

impl NvidiaNode {
    fn create(test: &str) -> NvidiaNode {
        let p = PathBuf::from(format!(
            "/dev/nvidia-gpu-plugin-test-{test}-{}",
            std::process::id()
        ));
        std::fs::write(&p, b"").expect("a file under /dev (root is needed)");
        NvidiaNode(p)
    }
}

impl Drop for NvidiaNode {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The library of `tests/fixtures/e2e/marker_lib.c`: its constructor creates the file named by
/// `GPU_PLUGIN_TEST_MARKER`.
fn marker_lib() -> PathBuf {
    cc(
        "marker_lib.so",
        &[
            "-shared".into(),
            "-fPIC".into(),
            fixture("e2e/marker_lib.c"),
        ],
    )
}

/// Puts `marker_lib` into `images` and a `lib/` below it under the names of libcuda and NVML.
fn plant(marker_lib: &Path, images: &Path) {
    std::fs::create_dir_all(images.join("lib")).unwrap();
    for name in [
        "libcuda.so.1",
        "lib/libcuda.so.1",
        "libnvidia-ml.so.1",
        "lib/libnvidia-ml.so.1",
    ] {
        std::fs::copy(marker_lib, images.join(name)).unwrap();
    }
}

/// A process in a session of its own that keeps `node` open (fd 3) and sleeps.
fn holder(f: &Fake, node: &Path) -> i32 {
    let mut cmd = f.e.command(Path::new("/bin/sh"));
    cmd.args(["-c", "exec 3<\"$1\"; exec sleep 600", "sh"])
        .arg(node);
    let pid = f.e.spawn_session(cmd);
    common::wait_until(format!("pid {pid} holds {}", node.display()), || {
        std::fs::read_link(format!("/proc/{pid}/fd/3")).is_ok_and(|t| t == node)
            && comm_of(pid).as_deref() == Some("sleep")
    });
    pid
}

/// The dump failed at PAUSE_DEVICES with the plugin's reason, naming every `needle`, and the
/// process runs on.
fn refused(run: &CriuRun, pid: i32, node: &Path, needles: &[&str]) {
    run.assert_failed();
    let line = run
        .errors()
        .into_iter()
        .find(|l| l.contains(&format!("cuda: pid {pid} holds {}", node.display())))
        .unwrap_or_else(|| panic!("no refusal of pid {pid}: {run:?}"));
    for n in needles {
        assert!(line.contains(n), "{n:?} not in {line:?}");
    }
    assert!(
        matches!(common::state_of(pid), Some('S' | 'R')),
        "pid {pid} not running after the refused dump: {:?}",
        common::state_of(pid)
    );
}

#[test]
fn a_process_holding_an_nvidia_device_is_never_dumped_without_its_gpu_state() {
    let Some(f) = OneGpu::start("nv-unusable") else {
        return;
    };
    let node = NvidiaNode::create("unusable");
    let pid = holder(&f, &node.0);
    let tree = Tree::start(&f.e, "tree.out", &[]);
    let with = |key: &'static str, value: &str| {
        let mut env = f.env("calls");
        env.retain(|(k, _)| *k != key);
        env.push((key, value.to_string()));
        env
    };
    let config = f.e.dir().join("gpu-plugin.conf");
    std::fs::write(&config, b"cuda.parallel = yes\n\xff\xfe\n").unwrap();
    let cases: Vec<(&str, Env, Vec<String>)> = vec![
        (
            "libcuda",
            with("CRIU_GPU_LIBCUDA", "/nonexistent/libcuda.so.1"),
            vec!["libcuda = /nonexistent/libcuda.so.1 (environment CRIU_GPU_LIBCUDA)".into()],
        ),
        (
            "nvidia-proc",
            with("CRIU_GPU_CUDA_NVIDIA_PROC", "/dev/zero"),
            vec![
                "cuda.nvidia-proc = /dev/zero (environment CRIU_GPU_CUDA_NVIDIA_PROC) is not a directory"
                    .into(),
            ],
        ),
        (
            "settings-file",
            with("CRIU_GPU_PLUGIN_CONFIG", &config.display().to_string()),
            vec![
                "the settings file cannot be read".into(),
                config.display().to_string(),
            ],
        ),
    ];
    for (name, env, needles) in &cases {
        let images = f.e.images(&format!("img-{name}"));
        let dump = f.dump_into(&images, pid, &[], env);
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        refused(&dump, pid, &node.0, &needles);
        assert!(f.calls("calls").0.is_empty(), "{name}: driver calls");

        // The same bad setting does not fail a dump that needs no GPU.
        let images = f.e.images(&format!("img-plain-{name}"));
        let dump = f.dump_into(&images, tree.root, &["--leave-running"], env);
        dump.assert_ok();
    }
}

#[test]
fn no_library_is_loaded_from_the_image_directory() {
    let Some(f) = OneGpu::start("nv-cwd-library") else {
        return;
    };
    let marker_lib = marker_lib();
    let tree = Tree::start(&f.e, "tree.out", &[]);
    let marker = f.e.dir().join("loaded");
    // (libcuda, nvml) as the settings give them; CRIU runs in the image directory, which
    // holds the marker library under both names and in a `lib/` below it.
    let cases = [
        ("libcuda.so.1", None),
        ("lib/libcuda.so.1", None),
        ("./libcuda.so.1", None),
        (f.libcuda.to_str().unwrap(), Some("libnvidia-ml.so.1")),
        (f.libcuda.to_str().unwrap(), Some("lib/libnvidia-ml.so.1")),
    ];
    for (n, (libcuda, nvml)) in cases.iter().enumerate() {
        let images = f.e.images(&format!("img{n}"));
        plant(&marker_lib, &images);
        let mut env = f.env("calls");
        env.retain(|(k, _)| !matches!(*k, "CRIU_GPU_LIBCUDA" | "CRIU_GPU_NVML"));
        env.push(("CRIU_GPU_LIBCUDA", libcuda.to_string()));
        if let Some(nvml) = nvml {
            env.push(("CRIU_GPU_NVML", nvml.to_string()));
        }
        env.push(("GPU_PLUGIN_TEST_MARKER", marker.display().to_string()));
        let dump = f.dump_into(&images, tree.root, &["--leave-running"], &env);
        dump.assert_ok();
        assert!(
            !marker.exists(),
            "libcuda = {libcuda}, nvml = {nvml:?}: a library of the image directory was loaded: {dump:?}"
        );
        if libcuda.contains('/') && !libcuda.starts_with('/') {
            assert!(
                dump.has(&format!("libcuda = {libcuda} (environment CRIU_GPU_LIBCUDA): {libcuda} is a relative path")),
                "{dump:?}"
            );
        }
        if nvml.is_some_and(|v| v.contains('/')) {
            assert!(dump.has("is a relative path"), "{dump:?}");
        }
    }
}

/// An empty or relative entry in `LD_LIBRARY_PATH` (`/opt/x:`, as CUDA shell setups often
/// write it) makes the dynamic loader look for a bare name in the working directory, and CRIU
/// works in the image directory (it changes into it itself). The plugin searches absolute
/// directories only: the libraries planted among the images are never loaded, and the dump and
/// restore run as before, the stand-in driver and NVML found through an absolute entry of
/// `LD_LIBRARY_PATH` behind a relative and an empty one (dump), the driver through its
/// configured absolute path with a trailing `:` in `LD_LIBRARY_PATH` (restore; NVML's bare name
/// finds nothing there and the free-memory check is skipped, as without NVML).
#[test]
fn an_empty_library_path_entry_never_loads_a_library_from_the_image_directory() {
    let Some(f) = OneGpu::start("nv-empty-ld-path") else {
        return;
    };
    let marker = f.e.dir().join("loaded");
    let images = &f.images;
    plant(&marker_lib(), images);

    // The attack is real: a program in the image directory with such a path loads the planted
    // library when it asks the loader for the bare name.
    let probe = cc(
        "dlopen_name",
        &[fixture("e2e/dlopen_name.c"), "-ldl".into()],
    );
    let status =
        f.e.command(&probe)
            .arg("libcuda.so.1")
            .current_dir(images)
            .env("LD_LIBRARY_PATH", "/nonexistent:")
            .env("GPU_PLUGIN_TEST_MARKER", &marker)
            .status()
            .expect("run dlopen_name");
    assert!(
        status.success() && marker.exists(),
        "the loader did not take the planted library ({status}): this test would prove nothing"
    );
    std::fs::remove_file(&marker).unwrap();

    let w = f.workload(&["--mib", "8", "--children", "1"]);
    let lib = lib();
    let fake_dir = f.libcuda.parent().expect("the stand-in's directory");
    assert_eq!(
        f.nvml.parent(),
        Some(fake_dir),
        "libcuda and NVML side by side"
    );
    let env = |calls: &str, library_path: &str| {
        let mut env = f.env(calls);
        env.retain(|(k, _)| !matches!(*k, "CRIU_GPU_LIBCUDA" | "CRIU_GPU_NVML"));
        env.push(("LD_LIBRARY_PATH", library_path.to_string()));
        env.push(("GPU_PLUGIN_TEST_MARKER", marker.display().to_string()));
        env
    };

    let library_path = format!("lib::{}:", fake_dir.display());
    let dump = f.criu(
        &["dump", "-t", &w.root().to_string(), "-L", &lib, "-v4"],
        images,
        "dump.log",
        &env("dump.calls", &library_path),
    );
    assert!(
        !marker.exists(),
        "LD_LIBRARY_PATH={library_path}: a library of the image directory was loaded: {dump:?}"
    );
    dump.assert_ok();
    f.e.reap(&w.pids);
    dump.assert_no_plugin_errors();
    assert!(
        dump.has(&format!(
            "libcuda = libcuda.so.1 (default): loaded {}",
            f.libcuda.display()
        )),
        "{dump:?}"
    );
    assert!(!dump.has("GPU memory sizes unknown"), "NVML: {dump:?}");
    let nvml_log = std::fs::read_to_string(f.e.dir().join("nvml.log")).unwrap_or_default();
    assert!(
        nvml_log.contains("init pid="),
        "the stand-in NVML never answered"
    );
    let calls = f.calls("dump.calls");
    calls.assert_transitions(&w.pids, &["lock=0", "checkpoint=0"]);
    let marks = w.marks();

    let library_path = "/nonexistent:";
    let mut restore_env = env("restore.calls", library_path);
    restore_env.push(("CRIU_GPU_LIBCUDA", f.libcuda.display().to_string()));
    let restore = f.restore("restore.log", &restore_env);
    assert!(
        !marker.exists(),
        "LD_LIBRARY_PATH={library_path}: a library of the image directory was loaded: {restore:?}"
    );
    restore.assert_ok();
    restore.assert_no_plugin_errors();
    // Where this machine has no NVML of its own, the log says where it was looked for.
    let machine_nvml = Search {
        library_path: Some(library_path.as_ref()),
        secure: false,
        cache: LOADER_CACHE.as_ref(),
        system_dirs: SYSTEM_DIRS,
    }
    .find("libnvidia-ml.so.1");
    if machine_nvml.is_err() {
        assert!(
            restore.has(
                "GPU memory sizes unknown (libnvidia-ml.so.1 not found in LD_LIBRARY_PATH's absolute directories [/nonexistent] (empty or relative entries skipped: \"\")"
            ),
            "{restore:?}"
        );
    }
    let calls = f.calls("restore.calls");
    calls.assert_transitions(&w.pids, &["restore=0", "unlock=0"]);
    w.assert_all_running("after the restore");
    w.assert_continues(&marks);
}
