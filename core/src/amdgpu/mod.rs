//! AMD GPUs through the KFD driver (`/dev/kfd`).
//!
//! Public: the backend with its options, the device seam ([`device`]: what the KFD simulator of
//! the `kfd-sim` crate implements), the image format ([`image`]), the KFD topology
//! ([`topology`]), the SDMA copy engine ([`sdma`], which the simulator's SDMA model is
//! tested against) and what restarts a dump's paused queues should CRIU end early
//! ([`guardian`]). The rest (dump, restore, contents, copy pipeline, parallel restore, image
//! store, kernel ioctls) is the backend's own.
//!
//! Laid out as the CUDA backend: `init` makes the run's state, a dump run or a restore run
//! (`DumpRun` of `dump.rs`, `RestoreRun` of `restore.rs`, each from `init` to `exit`), and the
//! hooks of the other stage find none and answer "not mine"; what a run does per CRIU file
//! is in `dump/files.rs` and `restore/files.rs`.

pub(crate) mod backend;
pub(crate) mod contents;
pub(crate) mod copy;
pub mod device;
pub(crate) mod dump;
pub(crate) mod error;
pub mod guardian;
pub(crate) mod holder;
pub mod image;
pub(crate) mod kernel;
pub(crate) mod parallel;
pub(crate) mod restore;
pub(crate) mod run;
pub mod sdma;
pub(crate) mod settings;
pub(crate) mod store;
pub mod topology;

pub use backend::{
    AmdgpuBackend, BackendOptions, CopyKind, CopyObserver, CopyRecord, DeviceFactory,
};
pub use copy::{CopyStats, StagingRegion, page_size};
pub use parallel::{FdStore, LocalFdStore};
pub use settings::AmdgpuSettings;
