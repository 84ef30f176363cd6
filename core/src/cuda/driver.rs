//! The NVIDIA driver as a run finds it: `libcuda` loaded as the settings say (its checkpoint
//! support checked), the kernel module's release, and the GPUs' memory from NVML.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use cuda_ckpt_sys::{CUresult, Driver, DriverError, GpuUuid};

use super::error::{Cause, FailureKind};
use super::gpus::Gpu;
use super::helper;
use super::library::{Library, LibraryError, library};
use super::settings::CudaSettings;
use super::step::ms;

/// Why the CUDA driver the settings name cannot be used; each names the `libcuda` value and
/// where it came from.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The setting names a library that may not be loaded.
    #[error("{setting}: {source}")]
    Library {
        /// The setting and where it came from.
        setting: String,
        /// Why.
        source: LibraryError,
    },
    /// The library cannot be loaded.
    #[error("{setting}: {source}")]
    Open {
        /// The setting and where it came from.
        setting: String,
        /// The loader's answer.
        source: DriverError,
    },
    /// The driver has no checkpoint API.
    #[error(
        "{setting}: {source}: the CUDA checkpoint API needs driver 570 or later (CUDA {min})",
        min = cuda_ckpt_sys::format_version(cuda_ckpt_sys::MIN_CHECKPOINT_VERSION)
    )]
    NoCheckpoint {
        /// The setting and where it came from.
        setting: String,
        /// The driver's answer.
        source: DriverError,
    },
}

/// No CUDA driver the run can use on this machine.
impl Cause for LoadError {
    fn errno(&self) -> i32 {
        libc::ENODEV
    }
    fn kind(&self) -> FailureKind {
        FailureKind::Machine
    }
}

/// Loads the CUDA driver the settings name and checks that it can checkpoint processes;
/// returns it with its version.
/// Errors name the `libcuda` value and where it came from.
pub fn load(settings: &CudaSettings) -> Result<(Driver, i32), LoadError> {
    let setting = || settings.describe_libcuda();
    let driver = match &settings.libcuda {
        None => Driver::open_default(),
        Some(p) => {
            let value = p.to_string_lossy();
            let found = library(&value).map_err(|source| LoadError::Library {
                setting: setting(),
                source,
            })?;
            match found {
                Library::Search(name) => Driver::open_search(name),
                Library::File(path) => Driver::open(path),
            }
        }
    }
    .map_err(|source| LoadError::Open {
        setting: setting(),
        source,
    })?;
    log::debug!(
        "cuda: {}: loaded {}",
        settings.describe_libcuda(),
        driver.path()
    );
    let version = driver
        .check_checkpoint_support()
        .map_err(|source| LoadError::NoCheckpoint {
            setting: setting(),
            source,
        })?;
    Ok((driver, version))
}

/// The kernel driver's release from `version` beside the GPU listing (normally
/// `/proc/driver/nvidia/version`).
pub fn read_release(gpus_dir: &Path) -> Option<String> {
    let mut text = String::new();
    let bytes =
        criu_plugin::files::read_regular(None, &gpus_dir.parent()?.join("version"), false, 4096)
            .ok()?;
    text.push_str(&String::from_utf8_lossy(&bytes));
    // "NVRM version: NVIDIA UNIX [Open ]Kernel Module for x86_64  580.159.04  Release Build ..."
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| {
            w.split('.').count() >= 2
                && w.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

/// Fills in each GPU's total memory from NVML and returns the free memory by UUID, or `None`
/// (with a log line) when NVML cannot answer.
pub fn fill_memory(nvml: &str, gpus: &mut [Gpu]) -> Option<BTreeMap<GpuUuid, u64>> {
    let t = Instant::now();
    let uuids: Vec<_> = gpus.iter().map(|g| g.uuid).collect();
    match helper::query_memory(nvml, &uuids) {
        Ok(mem) => {
            for g in gpus.iter_mut() {
                if let Some(m) = mem.get(&g.uuid) {
                    g.memory = m.total;
                }
            }
            log::debug!("cuda: NVML memory query {:.1} ms", ms(t.elapsed()));
            Some(mem.into_iter().map(|(u, m)| (u, m.free)).collect())
        }
        Err(e) => {
            log::info!("cuda: GPU memory sizes unknown ({e}); the free-memory check is skipped");
            None
        }
    }
}

/// Whether the driver's answer about `pid` means the process does not use CUDA (no CUDA at
/// all, or none the driver knows of).
pub fn not_a_cuda_process(e: &DriverError) -> bool {
    matches!(
        e.cuda_code(),
        Some(CUresult::NOT_INITIALIZED | CUresult::INVALID_VALUE | CUresult::NOT_FOUND)
    )
}
