//! AMD GPUs through the KFD driver (`/dev/kfd`).

mod backend;
pub mod image;
pub mod topology;

pub use backend::AmdgpuBackend;
