//! The one executor of driver calls: a call per process, on worker threads, each answered when
//! it returns, when its target ends, or when the wait for it is up ([`execute`]).
//!
//! It runs in two places, chosen by the [`Plan`]:
//!
//! - in a helper process ([`Plan::in_helper`]), for CRIU: a call stuck in the driver keeps its
//!   thread, and the helper's `_exit` after its answer ends it;
//! - in process ([`Plan::in_process`]), for `criu-gpu` and the guardian, where no CRIU is to
//!   protect: every worker is joined before [`execute`] returns.
//!
//! Inside CRIU's own process no driver call runs: CRIU must have one thread whenever the plugin
//! returns to it, so the plugin's calls go through a helper process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use super::procfs;

/// How [`execute`] runs its calls.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    parallel: bool,
    lone_on_worker: bool,
    watch_ends: bool,
    wait: Option<Duration>,
    detached: bool,
}

impl Plan {
    /// In process: every worker joined before [`execute`] returns, calls all at once when
    /// `parallel` (else one after another on the calling thread), unwatched, unbounded.
    pub fn in_process(parallel: bool) -> Plan {
        Plan {
            parallel,
            lone_on_worker: false,
            watch_ends: false,
            wait: None,
            detached: false,
        }
    }

    /// In a helper process: every call on a worker (one worker in all when not `parallel`),
    /// each answered when its target ends; a stuck call's worker is left behind.
    ///
    /// # Safety
    ///
    /// The workers borrow the `pids` and `op` that [`execute`] is given and may outlive it:
    /// both must stay alive until the process ends (`_exit`), leaked or owned by frames that
    /// never return before it.
    pub unsafe fn in_helper(parallel: bool) -> Plan {
        Plan {
            parallel,
            lone_on_worker: true,
            watch_ends: true,
            wait: None,
            detached: true,
        }
    }

    /// Even a lone call, or calls one after another, run on a worker: the calling thread stays
    /// free (the guardian's takes its signals).
    pub fn lone_on_worker(mut self) -> Plan {
        self.lone_on_worker = true;
        self
    }

    /// Calls whose target ends are not answered for: each waits for its call's return.
    pub fn unwatched(mut self) -> Plan {
        self.watch_ends = false;
        self
    }

    /// What has not answered within `wait` is [`Outcome::NoAnswer`] (for a plan whose workers
    /// are joined, [`execute`] still returns only once they are).
    pub fn within(mut self, wait: Duration) -> Plan {
        self.wait = Some(wait);
        self.lone_on_worker = true;
        self
    }
}

/// How one call ended.
#[derive(Debug)]
pub enum Outcome<T> {
    /// It returned this.
    Returned(T),
    /// It panicked, saying this.
    Panicked(String),
    /// Its target ended while the call was under way (watched plans).
    Ended,
    /// It did not answer in time ([`Plan::within`]).
    NoAnswer,
}

/// One process's outcome and the time it took.
pub type Ran<T> = (i32, Outcome<T>, Duration);

/// What the workers share: the next call to take and which are under way.
struct Calls {
    next: AtomicUsize,
    count: usize,
    under_way: Vec<AtomicBool>,
}

type Sent<T> = (usize, Outcome<T>, Duration);

/// Runs `op(k)` for each `pids[k]` as `plan` says and reports each answer, in the order of
/// `pids`. A panic in `op` is that call's answer, never unwound further.
pub fn execute<T: Send>(
    pids: &[i32],
    plan: Plan,
    op: &(impl Fn(usize) -> T + Sync),
) -> Vec<Ran<T>> {
    let here = || {
        pids.iter()
            .enumerate()
            .map(|(k, &pid)| {
                let (a, took) = call(op, k);
                (pid, a, took)
            })
            .collect()
    };
    let calling_thread = !plan.lone_on_worker && (!plan.parallel || pids.len() < 2);
    if pids.is_empty() || calling_thread {
        return here();
    }
    let calls = Arc::new(Calls {
        next: 0.into(),
        count: pids.len(),
        under_way: pids.iter().map(|_| false.into()).collect(),
    });
    let (tx, rx) = channel::<Sent<T>>();
    // Each worker takes the next call until none is left.
    // `move`: a worker holds copies of the references `pids` and `op`, never a borrow of
    // this frame, which a helper's stuck worker outlives.
    let worker = move |calls: Arc<Calls>, tx: Sender<Sent<T>>| {
        move || {
            loop {
                let k = calls.next.fetch_add(1, Ordering::SeqCst);
                if k >= calls.count {
                    return;
                }
                calls.under_way[k].store(true, Ordering::SeqCst);
                let (a, took) = call(op, k);
                let _ = tx.send((k, a, took));
                calls.under_way[k].store(false, Ordering::SeqCst);
            }
        }
    };
    let workers = if plan.parallel { pids.len() } else { 1 };
    if plan.detached {
        let spawn = || {
            let f = worker(Arc::clone(&calls), tx.clone());
            // SAFETY: the worker borrows `pids` and `op`, which outlive it by the contract of
            // `Plan::in_helper` (the process `_exit`s before their frames return); the rest it
            // holds is owned.
            unsafe { std::thread::Builder::new().spawn_unchecked(f) }.is_ok()
        };
        let started = (0..workers).take_while(|_| spawn()).count();
        if started == 0 {
            // No thread at all: the calls are made here, one after another, unwatched.
            return here();
        }
        let ran = collect(pids, plan, &calls, &rx, &spawn);
        // A worker whose stuck call returns after this takes no other.
        calls.next.store(calls.count, Ordering::SeqCst);
        ran
    } else {
        // Each worker starts with every asynchronous signal blocked, and all are joined.
        let ran = criu_plugin::threads::scope(|w| {
            let spawn = || {
                let f = worker(Arc::clone(&calls), tx.clone());
                w.spawn("cuda-call", f).is_ok()
            };
            let started = (0..workers).take_while(|_| spawn()).count();
            if started == 0 {
                return None;
            }
            Some(collect(pids, plan, &calls, &rx, &spawn))
        });
        match ran {
            Ok(Some(ran)) => ran,
            // No thread to be had: the calls are made here.
            Ok(None) => here(),
            // Only a panic outside `op` gets here (each call catches its own).
            Err(panic) => pids
                .iter()
                .map(|&pid| (pid, Outcome::Panicked(panic.to_string()), Duration::ZERO))
                .collect(),
        }
    }
}

/// Makes one call, timed, its panic caught.
fn call<T>(op: &impl Fn(usize) -> T, k: usize) -> (Outcome<T>, Duration) {
    let t = Instant::now();
    let a = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(k))) {
        Ok(v) => Outcome::Returned(v),
        Err(p) => Outcome::Panicked(criu_plugin::error::panic_message(p.as_ref())),
    };
    (a, t.elapsed())
}

/// Gathers the workers' answers, answering for calls whose target ended (watched plans) and,
/// at the plan's wait, for every call still out.
fn collect<T>(
    pids: &[i32],
    plan: Plan,
    calls: &Calls,
    rx: &Receiver<Sent<T>>,
    respawn: &dyn Fn() -> bool,
) -> Vec<Ran<T>> {
    let began = Instant::now();
    let pidfds: Vec<Option<std::os::fd::OwnedFd>> = pids
        .iter()
        .map(|&p| {
            plan.watch_ends
                .then(|| criu_plugin::proc::pidfd(p).ok())
                .flatten()
        })
        .collect();
    let until = plan.wait.map(|w| began + w);
    let mut answers: Vec<Option<(Outcome<T>, Duration)>> = pids.iter().map(|_| None).collect();
    while answers.iter().any(Option::is_none) {
        let tick = match (plan.watch_ends, until) {
            (true, _) => Duration::from_millis(10),
            (false, Some(u)) => u.saturating_duration_since(Instant::now()),
            (false, None) => Duration::from_secs(3600),
        };
        if let Ok((k, a, took)) = rx.recv_timeout(tick) {
            answers[k] = Some((a, took));
            continue;
        }
        if until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
        if !plan.watch_ends {
            continue;
        }
        for (k, &pid) in pids.iter().enumerate() {
            if answers[k].is_some() || !calls.under_way[k].load(Ordering::SeqCst) {
                continue;
            }
            // A killed task under CRIU's ptrace stays a zombie (its threads wait for CRIU, the
            // tracer, to reap them), so its pidfd would never turn readable while CRIU waits.
            let ended = pidfds[k].as_ref().is_some_and(criu_plugin::proc::ended)
                || matches!(procfs::thread_state(pid, pid), None | Some('Z' | 'X'));
            if !ended {
                continue;
            }
            answers[k] = Some((Outcome::Ended, began.elapsed()));
            // The stuck call holds its worker for good: another takes the calls left.
            if calls.next.load(Ordering::SeqCst) < pids.len() {
                respawn();
            }
        }
    }
    answers
        .into_iter()
        .zip(pids)
        .map(|(a, &pid)| match a {
            Some((a, took)) => (pid, a, took),
            None => (pid, Outcome::NoAnswer, began.elapsed()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tid() -> i32 {
        nix::unistd::gettid().as_raw()
    }

    #[test]
    fn answers_come_in_the_order_asked_each_with_its_panic() {
        for parallel in [false, true] {
            let ran = execute(&[10, 20, 30], Plan::in_process(parallel), &|k| {
                assert!(k != 1, "call {k} failed");
                k * 2
            });
            let pids: Vec<i32> = ran.iter().map(|r| r.0).collect();
            assert_eq!(pids, [10, 20, 30]);
            assert!(matches!(ran[0].1, Outcome::Returned(0)));
            assert!(matches!(&ran[1].1, Outcome::Panicked(m) if m == "call 1 failed"));
            assert!(matches!(ran[2].1, Outcome::Returned(4)));
        }
    }

    #[test]
    fn a_lone_call_runs_here_unless_asked_onto_a_worker() {
        let here = tid();
        let ran = execute(&[1], Plan::in_process(true), &|_| tid());
        assert!(matches!(ran[0].1, Outcome::Returned(t) if t == here));
        let ran = execute(&[1], Plan::in_process(true).lone_on_worker(), &|_| tid());
        assert!(matches!(ran[0].1, Outcome::Returned(t) if t != here));
    }

    #[test]
    fn a_call_that_does_not_answer_within_the_wait_has_no_answer() {
        let plan = Plan::in_process(true).within(Duration::from_millis(50));
        let ran = execute(&[1, 2], plan, &|k| {
            if k == 1 {
                std::thread::sleep(Duration::from_millis(500));
            }
            k
        });
        assert!(matches!(ran[0].1, Outcome::Returned(0)));
        assert!(matches!(ran[1].1, Outcome::NoAnswer));
    }
}
