//! NVIDIA GPUs through the CUDA driver's checkpoint API (`cuCheckpointProcess*`).
//!
//! The driver moves a process's GPU state into the process's own memory (checkpoint) and back
//! (restore); CRIU then saves and restores that memory like any other. The backend calls the
//! driver in-process through `libcuda.so.1` (no `cuda-checkpoint` utility), and:
//!
//! - `PAUSE_DEVICES`: locks each CUDA process of the tree while it still runs, with CRIU's
//!   remaining `--timeout` as the lock timeout; processes found locked or checkpointed by someone
//!   else are left as found. A stopped process or a frozen cgroup is refused with a reason
//!   instead of a driver call that would never return.
//! - `CHECKPOINT_DEVICES`: on the first call, checkpoints every locked process of the tree at
//!   once (driver calls on worker threads; ptrace stays on CRIU's thread), then writes
//!   [`metadata::FILE_NAME`].
//! - `exit` after a failed dump, or with `--leave-running`/`--leave-stopped`: every process it
//!   touched is restored and unlocked, back to the state it was found in.
//! - restore `init`: reads the metadata and refuses early what cannot work (older driver, GPUs
//!   missing, unreachable or of another model, too little free GPU memory); plans the GPU map
//!   onto the GPUs this restore can reach (in a container: those its device cgroup allows).
//! - `RESUME_DEVICES_LATE`: on the first call (CRIU calls it for the root first), gives a
//!   restored container's `/dev` the nodes of its GPUs, then restores and unlocks every process
//!   of the restored tree at once. Processes are matched by their pid in
//!   their own pid namespace, which a container keeps across a restore while the host pid
//!   changes.
//!
//! `init` makes the run's state, a dump run or a restore run (`dump.rs`, `restore.rs`): the
//! hooks of the other stage find none and answer "not mine". The inventory name is
//! `cuda_plugin`, the C plugin's, so images move between the two.

pub mod batch;
pub mod devnodes;
mod disabled;
pub mod driver;
mod dump;
pub mod error;
pub mod exclusive;
pub mod executor;
pub mod gpu;
pub mod gpus;
mod guardian;
pub mod helper;
mod image;
pub mod library;
pub mod metadata;
pub mod nvml;
pub mod preflight;
pub mod procfs;
mod restore;
pub mod restore_thread;
pub(crate) mod settings;
pub mod step;

#[cfg(test)]
mod tests;

use std::ffi::CStr;

use criu_plugin::{HookError, HookHandler, HookResult, InventoryListing, Stage};

use crate::backend::{GpuBackend, InitContext};
use disabled::DisabledRestore;
use dump::DumpRun;
use error::{Failure, FailureKind};
use restore::RestoreRun;
pub use settings::CudaSettings;

/// Inventory name of CRIU's C plugin, kept so images move both ways.
pub const INVENTORY_NAME: &CStr = c"cuda_plugin";

/// Checkpoint and restore of CUDA processes.
#[derive(Default)]
pub struct CudaBackend {
    /// The run `init` prepared; `None` when the NVIDIA side sits the run out.
    run: Option<Run>,
}

/// The state of one run, by stage.
enum Run {
    Dump(DumpRun),
    Restore(RestoreRun),
    /// A dump the NVIDIA side cannot serve (`why`) on a machine that may have NVIDIA GPUs:
    /// a process that holds an NVIDIA device fails it rather than lose its GPU state; the
    /// others are left to CRIU.
    Unusable {
        why: dump::Unusable,
    },
    /// A restore with the NVIDIA side switched off, watched for CUDA processes left frozen.
    Disabled(DisabledRestore),
}

impl CudaBackend {
    /// A backend with nothing set up yet.
    pub fn new() -> Self {
        Self::default()
    }
}

impl GpuBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn inventory_name(&self) -> &'static CStr {
        INVENTORY_NAME
    }

    fn init(&mut self, ctx: &InitContext<'_>, stage: Stage) -> Result<bool, HookError> {
        self.run = None;
        let settings = CudaSettings::from_config(ctx.config);
        self.run = match stage {
            // Nothing would unlock a process locked in pre-dump: CRIU calls no exit there.
            Stage::PreDump => None,
            Stage::Dump => match DumpRun::start(settings) {
                Ok(run) => run.map(Run::Dump),
                Err(why) => {
                    log::warn!(
                        "cuda: {why}; a dump of a process that holds an NVIDIA device fails"
                    );
                    Some(Run::Unusable { why })
                }
            },
            // Loads nothing on settings it could not read, unless the image needs it (and
            // then fails, naming the file).
            Stage::Restore
                if settings.file_error.is_some() && ctx.listing != InventoryListing::Listed =>
            {
                None
            }
            Stage::Restore => RestoreRun::start(&settings, ctx.listing)?.map(Run::Restore),
        };
        Ok(self.run.is_some())
    }

    fn init_disabled(&mut self, ctx: &InitContext<'_>, stage: Stage) -> bool {
        self.run = None;
        if stage != Stage::Restore {
            return false;
        }
        let settings = CudaSettings::from_config(ctx.config);
        self.run = DisabledRestore::start(&settings, ctx.config.describe_origin("disable"))
            .map(Run::Disabled);
        self.run.is_some()
    }

    fn exit(&mut self, _stage: Stage, ret: i32) {
        // The run's own stage decides; its claims and driver go with it.
        match self.run.take() {
            Some(Run::Dump(d)) => d.finish(ret),
            Some(Run::Restore(r)) => r.finish(ret),
            Some(Run::Unusable { .. } | Run::Disabled(_)) | None => {}
        }
    }
}

impl HookHandler for CudaBackend {
    fn pause_devices(&mut self, pid: i32) -> HookResult {
        match &mut self.run {
            Some(Run::Dump(d)) => d.pause(pid),
            Some(Run::Unusable { why }) => refuse_nvidia_user(pid, &why.to_string()),
            _ => Err(HookError::NotMine),
        }
    }

    fn checkpoint_devices(&mut self, pid: i32) -> HookResult {
        match &mut self.run {
            Some(Run::Dump(d)) => d.checkpoint(pid),
            _ => Err(HookError::NotMine),
        }
    }

    fn post_forking(&mut self) -> HookResult {
        match &mut self.run {
            Some(Run::Restore(r)) => r.post_forking(),
            _ => Err(HookError::NotMine),
        }
    }

    fn resume_devices_late(&mut self, pid: i32) -> HookResult {
        match &mut self.run {
            Some(Run::Restore(r)) => r.resume(pid),
            Some(Run::Disabled(d)) => d.resume(pid),
            _ => Err(HookError::NotMine),
        }
    }

    fn dump_finish(&mut self, ret: i32) -> HookResult {
        match &mut self.run {
            Some(Run::Dump(d)) => d.dump_finish(ret),
            _ => Err(HookError::NotMine),
        }
    }
}

/// `PAUSE_DEVICES` when the NVIDIA side cannot run: "not mine" for a process without NVIDIA
/// devices, a failure naming `why` for one that holds any (CRIU would dump it without its GPU
/// state, and the restored process would have lost it).
fn refuse_nvidia_user(pid: i32, why: &str) -> HookResult {
    match procfs::nvidia_device(pid) {
        Ok(None) => Err(HookError::NotMine),
        Ok(Some(dev)) => Err(Failure::new(
            FailureKind::Settings,
            libc::ENODEV,
            format!(
                "cuda: pid {pid} holds {dev}, but {why}: its GPU state cannot be saved, so the dump fails"
            ),
        )
        .into()),
        Err(e) => Err(error::os_failure(
            &e,
            format!("cuda: cannot tell whether pid {pid} holds an NVIDIA device ({e}), and {why}"),
        )
        .into()),
    }
}
