//! The matching itself: the pairwise checks of a checkpointed GPU against a
//! restore GPU, and the bounded backtracking search over hives and the
//! remaining GPUs.

use super::MapError;
use super::hives::{LinkView, View};
use crate::amdgpu::topology::IoLinkType;
use crate::amdgpu::topology::compat::CompatChecks;
use crate::amdgpu::topology::properties::property_mismatch;

const SEARCH_LIMIT: u64 = 1_000_000;

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
pub(super) fn static_mismatch(
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
pub(super) enum Next {
    Hive(usize),
    Done,
}

pub(super) struct Search<'v, 'a> {
    src: &'v View<'a>,
    dst: &'v View<'a>,
    checks: CompatChecks,
    /// `compat[s][d]`: the pair passes [`static_mismatch`].
    compat: &'v [Vec<bool>],
    /// Valid links of each checkpoint GPU that lead to a CPU.
    src_cpu_links: Vec<Vec<LinkView>>,
    pub(super) assigned: Vec<Option<usize>>,
    used: Vec<bool>,
    hive_used: Vec<bool>,
    /// CPU node mappings (checkpoint node index, restore node index).
    pub(super) cpu_map: Vec<(usize, usize)>,
    attempts: u64,
}

impl<'v, 'a> Search<'v, 'a> {
    pub(super) fn new(
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

    pub(super) fn run(&mut self, next: Next) -> Result<bool, MapError> {
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
    pub(super) fn assign(
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
    pub(super) fn unmatchable(&self) -> Option<usize> {
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
pub(super) fn unplaceable_hive(can: &[Vec<bool>], restore_hives: usize) -> Option<usize> {
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
