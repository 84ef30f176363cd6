//! Choosing the restore GPU for each checkpointed GPU ([`map_gpus`]): links
//! resolved into a view with XGMI hives, the pairwise checks, and the
//! backtracking search over hives and the remaining GPUs.

mod hives;
mod search;

use std::error::Error;
use std::fmt;

use super::Topology;
use super::compat::CompatChecks;
use hives::View;
use search::{Next, Search, static_mismatch, unplaceable_hive};

/// Where one checkpointed GPU goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuMapping {
    /// Gpu id in the image (the user id KFD keeps for the process).
    pub checkpoint_gpu_id: u32,
    /// Local (actual) gpu id of the chosen restore GPU.
    pub restore_gpu_id: u32,
    /// Node id in the checkpointed topology.
    pub checkpoint_node_id: u32,
    /// Node id in the restore topology.
    pub restore_node_id: u32,
    /// Render minor recorded at checkpoint time.
    pub checkpoint_render_minor: u32,
    /// Render minor of the chosen restore GPU.
    pub restore_render_minor: u32,
}

/// Result of [`map_gpus`]: one [`GpuMapping`] per checkpointed GPU (in
/// checkpoint topology order) and the CPU node mapping used for the NUMA
/// check (never sent to the kernel).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuMap {
    gpus: Vec<GpuMapping>,
    cpus: Vec<(u32, u32)>,
}

impl GpuMap {
    /// The mapping of a checkpointed (image) gpu id.
    pub fn get(&self, checkpoint_gpu_id: u32) -> Option<&GpuMapping> {
        self.gpus
            .iter()
            .find(|m| m.checkpoint_gpu_id == checkpoint_gpu_id)
    }

    /// The restore gpu id for a checkpointed (image) gpu id.
    pub fn restore_gpu_id(&self, checkpoint_gpu_id: u32) -> Option<u32> {
        self.get(checkpoint_gpu_id).map(|m| m.restore_gpu_id)
    }

    /// The mapping of the GPU that had render minor `minor` at checkpoint.
    pub fn get_by_checkpoint_render_minor(&self, minor: u32) -> Option<&GpuMapping> {
        self.gpus
            .iter()
            .find(|m| m.checkpoint_render_minor == minor)
    }

    /// All GPU mappings, in checkpoint topology order.
    pub fn iter(&self) -> std::slice::Iter<'_, GpuMapping> {
        self.gpus.iter()
    }

    /// Number of mapped GPUs.
    pub fn len(&self) -> usize {
        self.gpus.len()
    }

    /// True when no GPU is mapped.
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// CPU node mappings (checkpoint node id, restore node id) chosen by the
    /// NUMA check, sorted by checkpoint node id. Empty when the check is off.
    pub fn cpu_mappings(&self) -> &[(u32, u32)] {
        &self.cpus
    }
}

impl<'a> IntoIterator for &'a GpuMap {
    type Item = &'a GpuMapping;
    type IntoIter = std::slice::Iter<'a, GpuMapping>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Why the checkpointed GPUs could not be mapped.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MapError {
    /// The GPU counts differ (KFD restores exactly the checkpointed set).
    GpuCountMismatch {
        /// Checkpointed gpu ids.
        checkpoint: Vec<u32>,
        /// Usable restore gpu ids.
        restore: Vec<u32>,
    },
    /// The checkpoint has more XGMI hives than the restore host.
    HiveCountMismatch {
        /// Checkpointed hives (gpu ids).
        checkpoint: Vec<Vec<u32>>,
        /// Restore hives (gpu ids).
        restore: Vec<Vec<u32>>,
    },
    /// A checkpointed GPU matches no restore GPU at all.
    NoCompatibleGpu {
        /// The checkpointed gpu id.
        checkpoint_gpu_id: u32,
        /// Each restore gpu id with the first reason it was rejected.
        rejected: Vec<(u32, String)>,
    },
    /// No restore hive can take this checkpointed hive.
    HiveNotPlaceable {
        /// The checkpointed hive (gpu ids).
        hive: Vec<u32>,
    },
    /// Every GPU has candidates, but no complete assignment satisfies the
    /// one-to-one, hive and NUMA constraints together.
    NoConsistentMapping {
        /// Explanation.
        detail: String,
    },
    /// The search gave up after this many pair evaluations.
    SearchLimit {
        /// Pair evaluations made.
        attempts: u64,
    },
}

struct Ids<'a>(&'a [u32]);

impl fmt::Display for Ids<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, id) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{id:#06x}")?;
        }
        Ok(())
    }
}

impl fmt::Display for MapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::GpuCountMismatch {
                checkpoint,
                restore,
            } if checkpoint.len() > restore.len() => write!(
                f,
                "the checkpoint used {} GPUs ({}) but only {} usable GPUs are present here ({}): {} missing",
                checkpoint.len(),
                Ids(checkpoint),
                restore.len(),
                Ids(restore),
                checkpoint.len() - restore.len()
            ),
            Self::GpuCountMismatch {
                checkpoint,
                restore,
            } => write!(
                f,
                "this host has {} usable GPUs ({}) but the checkpoint used {} ({}); \
                 KFD restores exactly the checkpointed number, so hide the extra GPUs from the restored task",
                restore.len(),
                Ids(restore),
                checkpoint.len(),
                Ids(checkpoint)
            ),
            Self::HiveCountMismatch {
                checkpoint,
                restore,
            } => write!(
                f,
                "the checkpoint has {} XGMI hives but this host has only {}",
                checkpoint.len(),
                restore.len()
            ),
            Self::NoCompatibleGpu {
                checkpoint_gpu_id,
                rejected,
            } => {
                write!(
                    f,
                    "no GPU here can take checkpointed GPU {checkpoint_gpu_id:#06x}"
                )?;
                for (i, (id, why)) in rejected.iter().enumerate() {
                    f.write_str(if i == 0 { ": " } else { "; " })?;
                    write!(f, "{id:#06x} {why}")?;
                }
                Ok(())
            }
            Self::HiveNotPlaceable { hive } => write!(
                f,
                "no XGMI hive here is left for the checkpointed hive of GPUs {} \
                 (a restore hive must be at least as large, hold compatible GPUs, and take one checkpointed hive)",
                Ids(hive)
            ),
            Self::NoConsistentMapping { detail } => {
                write!(f, "the GPUs cannot be mapped: {detail}")
            }
            Self::SearchLimit { attempts } => write!(
                f,
                "gave up mapping GPUs after {attempts} attempts without finding a consistent assignment"
            ),
        }
    }
}

impl Error for MapError {}

/// Maps every GPU of the checkpointed topology (rebuilt from the image with
/// [`Topology::from_device_entries`]) to a distinct GPU of `restore` (parsed
/// from sysfs and filtered with [`Topology::retain_accessible`]).
///
/// The GPU counts must be equal and the restore host must have at least as
/// many XGMI hives. Hives are matched first, each into one restore hive,
/// then the remaining GPUs. See the module documentation for the rules and
/// for how this differs from the C plugin.
pub fn map_gpus(
    checkpointed: &Topology,
    restore: &Topology,
    checks: &CompatChecks,
) -> Result<GpuMap, MapError> {
    let src = View::new(checkpointed);
    let dst = View::new(restore);
    if src.gpus.len() != dst.gpus.len() {
        return Err(MapError::GpuCountMismatch {
            checkpoint: src.gpu_ids(),
            restore: dst.gpu_ids(),
        });
    }
    if src.hives.len() > dst.hives.len() {
        return Err(MapError::HiveCountMismatch {
            checkpoint: src.hive_ids(),
            restore: dst.hive_ids(),
        });
    }

    let mut compat: Vec<Vec<bool>> = Vec::with_capacity(src.gpus.len());
    for s in 0..src.gpus.len() {
        let reasons: Vec<Option<String>> = (0..dst.gpus.len())
            .map(|d| static_mismatch(&src, s, &dst, d, checks))
            .collect();
        if reasons.iter().all(Option::is_some) {
            return Err(MapError::NoCompatibleGpu {
                checkpoint_gpu_id: src.gpus[s].gpu_id,
                rejected: dst
                    .gpus
                    .iter()
                    .zip(reasons)
                    .map(|(g, r)| (g.gpu_id, r.unwrap_or_default()))
                    .collect(),
            });
        }
        compat.push(reasons.iter().map(Option::is_none).collect());
    }

    let mut search = Search::new(&src, &dst, *checks, &compat);
    if let Some(s) = search.unmatchable() {
        let candidates: Vec<u32> = (0..dst.gpus.len())
            .filter(|&d| compat[s][d])
            .map(|d| dst.gpus[d].gpu_id)
            .collect();
        return Err(MapError::NoConsistentMapping {
            detail: format!(
                "checkpointed GPU {:#06x} can only use restore GPUs {}, which other checkpointed GPUs need as well",
                src.gpus[s].gpu_id,
                Ids(&candidates)
            ),
        });
    }
    if !search.run(Next::Hive(0))? {
        // Which checkpoint hive fits which restore hive on its own, then
        // whether the hives can be paired one-to-one at all.
        let mut can = Vec::with_capacity(src.hives.len());
        for hive in &src.hives {
            let mut row = Vec::with_capacity(dst.hives.len());
            for dest_hive in &dst.hives {
                let fits = dest_hive.len() >= hive.len()
                    && Search::new(&src, &dst, *checks, &compat).assign(
                        hive,
                        0,
                        dest_hive,
                        Next::Done,
                    )?;
                row.push(fits);
            }
            can.push(row);
        }
        if let Some(h) = unplaceable_hive(&can, dst.hives.len()) {
            return Err(MapError::HiveNotPlaceable {
                hive: src.hives[h].iter().map(|&g| src.gpus[g].gpu_id).collect(),
            });
        }
        return Err(MapError::NoConsistentMapping {
            detail: "every GPU has compatible counterparts, but no assignment keeps the XGMI hives together \
                     and the GPU-to-CPU (NUMA) links consistent"
                .into(),
        });
    }

    let gpus = search
        .assigned
        .iter()
        .enumerate()
        .filter_map(|(s, d)| {
            let d = (*d)?;
            let (sg, dg) = (src.gpus[s], dst.gpus[d]);
            Some(GpuMapping {
                checkpoint_gpu_id: sg.gpu_id,
                restore_gpu_id: dg.gpu_id,
                checkpoint_node_id: sg.node_id,
                restore_node_id: dg.node_id,
                checkpoint_render_minor: sg.drm_render_minor,
                restore_render_minor: dg.drm_render_minor,
            })
        })
        .collect::<Vec<_>>();
    let mut cpus: Vec<(u32, u32)> = search
        .cpu_map
        .iter()
        .map(|&(a, b)| (src.node_ids[a], dst.node_ids[b]))
        .collect();
    cpus.sort_unstable();
    for m in &gpus {
        log::info!(
            "GPU {:#06x} (renderD{}) -> {:#06x} (renderD{})",
            m.checkpoint_gpu_id,
            m.checkpoint_render_minor,
            m.restore_gpu_id,
            m.restore_render_minor
        );
    }
    Ok(GpuMap { gpus, cpus })
}
