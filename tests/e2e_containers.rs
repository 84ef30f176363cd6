//! Containers checkpointed and restored by real container runtimes with the plugin loaded by
//! the CRIU they run: runc (the plugin found through `/etc/criu/runc.conf`,
//! `/etc/criu/default.conf`, CRIU's built-in `/usr/lib/criu`, and the `org.criu.config`
//! annotation), crun (`default.conf`, `/usr/lib/criu`: its libcriu cannot pass a configuration
//! file), Podman with runc (export and import of the checkpoint, read by checkpointctl) and
//! containerd with `ctr`. CRIU's logs are read where each runtime leaves them: runc's and
//! crun's `--work-path`, Podman's container directory (`--keep`), `ctr task checkpoint
//! --work-path` (containerd removes the logs of `ctr container checkpoint`/`restore`).
//!
//! containerd pauses (freezes) a task around every checkpoint; CRIU before 4.2 does not thaw
//! it for plugins, so there a CUDA task cannot be locked: the test then checks that the plugin
//! refuses with that reason and leaves the task running with its GPU.
//!
//! Each container has its own mount, pid and IPC namespaces but the host's network namespace
//! (the stand-in CUDA driver talks over abstract unix sockets, which are per network
//! namespace), stdio on /dev/null, and runs either a busybox counter loop or `workload.c` on the
//! stand-in CUDA driver (`tests/fixtures/fake-cuda`) with the stand-in NVML, whose init leaves
//! a thread behind as the real one does: CRIU's process must stay single-threaded for its
//! `setns()` into the container's mount namespace.
//!
//! Configuration in system places (`/etc/criu`, `/usr/lib/criu`) exists only in private mount
//! namespaces of the runtime commands (`containers_support::PrivateMounts`); runtimes keep their
//! state under the test's directory. Runtimes come from `scripts/install-runtimes.sh`; without
//! them these tests fail, unless `GPU_PLUGIN_SKIP_E2E=1`. They need root, and run one at a time.
//!
//! `runc_installed_plugin` checks an installed plugin (`CRIU_GPU_TEST_INSTALLED_PLUGIN`, the
//! path of e.g. `/usr/lib/criu/gpu_plugin.so`) through CRIU's built-in directory only; without
//! that variable it does nothing.

use criu_gpu_test_support as common;
// Some of the harness serves tests/e2e_containers_2026.rs only.
#[allow(dead_code)]
mod containers_support;

use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{E2e, plugin_libdir};
use containers_support::engines::{Containerd, Podman};
use containers_support::oci::{Oci, OciRuntime};
use containers_support::{
    CUDA, PrivateMounts, Workload, assert_plugin_dumped, cycles, fake_cuda_env, private_tool,
    transitions, write_settings,
};

/// How CRIU, started by the runtime, finds the plugin.
#[derive(Clone, Copy, Debug)]
enum Reach {
    /// `libdir` in `/etc/criu/runc.conf` (read by runc's CRIU only).
    RuncConf,
    /// `libdir` in `/etc/criu/default.conf` (read by every CRIU).
    DefaultConf,
    /// The plugin in CRIU's built-in directory, `/usr/lib/criu`.
    DefaultDir,
    /// A CRIU configuration file named by the container's `org.criu.config` annotation.
    Annotation,
    /// An installed plugin, already in `/usr/lib/criu`: no libdir anywhere.
    Installed,
}

/// What a test's runtime commands get for `reach`.
struct Setup {
    /// The test's `/etc/criu` (runc.conf, default.conf, gpu-plugin.conf as `reach` needs).
    etc_criu: PathBuf,
    mounts: PrivateMounts,
    annotations: Vec<(String, String)>,
    env: Vec<(&'static str, OsString)>,
    /// The plugin reads `/etc/criu/gpu-plugin.conf`, not the file E2e's commands name.
    system_settings: bool,
}

/// The plugin's directory, the settings and CRIU's configuration for `reach`; `criu_extra` are
/// more lines of CRIU configuration.
fn setup(e: &E2e, reach: Reach, workload: Workload, criu_extra: &str) -> Setup {
    let etc_criu = e.dir().join("etc-criu");
    std::fs::create_dir_all(&etc_criu).expect("etc/criu");
    let libdir = format!("libdir {}\n{criu_extra}", plugin_libdir().display());
    let mut s = Setup {
        etc_criu: etc_criu.clone(),
        mounts: PrivateMounts::new().bind(&etc_criu, "/etc/criu"),
        annotations: Vec::new(),
        env: Vec::new(),
        system_settings: true,
    };
    let config_in_env = |s: &mut Setup| {
        let settings = e.dir().join("gpu-plugin.conf");
        write_settings(e, workload, &settings);
        s.env.push(("CRIU_GPU_PLUGIN_CONFIG", settings.into()));
        s.system_settings = false;
    };
    match reach {
        Reach::RuncConf | Reach::DefaultConf => {
            let name = match reach {
                Reach::RuncConf => "runc.conf",
                _ => "default.conf",
            };
            std::fs::write(etc_criu.join(name), &libdir).expect("CRIU configuration");
            write_settings(e, workload, &etc_criu.join("gpu-plugin.conf"));
        }
        Reach::DefaultDir => {
            assert!(criu_extra.is_empty(), "no CRIU configuration file here");
            write_settings(e, workload, &etc_criu.join("gpu-plugin.conf"));
            s.mounts = s.mounts.bind(plugin_libdir(), "/usr/lib/criu");
        }
        Reach::Annotation => {
            // No system file at all: CRIU's configuration by annotation, the plugin's settings
            // through the environment (runc's reaches CRIU).
            let conf = e.dir().join("criu.conf");
            std::fs::write(&conf, &libdir).expect("CRIU configuration");
            s.annotations
                .push(("org.criu.config".into(), conf.display().to_string()));
            s.mounts = PrivateMounts::new();
            config_in_env(&mut s);
        }
        Reach::Installed => {
            // An empty /etc/criu: no libdir of the machine's either.
            assert!(criu_extra.is_empty(), "no CRIU configuration file here");
            config_in_env(&mut s);
        }
    }
    s
}

/// The way to reach the plugin that needs no system file where the runtime has one (runc's
/// annotation), else `default.conf` (crun's libcriu 4.1 cannot name a configuration file).
fn own_reach(kind: Oci) -> Reach {
    match kind {
        Oci::Runc => Reach::Annotation,
        Oci::Crun => Reach::DefaultConf,
    }
}

fn oci_runtime<'e>(e: &'e E2e, kind: Oci, s: &Setup) -> OciRuntime<'e> {
    let mut rt = OciRuntime::new(e, kind, s.mounts.clone());
    for (k, v) in s.env.iter().cloned().chain(fake_cuda_env(&calls(e))) {
        rt = rt.env(k, v);
    }
    if s.system_settings {
        rt = rt.unset("CRIU_GPU_PLUGIN_CONFIG");
    }
    rt
}

/// The fake driver's call log of the test (written where the environment reaches CRIU).
fn calls(e: &E2e) -> PathBuf {
    e.dir().join("cuda-calls")
}

// ---- runc and crun ------------------------------------------------------------------------

/// Checkpoint (the container goes), restore, the workload goes on where it was.
fn oci_cycle(e: &E2e, kind: Oci, reach: Reach, workload: Workload, name: &str) {
    let s = setup(e, reach, workload, "");
    let rt = oci_runtime(e, kind, &s);
    cycles::oci_checkpoint_restore(e, &rt, workload, &s.annotations, name, &calls(e), &|_| {});
}

fn oci_test(test: &str, kind: Oci, reach: Reach, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    oci_cycle(&e, kind, reach, workload, "c");
}

/// `--leave-running`: the container runs on with its GPU, and the image restores.
fn oci_leave_running(test: &str, kind: Oci, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let s = setup(&e, own_reach(kind), workload, "");
    let rt = oci_runtime(&e, kind, &s);
    cycles::oci_leave_running_restore(&e, &rt, workload, &s.annotations, &calls(&e), &|_| {});
}

/// A checkpoint that fails leaves the container running: for the counter, an external unix
/// socket (its peer is this test), which CRIU refuses; for CUDA, a GPU lock that times out
/// (the workload holds a busy section longer than CRIU's `timeout 2` lets the lock wait).
fn oci_failed_checkpoint(test: &str, kind: Oci, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let (workload, extra) = if workload.is_cuda() {
        (Workload::Cuda { hold_ms: 8000 }, "timeout 2\n")
    } else {
        (workload, "")
    };
    let s = setup(&e, own_reach(kind), workload, extra);
    let rt = oci_runtime(&e, kind, &s);
    let (peer, ours) = if workload.is_cuda() {
        (None, None)
    } else {
        let (a, b) = UnixStream::pair().expect("socketpair");
        (Some(a), Some(b))
    };
    let c = rt.start("c", workload, &s.annotations, peer.map(Into::into));
    let pid = c.pid();
    let files = workload.is_cuda().then(|| cycles::device_memory(&c.out));
    if workload.is_cuda() {
        assert!(common::signal(pid, libc::SIGUSR2), "SIGUSR2 to {pid}");
        c.out.wait_line("hold begin");
    }

    let dump = c.checkpoint(&e.images("img"), &e.dir().join("dump"), false);
    dump.assert_failed();
    e.assert_plugin_loaded(&dump, "Dump");
    let first = dump.first_error().unwrap_or_default();
    if workload.is_cuda() {
        dump.assert_lock_timed_out(Duration::from_secs(6));
        let t = transitions(&calls(&e), pid);
        assert!(
            t.len() == 1 && t[0].starts_with("lock=") && t[0] != "lock=0",
            "expected one failed lock: {t:?}"
        );
    } else {
        assert!(
            first.contains("External socket"),
            "CRIU should have refused the external unix socket first: {dump:?}"
        );
        dump.assert_no_plugin_errors();
    }
    assert_eq!(c.pid(), pid, "the container after the failed checkpoint");
    if let Some(files) = files {
        c.out.wait_line("hold end");
        assert_eq!(
            c.out.device_files(),
            files,
            "device memory after the failure"
        );
        c.out.verify(pid);
    }
    c.out.wait_counting(3);
    drop(ours);
}

#[test]
fn runc_counter_plugin_from_runc_conf() {
    oci_test(
        "runc-counter-runc-conf",
        Oci::Runc,
        Reach::RuncConf,
        Workload::Counter,
    );
}

#[test]
fn runc_cuda_plugin_from_runc_conf() {
    oci_test("runc-cuda-runc-conf", Oci::Runc, Reach::RuncConf, CUDA);
}

#[test]
fn runc_counter_plugin_from_default_conf() {
    oci_test(
        "runc-counter-default-conf",
        Oci::Runc,
        Reach::DefaultConf,
        Workload::Counter,
    );
}

#[test]
fn runc_cuda_plugin_from_default_conf() {
    oci_test(
        "runc-cuda-default-conf",
        Oci::Runc,
        Reach::DefaultConf,
        CUDA,
    );
}

#[test]
fn runc_counter_plugin_from_criu_default_dir() {
    oci_test(
        "runc-counter-default-dir",
        Oci::Runc,
        Reach::DefaultDir,
        Workload::Counter,
    );
}

#[test]
fn runc_cuda_plugin_from_criu_default_dir() {
    oci_test("runc-cuda-default-dir", Oci::Runc, Reach::DefaultDir, CUDA);
}

#[test]
fn runc_counter_plugin_from_criu_config_annotation() {
    oci_test(
        "runc-counter-annotation",
        Oci::Runc,
        Reach::Annotation,
        Workload::Counter,
    );
}

#[test]
fn runc_cuda_plugin_from_criu_config_annotation() {
    oci_test("runc-cuda-annotation", Oci::Runc, Reach::Annotation, CUDA);
}

#[test]
fn runc_counter_leave_running() {
    oci_leave_running("runc-counter-leave-running", Oci::Runc, Workload::Counter);
}

#[test]
fn runc_cuda_leave_running() {
    oci_leave_running("runc-cuda-leave-running", Oci::Runc, CUDA);
}

#[test]
fn runc_counter_failed_checkpoint_leaves_it_running() {
    oci_failed_checkpoint("runc-counter-failed", Oci::Runc, Workload::Counter);
}

#[test]
fn runc_cuda_failed_checkpoint_leaves_it_running() {
    oci_failed_checkpoint("runc-cuda-failed", Oci::Runc, CUDA);
}

#[test]
fn crun_counter_plugin_from_default_conf() {
    oci_test(
        "crun-counter-default-conf",
        Oci::Crun,
        Reach::DefaultConf,
        Workload::Counter,
    );
}

#[test]
fn crun_cuda_plugin_from_default_conf() {
    oci_test(
        "crun-cuda-default-conf",
        Oci::Crun,
        Reach::DefaultConf,
        CUDA,
    );
}

#[test]
fn crun_counter_plugin_from_criu_default_dir() {
    oci_test(
        "crun-counter-default-dir",
        Oci::Crun,
        Reach::DefaultDir,
        Workload::Counter,
    );
}

#[test]
fn crun_cuda_plugin_from_criu_default_dir() {
    oci_test("crun-cuda-default-dir", Oci::Crun, Reach::DefaultDir, CUDA);
}

#[test]
fn crun_cuda_leave_running() {
    oci_leave_running("crun-cuda-leave-running", Oci::Crun, CUDA);
}

#[test]
fn crun_cuda_failed_checkpoint_leaves_it_running() {
    oci_failed_checkpoint("crun-cuda-failed", Oci::Crun, CUDA);
}

/// The plugin installed on this machine (`CRIU_GPU_TEST_INSTALLED_PLUGIN`, in CRIU's built-in
/// directory), with no libdir anywhere: runc checkpoints and restores the counter and the CUDA
/// container with it.
#[test]
fn runc_installed_plugin() {
    let Some(plugin) = std::env::var_os("CRIU_GPU_TEST_INSTALLED_PLUGIN") else {
        eprintln!(
            "runc_installed_plugin: CRIU_GPU_TEST_INSTALLED_PLUGIN is not set (the path of an \
             installed plugin, e.g. /usr/lib/criu/gpu_plugin.so); nothing to check"
        );
        return;
    };
    let Some(e) = E2e::start("runc-installed") else {
        return;
    };
    let plugin = PathBuf::from(plugin);
    assert!(plugin.is_file(), "{} is not a file", plugin.display());
    assert_eq!(
        plugin.parent(),
        Some(Path::new("/usr/lib/criu")),
        "the installed plugin must be in CRIU's built-in plugin directory"
    );
    oci_cycle(
        &e,
        Oci::Runc,
        Reach::Installed,
        Workload::Counter,
        "counter",
    );
    oci_cycle(&e, Oci::Runc, Reach::Installed, CUDA, "cuda");
}

// ---- Podman -------------------------------------------------------------------------------

fn podman_cycle(test: &str, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    // runc (which Podman runs) reads runc.conf; the plugin reads /etc/criu/gpu-plugin.conf,
    // since Podman need not pass its environment on.
    let s = setup(&e, Reach::RuncConf, workload, "");
    let pm = Podman::new(&e, &s.etc_criu);
    cycles::podman_export_import(&e, &pm, workload, &private_tool("checkpointctl"));
}

#[test]
fn podman_counter_export_and_import() {
    podman_cycle("podman-counter", Workload::Counter);
}

#[test]
fn podman_cuda_export_and_import() {
    podman_cycle("podman-cuda", CUDA);
}

// ---- containerd ---------------------------------------------------------------------------

fn containerd_cycle(test: &str, workload: Workload) {
    let Some(e) = E2e::start(test) else {
        return;
    };
    let s = setup(&e, Reach::RuncConf, workload, "");
    let cd = Containerd::start(&e, &s.etc_criu, &fake_cuda_env(&calls(&e)));
    cd.import_image();
    let c = cd.start_container("c", workload);
    let pid = c.running_pid();
    let files = workload.is_cuda().then(|| cycles::device_memory(&c.out));

    // `ctr task checkpoint` keeps CRIU's log (in its work path) and leaves the task running.
    let dump = c.task_checkpoint(&e.images("task-img"), &e.dir().join("task-dump"));
    if workload.is_cuda() && e.criu_release().is_some_and(|v| v < (4, 2)) {
        // containerd freezes the task's cgroup around every checkpoint, and CRIU before 4.2
        // does not thaw it for plugins: the GPU cannot be locked, the plugin must say so and
        // leave the task running with its GPU.
        dump.assert_failed();
        let first = dump.first_error().unwrap_or_default();
        assert!(
            first.contains("gpu_plugin") && first.contains("frozen cgroup"),
            "the first error must be the plugin's refusal of the frozen cgroup: {dump:?}"
        );
        assert_eq!(
            c.running_pid(),
            pid,
            "the task after the refused checkpoint"
        );
        c.out.wait_counting(3);
        assert_eq!(
            c.out.device_files(),
            files.unwrap_or_default(),
            "device memory"
        );
        c.out.verify(pid);
        return;
    }
    assert_plugin_dumped(&e, &dump, workload, pid);
    assert_eq!(c.running_pid(), pid, "the task after its checkpoint");
    if let Some(files) = &files {
        assert_eq!(&c.out.device_files(), files, "device memory not given back");
        c.out.verify(pid);
    }

    // The container's checkpoint image (the task keeps running), the container gone, restored.
    c.checkpoint_remove_restore("localhost/criu-gpu-e2e-checkpoint:1", files, &calls(&e));
}

#[test]
fn containerd_counter_checkpoint_and_restore() {
    containerd_cycle("containerd-counter", Workload::Counter);
}

/// With CRIU before 4.2: refused for the frozen cgroup, the task left running (see the top).
#[test]
fn containerd_cuda_checkpoint_and_restore() {
    containerd_cycle("containerd-cuda", CUDA);
}
