//! `suspend`, `resume` and `status`: CUDA processes suspended in place (locked and
//! checkpointed: their GPU memory moved into host memory, the GPU freed) and resumed again,
//! all at once, all or nothing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criu_gpu_core::session::{
    self, Claim, ClaimError, Found, GpuMemory, HeldBy, NotRunnable, Probe, ProbeError, Session,
    Timed,
};
use cuda_ckpt_sys::{GpuUuid, ProcessState};

use crate::report::{Outcome, Report, Skipped, mib};
use crate::{Failed, progress};

/// Processes the tool changed, for a rollback: (pid, restore thread, and whether the tool
/// locked it, or for a resume whether it was checkpointed).
type Touched = Vec<(i32, i32, bool)>;

/// Refuses, before anything is changed, a target with CUDA processes the driver cannot
/// answer for or in a state the command cannot start from.
fn blockers(probes: &[Probe], ok: &[ProcessState], what: &str) -> Result<(), Failed> {
    let mut why = Vec::new();
    // A process its tracer stops (a CRIU dump under way) is held, as a claimed one is.
    let mut held = false;
    for p in probes {
        match &p.found {
            Found::Cuda { state: Err(e), .. } => {
                held |= matches!(e, ProbeError::NotRunnable(NotRunnable::Traced { .. }));
                why.push(format!("pid {} ({}): {e}", p.pid, p.comm))
            }
            Found::Cuda { state: Ok(s), .. } if !ok.contains(s) => why.push(format!(
                "pid {} ({}) is in CUDA state {s}, from which it cannot be {what}",
                p.pid, p.comm
            )),
            _ => {}
        }
    }
    if why.is_empty() {
        return Ok(());
    }
    let message = format!("nothing was changed: {}", why.join("; "));
    Err(if held {
        Failed::busy(message)
    } else {
        Failed::new(message)
    })
}

fn skipped(probes: &[Probe]) -> Vec<Skipped> {
    probes
        .iter()
        .filter(|p| matches!(p.found, Found::NotCuda | Found::Gone))
        .map(|p| Skipped {
            pid: p.pid,
            comm: p.comm.clone(),
            why: p.state_word(),
        })
        .collect()
}

fn failures(results: &[Timed]) -> Vec<(i32, String)> {
    results
        .iter()
        .filter_map(|(pid, r, _)| r.as_ref().err().map(|e| (*pid, e.to_string())))
        .collect()
}

fn took(results: &[Timed], pid: i32) -> Duration {
    results.iter().filter(|r| r.0 == pid).map(|r| r.2).sum()
}

/// Free memory summed over every GPU NVML knows.
fn free_total(m: &Option<BTreeMap<GpuUuid, GpuMemory>>) -> Option<u64> {
    m.as_ref().map(|m| m.values().map(|g| g.free).sum())
}

/// Puts back `touched` after a failure and says how it went.
fn roll_back(report: &mut Report, results: Vec<Timed>, what: &str) {
    progress(&format!("rolling back {} process(es)", results.len()));
    report.rolled_back = true;
    for (pid, r, _) in results {
        match r {
            Ok(()) => {
                if let Some(o) = report.processes.iter_mut().find(|o| o.pid == pid) {
                    o.after = o.before.clone();
                }
            }
            Err(e) => report.rollback_failures.push(format!(
                "pid {pid} could not be {what}: {e}; check it with `criu-gpu status {pid}`"
            )),
        }
    }
}

/// Takes the plugin's per-process claim (the lock a CRIU dump holds from `PAUSE_DEVICES` to its
/// end) on every target, held for the command's whole run: a CRIU or another `criu-gpu` acting
/// on one of them at the same time would leave it in a state neither expects (a dump exiting 0
/// with an image that cannot be restored, a resume undone behind its back). Nothing is changed
/// when any is held elsewhere; the refusal names each holder and what to do about it (a stopped
/// one holds the process until it is continued or ended). Where no claim can be made at all
/// (neither lock directory usable), nothing is changed either: the command could race a CRIU.
fn claim_all(pids: &[i32]) -> Result<Vec<Claim>, Failed> {
    let mut claims = Vec::with_capacity(pids.len());
    // Busy pids, grouped by who holds them.
    let mut busy: Vec<(HeldBy, Vec<i32>)> = Vec::new();
    let mut warned = false;
    for &pid in pids {
        // A process gone meanwhile has nothing to guard; the probe reports it gone.
        let Some(start) = session::start_time(pid) else {
            continue;
        };
        match session::claim(pid, start) {
            Ok(c) => {
                if let Some(p) = c.fallback_from()
                    && !warned
                {
                    warned = true;
                    progress(&format!(
                        "warning: the per-process claims cannot be taken in {p}; they are taken in {} instead, where the plugin looks too",
                        session::FALLBACK_DIR
                    ));
                }
                claims.push(c);
            }
            Err(ClaimError::Busy(held)) => match busy.iter_mut().find(|b| b.0 == held) {
                Some(b) => b.1.push(pid),
                None => busy.push((held, vec![pid])),
            },
            Err(ClaimError::Unavailable(problems)) => {
                return Err(Failed::new(format!(
                    "nothing was changed: no per-process claim can be taken ({}), and without one criu-gpu could act on pid {pid} while a CRIU does; make {} (or {}) a writable directory of root's",
                    ClaimError::problems(&problems),
                    session::LOCK_DIR,
                    session::FALLBACK_DIR
                )));
            }
        }
    }
    if busy.is_empty() {
        return Ok(claims);
    }
    let shown: Vec<String> = busy
        .iter()
        .take(8)
        .map(|(held, pids)| {
            let first = pids[0];
            let others = if pids.len() > 1 {
                let rest: Vec<String> = pids[1..].iter().take(8).map(|p| p.to_string()).collect();
                let more = pids.len().saturating_sub(9);
                format!(
                    " (so are pid(s) {}{})",
                    rest.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    }
                )
            } else {
                String::new()
            };
            format!("pid {first} {}{others}", held.describe(first))
        })
        .collect();
    Err(Failed::busy(format!(
        "nothing was changed: {}",
        shown.join("; ")
    )))
}

/// Asks the driver where every process the command acted on ended up, so that the report says
/// what is true rather than what the calls returned: a process whose state is not the one the
/// command meant to leave (or cannot be asked) is named as not done.
fn verify(s: &Session, report: &mut Report) {
    let pids: Vec<i32> = report.processes.iter().map(|o| o.pid).collect();
    if pids.is_empty() {
        return;
    }
    let probes = s.probe(&pids);
    for o in &mut report.processes {
        let actual = probes
            .iter()
            .find(|p| p.pid == o.pid)
            .map_or_else(|| "gone".to_string(), |p| p.state_word());
        if actual == o.after {
            continue;
        }
        let why = format!(
            "the driver reports it {actual} afterwards, not {}; check it with `criu-gpu status {}`",
            o.after, o.pid
        );
        o.after = actual;
        o.bytes = None;
        if report.rolled_back {
            report
                .rollback_failures
                .push(format!("pid {}: {why}", o.pid));
        } else if !report.failed.iter().any(|f| f.0 == o.pid) {
            report.failed.push((o.pid, why));
        }
    }
}

/// `suspend`: lock every running CUDA process, then checkpoint every locked one, under the
/// claims of [`claim_all`]; the end states are checked with the driver.
pub fn suspend(s: &Session, pids: &[i32], timeout: Duration) -> Result<Report, Failed> {
    let _claims = claim_all(pids)?;
    let mut report = suspend_claimed(s, pids, timeout)?;
    verify(s, &mut report);
    Ok(report)
}

fn suspend_claimed(s: &Session, pids: &[i32], timeout: Duration) -> Result<Report, Failed> {
    let started = Instant::now();
    let probes = s.probe(pids);
    blockers(
        &probes,
        &[
            ProcessState::Running,
            ProcessState::Locked,
            ProcessState::Checkpointed,
        ],
        "suspended",
    )?;
    let mut report = Report::new("suspend", skipped(&probes));
    let cuda: Vec<&Probe> = probes.iter().filter(|p| p.state().is_some()).collect();
    for p in cuda
        .iter()
        .filter(|p| p.state() == Some(ProcessState::Checkpointed))
    {
        report.skipped.push(Skipped {
            pid: p.pid,
            comm: p.comm.clone(),
            why: "already checkpointed".into(),
        });
    }
    let todo: Vec<&&Probe> = cuda
        .iter()
        .filter(|p| p.state() != Some(ProcessState::Checkpointed))
        .collect();
    let to_lock: Vec<i32> = todo
        .iter()
        .filter(|p| p.state() == Some(ProcessState::Running))
        .map(|p| p.pid)
        .collect();
    let mem_before = s.gpu_memory();
    for p in &todo {
        report
            .processes
            .push(Outcome::new(p, session::rss_bytes(p.pid)));
    }
    if todo.is_empty() {
        report.wall = started.elapsed();
        return Ok(report);
    }
    progress(&format!(
        "locking {} process(es) (timeout {:.1} s)",
        to_lock.len(),
        timeout.as_secs_f64()
    ));
    let locked = s.lock(&to_lock, timeout);
    let lock_failed = failures(&locked);
    let locked_ok: Touched = locked
        .iter()
        .filter(|r| r.1.is_ok())
        .filter_map(|r| {
            todo.iter()
                .find(|p| p.pid == r.0)
                .map(|p| (p.pid, p.tid().unwrap_or(0), true))
        })
        .collect();
    for o in &mut report.processes {
        o.took += took(&locked, o.pid);
        if locked_ok.iter().any(|t| t.0 == o.pid) {
            o.after = "locked".into();
        }
    }
    if !lock_failed.is_empty() {
        report.fail(lock_failed.iter().map(|(pid, e)| {
            let hint =
                if e.contains("NOT_READY") || e.contains("timed out") || e.contains("TIMEOUT") {
                    " (its GPU work did not finish in time: raise --timeout)"
                } else {
                    ""
                };
            (*pid, format!("lock failed: {e}{hint}"))
        }));
        let back = s.put_back(&locked_ok);
        roll_back(&mut report, back, "unlocked again");
        report.wall = started.elapsed();
        return Ok(report);
    }
    progress(&format!("checkpointing {} process(es)", todo.len()));
    let procs: Vec<(i32, i32)> = todo.iter().map(|p| (p.pid, p.tid().unwrap_or(0))).collect();
    let ckpt = s.checkpoint(&procs);
    for o in &mut report.processes {
        o.took += took(&ckpt, o.pid);
        if ckpt.iter().any(|r| r.0 == o.pid && r.1.is_ok()) {
            o.after = "checkpointed".into();
            o.bytes = Some(session::rss_bytes(o.pid).saturating_sub(o.rss_before));
        }
    }
    let failed = failures(&ckpt);
    if !failed.is_empty() {
        report.fail(
            failed
                .iter()
                .map(|(pid, e)| (*pid, format!("checkpoint failed: {e}"))),
        );
        let touched: Touched = todo
            .iter()
            .map(|p| (p.pid, p.tid().unwrap_or(0), to_lock.contains(&p.pid)))
            .collect();
        let back = s.put_back(&touched);
        roll_back(&mut report, back, "put back as it was found");
        for o in &mut report.processes {
            o.bytes = None;
        }
        report.wall = started.elapsed();
        return Ok(report);
    }
    report.gpu_free_before = free_total(&mem_before);
    report.gpu_free_after = free_total(&s.gpu_memory());
    report.wall = started.elapsed();
    Ok(report)
}

/// `resume`: restore every checkpointed CUDA process (onto `map`'s GPUs) and unlock it, and
/// unlock every locked one, under the claims of [`claim_all`]; each process's end state is
/// checked with the driver before it is reported resumed.
pub fn resume(s: &Session, pids: &[i32], map: Option<&str>) -> Result<Report, Failed> {
    let _claims = claim_all(pids)?;
    let mut report = resume_claimed(s, pids, map)?;
    verify(s, &mut report);
    Ok(report)
}

fn resume_claimed(s: &Session, pids: &[i32], map: Option<&str>) -> Result<Report, Failed> {
    let started = Instant::now();
    let text = map.unwrap_or(&s.settings.device_map);
    let pairs = session::parse_device_map(text).map_err(|e| {
        Failed::new(format!(
            "--device-map: {e}; write OLD=NEW pairs of GPU UUIDs (as `nvidia-smi -L` prints them), separated by commas"
        ))
    })?;
    if !pairs.is_empty() && s.version < cuda_ckpt_sys::GPU_PAIRS_VERSION {
        return Err(Failed::new(format!(
            "restoring onto other GPUs needs driver 580 (CUDA 13.0) or later; this one supports CUDA {}: resume without --device-map",
            cuda_ckpt_sys::format_version(s.version)
        )));
    }
    let probes = s.probe(pids);
    blockers(
        &probes,
        &[
            ProcessState::Running,
            ProcessState::Locked,
            ProcessState::Checkpointed,
        ],
        "resumed",
    )?;
    let mut report = Report::new("resume", skipped(&probes));
    let mut todo: Touched = Vec::new();
    for p in probes.iter().filter(|p| p.state().is_some()) {
        match p.state() {
            Some(ProcessState::Running) => report.skipped.push(Skipped {
                pid: p.pid,
                comm: p.comm.clone(),
                why: "already running".into(),
            }),
            Some(st) => {
                todo.push((
                    p.pid,
                    p.tid().unwrap_or(0),
                    st == ProcessState::Checkpointed,
                ));
                report
                    .processes
                    .push(Outcome::new(p, session::rss_bytes(p.pid)));
            }
            None => {}
        }
    }
    if todo.is_empty() {
        report.wall = started.elapsed();
        return Ok(report);
    }
    let mem_before = s.gpu_memory();
    progress(&format!(
        "restoring and unlocking {} process(es)",
        todo.len()
    ));
    let results = s.restore(&todo, &pairs);
    for o in &mut report.processes {
        o.took += took(&results, o.pid);
        if results.iter().any(|r| r.0 == o.pid && r.1.is_ok()) {
            o.after = "running".into();
            o.bytes = Some(o.rss_before.saturating_sub(session::rss_bytes(o.pid)));
        }
    }
    let failed = failures(&results);
    if !failed.is_empty() {
        report.fail(
            failed
                .iter()
                .map(|(pid, e)| (*pid, format!("restore failed: {e}"))),
        );
        let mut done: Touched = todo
            .iter()
            .filter(|t| results.iter().any(|r| r.0 == t.0 && r.1.is_ok()))
            .copied()
            .collect();
        // A failed restore may have gone half-way (restored, then the unlock failed): the
        // driver says where each failed process is now.
        let failed_pids: Vec<i32> = failed.iter().map(|(pid, _)| *pid).collect();
        let mut locked_now: Touched = Vec::new();
        for p in s.probe(&failed_pids) {
            let Some(t) = todo.iter().find(|t| t.0 == p.pid) else {
                continue;
            };
            match p.state() {
                Some(ProcessState::Running) => done.push(*t),
                Some(ProcessState::Locked) if t.2 => locked_now.push(*t),
                _ => {}
            }
        }
        suspend_again(s, &mut report, &done, &locked_now);
        for o in &mut report.processes {
            o.bytes = None;
        }
        report.wall = started.elapsed();
        return Ok(report);
    }
    report.gpu_free_before = free_total(&mem_before);
    report.gpu_free_after = free_total(&s.gpu_memory());
    report.wall = started.elapsed();
    Ok(report)
}

/// The rollback of a resume: the processes resumed are locked again, and those that were
/// checkpointed checkpointed again; `locked_now` were restored but left locked by a failed
/// unlock, and only need their checkpoint again.
fn suspend_again(s: &Session, report: &mut Report, done: &Touched, locked_now: &Touched) {
    progress(&format!(
        "rolling back {} process(es)",
        done.len() + locked_now.len()
    ));
    report.rolled_back = true;
    let pids: Vec<i32> = done.iter().map(|t| t.0).collect();
    let timeout = Duration::from_millis(s.settings.lock_timeout_ms);
    let locked = s.lock(&pids, timeout);
    let mut back: Vec<Timed> = Vec::new();
    let mut again = Vec::new();
    for (pid, r, t) in locked {
        let was_ckpt = done.iter().any(|d| d.0 == pid && d.2);
        match r {
            Ok(()) if was_ckpt => {
                if let Some(d) = done.iter().find(|d| d.0 == pid) {
                    again.push((d.0, d.1));
                }
            }
            r => back.push((pid, r, t)),
        }
    }
    again.extend(locked_now.iter().map(|d| (d.0, d.1)));
    back.extend(s.checkpoint(&again));
    roll_back(report, back, "suspended again");
}

/// `status`: each process's CUDA state, restore thread and GPUs.
pub fn status(s: &Session, pids: &[i32]) -> (String, serde_json::Value) {
    let probes = s.probe(pids);
    let mut text = format!(
        "{:<8} {:<16} {:<13} {:<12} {}\n",
        "PID", "COMMAND", "CUDA STATE", "RESTORE TID", "GPUS"
    );
    let mut rows = Vec::new();
    for p in &probes {
        let gpus: Vec<String> = match p.found {
            Found::Cuda { .. } => s.gpus_of(p.pid).iter().map(|u| u.to_string()).collect(),
            _ => Vec::new(),
        };
        let note = match &p.found {
            Found::Cuda { state: Err(e), .. } => Some(e.to_string()),
            _ => None,
        };
        text.push_str(&format!(
            "{:<8} {:<16} {:<13} {:<12} {}\n",
            p.pid,
            p.comm,
            p.state_word(),
            p.tid().map_or("-".into(), |t| t.to_string()),
            if gpus.is_empty() {
                if p.tid().is_some() {
                    "unknown".into()
                } else {
                    "-".into()
                }
            } else {
                gpus.join(",")
            }
        ));
        if let Some(n) = &note {
            text.push_str(&format!("         {n}\n"));
        }
        rows.push(serde_json::json!({
            "pid": p.pid,
            "command": p.comm,
            "state": p.state_word(),
            "restore_tid": p.tid(),
            "gpus": gpus,
            "note": note,
        }));
    }
    let n = probes.iter().filter(|p| p.tid().is_some()).count();
    text.push_str(&format!(
        "{} process(es), {n} using CUDA; GPU memory as NVML reports it: {}\n",
        probes.len(),
        match free_total(&s.gpu_memory()) {
            Some(f) => format!("{} free", mib(f)),
            None => "unknown".into(),
        }
    ));
    (
        text,
        serde_json::json!({"command": "status", "processes": rows}),
    )
}
