//! CRIU's plugin ABI as the `criu` binary reads it (`criu/include/criu-plugin.h`).
//!
//! The descriptor layout has not changed since CRIU 1.4 apart from the length of the hook
//! array, and the host only reads `hooks[0 .. max_hooks)`. On x86-64 and aarch64 the fields sit
//! at: name 0, init 8, exit 16, version 24, max_hooks 28, hooks 32.

use std::ffi::{c_char, c_int, c_uint};

use crate::error::Phase;
use crate::hooks::ChainRule;

/// A CRIU release family, as far as the plugin ABI distinguishes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HostVersion {
    /// Not a CRIU we recognise (for example a plain `dlopen` from another program).
    Unknown,
    /// CRIU before 3.17: 7 hooks, no device hooks.
    Pre317,
    /// CRIU 3.17 to 3.19: 10 hooks.
    V3_17,
    /// CRIU 4.0 to 4.1.x: 12 hooks.
    V4_0,
    /// CRIU 4.2: 13 hooks.
    V4_2,
    /// criu-dev after 4.2: 15 hooks, `RESTORE_EXT_FILE(id, bool *retry_needed)`.
    Dev,
    /// CRIU 4.3 (and criu-dev after it): 17 hooks (`UPDATE_INETSK`, `DUMP_FINISH`), plugin
    /// options, `RESTORE_EXT_FILE(id, bool *retry_needed)`.
    V4_3,
}

impl std::fmt::Display for HostVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostVersion::Unknown => "a program that is not CRIU",
            HostVersion::Pre317 => "CRIU before 3.17",
            HostVersion::V3_17 => "CRIU 3.17-3.19",
            HostVersion::V4_0 => "CRIU 4.0-4.1",
            HostVersion::V4_2 => "CRIU 4.2",
            HostVersion::Dev => "criu-dev",
            HostVersion::V4_3 => "CRIU 4.3",
        })
    }
}

/// The descriptor version CRIU accepts (`CRIU_PLUGIN_VERSION`, 0.2.0, since CRIU 1.4).
///
/// Never 0x100 (`CRIU_PLUGIN_VERSION_OLD`): `cr_plugin_fini` frees descriptors with that
/// version, assuming the host allocated them.
pub const CRIU_PLUGIN_VERSION: c_uint = 0x0200;

/// The pre-descriptor version CRIU frees on unload; exported only so tests can refuse it.
pub const CRIU_PLUGIN_VERSION_OLD: c_uint = 0x0100;

/// Number of hook slots this crate knows (`CR_PLUGIN_HOOK__MAX` of CRIU 4.3).
pub const HOOK_SLOTS: usize = 17;

/// The stage a plugin is initialised for (`enum cr_plugin_stage`, the same in every CRIU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// `criu dump` (`CR_PLUGIN_STAGE__DUMP`).
    Dump,
    /// `criu pre-dump` (`CR_PLUGIN_STAGE__PRE_DUMP`): CRIU never calls `exit` for it.
    PreDump,
    /// `criu restore` (`CR_PLUGIN_STAGE__RESTORE`).
    Restore,
}

impl Stage {
    /// Decodes CRIU's stage number.
    pub fn from_raw(raw: c_int) -> Option<Stage> {
        match raw {
            0 => Some(Stage::Dump),
            1 => Some(Stage::PreDump),
            2 => Some(Stage::Restore),
            _ => None,
        }
    }

    /// CRIU's stage number.
    pub fn as_raw(self) -> c_int {
        match self {
            Stage::Dump => 0,
            Stage::PreDump => 1,
            Stage::Restore => 2,
        }
    }
}

/// Generates [`HookId`] from the hook table ([`crate::hooks`]).
macro_rules! hook_ids {
    ($({
        $(#[$doc:meta])*
        $id:ident = $slot:literal, $label:literal, $legacy:literal, since $since:ident, $chain:ident, $phase:ident,
        $($signatures:tt)*
    })*) => {
        /// Hook slots (`enum cr_plugin_hook`), with the CRIU release that introduced each.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum HookId {
            $(
                $(#[$doc])*
                #[doc = concat!("\n\nSince ", stringify!($since), " ([`HostVersion`]).")]
                $id = $slot,
            )*
        }

        impl HookId {
            /// Every hook in slot order.
            pub const ALL: [HookId; HOOK_SLOTS] = [$(HookId::$id),*];

            /// The hook's name as CRIU's sources and logs spell it (`PAUSE_DEVICES`).
            pub const fn label(self) -> &'static str {
                match self {
                    $(HookId::$id => $label,)*
                }
            }

            /// The legacy symbol name CRIU looks up for this hook (which also sits in the
            /// read-only data of every `criu` binary that knows the hook, and is how hosts are
            /// told apart).
            pub const fn legacy_symbol(self) -> &'static str {
                match self {
                    $(HookId::$id => $legacy,)*
                }
            }

            /// The first CRIU release family that calls the hook.
            pub const fn since(self) -> HostVersion {
                match self {
                    $(HookId::$id => HostVersion::$since,)*
                }
            }

            /// The phase of CRIU's run the hook belongs to.
            pub const fn phase(self) -> Phase {
                match self {
                    $(HookId::$id => Phase::$phase,)*
                }
            }

            /// How a plugin chains the hook through its handlers.
            pub const fn chain_rule(self) -> ChainRule {
                match self {
                    $(HookId::$id => ChainRule::$chain,)*
                }
            }
        }
    };
}

crate::hooks::for_each_hook!(hook_ids);

impl HookId {
    /// The slot index in the descriptor's hook array.
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// A type-erased hook pointer as stored in the descriptor (`void *hooks[]`).
pub type RawHook = Option<unsafe extern "C" fn()>;

/// `int (*init)(int stage)`.
pub type InitFn = unsafe extern "C" fn(stage: c_int) -> c_int;
/// `void (*exit)(int stage, int ret)`.
pub type ExitFn = unsafe extern "C" fn(stage: c_int, ret: c_int);

/// `cr_plugin_desc_t`, laid out exactly as CRIU reads it.
#[repr(C)]
#[derive(Debug)]
pub struct PluginDesc {
    /// Plugin name, shown in CRIU's debug log.
    pub name: *const c_char,
    /// Called once per stage after loading; non-zero fails the whole CRIU run.
    pub init: Option<InitFn>,
    /// Called at the end of dump and restore (never for pre-dump).
    pub exit: Option<ExitFn>,
    /// Must be at most [`CRIU_PLUGIN_VERSION`] and never [`CRIU_PLUGIN_VERSION_OLD`].
    pub version: c_uint,
    /// How many hook slots the host may read; more than the host knows fails every CRIU run.
    pub max_hooks: c_uint,
    /// Hook pointers; NULL slots are skipped by the host.
    pub hooks: [RawHook; HOOK_SLOTS],
}

// SAFETY: the descriptor holds only a pointer to a static C string and function pointers, all
// immutable after the load-time constructor adjusts `max_hooks`.
unsafe impl Sync for PluginDesc {}

impl PluginDesc {
    /// A descriptor with every slot set from `hooks`; `max_hooks` starts at the full count and is
    /// lowered to the host's by [`crate::host::adapt_descriptor`].
    pub const fn new(
        name: &'static std::ffi::CStr,
        init: Option<InitFn>,
        exit: Option<ExitFn>,
        hooks: [RawHook; HOOK_SLOTS],
    ) -> PluginDesc {
        PluginDesc {
            name: name.as_ptr(),
            init,
            exit,
            version: CRIU_PLUGIN_VERSION,
            max_hooks: HOOK_SLOTS as c_uint,
            hooks,
        }
    }
}

/// Signature of `print_on_level` (`void print_on_level(unsigned int loglevel, const char *format, ...)`).
pub type PrintOnLevelFn = unsafe extern "C" fn(c_uint, *const c_char, ...);
