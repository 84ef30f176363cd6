//! The CRIU plugin: CRIU's hooks mapped onto the GPU backends.
//!
//! State lives in one [`GpuPlugin`] instance behind a mutex; backends are created anew at every
//! `init`, because one `criu swrk` may load the plugin for several requests and a shared object
//! kept resident keeps its statics.

use std::ffi::CStr;
use std::sync::{Mutex, MutexGuard};

use criu_plugin::log::CriuLogger;
use criu_plugin::{CriuSymbols, HookId, HookResult, InventoryListing, Plugin, Stage};

use crate::backend::{GpuBackend, InitContext};
use crate::config::Config;

/// Name in CRIU's log and in the descriptor.
pub const PLUGIN_NAME: &CStr = c"gpu_plugin";

/// The plugin instance CRIU calls into.
pub struct GpuPlugin {
    state: Mutex<Option<RunState>>,
}

struct RunState {
    stage: Stage,
    /// Backends taking part in this run, in chain order.
    active: Vec<Box<dyn GpuBackend>>,
}

static PLUGIN: GpuPlugin = GpuPlugin {
    state: Mutex::new(None),
};
static LOGGER: CriuLogger = CriuLogger::new("gpu_plugin");

/// Every backend this build knows, in chain order.
pub fn all_backends() -> Vec<Box<dyn GpuBackend>> {
    vec![
        Box::new(crate::cuda::CudaBackend::new()),
        Box::new(crate::amdgpu::AmdgpuBackend::new()),
    ]
}

impl GpuPlugin {
    fn state(&self) -> MutexGuard<'_, Option<RunState>> {
        // A poisoned lock means a hook panicked (and was contained): the state is still the
        // best knowledge there is of what to put back.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a run with the given backends (the hook `init`, and tests).
    pub fn start(
        &self,
        stage: Stage,
        config: &Config,
        backends: Vec<Box<dyn GpuBackend>>,
    ) -> HookResult {
        // A second init without exit (a CRIU service process reusing the plugin, or a host
        // bug) must not drop the run before: its processes are put back as after a failure.
        if let Some(prev) = self.state().take() {
            log::warn!(
                "init of a {stage:?} run while a {:?} run never got its exit: ending that run as failed",
                prev.stage
            );
            for mut b in prev.active {
                b.exit(prev.stage, -1);
            }
        }
        let host = criu_plugin::host::current();
        let syms = CriuSymbols::get();
        log::info!(
            "{} {} in {} (hooks {}, RESTORE_EXT_FILE retry {}), stage {stage:?}",
            PLUGIN_NAME.to_string_lossy(),
            env!("CARGO_PKG_VERSION"),
            host.version,
            host.hook_count,
            host.restore_ext_file_retry,
        );
        if let Some(src) = &config.source {
            log::info!("settings from {}", src.display());
        }
        for w in &config.warnings {
            log::warn!("settings: {w}");
        }
        for n in &config.notes {
            log::info!("settings: {n}");
        }
        if let Some(line) = config.summary() {
            log::info!("settings in force: {line}");
        }
        let mut active = Vec::new();
        for mut b in backends {
            if config.is_disabled(b.name()) {
                log::info!("{}: disabled by settings", b.name());
                let ctx = InitContext {
                    host,
                    config,
                    listing: InventoryListing::NoList,
                };
                if b.init_disabled(&ctx, stage) {
                    active.push(b);
                }
                continue;
            }
            // Claim the inventory entry in init: CRIU checks for unclaimed names right after.
            let listing = if stage == Stage::Restore {
                syms.inventory_listing(b.inventory_name())
            } else {
                InventoryListing::NoList
            };
            let ctx = InitContext {
                host,
                config,
                listing,
            };
            match b.init(&ctx, stage) {
                Ok(true) => active.push(b),
                Ok(false) => log::debug!("{}: nothing to do in this run", b.name()),
                Err(e) => {
                    // Backends set up so far get the failure too, as CRIU would tell them.
                    for mut a in active {
                        a.exit(stage, -1);
                    }
                    return Err(e);
                }
            }
        }
        *self.state() = Some(RunState { stage, active });
        Ok(())
    }
}

/// CRIU's C GPU plugins in the same directory would act on the same processes (the first one
/// loaded owns each hook): say so once per run.
fn warn_about_c_plugins() {
    let Some(me) = criu_plugin::host::plugin_file() else {
        return;
    };
    let Some(dir) = me.parent() else {
        return;
    };
    for other in ["cuda_plugin.so", "amdgpu_plugin.so"] {
        if dir.join(other).exists() {
            log::warn!(
                "CRIU's C plugin {other} is in {} too: both would act on the same GPU processes; keep only one",
                dir.display()
            );
        }
    }
}

impl Plugin for GpuPlugin {
    const NAME: &'static CStr = PLUGIN_NAME;
    const LOG_PREFIX: &'static str = "gpu_plugin";
    const HOOKS: &'static [HookId] = &[
        HookId::DumpExtFile,
        HookId::RestoreExtFile,
        HookId::HandleDeviceVma,
        HookId::UpdateVmaMap,
        HookId::ResumeDevicesLate,
        HookId::PauseDevices,
        HookId::CheckpointDevices,
        HookId::PostForking,
        HookId::RestoreInit,
        HookId::DumpDevicesLate,
        HookId::DumpFinish,
    ];
    type Handler = dyn GpuBackend;

    fn instance() -> &'static Self {
        &PLUGIN
    }

    fn logger() -> &'static CriuLogger {
        &LOGGER
    }

    fn init(&self, stage: Stage) -> HookResult {
        // A settings file that cannot be read must not fail every CRIU run on the host. The AMD
        // side sits the run out (CRIU itself then refuses an AMD process: nothing handles its
        // KFD mappings); the NVIDIA side loads nothing, but stays to fail a dump of a process
        // that holds an NVIDIA device, which would otherwise lose its GPU state, and a restore
        // that needs it.
        let mut config = match Config::from_process() {
            Ok(c) => c,
            Err(e) => {
                let options = criu_plugin::options::from_host();
                let mine: Vec<String> = options
                    .all
                    .iter()
                    .filter(|o| {
                        o.plugin == crate::config::OPTION_NAMESPACE
                            || o.plugin == crate::config::CUDA_PLUGIN_NAMESPACE
                    })
                    .map(|o| format!("{}.{}", o.plugin, o.name))
                    .collect();
                let unused = if mine.is_empty() {
                    String::new()
                } else {
                    format!(" (plugin options not applied: {})", mine.join(", "))
                };
                log::error!(
                    "settings: {e}; GPU support is off for this run: a dump or restore of GPU processes fails{unused}"
                );
                let mut config = Config::default();
                config.unreadable = Some(e.to_string());
                return self.start(
                    stage,
                    &config,
                    vec![Box::new(crate::cuda::CudaBackend::new())],
                );
            }
        };
        // CRIU 4.3's plugin options come last and win: they are what a runtime asks for this
        // one request.
        config.apply_options(&criu_plugin::options::from_host());
        warn_about_c_plugins();
        self.start(stage, &config, all_backends())
    }

    fn exit(&self, stage: Option<Stage>, ret: i32) {
        // The run's own stage decides what to put back, whatever stage CRIU passes.
        if let Some(run) = self.state().take() {
            if stage != Some(run.stage) {
                log::warn!(
                    "exit for stage {stage:?} during a {:?} run: ending that run",
                    run.stage
                );
            }
            let ret = if stage == Some(run.stage) {
                ret
            } else {
                ret.min(-1)
            };
            for mut b in run.active {
                b.exit(run.stage, ret);
            }
        }
        log::debug!("exit({stage:?}, {ret})");
    }

    fn each_handler(&self, visit: &mut dyn FnMut(&mut Self::Handler) -> bool) {
        let mut guard = self.state();
        let Some(run) = guard.as_mut() else {
            return;
        };
        for b in run.active.iter_mut() {
            if !visit(b.as_mut()) {
                break;
            }
        }
    }
}
