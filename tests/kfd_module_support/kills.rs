//! CRIU killed (`SIGKILL`) at random moments of AMD dumps and restores of the workload: a dump
//! killed leaves the workload running with its queues advancing again (the dump's guardian
//! restarts what it paused), a restore killed leaves nothing holding the image's pids, and
//! no process of a killed run stays behind; a whole dump and restore afterwards still verify.
//!
//! The kill moments are spread over 1.2 times a whole run's length, from a seeded generator:
//! `KFD_KILLS` kills per test (default 12), `KFD_KILL_SEED` to repeat a sequence (printed).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::bench::{
    Bench, GPU0, GPU1, StandInKfd, Status, check_restored, kill_both, reap, setup, wait_gone,
};
use super::common::rng::{Rng, env_number, seed_from_env};
use super::common::status_field as field;

/// How many kills each test makes.
fn kills() -> usize {
    env_number("KFD_KILLS").unwrap_or(12)
}

/// When (since CRIU's start) CRIU's log `log` first says `marker`.
fn logged_at(log: &str, marker: &str) -> Option<Duration> {
    let line = log.lines().find(|l| l.contains(marker))?;
    let stamp = line.strip_prefix('(')?.split(')').next()?;
    Some(Duration::from_secs_f64(stamp.trim().parse().ok()?))
}

/// Waits until `log` says `marker` (CRIU writes its log line by line), `criu` ends or `within`
/// passes; returns whether it said it.
fn wait_logged(log: &Path, marker: &str, criu: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if std::fs::read_to_string(log).is_ok_and(|t| t.contains(marker)) {
            return true;
        }
        if criu.try_wait().ok().flatten().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(3));
    }
    false
}

/// Lets `criu` run until the `i`th kill moment and says what it was: every other one anywhere
/// in 1.2 times a whole run (`whole`), the others within 1.5 times `window` after its log
/// says `marker` (the stretch where the run holds the most: the queues paused, the tasks
/// forked).
fn run_until_kill(
    m: &mut Rng,
    i: usize,
    criu: &mut Child,
    log: &Path,
    whole: Duration,
    (marker, window): (&str, Duration),
) -> String {
    if i % 2 == 1 {
        let at = m.within(whole.mul_f64(1.2));
        std::thread::sleep(at);
        return format!("at {:.3} s", at.as_secs_f64());
    }
    if !wait_logged(log, marker, criu, whole * 3) {
        return format!("(CRIU ended before \"{marker}\")");
    }
    let at = m.within(window.mul_f64(1.5));
    std::thread::sleep(at);
    format!("{:.3} s after \"{marker}\"", at.as_secs_f64())
}

/// CRIU started on `images` (its log `ACTION.log` there), not waited for.
fn spawn_criu(b: &Bench, action: &str, images: &Path, extra: &[&str]) -> Child {
    std::fs::create_dir_all(images).unwrap();
    Command::new(&b.criu)
        .arg(action)
        .arg("-D")
        .arg(images)
        .arg("-L")
        .arg(&b.lib)
        .args(["-v4", "-o", &format!("{action}.log")])
        .args(extra)
        .env("CRIU_GPU_AMDGPU_TOPOLOGY", &b.topology)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn kill_criu(criu: &mut Child) {
    let _ = criu.kill();
    let _ = criu.wait();
}

fn status_of(pid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status")).ok()
}

/// Processes named `criu` that are not zombies: CRIU, its forks, the plugin's helpers and
/// guardian (only the test runs CRIU in the guest), with their state letter.
fn criu_processes() -> Vec<(i32, char)> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let s = status_of(pid)?;
            let state = field(&s, "State:")?.chars().next()?;
            (field(&s, "Name:") == Some("criu") && !matches!(state, 'Z' | 'X'))
                .then_some((pid, state))
        })
        .collect()
}

/// Whether `pid` maps the plugin (CRIU once it has loaded it, and every copy of CRIU made
/// after that: restore tasks, the plugin's helpers and guardian).
fn maps_plugin(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains("gpu_plugin.so"))
}

/// Waits until no process of a killed run is left; returns how many of CRIU's own kernel-probe
/// children it killed. CRIU probes the kernel (`kerndat`) before it loads any plugin, some
/// probes with a child that stops itself or sleeps until CRIU attaches; a CRIU killed in
/// between leaves that child for good. Such a child maps no plugin: a stopped one is killed at
/// once, a sleeping one once `within` is half over. Any other process is the run's, and an
/// error once `within` is over.
fn wait_no_criu(within: Duration) -> Result<usize, String> {
    let t = Instant::now();
    let mut killed: Vec<i32> = Vec::new();
    loop {
        reap();
        let left = criu_processes();
        if left.is_empty() {
            return Ok(killed.len());
        }
        for &(pid, state) in &left {
            let stopped = matches!(state, 'T' | 't');
            if !killed.contains(&pid) && !maps_plugin(pid) && (stopped || t.elapsed() > within / 2)
            {
                // SAFETY: kill has no memory-safety preconditions; the pid is a copy of CRIU
                // without the plugin, in a guest where only this test runs CRIU.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                println!(
                    "kfd_module: CRIU's own probe child {pid} (state {state}) left by the kill: killed"
                );
                killed.push(pid);
            }
        }
        if t.elapsed() > within {
            let rest: Vec<String> = left
                .iter()
                .filter(|(pid, _)| !killed.contains(pid))
                .map(|(pid, state)| {
                    format!("{pid} ({state}, maps the plugin: {})", maps_plugin(*pid))
                })
                .collect();
            if !rest.is_empty() || t.elapsed() > within * 2 {
                return Err(format!(
                    "processes of the killed CRIU run left: {rest:?}, killed but not gone: {killed:?}"
                ));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn counters(s: &Status) -> [u64; 2] {
    [0, 1].map(|g| s[&format!("gpu{g}_counter")].parse().unwrap())
}

/// Whether `pid` has ended (gone, or a zombie not yet reaped).
fn ended(pid: i32) -> bool {
    status_of(pid)
        .and_then(|s| field(&s, "State:").map(|v| v.starts_with('Z') || v.starts_with('X')))
        .unwrap_or(true)
}

/// Which of `pids` ended with the CRIU just killed. A task CRIU's parasite code ran in when
/// CRIU died dies of its trap once the kernel has detached it, a moment after CRIU: waits
/// until each has ended or runs untraced (at most 10 s), then a little more.
fn ended_with_criu(pids: &[i32]) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline
        && pids.iter().any(|&p| {
            status_of(p).is_some_and(|s| {
                let traced = field(&s, "TracerPid:").is_some_and(|t| t != "0");
                let stopped = field(&s, "State:").is_some_and(|v| v.starts_with(['t', 'T']));
                !ended(p) && (traced || stopped)
            })
        })
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    pids.iter().copied().filter(|&p| ended(p)).collect()
}

/// Waits until `pid` runs untraced and its queues advance; returns how long that took.
fn queues_run(b: &Bench, pid: i32, within: Duration) -> Result<Duration, String> {
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < within {
        let Some(s) = status_of(pid) else {
            return Err(format!("pid {pid} is gone"));
        };
        let state = field(&s, "State:").unwrap_or("?").to_string();
        let tracer = field(&s, "TracerPid:").unwrap_or("?").to_string();
        if tracer != "0" || state.starts_with('t') || state.starts_with('T') {
            last = format!("state {state}, tracer {tracer}");
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let a = counters(&b.status(pid));
        std::thread::sleep(Duration::from_millis(300));
        let z = counters(&b.status(pid));
        if z[0] > a[0] && z[1] > a[1] {
            return Ok(t.elapsed());
        }
        last = format!("queue counters {a:?} -> {z:?}");
    }
    Err(format!(
        "pid {pid}'s queues do not run again within {within:?} ({last})"
    ))
}

#[test]
fn criu_killed_in_the_middle_of_amd_dumps() {
    let Some(setup) = setup("kfd-dump-kills") else {
        return;
    };
    let b = &setup.bench;
    let img = |n: &str| b.dir.path().join(n);
    let _module = StandInKfd::load(&setup.ko, [GPU0, GPU1]);
    let mut pids = b.start();
    let t = Instant::now();
    let log = b.criu(
        "dump",
        &img("timed"),
        &["-t", &pids.0.to_string(), "--leave-running"],
        &[],
    );
    let whole = t.elapsed();
    let paused = (
        logged_at(&log, "GPU queues paused").expect("the pause is logged"),
        logged_at(&log, "GPU queues of").expect("the restart is logged"),
    );
    let (n, seed) = (kills(), seed_from_env("KFD_KILL_SEED"));
    println!(
        "kfd_module: {n} dumps killed, seed {seed} (KFD_KILL_SEED); a whole dump takes {:.2} s, the queues paused from {:.2} to {:.2} s of it",
        whole.as_secs_f64(),
        paused.0.as_secs_f64(),
        paused.1.as_secs_f64()
    );
    let mut moments = Rng::new(seed);
    let (mut by_guardian, mut finished, mut slowest) = (0, 0, Duration::ZERO);
    let mut trapped = 0;
    for i in 1..=n {
        let images = img(&format!("dump-kill-{i}"));
        let pid = pids.0.to_string();
        let mut criu = spawn_criu(b, "dump", &images, &["-t", &pid, "--leave-running"]);
        let log = images.join("dump.log");
        let window = ("GPU queues paused", paused.1.saturating_sub(paused.0));
        let at = run_until_kill(&mut moments, i, &mut criu, &log, whole, window);
        kill_criu(&mut criu);
        let what = format!("dump kill {i} {at} (seed {seed})");
        // CRIU killed while its parasite code runs inside a task ends that task (compel's
        // breakpoint trap), plain processes too: CRIU's own, counted; a new workload goes on.
        let dead = ended_with_criu(&[pids.0, pids.1]);
        if !dead.is_empty() {
            trapped += 1;
            println!(
                "kfd_module: {what}: pid(s) {dead:?} ended with CRIU (its parasite code ran there); a new workload"
            );
            kill_both(pids);
            reap();
            wait_gone(&[pids.0, pids.1]);
            wait_no_criu(Duration::from_secs(10)).unwrap_or_else(|e| panic!("{what}: {e}"));
            let _ = std::fs::remove_dir_all(&images);
            pids = b.start();
            continue;
        }
        let ran = queues_run(b, pids.0, Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            b.status(pids.1).contains_key("dmabuf_sum"),
            "{what}: the child"
        );
        wait_no_criu(Duration::from_secs(10)).unwrap_or_else(|e| panic!("{what}: {e}"));
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        let outcome = if log.contains("GPU queues run again (KFD UNPAUSE)") {
            by_guardian += 1;
            "the guardian restarted the queues"
        } else if log.contains("Dumping finished successfully") {
            finished += 1;
            "the dump had finished"
        } else if log.contains("GPU queues of") {
            "the dump had restarted the queues"
        } else if log.contains("GPU queues paused") {
            "the queues were paused, the guardian left no word (its log?)"
        } else {
            "before the pause"
        };
        slowest = slowest.max(ran);
        println!(
            "kfd_module: {what}: {outcome}; queues running {:.2} s after the kill",
            ran.as_secs_f64()
        );
        let _ = std::fs::remove_dir_all(&images);
    }
    println!(
        "kfd_module: {n} dumps killed: queues restarted by the guardian {by_guardian} times, dump finished first {finished} times, a task ended by CRIU's parasite trap {trapped} times; queues ran again within {:.2} s each time",
        slowest.as_secs_f64()
    );
    assert!(
        trapped * 2 <= n,
        "CRIU's parasite trap ended a task in {trapped} of {n} kills: too few kills tested the guardian"
    );
    resume_by_hand(b, pids.0, &img("guardian-stopped"));
    // The workload lost nothing: a whole dump and restore still verify.
    let before = b.status(pids.0);
    b.dump(pids.0, &img("after"), false);
    b.restore(&img("after"), pids, &[]);
    check_restored(
        b,
        pids,
        &before,
        [GPU0, GPU1],
        "restore after the dump kills",
    );
    println!("kfd_module: a whole dump and restore after the dump kills: ok");
    kill_both(pids);
    wait_gone(&[pids.0, pids.1]);
}

/// `criu-gpu` of this workspace (built before the tests: the guest cannot build it).
fn criu_gpu() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("criu-gpu");
    assert!(
        bin.is_file(),
        "no {}: run `cargo build --locked -p criu-gpu` first",
        bin.display()
    );
    bin
}

/// The guardian stopped (`SIGSTOP`) before CRIU is killed with the queues paused: they stay
/// paused until `criu-gpu resume` restarts them; the guardian, continued, finds nothing left
/// to do and ends.
fn resume_by_hand(b: &Bench, pid: i32, images: &Path) {
    let p = pid.to_string();
    let mut criu = spawn_criu(b, "dump", images, &["-t", &p, "--leave-running"]);
    let log = images.join("dump.log");
    assert!(
        wait_logged(
            &log,
            "GPU queues paused",
            &mut criu,
            Duration::from_secs(60)
        ),
        "the dump did not pause the queues"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let guardian: i32 = text
        .lines()
        .find_map(|l| l.split("amdgpu: guardian ").nth(1))
        .and_then(|r| r.split(' ').next()?.parse().ok())
        .expect("the guardian's pid is logged");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(guardian, libc::SIGSTOP) };
    kill_criu(&mut criu);
    // Untraced, running on the CPU, its queues paused.
    let deadline = Instant::now() + Duration::from_secs(20);
    while status_of(pid)
        .and_then(|s| field(&s, "TracerPid:").map(|t| t != "0"))
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "pid {pid} is still traced");
        std::thread::sleep(Duration::from_millis(50));
    }
    let a = counters(&b.status(pid));
    std::thread::sleep(Duration::from_millis(500));
    let z = counters(&b.status(pid));
    assert_eq!(a, z, "the queues run without the guardian");
    let out = Command::new(criu_gpu())
        .args(["resume", &p])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("queues paused"),
        "criu-gpu resume {p}: {}\n{said}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let ran = queues_run(b, pid, Duration::from_secs(20)).unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(guardian, libc::SIGCONT) };
    wait_no_criu(Duration::from_secs(10)).unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("its GPU queues were not paused"),
        "the guardian, continued, says nothing of pid {pid}"
    );
    println!(
        "kfd_module: guardian stopped, CRIU killed with the queues paused: `criu-gpu resume {pid}` restarted them ({:.2} s); the guardian, continued, found them running",
        ran.as_secs_f64()
    );
}

/// Waits until no process started since `since` (clock ticks) holds one of `pids`. Returns
/// what still does at the deadline.
fn wait_freed(pids: &[i32], since: u64, within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    loop {
        reap();
        let held: Vec<String> = pids
            .iter()
            .filter(|&&p| criu_plugin::proc::start_time(p).is_some_and(|s| s >= since))
            .map(|&p| {
                let s = status_of(p).unwrap_or_default();
                format!(
                    "{p} ({}, tracer {}, blocked signals {})",
                    field(&s, "State:").unwrap_or("gone"),
                    field(&s, "TracerPid:").unwrap_or("?"),
                    field(&s, "SigBlk:").unwrap_or("?")
                )
            })
            .collect();
        if held.is_empty() || Instant::now() > deadline {
            return held;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn criu_killed_in_the_middle_of_amd_restores() {
    let Some(setup) = setup("kfd-restore-kills") else {
        return;
    };
    let b = &setup.bench;
    let img = |n: &str| b.dir.path().join(n);
    let _module = StandInKfd::load(&setup.ko, [GPU0, GPU1]);
    let pids = b.start();
    let before = b.status(pids.0);
    b.dump(pids.0, &img("base"), false);
    let t = Instant::now();
    let log = b.restore(&img("base"), pids, &[]);
    let whole = t.elapsed();
    let busy = (
        logged_at(&log, "KFD file(s) can be restored here").expect("the preflight is logged"),
        logged_at(&log, "Restore finished successfully").expect("the end is logged"),
    );
    check_restored(b, pids, &before, [GPU0, GPU1], "restore");
    kill_both(pids);
    let (n, seed) = (kills(), seed_from_env("KFD_KILL_SEED"));
    println!(
        "kfd_module: {n} restores killed, seed {seed} (KFD_KILL_SEED); a whole restore takes {:.2} s, from {:.2} to {:.2} s of it from the AMD preflight to its end",
        whole.as_secs_f64(),
        busy.0.as_secs_f64(),
        busy.1.as_secs_f64()
    );
    let mut moments = Rng::new(seed);
    let (mut finished, mut ended_by_guardian, mut failures) = (0, 0, Vec::new());
    for i in 1..=n {
        wait_gone(&[pids.0, pids.1]);
        // A CRIU killed before it opened its log must not leave the last run's to be read.
        let log = img("base").join("restore.log");
        let _ = std::fs::remove_file(&log);
        let mut criu = spawn_criu(b, "restore", &img("base"), &["-d"]);
        let since = criu_plugin::proc::start_time(criu.id() as i32).unwrap_or(0);
        let window = (
            "KFD file(s) can be restored here",
            busy.1.saturating_sub(busy.0),
        );
        let at = run_until_kill(&mut moments, i, &mut criu, &log, whole, window);
        kill_criu(&mut criu);
        let what = format!("restore kill {i} {at} (seed {seed})");
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        if log.contains("Restore finished successfully") {
            // The restore won the race: a restored tree, as any other.
            finished += 1;
            println!("kfd_module: {what}: the restore had finished");
            kill_both(pids);
        } else {
            let t = Instant::now();
            let held = wait_freed(&[pids.0, pids.1], since, Duration::from_secs(15));
            let freed_after = t.elapsed();
            let last = log.lines().last().unwrap_or("(no log)");
            let last: String = last.chars().take(120).collect();
            if held.is_empty() {
                // The guardian's word comes in the log once it has acted.
                let log =
                    std::fs::read_to_string(img("base").join("restore.log")).unwrap_or_default();
                let by = if log.contains("half-restored task(s) killed") {
                    "the guardian ended the half-restored tasks; "
                } else {
                    ""
                };
                ended_by_guardian += usize::from(!by.is_empty());
                println!(
                    "kfd_module: {what}: {by}the image's pids free {:.2} s after the kill (CRIU's last word: {last})",
                    freed_after.as_secs_f64()
                );
            } else {
                println!("kfd_module: {what}: still held: {held:?} (CRIU's last word: {last})");
                failures.push(format!("{what}: the image's pids still held: {held:?}"));
                kill_both(pids);
            }
        }
        if let Err(e) = wait_no_criu(Duration::from_secs(10)) {
            println!("kfd_module: {what}: {e}");
            failures.push(format!("{what}: {e}"));
        }
    }
    // A restore from the same images still succeeds and verifies.
    b.restore(&img("base"), pids, &[]);
    check_restored(
        b,
        pids,
        &before,
        [GPU0, GPU1],
        "restore after the restore kills",
    );
    println!(
        "kfd_module: {n} restores killed ({finished} had finished, the guardian ended the tasks of {ended_by_guardian}), then a whole restore: ok"
    );
    kill_both(pids);
    wait_gone(&[pids.0, pids.1]);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
