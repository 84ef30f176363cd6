//! The AMD backend: CRIU's hooks for processes that have `/dev/kfd` open.

use std::ffi::CStr;

use criu_plugin::{HookError, Stage};

use crate::backend::{GpuBackend, InitContext};

/// Inventory name of CRIU's C plugin, kept so images move both ways.
pub const INVENTORY_NAME: &CStr = c"amdgpu_plugin";

/// Checkpoint and restore of KFD processes.
#[derive(Default)]
pub struct AmdgpuBackend {}

impl AmdgpuBackend {
    /// A backend with nothing set up yet.
    pub fn new() -> Self {
        Self::default()
    }
}

impl GpuBackend for AmdgpuBackend {
    fn name(&self) -> &'static str {
        "amdgpu"
    }

    fn inventory_name(&self) -> &'static CStr {
        INVENTORY_NAME
    }

    fn init(&mut self, _ctx: &InitContext<'_>, _stage: Stage) -> Result<bool, HookError> {
        Ok(false)
    }

    fn finish(&mut self, _stage: Stage, _ret: i32) {}
}
