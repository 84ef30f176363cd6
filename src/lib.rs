//! placeholder
pub mod amdgpu;
