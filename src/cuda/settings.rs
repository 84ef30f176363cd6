//! The NVIDIA side's settings (`libcuda`, `nvml`, `cuda.*`), read from [`crate::config::Config`].

use std::path::PathBuf;

/// Lock timeout when CRIU has no alarm running.
const DEFAULT_LOCK_TIMEOUT_MS: u64 = 10_000;

/// The backend's settings, from [`crate::config::Config`].
#[derive(Clone, Debug)]
pub struct CudaSettings {
    /// Library to load; `None` = `libcuda.so.1` from the search path.
    pub libcuda: Option<PathBuf>,
    /// Directory listing the kernel driver's GPUs.
    pub nvidia_proc: PathBuf,
    /// Checkpoint and restore all processes at once.
    pub parallel: bool,
    /// Lock timeout when CRIU sets none.
    pub lock_timeout_ms: u64,
    /// Explicit restore GPU map, as written (parsed when a restore needs it).
    pub device_map: String,
    /// NVML library for memory sizes.
    pub nvml: String,
}

impl CudaSettings {
    /// Reads the settings; a bad value is warned about and replaced by its default, since a
    /// typo in a GPU setting must not fail every CRIU run on the host.
    pub fn from_config(cfg: &crate::config::Config) -> CudaSettings {
        let parallel = cfg.get_bool("cuda.parallel", true).unwrap_or_else(|e| {
            log::warn!("cuda: settings: {e}; using true");
            true
        });
        // 0 would ask the driver to wait for good: a lock must always end by itself.
        let lock_timeout_ms = match cfg.get_u64("cuda.lock-timeout-ms", DEFAULT_LOCK_TIMEOUT_MS) {
            Ok(0) => {
                log::warn!(
                    "cuda: settings: cuda.lock-timeout-ms = 0 would wait for good; using {DEFAULT_LOCK_TIMEOUT_MS}"
                );
                DEFAULT_LOCK_TIMEOUT_MS
            }
            Ok(n) => n.min(u64::from(u32::MAX)),
            Err(e) => {
                log::warn!("cuda: settings: {e}; using {DEFAULT_LOCK_TIMEOUT_MS}");
                DEFAULT_LOCK_TIMEOUT_MS
            }
        };
        CudaSettings {
            libcuda: cfg.get("libcuda").map(PathBuf::from),
            nvidia_proc: PathBuf::from(
                cfg.get("cuda.nvidia-proc")
                    .unwrap_or("/proc/driver/nvidia/gpus"),
            ),
            parallel,
            lock_timeout_ms,
            device_map: cfg.get("cuda.device-map").unwrap_or("").to_string(),
            nvml: cfg.get("nvml").unwrap_or("libnvidia-ml.so.1").to_string(),
        }
    }
}
