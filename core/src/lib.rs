//! The logic of the CRIU plugin for GPU processes, NVIDIA GPUs through the CUDA driver's
//! checkpoint API and AMD GPUs through the KFD driver's CRIU ioctls, as a plain Rust library.
//!
//! Its users:
//!
//! - the plugin `.so` (the workspace's root crate), which only exports [`GpuPlugin`] to CRIU;
//! - `criu-gpu`, the operator tool: the CUDA [`session`] (probe, lock, checkpoint, restore,
//!   put back processes in place) and the [`images`] API (read and check an images
//!   directory);
//! - the tests and benchmarks, which drive the [`backend::GpuBackend`]s directly, the AMD one
//!   on the KFD simulator (the `kfd-sim` crate) through the device seam in [`amdgpu::device`].
//!
//! [`GpuPlugin`] dispatches CRIU's hooks to one [`backend::GpuBackend`] per vendor.

pub mod amdgpu;
pub mod backend;
pub mod config;
pub(crate) mod cuda;
pub mod images;
mod plugin;
pub(crate) mod restore_guardian;
pub mod session;
pub mod settings;

pub use plugin::GpuPlugin;
