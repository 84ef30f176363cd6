//! The GPU VM of one simulated render-node file: the memory behind its GEM handles, its
//! mappings, contexts and submissions; what the render-node side (`render.rs`) keeps per file
//! and the SDMA engine (`sdma.rs`) reads its copies through.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::BoMem;

/// Memory behind a GEM handle of a simulated render-node file.
#[derive(Clone)]
pub(super) enum GemMem {
    /// A KFD BO of this file's GPU, imported through its dma-buf.
    Bo(Arc<BoMem>),
    /// A BO of another GPU: not reachable by this GPU's SDMA engine here.
    Foreign,
    /// A GTT BO created in the file (command buffers).
    Local(Arc<BoMem>),
    /// User memory (userptr) of the calling process.
    User { addr: usize, size: u64 },
}

impl GemMem {
    pub(super) fn size(&self) -> u64 {
        match self {
            GemMem::Bo(m) | GemMem::Local(m) => m.size,
            GemMem::Foreign => 0,
            GemMem::User { size, .. } => *size,
        }
    }
}

/// Outcome of a submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Job {
    Done,
    Failed(i32),
    Hung,
}

/// The GPU VM and submission state of one render-node file.
#[derive(Default)]
pub(super) struct SimVm {
    pub(super) objects: HashMap<u32, GemMem>,
    /// VA → (handle, size).
    pub(super) maps: BTreeMap<u64, (u32, u64)>,
    pub(super) contexts: HashMap<u32, u64>,
    pub(super) next_ctx: u32,
    pub(super) jobs: HashMap<(u32, u64), Job>,
    /// Last GPU page fault: (page address, status).
    pub(super) fault: Option<(u64, u32)>,
}

/// Start and end of the VA range simulated render files offer.
pub(super) const SIM_VA_START: u64 = 0x80_0000;
pub(super) const SIM_VA_END: u64 = 1 << 47;

impl SimVm {
    /// The memory and offset behind `len` bytes at `va`, which must lie in one mapping of a
    /// BO in `allowed` (the submission's BO list); otherwise a GPU page fault.
    pub(super) fn resolve(
        &self,
        va: u64,
        len: u64,
        allowed: &[u32],
    ) -> Result<(GemMem, u64, u32), i32> {
        let (&start, &(handle, size)) = self.maps.range(..=va).next_back().ok_or(libc::EFAULT)?;
        let end = va.checked_add(len).ok_or(libc::EFAULT)?;
        if end > start + size {
            return Err(libc::EFAULT);
        }
        if !allowed.contains(&handle) {
            return Err(libc::EFAULT);
        }
        let mem = self.objects.get(&handle).ok_or(libc::EFAULT)?;
        Ok((mem.clone(), va - start, handle))
    }
}
