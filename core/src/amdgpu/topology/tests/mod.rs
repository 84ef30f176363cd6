//! Tests of the topology module, one file per part: the upstream remap
//! cases, the rest of the mapping, the image form, and sysfs parsing. This
//! file holds the builders and fixtures they share.

use super::sysfs::{numeric_entries, numeric_entries_capped};
use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

mod image;
mod mapping;
mod remap;
mod sysfs;

const PCIE: IoLinkType = IoLinkType::Pcie;
const XGMI: IoLinkType = IoLinkType::Xgmi;

// ----- builders for the upstream remap cases ---------------------------

#[derive(Default)]
struct Tb {
    nodes: Vec<TopologyNode>,
}

impl Tb {
    fn cpu(&mut self, id: u32) {
        self.nodes.push(TopologyNode::Cpu(CpuNode {
            node_id: id,
            cpu_cores_count: 1,
            io_links: Vec::new(),
        }));
    }

    fn gpu(&mut self, id: u32, gpu_id: u32, device_id: u32) {
        self.nodes.push(TopologyNode::Gpu(GpuNode {
            node_id: id,
            gpu_id,
            device_id,
            ..GpuNode::default()
        }));
    }

    fn link(&mut self, from: u32, kind: IoLinkType, to: u32) {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.node_id() == from)
            .expect("node exists");
        node.io_links_mut().push(IoLink {
            link_type: kind,
            node_to: to,
        });
    }

    /// Links `a` to `b` and `b` back to `a`.
    fn link_both(&mut self, a: u32, kind: IoLinkType, b: u32) {
        self.link(a, kind, b);
        self.link(b, kind, a);
    }

    /// Links every node of `nodes` to every other one, in list order.
    fn full_mesh(&mut self, nodes: &[u32], kind: IoLinkType) {
        for &a in nodes {
            for &b in nodes {
                if a != b {
                    self.link(a, kind, b);
                }
            }
        }
    }

    /// Four GPUs on the nodes from `first`, with gpu ids from `first_id`,
    /// each linked to CPU `i & 1`; `back(i)` says whether that CPU links
    /// back to GPU `i`.
    fn gpu_quad(&mut self, first: u32, first_id: u32, device_id: u32, back: impl Fn(u32) -> bool) {
        for i in 0..4 {
            self.gpu(first + i, first_id + i, device_id);
            self.link(first + i, PCIE, i & 1);
            if back(i) {
                self.link(i & 1, PCIE, first + i);
            }
        }
    }

    /// The upstream hive layout: each of the four nodes from `first` links
    /// to the next three, wrapping around.
    fn ring_mesh(&mut self, first: u32, kind: IoLinkType) {
        for i in 0..4 {
            for j in 1..4 {
                self.link(first + i, kind, first + (i + j) % 4);
            }
        }
    }

    /// PCIe P2P links from each of the four nodes from `from` to those of the
    /// four nodes from `to` that `keep` accepts, starting at its own position.
    fn quad_p2p(&mut self, from: u32, to: u32, keep: impl Fn(u32) -> bool) {
        for i in 0..4 {
            for j in 0..4 {
                let target = to + (i + j) % 4;
                if keep(target) {
                    self.link(from + i, PCIE, target);
                }
            }
        }
    }

    fn build(self) -> Topology {
        Topology::from_nodes(self.nodes).expect("valid test topology")
    }
}

/// Tests 0 and 1/2: two hives of 4 behind 2 CPUs; `partial` drops the
/// CPU back-links of the last two GPUs and the PCIe links to them.
fn two_hives(base: u32, dev: [u32; 2], partial: bool) -> Topology {
    let mut t = Tb::default();
    t.cpu(0);
    t.cpu(1);
    t.gpu_quad(2, base, dev[0], |_| true);
    t.ring_mesh(2, XGMI);
    t.quad_p2p(2, 6, |to| !partial || to < 8);
    t.gpu_quad(6, base + 0x14, dev[1], |i| !partial || i < 2);
    t.ring_mesh(6, XGMI);
    t.quad_p2p(6, 2, |_| true);
    t.build()
}

/// Tests 3 and 4: two hives (device ids D000, D001), GPU-to-CPU links
/// everywhere, CPU back-links only to `back[0]` (CPU 0) and `back[1]`.
fn hives_one_cpu_backlink(base: u32, back: [u32; 2]) -> Topology {
    let mut t = Tb::default();
    t.cpu(0);
    t.cpu(1);
    t.gpu_quad(2, base, 0xD000, |_| false);
    t.ring_mesh(2, XGMI);
    t.gpu_quad(6, base + 0x14, 0xD001, |_| false);
    t.ring_mesh(6, XGMI);
    t.link(0, PCIE, back[0]);
    t.link(1, PCIE, back[1]);
    t.build()
}

/// Test 5: one hive of 4 plus 4 GPUs joined by PCIe only, full P2P.
fn one_hive_four_pcie(base: u32) -> Topology {
    let mut t = Tb::default();
    t.cpu(0);
    t.cpu(1);
    t.gpu_quad(2, base, 0xD000, |_| true);
    t.ring_mesh(2, XGMI);
    t.quad_p2p(2, 6, |_| true);
    t.gpu_quad(6, base + 0x14, 0xD000, |_| true);
    t.ring_mesh(6, PCIE);
    t.quad_p2p(6, 2, |_| true);
    t.build()
}

/// Tests 6 and 8: 5 GPUs behind one CPU, no hive; P2P-PCIe links to the
/// GPU nodes below `limit`.
fn five_gpus(base: u32, devs: [u32; 5], limit: u32) -> Topology {
    let mut t = Tb::default();
    t.cpu(0);
    for i in 0..5u32 {
        t.gpu(i + 1, base + i, devs[i as usize]);
        t.link_both(i + 1, PCIE, 0);
    }
    for i in 0..5u32 {
        for j in 1..5 {
            let to = (i + j) % 5 + 1;
            if to < limit {
                t.link(i + 1, PCIE, to);
            }
        }
    }
    t.build()
}

/// Test 7: a hive of 4 with one-way CPU links, plus 4 GPUs that form a
/// second hive (restore side) or have no links at all (checkpoint side).
fn hive_plus_four(base: u32, second_hive: bool) -> Topology {
    let mut t = Tb::default();
    t.cpu(0);
    t.cpu(1);
    t.gpu_quad(2, base, 0xD000, |_| false);
    t.ring_mesh(2, XGMI);
    for i in 0..4 {
        t.gpu(6 + i, base + 0x14 + i, 0xD000);
    }
    if second_hive {
        t.ring_mesh(6, XGMI);
    }
    t.build()
}

fn gpu_pairs(map: &GpuMap) -> BTreeMap<u32, u32> {
    map.iter()
        .map(|m| (m.checkpoint_gpu_id, m.restore_gpu_id))
        .collect()
}

fn expect_map(src: &Topology, dst: &Topology, pairs: &[(u32, u32)]) -> GpuMap {
    let map = map_gpus(src, dst, &CompatChecks::default()).expect("mapping succeeds");
    let want: BTreeMap<u32, u32> = pairs.iter().copied().collect();
    assert_eq!(gpu_pairs(&map), want);
    map
}

fn identity_pairs(n_first: u32, with_second: bool) -> Vec<(u32, u32)> {
    let mut v: Vec<(u32, u32)> = (0..n_first).map(|i| (0xA000 + i, 0xB000 + i)).collect();
    if with_second {
        v.extend((0x14..0x18).map(|i| (0xA000 + i, 0xB000 + i)));
    }
    v
}
// ----- container device lists ------------------------------------------------

/// A KFD topology fixture of the workspace's tests (`tests/fixtures/kfd-topology/`).
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/kfd-topology")
        .join(name)
}

fn identity_image(t: &Topology) -> Topology {
    Topology::from_device_entries(&t.to_device_entries(Some)).expect("image round trip")
}

// ----- hostile sysfs -------------------------------------------------------------

static TEMP_SEQ: AtomicUsize = AtomicUsize::new(0);

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let n = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kfd-topo-{}-{tag}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
