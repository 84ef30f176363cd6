//! AMD GPUs through the KFD driver (`/dev/kfd`).

pub mod backend;
pub mod contents;
pub mod copy;
pub mod device;
pub mod dump;
pub mod error;
pub mod image;
pub mod kernel;
pub mod parallel;
pub mod restore;
pub mod sdma;
pub mod settings;
#[cfg(any(test, feature = "kfd-sim"))]
pub mod sim;
pub mod store;
pub mod topology;

pub use backend::AmdgpuBackend;
