//! Runs cut short: real CRIU killed (SIGKILL, SIGTERM, SIGINT) at random moments of dumps and
//! restores of CUDA trees, a task of the tree killed in the middle of a dump, a driver call
//! that never returns. After each, every stand-in CUDA process must run again with its GPU
//! state within 2 s of CRIU's end (the plugin's guardian puts it back), or, after a restore cut
//! short, nothing may hold the image's pids and the next restore from the same images must
//! succeed. The stand-in driver and harness are those of `tests/e2e_cuda_fake.rs`.
//!
//! After every run of the kill loops no process of that run may remain
//! ([`common::run_leftovers`]): the plugin's helpers and guardian end by themselves. CRIU's own
//! forks that a kill leaves behind (children of its kernel probes, stopped or asleep for good)
//! are killed by the test, which counts them.
//!
//! The kill loops are bounded in count and in time: `CUT_SHORT_KILLS` sets the number of
//! kills of dumps (default 160) and of restores (a quarter of it, at least 40).

use criu_gpu_test_support as common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::fake_cuda::*;
use common::rng::{Rng, env_number};
use common::run_leftovers::{GONE_WITHIN, Run, Tally};
use common::scenario::*;
use common::{
    children_of, reap_until_gone, sid_of, signal, state_of, status_field, task_state_at, wait_until,
};

/// How long a process may stay frozen after CRIU's end.
const BACK_WITHIN: Duration = Duration::from_secs(2);
/// The most time one kill loop may take.
const LOOP_BUDGET: Duration = Duration::from_secs(240);

fn dump_kills() -> usize {
    env_number("CUT_SHORT_KILLS").unwrap_or(160)
}

const SIGNALS: [(libc::c_int, &str); 3] = [
    (libc::SIGKILL, "SIGKILL"),
    (libc::SIGTERM, "SIGTERM"),
    (libc::SIGINT, "SIGINT"),
];

/// A CRIU run ended by a signal `after` it started (if it had not ended by then).
struct Cut {
    /// CRIU's exit status (`None`: killed).
    code: Option<i32>,
    log: String,
    /// When CRIU was gone.
    ended: Instant,
    /// How long it ran.
    took: Duration,
    /// Which processes are the run's.
    run: Run,
}

fn criu_cut(
    f: &Fake,
    args: &[&str],
    images: &Path,
    env: &[(&str, String)],
    after: Duration,
    sig: libc::c_int,
) -> Cut {
    // A log name of the run's own: CRIU's forks carry it on their command line.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let log = format!(
        "cut-{}.log",
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let _ = std::fs::remove_file(images.join("cut.log"));
    let mut cmd: Command = f.e.command(&f.e.criu);
    cmd.args(args).arg("-D").arg(images).args(["-o", &log]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start criu");
    let started = Instant::now();
    let run = Run::new(child.id() as i32, images, &log);
    let mut sent = false;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for criu") {
            break st;
        }
        if !sent && started.elapsed() >= after {
            signal(child.id() as i32, sig);
            sent = true;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "criu {args:?} still runs 60 s after it was signalled"
        );
        std::thread::sleep(Duration::from_micros(500));
    };
    let ended = Instant::now();
    // Kept as `cut.log`, where `last_log_lines` looks.
    let _ = std::fs::rename(images.join(&log), images.join("cut.log"));
    Cut {
        code: status.code(),
        log: std::fs::read_to_string(images.join("cut.log")).unwrap_or_default(),
        ended,
        took: started.elapsed(),
        run,
    }
}

/// The guardian's lines and the last lines of every `cut.log` of the test.
fn last_log_lines(f: &Fake) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(f.e.dir()).into_iter().flatten().flatten() {
        let log = std::fs::read_to_string(e.path().join("cut.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        for l in lines.iter().filter(|l| l.contains("guardian")) {
            out.push_str(&format!("{l}\n"));
            if let Some(g) = l
                .split("guardian ")
                .nth(1)
                .and_then(|t| t.split(' ').next())
                .and_then(|t| t.parse::<i32>().ok())
            {
                let wchan = std::fs::read_to_string(format!("/proc/{g}/wchan")).unwrap_or_default();
                let sys = std::fs::read_to_string(format!("/proc/{g}/syscall")).unwrap_or_default();
                out.push_str(&format!(
                    "  guardian {g}: {} wchan {wchan} syscall {sys}\n",
                    describe(g)
                ));
            }
        }
        for l in &lines[lines.len().saturating_sub(15)..] {
            out.push_str(&format!("{l}\n"));
        }
    }
    out
}

/// What `/proc` says of `pid`: its command, parent, signal masks and executable.
fn describe(pid: i32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let keep: Vec<&str> = status
        .lines()
        .filter(|l| {
            ["Name:", "PPid:", "TracerPid:", "SigBlk:", "NSpid:"]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .collect();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
    format!("{} exe {}", keep.join(" "), exe.display())
}

/// The exit code a zombie left (field 52 of `/proc/PID/stat`).
fn exit_code(pid: i32) -> Option<i64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?
        .1
        .split_whitespace()
        .nth(49)?
        .parse()
        .ok()
}

/// Every process of `w` holds its device memory again and counts, within [`BACK_WITHIN`] of
/// `since`; then its memory is checked.
fn assert_back(f: &Fake, w: &Workload, files: usize, since: Instant, what: &str) {
    let dead = wait_back(f, w, files, since, what);
    assert!(dead.is_empty(), "{what}: pid(s) {dead:?} died");
    for &p in &w.pids {
        w.verify(p);
    }
}

/// Waits until every process of `w` holds its device memory again and counts, or has died,
/// within [`BACK_WITHIN`] of `since`; returns the dead ones.
fn wait_back(f: &Fake, w: &Workload, files: usize, since: Instant, what: &str) -> Vec<i32> {
    let mut dead = Vec::new();
    for &p in &w.pids {
        let c0 = w.last_counter(p);
        loop {
            let state = state_of(p);
            if matches!(state, None | Some('Z' | 'X')) {
                dead.push(p);
                break;
            }
            let back = f.device_files(p).len() == files
                && matches!(state, Some('R' | 'S'))
                && w.last_counter(p) > c0;
            if back {
                break;
            }
            assert!(
                since.elapsed() < BACK_WITHIN,
                "{what}: pid {p} not running with its GPU state {BACK_WITHIN:?} after CRIU ended (state {state:?}, device files {:?}, {:?}; {})\nCRIU's last log lines and the guardian's:\n{}",
                f.device_files(p),
                w.tail(p),
                describe(p),
                last_log_lines(f)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    dead
}

fn workload(f: &Fake) -> Workload {
    Workload::start(f, "w", &ROOT_AND_CHILD)
}

/// SIGKILL, SIGTERM and SIGINT at random moments of `--leave-running` dumps of a CUDA tree:
/// afterwards every process runs with its GPU state within 2 s, whether the dump had ended,
/// was killed while processes were locked, or while they were checkpointed.
#[test]
fn criu_killed_at_random_moments_of_dumps_leaves_nothing_frozen() {
    let Some(f) = OneGpu::start("cut-dump") else {
        return;
    };
    let mut w = workload(&f);
    let files = f.device_files(w.root()).len();
    let lib = lib();
    let mut root = w.root().to_string();
    let env = f.env("calls");
    let images = &f.images;
    let dump_args = |root: &str| -> Vec<String> {
        ["dump", "--leave-running", "-t", root, "-L", &lib, "-v4"]
            .map(String::from)
            .to_vec()
    };
    // How long a whole dump takes here: the kills land inside that.
    let a = dump_args(&root);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let mut left = Tally::default();
    let whole = criu_cut(&f, &a, images, &env, Duration::from_secs(3600), 0);
    assert_eq!(whole.code, Some(0), "{}", whole.log);
    left.check(&whole.run, &w.pids, "a whole dump");
    let again = criu_cut(&f, &a, images, &env, Duration::from_secs(3600), 0);
    assert_eq!(again.code, Some(0), "{}", again.log);
    left.check(&again.run, &w.pids, "a second whole dump");
    let span = whole.took.max(again.took).as_micros().max(1) as u64;
    eprintln!("a whole dump takes {:?}", whole.took.max(again.took));
    let mut rng = Rng::from_env("CUT_SHORT_SEED");
    let started = Instant::now();
    let (mut killed, mut finished, mut guarded) = (0usize, 0usize, 0usize);
    let mut ended_with_criu = 0usize;
    let kills = dump_kills();
    for i in 0..kills {
        assert!(
            started.elapsed() < LOOP_BUDGET,
            "{i} kills took longer than {LOOP_BUDGET:?}"
        );
        let (sig, name) = SIGNALS[rng.below(3) as usize];
        let after = Duration::from_micros(rng.below(span * 11 / 10));
        let a = dump_args(&root);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let cut = criu_cut(&f, &a, images, &env, after, sig);
        let what = format!(
            "kill {i}: {name} after {after:?} (criu exit {:?})",
            cut.code
        );
        if cut.code == Some(0) {
            finished += 1;
        } else {
            killed += 1;
        }
        if cut.log.contains("guardian") {
            guarded += 1;
        }
        // The guardian of a killed CRIU is this test's child (a subreaper): reap it.
        reap_until_gone(&[], Duration::ZERO);
        // CRIU killed while its parasite code runs inside a task ends that task (CRIU's own
        // doing, plain processes too): the task is dead, not frozen, and its survivors must
        // run; the tree is then started anew.
        let dead = wait_back(&f, &w, files, cut.ended, &what);
        if !dead.is_empty() {
            let codes: Vec<(i32, Option<i64>)> = dead.iter().map(|&p| (p, exit_code(p))).collect();
            eprintln!("{what}: task(s) ended with CRIU (pid, exit code): {codes:?}");
        }
        // Nothing of the run is left: the plugin's helpers and guardian are gone.
        left.check(&cut.run, &w.pids, &what);
        if !dead.is_empty() {
            ended_with_criu += 1;
            for &p in w.pids.iter().filter(|p| !dead.contains(p)) {
                w.verify(p);
            }
            f.e.kill_and_reap(&w.pids);
            f.clear_device_dir();
            w = workload(&f);
            root = w.root().to_string();
            continue;
        }
        for &p in &w.pids {
            w.verify(p);
        }
    }
    eprintln!(
        "{kills} dumps signalled: {killed} ended by the signal, {finished} done before it; the guardian wrote to the log in {guarded}; a task ended with CRIU in {ended_with_criu}; {}",
        left.summary()
    );
    assert!(
        killed >= kills / 4,
        "too few dumps were cut short: {killed}"
    );
}

/// SIGKILL, SIGTERM and SIGINT at random moments of restores: afterwards either the tree runs
/// with its GPU state, or nothing holds the image's pids; the next restore from the same images
/// always succeeds.
#[test]
fn criu_killed_at_random_moments_of_restores_leaves_nothing_behind() {
    let Some(Dumped {
        f,
        w,
        files,
        lib,
        env,
        images,
    }) = Dumped::new("cut-restore", false)
    else {
        return;
    };
    let args = ["restore", "-d", "-L", &lib, "-v4"];
    let end_tree = |w: &Workload| {
        for &p in &w.pids {
            signal(p, libc::SIGKILL);
        }
        assert!(
            reap_until_gone(&w.pids, common::WAIT),
            "restored tree did not go"
        );
        f.clear_device_dir();
    };
    let mut left = Tally::default();
    let whole = criu_cut(&f, &args, &images, &env, Duration::from_secs(3600), 0);
    assert_eq!(whole.code, Some(0), "{}", whole.log);
    let span = whole.took.as_micros().max(1) as u64;
    eprintln!("a whole restore takes {:?}", whole.took);
    left.check(&whole.run, &w.pids, "a whole restore");
    end_tree(&w);
    let mut rng = Rng::from_env("CUT_SHORT_SEED");
    let started = Instant::now();
    let kills = (dump_kills() / 4).max(40);
    let (mut killed, mut finished, mut ran_on) = (0usize, 0usize, 0usize);
    for i in 0..kills {
        assert!(
            started.elapsed() < LOOP_BUDGET,
            "{i} kills took longer than {LOOP_BUDGET:?}"
        );
        let (sig, name) = SIGNALS[rng.below(3) as usize];
        let after = Duration::from_micros(rng.below(span * 11 / 10));
        let cut = criu_cut(&f, &args, &images, &env, after, sig);
        let what = format!(
            "kill {i}: {name} after {after:?} (criu exit {:?})",
            cut.code
        );
        reap_until_gone(&[], Duration::ZERO);
        if cut.code == Some(0) {
            finished += 1;
            assert_back(&f, &w, files, cut.ended, &what);
        } else {
            killed += 1;
            // CRIU killed after it let the tree go (its last moments) leaves a tree that
            // runs with its GPU state: kept. Anything half restored is gone, its pids free
            // again within the bound (plus the time this machine's init takes to reap).
            let dead = wait_back(&f, &w, files, cut.ended, &what);
            if dead.len() < w.pids.len() {
                if !dead.is_empty() {
                    let codes: Vec<_> = dead.iter().map(|&p| (p, exit_code(p))).collect();
                    eprintln!("{what}: task(s) ended with CRIU (pid, exit code): {codes:?}");
                }
                ran_on += 1;
                for &p in w.pids.iter().filter(|p| !dead.contains(p)) {
                    w.verify(p);
                }
            } else {
                let gone = reap_until_gone(&w.pids, BACK_WITHIN + Duration::from_secs(3));
                assert!(
                    gone,
                    "{what}: pids {:?} still held: {:?}\n{}",
                    w.pids,
                    w.pids.iter().map(|&p| (p, state_of(p))).collect::<Vec<_>>(),
                    cut.log
                );
            }
        }
        // Nothing of the run is left but the restored tree's tasks that run on: no helper, no
        // guardian, no half-restored task.
        left.check(&cut.run, &w.pids, &what);
        end_tree(&w);
    }
    eprintln!(
        "{kills} restores signalled: {killed} ended by the signal ({ran_on} of them after the tree ran), {finished} done before it; {}",
        left.summary()
    );
    // And a last restore, not cut short, from the same images.
    let last = f.criu(&args, &images, "restore.log", &env);
    last.assert_ok();
    assert_back(&f, &w, files, Instant::now(), "the last restore");
}

/// Starts a `--leave-running` dump (with `extra` arguments) of a new tree of a root and a
/// child, kills the child once `kill_when` returns, and checks that CRIU ends within `limit`
/// and that the root runs again with its GPU state within 2 s of CRIU's end.
fn kill_child_mid_dump(
    f: &Fake,
    env: &[(&str, String)],
    round: usize,
    extra: &[&str],
    limit: Duration,
    kill_when: &dyn Fn(),
) {
    let w = Workload::start(
        f,
        &format!("w{round}"),
        &["--mib", "8", "--chunk-mib", "4", "--children", "1"],
    );
    let files = f.device_files(w.root()).len();
    let (root, child) = (w.pids[0], w.pids[1]);
    let images = f.e.images(&format!("img{round}"));
    let (root_s, lib) = (root.to_string(), lib());
    let mut cmd: Command = f.e.command(&f.e.criu);
    cmd.args(["dump", "--leave-running", "-t", &root_s, "-L", &lib, "-v4"])
        .args(extra)
        .arg("-D")
        .arg(&images)
        .args(["-o", "cut.log"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut criu = cmd.spawn().expect("criu");
    kill_when();
    signal(child, libc::SIGKILL);
    let t = Instant::now();
    let status = loop {
        if let Some(st) = criu.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > limit {
            // What each task is waiting in, before CRIU goes.
            let criu_pid = criu.id() as i32;
            let tasks = tasks_waiting(&[criu_pid, root, child]);
            if criu_waits_for_its_dead_tracee(criu_pid, child) {
                // CRIU's own deadlock (4.3 seen): the child and its threads died while CRIU
                // waited for the child alone. A traced leader's exit is reported only once its
                // threads are reaped, which only CRIU can do. A runtime's deadline ends such a
                // CRIU; the root must then run again with its GPU state.
                eprintln!(
                    "round {round}: CRIU waits for its dead child {child} forever (its threads \
                     are zombies only CRIU can reap); killed, as a runtime's deadline would:\n\
                     {tasks}"
                );
                let _ = criu.kill();
                break criu.wait().expect("criu's status");
            }
            let _ = criu.kill();
            let log = std::fs::read_to_string(images.join("cut.log")).unwrap_or_default();
            panic!(
                "criu still runs {limit:?} after a task of the tree died (seed: see above):\n\
                 {tasks}\n{log}"
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let ended = Instant::now();
    // The child stays a zombie of the root (which never waits for it).
    reap_until_gone(&[], Duration::ZERO);
    let survivor = Workload {
        out: w.out.clone(),
        pids: vec![root],
        ns_pids: vec![root],
    };
    let log = std::fs::read_to_string(images.join("cut.log")).unwrap_or_default();
    let what = format!("round {round}: criu {status:?}\n{log}");
    assert_back(f, &survivor, files, ended, &what);
    f.e.kill_and_reap(&w.pids);
}

/// Whether CRIU (`criu`) waits in the kernel while every thread of `child` is a zombie it
/// traces: CRIU waiting for the child's leader, whose exit the kernel reports only once those
/// threads are reaped.
fn criu_waits_for_its_dead_tracee(criu: i32, child: i32) -> bool {
    let waits = std::fs::read_to_string(format!("/proc/{criu}/wchan")).unwrap_or_default();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{child}/task")) else {
        return false;
    };
    let mut threads = 0;
    for t in tasks.flatten() {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let zombie = status_field(&status, "State:").is_some_and(|s| s.starts_with('Z'));
        let traced_by_criu = status_field(&status, "TracerPid:") == Some(&criu.to_string());
        if !zombie || !traced_by_criu {
            return false;
        }
        threads += 1;
    }
    waits == "do_wait" && threads > 1
}

/// Each thread of `pids` as `/proc` says it is ([`task_state_at`]), one per line.
fn tasks_waiting(pids: &[i32]) -> String {
    let mut out = String::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            out.push_str(&format!("{pid}: gone\n"));
            continue;
        };
        for t in tasks.flatten() {
            let tid = t.file_name();
            let state = task_state_at(&t.path());
            out.push_str(&format!("{pid}/{}: {state}\n", tid.to_string_lossy()));
        }
    }
    out
}

/// A child of the tree killed in the middle of a `--leave-running` dump: CRIU fails the dump
/// (4.1 exits from its own SIGCHLD handler without calling the plugin) and the root runs with
/// its GPU state again within 2 s. Where CRIU instead waits forever for the dead child (its
/// own deadlock, seen with 4.3 when the child dies while CRIU waits for it alone), it is killed
/// after 60 s, as a runtime's deadline would, and the root must run again just the same.
#[test]
fn a_child_killed_mid_dump_leaves_the_root_running() {
    let Some(f) = OneGpu::start("cut-child") else {
        return;
    };
    let env = f.env("calls");
    let rng = std::cell::RefCell::new(Rng::from_env("CUT_SHORT_SEED"));
    for round in 0..6 {
        let pause = Duration::from_micros(rng.borrow_mut().below(60_000));
        kill_child_mid_dump(&f, &env, round, &[], Duration::from_secs(60), &|| {
            std::thread::sleep(pause)
        });
    }
}

/// A driver call that never returns (the stand-in waits for good, as the real driver does,
/// and a task killed mid-checkpoint never answers): CRIU does not hang, the dump fails, and
/// the survivors run again.
#[test]
fn a_driver_call_that_never_returns_does_not_hang_criu() {
    let Some(f) = OneGpu::start("cut-hung") else {
        return;
    };
    let mut env = f.env("calls");
    env.retain(|(k, _)| *k != "FAKE_CUDA_CALL_TIMEOUT_MS");
    env.push(("FAKE_CUDA_CALL_TIMEOUT_MS", "0".into()));
    let calls = f.e.dir().join("calls");
    for round in 0..4 {
        // The child is killed once both locks are done: its checkpoint then never answers.
        let locked = || {
            wait_until("the tree's locks", || {
                std::fs::read_to_string(&calls).is_ok_and(|t| {
                    t.lines().filter(|l| l.starts_with("lock ")).count() >= 2 * (round + 1)
                })
            })
        };
        kill_child_mid_dump(
            &f,
            &env,
            round,
            &["--timeout", "5"],
            Duration::from_secs(30),
            &locked,
        );
    }
}

/// A `--leave-running` dump started while a restore of the same tree runs, at several delays:
/// the dump either refuses the tree (the restore holds it) or, once the restore is done, dumps
/// it with its GPU state; never an image without it. The restored tree runs with its GPU state
/// afterwards, or the restore failed and nothing holds the image's pids.
#[test]
fn a_dump_racing_a_restore_never_records_the_tree_without_its_gpu_state() {
    let Some(Dumped {
        f,
        w,
        files,
        lib,
        env,
        images,
    }) = Dumped::new("race-restore", false)
    else {
        return;
    };
    let root = w.root().to_string();
    let (mut refused, mut dumped) = (0, 0);
    for (round, delay_ms) in [0u64, 5, 15, 30, 60, 100, 200, 400].into_iter().enumerate() {
        f.clear_device_dir();
        let mut restore: Command = f.e.command(&f.e.criu);
        restore
            .args(["restore", "-d", "-L", &lib, "-v4", "-D"])
            .arg(&images)
            .args(["-o", "restore.log"]);
        for (k, v) in &env {
            restore.env(k, v);
        }
        let mut restore = restore.spawn().expect("criu restore");
        std::thread::sleep(Duration::from_millis(delay_ms));
        let second = f.e.images(&format!("second{round}"));
        let run = f.criu(
            &["dump", "--leave-running", "-t", &root, "-L", &lib, "-v4"],
            &second,
            "dump.log",
            &env,
        );
        let status = restore.wait().expect("wait for the restore");
        reap_until_gone(&[], Duration::ZERO);
        let what = format!(
            "round {round} ({delay_ms} ms): restore {status:?}, dump {:?}",
            run.code
        );
        if run.ok() {
            dumped += 1;
            // Every CUDA process of the tree is in the image with its GPU state.
            let md =
                std::fs::read_to_string(second.join("gpu-plugin-cuda.img")).unwrap_or_default();
            let records = md.lines().filter(|l| l.starts_with("process ")).count();
            assert_eq!(
                records,
                w.pids.len(),
                "{what}: the dump recorded {records} CUDA process(es)\n{md}\n{}",
                run.log
            );
        } else {
            refused += 1;
        }
        if status.success() {
            assert_back(&f, &w, files, Instant::now(), &what);
        }
        for &p in &w.pids {
            signal(p, libc::SIGKILL);
        }
        assert!(
            reap_until_gone(&w.pids, BACK_WITHIN + Duration::from_secs(3)),
            "{what}: the image's pids are still held"
        );
    }
    eprintln!("dumps racing a restore: {refused} refused, {dumped} dumped with the GPU state");
}

/// A helper of the plugin stopped (`SIGSTOP`, as a Ctrl-Z of CRIU's process group would) while
/// it waits in the driver, then CRIU killed: the helper ends with CRIU all the same (its
/// parent-death signal is `SIGKILL`, which ends a stopped process too) and nothing of the run
/// remains once the guardian has put the process back.
#[test]
fn a_stopped_helper_ends_with_criu() {
    let Some(f) = OneGpu::start("cut-stopped-helper") else {
        return;
    };
    let env = f.env("calls");
    // A GPU-busy process: the dump's lock helper waits for the busy section (up to the lock
    // timeout, 5 s) inside the driver.
    let w = f.workload(&["--mib", "8", "--threads", "1", "--hold-ms", "8000"]);
    let root = w.root();
    assert!(signal(root, libc::SIGUSR2), "SIGUSR2");
    w.wait_line(root, "hold begin");
    let images = &f.images;
    let (root_s, lib) = (root.to_string(), lib());
    let mut cmd: Command = f.e.command(&f.e.criu);
    cmd.args(["dump", "--leave-running", "-t", &root_s, "--timeout", "5"])
        .args(["-L", &lib, "-v4", "-D"])
        .arg(images)
        .args(["-o", "stopped.log"]);
    for (k, v) in &env {
        cmd.env(k, v);
    }
    let mut criu = cmd.spawn().expect("criu");
    let criu_pid = criu.id() as i32;
    let run = Run::new(criu_pid, images, "stopped.log");
    // The helper: CRIU's child with the plugin mapped, waiting in the driver (the stand-in
    // polls), in CRIU's session (the guardian, which polls too, has left it by then).
    let in_driver = |p: i32| {
        std::fs::read_to_string(format!("/proc/{p}/wchan")).is_ok_and(|w| w.contains("poll"))
    };
    let mut helper = 0;
    wait_until("the dump's lock helper waiting in the driver", || {
        helper = children_of(criu_pid)
            .into_iter()
            .find(|&p| {
                common::run_leftovers::maps_plugin(p)
                    && sid_of(p) == sid_of(criu_pid)
                    && in_driver(p)
            })
            .unwrap_or(0);
        helper != 0
    });
    assert!(signal(helper, libc::SIGSTOP), "SIGSTOP the helper");
    wait_until(format!("helper {helper} stopped"), || {
        state_of(helper) == Some('T')
    });
    signal(criu_pid, libc::SIGKILL);
    criu.wait().expect("wait for criu");
    assert!(
        reap_until_gone(&[helper], GONE_WITHIN),
        "the stopped helper outlived CRIU: {}",
        common::run_leftovers::Left::of(helper, true).describe()
    );
    // The guardian's put-back waits behind the lock the helper asked for (the stand-in serves
    // one request at a time) until its timeout.
    let r = run.reap(
        &w.pids,
        GONE_WITHIN + Duration::from_secs(5),
        "stopped helper",
    );
    eprintln!("the run's other processes went within {:?}", r.took);
    w.wait_line(root, "hold end");
    w.assert_all_running("after CRIU and its stopped helper were killed");
}
