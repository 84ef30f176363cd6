//! The topology as the GPU mapping sees it: io links resolved (valid,
//! bi-directional) and GPUs grouped into XGMI hives.

use std::collections::HashMap;

use crate::amdgpu::topology::{GpuNode, IoLinkType, Topology, TopologyNode};

#[derive(Clone, Copy)]
pub(super) struct LinkView {
    pub(super) kind: IoLinkType,
    /// Index of the target node; `None` for an invalid link.
    pub(super) target: Option<usize>,
    pub(super) bidirectional: bool,
}

/// A topology with links resolved (validity, direction) and hives found.
pub(super) struct View<'a> {
    pub(super) is_gpu: Vec<bool>,
    pub(super) links: Vec<Vec<LinkView>>,
    pub(super) valid_links: Vec<usize>,
    /// GPUs in topology order.
    pub(super) gpus: Vec<&'a GpuNode>,
    /// Node index of each GPU.
    pub(super) gpu_node: Vec<usize>,
    /// Hives as lists of GPU ordinals (indices into `gpus`).
    pub(super) hives: Vec<Vec<usize>>,
    pub(super) node_ids: Vec<u32>,
}

impl<'a> View<'a> {
    pub(super) fn new(topo: &'a Topology) -> Self {
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

    pub(super) fn gpu_ids(&self) -> Vec<u32> {
        self.gpus.iter().map(|g| g.gpu_id).collect()
    }

    pub(super) fn hive_ids(&self) -> Vec<Vec<u32>> {
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
