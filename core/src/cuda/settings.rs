//! The NVIDIA side's settings (`libcuda`, `nvml`, `cuda.*`): their table, and their values
//! read from [`crate::config::Config`].

use std::path::PathBuf;

pub mod table;

/// Lock timeout when CRIU has no alarm running.
const DEFAULT_LOCK_TIMEOUT_MS: u64 = 10_000;

/// The backend's settings, from [`crate::config::Config`].
#[derive(Clone, Debug)]
pub struct CudaSettings {
    /// Library to load; `None` = `libcuda.so.1`, searched over absolute directories only.
    pub libcuda: Option<PathBuf>,
    /// Directory listing the kernel driver's GPUs.
    pub nvidia_proc: PathBuf,
    /// Directory holding the GPUs' device nodes (`nvidia<minor>`) as this CRIU sees them.
    pub nvidia_dev: PathBuf,
    /// Checkpoint and restore all processes at once.
    pub parallel: bool,
    /// Lock timeout when CRIU sets none.
    pub lock_timeout_ms: u64,
    /// Explicit restore GPU map, as written (parsed when a restore needs it).
    pub device_map: String,
    /// NVML library for memory sizes.
    pub nvml: String,
    /// Where `libcuda`, `cuda.nvidia-proc` and `nvml` came from, in words, for messages.
    pub libcuda_from: String,
    pub nvidia_proc_from: String,
    pub nvml_from: String,
    /// Why the settings file could not be read, if it could not: the NVIDIA side then loads
    /// nothing (the file may name another library or switch it off) and a dump of a process
    /// that holds an NVIDIA device fails with this.
    pub file_error: Option<String>,
    /// Bad values, each kept at its default: warned about at `init`, and they fail a dump or
    /// restore that has CUDA processes, naming the key and where its value came from.
    pub problems: Vec<String>,
}

/// The CUDA backends `cuda.backend` (`cuda_plugin.backend`) may name; both mean the driver's
/// checkpoint API, called in-process.
const BACKENDS: &[&str] = &["auto", "driver-api"];

impl CudaSettings {
    /// Reads the settings. A bad value keeps its default and is added to
    /// [`CudaSettings::problems`], since a typo in a GPU setting must not fail the CRIU runs of
    /// processes without CUDA.
    pub fn from_config(cfg: &crate::config::Config) -> CudaSettings {
        let mut problems = Vec::new();
        if let Some(e) = &cfg.unreadable {
            problems.push(format!("the settings file cannot be read ({e})"));
        }
        let parallel = cfg.get_bool("cuda.parallel", true).unwrap_or_else(|e| {
            problems.push(e.to_string());
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
                problems.push(e.to_string());
                DEFAULT_LOCK_TIMEOUT_MS
            }
        };
        match cfg.get("cuda.backend").map(str::trim) {
            None => {}
            Some(b) if BACKENDS.contains(&b) => {}
            Some("cuda-checkpoint") => problems.push(format!(
                "cuda.backend = cuda-checkpoint ({}): this plugin calls the driver's checkpoint API itself and does not run NVIDIA's cuda-checkpoint utility; use auto or driver-api",
                cfg.describe_origin("cuda.backend")
            )),
            Some(b) => problems.push(format!(
                "cuda.backend = {} ({}): expected auto or driver-api",
                crate::settings::shown(b),
                cfg.describe_origin("cuda.backend")
            )),
        }
        for p in &problems {
            log::warn!(
                "cuda: settings: {p}; a dump or restore of CUDA processes fails until it is fixed"
            );
        }
        CudaSettings {
            libcuda: cfg.get("libcuda").map(PathBuf::from),
            nvidia_proc: PathBuf::from(
                cfg.get("cuda.nvidia-proc")
                    .unwrap_or("/proc/driver/nvidia/gpus"),
            ),
            nvidia_dev: PathBuf::from(cfg.get("cuda.nvidia-dev").unwrap_or("/dev")),
            parallel,
            lock_timeout_ms,
            device_map: cfg.get("cuda.device-map").unwrap_or("").to_string(),
            nvml: cfg.get("nvml").unwrap_or("libnvidia-ml.so.1").to_string(),
            libcuda_from: cfg.describe_origin("libcuda"),
            nvidia_proc_from: cfg.describe_origin("cuda.nvidia-proc"),
            nvml_from: cfg.describe_origin("nvml"),
            file_error: cfg.unreadable.clone(),
            problems,
        }
    }

    /// `libcuda` as given, with where it came from (`libcuda = X (line 2 of F)`).
    pub fn describe_libcuda(&self) -> String {
        match &self.libcuda {
            Some(p) => format!("libcuda = {} ({})", p.display(), self.libcuda_from),
            None => format!("libcuda = {} (default)", cuda_ckpt_sys::DEFAULT_LIBRARY),
        }
    }

    /// Why `cuda.nvidia-proc` lists no GPUs, `None` when it is a directory: missing, or
    /// something else than a directory (`/dev/zero`), with where the value came from.
    pub fn nvidia_proc_problem(&self) -> Option<String> {
        let what = match std::fs::metadata(&self.nvidia_proc) {
            Ok(m) if m.is_dir() => return None,
            Ok(_) => "is not a directory",
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "is missing",
            Err(_) => "cannot be read",
        };
        Some(format!(
            "cuda.nvidia-proc = {} ({}) {what}",
            self.nvidia_proc.display(),
            self.nvidia_proc_from
        ))
    }

    /// The first bad value, as a failure of a run that needs CUDA (`why` starts the message).
    pub fn check(&self, why: &str) -> Result<(), super::error::Failure> {
        match self.problems.first() {
            None => Ok(()),
            Some(p) => Err(super::error::Failure::new(
                super::error::FailureKind::Settings,
                libc::EINVAL,
                format!("{why} but a setting is bad: {p}"),
            )),
        }
    }
}
