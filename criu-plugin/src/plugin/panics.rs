//! Panics contained at the hook boundary: a hook body's panic is logged with its file and
//! line and becomes `-EIO`, never unwinding into CRIU, and a hook that leaves CRIU's process
//! with more threads than it found is reported.

use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use super::Plugin;
use crate::error::{Failure, panic_message};
use crate::log::CriuLevel;

/// Most panics one hook call records.
const MAX_PANICS_SEEN: usize = 16;

/// A panic the hook of [`PanicWatch`] saw: where, and on which thread.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PanicSeen {
    location: Option<String>,
    thread: std::thread::ThreadId,
    thread_name: Option<String>,
}

/// Rust's panic hook replaced for one hook call by one that records where each panic happened
/// (in CRIU's thread or a worker of the plugin's) and prints nothing; the previous hook is put
/// back when the call ends, so nothing stays behind between hooks.
struct PanicWatch {
    seen: Arc<Mutex<Vec<PanicSeen>>>,
    previous: Option<Box<PanicHook>>,
}

type PanicHook = dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send + 'static;

impl PanicWatch {
    fn start() -> PanicWatch {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let previous = std::panic::take_hook();
        let record = Arc::clone(&seen);
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            let p = PanicSeen {
                location: info.location().map(|l| l.to_string()),
                thread: thread.id(),
                thread_name: thread.name().map(str::to_string),
            };
            let mut seen = record.lock().unwrap_or_else(|e| e.into_inner());
            if seen.len() < MAX_PANICS_SEEN {
                seen.push(p);
            }
        }));
        PanicWatch {
            seen,
            previous: Some(previous),
        }
    }

    /// Puts the previous hook back; the panics seen.
    fn stop(mut self) -> Vec<PanicSeen> {
        self.restore();
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.clone()
    }

    fn restore(&mut self) {
        if let Some(previous) = self.previous.take() {
            drop(std::panic::take_hook());
            std::panic::set_hook(previous);
        }
    }
}

impl Drop for PanicWatch {
    fn drop(&mut self) {
        self.restore();
    }
}

/// Runs a hook body with panics contained: its return value (`-EIO` for a panic), and the
/// lines to log for every panic of the call, with the file and line where it happened.
pub(super) fn contain(hook: &str, body: impl FnOnce() -> c_int) -> (c_int, Vec<String>) {
    let watch = PanicWatch::start();
    let result = catch_unwind(AssertUnwindSafe(body));
    let mut seen = watch.stop();
    let me = std::thread::current().id();
    let mut lines = Vec::new();
    let rc = match result {
        Ok(rc) => rc,
        Err(payload) => {
            // The hook's own panic is the last one seen on this thread.
            let own = seen
                .iter()
                .rposition(|p| p.thread == me)
                .map(|i| seen.remove(i));
            let location = own.and_then(|p| p.location);
            let f = Failure::panic(
                format!("in {hook}"),
                &panic_message(payload.as_ref()),
                location.as_deref(),
            );
            lines.push(format!("{}; the operation is failed safely", f.log_line()));
            -libc::EIO
        }
    };
    for p in seen {
        let at = p.location.as_deref().unwrap_or("an unknown place");
        let thread = p.thread_name.as_deref().unwrap_or("unnamed");
        lines.push(format!(
            "{hook}: a panic at {at} on thread {thread} was contained [panic]"
        ));
    }
    (rc, lines)
}

/// Runs a hook body: a panic is logged with its file and line and returned as `-EIO`, never
/// unwound into CRIU.
///
/// CRIU's process must be single-threaded whenever a hook returns (`setns(2)` into a
/// container's namespaces fails otherwise): a hook entered with one thread that returns with
/// more is reported at ERROR, naming the hook, so that the defect shows in CRIU's log rather
/// than as a failed `setns` later.
pub fn guard<P: Plugin>(hook: &str, body: impl FnOnce() -> c_int) -> c_int {
    let single = crate::child::thread_count() == Some(1);
    let (rc, panics) = contain(hook, body);
    for line in panics {
        P::logger().write(CriuLevel::Error, None, None, &line);
    }
    if single {
        if let Some(n @ 2..) = crate::child::thread_count() {
            let msg = format!(
                "{hook} left CRIU's process with {n} threads; CRIU cannot enter a container's namespaces now"
            );
            P::logger().write(CriuLevel::Error, None, None, &msg);
        }
    }
    rc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::tests::serial;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_panic_is_logged_with_its_file_and_line_and_the_panic_hook_put_back() {
        let _serial = serial();
        static PREVIOUS_HOOK_RAN: AtomicUsize = AtomicUsize::new(0);
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {
            PREVIOUS_HOOK_RAN.fetch_add(1, Ordering::SeqCst);
        }));
        let line = line!() + 2;
        let (rc, lines) = contain("PAUSE_DEVICES", || {
            panic!("pid 3 is cursed");
        });
        assert_eq!(rc, -libc::EIO);
        assert_eq!(
            lines,
            [format!(
                "internal error in PAUSE_DEVICES: panic at {}:{line}:13: pid 3 is cursed [panic]; the operation is failed safely",
                file!()
            )]
        );
        // A worker's panic, contained by the plugin itself, is logged too, with its thread.
        let (rc, lines) = contain("CHECKPOINT_DEVICES", || {
            std::thread::scope(|s| {
                let worker = std::thread::Builder::new().name("cuda-7".into());
                let h = worker.spawn_scoped(s, || panic!("worker")).unwrap();
                assert!(h.join().is_err());
            });
            0
        });
        assert_eq!(rc, 0);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with(&format!("CHECKPOINT_DEVICES: a panic at {}:", file!())));
        assert!(
            lines[0].ends_with(" on thread cuda-7 was contained [panic]"),
            "{lines:?}"
        );
        // Neither panic reached the hook that was in place; it is back after each call.
        assert_eq!(PREVIOUS_HOOK_RAN.load(Ordering::SeqCst), 0);
        let _ = catch_unwind(|| panic!("outside a hook"));
        assert_eq!(PREVIOUS_HOOK_RAN.load(Ordering::SeqCst), 1);
        std::panic::set_hook(before);
    }
}
