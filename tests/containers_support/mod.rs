//! Helpers of the container tests (`tests/e2e_containers.rs`): the runtimes' programs, commands
//! run to completion while this process reaps the containers orphaned to it, private mount
//! namespaces that put CRIU and plugin configuration in system places without touching the
//! system, the containers' root file system (`rootfs.rs`), the two workloads and what they write
//! (`workloads.rs`).
//!
//! - runc, Podman, conmon, containerd and ctr are Debian 12's (in the system); crun,
//!   checkpointctl and busybox come from `<repo>/.runtimes/` (both installed by
//!   `scripts/install-runtimes.sh`); today's runtimes of `tests/e2e_containers_2026.rs` from
//!   `<repo>/.runtimes-2026/` ([`tool_2026`], `scripts/install-runtimes-2026.sh`); CRIU is the
//!   one [`E2e`] found, put on `PATH` as `criu`, where every runtime looks for it.
//! - The test process is a child subreaper ([`E2e::start`]): a container's init is re-parented
//!   here once its runtime command exits. [`run_tool`] therefore reaps every child while it
//!   waits for one, and nothing here waits through `std::process::Child`.

pub mod cdi;
// Used by tests/e2e_cri.rs and tests/e2e_crio.rs only; every test binary compiles this module.
#[allow(dead_code)]
pub mod cri;
// Used by tests/e2e_crio.rs only.
#[allow(dead_code)]
pub mod crio;
pub mod cycles;
pub mod docker;
pub mod engines;
mod mounts;
pub mod oci;
pub mod pidns;
mod rootfs;
mod workloads;

pub use mounts::PrivateMounts;
pub use rootfs::*;
pub use workloads::*;

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::{self, E2e, REPO, build_dir, fake_cuda_build, wait_until};

/// How long one runtime command may take before it counts as hung.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(90);

/// The container's init as the workloads see it: every container has its own pid namespace.
pub const INIT_PID: i32 = 1;

// ---- programs -----------------------------------------------------------------------------

fn install_hint(what: &str) -> String {
    format!(
        "{what} is missing: run scripts/install-runtimes.sh (scripts/setup.sh does), or set \
         GPU_PLUGIN_SKIP_E2E=1 to skip the end-to-end tests"
    )
}

/// A program of the system (`/usr/sbin/runc`, ...); a panic saying how to install it if absent.
pub fn system_tool(name: &str) -> PathBuf {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{}", install_hint(name)))
}

/// `<repo>/.runtimes/bin/<name>`.
pub fn private_tool(name: &str) -> PathBuf {
    let p = Path::new(REPO).join(".runtimes/bin").join(name);
    assert!(p.exists(), "{}", install_hint(&p.display().to_string()));
    p
}

/// A program of today's runtimes: `$var` if set, else `<repo>/.runtimes-2026/<rel>`
/// (`scripts/install-runtimes-2026.sh`).
pub fn tool_2026(var: &str, rel: &str) -> PathBuf {
    let p = std::env::var_os(var).map_or_else(
        || Path::new(REPO).join(".runtimes-2026").join(rel),
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "{} is missing: run scripts/install-runtimes-2026.sh (scripts/setup.sh does), set {var}, \
         or set GPU_PLUGIN_SKIP_E2E=1 to skip the end-to-end tests",
        p.display()
    );
    p
}

/// The first line `program --version` prints (for a test's log).
pub fn version_line(program: &Path) -> String {
    Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .unwrap_or_else(|e| format!("{}: {e}", program.display()))
}

/// A directory holding `criu` (a link to the CRIU under test), first on every runtime's PATH.
fn criu_bin_dir(e: &E2e) -> PathBuf {
    let dir = build_dir().join("containers-bin");
    let link = dir.join("criu");
    if std::fs::read_link(&link).ok().as_deref() != Some(e.criu.as_path()) {
        std::fs::create_dir_all(&dir).expect("bin directory");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&e.criu, &link).expect("criu link");
    }
    dir
}

/// `PATH` for runtime commands: the CRIU under test, then `.runtimes/bin`, then the caller's.
pub fn tool_path(e: &E2e) -> OsString {
    let mut dirs = vec![criu_bin_dir(e), Path::new(REPO).join(".runtimes/bin")];
    if let Some(p) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&p));
    }
    std::env::join_paths(dirs).expect("PATH")
}

// ---- running commands ---------------------------------------------------------------------

/// One finished runtime command.
pub struct ToolRun {
    pub what: String,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

impl ToolRun {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    pub fn assert_ok(&self) -> &ToolRun {
        assert!(self.ok(), "{self:?}");
        self
    }
}

impl std::fmt::Debug for ToolRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: exit {:?} after {:?}",
            self.what, self.code, self.took
        )?;
        writeln!(f, "  stdout: {}", self.stdout.trim_end())?;
        write!(f, "  stderr: {}", self.stderr.trim_end())
    }
}

/// Reaps every child that has exited; returns the wait status of `want` if it was among them.
fn reap_children(want: i32) -> Option<i32> {
    let mut found = None;
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes one int through the valid pointer; WNOHANG never blocks.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if r <= 0 {
            return found;
        }
        if r == want {
            found = Some(status);
        }
    }
}

/// Reaps whatever has exited (containers killed by a runtime are this process's children).
pub fn reap_now() {
    reap_children(0);
}

/// Waits until `pid` is gone, reaping meanwhile; panics after [`common::WAIT`].
pub fn wait_gone(pid: i32, what: &str) {
    wait_until(format!("{what} (pid {pid}) gone"), || {
        reap_now();
        !common::exists(pid)
    });
}

/// Runs `cmd` to completion (stdin /dev/null, stdout and stderr captured through files under
/// `dir`), reaping every other child meanwhile. A command that hangs past [`TOOL_TIMEOUT`] is
/// killed with its process group and reported with no exit code. Never panics once the
/// command has started, so that guards can use it while a failed test unwinds.
pub fn run_tool(dir: &Path, cmd: Command, what: &str) -> ToolRun {
    run_tool_with(dir, cmd, what, true, TOOL_TIMEOUT)
}

/// [`run_tool`] with all stdio on /dev/null, for a command whose stdio a container inherits
/// (`runc run -d`, `runc restore -d`): CRIU cannot dump a host file as a container's stdio.
pub fn run_tool_detached(dir: &Path, cmd: Command, what: &str) -> ToolRun {
    run_tool_with(dir, cmd, what, false, TOOL_TIMEOUT)
}

/// [`run_tool`] with another time limit.
pub fn run_tool_for(dir: &Path, cmd: Command, what: &str, limit: Duration) -> ToolRun {
    run_tool_with(dir, cmd, what, true, limit)
}

/// [`run_tool`] for clean-up: a shorter limit.
pub fn run_cleanup(dir: &Path, cmd: Command, what: &str) -> ToolRun {
    run_tool_with(dir, cmd, what, true, Duration::from_secs(20))
}

fn run_tool_with(
    dir: &Path,
    mut cmd: Command,
    what: &str,
    capture: bool,
    limit: Duration,
) -> ToolRun {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let (out, err) = (
        dir.join(format!("tool-{n}.out")),
        dir.join(format!("tool-{n}.err")),
    );
    cmd.stdin(Stdio::null());
    let files = capture
        .then(|| {
            Some((
                std::fs::File::create(&out).ok()?,
                std::fs::File::create(&err).ok()?,
            ))
        })
        .flatten();
    match files {
        Some((o, e)) => cmd.stdout(o).stderr(e),
        None => cmd.stdout(Stdio::null()).stderr(Stdio::null()),
    };
    {
        use std::os::unix::process::CommandExt;
        // Its own group, so that a hung command goes with everything it started.
        cmd.process_group(0);
    }
    let started = Instant::now();
    let mut run = ToolRun {
        what: what.to_string(),
        code: None,
        stdout: String::new(),
        stderr: String::new(),
        took: Duration::ZERO,
    };
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            run.stderr = format!("cannot start: {e}");
            return run;
        }
    };
    let pid = child.id() as i32;
    // Waited for through waitpid(-1) below, never by std.
    drop(child);
    let status = loop {
        if let Some(st) = reap_children(pid) {
            break Some(st);
        }
        if started.elapsed() > limit {
            common::signal(-pid, libc::SIGKILL);
            let _ = common::reap_until_gone(&[pid], common::WAIT);
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    run.code = status.and_then(|st| libc::WIFEXITED(st).then(|| libc::WEXITSTATUS(st)));
    run.stdout = std::fs::read_to_string(&out).unwrap_or_default();
    run.stderr = std::fs::read_to_string(&err).unwrap_or_default();
    if status.is_none() {
        run.stderr += &format!("\n(killed: still running after {limit:?})");
    }
    run.took = started.elapsed();
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&err);
    eprintln!("{what}: exit {:?} in {:?}", run.code, run.took);
    run
}

/// `what` for messages: the program's name and arguments.
pub fn describe(argv: &[OsString]) -> String {
    argv.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

// ---- the plugin's settings ----------------------------------------------------------------

/// The test's `/etc/criu` (`<test dir>/etc-criu`, bound over `/etc/criu` by the runtimes'
/// private mounts) with CRIU configuration file `conf` (`runc.conf`, `crun.conf`...) loading
/// the plugin.
pub fn etc_criu_loading_plugin(e: &E2e, conf: &str) -> PathBuf {
    let dir = e.dir().join("etc-criu");
    std::fs::create_dir_all(&dir).expect("etc/criu");
    std::fs::write(
        dir.join(conf),
        format!("libdir {}\n", common::plugin_libdir().display()),
    )
    .expect("CRIU configuration");
    dir
}

/// [`etc_criu_loading_plugin`] with the plugin's settings for `workload` in it.
pub fn etc_criu(e: &E2e, workload: Workload, conf: &str) -> PathBuf {
    let dir = etc_criu_loading_plugin(e, conf);
    write_settings(e, workload, &dir.join("gpu-plugin.conf"));
    dir
}

/// The test's `/etc/criu` for a node whose CRIU finds the plugin in its built-in plugin
/// directory (`/usr/lib/criu`, where the package installs it): CRIU configuration file `conf`
/// without a `libdir`, and the plugin's settings for `workload`.
pub fn etc_criu_settings(e: &E2e, workload: Workload, conf: &str) -> PathBuf {
    let dir = e.dir().join("etc-criu");
    std::fs::create_dir_all(&dir).expect("etc/criu");
    std::fs::write(
        dir.join(conf),
        "# The plugin is found in /usr/lib/criu, CRIU's built-in plugin directory.\n",
    )
    .expect("CRIU configuration");
    write_settings(e, workload, &dir.join("gpu-plugin.conf"));
    dir
}

/// Skips (saying so) a CUDA test with a CRIU older than 4.2 where `why` needs 4.2.
pub fn needs_criu_4_2(e: &E2e, test: &str, workload: Workload, why: &str) -> bool {
    if workload.is_cuda() && e.criu_release().is_some_and(|v| v < (4, 2)) {
        eprintln!(
            "SKIPPED {test}: CRIU {:?} is older than 4.2, which {why}. Run with CRIU_BIN \
             pointing at CRIU 4.2 or newer.",
            e.criu_release()
        );
        return true;
    }
    false
}

/// The controllers of this system's cgroup v2 hierarchy (`/sys/fs/cgroup` on a v2-only system,
/// `/sys/fs/cgroup/unified` on a hybrid one): on a hybrid system only those no v1 hierarchy
/// holds.
pub fn cgroup2_controllers() -> Vec<String> {
    [
        "/sys/fs/cgroup/cgroup.controllers",
        "/sys/fs/cgroup/unified/cgroup.controllers",
    ]
    .iter()
    .find_map(|f| std::fs::read_to_string(f).ok())
    .map(|s| s.split_whitespace().map(String::from).collect())
    .unwrap_or_default()
}

/// Whether `test` must be skipped (saying so) because this system's cgroup v2 hierarchy lacks
/// a controller of `needed`, which `why`.
pub fn lacks_cgroup2_controllers(test: &str, needed: &[&str], why: &str) -> bool {
    let have = cgroup2_controllers();
    let missing: Vec<&str> = needed
        .iter()
        .copied()
        .filter(|c| !have.iter().any(|h| h == c))
        .collect();
    if missing.is_empty() {
        return false;
    }
    eprintln!(
        "SKIPPED {test}: this system's cgroup v2 hierarchy has the controllers {have:?}, not \
         {missing:?} ({why}); a cgroup-v2-only kernel has them: the guest of scripts/guest/ \
         runs this test"
    );
    true
}

/// The plugin's settings file for `workload`, written under the test's directory: on the fake
/// driver for CUDA (GPU list, NVML stand-in), else the NVIDIA side pointed at a driver directory
/// that does not exist, so the counter tests mean the same on a machine with an NVIDIA GPU.
pub fn write_settings(e: &E2e, workload: Workload, path: &Path) {
    let text = if workload.is_cuda() {
        let f = fake_cuda();
        let (uuid, model) = f.gpu(e);
        let nv = e.dir().join("nvidia-gpus");
        let bus = "0000:00:06.0";
        std::fs::create_dir_all(nv.join(bus)).expect("GPU list");
        std::fs::write(
            nv.join(bus).join("information"),
            format!(
                "Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nVideo BIOS: \t \
                 00.00.00.00.00\nBus Type: \t PCIe\nBus Location: \t {bus}\n"
            ),
        )
        .expect("GPU list");
        format!(
            "libcuda = {}\ncuda.nvidia-proc = {}\nnvml = {}\n",
            f.libcuda.display(),
            nv.display(),
            f.nvml.display()
        )
    } else {
        let mut text = format!(
            "cuda.nvidia-proc = {}\n",
            e.dir().join("no-nvidia-driver").display()
        );
        if workload.is_kfd() {
            // The stand-in KFD module makes no topology in sysfs: the fixture of its two GPUs.
            text += &format!(
                "amdgpu.topology = {}/tests/fixtures/kfd-topology/2gpu\n",
                common::REPO
            );
        }
        text
    };
    std::fs::create_dir_all(path.parent().expect("parent")).expect("settings directory");
    std::fs::write(path, text).expect("settings file");
}

/// Environment for runtime commands where it reaches CRIU: the fake driver's controller side
/// logs its calls to `calls` and gives up on a hung target instead of hanging the test.
pub fn fake_cuda_env(calls: &Path) -> Vec<(&'static str, OsString)> {
    vec![
        ("FAKE_CUDA_LOG", calls.as_os_str().to_owned()),
        ("FAKE_CUDA_CALL_TIMEOUT_MS", OsStr::new("15000").to_owned()),
    ]
}

/// The state-changing driver calls the fake logged to `calls` for `pid`, as "op=rc".
pub fn transitions(calls: &Path, pid: i32) -> Vec<String> {
    std::fs::read_to_string(calls)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let op = it.next()?;
            let p: i32 = it.next()?.strip_prefix("pid=")?.parse().ok()?;
            let rc = it.next()?.strip_prefix("result=")?;
            (p == pid && matches!(op, "lock" | "checkpoint" | "restore" | "unlock"))
                .then(|| format!("{op}={rc}"))
        })
        .collect()
}

// ---- CRIU's logs --------------------------------------------------------------------------

/// A runtime's CRIU run, as [`common::CriuRun`]: the runtime's exit and output, CRIU's log.
pub fn criu_run(run: &ToolRun, log: &Path) -> common::CriuRun {
    common::CriuRun {
        what: run.what.clone(),
        code: run.code,
        log: std::fs::read_to_string(log).unwrap_or_default(),
        output: format!("{}{}", run.stdout, run.stderr),
        took: run.took,
    }
}

/// A dump that succeeded with the plugin: loaded, no error of ours, and on CUDA the workload
/// (host pid `pid`) locked and checkpointed by the plugin.
pub fn assert_plugin_dumped(e: &E2e, run: &common::CriuRun, workload: Workload, pid: i32) {
    run.assert_ok();
    e.assert_plugin_loaded(run, "Dump");
    run.assert_no_plugin_errors();
    if workload.is_cuda() {
        assert!(
            run.log
                .lines()
                .any(|l| l.contains(&format!("gpu_plugin: cuda: pid {pid} "))
                    && l.contains("paused")),
            "pid {pid} not paused by the plugin: {run:?}"
        );
        assert!(
            run.has("gpu_plugin: cuda: checkpoint phase: 1 process(es)"),
            "{run:?}"
        );
    }
    if workload.is_kfd() {
        assert!(
            run.log
                .lines()
                .any(|l| l.contains("gpu_plugin: amdgpu: file") && l.contains("GPU queues paused")),
            "the plugin paused no KFD process: {run:?}"
        );
    }
}

/// A restore that succeeded with the plugin (on CUDA: the workload restored by it).
pub fn assert_plugin_restored(e: &E2e, run: &common::CriuRun, workload: Workload) {
    run.assert_ok();
    e.assert_plugin_loaded(run, "Restore");
    run.assert_no_plugin_errors();
    if workload.is_cuda() {
        assert!(
            run.has("gpu_plugin: cuda: restore phase: 1 process(es)"),
            "{run:?}"
        );
    }
    if workload.is_kfd() {
        for want in ["BO(s) restored", "GPU resumed"] {
            assert!(
                run.log
                    .lines()
                    .any(|l| l.contains("gpu_plugin: amdgpu: ") && l.contains(want)),
                "no `{want}` from the plugin: {run:?}"
            );
        }
    }
}

// ---- cgroups ------------------------------------------------------------------------------

/// A cgroup path of the test's own (`/criu-gpu-e2e-<pid>-<n>`), removed from every hierarchy on
/// drop, whatever the runtime left there.
pub struct Cgroup {
    pub path: String,
}

impl Cgroup {
    pub fn new() -> Cgroup {
        static N: AtomicUsize = AtomicUsize::new(0);
        Cgroup {
            path: format!(
                "/criu-gpu-e2e-{}-{}",
                common::owner_tag(),
                N.fetch_add(1, Ordering::Relaxed)
            ),
        }
    }
}

/// Removes `dir` and the directories below it, deepest first (cgroup directories go with
/// rmdir only, and only when empty).
fn rmdir_tree(dir: &Path) {
    if let Ok(it) = std::fs::read_dir(dir) {
        for e in it.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                rmdir_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let Ok(it) = std::fs::read_dir("/sys/fs/cgroup") else {
            return;
        };
        let rel = self.path.trim_start_matches('/');
        let mut hierarchies: Vec<PathBuf> = it.flatten().map(|e| e.path()).collect();
        // cgroup v2 mounted at /sys/fs/cgroup itself.
        hierarchies.push(PathBuf::from("/sys/fs/cgroup"));
        // A task that is still exiting keeps its cgroup busy for a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left: Vec<PathBuf> = hierarchies
                .iter()
                .map(|h| h.join(rel))
                .filter(|d| d.is_dir())
                .collect();
            left.iter().for_each(|d| rmdir_tree(d));
            if left.iter().all(|d| !d.is_dir()) || Instant::now() > deadline {
                return;
            }
            reap_now();
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Every count is one more than the one before.
fn assert_steps_by_one(counts: &[u64]) {
    for w in counts.windows(2) {
        assert_eq!(
            w[1],
            w[0] + 1,
            "the counter jumps from {} to {}",
            w[0],
            w[1]
        );
    }
}
