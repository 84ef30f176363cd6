//! One driver step on one process ([`Step`]), the driver call a failure names ([`DriverCall`])
//! and a step's timed result ([`Timed`]): what the batch, the helper process, the guardian and
//! `criu-gpu` share.

use std::fmt;
use std::time::Duration;

use cuda_ckpt_sys::{CUresult, CudaError, Driver, DriverError, GpuPair, ProcessState};

use super::error::CallError;

/// One process's result and the time its calls took.
pub type Timed<E = CallError> = (i32, Result<(), E>, Duration);

/// Milliseconds, for log lines.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A CUDA driver function whose failure the plugin reports (and a helper process sends back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverCall {
    /// `cuCheckpointProcessGetState`.
    GetState,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuInit`.
    Init,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuDriverGetVersion`.
    DriverGetVersion,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    GetRestoreThreadId,
    /// `cuDeviceGetCount`.
    DeviceGetCount,
    /// `cuDeviceGet`.
    DeviceGet,
    /// `cuDeviceGetName`.
    DeviceGetName,
}

impl DriverCall {
    /// Every call, in the order of their wire numbers.
    pub const ALL: [DriverCall; 11] = [
        DriverCall::GetState,
        DriverCall::Lock,
        DriverCall::Restore,
        DriverCall::Unlock,
        DriverCall::Init,
        DriverCall::Checkpoint,
        DriverCall::DriverGetVersion,
        DriverCall::GetRestoreThreadId,
        DriverCall::DeviceGetCount,
        DriverCall::DeviceGet,
        DriverCall::DeviceGetName,
    ];

    /// The C function's name.
    pub fn name(self) -> &'static str {
        match self {
            DriverCall::GetState => "cuCheckpointProcessGetState",
            DriverCall::Lock => "cuCheckpointProcessLock",
            DriverCall::Restore => "cuCheckpointProcessRestore",
            DriverCall::Unlock => "cuCheckpointProcessUnlock",
            DriverCall::Init => "cuInit",
            DriverCall::Checkpoint => "cuCheckpointProcessCheckpoint",
            DriverCall::DriverGetVersion => "cuDriverGetVersion",
            DriverCall::GetRestoreThreadId => "cuCheckpointProcessGetRestoreThreadId",
            DriverCall::DeviceGetCount => "cuDeviceGetCount",
            DriverCall::DeviceGet => "cuDeviceGet",
            DriverCall::DeviceGetName => "cuDeviceGetName",
        }
    }

    /// The call a driver error names, when it is one of these.
    pub fn of(e: &CudaError) -> Option<DriverCall> {
        DriverCall::ALL.into_iter().find(|c| c.name() == e.call)
    }
}

impl fmt::Display for DriverCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the driver refused a restore because the caller has not called `cuInit` (needed
/// when persistence mode is off): the step is then redone from a process that calls it.
pub fn needs_init(r: &Result<(), CallError>) -> bool {
    matches!(r, Err(CallError::Driver(DriverError::Cuda(e)))
        if e.code == CUresult::NOT_PERMITTED && DriverCall::of(e) == Some(DriverCall::Restore))
}

/// One driver step on one process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step<'a> {
    /// Lock it, waiting at most this many milliseconds for its GPU work (never 0).
    Lock {
        /// The lock timeout.
        timeout_ms: u32,
    },
    /// Checkpoint it (locked).
    Checkpoint,
    /// Restore it onto `pairs` (empty: its own GPUs), then unlock it when `unlock`.
    Restore {
        /// The GPU map.
        pairs: &'a [GpuPair],
        /// Unlock after the restore (it was running when dumped).
        unlock: bool,
    },
    /// Unlock it.
    Unlock,
    /// Put it back as a dump found it ([`put_back`]).
    PutBack {
        /// The dump locked it: unlock it too.
        unlock: bool,
    },
}

impl Step<'_> {
    /// Makes the step's driver calls on `pid`.
    pub fn run(&self, driver: &Driver, pid: i32) -> Result<(), CallError> {
        match *self {
            Step::Lock { timeout_ms } => Ok(driver.lock(pid, timeout_ms)?),
            Step::Checkpoint => Ok(driver.checkpoint(pid)?),
            Step::Restore { pairs, unlock } => {
                driver.restore(pid, pairs)?;
                if unlock {
                    driver.unlock(pid)?;
                }
                Ok(())
            }
            Step::Unlock => Ok(driver.unlock(pid)?),
            Step::PutBack { unlock } => put_back(driver, pid, unlock),
        }
    }

    /// What is redone, from a process that called `cuInit`, of a step whose restore the driver
    /// refused for want of it ([`needs_init`]).
    pub fn after_init(&self) -> Step<'_> {
        match *self {
            Step::PutBack { unlock } => Step::Restore { pairs: &[], unlock },
            other => other,
        }
    }
}

/// Puts one process back as the dump found it: restore if checkpointed, unlock if we locked it.
/// A restore the driver refuses for want of `cuInit` is returned as is, for the caller to
/// redo from a helper process and then to check with [`check_put_back`].
pub fn put_back(driver: &Driver, pid: i32, unlock: bool) -> Result<(), CallError> {
    if driver.process_state(pid)? == ProcessState::Checkpointed {
        driver.restore(pid, &[])?;
    }
    if unlock && driver.process_state(pid)? == ProcessState::Locked {
        driver.unlock(pid)?;
    }
    check_put_back(driver, pid, unlock)
}

/// Checks that a process put back is in the state the dump found it in.
pub fn check_put_back(driver: &Driver, pid: i32, unlock: bool) -> Result<(), CallError> {
    let end = driver.process_state(pid)?;
    let expected = if unlock {
        ProcessState::Running
    } else {
        ProcessState::Locked
    };
    if end != expected {
        return Err(CallError::Process(format!(
            "pid {pid} is {end} after being put back, not {expected}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(call: &'static str, code: CUresult) -> Result<(), CallError> {
        Err(CallError::Driver(DriverError::Cuda(CudaError {
            call,
            pid: Some(7),
            code,
            name: None,
            text: None,
        })))
    }

    #[test]
    fn only_a_refused_restore_needs_init() {
        assert!(needs_init(&refused(
            "cuCheckpointProcessRestore",
            CUresult::NOT_PERMITTED
        )));
        assert!(!needs_init(&refused(
            "cuCheckpointProcessUnlock",
            CUresult::NOT_PERMITTED
        )));
        assert!(!needs_init(&refused(
            "cuCheckpointProcessRestore",
            CUresult::INVALID_VALUE
        )));
        assert!(!needs_init(&Ok(())));
    }

    #[test]
    fn calls_are_named_as_the_driver_names_them() {
        for c in DriverCall::ALL {
            let e = CudaError {
                call: c.name(),
                pid: None,
                code: CUresult(1),
                name: None,
                text: None,
            };
            assert_eq!(DriverCall::of(&e), Some(c));
            assert_eq!(c.to_string(), c.name());
        }
    }

    #[test]
    fn a_put_back_is_redone_as_a_restore_on_its_own_gpus() {
        assert_eq!(
            Step::PutBack { unlock: true }.after_init(),
            Step::Restore {
                pairs: &[],
                unlock: true
            }
        );
        assert_eq!(Step::Checkpoint.after_init(), Step::Checkpoint);
    }
}
