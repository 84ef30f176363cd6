//! The NVIDIA side's settings table (`libcuda`, `nvml`, `cuda.*`): what the keys are, apart from
//! how the backend reads their values (`super`), so that the list of every table needs nothing
//! of the configuration it describes.

use crate::settings::{CPluginName, Setting, Syntax};

/// The NVIDIA side's settings.
pub const SETTINGS: &[Setting] = &[
    Setting {
        key: "libcuda",
        env: "CRIU_GPU_LIBCUDA",
        c_plugin: CPluginName::None,
        syntax: Syntax::Text,
        default: "`libcuda.so.1`",
        doc: "the CUDA driver library, looked up in absolute directories only",
        about: "The CUDA driver library: a bare name, searched for in absolute directories only, or an absolute path to a regular file; a relative path is refused. A bare name is looked up over the absolute entries of `LD_LIBRARY_PATH`, `/etc/ld.so.cache` and the system library directories, never the working directory (the image directory), and loaded by the absolute path found.",
    },
    Setting {
        key: "nvml",
        env: "CRIU_GPU_NVML",
        c_plugin: CPluginName::None,
        syntax: Syntax::Text,
        default: "`libnvidia-ml.so.1`",
        doc: "the NVML library (GPU memory sizes), looked up as `libcuda`",
        about: "The NVML library, for GPU memory sizes (the free-memory check at restore; skipped when NVML cannot answer); a name or path as for `libcuda`.",
    },
    Setting {
        key: "cuda.nvidia-proc",
        env: "CRIU_GPU_CUDA_NVIDIA_PROC",
        c_plugin: CPluginName::None,
        syntax: Syntax::Text,
        default: "`/proc/driver/nvidia/gpus`",
        doc: "where the driver lists GPUs",
        about: "The directory whose presence says an NVIDIA kernel driver is loaded, and which lists the GPUs.",
    },
    Setting {
        key: "cuda.nvidia-dev",
        env: "CRIU_GPU_CUDA_NVIDIA_DEV",
        c_plugin: CPluginName::None,
        syntax: Syntax::Text,
        default: "`/dev`",
        doc: "where the NVIDIA device nodes are",
        about: "The directory holding the NVIDIA device nodes (`nvidia<minor>`) as this CRIU sees them.",
    },
    Setting {
        key: "cuda.device-map",
        env: "CRIU_GPU_CUDA_DEVICE_MAP",
        c_plugin: CPluginName::Option("device-map"),
        syntax: Syntax::Text,
        default: "empty",
        doc: "`OLD=NEW` GPU UUIDs for a restore; unnamed GPUs go to a free GPU of the same model",
        about: "Where checkpointed GPUs go at restore: `OLD=NEW` pairs of GPU UUIDs as `nvidia-smi -L` prints them (`GPU-<uuid>`), separated by commas or spaces. GPUs not named keep their UUID when this machine has it, otherwise take a free GPU of the same model in PCI order.",
    },
    Setting {
        key: "cuda.lock-timeout-ms",
        env: "CRIU_GPU_CUDA_LOCK_TIMEOUT_MS",
        c_plugin: CPluginName::OptionSeconds("timeout"),
        syntax: Syntax::WholeNumber,
        default: "10000",
        doc: "lock timeout when CRIU sets none",
        about: "Lock timeout in milliseconds when CRIU runs without a timeout (otherwise what is left of CRIU's `--timeout`). `0` keeps the default: a lock always ends by itself.",
    },
    Setting {
        key: "cuda.backend",
        env: "CRIU_GPU_CUDA_BACKEND",
        c_plugin: CPluginName::Option("backend"),
        syntax: Syntax::Text,
        default: "`auto`",
        doc: "`auto` or `driver-api`; `cuda-checkpoint` is refused",
        about: "`auto` or `driver-api`: both mean the driver's checkpoint API, called by the plugin itself; `cuda-checkpoint` is refused. `cuda-checkpoint` is the C plugin's mode that runs NVIDIA's utility.",
    },
    Setting {
        key: "cuda.parallel",
        env: "CRIU_GPU_CUDA_PARALLEL",
        c_plugin: CPluginName::None,
        syntax: Syntax::Bool,
        default: "`true`",
        doc: "all CUDA processes of a tree at once",
        about: "Checkpoint and restore all CUDA processes of the tree at once, rather than one after another.",
    },
];
