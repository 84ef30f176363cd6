//! `criu-gpu suspend`, `resume` and `status` on the stand-in CUDA driver: a process tree, a
//! cgroup (v1 and v2), all-or-nothing rollback when one process fails half-way, processes
//! without CUDA skipped.

mod support;

use support::{Cgroup, T, wait_until};

fn count(hay: &str, needle: &str) -> usize {
    hay.matches(needle).count()
}

#[test]
fn a_tree_is_suspended_and_resumed_in_place() {
    let t = T::start("tree");
    let w = t.workload("w", 2, 8);
    let root = w.root().to_string();
    for &p in &w.pids {
        assert!(t.device_files(p) > 0, "pid {p} has device memory");
    }

    let st = t.tool(&["status", &root], &[]);
    assert_eq!(st.code, Some(0));
    assert_eq!(count(&st.stdout, " running "), 3, "{}", st.stdout);

    let s = t.tool(&["suspend", &root, "--json"], &[]);
    assert_eq!(s.code, Some(0), "{s:?}");
    assert_eq!(
        count(&s.stdout, r#""after":"checkpointed""#),
        3,
        "{}",
        s.stdout
    );
    assert_eq!(count(&s.stdout, r#""before":"running""#), 3);
    assert!(s.stdout.contains(r#""ok":true"#));
    assert!(
        s.stderr.contains("locking 3 process(es)"),
        "progress: {}",
        s.stderr
    );
    for &p in &w.pids {
        assert_eq!(t.device_files(p), 0, "pid {p}: GPU memory not freed");
        assert_eq!(t.transitions(p), ["lock=0", "checkpoint=0"]);
        w.assert_frozen(p);
    }
    // The GPU bytes moved are each process's resident-set growth, as the plugin logs them.
    assert!(!s.stdout.contains(r#""gpu_bytes":null"#), "{}", s.stdout);

    let st = t.tool(&["status", &root, "--json"], &[]);
    assert_eq!(
        count(&st.stdout, r#""state":"checkpointed""#),
        3,
        "{}",
        st.stdout
    );

    // Suspending again changes nothing: every process is skipped as already checkpointed.
    let again = t.tool(&["suspend", &root], &[]);
    assert_eq!(again.code, Some(0));
    assert_eq!(
        count(&again.stdout, "already checkpointed"),
        3,
        "{}",
        again.stdout
    );

    t.clear_calls();
    let r = t.tool(&["resume", &root], &[]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(
        r.stdout.contains("total: 3 process(es) resumed"),
        "{}",
        r.stdout
    );
    for &p in &w.pids {
        assert!(t.device_files(p) > 0, "pid {p}: GPU memory not back");
        assert_eq!(t.transitions(p), ["restore=0", "unlock=0"]);
    }
    w.assert_running();

    let st = t.tool(&["status", &root], &[]);
    assert_eq!(count(&st.stdout, " running "), 3, "{}", st.stdout);
    let r = t.tool(&["resume", &root], &[]);
    assert_eq!(count(&r.stdout, "already running"), 3, "{}", r.stdout);
}

fn cgroup_case(hierarchy: &str, name: &str) {
    let t = T::start(name);
    let Some(cg) = Cgroup::new(hierarchy, name) else {
        return;
    };
    let w = t.workload("w", 1, 4);
    let sleeper = t.spawn(std::path::Path::new("sleep"), &["60"]);
    // The workload's root in the cgroup, its child and a process without CUDA in a sub-cgroup.
    cg.add(false, w.pids[0]);
    cg.add(true, w.pids[1]);
    cg.add(true, sleeper);
    let path = cg.dir.display().to_string();

    let s = t.tool(&["suspend", "--cgroup", &path], &[]);
    assert_eq!(s.code, Some(0), "{s:?}");
    assert!(
        s.stdout
            .contains(&format!("skipped: pid {sleeper} (sleep): not CUDA")),
        "{}",
        s.stdout
    );
    assert!(
        s.stdout.contains("total: 2 process(es) suspended"),
        "{}",
        s.stdout
    );
    for &p in &w.pids {
        assert_eq!(t.device_files(p), 0, "pid {p}");
    }
    let st = t.tool(&["status", "--cgroup", &path], &[]);
    assert_eq!(count(&st.stdout, "checkpointed"), 2, "{}", st.stdout);
    assert!(st.stdout.contains("not CUDA"), "{}", st.stdout);

    let r = t.tool(&["resume", "--cgroup", &path, "--json"], &[]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert_eq!(count(&r.stdout, r#""after":"running""#), 2, "{}", r.stdout);
    w.assert_running();
    drop(cg);
}

#[test]
fn a_v1_cgroup_is_suspended_and_resumed() {
    cgroup_case("/sys/fs/cgroup/pids", "cg-v1");
}

#[test]
fn a_v2_cgroup_is_suspended_and_resumed() {
    cgroup_case("/sys/fs/cgroup/unified", "cg-v2");
}

#[test]
fn a_checkpoint_failure_half_way_puts_every_process_back() {
    let t = T::start("rollback");
    let w = t.workload("w", 2, 4);
    let bad = w.pids[2];
    let rule = format!("checkpoint@{bad}");
    let s = t.tool(
        &["suspend", &w.root().to_string()],
        &[("FAKE_CUDA_FAIL", &rule)],
    );
    assert_eq!(s.code, Some(1), "{s:?}");
    assert!(
        s.stderr
            .contains(&format!("suspend failed: pid {bad}: checkpoint failed")),
        "{}",
        s.stderr
    );
    assert!(
        s.stderr.contains("every process was put back"),
        "{}",
        s.stderr
    );
    assert!(
        s.stdout.contains("total: 0 process(es) suspended"),
        "{}",
        s.stdout
    );
    for &p in &w.pids {
        let tr = t.transitions(p);
        assert_eq!(
            tr.first().map(String::as_str),
            Some("lock=0"),
            "pid {p}: {tr:?}"
        );
        assert_eq!(
            tr.last().map(String::as_str),
            Some("unlock=0"),
            "pid {p}: {tr:?}"
        );
        if p != bad {
            assert_eq!(
                tr,
                ["lock=0", "checkpoint=0", "restore=0", "unlock=0"],
                "pid {p}"
            );
        }
    }
    w.assert_running();
}

#[test]
fn a_restore_failure_half_way_suspends_the_others_again() {
    let t = T::start("resume-rollback");
    let w = t.workload("w", 2, 4);
    let root = w.root().to_string();
    assert_eq!(t.tool(&["suspend", &root], &[]).code, Some(0));
    let bad = w.pids[1];
    let rule = format!("restore@{bad}");
    t.clear_calls();
    let r = t.tool(&["resume", &root, "--json"], &[("FAKE_CUDA_FAIL", &rule)]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stdout.contains(r#""ok":false"#), "{}", r.stdout);
    assert!(
        r.stdout
            .contains(&format!(r#""failed":[{{"pid":{bad},"why":"restore failed"#)),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains(r#""rolled_back":true"#));
    for &p in &w.pids {
        if p != bad {
            assert_eq!(
                t.transitions(p),
                ["restore=0", "unlock=0", "lock=0", "checkpoint=0"],
                "pid {p}"
            );
        }
    }
    let st = t.tool(&["status", &root, "--json"], &[]);
    assert_eq!(
        count(&st.stdout, r#""state":"checkpointed""#),
        3,
        "{}",
        st.stdout
    );
    // Without the failure, all of them come back.
    assert_eq!(t.tool(&["resume", &root], &[]).code, Some(0));
    w.assert_running();
}

#[test]
fn a_lock_that_times_out_leaves_every_process_running() {
    let t = T::start("lock-timeout");
    let w = t.workload("w", 1, 4);
    // SIGUSR2 holds a busy section for 3 s: a lock of 200 ms cannot drain it.
    // SAFETY: kill(2) of a workload this test started.
    unsafe { libc::kill(w.pids[1], libc::SIGUSR2) };
    w.wait_line(w.pids[1], "hold begin");
    let s = t.tool(
        &["suspend", &w.root().to_string(), "--timeout", "200ms"],
        &[],
    );
    assert_eq!(s.code, Some(1), "{s:?}");
    assert!(
        s.stderr
            .contains(&format!("pid {}: lock failed", w.pids[1])),
        "{}",
        s.stderr
    );
    assert!(s.stderr.contains("raise --timeout"), "{}", s.stderr);
    assert_eq!(t.transitions(w.pids[0]), ["lock=0", "unlock=0"]);
    w.wait_line(w.pids[1], "hold end");
    w.assert_running();
}

#[test]
fn a_stopped_process_is_refused_before_anything_changes() {
    let t = T::start("stopped");
    let w = t.workload("w", 1, 4);
    // SAFETY: kill(2) of a workload this test started.
    unsafe { libc::kill(w.pids[1], libc::SIGSTOP) };
    // SIGSTOP reaches the threads one by one: suspend only once every one has stopped.
    wait_until(format!("pid {} stopped", w.pids[1]), || {
        all_threads_stopped(w.pids[1])
    });
    let s = t.tool(&["suspend", &w.root().to_string()], &[]);
    assert_eq!(s.code, Some(1), "{s:?}");
    assert!(s.stderr.contains("nothing was changed"), "{}", s.stderr);
    assert!(
        s.stderr.contains(&format!("kill -CONT {}", w.pids[1])),
        "{}",
        s.stderr
    );
    assert!(t.transitions(w.pids[0]).is_empty());
    // SAFETY: as above.
    unsafe { libc::kill(w.pids[1], libc::SIGCONT) };
    w.assert_running();
}

/// A process its tracer has stopped (as a CRIU dump's seize does, before its plugin takes the
/// claim) is refused as held, exit 4, naming the tracer; nothing changes, and it runs on once
/// let go.
#[test]
fn a_process_its_tracer_stopped_is_refused_as_held() {
    let t = T::start("traced");
    let w = t.workload("w", 1, 4);
    let pid = w.pids[1];
    let (seized, tracer_ready) = std::sync::mpsc::channel();
    let (let_go, told) = std::sync::mpsc::channel::<()>();
    // Ptrace stops belong to the tracer thread: it seizes, stops, waits and detaches.
    let tracer = std::thread::spawn(move || {
        let tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("the workload's threads")
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        for &tid in &tids {
            // SAFETY: ptrace and waitpid on threads of a workload this test started; the
            // status pointer is a local.
            unsafe {
                assert_eq!(
                    libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0),
                    0,
                    "seize {tid}"
                );
                assert_eq!(
                    libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0),
                    0,
                    "stop {tid}"
                );
                let mut status = 0;
                assert_eq!(
                    libc::waitpid(tid, &mut status, libc::__WALL),
                    tid,
                    "wait {tid}"
                );
            }
        }
        // SAFETY: gettid has no preconditions.
        seized.send(unsafe { libc::gettid() }).unwrap();
        let _ = told.recv();
        for &tid in &tids {
            // SAFETY: as above; detaching lets the thread run on.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0) };
        }
    });
    let tracer_tid = tracer_ready
        .recv()
        .expect("the tracer stopped the workload");
    let s = t.tool(&["suspend", &w.root().to_string()], &[]);
    let_go.send(()).unwrap();
    tracer.join().expect("the tracer thread");
    assert_eq!(s.code, Some(4), "{s:?}");
    for want in [
        "nothing was changed".to_string(),
        format!("it is stopped by pid {tracer_tid} ("),
        format!("try again once pid {tracer_tid} has let it go"),
    ] {
        assert!(s.stderr.contains(&want), "{want}: {}", s.stderr);
    }
    assert!(t.transitions(w.pids[0]).is_empty());
    w.assert_running();
}

#[test]
fn usage_errors_and_missing_targets_say_what_to_do() {
    let t = T::start("usage");
    let r = t.tool(&["suspend"], &[]);
    assert_eq!(r.code, Some(2));
    assert!(
        r.stderr.contains("needs a TARGET") && r.stderr.contains("criu-gpu help suspend"),
        "{}",
        r.stderr
    );
    let r = t.tool(&["status", "999999999"], &[]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("no process 999999999"), "{}", r.stderr);
    let r = t.tool(
        &["status", "1"],
        &[("CRIU_GPU_CUDA_NVIDIA_PROC", "/nonexistent")],
    );
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("no NVIDIA driver here"), "{}", r.stderr);
    let h = t.tool(&["help", "suspend"], &[]);
    assert_eq!(h.code, Some(0));
    assert!(h.stdout.contains("SYNOPSIS") && h.stdout.contains("All or nothing"));
    let h = t.tool(&["--help"], &[]);
    assert!(h.stdout.contains("EXIT STATUS"));
}

/// A process another CRIU or criu-gpu holds (its claim in /run/criu-gpu-plugin/, taken here as
/// criu-gpu takes it) is refused with exit status 4, naming the holder, and nothing is changed; once the claim ends
/// the same command works, and criu-gpu leaves no claim behind.
#[test]
fn a_process_claimed_elsewhere_is_refused_and_left_alone() {
    use criu_gpu_core::session;
    let t = T::start("claimed");
    let w = t.workload("w", 1, 4);
    let root = w.root().to_string();
    let child = w.pids[1];
    let hold = || session::claim(child, session::start_time(child).unwrap()).unwrap();

    let claim = hold();
    let s = t.tool(&["suspend", &root], &[]);
    assert_eq!(s.code, Some(4), "{s:?}");
    // The claim names its holder: this test, as criu-gpu.
    assert!(
        s.stderr.contains(&format!(
            "nothing was changed: pid {child} is held by criu-gpu {} right now",
            std::process::id()
        )),
        "{}",
        s.stderr
    );
    for &p in &w.pids {
        assert!(
            t.transitions(p).is_empty(),
            "pid {p}: {:?}",
            t.transitions(p)
        );
    }
    w.assert_running();
    drop(claim);

    let s = t.tool(&["suspend", &root], &[]);
    assert_eq!(s.code, Some(0), "{s:?}");
    let claim = hold();
    let r = t.tool(&["resume", &root], &[]);
    assert_eq!(r.code, Some(4), "{r:?}");
    for &p in &w.pids {
        assert_eq!(t.transitions(p), ["lock=0", "checkpoint=0"], "pid {p}");
        w.assert_frozen(p);
    }
    drop(claim);
    let r = t.tool(&["resume", &root], &[]);
    assert_eq!(r.code, Some(0), "{r:?}");
    w.assert_running();
    // Taken again at once: criu-gpu's claims ended with it.
    drop(hold());
}

/// `resume` reports as resumed only what the driver confirms running at the end: a process
/// whose final state cannot be had is named, the others counted, and the exit status says not
/// everything is as it should be.
#[test]
fn resume_reports_only_what_the_driver_confirms() {
    let t = T::start("confirm");
    let w = t.workload("w", 2, 4);
    let root = w.root().to_string();
    let child = w.pids[1];
    let s = t.tool(&["suspend", &root], &[]);
    assert_eq!(s.code, Some(0), "{s:?}");
    // The child's second state query (the first is the probe) is the final check.
    let rule = format!("get_state:2@{child}");
    let r = t.tool(&["resume", &root, "--json"], &[("FAKE_CUDA_FAIL", &rule)]);
    assert_eq!(r.code, Some(3), "{r:?}");
    assert!(
        r.stderr.contains(&format!(
            "resume failed: pid {child}: the driver reports it unknown afterwards, not running"
        )),
        "{}",
        r.stderr
    );
    assert_eq!(count(&r.stdout, r#""after":"running""#), 2, "{}", r.stdout);
    assert_eq!(count(&r.stdout, r#""after":"unknown""#), 1, "{}", r.stdout);
    let r = t.tool(&["resume", &root], &[("FAKE_CUDA_FAIL", &rule)]);
    assert!(r.stdout.contains("already running"), "{}", r.stdout);
    w.assert_running();
}

/// Whether every thread of `pid` is in state T (stopped).
fn all_threads_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T'))
        })
    })
}
