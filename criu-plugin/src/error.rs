//! A hook's error as one type, [`HookError`]: "not mine", a failure already logged, or a
//! [`Failure`] to log once (errno, kind, phase, the sentence for CRIU's log, its cause).
//!
//! Plugins build a [`Failure`] where they learn what went wrong and return it as a
//! [`HookError`]; the trampoline that returns to CRIU writes it to CRIU's log at ERROR, with
//! its kind, so that a failure is never logged twice (once where it happened and again on every
//! level it passes) nor lost. Errno values are positive everywhere ([`Errno`]); the negative
//! value CRIU gets is made once, at the C boundary ([`HookError::to_return`]).

use std::ffi::c_int;
use std::fmt;
use std::sync::Arc;

/// A positive errno value; zero and negative values are held as `EIO`, so that a failure never
/// reads as success. `ENOTSUP` (`EOPNOTSUPP`) is kept, being what a device or driver said, but
/// reaches CRIU as `EIO`: CRIU reads `-ENOTSUP` as "not mine".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Errno(i32);

impl Errno {
    /// `EIO`, the errno of a failure that carries none.
    pub const EIO: Errno = Errno(libc::EIO);

    /// `errno` (positive), or `EIO` where it is not a failure's errno.
    pub const fn new(errno: i32) -> Errno {
        if errno > 0 { Errno(errno) } else { Errno::EIO }
    }

    /// The errno of an I/O error; for errors made with a message, the one its kind stands for.
    pub fn of_io(e: &std::io::Error) -> Errno {
        if let Some(n) = e.raw_os_error() {
            return Errno::new(n);
        }
        Errno::new(match e.kind() {
            std::io::ErrorKind::PermissionDenied => libc::EPERM,
            std::io::ErrorKind::NotFound => libc::ENOENT,
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => libc::EINVAL,
            std::io::ErrorKind::OutOfMemory => libc::ENOMEM,
            std::io::ErrorKind::Unsupported => libc::EOPNOTSUPP,
            _ => libc::EIO,
        })
    }

    /// The positive value.
    pub const fn get(self) -> i32 {
        self.0
    }

    /// What a hook returns to CRIU for it: the negative value, made here only.
    pub const fn to_return(self) -> c_int {
        if self.0 == libc::ENOTSUP {
            -libc::EIO
        } else {
            -self.0
        }
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

/// The errno of an I/O error (positive); see [`Errno::of_io`].
pub fn errno_of(e: &std::io::Error) -> i32 {
    Errno::of_io(e).get()
}

/// The message of a caught panic's payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Where in CRIU's run a failure happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The plugin's `init`.
    Init,
    /// A hook of `criu dump` or `criu pre-dump`.
    Dump,
    /// A hook of `criu restore`.
    Restore,
    /// The plugin's `exit`.
    Exit,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Init => "init",
            Phase::Dump => "dump",
            Phase::Restore => "restore",
            Phase::Exit => "exit",
        })
    }
}

/// What a failure is about, in the terms an operator sorts failures by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// A setting (file, environment or plugin option) with a bad value.
    Settings,
    /// An image that is missing, unreadable, damaged or hostile.
    Image,
    /// The GPU driver refused or failed a call.
    Driver,
    /// A device operation (ioctl, mapping, copy engine) failed in the kernel.
    Device,
    /// The process is in a state that cannot be checkpointed or restored (stopped, busy,
    /// another CRIU at it).
    Process,
    /// This machine cannot take the checkpoint: driver too old, GPUs missing or of another
    /// model, too little memory.
    Machine,
    /// A system call failed.
    System,
    /// A helper process or thread of the plugin failed: it died, was killed at its deadline,
    /// gave no or a malformed answer, or could not be started.
    Helper,
    /// A panic of the plugin, contained.
    Panic,
    /// A bug of the plugin (a broken invariant).
    Internal,
}

impl FailureKind {
    /// The kind as one lower-case word, for log lines.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Settings => "settings",
            FailureKind::Image => "image",
            FailureKind::Driver => "driver",
            FailureKind::Device => "device",
            FailureKind::Process => "process",
            FailureKind::Machine => "machine",
            FailureKind::System => "system",
            FailureKind::Helper => "helper",
            FailureKind::Panic => "panic",
            FailureKind::Internal => "internal",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The cause of a failure, kept as a value ([`std::error::Error::source`]).
pub type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// One failure, not yet logged. Its `Display` is the whole sentence for the log, the cause's
/// text included where the message names it; [`Failure::cause`] keeps the cause as a value
/// (a driver error, an I/O error) for callers that look into it.
#[derive(Clone, Debug)]
pub struct Failure {
    /// What CRIU gets.
    pub errno: Errno,
    /// What it is about.
    pub kind: FailureKind,
    /// Where in the run; set by the hook that returns it when its maker did not.
    pub phase: Option<Phase>,
    /// What failed and why, most specific part last.
    pub message: String,
    /// What caused it.
    pub cause: Option<Cause>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The source is the cause itself (not the `Arc` around it), so that callers can downcast it.
impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let cause: &(dyn std::error::Error + 'static) = self.cause.as_deref()?;
        Some(cause)
    }
}

/// Two failures are the same when CRIU and the operator get the same from them.
impl PartialEq for Failure {
    fn eq(&self, other: &Self) -> bool {
        (self.errno, self.kind, self.phase, &self.message)
            == (other.errno, other.kind, other.phase, &other.message)
    }
}

impl Eq for Failure {}

impl Failure {
    /// A failure of `kind` with `errno` (positive) and `message`.
    pub fn new(kind: FailureKind, errno: i32, message: impl fmt::Display) -> Failure {
        Failure {
            errno: Errno::new(errno),
            kind,
            phase: None,
            message: message.to_string(),
            cause: None,
        }
    }

    /// A failed system call: its errno (`EIO` when it carries none) and what was being done;
    /// the I/O error is the cause.
    pub fn io(e: &std::io::Error, what: impl fmt::Display) -> Failure {
        Failure::new(FailureKind::System, errno_of(e), format!("{what}: {e}"))
            .caused_by(io_cause(e))
    }

    /// A contained panic: its message and, where the panic hook saw it, its file and line.
    pub fn panic(what: impl fmt::Display, panic: &str, location: Option<&str>) -> Failure {
        let at = location.map(|l| format!(" at {l}")).unwrap_or_default();
        Failure::new(
            FailureKind::Panic,
            libc::EIO,
            format!("internal error {what}: panic{at}: {panic}"),
        )
    }

    /// A helper process or thread of the plugin that failed (`EIO`).
    pub fn helper(message: impl fmt::Display) -> Failure {
        Failure::new(FailureKind::Helper, libc::EIO, message)
    }

    /// The same failure with `cause` as its source.
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Failure {
        self.cause = Some(Arc::new(cause));
        self
    }

    /// Prefixes the message with what was being done.
    pub fn context(mut self, what: impl fmt::Display) -> Failure {
        self.message = format!("{what}: {}", self.message);
        self
    }

    /// The same failure as another kind.
    pub fn with_kind(mut self, kind: FailureKind) -> Failure {
        self.kind = kind;
        self
    }

    /// The failure in `phase`, unless its maker named one.
    pub fn in_phase(mut self, phase: Phase) -> Failure {
        self.phase.get_or_insert(phase);
        self
    }

    /// The line CRIU's log gets.
    pub fn log_line(&self) -> String {
        format!("{} [{}]", self.message, self.kind)
    }
}

/// An I/O error's copy, as a cause (`std::io::Error` is not `Clone`).
fn io_cause(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(n) => std::io::Error::from_raw_os_error(n),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        let mut f = Failure::new(FailureKind::System, errno_of(&e), e.to_string());
        f.cause = Some(Arc::new(e));
        f
    }
}

/// Why a hook did not succeed: the one error type of every hook and of what a hook calls.
/// Two hook errors are equal when CRIU gets the same answer from them: a [`Failure`]
/// compares by its errno, its message being for the log.
#[derive(Clone, Debug, thiserror::Error)]
pub enum HookError {
    /// The object (process, file, mapping) is not this plugin's: CRIU asks the next plugin.
    #[error("not this plugin's")]
    NotMine,
    /// A failure already logged (or with nothing to say).
    #[error("failed ({0}), logged already")]
    Errno(Errno),
    /// A failure to log: the trampoline writes it to CRIU's log once, at ERROR, with its kind.
    #[error(transparent)]
    Failed(Box<Failure>),
}

impl HookError {
    /// A failure already logged, with `errno` (positive).
    pub const fn logged(errno: i32) -> HookError {
        HookError::Errno(Errno::new(errno))
    }

    /// The errno CRIU gets (`ENOTSUP` for "not mine").
    pub fn errno(&self) -> i32 {
        match self {
            HookError::NotMine => libc::ENOTSUP,
            HookError::Errno(e) => e.get(),
            HookError::Failed(f) => f.errno.get(),
        }
    }

    /// The value a hook returns to CRIU: the only place the negative errno is made.
    pub fn to_return(&self) -> c_int {
        match self {
            HookError::NotMine => -libc::ENOTSUP,
            HookError::Errno(e) => e.to_return(),
            HookError::Failed(f) => f.errno.to_return(),
        }
    }

    /// The failure in `phase`, unless its maker named one.
    pub fn in_phase(self, phase: Phase) -> HookError {
        match self {
            HookError::Failed(f) => HookError::Failed(Box::new(f.in_phase(phase))),
            other => other,
        }
    }
}

impl PartialEq for HookError {
    fn eq(&self, other: &Self) -> bool {
        self.to_return() == other.to_return()
    }
}

impl Eq for HookError {}

impl From<Failure> for HookError {
    fn from(f: Failure) -> Self {
        HookError::Failed(Box::new(f))
    }
}

/// An I/O error a hook passes up with `?` is a failure to log, like any other.
impl From<std::io::Error> for HookError {
    fn from(e: std::io::Error) -> Self {
        Failure::from(e).into()
    }
}

/// Result of a hook, and of what a hook calls.
pub type HookResult<T = ()> = Result<T, HookError>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn a_failure_says_what_kind_it_is() {
        let f = Failure::new(FailureKind::Machine, libc::ENODEV, "no such GPU").context("restore");
        assert_eq!(f.log_line(), "restore: no such GPU [machine]");
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        let f = Failure::io(&io, "open x");
        assert_eq!((f.errno.get(), f.kind), (libc::ENOENT, FailureKind::System));
        assert_eq!(
            f.to_string(),
            "open x: No such file or directory (os error 2)"
        );
        let custom = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad");
        assert_eq!(errno_of(&custom), libc::EINVAL);
    }

    #[test]
    fn errno_is_positive_inside_and_negative_only_for_criu() {
        assert_eq!(Errno::new(libc::EPERM).get(), libc::EPERM);
        assert_eq!(Errno::new(libc::EPERM).to_return(), -libc::EPERM);
        for not_a_failure in [0, -libc::EPERM] {
            assert_eq!(Errno::new(not_a_failure), Errno::EIO);
        }
        // What a device said stays, but never reads as "not mine" to CRIU.
        assert_eq!(Errno::new(libc::EOPNOTSUPP).get(), libc::EOPNOTSUPP);
        assert_eq!(Errno::new(libc::ENOTSUP).to_return(), -libc::EIO);
        assert_eq!(HookError::NotMine.to_return(), -libc::ENOTSUP);
        assert_eq!(HookError::logged(libc::ETIMEDOUT).errno(), libc::ETIMEDOUT);
    }

    #[test]
    fn the_cause_is_chained_and_the_phase_kept() {
        let io = std::io::Error::from_raw_os_error(libc::EACCES);
        let f = Failure::io(&io, "open /dev/kfd").in_phase(Phase::Dump);
        let e = HookError::from(f.clone().in_phase(Phase::Restore));
        let HookError::Failed(inner) = &e else {
            panic!("{e:?}")
        };
        // The maker's phase wins.
        assert_eq!(inner.phase, Some(Phase::Dump));
        let cause = e.source().expect("cause");
        let io = cause
            .downcast_ref::<std::io::Error>()
            .expect("an I/O error");
        assert_eq!(io.raw_os_error(), Some(libc::EACCES));
        assert_eq!(e.to_string(), f.to_string());
        let p = Failure::panic("in PAUSE_DEVICES", "boom", Some("src/x.rs:3:9"));
        assert_eq!(
            p.log_line(),
            "internal error in PAUSE_DEVICES: panic at src/x.rs:3:9: boom [panic]"
        );
    }
}
