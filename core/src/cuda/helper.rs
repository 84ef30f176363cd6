//! Driver and NVML calls made in a helper process ([`criu_plugin::child`]) instead of CRIU's.
//!
//! Three kinds of call must not run in CRIU's process, which has to stay single-threaded:
//!
//! - NVML: `nvmlInit_v2` starts a thread that `nvmlShutdown` leaves running;
//! - `cuInit`, which a restore needs when persistence mode is off: it starts libcuda's threads;
//! - calls that may never return (the state query and the lock wait for the target's restore
//!   thread): a hung helper is killed at its deadline, a hung thread could never be.
//!
//! Replies travel as a small binary encoding, read back with bounds on every length.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criu_plugin::child::{self, ChildError};
use cuda_ckpt_sys::{CUresult, CudaError, Driver, DriverError, GpuPair, GpuUuid, ProcessState};

use super::batch::Timed;
use super::error::CallError;
use super::nvml::{self, GpuMemory};

/// The most GPUs or processes one reply may describe.
const MAX_ITEMS: usize = 1 << 16;
/// The longest message one reply may carry.
const MAX_TEXT: usize = 4096;
/// The largest reply accepted from a helper.
const MAX_REPLY: usize = 1 << 20;

/// How long an NVML query may take before it is given up (the free-memory check is then
/// skipped, as without NVML).
pub const NVML_DEADLINE: Duration = Duration::from_secs(15);

/// Driver calls whose failures travel back; the name is what the error message shows.
const CALLS: [&str; 7] = [
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuInit",
    "cuCheckpointProcessCheckpoint",
    "cuDriverGetVersion",
];

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn i32(&mut self, v: i32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn text(&mut self, s: &str) -> &mut Self {
        let b = &s.as_bytes()[..s.len().min(MAX_TEXT)];
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }
    fn driver_result(&mut self, r: &Result<(), DriverError>) -> &mut Self {
        match r {
            Ok(()) => self.u8(0),
            Err(DriverError::Cuda(e)) if CALLS.contains(&e.call) => {
                let call = CALLS.iter().position(|c| *c == e.call).unwrap_or(0);
                self.u8(1)
                    .u8(call as u8)
                    .i32(e.pid.unwrap_or(-1))
                    .i32(e.code.0)
            }
            Err(DriverError::InvalidArgument(m)) => self.u8(2).text(m),
            Err(other) => self.u8(2).text(&other.to_string()),
        }
    }
    fn call_result(&mut self, r: &Result<(), CallError>) -> &mut Self {
        match r {
            Ok(()) => self.u8(0),
            Err(CallError::Driver(e)) => self.driver_result(&Err(e.clone())),
            Err(CallError::Panic { pid, message }) => self.u8(3).i32(*pid).text(message),
            Err(CallError::Helper(m)) => self.u8(4).text(m),
            Err(CallError::Process(m)) => self.u8(5).text(m),
            Err(CallError::System { message, errno }) => self.u8(6).i32(*errno).text(message),
        }
    }
}

/// Reads a reply; every method fails on a short or malformed reply.
struct Reader<'a>(&'a [u8]);

type Malformed = ChildError;

fn malformed() -> Malformed {
    ChildError::NoReply("answered malformed data".into())
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Malformed> {
        if self.0.len() < n {
            return Err(malformed());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn i32(&mut self) -> Result<i32, Malformed> {
        Ok(i32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, Malformed> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn count(&mut self) -> Result<usize, Malformed> {
        let n = self.u64()?;
        if n > MAX_ITEMS as u64 {
            return Err(malformed());
        }
        Ok(n as usize)
    }
    fn text(&mut self) -> Result<String, Malformed> {
        let n = self.u64()?;
        if n > MAX_TEXT as u64 {
            return Err(malformed());
        }
        Ok(String::from_utf8_lossy(self.take(n as usize)?).into_owned())
    }
    fn driver_result(&mut self, driver: &Driver) -> Result<Result<(), DriverError>, Malformed> {
        match self.call_result(driver)? {
            Ok(()) => Ok(Ok(())),
            Err(CallError::Driver(e)) => Ok(Err(e)),
            Err(_) => Err(malformed()),
        }
    }
    fn call_result(&mut self, driver: &Driver) -> Result<Result<(), CallError>, Malformed> {
        Ok(match self.u8()? {
            0 => Ok(()),
            1 => {
                let call = CALLS.get(self.u8()? as usize).ok_or_else(malformed)?;
                let pid = self.i32()?;
                let code = CUresult(self.i32()?);
                Err(DriverError::Cuda(CudaError {
                    call,
                    pid: (pid >= 0).then_some(pid),
                    code,
                    name: driver.error_name(code),
                    text: driver.error_string(code),
                })
                .into())
            }
            2 => Err(DriverError::InvalidArgument(self.text()?).into()),
            3 => {
                let pid = self.i32()?;
                Err(CallError::Panic {
                    pid,
                    message: self.text()?,
                })
            }
            4 => Err(CallError::Helper(self.text()?)),
            5 => Err(CallError::Process(self.text()?)),
            6 => {
                let errno = self.i32()?;
                Err(CallError::System {
                    errno,
                    message: self.text()?,
                })
            }
            _ => return Err(malformed()),
        })
    }
}

fn state_code(s: ProcessState) -> u64 {
    match s {
        ProcessState::Running => 0,
        ProcessState::Locked => 1,
        ProcessState::Checkpointed => 2,
        ProcessState::Failed => 3,
        ProcessState::Checkpointing => 4,
        ProcessState::Restoring => 5,
        ProcessState::Unknown(n) => 0x1_0000_0000 | u64::from(n),
    }
}

fn state_from_code(c: u64) -> ProcessState {
    match c {
        0 => ProcessState::Running,
        1 => ProcessState::Locked,
        2 => ProcessState::Checkpointed,
        3 => ProcessState::Failed,
        4 => ProcessState::Checkpointing,
        5 => ProcessState::Restoring,
        n => ProcessState::Unknown(n as u32),
    }
}

/// NVML's memory figures for `uuids`, asked in a helper process.
pub fn query_memory(lib: &str, uuids: &[GpuUuid]) -> Result<BTreeMap<GpuUuid, GpuMemory>, String> {
    super::driver::library(lib).map_err(|e| format!("nvml = {lib}: {e}"))?;
    let reply = child::run(NVML_DEADLINE, MAX_REPLY, || {
        let mut w = Writer::default();
        match nvml::query_memory(lib, uuids) {
            Ok(mem) => {
                w.u8(0).u64(mem.len() as u64);
                for (u, m) in &mem {
                    w.0.extend_from_slice(&u.0);
                    w.u64(m.total).u64(m.free);
                }
            }
            Err(e) => {
                w.u8(1).text(&e);
            }
        }
        w.0
    })
    .map_err(|e| format!("NVML: {e}"))?;
    let mut r = Reader(&reply);
    let parse =
        |r: &mut Reader<'_>| -> Result<Result<BTreeMap<GpuUuid, GpuMemory>, String>, Malformed> {
            if r.u8()? != 0 {
                return Ok(Err(r.text()?));
            }
            let n = r.count()?;
            let mut out = BTreeMap::new();
            for _ in 0..n {
                let uuid = GpuUuid(r.take(16)?.try_into().expect("16"));
                let total = r.u64()?;
                let free = r.u64()?;
                out.insert(uuid, GpuMemory { total, free });
            }
            Ok(Ok(out))
        };
    parse(&mut r).map_err(|e| format!("NVML: {e}"))?
}

/// What a pause helper found and did.
#[derive(Debug)]
pub struct LockOutcome {
    /// The process's state before anything was done.
    pub state: Result<ProcessState, DriverError>,
    /// The lock's result, when the process was running and a lock was asked for.
    pub lock: Option<Result<(), CallError>>,
    /// Time spent in the driver inside the helper (the rest of the call is the helper's cost).
    pub in_driver: Duration,
}

/// Asks for `pid`'s state and, when it runs, locks it with `timeout_ms`, in a helper killed
/// after `deadline`. The helper calls `announce` just before it asks for the lock (the
/// guardian learns of the process there: a CRIU killed during the lock is covered); when
/// `announce` says it could not, the process is not locked.
pub fn state_and_lock(
    driver: &Driver,
    pid: i32,
    timeout_ms: u32,
    deadline: Duration,
    announce: &dyn Fn() -> bool,
) -> Result<LockOutcome, ChildError> {
    let reply = child::run(deadline, MAX_REPLY, || {
        let mut w = Writer::default();
        let t = Instant::now();
        match driver.process_state(pid) {
            Ok(state) => {
                w.u8(0).u64(state_code(state));
                if state == ProcessState::Running {
                    // What is left of the timeout after the state query: the lock must end
                    // before the parent's deadline, never after the helper is gone.
                    let spent = t.elapsed().as_millis().min(u128::from(u32::MAX)) as u32;
                    let left = timeout_ms.saturating_sub(spent).max(1);
                    let locked = if announce() {
                        driver.lock(pid, left).map_err(CallError::from)
                    } else {
                        Err(CallError::Helper(format!(
                            "pid {pid} is not locked: the guardian that would put it back could not be told of it"
                        )))
                    };
                    w.u8(1).call_result(&locked);
                } else {
                    w.u8(0);
                }
            }
            Err(e) => {
                w.u8(1).driver_result(&Err(e));
            }
        }
        w.u64(t.elapsed().as_nanos().min(u64::MAX as u128) as u64);
        w.0
    })?;
    let mut r = Reader(&reply);
    let state = match r.u8()? {
        0 => Ok(state_from_code(r.u64()?)),
        1 => Err(r.driver_result(driver)?.err().ok_or_else(malformed)?),
        _ => return Err(malformed()),
    };
    let lock = match (&state, state.is_ok().then(|| r.u8()).transpose()?) {
        (Ok(_), Some(1)) => Some(r.call_result(driver)?),
        _ => None,
    };
    let in_driver = Duration::from_nanos(r.u64()?);
    Ok(LockOutcome {
        state,
        lock,
        in_driver,
    })
}

/// Unlocks `pid` if it is locked, in a helper killed after `deadline`: for a process whose
/// lock the plugin gave up waiting for, which may have completed since. `Ok(true)` when it
/// was locked and is now unlocked.
pub fn unlock_if_locked(driver: &Driver, pid: i32, deadline: Duration) -> Result<bool, String> {
    let reply = child::run(deadline, MAX_REPLY, || {
        let mut w = Writer::default();
        match driver.process_state(pid) {
            Ok(ProcessState::Locked) => {
                w.u8(1).driver_result(&driver.unlock(pid));
            }
            Ok(_) => {
                w.u8(0);
            }
            Err(e) => {
                w.u8(2).driver_result(&Err(e));
            }
        }
        w.0
    })
    .map_err(|e| e.to_string())?;
    let mut r = Reader(&reply);
    let parsed = (|| -> Result<Result<bool, DriverError>, Malformed> {
        Ok(match r.u8()? {
            0 => Ok(false),
            1 => r.driver_result(driver)?.map(|()| true),
            _ => Err(r.driver_result(driver)?.err().ok_or_else(malformed)?),
        })
    })();
    parsed
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// A process's state, the driver's error, or `None` when it did not answer in time.
pub type StateAnswer = Option<Result<ProcessState, DriverError>>;

/// The state of each of `pids`, asked from one helper process with each query on its own
/// thread there, so that a target that never answers costs only its own answer: what has not
/// answered within `wait` comes back as `None`. The helper is killed shortly after `wait`.
pub fn process_states(
    driver: &Driver,
    pids: &[i32],
    wait: Duration,
) -> Result<Vec<(i32, StateAnswer)>, ChildError> {
    let reply = child::run(wait + Duration::from_secs(2), MAX_REPLY, || {
        let (tx, rx) = std::sync::mpsc::channel();
        for &pid in pids {
            let (mine, d) = (tx.clone(), driver.clone());
            // The helper is `_exit`ed after its reply: a thread stuck in the driver goes with
            // it, which is why these are not scoped (joined) threads.
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
        let mut w = Writer::default();
        w.u64(pids.len().min(MAX_ITEMS) as u64);
        for &pid in pids.iter().take(MAX_ITEMS) {
            w.i32(pid);
            match got.remove(&pid) {
                Some(Ok(s)) => w.u8(0).u64(state_code(s)),
                Some(Err(e)) => w.u8(1).driver_result(&Err(e)),
                None => w.u8(2),
            };
        }
        w.0
    })?;
    let mut r = Reader(&reply);
    let n = r.count()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let pid = r.i32()?;
        let answer = match r.u8()? {
            0 => Some(Ok(state_from_code(r.u64()?))),
            1 => Some(Err(r.driver_result(driver)?.err().ok_or_else(malformed)?)),
            2 => None,
            _ => return Err(malformed()),
        };
        out.push((pid, answer));
    }
    Ok(out)
}

/// One process for [`restore_with_init`]: its pid and whether to unlock it after the restore.
#[derive(Clone, Copy, Debug)]
pub struct RestoreJob {
    /// Host pid.
    pub pid: i32,
    /// Unlock after the restore (it was running when dumped).
    pub unlock: bool,
}

impl RestoreJob {
    /// Restores the process onto `pairs` (empty: its own GPUs), then unlocks it if asked.
    pub fn restore(&self, driver: &Driver, pairs: &[GpuPair]) -> Result<(), DriverError> {
        driver.restore(self.pid, pairs)?;
        if self.unlock {
            driver.unlock(self.pid)?;
        }
        Ok(())
    }
}

/// Restores (and unlocks) `jobs` from a helper that first calls `cuInit`, as the driver
/// requires of a restoring process when persistence mode is off (see [`each_in_helper`]).
pub fn restore_with_init(
    driver: &Driver,
    jobs: &[RestoreJob],
    pairs: &[GpuPair],
    parallel: bool,
    deadline: Duration,
) -> Result<Vec<Timed>, ChildError> {
    let pids: Vec<i32> = jobs.iter().map(|j| j.pid).collect();
    each_in_helper(driver, &pids, parallel, true, deadline, |pid| {
        jobs.iter()
            .find(|j| j.pid == pid)
            .map_or(Ok(()), |j| j.restore(driver, pairs))
    })
}

/// Runs `op` for every pid in a helper process killed after `deadline` (after `cuInit` when
/// `init`): each call on a thread of the helper's, all at once when `parallel`, else one after
/// another. A driver call waits for the target's restore thread, and a target that dies
/// meanwhile may never answer: the helper watches each target through a pidfd and answers for
/// one that ended at once, so a task killed in the middle of a dump costs a failed call, not a
/// CRIU that hangs. A helper that gives no answer fails every pid with its reason.
pub fn each_in_helper<E: Into<CallError>>(
    driver: &Driver,
    pids: &[i32],
    parallel: bool,
    init: bool,
    deadline: Duration,
    op: impl Fn(i32) -> Result<(), E> + Sync,
) -> Result<Vec<Timed>, ChildError> {
    let reply = child::run(deadline, MAX_REPLY, || {
        let mut w = Writer::default();
        let started = if init { driver.init() } else { Ok(()) };
        w.driver_result(&started);
        if started.is_ok() {
            let results = watched_calls(pids, parallel, &op);
            w.u64(results.len() as u64);
            for (pid, r, took) in &results {
                w.i32(*pid)
                    .u64(took.as_nanos().min(u64::MAX as u128) as u64)
                    .call_result(r);
            }
        }
        w.0
    })?;
    let mut r = Reader(&reply);
    if let Err(e) = r.driver_result(driver)? {
        let started = Instant::now();
        return Ok(pids
            .iter()
            .map(|&pid| (pid, Err(CallError::from(e.clone())), started.elapsed()))
            .collect());
    }
    let n = r.count()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let pid = r.i32()?;
        let took = Duration::from_nanos(r.u64()?);
        out.push((pid, r.call_result(driver)?, took));
    }
    Ok(out)
}

/// What the worker threads of [`watched_calls`] share.
struct Calls {
    next: std::sync::atomic::AtomicUsize,
    under_way: Vec<std::sync::atomic::AtomicBool>,
}

/// Inside a helper: the calls of [`each_in_helper`], each answered when it returns or when its
/// target ends, whichever comes first. Threads stuck in a call to a dead target stay behind;
/// the helper's `_exit` ends them.
fn watched_calls<E: Into<CallError>>(
    pids: &[i32],
    parallel: bool,
    op: &(impl Fn(i32) -> Result<(), E> + Sync),
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
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    op(pid).map_err(Into::into)
                }))
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
            .map(|&pid| {
                let t = Instant::now();
                (pid, op(pid).map_err(Into::into), t.elapsed())
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
                    super::procfs::thread_state(pids[k], pids[k]),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip() {
        for s in [
            ProcessState::Running,
            ProcessState::Locked,
            ProcessState::Checkpointed,
            ProcessState::Failed,
            ProcessState::Checkpointing,
            ProcessState::Restoring,
            ProcessState::Unknown(77),
        ] {
            assert_eq!(state_from_code(state_code(s)), s);
        }
    }

    #[test]
    fn short_and_oversized_replies_are_refused() {
        let mut r = Reader(&[1, 2, 3]);
        assert!(r.u64().is_err());
        let mut w = Writer::default();
        w.u64(MAX_ITEMS as u64 + 1);
        assert!(Reader(&w.0).count().is_err());
        let mut w = Writer::default();
        w.u64(MAX_TEXT as u64 + 1);
        assert!(Reader(&w.0).text().is_err());
    }

    #[test]
    fn nvml_that_cannot_load_is_reported_from_the_helper() {
        let e = query_memory("/nonexistent/libnvidia-ml.so.1", &[]).unwrap_err();
        assert!(e.contains("cannot be loaded"), "{e}");
    }
}
