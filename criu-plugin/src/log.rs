//! Logging into CRIU's own log through `print_on_level`, behind the `log` facade.
//!
//! CRIU formats every message into one static buffer, so calls are serialised here (CRIU's own
//! SIGALRM handler may still log concurrently; nothing can be done about that). Lines follow
//! CRIU's macros: errors and warnings read `Error (file:line): prefix: message`, so the first
//! error (which CRIU hands to runc and Podman as the failure reason) carries the plugin's name.
//! Level 0 (`LOG_MSG`) goes to stdout in CRIU and is never used.

use std::ffi::CString;
use std::io::Write;
use std::sync::Mutex;

use crate::criu_internals::{LOG_BUF_LEN, LOG_ERROR_MARKER, LOG_WARN_MARKER};
use crate::symbols::CriuSymbols;

/// CRIU's log levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u32)]
pub enum CriuLevel {
    /// `LOG_ERROR`.
    Error = 1,
    /// `LOG_WARN`, CRIU's default.
    Warn = 2,
    /// `LOG_INFO`: timestamps are added from here on.
    Info = 3,
    /// `LOG_DEBUG` (`-v4`, what runc and crun use).
    Debug = 4,
}

impl From<log::Level> for CriuLevel {
    fn from(l: log::Level) -> Self {
        match l {
            log::Level::Error => CriuLevel::Error,
            log::Level::Warn => CriuLevel::Warn,
            log::Level::Info => CriuLevel::Info,
            log::Level::Debug | log::Level::Trace => CriuLevel::Debug,
        }
    }
}

/// Longest line handed to CRIU: half of CRIU's line buffer ([`LOG_BUF_LEN`]), which its
/// timestamp and pid prefix share; a longer line would lose its newline and run into the
/// next one.
pub const MAX_LINE_BYTES: usize = LOG_BUF_LEN / 2;

/// Builds one CRIU log line the way CRIU's `pr_*` macros do, at most [`MAX_LINE_BYTES`] long
/// (a longer message is cut at a character boundary and says how long it was).
pub fn format_line(
    level: CriuLevel,
    prefix: &str,
    file: Option<&str>,
    line: Option<u32>,
    msg: &str,
) -> String {
    let loc = match (file, line) {
        (Some(f), Some(l)) => format!("{}:{l}", f.rsplit('/').next().unwrap_or(f)),
        (Some(f), None) => f.to_string(),
        _ => prefix.to_string(),
    };
    let mut s = match level {
        CriuLevel::Error => format!("{LOG_ERROR_MARKER}{loc}): {prefix}: {msg}"),
        CriuLevel::Warn => format!("{LOG_WARN_MARKER}{loc}): {prefix}: {msg}"),
        CriuLevel::Info | CriuLevel::Debug => format!("{prefix}: {msg}"),
    };
    if s.ends_with('\n') {
        s.pop();
    }
    if s.len() >= MAX_LINE_BYTES {
        let total = s.len();
        let mut end = MAX_LINE_BYTES - 64;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str(&format!("… (line of {total} bytes cut)"));
    }
    s.push('\n');
    s
}

/// The `log::Log` implementation that writes into CRIU's log.
pub struct CriuLogger {
    prefix: &'static str,
    lock: Mutex<()>,
}

impl CriuLogger {
    /// A logger whose lines start with `prefix` (for example `gpu_plugin`).
    pub const fn new(prefix: &'static str) -> CriuLogger {
        CriuLogger {
            prefix,
            lock: Mutex::new(()),
        }
    }

    /// Installs `logger` as the process's `log` backend (once; later calls keep the first) and
    /// sets the `log` filter from CRIU's current level.
    pub fn install(logger: &'static CriuLogger) {
        let _ = log::set_logger(logger);
        let level = match CriuSymbols::get().log_level() {
            Some(0 | 1) => log::LevelFilter::Error,
            Some(2) => log::LevelFilter::Warn,
            Some(3) => log::LevelFilter::Info,
            Some(_) => log::LevelFilter::Debug,
            // Outside CRIU only warnings and errors reach stderr.
            None => log::LevelFilter::Warn,
        };
        log::set_max_level(level);
    }

    /// Writes one line at `level`; used by the logger and by the panic path.
    pub fn write(&self, level: CriuLevel, file: Option<&str>, line: Option<u32>, msg: &str) {
        let text = format_line(level, self.prefix, file, line, msg);
        let _guard = self.lock_bounded();
        let syms = CriuSymbols::get();
        match syms.print_on_level() {
            Some(print) => {
                let Ok(c) = CString::new(text.replace('\0', "\\0")) else {
                    return;
                };
                // SAFETY: "%s" consumes exactly one NUL-terminated string argument, which `c`
                // provides for the duration of the call; CRIU never keeps the pointer.
                unsafe { print(level as u32, c"%s".as_ptr(), c.as_ptr()) };
            }
            None => {
                let _ = std::io::stderr().write_all(text.as_bytes());
            }
        }
    }
}

impl CriuLogger {
    /// Takes the writer lock, but gives up waiting after a while: a process CRIU forked while
    /// another thread held the lock would otherwise wait forever. A poisoned lock only means a
    /// thread panicked while logging, which is no reason to stop.
    fn lock_bounded(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
        loop {
            match self.lock.try_lock() {
                Ok(g) => return Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock)
                    if std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                Err(std::sync::TryLockError::WouldBlock) => return None,
            }
        }
    }
}

/// Writes `text` (one short line) to CRIU's standard error where that is a pipe, a terminal or
/// a file: run by hand, `criu restore` shows it on the terminal (or in the file its stderr went
/// to), and a runtime that hands CRIU the restored container's output streams (runc, crun)
/// gets it there. A socket or nothing gets nothing. Never blocks on a reader: a pipe or
/// terminal is opened again non-blocking, so a full pipe or a stalled terminal takes nothing
/// and the caller's file flags are left alone; never raises SIGPIPE; at most `PIPE_BUF` bytes,
/// in one write. Call it from CRIU's own process only (in a task being restored, fd 2 is the
/// task's).
pub fn to_stderr(text: &str) {
    use nix::fcntl::{OFlag, open};
    use nix::sys::stat::{Mode, SFlag, fstat};
    use std::os::fd::BorrowedFd;

    // SAFETY: fd 2 is only borrowed for this call; fstat of a closed fd fails with EBADF.
    let stderr = unsafe { BorrowedFd::borrow_raw(libc::STDERR_FILENO) };
    let Ok(st) = fstat(stderr) else {
        return;
    };
    let bytes = &text.as_bytes()[..text.len().min(libc::PIPE_BUF)];
    let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
    if kind == SFlag::S_IFREG {
        write_without_sigpipe(&stderr, bytes);
        return;
    }
    if kind != SFlag::S_IFIFO && kind != SFlag::S_IFCHR {
        return;
    }
    let flags = OFlag::O_WRONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
    // A pipe with no reader refuses the open (ENXIO): nothing is written.
    let Ok(fd) = open("/proc/self/fd/2", flags, Mode::empty()) else {
        return;
    };
    write_without_sigpipe(&fd, bytes);
}

/// One write of `bytes` to `fd` with SIGPIPE blocked: a reader that is gone fails the write
/// (EPIPE) instead of ending the process; the SIGPIPE it raised is taken before the signal mask
/// is put back as it was.
fn write_without_sigpipe(fd: &impl std::os::fd::AsFd, bytes: &[u8]) {
    use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};

    let mut pipe = SigSet::empty();
    pipe.add(Signal::SIGPIPE);
    let mut old = SigSet::empty();
    if pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&pipe), Some(&mut old)).is_err() {
        return;
    }
    let was_pending = sigpipe_pending();
    let wrote = nix::unistd::write(fd, bytes);
    if wrote == Err(nix::errno::Errno::EPIPE) && !was_pending {
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `pipe` is a valid signal set and `zero` a valid timeout, both live for the
        // call; no siginfo is asked for.
        unsafe { libc::sigtimedwait(pipe.as_ref(), std::ptr::null_mut(), &zero) };
    }
    let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
}

/// Whether a SIGPIPE is pending for this thread or process.
fn sigpipe_pending() -> bool {
    // SAFETY: an all-zero sigset_t is a valid value to pass to sigpending, which fills it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live sigset_t for sigpending to write and sigismember to read.
    unsafe { libc::sigpending(&mut set) == 0 && libc::sigismember(&set, libc::SIGPIPE) == 1 }
}

impl log::Log for CriuLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        self.write(
            record.level().into(),
            record.file(),
            record.line(),
            &record.args().to_string(),
        );
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_look_like_criu_macros() {
        assert_eq!(
            format_line(
                CriuLevel::Error,
                "gpu",
                Some("src/cuda/mod.rs"),
                Some(7),
                "boom"
            ),
            "Error (mod.rs:7): gpu: boom\n"
        );
        assert_eq!(
            format_line(CriuLevel::Warn, "gpu", None, None, "careful\n"),
            "Warn  (gpu): gpu: careful\n"
        );
        assert_eq!(
            format_line(CriuLevel::Info, "gpu", Some("a.rs"), Some(1), "hi"),
            "gpu: hi\n"
        );
    }

    #[test]
    fn a_pipe_whose_reader_is_gone_ends_nothing() {
        // The write fails with EPIPE, the SIGPIPE it raised is taken, and the mask is as it
        // was. (Rust ignores SIGPIPE in its own programs; inside CRIU it would be fatal.)
        let (r, w) = nix::unistd::pipe().unwrap();
        drop(r);
        let before = nix::sys::signal::SigSet::thread_get_mask().unwrap();
        write_without_sigpipe(&w, b"gpu: restore failed: test\n");
        assert!(!sigpipe_pending());
        assert_eq!(nix::sys::signal::SigSet::thread_get_mask().unwrap(), before);
    }

    #[test]
    fn long_lines_are_cut_and_keep_their_newline() {
        let msg = "ü".repeat(30_000);
        let line = format_line(CriuLevel::Info, "gpu", None, None, &msg);
        assert!(line.len() <= MAX_LINE_BYTES, "{}", line.len());
        assert!(
            line.ends_with("… (line of 60005 bytes cut)\n"),
            "{}",
            &line[4000..]
        );
        assert_eq!(line.matches('\n').count(), 1);
    }

    #[test]
    fn levels_map_onto_criu() {
        assert_eq!(CriuLevel::from(log::Level::Error) as u32, 1);
        assert_eq!(CriuLevel::from(log::Level::Warn) as u32, 2);
        assert_eq!(CriuLevel::from(log::Level::Info) as u32, 3);
        assert_eq!(CriuLevel::from(log::Level::Trace) as u32, 4);
    }
}
