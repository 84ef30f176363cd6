//! The executor inside a helper process: driver calls on threads of the helper's, each
//! answered when it returns, when its target ends, or (for state queries) when its wait is up.
//! A call stuck in the driver keeps its thread; the helper's `_exit` after its answer ends it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cuda_ckpt_sys::{Driver, DriverError, ProcessState};

use super::super::error::CallError;
use super::super::procfs;
use super::super::step::Timed;
use super::protocol::StateAnswer;

/// Inside a helper: the state of each of `pids`, each query on its own thread, so that a
/// target that never answers costs only its own answer: what has not answered within `wait`
/// is `None`.
pub(super) fn states_within(
    driver: &Driver,
    pids: &[i32],
    wait: Duration,
) -> Vec<(i32, StateAnswer)> {
    let (tx, rx) = std::sync::mpsc::channel();
    for &pid in pids {
        let (mine, d) = (tx.clone(), driver.clone());
        // The helper is `_exit`ed after its reply: a thread stuck in the driver goes with it,
        // which is why these are not scoped (joined) threads.
        let started = std::thread::Builder::new().spawn(move || {
            let _ = mine.send((pid, d.process_state(pid)));
        });
        if started.is_err() {
            let _ = tx.send((pid, driver.process_state(pid)));
        }
    }
    drop(tx);
    let until = Instant::now() + wait;
    let mut got: BTreeMap<i32, Result<ProcessState, DriverError>> = BTreeMap::new();
    while got.len() < pids.len() {
        match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok((pid, r)) => {
                got.insert(pid, r);
            }
            Err(_) => break,
        }
    }
    pids.iter().map(|&pid| (pid, got.remove(&pid))).collect()
}

/// What the worker threads of [`watched_calls`] share.
struct Calls {
    next: std::sync::atomic::AtomicUsize,
    under_way: Vec<std::sync::atomic::AtomicBool>,
}

/// Inside a helper: `op` for each of `pids` (by its index), each answered when it returns or
/// when its target ends, whichever comes first. Threads stuck in a call to a dead target stay
/// behind; the helper's `_exit` ends them.
pub(super) fn watched_calls(
    pids: &[i32],
    parallel: bool,
    op: &(impl Fn(usize) -> Result<(), CallError> + Sync),
) -> Vec<Timed> {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    let began = Instant::now();
    let pidfds: Vec<Option<std::os::fd::OwnedFd>> = pids
        .iter()
        .map(|&p| criu_plugin::proc::pidfd(p).ok())
        .collect();
    let calls = Arc::new(Calls {
        next: 0.into(),
        under_way: pids.iter().map(|_| false.into()).collect(),
    });
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<(), CallError>, Duration)>();
    let worker = |calls: Arc<Calls>, tx: std::sync::mpsc::Sender<_>| {
        move || {
            loop {
                let k = calls.next.fetch_add(1, Ordering::SeqCst);
                let Some(&pid) = pids.get(k) else { return };
                calls.under_way[k].store(true, Ordering::SeqCst);
                let t = Instant::now();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(k)))
                    .unwrap_or_else(|p| Err(CallError::panic(pid, p.as_ref())));
                let _ = tx.send((k, r, t.elapsed()));
                calls.under_way[k].store(false, Ordering::SeqCst);
            }
        }
    };
    let spawn = |calls: &Arc<Calls>| {
        let f = worker(Arc::clone(calls), tx.clone());
        // SAFETY: the thread borrows `pids` and `op`, which live in frames of the callers of
        // `child::run`. The helper never returns into them: it writes its answer and `_exit`s,
        // which ends this thread too, so they outlive it. Its other state is owned (`Arc`).
        unsafe { std::thread::Builder::new().spawn_unchecked(f) }.is_ok()
    };
    let workers = if parallel {
        pids.len()
    } else {
        1.min(pids.len())
    };
    let mut results: Vec<Option<Timed>> = pids.iter().map(|_| None).collect();
    // Each worker takes the next call until none is left; fewer workers than asked for (no
    // thread to be had) share the calls.
    let started = (0..workers).take_while(|_| spawn(&calls)).count();
    if started == 0 && !pids.is_empty() {
        // No thread at all: the calls are made here, one after another, unwatched.
        return pids
            .iter()
            .enumerate()
            .map(|(k, &pid)| {
                let t = Instant::now();
                (pid, op(k), t.elapsed())
            })
            .collect();
    }
    while results.iter().any(Option::is_none) {
        if let Ok((k, r, took)) = rx.recv_timeout(Duration::from_millis(10)) {
            results[k] = Some((pids[k], r, took));
            continue;
        }
        for (k, fd) in pidfds.iter().enumerate() {
            // A killed task under CRIU's ptrace stays a zombie (its threads wait for CRIU, the
            // tracer, to reap them), so its pidfd never turns readable while CRIU waits here.
            let ended = fd.as_ref().is_some_and(criu_plugin::proc::ended)
                || matches!(
                    procfs::thread_state(pids[k], pids[k]),
                    None | Some('Z' | 'X')
                );
            if results[k].is_some() || !ended || !calls.under_way[k].load(Ordering::SeqCst) {
                continue;
            }
            results[k] = Some((
                pids[k],
                Err(CallError::Process(format!(
                    "pid {} ended while the driver was working on it",
                    pids[k]
                ))),
                began.elapsed(),
            ));
            // The stuck call holds its worker for good: another takes the calls left.
            if calls.next.load(Ordering::SeqCst) < pids.len() {
                spawn(&calls);
            }
        }
    }
    results
        .into_iter()
        .zip(pids)
        .map(|(r, &pid)| {
            r.unwrap_or_else(|| {
                (
                    pid,
                    Err(CallError::Helper(
                        "the driver helper had no thread to call the driver".into(),
                    )),
                    began.elapsed(),
                )
            })
        })
        .collect()
}
