//! Choosing the restore GPU for each checkpointed GPU ([`map_gpus`]): links
//! resolved into a view with XGMI hives, the pairwise checks, and the
//! backtracking search over hives and the remaining GPUs.

use std::collections::HashMap;
use std::error::Error;
use std::fmt;

use super::compat::{CompatChecks, property_mismatch};
use super::{GpuNode, IoLinkType, Topology, TopologyNode};

const SEARCH_LIMIT: u64 = 1_000_000;

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

// ---------------------------------------------------------------------------
// Matching
// ---------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct LinkView {
    kind: IoLinkType,
    /// Index of the target node; `None` for an invalid link.
    target: Option<usize>,
    bidirectional: bool,
}

/// A topology with links resolved (validity, direction) and hives found.
struct View<'a> {
    is_gpu: Vec<bool>,
    links: Vec<Vec<LinkView>>,
    valid_links: Vec<usize>,
    /// GPUs in topology order.
    gpus: Vec<&'a GpuNode>,
    /// Node index of each GPU.
    gpu_node: Vec<usize>,
    /// Hives as lists of GPU ordinals (indices into `gpus`).
    hives: Vec<Vec<usize>>,
    node_ids: Vec<u32>,
}

impl<'a> View<'a> {
    fn new(topo: &'a Topology) -> Self {
        let nodes = &topo.nodes;
        let index: HashMap<u32, usize> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.node_id(), i))
            .collect();
        let node_ids: Vec<u32> = nodes.iter().map(TopologyNode::node_id).collect();
        let is_gpu: Vec<bool> = nodes.iter().map(|n| n.as_gpu().is_some()).collect();
        let links: Vec<Vec<LinkView>> = nodes
            .iter()
            .map(|node| {
                node.io_links()
                    .iter()
                    .map(|l| {
                        let target = index.get(&l.node_to).copied();
                        let bidirectional = target.is_some_and(|t| {
                            nodes[t].io_links().iter().any(|back| {
                                back.link_type == l.link_type && back.node_to == node.node_id()
                            })
                        });
                        LinkView {
                            kind: l.link_type,
                            target,
                            bidirectional,
                        }
                    })
                    .collect()
            })
            .collect();
        let valid_links = links
            .iter()
            .map(|ls| ls.iter().filter(|l| l.target.is_some()).count())
            .collect();
        let mut gpus = Vec::new();
        let mut gpu_node = Vec::new();
        let mut ordinal = vec![None; nodes.len()];
        for (i, node) in nodes.iter().enumerate() {
            if let Some(g) = node.as_gpu() {
                ordinal[i] = Some(gpus.len());
                gpus.push(g);
                gpu_node.push(i);
            }
        }
        // Hives: a GPU's first bi-directional XGMI link to another GPU starts
        // a group holding it and its peers, in link order (as upstream);
        // groups that touch are merged so that a GPU is in one hive only.
        let mut group_of: Vec<Option<usize>> = vec![None; gpus.len()];
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (a, &node) in gpu_node.iter().enumerate() {
            for l in &links[node] {
                let Some(b) = l.target.and_then(|t| ordinal[t]) else {
                    continue;
                };
                if l.kind != IoLinkType::Xgmi || !l.bidirectional || b == a {
                    continue;
                }
                let ga = match group_of[a] {
                    Some(g) => g,
                    None => {
                        groups.push(vec![a]);
                        group_of[a] = Some(groups.len() - 1);
                        groups.len() - 1
                    }
                };
                match group_of[b] {
                    None => {
                        groups[ga].push(b);
                        group_of[b] = Some(ga);
                    }
                    Some(gb) if gb != ga => {
                        let moved = std::mem::take(&mut groups[gb]);
                        for m in moved {
                            group_of[m] = Some(ga);
                            groups[ga].push(m);
                        }
                    }
                    Some(_) => {}
                }
            }
        }
        groups.retain(|g| !g.is_empty());
        Self {
            is_gpu,
            links,
            valid_links,
            gpus,
            gpu_node,
            hives: groups,
            node_ids,
        }
    }

    fn gpu_ids(&self) -> Vec<u32> {
        self.gpus.iter().map(|g| g.gpu_id).collect()
    }

    fn hive_ids(&self) -> Vec<Vec<u32>> {
        self.hives
            .iter()
            .map(|h| h.iter().map(|&g| self.gpus[g].gpu_id).collect())
            .collect()
    }
}

impl Topology {
    /// The XGMI hives: groups of GPUs joined by bi-directional XGMI links,
    /// as lists of gpu ids in discovery order.
    pub fn xgmi_hives(&self) -> Vec<Vec<u32>> {
        let view = View::new(self);
        view.hives
            .iter()
            .map(|h| h.iter().map(|&g| view.gpus[g].gpu_id).collect())
            .collect()
    }
}

/// `iolink_match`: can restore link `d` stand in for checkpoint link `s`?
fn link_match(src: &View<'_>, s: &LinkView, dst: &View<'_>, d: &LinkView) -> bool {
    let Some(st) = s.target else { return true };
    let Some(dt) = d.target else { return false };
    if src.is_gpu[st] != dst.is_gpu[dt] {
        return false;
    }
    // XGMI cannot be replaced by PCIe (PCIe by XGMI is fine).
    if s.kind == IoLinkType::Xgmi && d.kind == IoLinkType::Pcie {
        return false;
    }
    // A bi-directional link needs a bi-directional replacement.
    !s.bidirectional || d.bidirectional
}

/// Checks of a pair that do not depend on other pairs: properties, the valid
/// link count, and that each link to a CPU has some usable counterpart (the
/// whole CPU-link check when `KFD_NUMA_CHECK` is off, a necessary condition
/// when it is on).
fn static_mismatch(
    src: &View<'_>,
    s: usize,
    dst: &View<'_>,
    d: usize,
    checks: &CompatChecks,
) -> Option<String> {
    if let Some(why) = property_mismatch(src.gpus[s], dst.gpus[d], checks) {
        return Some(why);
    }
    let (sn, dn) = (src.gpu_node[s], dst.gpu_node[d]);
    if src.valid_links[sn] > dst.valid_links[dn] {
        return Some(format!(
            "has {} valid io links, the checkpoint needs at least {}",
            dst.valid_links[dn], src.valid_links[sn]
        ));
    }
    for sl in &src.links[sn] {
        let Some(st) = sl.target else { continue };
        if src.is_gpu[st] {
            // GPU-to-GPU links are not checked (upstream: CPU links imply them).
            continue;
        }
        if !dst.links[dn].iter().any(|dl| link_match(src, sl, dst, dl)) {
            return Some(format!(
                "has no io link that can replace the {}{} link to CPU node {}",
                if sl.bidirectional {
                    "bi-directional "
                } else {
                    ""
                },
                sl.kind,
                src.node_ids[st]
            ));
        }
    }
    None
}

#[derive(Clone, Copy)]
enum Next {
    Hive(usize),
    Done,
}

struct Search<'v, 'a> {
    src: &'v View<'a>,
    dst: &'v View<'a>,
    checks: CompatChecks,
    /// `compat[s][d]`: the pair passes [`static_mismatch`].
    compat: &'v [Vec<bool>],
    /// Valid links of each checkpoint GPU that lead to a CPU.
    src_cpu_links: Vec<Vec<LinkView>>,
    assigned: Vec<Option<usize>>,
    used: Vec<bool>,
    hive_used: Vec<bool>,
    /// CPU node mappings (checkpoint node index, restore node index).
    cpu_map: Vec<(usize, usize)>,
    attempts: u64,
}

impl<'v, 'a> Search<'v, 'a> {
    fn new(
        src: &'v View<'a>,
        dst: &'v View<'a>,
        checks: CompatChecks,
        compat: &'v [Vec<bool>],
    ) -> Self {
        let src_cpu_links = src
            .gpu_node
            .iter()
            .map(|&n| {
                src.links[n]
                    .iter()
                    .filter(|l| l.target.is_some_and(|t| !src.is_gpu[t]))
                    .copied()
                    .collect()
            })
            .collect();
        Self {
            src,
            dst,
            checks,
            compat,
            src_cpu_links,
            assigned: vec![None; src.gpus.len()],
            used: vec![false; dst.gpus.len()],
            hive_used: vec![false; dst.hives.len()],
            cpu_map: Vec::new(),
            attempts: 0,
        }
    }

    fn mapped_cpu(&self, src_cpu: usize) -> Option<usize> {
        self.cpu_map
            .iter()
            .find(|&&(a, _)| a == src_cpu)
            .map(|&(_, b)| b)
    }

    fn run(&mut self, next: Next) -> Result<bool, MapError> {
        match next {
            Next::Hive(h) => self.hives_from(h),
            Next::Done => Ok(true),
        }
    }

    /// `match_xgmi_groups`: checkpoint hive `h` (and the later ones) into
    /// unused restore hives, trying restore hives in order.
    fn hives_from(&mut self, h: usize) -> Result<bool, MapError> {
        let (src, dst) = (self.src, self.dst);
        let Some(hive) = src.hives.get(h) else {
            return self.rest();
        };
        for (dh, dest_hive) in dst.hives.iter().enumerate() {
            if self.hive_used[dh] || dest_hive.len() < hive.len() {
                continue;
            }
            self.hive_used[dh] = true;
            if self.assign(hive, 0, dest_hive, Next::Hive(h + 1))? {
                return Ok(true);
            }
            self.hive_used[dh] = false;
        }
        Ok(false)
    }

    /// The GPUs left after the hives, both lists in reverse topology order
    /// (upstream builds them by prepending).
    fn rest(&mut self) -> Result<bool, MapError> {
        let srcs: Vec<usize> = (0..self.src.gpus.len())
            .rev()
            .filter(|&s| self.assigned[s].is_none())
            .collect();
        let cands: Vec<usize> = (0..self.dst.gpus.len())
            .rev()
            .filter(|&d| !self.used[d])
            .collect();
        self.assign(&srcs, 0, &cands, Next::Done)
    }

    /// `map_devices`: `srcs[pos..]` onto distinct unused `cands`, then `next`.
    fn assign(
        &mut self,
        srcs: &[usize],
        pos: usize,
        cands: &[usize],
        next: Next,
    ) -> Result<bool, MapError> {
        let Some(&s) = srcs.get(pos) else {
            return self.run(next);
        };
        for &d in cands {
            if self.used[d] || !self.compat[s][d] {
                continue;
            }
            self.attempts += 1;
            if self.attempts > SEARCH_LIMIT {
                return Err(MapError::SearchLimit {
                    attempts: self.attempts - 1,
                });
            }
            let mark = self.cpu_map.len();
            if self.numa_ok(s, d) {
                self.assigned[s] = Some(d);
                self.used[d] = true;
                if self.feasible() && self.assign(srcs, pos + 1, cands, next)? {
                    return Ok(true);
                }
                self.assigned[s] = None;
                self.used[d] = false;
            }
            self.cpu_map.truncate(mark);
        }
        Ok(false)
    }

    /// The CPU-link part of `map_device` with `KFD_NUMA_CHECK` on: links to
    /// an already mapped CPU need a same-type link to its image; links to an
    /// unmapped CPU take the first usable link to an unmapped restore CPU and
    /// record that CPU mapping.
    fn numa_ok(&mut self, s: usize, d: usize) -> bool {
        if !self.checks.numa {
            return true;
        }
        let (src, dst) = (self.src, self.dst);
        let dst_links = &dst.links[dst.gpu_node[d]];
        for i in 0..self.src_cpu_links[s].len() {
            let sl = self.src_cpu_links[s][i];
            let Some(st) = sl.target else { continue };
            if let Some(dc) = self.mapped_cpu(st) {
                if !self.link_to_cpu_ok(&sl, d, dc) {
                    return false;
                }
                continue;
            }
            let pick = dst_links.iter().find_map(|dl| {
                let t = dl.target?;
                let free = !self.cpu_map.iter().any(|&(_, b)| b == t);
                (free && link_match(src, &sl, dst, dl)).then_some(t)
            });
            match pick {
                Some(t) => self.cpu_map.push((st, t)),
                None => return false,
            }
        }
        true
    }

    /// `node_get_iolink_to_node_id` + `iolink_match`: the first link of
    /// restore GPU `d` of the same type to restore CPU `dc` must match `sl`.
    fn link_to_cpu_ok(&self, sl: &LinkView, d: usize, dc: usize) -> bool {
        self.dst.links[self.dst.gpu_node[d]]
            .iter()
            .find(|dl| dl.kind == sl.kind && dl.target == Some(dc))
            .is_some_and(|dl| link_match(self.src, sl, self.dst, dl))
    }

    /// Whether pair (s, d) is still possible: the pairwise checks, and links
    /// to CPUs that are already mapped (mappings only grow on a search path).
    fn possible(&self, s: usize, d: usize) -> bool {
        if !self.compat[s][d] {
            return false;
        }
        if !self.checks.numa {
            return true;
        }
        self.src_cpu_links[s]
            .iter()
            .all(|sl| match sl.target.and_then(|st| self.mapped_cpu(st)) {
                Some(dc) => self.link_to_cpu_ok(sl, d, dc),
                None => true,
            })
    }

    /// Whether the unassigned checkpoint GPUs can still be matched one-to-one
    /// with the unused restore GPUs using only [`Search::possible`] pairs (a
    /// necessary condition: it prunes only subtrees without a solution).
    fn feasible(&self) -> bool {
        self.unmatchable().is_none()
    }

    /// The first unassigned checkpoint GPU that a maximum matching leaves
    /// without a restore GPU (Kuhn's augmenting paths).
    fn unmatchable(&self) -> Option<usize> {
        let mut owner: Vec<Option<usize>> = vec![None; self.dst.gpus.len()];
        for s in 0..self.src.gpus.len() {
            if self.assigned[s].is_some() {
                continue;
            }
            let mut seen = vec![false; self.dst.gpus.len()];
            if !self.augment(s, &mut seen, &mut owner) {
                return Some(s);
            }
        }
        None
    }

    fn augment(&self, s: usize, seen: &mut [bool], owner: &mut [Option<usize>]) -> bool {
        for d in 0..self.dst.gpus.len() {
            if self.used[d] || seen[d] || !self.possible(s, d) {
                continue;
            }
            seen[d] = true;
            if owner[d].is_none_or(|other| self.augment(other, seen, owner)) {
                owner[d] = Some(s);
                return true;
            }
        }
        false
    }
}

/// Kuhn's matching of checkpoint hives to restore hives over `can[h][dh]`;
/// the first hive left without a restore hive.
fn unplaceable_hive(can: &[Vec<bool>], restore_hives: usize) -> Option<usize> {
    fn augment(
        h: usize,
        can: &[Vec<bool>],
        seen: &mut [bool],
        owner: &mut [Option<usize>],
    ) -> bool {
        for dh in 0..owner.len() {
            if seen[dh] || !can[h][dh] {
                continue;
            }
            seen[dh] = true;
            if owner[dh].is_none_or(|other| augment(other, can, seen, owner)) {
                owner[dh] = Some(h);
                return true;
            }
        }
        false
    }
    let mut owner = vec![None; restore_hives];
    (0..can.len()).find(|&h| !augment(h, can, &mut vec![false; restore_hives], &mut owner))
}

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
