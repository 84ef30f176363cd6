//! One GPU as the kernel driver lists it: what the GPU listing reads, and what device nodes
//! are checked and made for.

use cuda_ckpt_sys::GpuUuid;

/// One GPU as the kernel driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// `GPU-…` UUID.
    pub uuid: GpuUuid,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// PCI address, e.g. `0000:00:06.0`.
    pub bus: String,
    /// Total memory in bytes, when known (from the CUDA driver or NVML; 0 = unknown).
    pub memory: u64,
    /// Minor number of its device node `/dev/nvidia<minor>`, when the driver says.
    pub minor: Option<u32>,
}
