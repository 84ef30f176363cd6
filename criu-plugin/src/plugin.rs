//! The safe side of the ABI, generated from the hook table ([`crate::hooks`]): [`Plugin`] and
//! [`HookHandler`] with one method per hook, and the `extern "C"` trampolines CRIU calls, which
//! contain every panic and turn errors into negative errno.
//!
//! CRIU chains plugins per hook: `-ENOTSUP` means "not mine, ask the next plugin"; any other
//! value ends the chain. [`HookError::NotMine`] is that answer.

mod panics;

use std::ffi::{CStr, c_char, c_int};
use std::os::fd::RawFd;

use crate::abi::{HOOK_SLOTS, HookId, PluginDesc, RawHook, Stage};
use crate::error::{HookError, HookResult, Phase};
use crate::hooks::{Chain, ChainRule, Reborrow};
use crate::log::CriuLogger;
pub use panics::guard;

/// The answer to `UPDATE_VMA_MAP` for a mapping the plugin owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmaUpdate {
    /// The new file offset for the mapping (`*new_pgoff`).
    pub new_pgoff: u64,
    /// An fd CRIU maps instead of reopening the path, and then closes; `None` for -1.
    pub plugin_fd: Option<RawFd>,
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

/// `r`, its failure also written to CRIU's standard error where `restore`
/// ([`log::to_stderr`]: a user running `criu restore` or a runtime that hands CRIU the
/// container's output streams gets it). Only for `init`, which runs in CRIU's own process:
/// later restore hooks may run in a task being restored, whose fd 2 is the task's own.
///
/// [`log::to_stderr`]: crate::log::to_stderr
fn told<P: Plugin>(r: HookResult, restore: bool) -> HookResult {
    if let (true, Err(HookError::Failed(f))) = (restore, &r) {
        crate::log::to_stderr(&format!(
            "{}: restore failed: {}\n",
            P::LOG_PREFIX,
            f.log_line()
        ));
    }
    r
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
                    let r = P::instance().init(stage).map_err(|e| e.in_phase(Phase::Init));
                    ret(told::<P>(r, stage == Stage::Restore), |_| 0)
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
mod tests;
