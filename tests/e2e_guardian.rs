//! The guardian acts on its own run only, and closes every window of a restore, with real CRIU
//! and the stand-in CUDA driver of `tests/e2e_cuda_fake.rs`:
//!
//! - a process that is not CRIU's fork but looks like a restore's task (it holds an image pid,
//!   started after CRIU, blocks every signal) is never killed, CRIU failing or killed;
//! - two restores of the same images at once: one wins and runs on with its GPU state, the other
//!   fails, as without the plugin;
//! - CRIU killed after the restored tasks left its restore code but before their GPU state is
//!   back (inside `RESUME_DEVICES_LATE`, made slow): plain, with `--restore-sibling`, into a new
//!   pid namespace, and both (how runc restores), the tree is ended, never left running without its
//!   GPU state, and the next restore from the same images succeeds;
//! - the guardian itself killed in the middle of a dump and of a restore: CRIU's run goes on
//!   (CRIU never sees the guardian, whichever release it is).

use criu_gpu_test_support as common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::fake_cuda::*;
use common::scenario::*;
use common::{children_of, comm_of, ns_pid_of, reap_until_gone, signal, state_of};

/// The restored tree's host pids: the image's where it shares this pid namespace, else the
/// new init (adopted by this process, a subreaper) and its children.
fn restored_pids(d: &Dumped) -> Option<Vec<i32>> {
    if d.w.ns_pids == d.w.pids {
        return d.w.pids.iter().all(|&p| alive(p)).then(|| d.w.pids.clone());
    }
    // Killed tasks wait here as zombies until reaped.
    reap_until_gone(&[], Duration::ZERO);
    let root = children_of(std::process::id() as i32)
        .into_iter()
        .find(|&p| {
            alive(p) && ns_pid_of(p) == Some(1) && comm_of(p).as_deref() == Some("workload")
        })?;
    let mut pids = vec![root];
    pids.extend(children_of(root).into_iter().filter(|&p| alive(p)));
    Some(pids)
}

fn alive(pid: i32) -> bool {
    !matches!(state_of(pid), None | Some('Z' | 'X'))
}

/// Whether every process of `pids` holds its device memory and counts again.
fn running_with_gpu(d: &Dumped, pids: &[i32]) -> bool {
    let mut w = Workload {
        out: d.w.out.clone(),
        pids: d.w.pids.clone(),
        ns_pids: d.w.ns_pids.clone(),
    };
    if pids.len() != w.ns_pids.len() {
        return false;
    }
    w.moved_to(pids.to_vec());
    let c0: Vec<u64> = pids.iter().map(|&p| w.last_counter(p)).collect();
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        let all = pids.iter().zip(&c0).all(|(&p, &c)| {
            alive(p) && d.f.device_files(w.own_pid(p)).len() == d.files && w.last_counter(p) > c
        });
        if all {
            for &p in pids {
                w.verify(p);
                // The marker CRIU's forks inherit is gone once CRIU's restorer is done.
                let maps = std::fs::read_to_string(format!("/proc/{p}/maps")).unwrap_or_default();
                assert!(
                    !maps.contains("criu-gpu-plugin-restore"),
                    "pid {p} still maps the guardian's marker:\n{maps}"
                );
            }
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Kills every process of the restored tree and waits until the pids are free.
fn end_restored(d: &Dumped, pids: &[i32]) {
    for &p in pids {
        signal(p, libc::SIGKILL);
    }
    assert!(
        reap_until_gone(pids, Duration::from_secs(10)),
        "restored tree {pids:?} did not go"
    );
    d.f.clear_device_dir();
}

/// Starts CRIU with `args` (`-D` and `-o LOG` added); returns it running.
fn criu_start(d: &Dumped, args: &[&str], log: &str, env: &[(&str, String)]) -> std::process::Child {
    let _ = std::fs::remove_file(d.images.join(log));
    let mut cmd: Command = d.f.e.command(&d.f.e.criu);
    cmd.args(args).arg("-D").arg(&d.images).args(["-o", log]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start criu")
}

/// Waits (bounded) for CRIU to end; its exit code, `None` when a signal ended it.
fn criu_wait(child: &mut std::process::Child) -> Option<i32> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = child.try_wait().expect("wait for criu") {
            return st.code();
        }
        assert!(Instant::now() < until, "criu still runs after 60 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Polls CRIU's log `log` until a line holds `needle` (or CRIU ends); whether it was seen.
fn wait_log(d: &Dumped, child: &mut std::process::Child, log: &str, needle: &str) -> bool {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if std::fs::read_to_string(d.images.join(log)).is_ok_and(|t| t.contains(needle)) {
            return true;
        }
        if child.try_wait().ok().flatten().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_micros(300));
    }
    false
}

fn log_of(d: &Dumped, log: &str) -> String {
    std::fs::read_to_string(d.images.join(log)).unwrap_or_default()
}

/// A small program that takes pid `argv[1]` with `clone3(set_tid)`: the new process blocks
/// every signal, leaves the caller's session and sleeps (a daemon using `signalfd` looks the
/// same); the caller prints its pid and exits. Exit 3 when the pid is taken.
fn take_pid_binary() -> PathBuf {
    let src = common::build_dir().join("take_pid.c");
    std::fs::write(
        &src,
        r#"#define _GNU_SOURCE
#include <errno.h>
#include <linux/sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    pid_t want = argc > 1 ? (pid_t)atoi(argv[1]) : 0;
    struct clone_args a;
    memset(&a, 0, sizeof(a));
    a.exit_signal = SIGCHLD;
    a.set_tid = (uint64_t)(uintptr_t)&want;
    a.set_tid_size = 1;
    long r = syscall(SYS_clone3, &a, sizeof(a));
    if (r < 0)
        return errno == EEXIST ? 3 : 1;
    if (r == 0) {
        sigset_t all;
        sigfillset(&all);
        sigprocmask(SIG_BLOCK, &all, NULL);
        setsid();
        /* The caller's output pipe must see EOF once the caller exits. */
        close(0);
        close(1);
        close(2);
        for (;;)
            pause();
    }
    printf("%ld\n", r);
    return 0;
}
"#,
    )
    .expect("write take_pid.c");
    common::cc("take_pid", &[src.display().to_string()])
}

/// Kills a process this test made with [`take_pid_binary`] and waits until it is gone.
fn end_taker(pid: i32) {
    signal(pid, libc::SIGKILL);
    assert!(reap_until_gone(&[pid], Duration::from_secs(10)));
}

#[test]
fn a_process_that_only_looks_like_a_restored_task_is_never_killed() {
    let Some(d) = Dumped::new("guardian-lookalike", false) else {
        return;
    };
    let take = take_pid_binary();
    let args = ["restore", "-d", "-L", d.lib.as_str(), "-v4"];
    let mut tried = 0;
    for round in 0..12 {
        // The child's pid on even rounds, the root's on odd ones; CRIU killed on every third.
        let pid = d.w.pids[(round + 1) % 2];
        let kill_criu = round % 3 == 2;
        let mut criu = criu_start(&d, &args, "restore.log", &d.env);
        let out = Command::new(&take)
            .arg(pid.to_string())
            .output()
            .expect("run take_pid");
        if kill_criu {
            signal(criu.id() as i32, libc::SIGKILL);
        }
        let code = criu_wait(&mut criu);
        let taker: Option<i32> = String::from_utf8_lossy(&out.stdout).trim().parse().ok();
        let Some(taker) = taker else {
            // CRIU had the pid first: its restore goes on; end it.
            if code == Some(0) {
                end_restored(&d, &d.w.pids);
            } else {
                let _ = reap_until_gone(&d.w.pids, Duration::from_secs(5));
            }
            continue;
        };
        tried += 1;
        assert_ne!(
            code,
            Some(0),
            "round {round}: the restore cannot have its pid {pid}"
        );
        // The guardian acts within moments of CRIU's end; give it far more.
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            alive(taker),
            "round {round}: the process holding pid {pid}, not CRIU's, was killed (CRIU {}):\n{}",
            if kill_criu { "killed" } else { "failed" },
            log_of(&d, "restore.log")
        );
        end_taker(taker);
        assert!(
            reap_until_gone(&d.w.pids, Duration::from_secs(10)),
            "round {round}: the failed restore left {:?}",
            d.w.pids
                .iter()
                .map(|&p| (p, state_of(p)))
                .collect::<Vec<_>>()
        );
    }
    assert!(
        tried >= 3,
        "the look-alike took an image pid in {tried} of 12 rounds only"
    );
    // The images restore as before.
    d.f.criu(&args, &d.images, "last.log", &d.env).assert_ok();
    assert!(running_with_gpu(&d, &d.w.pids));
    end_restored(&d, &d.w.pids);
}

#[test]
fn two_restores_of_the_same_images_at_once_one_wins() {
    let Some(d) = Dumped::new("guardian-two-restores", false) else {
        return;
    };
    let args = ["restore", "-d", "-L", d.lib.as_str(), "-v4"];
    for round in 0..4 {
        let mut a = criu_start(&d, &args, "a.log", &d.env);
        let mut b = criu_start(&d, &args, "b.log", &d.env);
        let (ca, cb) = (criu_wait(&mut a), criu_wait(&mut b));
        // Both guardians act within moments of their CRIU's end.
        std::thread::sleep(Duration::from_millis(500));
        let won = [ca, cb].iter().filter(|c| **c == Some(0)).count();
        assert_eq!(
            won,
            1,
            "round {round}: exits {ca:?} and {cb:?}\n{}\n{}",
            log_of(&d, "a.log"),
            log_of(&d, "b.log")
        );
        assert!(
            running_with_gpu(&d, &d.w.pids),
            "round {round}: the winner's tree does not run with its GPU state: {:?}\n{}\n{}",
            d.w.pids
                .iter()
                .map(|&p| (p, state_of(p)))
                .collect::<Vec<_>>(),
            log_of(&d, "a.log"),
            log_of(&d, "b.log")
        );
        end_restored(&d, &d.w.pids);
    }
}

/// CRIU SIGKILLed inside `RESUME_DEVICES_LATE` (the driver's restore made 400 ms slow): the
/// tasks have left CRIU's restore code and run as soon as CRIU lets go of them.
fn late_kill(test: &str, in_pid_ns: bool, extra: &[&str]) {
    let Some(d) = Dumped::new(test, in_pid_ns) else {
        return;
    };
    let mut args = vec!["restore", "-d", "-L", d.lib.as_str(), "-v4"];
    args.extend_from_slice(extra);
    let mut slow = d.env.clone();
    slow.push(("FAKE_CUDA_SLOW", "restore=400".to_string()));
    for round in 0..3 {
        let mut criu = criu_start(&d, &args, "late.log", &slow);
        let seen = wait_log(
            &d,
            &mut criu,
            "late.log",
            "Run late stage hook from criu master",
        );
        signal(criu.id() as i32, libc::SIGKILL);
        let code = criu_wait(&mut criu);
        let log = log_of(&d, "late.log");
        assert!(
            seen && code.is_none(),
            "round {round}: CRIU was not killed late ({code:?}):\n{log}"
        );
        assert!(!log.contains("Restore finished successfully"), "{log}");
        // Either running with its GPU state, or ended: never alive without it.
        let until = Instant::now() + Duration::from_secs(3);
        let outcome = loop {
            let pids = restored_pids(&d);
            if let Some(p) = &pids
                && running_with_gpu(&d, p)
            {
                break format!("ran on with its GPU state: {p:?}");
            }
            let left: Vec<i32> = if in_pid_ns {
                pids.unwrap_or_default()
            } else {
                d.w.pids.iter().copied().filter(|&p| alive(p)).collect()
            };
            if left.is_empty() {
                break "ended".to_string();
            }
            assert!(
                Instant::now() < until,
                "round {round}: {:?} alive without their GPU state 3 s after CRIU was killed:\n{log}",
                left.iter()
                    .map(|&p| (p, state_of(p), d.f.device_files(d.w.own_pid(p))))
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        eprintln!("{test} round {round}: the restored tree {outcome}");
        if let Some(p) = restored_pids(&d) {
            end_restored(&d, &p);
        }
        let _ = reap_until_gone(&d.w.pids, Duration::from_secs(10));
        d.f.clear_device_dir();
        // The next restore from the same images succeeds and verifies.
        d.f.criu(&args[..5], &d.images, "again.log", &d.env)
            .assert_ok();
        let p = restored_pids(&d).expect("the restored tree");
        assert!(
            running_with_gpu(&d, &p),
            "round {round}: the restore after the kill"
        );
        end_restored(&d, &p);
    }
}

#[test]
fn criu_killed_late_in_a_plain_restore_leaves_no_task_without_its_gpu_state() {
    late_kill("guardian-late-plain", false, &[]);
}

#[test]
fn criu_killed_late_in_a_restore_sibling_restore_leaves_no_task_without_its_gpu_state() {
    late_kill("guardian-late-sibling", false, &["--restore-sibling"]);
}

#[test]
fn criu_killed_late_in_a_restore_into_a_new_pid_namespace_leaves_no_task_without_its_gpu_state() {
    late_kill("guardian-late-pidns", true, &[]);
}

/// How runc restores a container: a new pid namespace, the root a sibling of CRIU.
#[test]
fn criu_killed_late_in_a_sibling_restore_into_a_new_pid_namespace_leaves_no_task_without_its_gpu_state()
 {
    late_kill("guardian-late-pidns-sibling", true, &["--restore-sibling"]);
}

/// The guardian's pid, from CRIU's log line `... guardian N started`.
fn guardian_pid(log: &str, what: &str) -> Option<i32> {
    log.lines()
        .find(|l| l.contains(what) && l.ends_with("started"))?
        .split_whitespace()
        .rev()
        .nth(1)?
        .parse()
        .ok()
}

#[test]
fn a_killed_guardian_fails_no_criu_run() {
    let Some(d) = Dumped::new("guardian-killed", false) else {
        return;
    };
    // Restore: the guardian killed as soon as it is there; CRIU's restore goes on.
    let args = ["restore", "-d", "-L", d.lib.as_str(), "-v4"];
    let mut slow = d.env.clone();
    slow.push(("FAKE_CUDA_SLOW", "restore=200".to_string()));
    let mut criu = criu_start(&d, &args, "restore.log", &slow);
    assert!(wait_log(&d, &mut criu, "restore.log", "restore guardian"));
    let g = guardian_pid(&log_of(&d, "restore.log"), "restore guardian").expect("guardian pid");
    assert_ne!(children_of(criu.id() as i32).first(), Some(&g));
    signal(g, libc::SIGKILL);
    let code = criu_wait(&mut criu);
    assert_eq!(code, Some(0), "{}", log_of(&d, "restore.log"));
    assert!(running_with_gpu(&d, &d.w.pids));
    // Dump with --leave-running: the guardian killed after the first lock; a new one takes over
    // and the dump succeeds.
    let root = d.w.root().to_string();
    let mut slow = d.env.clone();
    slow.push(("FAKE_CUDA_SLOW", "checkpoint=300".to_string()));
    let dump_args = [
        "dump",
        "-t",
        root.as_str(),
        "-L",
        d.lib.as_str(),
        "-v4",
        "--leave-running",
    ];
    let images2 = d.f.e.images("img2");
    let _ = std::fs::remove_file(images2.join("dump.log"));
    let mut cmd: Command = d.f.e.command(&d.f.e.criu);
    cmd.args(dump_args)
        .arg("-D")
        .arg(&images2)
        .args(["-o", "dump.log"]);
    for (k, v) in &slow {
        cmd.env(k, v);
    }
    let mut criu = cmd.spawn().expect("start criu");
    let log_path = images2.join("dump.log");
    let until = Instant::now() + Duration::from_secs(30);
    let g = loop {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        if let Some(g) = guardian_pid(&text, "cuda: guardian") {
            break g;
        }
        assert!(
            Instant::now() < until,
            "no guardian in the dump's log:\n{text}"
        );
        std::thread::sleep(Duration::from_micros(300));
    };
    signal(g, libc::SIGKILL);
    let code = criu_wait(&mut criu);
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert_eq!(code, Some(0), "{text}");
    assert!(running_with_gpu(&d, &d.w.pids), "{text}");
    end_restored(&d, &d.w.pids);
    let _ = Path::new(&log_path);
}
