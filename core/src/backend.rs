//! One vocabulary for every GPU vendor: pause, checkpoint, resume.
//!
//! Each vendor implements [`GpuBackend`] and, for the hooks it serves, [`HookHandler`], whose
//! methods `criu-plugin` generates from its hook table; [`crate::GpuPlugin`] hands CRIU's hooks
//! to the backends as that table says: the first backend that does not answer
//! [`HookError::NotMine`] owns the call, and every backend gets `DUMP_FINISH`.
//!
//! | CRIU hook | backend method | NVIDIA | AMD |
//! |---|---|---|---|
//! | `init` | [`GpuBackend::init`] | load libcuda, claim inventory | read topology, claim inventory |
//! | `PAUSE_DEVICES` | [`HookHandler::pause_devices`] | lock | — |
//! | `CHECKPOINT_DEVICES` | [`HookHandler::checkpoint_devices`] | checkpoint (whole tree at once) | — |
//! | `HANDLE_DEVICE_VMA` | [`HookHandler::handle_device_vma`] | — | claim KFD/DRM mappings |
//! | `DUMP_EXT_FILE` | [`HookHandler::dump_ext_file`] | — | KFD checkpoint, BO contents |
//! | `DUMP_DEVICES_LATE` | [`HookHandler::dump_devices_late`] | — | unpause queues |
//! | `DUMP_FINISH` | [`HookHandler::dump_finish`] | put back after a failed dump | unpause after a failed dump |
//! | `RESTORE_INIT` | [`HookHandler::restore_init`] | — | shared restore state |
//! | `RESTORE_EXT_FILE` | [`HookHandler::restore_ext_file`] | — | KFD restore |
//! | `UPDATE_VMA_MAP` | [`HookHandler::update_vma_map`] | — | offset remapping |
//! | `POST_FORKING` | [`HookHandler::post_forking`] | tells the guardian of the root (never answers) | claims the parallel restore |
//! | `RESUME_DEVICES_LATE` | [`HookHandler::resume_devices_late`] | restore + unlock | KFD resume |
//! | `exit` | [`GpuBackend::exit`] | put every touched process back | unpause on failure |
//!
//! Per-task restore hooks (`RESTORE_EXT_FILE`, `UPDATE_VMA_MAP`) run in tasks CRIU forked from
//! its main process: a backend's own threads must never hold a lock that such a hook takes.
//!
//! Both backends answer with one error type, [`HookError`]: "not mine", or a
//! [`criu_plugin::Failure`] (a positive errno for CRIU, a [`criu_plugin::FailureKind`], the
//! phase, the sentence for the user, its cause) carried up to the hook, where `criu-plugin`
//! writes it to CRIU's log once, with its kind (`... [machine]`), and makes the errno negative.

use std::ffi::CStr;

pub use criu_plugin::HookHandler;
use criu_plugin::{HookError, Host, InventoryListing, Stage};

use crate::config::Config;

/// What a backend learns at `init`.
pub struct InitContext<'a> {
    /// The CRIU that loaded the plugin.
    pub host: Host,
    /// The plugin's settings.
    pub config: &'a Config,
    /// What the image's inventory says of this backend's name (restore only; `NoList` at dump).
    /// `Listed` means the name is claimed: a backend that then cannot work must fail `init`,
    /// or CRIU would restore the processes without their GPU state.
    pub listing: InventoryListing,
}

/// A GPU vendor's checkpoint and restore: its hooks are those of [`HookHandler`] (each "not
/// mine" unless the backend implements it), chained by [`crate::GpuPlugin`] as the hook table
/// of `criu-plugin` says.
pub trait GpuBackend: HookHandler + Send {
    /// Short name used in logs and in the `disable` setting (`cuda`, `amdgpu`).
    fn name(&self) -> &'static str;
    /// The name recorded in CRIU's inventory; the C plugins' names, so images move both ways.
    fn inventory_name(&self) -> &'static CStr;
    /// Prepares for `stage`; `Ok(false)` means the backend sits this run out (no such GPU, or
    /// the image does not need it). Errors fail the CRIU run, so use them only when the run
    /// cannot succeed.
    fn init(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<bool, HookError>;
    /// Prepares for `stage` a backend switched off with `disable`: it acts on nothing, but may
    /// stay in the run (`true`) to refuse what only it can see would be reported done wrongly
    /// (the NVIDIA side: a restored CUDA process left checkpointed). Its inventory name is
    /// not claimed (`ctx.listing` is `NoList`), so CRIU still refuses an image that lists it.
    fn init_disabled(&mut self, _ctx: &InitContext<'_>, _stage: Stage) -> bool {
        false
    }
    /// The end of the run; `ret` is CRIU's result (non-zero: failed). After a failed dump or
    /// with `--leave-running`, every process the backend touched must be as it was found.
    fn exit(&mut self, stage: Stage, ret: i32);
}
