//! What a dump or a restore run of the AMD backend works with, whichever stage it is: the
//! device, settings and image store of the run, the copy observer, and how a hook's error is
//! told to CRIU. The runs (`dump.rs`, `restore.rs`) and the backend that holds them
//! (`backend.rs`) share it.

use std::ffi::CStr;
use std::sync::Arc;

use criu_plugin::HookError;

use super::device::{CriuLimits, KfdDevice};
use super::error::Error;
use super::settings::AmdgpuSettings;
use super::store::ImageStore;

/// Inventory name of CRIU's C plugin, kept so images move both ways.
pub const INVENTORY_NAME: &CStr = c"amdgpu_plugin";

/// Watches the BO content copies of a backend's runs, as each one ends. Called in the process
/// that copied (a restored task, or CRIU's main process for a parallel restore).
pub trait CopyObserver: Send + Sync {
    /// One copy of a file's BO contents, done.
    fn copied(&self, record: CopyRecord);
}

/// Who copied a file's BO contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// Dump: GPU to pages files, in CRIU's dumping process.
    Dump,
    /// Restore: pages files to GPU, in the restored task.
    RestoreInTask,
    /// Restore: pages files to GPU, in CRIU's main process (parallel restore).
    RestoreInMain,
}

/// One BO content copy of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyRecord {
    /// CRIU file id of the KFD file.
    pub file_id: u32,
    /// Direction and place.
    pub kind: CopyKind,
    /// What the copy pipeline did.
    pub stats: super::copy::CopyStats,
}

/// What a run of either stage works with.
pub(super) struct RunBase {
    pub(super) dev: Arc<dyn KfdDevice>,
    pub(super) settings: AmdgpuSettings,
    pub(super) images: ImageStore,
    pub(super) limits: CriuLimits,
    pub(super) copy_observer: Option<Arc<dyn CopyObserver>>,
}

impl RunBase {
    /// Tells the observer, if any, of a finished copy.
    pub(super) fn copied(&self, file_id: u32, kind: CopyKind, stats: super::copy::CopyStats) {
        if let Some(o) = &self.copy_observer {
            o.copied(CopyRecord {
                file_id,
                kind,
                stats,
            });
        }
    }
}

/// The hook's error for `e`, logged once, with its kind, where the hook returns to CRIU.
pub(super) fn fail(e: Error) -> HookError {
    e.context("amdgpu").into()
}

/// Most KFD images a restore looks at in the images directory.
pub(super) const MAX_KFD_IMAGES: usize = 1 << 16;
