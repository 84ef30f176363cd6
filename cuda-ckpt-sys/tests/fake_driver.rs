//! Drives [`cuda_ckpt_sys::Driver`] against the stand-in driver in `tests/fixtures/fake-cuda`
//! (compiled here with `cc`; skipped when there is no C compiler).
//!
//! Everything runs in ONE test function: the fake reads its controller settings from this
//! process's environment, which the scenarios change one after another.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use cuda_ckpt_sys::{CUresult, Driver, DriverError, GpuPair, GpuUuid, ProcessState};

const WAIT: Duration = Duration::from_secs(20);

/// Sets or clears a variable the fake driver reads in this process.
fn set_env(key: &str, value: Option<&str>) {
    // SAFETY: this test binary has a single #[test] function and spawns no threads of its own, so
    // nothing reads or writes the environment concurrently; the fake driver reads it from this
    // same thread during the calls that follow.
    unsafe {
        match value {
            Some(v) => std::env::set_var(key, v),
            None => std::env::remove_var(key),
        }
    }
}

/// Temporary directories, removed on drop.
struct Dirs {
    build: PathBuf,
    devices: PathBuf,
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.build);
        let _ = fs::remove_dir_all(&self.devices);
    }
}

fn unique_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("cuda-ckpt-sys-fake-{}-{nanos}", std::process::id())
}

fn fixture_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/fake-cuda")
}

/// Compiles the fake library and the workload; `None` when `cc` is missing.
fn build() -> Option<Dirs> {
    if Command::new("cc").arg("--version").output().is_err() {
        return None;
    }
    let name = unique_name();
    let shm = Path::new("/dev/shm");
    let dirs = Dirs {
        build: std::env::temp_dir().join(&name),
        devices: if shm.is_dir() {
            shm.join(&name)
        } else {
            std::env::temp_dir().join(format!("{name}-dev"))
        },
    };
    fs::create_dir_all(&dirs.build).unwrap();
    let src = fixture_src();
    let run = |cmd: &mut Command| {
        let out = cmd.output().expect("run cc");
        assert!(
            out.status.success(),
            "{cmd:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
        .arg(dirs.build.join("libcuda.so.1"))
        .arg(src.join("fake_libcuda.c"))
        .arg(src.join("fake_cuda_runtime.c"))
        .arg(src.join("fake_cuda_controller.c"))
        .arg(src.join("gpu_nodes.c"))
        .arg("-lpthread"));
    run(Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(dirs.build.join("workload"))
        .arg(src.join("workload.c"))
        .arg(format!("-L{}", dirs.build.display()))
        .args([
            "-l:libcuda.so.1",
            "-Wl,-rpath,$ORIGIN",
            "-Wl,--disable-new-dtags",
            "-lpthread",
        ]));
    Some(dirs)
}

/// A running workload process tree; SIGKILLed on drop (children die with the parent).
struct Workload {
    child: Child,
    pid: i32,
    out: PathBuf,
}

impl Workload {
    fn start(dirs: &Dirs, tag: &str, args: &[&str]) -> Self {
        Self::start_with(dirs, tag, args, false)
    }

    /// `detached`: own session, all stdio on /dev/null (what CRIU wants of a dump tree's root).
    fn start_with(dirs: &Dirs, tag: &str, args: &[&str], detached: bool) -> Self {
        let out = dirs.build.join(format!("out-{tag}"));
        let mut cmd = Command::new(dirs.build.join("workload"));
        cmd.arg("--out")
            .arg(&out)
            .args(args)
            .env("FAKE_CUDA_DEVICE_DIR", &dirs.devices)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if detached {
                Stdio::null()
            } else {
                Stdio::inherit()
            });
        if detached {
            // SAFETY: the closure runs in the forked child before exec and only calls setsid(2),
            // which is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    libc::setsid();
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().expect("start workload");
        let pid = child.id() as i32;
        let w = Self { child, pid, out };
        w.wait_line(pid, |l| l.starts_with("ready "));
        w
    }

    fn lines(&self, pid: i32) -> Vec<String> {
        let path = PathBuf::from(format!("{}.{pid}", self.out.display()));
        fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn wait_line(&self, pid: i32, pred: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            if let Some(l) = self.lines(pid).into_iter().find(|l| pred(l)) {
                return l;
            }
            assert!(
                t0.elapsed() < WAIT,
                "pid {pid}: expected line not written; got {:?}",
                self.lines(pid)
            );
            sleep(Duration::from_millis(10));
        }
    }

    fn counter(&self, pid: i32) -> u64 {
        self.lines(pid)
            .iter()
            .rev()
            .find_map(|l| l.strip_prefix("counter ")?.parse().ok())
            .unwrap_or(0)
    }

    fn assert_counting(&self, pid: i32) {
        let c0 = self.counter(pid);
        let t0 = Instant::now();
        while self.counter(pid) <= c0 + 2 {
            assert!(t0.elapsed() < WAIT, "pid {pid}: counter stuck at {c0}");
            sleep(Duration::from_millis(10));
        }
    }

    fn assert_frozen(&self, pid: i32) {
        sleep(Duration::from_millis(60));
        let c0 = self.counter(pid);
        sleep(Duration::from_millis(200));
        assert_eq!(
            self.counter(pid),
            c0,
            "pid {pid}: counter moved while locked"
        );
    }

    /// SIGUSR1 and wait for a new verification verdict.
    fn verify(&self, pid: i32) {
        let before = self
            .lines(pid)
            .iter()
            .filter(|l| l.starts_with("verify"))
            .count();
        signal(pid, libc::SIGUSR1);
        let t0 = Instant::now();
        loop {
            let verdicts: Vec<String> = self
                .lines(pid)
                .into_iter()
                .filter(|l| l.starts_with("verify"))
                .collect();
            if verdicts.len() > before {
                assert_eq!(verdicts[before], "verify ok", "pid {pid}");
                return;
            }
            assert!(t0.elapsed() < WAIT, "pid {pid}: no verify verdict");
            sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is a process this test started.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

fn code<T: std::fmt::Debug>(r: cuda_ckpt_sys::Result<T>) -> CUresult {
    match r {
        Err(DriverError::Cuda(e)) => e.code,
        other => panic!("expected a CUDA error, got {other:?}"),
    }
}

fn device_files(dirs: &Dirs, pid: i32) -> Vec<String> {
    let prefix = format!("{pid}.");
    let mut v: Vec<String> = fs::read_dir(&dirs.devices)
        .map(|it| {
            it.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn maps_device_files(dirs: &Dirs, pid: i32) -> bool {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    maps.contains(dirs.devices.to_str().unwrap())
}

fn comm(pid: i32, tid: i32) -> String {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn task_state(pid: i32, tid: i32) -> char {
    let stat = fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .unwrap_or('?')
}

fn full_cycle(driver: &Driver, w: &Workload, dirs: &Dirs, pid: i32) {
    let files = device_files(dirs, pid);
    assert!(!files.is_empty(), "pid {pid} has no device files");
    driver.lock(pid, 5000).unwrap();
    assert_eq!(driver.process_state(pid).unwrap(), ProcessState::Locked);
    w.assert_frozen(pid);
    driver.checkpoint(pid).unwrap();
    assert_eq!(
        driver.process_state(pid).unwrap(),
        ProcessState::Checkpointed
    );
    assert!(device_files(dirs, pid).is_empty(), "device files left");
    assert!(!maps_device_files(dirs, pid), "device files still mapped");
    driver.restore(pid, &[]).unwrap();
    assert_eq!(driver.process_state(pid).unwrap(), ProcessState::Locked);
    assert_eq!(device_files(dirs, pid), files);
    assert!(maps_device_files(dirs, pid));
    driver.unlock(pid).unwrap();
    assert_eq!(driver.process_state(pid).unwrap(), ProcessState::Running);
    w.assert_counting(pid);
    w.verify(pid);
}

/// `$CRIU`, else the workspace's `.criu/bin/criu`, if running as root and `criu check` passes.
fn criu() -> Option<PathBuf> {
    let path = std::env::var_os("CRIU")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.criu/bin/criu"));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !path.exists() {
        return None;
    }
    let ok = Command::new(&path)
        .arg("check")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(path)
}

fn run_criu(criu: &Path, args: &[&str], images: &Path, log: &str) {
    let status = Command::new(criu)
        .args(args)
        .arg("-D")
        .arg(images)
        .args(["-v4", "-o", log])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run criu");
    let text = fs::read_to_string(images.join(log)).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(30).collect();
    assert!(status.success(), "criu {args:?} failed: {tail:#?}");
}

/// Lock + checkpoint through the driver, CRIU dump (kills the process), remove every device file,
/// CRIU restore, then driver restore + unlock: the restored restore thread must answer and the
/// device memory must come back bit-exact from the image.
fn criu_round_trip(driver: &Driver, dirs: &Dirs, criu: &Path) {
    let mut w = Workload::start_with(
        dirs,
        "criu",
        &["--mib", "16", "--chunk-mib", "5", "--threads", "2"],
        true,
    );
    let pid = w.pid;
    let tid = driver.restore_thread_id(pid).unwrap();
    driver.lock(pid, 5000).unwrap();
    driver.checkpoint(pid).unwrap();
    let images = dirs.build.join("criu-images");
    fs::create_dir_all(&images).unwrap();
    run_criu(criu, &["dump", "-t", &pid.to_string()], &images, "dump.log");
    let _ = w.child.wait();
    assert!(device_files(dirs, pid).is_empty());
    let before = w.counter(pid);
    run_criu(criu, &["restore", "-d"], &images, "restore.log");
    assert_eq!(
        driver.process_state(pid).unwrap(),
        ProcessState::Checkpointed
    );
    assert_eq!(driver.restore_thread_id(pid).unwrap(), tid);
    driver.restore(pid, &[]).unwrap();
    assert_eq!(device_files(dirs, pid).len(), 5, "counter + 4 chunks");
    driver.unlock(pid).unwrap();
    w.assert_counting(pid);
    assert!(w.counter(pid) > before);
    w.verify(pid);
    eprintln!("CRIU section: dump, restore and driver restore of pid {pid} verified");
    signal(pid, libc::SIGKILL);
    // SAFETY: waitpid writes no status (NULL); the restored process was reparented to this
    // subreaper when `criu restore -d` exited.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
}

#[test]
fn fake_driver_end_to_end() {
    let Some(dirs) = build() else {
        eprintln!("SKIPPED: no C compiler (`cc`) to build the fake libcuda.so.1");
        return;
    };
    let log = dirs.build.join("calls.log");
    set_env("FAKE_CUDA_LOG", Some(log.to_str().unwrap()));
    set_env("FAKE_CUDA_CALL_TIMEOUT_MS", Some("10000"));
    for k in [
        "FAKE_CUDA_FAIL",
        "FAKE_CUDA_DRIVER_VERSION",
        "FAKE_CUDA_GPUS",
        "FAKE_CUDA_GPU_UUID_SEED",
        "FAKE_CUDA_RESTORE_NEEDS_INIT",
    ] {
        set_env(k, None);
    }

    let driver = Driver::open(dirs.build.join("libcuda.so.1")).expect("open fake driver");
    assert!(driver.has_checkpoint_api());
    assert_eq!(driver.check_checkpoint_support().unwrap(), 13000);
    assert_eq!(
        driver.error_name(CUresult::ILLEGAL_STATE).as_deref(),
        Some("CUDA_ERROR_ILLEGAL_STATE")
    );
    let devices = driver.devices().unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].name, "Fake GPU");
    assert!(devices[0].total_mem > 0);
    let gpu = devices[0].uuid;
    assert_eq!(gpu.to_string().parse::<GpuUuid>().unwrap(), gpu);

    // --- processes that are not CUDA targets
    let mut plain = Command::new("sleep").arg("30").spawn().unwrap();
    let plain_pid = plain.id() as i32;
    assert_eq!(
        code(driver.restore_thread_id(plain_pid)),
        CUresult::NOT_INITIALIZED
    );
    assert_eq!(
        code(driver.process_state(plain_pid)),
        CUresult::NOT_INITIALIZED
    );
    let _ = plain.kill();
    let _ = plain.wait();
    // As with the real driver, cuInit (done by devices()) made this process a target too.
    let me = std::process::id() as i32;
    let my_tid = driver.restore_thread_id(me).unwrap();
    assert!(comm(me, my_tid).starts_with("cuda"));
    assert_eq!(driver.process_state(me).unwrap(), ProcessState::Running);
    let mut gone = Command::new("true").spawn().unwrap();
    let gone_pid = gone.id() as i32;
    gone.wait().unwrap();
    assert_eq!(
        code(driver.restore_thread_id(gone_pid)),
        CUresult::OPERATING_SYSTEM
    );
    assert_eq!(code(driver.lock(gone_pid, 100)), CUresult::OPERATING_SYSTEM);

    // --- the basic cycle, restore thread identity
    let w = Workload::start(
        &dirs,
        "main",
        &[
            "--mib",
            "8",
            "--chunk-mib",
            "3",
            "--threads",
            "2",
            "--hold-ms",
            "3000",
        ],
    );
    let pid = w.pid;
    assert_eq!(driver.process_state(pid).unwrap(), ProcessState::Running);
    let tid = driver.restore_thread_id(pid).unwrap();
    assert_ne!(tid, pid);
    let name = comm(pid, tid);
    assert!(
        name.len() == 15
            && name.starts_with("cuda")
            && name[4..].chars().all(|c| c.is_ascii_hexdigit()),
        "restore thread comm {name:?}"
    );
    // The context's event thread also starts with "cuda" but is not the restore thread.
    let evt = fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok()?.parse::<i32>().ok())
        .find(|&t| comm(pid, t) == "cuda-EvtHandlr");
    assert!(evt.is_some_and(|t| t != tid), "no cuda-EvtHandlr thread");
    // A TID stands for its process.
    assert_eq!(driver.restore_thread_id(tid).unwrap(), tid);
    assert_eq!(driver.process_state(tid).unwrap(), ProcessState::Running);
    assert_eq!(
        device_files(&dirs, pid).len(),
        4,
        "counter + 3 pattern chunks"
    );
    full_cycle(&driver, &w, &dirs, pid);

    // --- illegal transitions
    let e = driver.checkpoint(pid).unwrap_err();
    assert_eq!(e.cuda_code(), Some(CUresult::ILLEGAL_STATE));
    assert_eq!(
        e.to_string(),
        format!(
            "cuCheckpointProcessCheckpoint(pid {pid}) failed: CUDA_ERROR_ILLEGAL_STATE (401): \
             the operation cannot be performed in the present state"
        )
    );
    assert_eq!(e.errno(), libc::EINVAL);
    assert_eq!(code(driver.unlock(pid)), CUresult::ILLEGAL_STATE);
    assert_eq!(code(driver.restore(pid, &[])), CUresult::ILLEGAL_STATE);
    driver.lock(pid, 1000).unwrap();
    assert_eq!(code(driver.lock(pid, 1000)), CUresult::ILLEGAL_STATE);
    assert_eq!(code(driver.restore(pid, &[])), CUresult::ILLEGAL_STATE);
    driver.checkpoint(pid).unwrap();
    assert_eq!(code(driver.checkpoint(pid)), CUresult::ILLEGAL_STATE);
    assert_eq!(code(driver.unlock(pid)), CUresult::ILLEGAL_STATE);
    assert_eq!(code(driver.lock(pid, 1000)), CUresult::ILLEGAL_STATE);

    // --- GPU pairs (process is CHECKPOINTED here)
    let other: GpuUuid = "GPU-00000000-1111-2222-3333-444444444444".parse().unwrap();
    set_env("FAKE_CUDA_DRIVER_VERSION", Some("12080"));
    assert!(matches!(
        driver.restore(pid, &[GpuPair { old: gpu, new: gpu }]),
        Err(DriverError::Unsupported {
            required: 13000,
            found: 12080,
            ..
        })
    ));
    set_env("FAKE_CUDA_DRIVER_VERSION", None);
    assert_eq!(
        code(driver.restore(
            pid,
            &[GpuPair {
                old: other,
                new: gpu
            }]
        )),
        CUresult::INVALID_VALUE,
        "unknown old GPU"
    );
    assert_eq!(
        code(driver.restore(
            pid,
            &[GpuPair {
                old: gpu,
                new: other
            }]
        )),
        CUresult::INVALID_VALUE,
        "new GPU not present"
    );
    assert_eq!(
        driver.process_state(pid).unwrap(),
        ProcessState::Checkpointed
    );
    driver
        .restore(pid, &[GpuPair { old: gpu, new: gpu }])
        .unwrap();
    let pairs_file = dirs.devices.join(format!("restore-pairs.{pid}"));
    assert_eq!(
        fs::read_to_string(&pairs_file).unwrap(),
        format!("{gpu} {gpu}\n")
    );
    driver.unlock(pid).unwrap();
    w.verify(pid);
    // Migration: the controller's GPU is now a different one; afterwards the process runs there.
    set_env("FAKE_CUDA_GPU_UUID_SEED", Some("7"));
    let gpu2 = driver.devices().unwrap()[0].uuid;
    assert_ne!(gpu2, gpu);
    driver.lock(pid, 1000).unwrap();
    driver.checkpoint(pid).unwrap();
    driver
        .restore(
            pid,
            &[GpuPair {
                old: gpu,
                new: gpu2,
            }],
        )
        .unwrap();
    driver.unlock(pid).unwrap();
    driver.lock(pid, 1000).unwrap();
    driver.checkpoint(pid).unwrap();
    assert_eq!(
        code(driver.restore(
            pid,
            &[GpuPair {
                old: gpu,
                new: gpu2
            }]
        )),
        CUresult::INVALID_VALUE,
        "old GPU after migration is gpu2"
    );
    driver
        .restore(
            pid,
            &[GpuPair {
                old: gpu2,
                new: gpu2,
            }],
        )
        .unwrap();
    driver.unlock(pid).unwrap();
    set_env("FAKE_CUDA_GPU_UUID_SEED", None);
    w.verify(pid);

    // --- lock timeout while the workload is inside a busy section
    signal(pid, libc::SIGUSR2);
    w.wait_line(pid, |l| l == "hold begin");
    let t0 = Instant::now();
    assert_eq!(code(driver.lock(pid, 300)), CUresult::NOT_READY);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_millis(2500),
        "lock timeout took {waited:?}"
    );
    assert_eq!(driver.process_state(pid).unwrap(), ProcessState::Running);
    // Without a timeout the lock waits for the busy section (3 s) to end.
    driver.lock(pid, 0).unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(1000),
        "lock(0) returned after {waited:?}"
    );
    driver.unlock(pid).unwrap();
    w.wait_line(pid, |l| l == "hold end");
    w.assert_counting(pid);

    // --- failure injection
    set_env("FAKE_CUDA_FAIL", Some("lock:2=801"));
    driver.lock(pid, 1000).unwrap();
    driver.unlock(pid).unwrap();
    assert_eq!(code(driver.lock(pid, 1000)), CUresult::NOT_SUPPORTED);
    assert_eq!(driver.process_state(pid).unwrap(), ProcessState::Running);
    driver.lock(pid, 1000).unwrap();
    driver.unlock(pid).unwrap();
    set_env("FAKE_CUDA_FAIL", Some("get_restore_tid,checkpoint@1"));
    assert_eq!(code(driver.restore_thread_id(pid)), CUresult::UNKNOWN);
    driver.lock(pid, 1000).unwrap();
    driver.checkpoint(pid).unwrap(); // the rule is for pid 1 only
    driver.restore(pid, &[]).unwrap();
    driver.unlock(pid).unwrap();

    let w2 = Workload::start(&dirs, "sticky", &["--mib", "1", "--threads", "1"]);
    let pid2 = w2.pid;
    set_env("FAKE_CUDA_FAIL", Some(&format!("checkpoint@{pid2}=2!")));
    driver.lock(pid2, 1000).unwrap();
    assert_eq!(code(driver.checkpoint(pid2)), CUresult::OUT_OF_MEMORY);
    assert_eq!(driver.process_state(pid2).unwrap(), ProcessState::Failed);
    assert_eq!(code(driver.restore(pid2, &[])), CUresult::OPERATING_SYSTEM);
    assert_eq!(code(driver.unlock(pid2)), CUresult::ILLEGAL_STATE);
    // The workload's blocked CUDA calls now fail; the process stays, and so does FAILED.
    w2.wait_line(pid2, |l| l.starts_with("cuda error 999"));
    assert_eq!(driver.process_state(pid2).unwrap(), ProcessState::Failed);
    set_env("FAKE_CUDA_FAIL", None);
    drop(w2);

    let log_text = fs::read_to_string(&log).unwrap();
    for want in [
        format!("lock pid={pid} result=801"),
        format!("get_restore_tid pid={pid} result=999"),
        format!("checkpoint pid={pid2} result=2"),
        format!("restore pid={pid2} result=304"),
        format!("get_state pid={plain_pid} result=3"),
        format!("lock pid={gone_pid} result=304"),
    ] {
        assert!(log_text.lines().any(|l| l == want), "log lacks {want:?}");
    }

    // --- the work is done by the target: a stopped target makes calls time out
    set_env("FAKE_CUDA_CALL_TIMEOUT_MS", Some("500"));
    signal(pid, libc::SIGSTOP);
    let t0 = Instant::now();
    while task_state(pid, tid) != 'T' {
        assert!(t0.elapsed() < WAIT, "restore thread did not stop");
        sleep(Duration::from_millis(5));
    }
    let t0 = Instant::now();
    assert_eq!(code(driver.process_state(pid)), CUresult::OPERATING_SYSTEM);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(450) && waited < Duration::from_secs(5),
        "stopped-target timeout took {waited:?}"
    );
    assert_eq!(code(driver.lock(pid, 100)), CUresult::OPERATING_SYSTEM);
    // The restore thread id comes from /proc and works on a stopped target (CRIU relies on it).
    assert_eq!(driver.restore_thread_id(pid).unwrap(), tid);
    signal(pid, libc::SIGCONT);
    set_env("FAKE_CUDA_CALL_TIMEOUT_MS", Some("10000"));
    // The lock that timed out must not take effect late.
    assert_eq!(driver.process_state(pid).unwrap(), ProcessState::Running);
    w.assert_counting(pid);
    w.verify(pid);

    // Become the subreaper so that orphaned workload children and CRIU-restored processes can be
    // reaped here.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes plain integers and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };

    // --- a real CRIU dump and restore of a checkpointed target (when CRIU is usable here)
    match criu() {
        Some(criu) => criu_round_trip(&driver, &dirs, &criu),
        None => eprintln!("CRIU section SKIPPED: no usable criu (set CRIU=/path/to/criu, as root)"),
    }

    // --- children: each has its own context and restore thread
    let wc = Workload::start(
        &dirs,
        "tree",
        &["--mib", "2", "--children", "2", "--threads", "1"],
    );
    let kids: Vec<i32> = wc
        .lines(wc.pid)
        .iter()
        .filter_map(|l| l.strip_prefix("child ")?.parse().ok())
        .collect();
    assert_eq!(kids.len(), 2);
    let parent_tid = driver.restore_thread_id(wc.pid).unwrap();
    for &kid in &kids {
        wc.wait_line(kid, |l| l.starts_with("ready "));
        let ktid = driver.restore_thread_id(kid).unwrap();
        assert_ne!(ktid, parent_tid);
        full_cycle(&driver, &wc, &dirs, kid);
    }
    assert_eq!(driver.process_state(wc.pid).unwrap(), ProcessState::Running);
    for &kid in &kids {
        signal(kid, libc::SIGKILL);
    }
    drop(wc);
    for &kid in &kids {
        // SAFETY: waitpid writes no status (NULL) and `kid` is a killed process that now belongs
        // to this subreaper.
        unsafe { libc::waitpid(kid, std::ptr::null_mut(), 0) };
    }

    drop(w);
}
