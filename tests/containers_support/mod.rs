//! Helpers of the container tests (`tests/e2e_containers.rs`): the runtimes' programs, commands
//! run to completion while this process reaps the containers orphaned to it, private mount
//! namespaces that put CRIU and plugin configuration in system places without touching the
//! system, the containers' root file system, the two workloads and what they write.
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

pub use mounts::PrivateMounts;

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

// ---- the containers' root file system -----------------------------------------------------

/// The stand-in CUDA driver, its NVML and the workload linked against it, built once.
pub struct FakeCuda {
    pub libcuda: PathBuf,
    pub nvml: PathBuf,
    pub workload: PathBuf,
    gpu_list: PathBuf,
}

pub fn fake_cuda() -> &'static FakeCuda {
    static F: OnceLock<FakeCuda> = OnceLock::new();
    F.get_or_init(|| {
        let b = fake_cuda_build();
        FakeCuda {
            libcuda: b.libcuda,
            nvml: b.nvml,
            workload: b.workload,
            gpu_list: b.gpu_list,
        }
    })
}

impl FakeCuda {
    /// (UUID, model) of each GPU of the fake under `FAKE_CUDA_GPUS=count`.
    pub fn gpus(&self, e: &E2e, count: u32) -> Vec<(String, String)> {
        let mut cmd = e.command(&self.gpu_list);
        cmd.env("FAKE_CUDA_DEVICE_DIR", e.dir().join("gpu-list-dev"))
            .env("FAKE_CUDA_GPUS", count.to_string());
        let run = run_tool(e.dir(), cmd, "gpu_list");
        run.assert_ok();
        let gpus: Vec<(String, String)> = run
            .stdout
            .lines()
            .filter_map(|l| {
                let (u, m) = l.split_once(' ')?;
                Some((u.to_string(), m.to_string()))
            })
            .collect();
        assert_eq!(gpus.len(), count as usize, "{}", run.stdout);
        gpus
    }

    /// (UUID, model) of the fake's one GPU.
    pub fn gpu(&self, e: &E2e) -> (String, String) {
        let mut cmd = e.command(&self.gpu_list);
        cmd.env("FAKE_CUDA_DEVICE_DIR", e.dir().join("gpu-list-dev"));
        let run = run_tool(e.dir(), cmd, "gpu_list");
        run.assert_ok();
        let line = run.stdout.lines().next().expect("one GPU").to_string();
        let (uuid, model) = line.split_once(' ').expect("`<uuid> <model>`");
        (uuid.to_string(), model.to_string())
    }
}

/// The libraries `ldd` says `bin` loads (the loader included), as absolute paths.
fn libraries_of(bin: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(bin).output().expect("run ldd");
    assert!(out.status.success(), "ldd {}: {out:?}", bin.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let p = match l.split_once("=>") {
                Some((_, rest)) => rest.trim().split(' ').next()?,
                None => l.split(' ').next()?,
            };
            p.starts_with('/').then(|| PathBuf::from(p))
        })
        .collect()
}

fn copy_into(root: &Path, from: &Path, to: &str) {
    let dst = root.join(to.trim_start_matches('/'));
    std::fs::create_dir_all(dst.parent().expect("parent")).expect("rootfs directory");
    std::fs::copy(from, &dst)
        .unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), dst.display()));
}

/// The containers' root file system, built once and shared (read-only in every container):
/// static busybox from its Debian package, the fake-CUDA workload with the fake driver and the
/// host libraries they load, and the mount points.
pub fn rootfs() -> &'static Path {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| {
        let root = build_dir().join("rootfs");
        let _ = std::fs::remove_dir_all(&root);
        copy_into(&root, &private_tool("busybox"), "/bin/busybox");
        for applet in ["sh", "echo", "cat", "sleep", "usleep", "true"] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))
                .expect("busybox link");
        }
        let f = fake_cuda();
        copy_into(&root, &f.workload, "/gpu/workload");
        copy_into(&root, &f.libcuda, "/gpu/libcuda.so.1");
        for bin in [&f.workload, &f.libcuda] {
            for lib in libraries_of(bin) {
                if lib.parent() != f.libcuda.parent() {
                    copy_into(&root, &lib, lib.to_str().expect("UTF-8 path"));
                }
            }
        }
        for d in ["proc", "dev", "out", "tmp", "etc"] {
            std::fs::create_dir_all(root.join(d)).expect("mount point");
        }
        root
    })
}

/// `rootfs()` as an uncompressed tar (for `podman import`).
pub fn rootfs_tar(e: &E2e) -> &'static Path {
    static T: OnceLock<PathBuf> = OnceLock::new();
    T.get_or_init(|| {
        let tar = build_dir().join("rootfs.tar");
        let mut cmd = e.command(Path::new("tar"));
        cmd.arg("-C").arg(rootfs()).arg("-cf").arg(&tar).arg(".");
        run_tool(e.dir(), cmd, "tar rootfs").assert_ok();
        tar
    })
}

// ---- the workloads ------------------------------------------------------------------------

/// The busybox loop of the counter container: one number per line, one more each time.
pub const COUNTER_LOOP: &str =
    "i=0; while :; do i=$((i + 1)); echo $i >> /out/counter; usleep 20000; done";

/// What a container runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// A shell loop counting into `/out/counter`.
    Counter,
    /// `workload.c` on the stand-in CUDA driver (8 MiB of patterned device memory, one busy
    /// thread), counting into `/out/w.1`; `hold_ms` is how long SIGUSR2 holds it busy.
    Cuda { hold_ms: u64 },
}

pub const CUDA: Workload = Workload::Cuda { hold_ms: 3000 };

impl Workload {
    pub fn args(self) -> Vec<String> {
        match self {
            Workload::Counter => vec!["/bin/sh".into(), "-c".into(), COUNTER_LOOP.into()],
            Workload::Cuda { hold_ms } => [
                "/gpu/workload",
                "--out",
                "/out/w",
                "--mib",
                "8",
                "--threads",
                "1",
                "--hold-ms",
                &hold_ms.to_string(),
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    pub fn env(self) -> Vec<String> {
        vec!["PATH=/bin".into(), "FAKE_CUDA_DEVICE_DIR=/out/dev".into()]
    }

    pub fn is_cuda(self) -> bool {
        matches!(self, Workload::Cuda { .. })
    }
}

/// The host side of a container's `/out`: what its workload writes.
pub struct Output {
    pub dir: PathBuf,
    pub workload: Workload,
}

impl Output {
    pub fn new(dir: PathBuf, workload: Workload) -> Output {
        std::fs::create_dir_all(dir.join("dev")).expect("output directory");
        Output { dir, workload }
    }

    fn file(&self) -> PathBuf {
        self.dir.join(match self.workload {
            Workload::Counter => "counter".to_string(),
            Workload::Cuda { .. } => format!("w.{INIT_PID}"),
        })
    }

    /// Complete lines so far.
    pub fn lines(&self) -> Vec<String> {
        let text = std::fs::read_to_string(self.file()).unwrap_or_default();
        let end = text.rfind('\n').map_or(0, |i| i + 1);
        text[..end].lines().map(str::to_owned).collect()
    }

    /// The counter values of `lines`.
    pub fn values_of(&self, lines: &[String]) -> Vec<u64> {
        lines
            .iter()
            .filter_map(|l| match self.workload {
                Workload::Counter => l.parse().ok(),
                Workload::Cuda { .. } => l.strip_prefix("counter ")?.parse().ok(),
            })
            .collect()
    }

    pub fn values(&self) -> Vec<u64> {
        self.values_of(&self.lines())
    }

    /// Waits until the counter has moved `n` more times.
    pub fn wait_counting(&self, n: usize) {
        let before = self.values().len();
        wait_until(
            format!(
                "{n} more counts in {} ({:?})",
                self.file().display(),
                self.tail()
            ),
            || {
                reap_now();
                self.values().len() >= before + n
            },
        );
    }

    pub fn tail(&self) -> Vec<String> {
        let l = self.lines();
        l[l.len().saturating_sub(4)..].to_vec()
    }

    /// A mark for [`Output::assert_continues`]: the number of lines now.
    pub fn mark(&self) -> usize {
        self.lines().len()
    }

    /// After a restore from an image taken when the container stopped: the counter goes on
    /// from its last value before `mark`, one by one.
    pub fn assert_continues(&self, mark: usize) {
        self.wait_counting(3);
        let lines = self.lines();
        let before = self.values_of(&lines[..mark]);
        let last = *before.last().expect("counted before the checkpoint");
        let all = self.values_of(&lines);
        let after = &all[before.len()..];
        assert_eq!(
            after.first().copied(),
            Some(last + 1),
            "last count before the checkpoint {last}, counts after the restore {:?}",
            &after[..after.len().min(5)]
        );
        assert_steps_by_one(&all);
    }

    /// After a restore from an image taken while the container kept running (between marks
    /// `low` and `high`, `killed` lines when it was killed): the first count after the restore
    /// is one the container had while it was dumped, and it goes on one by one from there.
    pub fn assert_resumes_between(&self, low: usize, high: usize, killed: usize) {
        self.wait_counting(3);
        let lines = self.lines();
        let lo = self.values_of(&lines[..low]).last().copied().unwrap_or(0);
        let hi = self.values_of(&lines[..high]).last().copied().unwrap_or(0);
        let after = self.values_of(&lines[killed..]);
        let first = after.first().copied().unwrap_or(0);
        assert!(
            lo < first && first <= hi + 1,
            "first count after the restore {first}, but the checkpoint was taken between {lo} \
             and {hi}"
        );
        assert_steps_by_one(&after);
    }

    /// The fake device files (`<pid>.<index>`) of the container's workload, sorted.
    pub fn device_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.dir.join("dev"))
            .map(|it| {
                it.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| n.starts_with(&format!("{INIT_PID}.")))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// After a dump that left the workload (host pid `pid`) running: it counts on and, on
    /// CUDA (`files`: its device files before), holds its device memory again, verified, the
    /// driver's calls for it (log `calls`) exactly a lock, checkpoint, restore and unlock.
    pub fn assert_given_back(&self, files: Option<&Vec<String>>, calls: &Path, pid: i32) {
        self.wait_counting(3);
        if let Some(files) = files {
            assert_eq!(&self.device_files(), files, "device memory not given back");
            assert_eq!(
                transitions(calls, pid),
                ["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
                "driver calls of the dump"
            );
            self.verify(pid);
        }
    }

    /// After a restore of the CUDA workload (`files`: its device files when dumped), now host
    /// pid `pid`: its device memory recreated and verified, the driver's last calls for it
    /// (log `calls`) a restore and an unlock.
    pub fn assert_gpu_restored(&self, files: &[String], calls: &Path, pid: i32) {
        assert_eq!(self.device_files(), files, "device memory not recreated");
        self.verify(pid);
        let t = transitions(calls, pid);
        assert!(
            t.ends_with(&["restore=0".to_string(), "unlock=0".to_string()]),
            "driver calls of the restore: {t:?}"
        );
    }

    /// SIGUSR1 to the CUDA workload (host pid `pid`); its new verdict must be "verify ok" (its
    /// device memory holds the pattern, the device counter did not go back).
    pub fn verify(&self, pid: i32) {
        let verdicts = || -> Vec<String> {
            self.lines()
                .into_iter()
                .filter(|l| l.starts_with("verify"))
                .collect()
        };
        let before = verdicts().len();
        assert!(common::signal(pid, libc::SIGUSR1), "SIGUSR1 to {pid}");
        wait_until(format!("pid {pid}: a verify verdict"), || {
            verdicts().len() > before
        });
        assert_eq!(verdicts()[before], "verify ok", "pid {pid}");
        let errors: Vec<String> = self
            .lines()
            .into_iter()
            .filter(|l| l.starts_with("cuda error"))
            .collect();
        assert!(errors.is_empty(), "pid {pid}: {errors:?}");
    }

    /// Waits for a line `line` of the workload.
    pub fn wait_line(&self, line: &str) {
        wait_until(format!("a line `{line}` ({:?})", self.tail()), || {
            self.lines().iter().any(|l| l == line)
        });
    }

    /// The workload has started: counting (and, on CUDA, its device memory allocated).
    pub fn wait_ready(&self) {
        if self.workload.is_cuda() {
            wait_until("the CUDA workload ready", || {
                reap_now();
                let lines = self.lines();
                let failed = lines.iter().find(|l| l.starts_with("cuda error"));
                // The stand-in driver names its socket after the pid the process sees: a
                // second process with that pid in another pid namespace of this network
                // namespace (another container on the stand-in) takes the name first.
                assert!(
                    failed.is_none(),
                    "the CUDA workload failed to start: {failed:?} (is another stand-in CUDA \
                     process running as pid {INIT_PID} of a pid namespace?)"
                );
                lines.iter().any(|l| l.starts_with("ready "))
            });
        }
        self.wait_counting(3);
    }
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
        format!(
            "cuda.nvidia-proc = {}\n",
            e.dir().join("no-nvidia-driver").display()
        )
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
