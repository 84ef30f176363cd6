//! The AMD side's settings table (`amdgpu.*`, with the C plugin's `KFD_MAX_BUFFER_SIZE` and
//! `KFD_*_CHECK` variables): what the keys are, apart from how the backend reads their values
//! (`super`), so that the list of every table needs nothing of the configuration it describes.

use crate::settings::{CPluginName, Setting, Syntax};

/// One compatibility check of the C plugin, by key, variable and C plugin variable.
const fn check(key: &'static str, env: &'static str, c_env: &'static str) -> Setting {
    Setting {
        key,
        env,
        c_plugin: CPluginName::Env(c_env),
        syntax: Syntax::Switch,
        default: "`yes`",
        doc: "the C plugin's GPU compatibility checks",
        about: "The C plugin's restore-time GPU compatibility checks: firmware and SDMA firmware version, cache count, GWS count and VRAM size no larger on the checkpointing machine, NUMA affinity kept, capability flags equal.",
    }
}

/// The AMD side's settings.
pub const SETTINGS: &[Setting] = &[
    Setting {
        key: "amdgpu.topology",
        env: "CRIU_GPU_AMDGPU_TOPOLOGY",
        c_plugin: CPluginName::None,
        syntax: Syntax::Text,
        default: "`/sys/class/kfd/kfd/topology`",
        doc: "the KFD topology",
        about: "The KFD topology in sysfs.",
    },
    Setting {
        key: "amdgpu.max-buffer-size",
        env: "CRIU_GPU_AMDGPU_MAX_BUFFER_SIZE",
        c_plugin: CPluginName::Env("KFD_MAX_BUFFER_SIZE"),
        syntax: Syntax::Size,
        default: "`256M`",
        doc: "staging memory of the buffer copies",
        about: "Staging memory for buffer copies, all copy threads together; `0` keeps the default.",
    },
    Setting {
        key: "amdgpu.copy-threads",
        env: "CRIU_GPU_AMDGPU_COPY_THREADS",
        c_plugin: CPluginName::None,
        syntax: Syntax::WholeNumber,
        default: "the number of CPUs, at least 2 and at most 8",
        doc: "buffer copy threads",
        about: "Buffer copy threads, 1 to 64. Each moves pieces device to host to file.",
    },
    Setting {
        key: "amdgpu.chunk-size",
        env: "CRIU_GPU_AMDGPU_CHUNK_SIZE",
        c_plugin: CPluginName::None,
        syntax: Syntax::Size,
        default: "`4M`",
        doc: "largest piece of a buffer copied at once",
        about: "Largest piece of a buffer copied at once, at least `4K`.",
    },
    Setting {
        key: "amdgpu.parallel-restore",
        env: "CRIU_GPU_AMDGPU_PARALLEL_RESTORE",
        c_plugin: CPluginName::None,
        syntax: Syntax::Bool,
        default: "`false`",
        doc: "CRIU's main process copies the restored buffers (CRIU 4.2+)",
        about: "Restored tasks hand their buffer copies to CRIU's main process, which does them at `RESUME_DEVICES_LATE` (CRIU 4.2 and later). Off, each task copies its own while CRIU restores the others. No thread is left in CRIU's process between hooks either way.",
    },
    check(
        "amdgpu.kfd-fw-ver-check",
        "CRIU_GPU_AMDGPU_KFD_FW_VER_CHECK",
        "KFD_FW_VER_CHECK",
    ),
    check(
        "amdgpu.kfd-sdma-fw-ver-check",
        "CRIU_GPU_AMDGPU_KFD_SDMA_FW_VER_CHECK",
        "KFD_SDMA_FW_VER_CHECK",
    ),
    check(
        "amdgpu.kfd-caches-count-check",
        "CRIU_GPU_AMDGPU_KFD_CACHES_COUNT_CHECK",
        "KFD_CACHES_COUNT_CHECK",
    ),
    check(
        "amdgpu.kfd-num-gws-check",
        "CRIU_GPU_AMDGPU_KFD_NUM_GWS_CHECK",
        "KFD_NUM_GWS_CHECK",
    ),
    check(
        "amdgpu.kfd-vram-size-check",
        "CRIU_GPU_AMDGPU_KFD_VRAM_SIZE_CHECK",
        "KFD_VRAM_SIZE_CHECK",
    ),
    check(
        "amdgpu.kfd-numa-check",
        "CRIU_GPU_AMDGPU_KFD_NUMA_CHECK",
        "KFD_NUMA_CHECK",
    ),
    check(
        "amdgpu.kfd-capability-check",
        "CRIU_GPU_AMDGPU_KFD_CAPABILITY_CHECK",
        "KFD_CAPABILITY_CHECK",
    ),
];
