//! Why the NVIDIA side cannot serve a dump that may need it: a process that holds an NVIDIA
//! device then fails the dump, saying why.

use super::super::{driver, gpus};

/// Why the NVIDIA side cannot serve a dump that may need it.
#[derive(Debug, thiserror::Error)]
pub enum Unusable {
    /// The settings file cannot be read.
    #[error("the settings file cannot be read ({0})")]
    Settings(String),
    /// The kernel driver's listing is not where the settings say.
    #[error("{0}")]
    Machine(String),
    /// No driver, or one without the checkpoint API.
    #[error("CUDA checkpointing cannot work: {0}")]
    Driver(#[from] driver::LoadError),
    /// The GPUs cannot be listed.
    #[error("the GPUs cannot be listed from cuda.nvidia-proc = {dir} ({from}): {source}")]
    Gpus {
        /// The listing's directory.
        dir: String,
        /// Where the setting came from.
        from: String,
        /// Why.
        source: gpus::ListingError,
    },
}
