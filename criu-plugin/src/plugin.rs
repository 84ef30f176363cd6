//! The safe side of the ABI, generated from the hook table ([`crate::hooks`]): [`Plugin`] and
//! [`HookHandler`] with one method per hook, and the `extern "C"` trampolines CRIU calls, which
//! contain every panic and turn errors into negative errno.
//!
//! CRIU chains plugins per hook: `-ENOTSUP` means "not mine, ask the next plugin"; any other
//! value ends the chain. [`HookError::NotMine`] is that answer.

use std::ffi::{CStr, c_char, c_int};
use std::os::fd::RawFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use crate::abi::{HOOK_SLOTS, HookId, PluginDesc, RawHook, Stage};
use crate::error::{Failure, HookError, HookResult, Phase, panic_message};
use crate::hooks::{Chain, ChainRule, Reborrow};
use crate::log::{CriuLevel, CriuLogger};

/// The answer to `UPDATE_VMA_MAP` for a mapping the plugin owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmaUpdate {
    /// The new file offset for the mapping (`*new_pgoff`).
    pub new_pgoff: u64,
    /// An fd CRIU maps instead of reopening the path, and then closes; `None` for -1.
    pub plugin_fd: Option<RawFd>,
}

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
fn contain(hook: &str, body: impl FnOnce() -> c_int) -> (c_int, Vec<String>) {
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

/// CRIU's answer for a hook's result; a failure not logged yet is logged here, once.
fn ret<T>(r: HookResult<T>, ok: impl FnOnce(T) -> c_int) -> c_int {
    match r {
        Ok(v) => ok(v),
        Err(e) => {
            if let HookError::Failed(f) = &e {
                log::error!("{}", f.log_line());
            }
            e.to_return()
        }
    }
}

fn id_u32(id: c_int) -> u32 {
    id as u32
}

macro_rules! erase {
    ($f:expr, $ty:ty) => {{
        let f: $ty = $f;
        // SAFETY: function pointers of every signature share one representation; CRIU calls
        // the slot with the signature `$ty` spells out.
        Some(unsafe { std::mem::transmute::<$ty, unsafe extern "C" fn()>(f) })
    }};
}

/// Runs a row's C glue on the plugin's method.
fn glue<F, R>(call: F, glue: impl FnOnce(F) -> R) -> R {
    glue(call)
}

/// Generates from the hook table ([`crate::hooks`]): [`Plugin`], [`HookHandler`], each hook's
/// `extern "C"` trampoline, and [`hook_pointer`] from the same rows, so that a trampoline and
/// its slot cannot disagree on the signature. The glue runs inside [`guard`] and returns the
/// hook's C value.
macro_rules! hook_items {
    ($({
        $(#[$doc:meta])*
        $id:ident = $slot:literal, $label:literal, $legacy:literal, since $since:ident, $chain:ident, $phase:ident,
        fn $method:ident($($arg:ident: $ty:ty),*) -> $out:ty,
        extern ($($carg:ident: $cty:ty),*) $glue:expr
    })*) => {
        /// A CRIU plugin. A hook the plugin does not implement itself goes to its handlers
        /// ([`Plugin::each_handler`]) as [`HookId::chain_rule`] says; with none (the default)
        /// the answer is [`HookError::NotMine`]. List the hooks the plugin serves in
        /// [`Plugin::HOOKS`] so that CRIU only calls those.
        pub trait Plugin: Sync + 'static {
            /// Name in the descriptor (CRIU's debug log shows it).
            const NAME: &'static CStr;
            /// Prefix of every log line.
            const LOG_PREFIX: &'static str;
            /// Hooks to register.
            const HOOKS: &'static [HookId];
            /// What the plugin forwards hooks to (its backends).
            type Handler: HookHandler + ?Sized;

            /// The plugin's single instance.
            fn instance() -> &'static Self;

            /// The logger the trampolines install at `init`.
            fn logger() -> &'static CriuLogger;

            /// `init(stage)`: an error fails the whole CRIU run, so a plugin with nothing to do
            /// (no GPU) returns `Ok` and disables itself.
            fn init(&self, stage: Stage) -> HookResult;
            /// `exit(stage, ret)`: `ret` is CRIU's result so far (non-zero means failure).
            /// `stage` is `None` when CRIU passed one this crate does not know: the plugin
            /// still has to clean up the run it knows it is in.
            fn exit(&self, stage: Option<Stage>, ret: i32);

            /// Shows `visit` the handlers of this run in chain order, until it answers
            /// `false`; none by default.
            fn each_handler(&self, visit: &mut dyn FnMut(&mut Self::Handler) -> bool) {
                let _ = visit;
            }

            $(
                $(#[$doc])*
                fn $method(&self, $($arg: $ty),*) -> HookResult<$out> {
                    let mut chain = Chain::new(ChainRule::$chain);
                    $(let mut $arg = $arg;)*
                    self.each_handler(&mut |h| chain.offer(h.$method($($arg.again()),*)));
                    chain.answer()
                }
            )*
        }

        /// Something a plugin forwards hooks to (a GPU vendor's backend); every hook defaults
        /// to [`HookError::NotMine`].
        #[allow(unused_variables)]
        pub trait HookHandler {
            $(
                $(#[$doc])*
                fn $method(&mut self, $($arg: $ty),*) -> HookResult<$out> {
                    Err(HookError::NotMine)
                }
            )*
        }

        /// The `extern "C"` functions CRIU calls; each forwards to [`Plugin`] inside [`guard`].
        ///
        /// # Safety
        /// Every function here must be called only as CRIU calls the hook slot of the same
        /// name: with pointer arguments that are null or valid for the duration of the call.
        #[allow(clippy::missing_safety_doc)]
        pub mod trampolines {
            use super::*;

            $(
                #[doc = concat!("`", $label, "` as CRIU calls it.")]
                pub unsafe extern "C" fn $method<P: Plugin>($($carg: $cty),*) -> c_int {
                    guard::<P>(HookId::$id.label(), || {
                        glue(
                            |$($arg: $ty),*| {
                                P::instance()
                                    .$method($($arg),*)
                                    .map_err(|e| e.in_phase(Phase::$phase))
                            },
                            $glue,
                        )
                    })
                }
            )*

            /// `init`.
            pub unsafe extern "C" fn init<P: Plugin>(stage: c_int) -> c_int {
                guard::<P>("init", || {
                    CriuLogger::install(P::logger());
                    let Some(stage) = Stage::from_raw(stage) else {
                        log::error!("unknown CRIU stage {stage}");
                        return -libc::EINVAL;
                    };
                    ret(P::instance().init(stage).map_err(|e| e.in_phase(Phase::Init)), |_| 0)
                })
            }

            /// `exit`.
            pub unsafe extern "C" fn exit<P: Plugin>(stage: c_int, rc: c_int) {
                guard::<P>("exit", || {
                    P::instance().exit(Stage::from_raw(stage), rc);
                    0
                });
            }

            /// `RESTORE_EXT_FILE` as CRIU 4.3 (and criu-dev before it) calls it, with
            /// `bool *retry_needed`: the second C signature of one hook.
            pub unsafe extern "C" fn restore_ext_file_retry<P: Plugin>(
                id: c_int,
                retry_needed: *mut bool,
            ) -> c_int {
                guard::<P>(HookId::RestoreExtFile.label(), || {
                    let mut retry = false;
                    let rc = ret(
                        P::instance()
                            .restore_ext_file(id_u32(id), Some(&mut retry))
                            .map_err(|e| e.in_phase(Phase::Restore)),
                        |fd| fd,
                    );
                    // The host leaves its flag uninitialised: always write it.
                    if !retry_needed.is_null() {
                        // SAFETY: the host passes a pointer to a live bool on its stack.
                        unsafe { retry_needed.write(retry) };
                    }
                    rc
                })
            }
        }

        /// The hook pointer for slot `hook` of plugin `P`.
        pub const fn hook_pointer<P: Plugin>(hook: HookId) -> RawHook {
            match hook {
                $(HookId::$id => erase!(
                    trampolines::$method::<P>,
                    unsafe extern "C" fn($($cty),*) -> c_int
                ),)*
            }
        }
    };
}

crate::hooks::for_each_hook!(hook_items);

/// The `RESTORE_EXT_FILE` variant for criu-dev hosts.
pub const fn restore_ext_file_retry_pointer<P: Plugin>() -> RawHook {
    erase!(
        trampolines::restore_ext_file_retry::<P>,
        unsafe extern "C" fn(c_int, *mut bool) -> c_int
    )
}

/// The descriptor for plugin `P`, with the hooks of [`Plugin::HOOKS`] filled in.
pub const fn descriptor<P: Plugin>() -> PluginDesc {
    let mut hooks: [RawHook; HOOK_SLOTS] = [None; HOOK_SLOTS];
    let mut i = 0;
    while i < P::HOOKS.len() {
        let h = P::HOOKS[i];
        hooks[h.index()] = hook_pointer::<P>(h);
        i += 1;
    }
    PluginDesc::new(
        P::NAME,
        erase_init(trampolines::init::<P>),
        erase_exit(trampolines::exit::<P>),
        hooks,
    )
}

const fn erase_init(f: unsafe extern "C" fn(c_int) -> c_int) -> Option<crate::abi::InitFn> {
    Some(f)
}

const fn erase_exit(f: unsafe extern "C" fn(c_int, c_int)) -> Option<crate::abi::ExitFn> {
    Some(f)
}

/// Exports `CR_PLUGIN_DESC` for plugin type `$plugin`, and a library constructor that fits the
/// descriptor to the loading CRIU before `dlopen` returns. Use it once, in the cdylib crate
/// itself (`#[no_mangle]` items of dependencies are not reliably exported).
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        /// The descriptor CRIU looks up after `dlopen`.
        #[unsafe(no_mangle)]
        pub static mut CR_PLUGIN_DESC: $crate::abi::PluginDesc =
            $crate::plugin::descriptor::<$plugin>();

        #[used]
        #[unsafe(link_section = ".init_array")]
        static __CRIU_PLUGIN_ADAPT: extern "C" fn() = {
            extern "C" fn adapt() {
                // A panic here would abort CRIU inside dlopen: contain it and keep the
                // descriptor's defaults.
                let _ = ::std::panic::catch_unwind(|| {
                    // SAFETY: constructors run inside dlopen before CRIU reads the descriptor,
                    // and nothing else touches it then.
                    unsafe {
                        $crate::host::adapt_descriptor(
                            &raw mut CR_PLUGIN_DESC,
                            $crate::plugin::restore_ext_file_retry_pointer::<$plugin>(),
                        )
                    }
                });
            }
            adapt
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{MutexGuard, PoisonError};

    /// The tests that run hooks, one at a time: each swaps the process's panic hook.
    fn serial() -> MutexGuard<'static, ()> {
        static SERIAL: Mutex<()> = Mutex::new(());
        SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
    }

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

    struct Probe {
        calls: Mutex<Vec<String>>,
        panics: AtomicUsize,
        backends: Mutex<Vec<Backend>>,
    }

    static PROBE: Probe = Probe {
        calls: Mutex::new(Vec::new()),
        panics: AtomicUsize::new(0),
        backends: Mutex::new(Vec::new()),
    };
    static LOGGER: CriuLogger = CriuLogger::new("probe");

    impl Plugin for Probe {
        const NAME: &'static CStr = c"probe";
        const LOG_PREFIX: &'static str = "probe";
        const HOOKS: &'static [HookId] = &[
            HookId::PauseDevices,
            HookId::RestoreExtFile,
            HookId::UpdateVmaMap,
        ];
        type Handler = Backend;
        fn instance() -> &'static Self {
            &PROBE
        }
        fn each_handler(&self, visit: &mut dyn FnMut(&mut Backend) -> bool) {
            for b in self.backends.lock().unwrap().iter_mut() {
                if !visit(b) {
                    break;
                }
            }
        }
        fn logger() -> &'static CriuLogger {
            &LOGGER
        }
        fn init(&self, _stage: Stage) -> HookResult {
            Ok(())
        }
        fn exit(&self, stage: Option<Stage>, ret: i32) {
            self.calls
                .lock()
                .unwrap()
                .push(format!("exit {stage:?} {ret}"));
        }
        fn pause_devices(&self, pid: i32) -> HookResult {
            match pid {
                1 => Ok(()),
                2 => Err(HookError::logged(libc::ETIMEDOUT)),
                3 => {
                    self.panics.fetch_add(1, Ordering::SeqCst);
                    panic!("pid 3 is cursed")
                }
                4 => Err(HookError::logged(0)),
                _ => Err(HookError::NotMine),
            }
        }
        fn restore_ext_file(&self, id: u32, retry: Option<&mut bool>) -> HookResult<RawFd> {
            if let Some(r) = retry {
                *r = id == 9;
            }
            Ok(id as RawFd + 100)
        }
        fn update_vma_map(&self, _p: &CStr, _a: u64, old: u64) -> HookResult<VmaUpdate> {
            Ok(VmaUpdate {
                new_pgoff: old + 1,
                plugin_fd: None,
            })
        }
    }

    #[test]
    fn descriptor_fills_only_listed_hooks() {
        let d = descriptor::<Probe>();
        assert_eq!(d.version, crate::abi::CRIU_PLUGIN_VERSION);
        assert_eq!(d.max_hooks as usize, HOOK_SLOTS);
        for h in HookId::ALL {
            assert_eq!(
                d.hooks[h.index()].is_some(),
                Probe::HOOKS.contains(&h),
                "{h:?}"
            );
        }
        assert!(d.init.is_some() && d.exit.is_some());
    }

    #[test]
    fn errors_become_negative_errno_and_panics_are_contained() {
        let _serial = serial();
        // SAFETY: calling the trampolines directly as CRIU would.
        unsafe {
            assert_eq!(trampolines::pause_devices::<Probe>(1), 0);
            assert_eq!(trampolines::pause_devices::<Probe>(2), -libc::ETIMEDOUT);
            assert_eq!(trampolines::pause_devices::<Probe>(7), -libc::ENOTSUP);
            assert_eq!(trampolines::pause_devices::<Probe>(4), -libc::EIO);
            assert_eq!(trampolines::pause_devices::<Probe>(3), -libc::EIO);
        }
        assert_eq!(PROBE.panics.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn retry_flag_is_always_written() {
        let _serial = serial();
        let mut flag = true;
        // SAFETY: `flag` outlives the call.
        let fd = unsafe { trampolines::restore_ext_file_retry::<Probe>(5, &mut flag) };
        assert_eq!((fd, flag), (105, false));
        // SAFETY: as above.
        let fd = unsafe { trampolines::restore_ext_file_retry::<Probe>(9, &mut flag) };
        assert_eq!((fd, flag), (109, true));
        // SAFETY: the 1-argument variant takes only the id.
        assert_eq!(unsafe { trampolines::restore_ext_file::<Probe>(1) }, 101);
    }

    #[test]
    fn update_vma_map_returns_one_and_writes_outputs() {
        let _serial = serial();
        let (mut pg, mut fd) = (0u64, 7);
        // SAFETY: outputs point to locals; the path is a valid C string.
        let rc = unsafe {
            trampolines::update_vma_map::<Probe>(c"/dev/kfd".as_ptr(), 0, 41, &mut pg, &mut fd)
        };
        assert_eq!((rc, pg, fd), (1, 42, -1));
    }

    #[test]
    fn exit_is_forwarded_with_stage() {
        let _serial = serial();
        // SAFETY: calling the exit trampoline as CRIU would.
        unsafe { trampolines::exit::<Probe>(0, -1) };
        // SAFETY: as above; an unknown stage is forwarded as `None`, so that the plugin can
        // still end the run it is in.
        unsafe { trampolines::exit::<Probe>(9, 0) };
        let calls = PROBE.calls.lock().unwrap();
        assert_eq!(calls.iter().filter(|c| c.starts_with("exit")).count(), 2);
        assert!(calls.contains(&"exit Some(Dump) -1".to_string()));
        assert!(calls.contains(&"exit None 0".to_string()));
    }

    #[test]
    fn a_failure_is_the_errno_crius_gets() {
        use crate::error::FailureKind;
        let f: HookError = Failure::new(FailureKind::Driver, libc::ETIMEDOUT, "slow").into();
        assert_eq!(f, HookError::logged(libc::ETIMEDOUT));
        assert_eq!(f.errno(), libc::ETIMEDOUT);
        assert_ne!(f, HookError::NotMine);
        let zero: HookError = Failure::new(FailureKind::Internal, 0, "no errno").into();
        assert_eq!(zero.to_return(), -libc::EIO);
    }

    #[test]
    fn hook_error_mapping() {
        assert_eq!(HookError::NotMine.to_return(), -95);
        assert_eq!(HookError::logged(libc::ENOTSUP).to_return(), -libc::EIO);
        assert_eq!(HookError::logged(-3).to_return(), -libc::EIO);
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(HookError::from(io), HookError::logged(libc::ENOENT));
    }

    /// A backend of [`Probe`]: answers for one pid, says "not mine" for the others, and
    /// counts what it was asked.
    struct Backend {
        pid: i32,
        asked: usize,
        finish: HookResult,
    }

    impl HookHandler for Backend {
        fn checkpoint_devices(&mut self, pid: i32) -> HookResult {
            self.asked += 1;
            if pid == self.pid {
                Ok(())
            } else {
                Err(HookError::NotMine)
            }
        }
        fn restore_ext_mount(
            &mut self,
            id: u32,
            _mountpoint: &CStr,
            _old_root: &CStr,
            is_file: Option<&mut bool>,
        ) -> HookResult {
            if let Some(f) = is_file {
                *f = !*f;
            }
            if id as i32 == self.pid {
                Ok(())
            } else {
                Err(HookError::NotMine)
            }
        }
        fn dump_finish(&mut self, _ret: i32) -> HookResult {
            self.asked += 1;
            self.finish.clone()
        }
    }

    #[test]
    fn hooks_not_implemented_go_to_the_handlers_as_the_table_says() {
        let _serial = serial();
        let backend = |pid, finish| Backend {
            pid,
            asked: 0,
            finish,
        };
        *PROBE.backends.lock().unwrap() = vec![
            backend(1, Err(HookError::NotMine)),
            backend(2, Err(HookError::logged(libc::EPERM))),
            backend(3, Ok(())),
        ];
        let asked = || {
            let b = PROBE.backends.lock().unwrap();
            b.iter().map(|b| b.asked).collect::<Vec<_>>()
        };
        // SAFETY: calling the trampolines directly as CRIU would.
        unsafe {
            // First rule: the owner answers, the ones after it are not asked.
            assert_eq!(trampolines::checkpoint_devices::<Probe>(2), 0);
            assert_eq!(asked(), [1, 1, 0]);
            assert_eq!(trampolines::checkpoint_devices::<Probe>(9), -libc::ENOTSUP);
            assert_eq!(asked(), [2, 2, 1]);
            // All rule: everyone is asked; the first failure is the answer.
            assert_eq!(trampolines::dump_finish::<Probe>(0), -libc::EPERM);
            assert_eq!(asked(), [3, 3, 2]);
        }
        // Every handler asked gets the output to write, in turn: two flips, then three.
        let mount = |id, is_file: &mut c_int| {
            let (mp, root) = (c"/m".as_ptr().cast_mut(), c"/".as_ptr().cast_mut());
            // SAFETY: the strings are valid and `is_file` outlives the call.
            unsafe { trampolines::restore_ext_mount::<Probe>(id, mp, root, is_file) }
        };
        let mut is_file = 0;
        assert_eq!((mount(2, &mut is_file), is_file), (0, 0));
        assert_eq!((mount(3, &mut is_file), is_file), (0, 1));
    }
}
