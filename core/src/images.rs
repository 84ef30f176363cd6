//! Checkpoint images outside CRIU: the file formats the plugin writes and the restore preflight
//! it runs, for `criu-gpu inspect` and `criu-gpu check` (and the tests that read images).

/// The AMD image format: KFD and render-node images, pages files, dma-buf records.
pub use crate::amdgpu::image as amd;
/// The CUDA metadata file (`gpu-plugin-cuda.json`): the processes and GPUs of a dump.
pub use crate::cuda::metadata;

/// The NVIDIA restore preflight, as the plugin runs it at restore `init`: the driver and GPUs of
/// this machine against an image's metadata.
pub mod cuda_check {
    pub use crate::cuda::CudaSettings;
    pub use crate::cuda::driver::{fill_memory, load as load_driver};
    pub use crate::cuda::gpus::{Gpu, parse_device_map, read_gpus};
    pub use crate::cuda::preflight::{Preflight, Refusal, preflight, records_not_in_tree};
}

/// The AMD restore preflight, as the plugin runs it at `RESTORE_INIT`: a KFD image's limits,
/// and its GPUs mapped onto this machine's KFD topology.
pub mod amd_check {
    pub use crate::amdgpu::device::CriuLimits;
    pub use crate::amdgpu::restore::files::{check_image, map_onto};
    pub use crate::amdgpu::settings::AmdgpuSettings;
    pub use crate::amdgpu::topology::{Topology, present_render_minors};
}
