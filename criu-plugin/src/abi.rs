//! CRIU's plugin ABI as the `criu` binary reads it (`criu/include/criu-plugin.h`).
//!
//! The descriptor layout has not changed since CRIU 1.4 apart from the length of the hook
//! array, and the host only reads `hooks[0 .. max_hooks)`. On x86-64 and aarch64 the fields sit
//! at: name 0, init 8, exit 16, version 24, max_hooks 28, hooks 32.

use std::ffi::{c_char, c_int, c_uint};

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

/// Declares every hook slot once: its number, the name CRIU's log and ours use, and the legacy
/// symbol name CRIU looks up for it (which also sits in the read-only data of every `criu`
/// binary that knows the hook, and is how hosts are told apart).
macro_rules! hook_slots {
    ($( $(#[$doc:meta])* $id:ident = $slot:literal, $label:literal, $legacy:literal; )*) => {
        /// Hook slots (`enum cr_plugin_hook`), with the CRIU release that introduced each.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum HookId {
            $( $(#[$doc])* $id = $slot, )*
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

            /// The legacy symbol name CRIU looks up for this hook.
            pub const fn legacy_symbol(self) -> &'static str {
                match self {
                    $(HookId::$id => $legacy,)*
                }
            }
        }
    };
}

hook_slots! {
    /// `(int fd, int id)`, all versions.
    DumpUnixSk = 0, "DUMP_UNIX_SK", "cr_plugin_dump_unix_sk";
    /// `(int id)`, all versions.
    RestoreUnixSk = 1, "RESTORE_UNIX_SK", "cr_plugin_restore_unix_sk";
    /// `(int fd, int id)`, all versions.
    DumpExtFile = 2, "DUMP_EXT_FILE", "cr_plugin_dump_file";
    /// `(int id)` up to 4.2; `(int id, bool *retry_needed)` from 4.3 (and criu-dev before it).
    RestoreExtFile = 3, "RESTORE_EXT_FILE", "cr_plugin_restore_file";
    /// `(char *mountpoint, int id)`, all versions.
    DumpExtMount = 4, "DUMP_EXT_MOUNT", "cr_plugin_dump_ext_mount";
    /// `(int id, char *mountpoint, char *old_root, int *is_file)`, all versions.
    RestoreExtMount = 5, "RESTORE_EXT_MOUNT", "cr_plugin_restore_ext_mount";
    /// `(int index, int type, char *kind)`, all versions.
    DumpExtLink = 6, "DUMP_EXT_LINK", "cr_plugin_dump_ext_link";
    /// `(int fd, const struct stat *st)`, CRIU 3.17.
    HandleDeviceVma = 7, "HANDLE_DEVICE_VMA", "cr_plugin_handle_device_vma";
    /// `(const char *path, u64 addr, u64 old_pgoff, u64 *new_pgoff, int *plugin_fd)`, CRIU 3.17.
    UpdateVmaMap = 8, "UPDATE_VMA_MAP", "cr_plugin_update_vma_map";
    /// `(int pid)`, CRIU 3.17.
    ResumeDevicesLate = 9, "RESUME_DEVICES_LATE", "cr_plugin_resume_devices_late";
    /// `(int pid)`, CRIU 4.0.
    PauseDevices = 10, "PAUSE_DEVICES", "cr_plugin_pause_devices";
    /// `(int pid)`, CRIU 4.0.
    CheckpointDevices = 11, "CHECKPOINT_DEVICES", "cr_plugin_checkpoint_devices";
    /// `(void)`, CRIU 4.2.
    PostForking = 12, "POST_FORKING", "cr_plugin_post_forking";
    /// `(void)`, CRIU 4.3 (criu-dev before it).
    RestoreInit = 13, "RESTORE_INIT", "cr_plugin_restore_init";
    /// `(int id)`, CRIU 4.3 (criu-dev before it).
    DumpDevicesLate = 14, "DUMP_DEVICES_LATE", "cr_plugin_dump_devices_late";
    /// `(uint32_t family, uint32_t state, uint32_t *src_ip, uint32_t *dst_ip)`, CRIU 4.3.
    UpdateInetsk = 15, "UPDATE_INETSK", "cr_plugin_update_inetsk";
    /// `(int ret)`, CRIU 4.3: before the dumped tasks are released; `ret` non-zero when they
    /// will be resumed because the dump failed (a failing post-dump script included). CRIU 4.3
    /// has no legacy name for it; this one is in no CRIU.
    DumpFinish = 16, "DUMP_FINISH", "cr_plugin_dump_finish";
}

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
