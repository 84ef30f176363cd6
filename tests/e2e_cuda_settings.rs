//! Settings that keep the NVIDIA side from running, against real CRIU and the stand-in driver
//! (`common::fake_cuda`): a dump of a process that holds an NVIDIA device fails, naming the
//! key and where its value came from, and leaves the process running; a process without one
//! still dumps. And no library is ever loaded from CRIU's working directory (the image
//! directory), whatever `libcuda` and `nvml` say.
//!
//! "Holds an NVIDIA device" is what the plugin reads from `/proc/PID/fd` and `/proc/PID/maps`:
//! a path under `/dev/nvidia`. The stand-in driver opens no such device, so the process here
//! holds a file `/dev/nvidia-gpu-plugin-test-*` open (root may create one in devtmpfs).
//!
//! Needs root, `cc` and CRIU as `tests/e2e_cuda_fake.rs` does.

mod common;

use std::path::{Path, PathBuf};

use common::fake_cuda::*;
use common::{CriuRun, Tree, cc};

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
    let Some(f) = Fake::start("nv-unusable") else {
        return;
    };
    let gpu = &f.gpus(1, 0)[0];
    let nv = one_gpu(&f, "nv", "0000:00:06.0", &gpu.model, gpu);
    let node = NvidiaNode::create("unusable");
    let pid = holder(&f, &node.0);
    let tree = Tree::start(&f.e, "tree.out", &[]);
    let lib = lib();
    let with = |key: &'static str, value: &str| {
        let mut env = f.env(&nv, "calls");
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
        let dump = f.criu(
            &["dump", "-t", &pid.to_string(), "-L", &lib, "-v4"],
            &images,
            "dump.log",
            env,
        );
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        refused(&dump, pid, &node.0, &needles);
        assert!(f.calls("calls").0.is_empty(), "{name}: driver calls");

        // The same bad setting does not fail a dump that needs no GPU.
        let images = f.e.images(&format!("img-plain-{name}"));
        let dump = f.criu(
            &[
                "dump",
                "-t",
                &tree.root.to_string(),
                "--leave-running",
                "-L",
                &lib,
                "-v4",
            ],
            &images,
            "dump.log",
            env,
        );
        dump.assert_ok();
    }
}

#[test]
fn no_library_is_loaded_from_the_image_directory() {
    let Some(f) = Fake::start("nv-cwd-library") else {
        return;
    };
    let gpu = &f.gpus(1, 0)[0];
    let nv = one_gpu(&f, "nv", "0000:00:06.0", &gpu.model, gpu);
    let marker_lib = cc(
        "marker_lib.so",
        &[
            "-shared".into(),
            "-fPIC".into(),
            format!(
                "{}/tests/fixtures/e2e/marker_lib.c",
                env!("CARGO_MANIFEST_DIR")
            ),
        ],
    );
    let tree = Tree::start(&f.e, "tree.out", &[]);
    let lib = lib();
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
        std::fs::create_dir_all(images.join("lib")).unwrap();
        for name in [
            "libcuda.so.1",
            "lib/libcuda.so.1",
            "libnvidia-ml.so.1",
            "lib/libnvidia-ml.so.1",
        ] {
            std::fs::copy(&marker_lib, images.join(name)).unwrap();
        }
        let mut env = f.env(&nv, "calls");
        env.retain(|(k, _)| !matches!(*k, "CRIU_GPU_LIBCUDA" | "CRIU_GPU_NVML"));
        env.push(("CRIU_GPU_LIBCUDA", libcuda.to_string()));
        if let Some(nvml) = nvml {
            env.push(("CRIU_GPU_NVML", nvml.to_string()));
        }
        env.push(("GPU_PLUGIN_TEST_MARKER", marker.display().to_string()));
        let dump = f.criu(
            &[
                "dump",
                "-t",
                &tree.root.to_string(),
                "--leave-running",
                "-L",
                &lib,
                "-v4",
            ],
            &images,
            "dump.log",
            &env,
        );
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
