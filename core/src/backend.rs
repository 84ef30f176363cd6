//! One vocabulary for every GPU vendor: pause, checkpoint, resume.
//!
//! Each vendor implements [`GpuBackend`], whose methods are named after CRIU's hooks; [`crate::plugin::GpuPlugin`] maps CRIU's hooks onto
//! it and chains the backends the way CRIU chains plugins: the first backend that does not
//! answer [`HookError::NotMine`] owns the call.
//!
//! | CRIU hook | backend method | NVIDIA | AMD |
//! |---|---|---|---|
//! | `init` | [`GpuBackend::init`] | load libcuda, claim inventory | read topology, claim inventory |
//! | `PAUSE_DEVICES` | [`GpuBackend::pause_devices`] | lock | — |
//! | `CHECKPOINT_DEVICES` | [`GpuBackend::checkpoint_devices`] | checkpoint (whole tree at once) | — |
//! | `HANDLE_DEVICE_VMA` | [`GpuBackend::handle_device_vma`] | — | claim KFD/DRM mappings |
//! | `DUMP_EXT_FILE` | [`GpuBackend::dump_ext_file`] | — | KFD checkpoint, BO contents |
//! | `DUMP_DEVICES_LATE` | [`GpuBackend::dump_devices_late`] | — | unpause queues |
//! | `DUMP_FINISH` | [`GpuBackend::dump_finish`] | put back after a failed dump | unpause after a failed dump |
//! | `RESTORE_INIT` | [`GpuBackend::restore_init`] | — | shared restore state |
//! | `RESTORE_EXT_FILE` | [`GpuBackend::restore_ext_file`] | — | KFD restore |
//! | `UPDATE_VMA_MAP` | [`GpuBackend::update_vma_map`] | — | offset remapping |
//! | `POST_FORKING` | [`GpuBackend::post_forking`] | — | claims the parallel restore |
//! | `RESUME_DEVICES_LATE` | [`GpuBackend::resume_devices_late`] | restore + unlock | KFD resume |
//! | `exit` | [`GpuBackend::exit`] | put every touched process back | unpause on failure |
//!
//! Per-task restore hooks (`RESTORE_EXT_FILE`, `UPDATE_VMA_MAP`) run in tasks CRIU forked from
//! its main process: a backend's own threads must never hold a lock that such a hook takes.
//!
//! Both backends carry a failure as one [`criu_plugin::Failure`] (errno for CRIU, a
//! [`criu_plugin::FailureKind`], the sentence for the user) in [`HookError::Failed`] up to the
//! hook, where `criu-plugin` writes it to CRIU's log once, with its kind (`... [machine]`).

use std::ffi::CStr;
use std::os::fd::RawFd;

use criu_plugin::{HookError, HookResult, Host, InventoryListing, Stage, VmaUpdate};

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

/// A GPU vendor's checkpoint and restore. Every method but `name`, `inventory_name`, `init` and
/// `exit` defaults to "not mine".
#[allow(unused_variables)]
pub trait GpuBackend: Send {
    /// Short name used in logs and in the `disable` setting (`cuda`, `amdgpu`).
    fn name(&self) -> &'static str;
    /// The name recorded in CRIU's inventory; the C plugins' names, so images move both ways.
    fn inventory_name(&self) -> &'static CStr;
    /// Prepares for `stage`; `Ok(false)` means the backend sits this run out (no such GPU, or
    /// the image does not need it). Errors fail the CRIU run, so use them only when the run
    /// cannot succeed.
    fn init(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<bool, HookError>;
    /// The end of the run; `ret` is CRIU's result (non-zero: failed). After a failed dump or
    /// with `--leave-running`, every process the backend touched must be as it was found.
    fn exit(&mut self, stage: Stage, ret: i32);

    /// Quiesce the process's GPU work before CRIU seizes it (`PAUSE_DEVICES`).
    fn pause_devices(&mut self, pid: i32) -> HookResult {
        Err(HookError::NotMine)
    }
    /// Move device state into the process's memory, every task seized (`CHECKPOINT_DEVICES`).
    fn checkpoint_devices(&mut self, pid: i32) -> HookResult {
        Err(HookError::NotMine)
    }
    /// Claim a device mapping (`HANDLE_DEVICE_VMA`).
    fn handle_device_vma(&mut self, fd: RawFd, st: &libc::stat) -> HookResult {
        Err(HookError::NotMine)
    }
    /// Dump a device file (`DUMP_EXT_FILE`).
    fn dump_ext_file(&mut self, fd: RawFd, id: u32) -> HookResult {
        Err(HookError::NotMine)
    }
    /// After every task's memory is dumped (`DUMP_DEVICES_LATE`, CRIU 4.3).
    fn dump_devices_late(&mut self, root_pid: i32) -> HookResult {
        Err(HookError::NotMine)
    }
    /// Before anything is forked on restore (`RESTORE_INIT`, CRIU 4.3).
    fn restore_init(&mut self) -> HookResult {
        Err(HookError::NotMine)
    }
    /// Reopen a device file inside the restored task (`RESTORE_EXT_FILE`).
    fn restore_ext_file(&mut self, id: u32, retry: Option<&mut bool>) -> HookResult<RawFd> {
        Err(HookError::NotMine)
    }
    /// Remap a device mapping's offset inside the restored task (`UPDATE_VMA_MAP`).
    fn update_vma_map(&mut self, path: &CStr, addr: u64, old_pgoff: u64) -> HookResult<VmaUpdate> {
        Err(HookError::NotMine)
    }
    /// The dump is over and the tasks are about to be released (`DUMP_FINISH`, 4.3); `ret`
    /// non-zero means they will run on (a failed dump, a failing post-dump script): put every
    /// process back as it was found. May come twice.
    fn dump_finish(&mut self, ret: i32) -> HookResult {
        let _ = ret;
        Err(HookError::NotMine)
    }
    /// The root task has forked (`POST_FORKING`, 4.2).
    fn post_forking(&mut self) -> HookResult {
        Err(HookError::NotMine)
    }
    /// Give the restored process its GPU back, before it runs again (`RESUME_DEVICES_LATE`).
    fn resume_devices_late(&mut self, pid: i32) -> HookResult {
        Err(HookError::NotMine)
    }
}
