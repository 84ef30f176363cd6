//! KFD topology: reading the GPU/CPU topology that amdkfd exposes in sysfs, and
//! choosing which GPU of the restore host stands in for each GPU of a checkpoint.
//!
//! # What this module does
//!
//! * [`Topology::from_sysfs`] parses `<root>/nodes/N/{gpu_id,properties}`,
//!   `mem_banks/*/properties` (GPU nodes) and `io_links/*/properties`, with
//!   every file read capped at [`MAX_SYSFS_FILE_BYTES`]. The default root is
//!   [`DEFAULT_SYSFS_ROOT`]. `p2p_links` is not read: the upstream plugin does
//!   not use it either.
//! * [`Topology::retain_accessible`] drops GPUs that the restored task will not
//!   be able to use (for example a container whose device list lacks their
//!   render node); [`present_render_minors`] lists the render nodes under a
//!   `/dev/dri` directory to build such a filter.
//! * [`Topology::to_device_entries`] / [`Topology::from_device_entries`] convert to
//!   and from the image's device entries ([`DeviceEntry`], `kfd_device_entry`).
//! * [`map_gpus`] maps every checkpointed GPU to a distinct restore GPU and
//!   returns a [`GpuMap`] (gpu ids and render minors), under the seven
//!   `KFD_*_CHECK` switches held in [`CompatChecks`].
//!
//! # Where the algorithm comes from
//!
//! It follows `amdgpu_plugin_topology.c` of CRIU's amdgpu plugin
//! (`topology_parse`, `topology_determine_iolinks`, `set_restore_gpu_maps`):
//! links are valid when their target node exists, bi-directional when the target links back
//! with the same type, bi-directional XGMI links between GPUs form hives; the
//! hives are matched first (each checkpointed hive inside a single restore
//! hive), then the remaining GPUs, in reverse topology order; a pair of GPUs
//! matches when the properties agree (`device_properties_match`), the restore
//! GPU has at least as many valid links, and every link to a CPU can be served
//! with a consistent CPU (NUMA) mapping. The nine cases of the upstream
//! `tests/test_topology_remap.c` are ported in the tests and give the same maps.
//!
//! # Defects fixed and deliberate deviations
//!
//! * GPUs hidden from the process: [`Topology::to_device_entries`] leaves out
//!   GPUs that KFD did not report for the process (cgroup or device-list
//!   limits) instead of failing the dump, and drops the links that pointed at
//!   them.
//! * GPUs whose render node is missing: the mapping never picks a GPU that
//!   [`Topology::retain_accessible`] removed, so a GPU whose render node is
//!   missing in the container is not chosen and then opened with a bad
//!   descriptor (the C plugin passed that bad descriptor on to KFD); the render
//!   minors are validated by [`render_node_path`].
//! * User and actual gpu ids: [`GpuMap`] keys are always the image (user) gpu
//!   ids and the values the local (actual) ids; the two never share a field
//!   (the C plugin looked BOs up by one id where the other was needed, so a
//!   process restored onto other GPUs could not be dumped again).
//! * Found while porting, beyond the points above: after a later hive failed to
//!   match, the C code kept the stale mappings of the earlier hive and so could
//!   never backtrack; it also re-inserted rejected candidates at the front of
//!   its list, which can skip candidates. This module backtracks fully with a
//!   stable candidate order, and pre-checks that a one-to-one assignment can
//!   exist at all (pruning only subtrees that cannot succeed). Whenever the C
//!   search succeeds the result is the same mapping; where the C search gave up
//!   early this one may find a mapping. The search is bounded
//!   ([`MapError::SearchLimit`]).
//! * The hive size pre-check that the C code meant to do (`num_nodes` was never
//!   incremented) is done here. Hives are connected components, so a GPU is
//!   never put in two hives, and XGMI links to CPU nodes never form hives.
//! * Nodes, memory banks and links are read in numeric order, not in `readdir`
//!   (hash) order, so results do not depend on the directory layout.
//! * Parsing is stricter where the C code silently truncated or ignored
//!   garbage: values must be plain decimal numbers, values of 32-bit
//!   properties must fit in 32 bits, a readable but non-numeric `gpu_id` is an
//!   error, and a link of a kept type must name its `node_to`. A missing
//!   `io_links` directory means "no links" (the C code failed). As upstream, a
//!   node whose `gpu_id` cannot be read is skipped (that is how device-cgroup
//!   masking shows up) and unknown property names are ignored.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::error::Error;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

pub use super::image::DeviceEntry;
use super::image::IoLink as EntryLink;

/// Where amdkfd exposes its topology.
pub const DEFAULT_SYSFS_ROOT: &str = "/sys/class/kfd/kfd/topology";

/// Largest sysfs file this module reads; larger files are an error.
pub const MAX_SYSFS_FILE_BYTES: usize = 64 * 1024;

/// Most entries read from one sysfs directory (nodes, banks or links).
pub const MAX_DIR_ENTRIES: usize = 4096;

/// Longest property name accepted (the C plugin's `MAX_PARAMETER_LEN`).
pub const MAX_PROPERTY_NAME_LEN: usize = 64;

/// Raw `type` value of a PCIe io link.
pub const IOLINK_TYPE_PCIE: u32 = 2;
/// Raw `type` value of an XGMI io link.
pub const IOLINK_TYPE_XGMI: u32 = 11;

/// First DRM render-node minor (`/dev/dri/renderD128`).
pub const RENDER_MINOR_FIRST: u32 = 128;
/// Last DRM render-node minor.
pub const RENDER_MINOR_LAST: u32 = 255;

const HEAP_TYPE_FB_PUBLIC: u32 = 1;
const HEAP_TYPE_FB_PRIVATE: u32 = 2;
const GPU_ID_FILE_LIMIT: usize = 64;
const SEARCH_LIMIT: u64 = 1_000_000;

// ---------------------------------------------------------------------------
// Plain data
// ---------------------------------------------------------------------------

/// Kind of an io link. Only the two kinds the plugin uses are kept; links of
/// other kinds are dropped when parsing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoLinkType {
    /// PCIe (raw type 2).
    Pcie,
    /// XGMI (raw type 11).
    Xgmi,
}

impl IoLinkType {
    /// The kind for a raw sysfs/image `type` value, if it is one that is kept.
    pub const fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            IOLINK_TYPE_PCIE => Some(Self::Pcie),
            IOLINK_TYPE_XGMI => Some(Self::Xgmi),
            _ => None,
        }
    }

    /// The raw sysfs/image `type` value.
    pub const fn raw(self) -> u32 {
        match self {
            Self::Pcie => IOLINK_TYPE_PCIE,
            Self::Xgmi => IOLINK_TYPE_XGMI,
        }
    }
}

impl fmt::Display for IoLinkType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pcie => "PCIe",
            Self::Xgmi => "XGMI",
        })
    }
}

/// One io link of a node, as listed under `io_links/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IoLink {
    /// PCIe or XGMI.
    pub link_type: IoLinkType,
    /// Node id of the other end.
    pub node_to: u32,
}

/// A CPU (NUMA) node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuNode {
    /// KFD node id (the directory name under `nodes/`).
    pub node_id: u32,
    /// `cpu_cores_count`.
    pub cpu_cores_count: u32,
    /// Links of kinds PCIe and XGMI, in numeric directory order.
    pub io_links: Vec<IoLink>,
}

/// A GPU node: the properties the plugin stores in the image and compares.
/// Fields without a comment carry the sysfs property of the same name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuNode {
    /// KFD node id (the directory name under `nodes/`).
    pub node_id: u32,
    /// KFD gpu id. Local (actual) id when parsed from sysfs; the user id when
    /// rebuilt from an image.
    pub gpu_id: u32,
    pub simd_count: u32,
    pub mem_banks_count: u32,
    pub caches_count: u32,
    /// Raw `io_links_count` property (all links, valid or not).
    pub io_links_count: u32,
    pub max_waves_per_simd: u32,
    pub lds_size_in_kb: u32,
    pub num_gws: u32,
    pub wave_front_size: u32,
    pub array_count: u32,
    pub simd_arrays_per_engine: u32,
    pub cu_per_simd_array: u32,
    pub simd_per_cu: u32,
    pub max_slots_scratch_cu: u32,
    pub vendor_id: u32,
    pub device_id: u32,
    /// PCI domain (not compared).
    pub domain: u32,
    /// Render-node minor (`/dev/dri/renderD<minor>`, not compared).
    pub drm_render_minor: u32,
    /// XGMI hive id (not compared; hives come from the links).
    pub hive_id: u64,
    pub num_sdma_engines: u32,
    pub num_sdma_xgmi_engines: u32,
    pub num_sdma_queues_per_engine: u32,
    pub num_cp_queues: u32,
    pub fw_version: u32,
    pub capability: u32,
    pub sdma_fw_version: u32,
    /// True when the first frame-buffer bank is public (heap type 1).
    pub vram_public: bool,
    /// Size of the first frame-buffer bank in bytes.
    pub vram_size: u64,
    /// Links of kinds PCIe and XGMI, in numeric directory order.
    pub io_links: Vec<IoLink>,
}

/// One node of a [`Topology`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopologyNode {
    /// A node without a GPU (gpu id 0).
    Cpu(CpuNode),
    /// A node with a GPU (an APU node counts as a GPU).
    Gpu(GpuNode),
}

impl TopologyNode {
    /// The KFD node id.
    pub fn node_id(&self) -> u32 {
        match self {
            Self::Cpu(c) => c.node_id,
            Self::Gpu(g) => g.node_id,
        }
    }

    /// The gpu id, 0 for a CPU node.
    pub fn gpu_id(&self) -> u32 {
        match self {
            Self::Cpu(_) => 0,
            Self::Gpu(g) => g.gpu_id,
        }
    }

    /// The node's io links.
    pub fn io_links(&self) -> &[IoLink] {
        match self {
            Self::Cpu(c) => &c.io_links,
            Self::Gpu(g) => &g.io_links,
        }
    }

    /// The GPU, if this is a GPU node.
    pub fn as_gpu(&self) -> Option<&GpuNode> {
        match self {
            Self::Cpu(_) => None,
            Self::Gpu(g) => Some(g),
        }
    }

    #[cfg(test)]
    fn io_links_mut(&mut self) -> &mut Vec<IoLink> {
        match self {
            Self::Cpu(c) => &mut c.io_links,
            Self::Gpu(g) => &mut g.io_links,
        }
    }
}

/// A set of KFD topology nodes (CPUs and GPUs) with unique node ids and
/// unique, non-zero gpu ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Topology {
    nodes: Vec<TopologyNode>,
}

// ---------------------------------------------------------------------------
// Image form
// ---------------------------------------------------------------------------

fn dev_links(links: &[IoLink]) -> Vec<EntryLink> {
    links
        .iter()
        .map(|l| EntryLink {
            link_type: l.link_type.raw(),
            node_to_id: l.node_to,
        })
        .collect()
}

impl GpuNode {
    /// The image entry for this GPU, recorded under `image_gpu_id` (the user
    /// gpu id KFD reported for the process). Links are copied as they are.
    pub fn to_device_entry(&self, image_gpu_id: u32) -> DeviceEntry {
        DeviceEntry {
            node_id: self.node_id,
            gpu_id: image_gpu_id,
            cpu_cores_count: 0,
            simd_count: self.simd_count,
            mem_banks_count: self.mem_banks_count,
            caches_count: self.caches_count,
            io_links_count: self.io_links_count,
            max_waves_per_simd: self.max_waves_per_simd,
            lds_size_in_kb: self.lds_size_in_kb,
            gds_size_in_kb: 0,
            num_gws: self.num_gws,
            wave_front_size: self.wave_front_size,
            array_count: self.array_count,
            simd_arrays_per_engine: self.simd_arrays_per_engine,
            cu_per_simd_array: self.cu_per_simd_array,
            simd_per_cu: self.simd_per_cu,
            max_slots_scratch_cu: self.max_slots_scratch_cu,
            vendor_id: self.vendor_id,
            device_id: self.device_id,
            domain: self.domain,
            drm_render_minor: self.drm_render_minor,
            hive_id: self.hive_id,
            num_sdma_engines: self.num_sdma_engines,
            num_sdma_xgmi_engines: self.num_sdma_xgmi_engines,
            num_sdma_queues_per_engine: self.num_sdma_queues_per_engine,
            num_cp_queues: self.num_cp_queues,
            fw_version: self.fw_version,
            capability: self.capability,
            sdma_fw_version: self.sdma_fw_version,
            vram_public: u32::from(self.vram_public),
            vram_size: self.vram_size,
            iolinks: dev_links(&self.io_links),
        }
    }
}

impl CpuNode {
    /// The image entry for this CPU node. Links are copied as they are.
    pub fn to_device_entry(&self) -> DeviceEntry {
        DeviceEntry {
            node_id: self.node_id,
            cpu_cores_count: self.cpu_cores_count,
            iolinks: dev_links(&self.io_links),
            ..DeviceEntry::default()
        }
    }
}

impl From<&DeviceEntry> for TopologyNode {
    /// An entry with a non-zero gpu id is a GPU, otherwise a CPU. (Upstream
    /// tests `cpu_cores_count`; for entries the plugin writes the two agree.)
    /// Links of unknown types are dropped.
    fn from(d: &DeviceEntry) -> Self {
        let io_links = d
            .iolinks
            .iter()
            .filter_map(|l| {
                IoLinkType::from_raw(l.link_type).map(|link_type| IoLink {
                    link_type,
                    node_to: l.node_to_id,
                })
            })
            .collect();
        if d.gpu_id == 0 {
            return Self::Cpu(CpuNode {
                node_id: d.node_id,
                cpu_cores_count: d.cpu_cores_count,
                io_links,
            });
        }
        Self::Gpu(GpuNode {
            node_id: d.node_id,
            gpu_id: d.gpu_id,
            simd_count: d.simd_count,
            mem_banks_count: d.mem_banks_count,
            caches_count: d.caches_count,
            io_links_count: d.io_links_count,
            max_waves_per_simd: d.max_waves_per_simd,
            lds_size_in_kb: d.lds_size_in_kb,
            num_gws: d.num_gws,
            wave_front_size: d.wave_front_size,
            array_count: d.array_count,
            simd_arrays_per_engine: d.simd_arrays_per_engine,
            cu_per_simd_array: d.cu_per_simd_array,
            simd_per_cu: d.simd_per_cu,
            max_slots_scratch_cu: d.max_slots_scratch_cu,
            vendor_id: d.vendor_id,
            device_id: d.device_id,
            domain: d.domain,
            drm_render_minor: d.drm_render_minor,
            hive_id: d.hive_id,
            num_sdma_engines: d.num_sdma_engines,
            num_sdma_xgmi_engines: d.num_sdma_xgmi_engines,
            num_sdma_queues_per_engine: d.num_sdma_queues_per_engine,
            num_cp_queues: d.num_cp_queues,
            fw_version: d.fw_version,
            capability: d.capability,
            sdma_fw_version: d.sdma_fw_version,
            vram_public: d.vram_public != 0,
            vram_size: d.vram_size,
            io_links,
        })
    }
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Why a topology could not be read or built.
#[derive(Debug)]
#[non_exhaustive]
pub enum TopologyError {
    /// A file or directory could not be read.
    Io {
        /// What was being read.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A file or directory exceeds the size or entry limit.
    TooLarge {
        /// The file or directory.
        path: PathBuf,
        /// The limit (bytes for files, entries for directories).
        limit: usize,
    },
    /// A file's content does not have the expected form.
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong, as a sentence fragment.
        detail: String,
    },
    /// A GPU node has no frame-buffer memory bank with a non-zero size.
    NoVram {
        /// The node directory.
        node_dir: PathBuf,
    },
    /// The nodes contradict each other (duplicate ids, a GPU with id 0).
    Inconsistent {
        /// What is wrong.
        detail: String,
    },
}

impl fmt::Display for TopologyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } => write!(f, "cannot read {}: {source}", path.display()),
            Self::TooLarge { path, limit } => {
                write!(f, "{} exceeds the limit of {limit}", path.display())
            }
            Self::Malformed { path, detail } => write!(f, "{}: {detail}", path.display()),
            Self::NoVram { node_dir } => write!(
                f,
                "GPU node {} has no frame-buffer memory bank (heap type 1 or 2) with a non-zero size",
                node_dir.display()
            ),
            Self::Inconsistent { detail } => write!(f, "inconsistent topology: {detail}"),
        }
    }
}

impl Error for TopologyError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> TopologyError + '_ {
    move |source| TopologyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn malformed(path: &Path, detail: String) -> TopologyError {
    TopologyError::Malformed {
        path: path.to_path_buf(),
        detail,
    }
}

// ---------------------------------------------------------------------------
// Topology
// ---------------------------------------------------------------------------

impl Topology {
    /// Builds a topology from nodes, checking that node ids are unique and
    /// that gpu ids are unique and non-zero.
    pub fn from_nodes(nodes: Vec<TopologyNode>) -> Result<Self, TopologyError> {
        let mut node_ids = HashSet::new();
        let mut gpu_ids = HashSet::new();
        for node in &nodes {
            if !node_ids.insert(node.node_id()) {
                return Err(TopologyError::Inconsistent {
                    detail: format!("node id {} appears twice", node.node_id()),
                });
            }
            if let TopologyNode::Gpu(g) = node {
                if g.gpu_id == 0 {
                    return Err(TopologyError::Inconsistent {
                        detail: format!("GPU node {} has gpu id 0", g.node_id),
                    });
                }
                if !gpu_ids.insert(g.gpu_id) {
                    return Err(TopologyError::Inconsistent {
                        detail: format!("gpu id {:#06x} appears twice", g.gpu_id),
                    });
                }
            }
        }
        Ok(Self { nodes })
    }

    /// Parses the KFD topology under `root` (normally [`DEFAULT_SYSFS_ROOT`]).
    ///
    /// Nodes whose directory or `gpu_id` cannot be read are skipped, as
    /// upstream does for GPUs masked by the device cgroup. Any other problem
    /// (an unreadable `properties` file, a malformed line, an oversized file,
    /// a GPU without VRAM) is an error.
    pub fn from_sysfs(root: &Path) -> Result<Self, TopologyError> {
        let nodes_dir = root.join("nodes");
        let mut nodes = Vec::new();
        for (node_id, dir) in numeric_entries(&nodes_dir, false)? {
            match fs::metadata(&dir) {
                Ok(meta) if meta.is_dir() => {}
                Ok(_) => continue,
                Err(e) => {
                    log::info!("skipping KFD node {}: {e}", dir.display());
                    continue;
                }
            }
            let Some(gpu_id) = read_gpu_id(&dir)? else {
                continue;
            };
            nodes.push(parse_node(&dir, node_id, gpu_id)?);
        }
        Self::from_nodes(nodes)
    }

    /// Rebuilds the checkpointed topology from the image's device entries.
    pub fn from_device_entries(entries: &[DeviceEntry]) -> Result<Self, TopologyError> {
        Self::from_nodes(entries.iter().map(TopologyNode::from).collect())
    }

    /// The image entries for this topology, one per node in topology order.
    ///
    /// `image_gpu_id` maps a local (actual) gpu id to the user gpu id KFD
    /// reported for the process. GPUs it returns `None` for were not
    /// reported by KFD (hidden by cgroups or a device list) and are left out
    /// (the C plugin failed the dump instead). Only valid links are
    /// written: links to nodes that are absent or left out are dropped.
    pub fn to_device_entries(
        &self,
        mut image_gpu_id: impl FnMut(u32) -> Option<u32>,
    ) -> Vec<DeviceEntry> {
        let mut kept: Vec<(&TopologyNode, u32)> = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            match node {
                TopologyNode::Cpu(_) => kept.push((node, 0)),
                TopologyNode::Gpu(g) => match image_gpu_id(g.gpu_id) {
                    Some(user) => kept.push((node, user)),
                    None => log::info!(
                        "GPU {:#06x} (node {}) is not used by the process; leaving it out of the image",
                        g.gpu_id,
                        g.node_id
                    ),
                },
            }
        }
        let present: HashSet<u32> = kept.iter().map(|(n, _)| n.node_id()).collect();
        kept.iter()
            .map(|&(node, user)| {
                let mut info = match node {
                    TopologyNode::Cpu(c) => c.to_device_entry(),
                    TopologyNode::Gpu(g) => g.to_device_entry(user),
                };
                info.iolinks.retain(|l| present.contains(&l.node_to_id));
                info
            })
            .collect()
    }

    /// All nodes, in topology order (ascending node id when parsed).
    pub fn nodes(&self) -> &[TopologyNode] {
        &self.nodes
    }

    /// The GPU nodes, in topology order.
    pub fn gpus(&self) -> impl Iterator<Item = &GpuNode> {
        self.nodes.iter().filter_map(TopologyNode::as_gpu)
    }

    /// Number of GPU nodes.
    pub fn gpu_count(&self) -> usize {
        self.gpus().count()
    }

    /// The GPU with this gpu id.
    pub fn gpu_by_id(&self, gpu_id: u32) -> Option<&GpuNode> {
        self.gpus().find(|g| g.gpu_id == gpu_id)
    }

    /// The GPU with this render-node minor.
    pub fn gpu_by_render_minor(&self, minor: u32) -> Option<&GpuNode> {
        self.gpus().find(|g| g.drm_render_minor == minor)
    }

    /// Removes the GPUs for which `keep` returns false (GPUs the restored
    /// task cannot use, e.g. whose render node the container lacks) and
    /// returns their gpu ids. Links to them become invalid, as upstream treats
    /// links to cgroup-masked GPUs.
    pub fn retain_accessible(&mut self, mut keep: impl FnMut(&GpuNode) -> bool) -> Vec<u32> {
        let mut removed = Vec::new();
        self.nodes.retain(|node| match node {
            TopologyNode::Cpu(_) => true,
            TopologyNode::Gpu(g) => {
                let k = keep(g);
                if !k {
                    removed.push(g.gpu_id);
                }
                k
            }
        });
        removed
    }

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

// ---------------------------------------------------------------------------
// sysfs parsing
// ---------------------------------------------------------------------------

fn read_capped(path: &Path, limit: usize) -> Result<Vec<u8>, TopologyError> {
    let file = File::open(path).map_err(io_error(path))?;
    read_capped_from(file, path, limit)
}

fn read_capped_from(file: File, path: &Path, limit: usize) -> Result<Vec<u8>, TopologyError> {
    let mut buf = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    file.take(cap)
        .read_to_end(&mut buf)
        .map_err(io_error(path))?;
    if buf.len() > limit {
        return Err(TopologyError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(buf)
}

fn read_text(path: &Path) -> Result<String, TopologyError> {
    let bytes = read_capped(path, MAX_SYSFS_FILE_BYTES)?;
    String::from_utf8(bytes).map_err(|_| malformed(path, "the file is not valid UTF-8".into()))
}

/// Numeric entries of `dir`, sorted by number. A missing directory gives an
/// empty list when `optional`.
fn numeric_entries(dir: &Path, optional: bool) -> Result<Vec<(u32, PathBuf)>, TopologyError> {
    numeric_entries_capped(dir, optional, MAX_DIR_ENTRIES)
}

fn numeric_entries_capped(
    dir: &Path,
    optional: bool,
    limit: usize,
) -> Result<Vec<(u32, PathBuf)>, TopologyError> {
    let iter = match fs::read_dir(dir) {
        Ok(iter) => iter,
        Err(e) if optional && e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error(dir)(e)),
    };
    let mut out = Vec::new();
    for (seen, entry) in iter.enumerate() {
        if seen >= limit {
            return Err(TopologyError::TooLarge {
                path: dir.to_path_buf(),
                limit,
            });
        }
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(n) = name.parse::<u32>() {
            out.push((n, entry.path()));
        }
    }
    out.sort_unstable_by_key(|(n, _)| *n);
    Ok(out)
}

/// Reads `gpu_id`. `Ok(None)` when it cannot be read (node skipped).
fn read_gpu_id(node_dir: &Path) -> Result<Option<u32>, TopologyError> {
    let path = node_dir.join("gpu_id");
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) => {
            log::info!(
                "skipping KFD node {}: cannot open gpu_id: {e}",
                node_dir.display()
            );
            return Ok(None);
        }
    };
    let bytes = match read_capped_from(file, &path, GPU_ID_FILE_LIMIT) {
        Ok(b) => b,
        Err(TopologyError::Io { source, .. }) => {
            log::info!(
                "skipping KFD node {}: cannot read gpu_id: {source}",
                node_dir.display()
            );
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim_ascii();
    let valid = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    match text.parse::<u32>() {
        Ok(id) if valid => Ok(Some(id)),
        _ => Err(malformed(
            &path,
            format!("gpu_id {text:?} is not a 32-bit decimal number"),
        )),
    }
}

/// Calls `visit(name, value)` for each `name value` line of a properties
/// file; `visit` returns false to stop early. Blank lines are skipped; any
/// other line must be exactly a name (at most 64 characters) and a decimal
/// 64-bit value.
fn for_each_property(
    path: &Path,
    text: &str,
    mut visit: impl FnMut(&str, u64) -> Result<bool, TopologyError>,
) -> Result<(), TopologyError> {
    for (index, line) in text.lines().enumerate() {
        let mut words = line.split_ascii_whitespace();
        let Some(name) = words.next() else { continue };
        let line_no = index + 1;
        let shown: String = line.chars().take(80).collect();
        let (Some(value), None) = (words.next(), words.next()) else {
            return Err(malformed(
                path,
                format!("line {line_no} is not a \"name value\" pair: {shown:?}"),
            ));
        };
        if name.len() > MAX_PROPERTY_NAME_LEN {
            return Err(malformed(
                path,
                format!(
                    "line {line_no} has a property name longer than {MAX_PROPERTY_NAME_LEN} characters"
                ),
            ));
        }
        if !value.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed(
                path,
                format!("line {line_no}: the value of {name} is not a decimal number: {shown:?}"),
            ));
        }
        let value: u64 = value.parse().map_err(|_| {
            malformed(
                path,
                format!("line {line_no}: the value of {name} does not fit in 64 bits"),
            )
        })?;
        if !visit(name, value)? {
            break;
        }
    }
    Ok(())
}

fn narrow(path: &Path, name: &str, value: u64) -> Result<u32, TopologyError> {
    u32::try_from(value).map_err(|_| {
        malformed(
            path,
            format!("the value {value} of {name} does not fit in 32 bits"),
        )
    })
}

fn gpu_field<'a>(g: &'a mut GpuNode, name: &str) -> Option<&'a mut u32> {
    Some(match name {
        "simd_count" => &mut g.simd_count,
        "mem_banks_count" => &mut g.mem_banks_count,
        "caches_count" => &mut g.caches_count,
        "io_links_count" => &mut g.io_links_count,
        "max_waves_per_simd" => &mut g.max_waves_per_simd,
        "lds_size_in_kb" => &mut g.lds_size_in_kb,
        "num_gws" => &mut g.num_gws,
        "wave_front_size" => &mut g.wave_front_size,
        "array_count" => &mut g.array_count,
        "simd_arrays_per_engine" => &mut g.simd_arrays_per_engine,
        "cu_per_simd_array" => &mut g.cu_per_simd_array,
        "simd_per_cu" => &mut g.simd_per_cu,
        "max_slots_scratch_cu" => &mut g.max_slots_scratch_cu,
        "vendor_id" => &mut g.vendor_id,
        "device_id" => &mut g.device_id,
        "domain" => &mut g.domain,
        "drm_render_minor" => &mut g.drm_render_minor,
        "num_sdma_engines" => &mut g.num_sdma_engines,
        "num_sdma_xgmi_engines" => &mut g.num_sdma_xgmi_engines,
        "num_sdma_queues_per_engine" => &mut g.num_sdma_queues_per_engine,
        "num_cp_queues" => &mut g.num_cp_queues,
        "fw_version" => &mut g.fw_version,
        "capability" => &mut g.capability,
        "sdma_fw_version" => &mut g.sdma_fw_version,
        _ => return None,
    })
}

fn parse_node(dir: &Path, node_id: u32, gpu_id: u32) -> Result<TopologyNode, TopologyError> {
    let path = dir.join("properties");
    let text = read_text(&path)?;
    let mut gpu = GpuNode {
        node_id,
        gpu_id,
        ..GpuNode::default()
    };
    let mut cores = 0u32;
    for_each_property(&path, &text, |name, value| {
        if name == "cpu_cores_count" {
            cores = narrow(&path, name, value)?;
        } else if name == "hive_id" {
            gpu.hive_id = value;
        } else if let Some(slot) = gpu_field(&mut gpu, name) {
            *slot = narrow(&path, name, value)?;
        }
        // A CPU node needs nothing past its core count (as upstream).
        Ok(!(gpu_id == 0 && cores >= 1))
    })?;
    let io_links = parse_io_links(dir)?;
    if gpu_id == 0 {
        return Ok(TopologyNode::Cpu(CpuNode {
            node_id,
            cpu_cores_count: cores,
            io_links,
        }));
    }
    let (vram_public, vram_size) = parse_vram(dir)?;
    gpu.vram_public = vram_public;
    gpu.vram_size = vram_size;
    gpu.io_links = io_links;
    Ok(TopologyNode::Gpu(gpu))
}

/// The first frame-buffer bank: (public, size).
fn parse_vram(dir: &Path) -> Result<(bool, u64), TopologyError> {
    for (_, bank) in numeric_entries(&dir.join("mem_banks"), false)? {
        if !bank.is_dir() {
            continue;
        }
        let path = bank.join("properties");
        let text = read_text(&path)?;
        let mut heap_type = 0u32;
        let mut size = 0u64;
        for_each_property(&path, &text, |name, value| {
            match name {
                "heap_type" => heap_type = narrow(&path, name, value)?,
                "size_in_bytes" => size = value,
                _ => {}
            }
            Ok(true)
        })?;
        if heap_type == HEAP_TYPE_FB_PUBLIC || heap_type == HEAP_TYPE_FB_PRIVATE {
            if size == 0 {
                break;
            }
            return Ok((heap_type == HEAP_TYPE_FB_PUBLIC, size));
        }
    }
    Err(TopologyError::NoVram {
        node_dir: dir.to_path_buf(),
    })
}

fn parse_io_links(dir: &Path) -> Result<Vec<IoLink>, TopologyError> {
    let mut links = Vec::new();
    for (_, link_dir) in numeric_entries(&dir.join("io_links"), true)? {
        if !link_dir.is_dir() {
            continue;
        }
        let path = link_dir.join("properties");
        let text = read_text(&path)?;
        let mut raw_type = 0u32;
        let mut node_to = None;
        for_each_property(&path, &text, |name, value| {
            match name {
                "type" => raw_type = narrow(&path, name, value)?,
                "node_to" => node_to = Some(narrow(&path, name, value)?),
                _ => {}
            }
            Ok(true)
        })?;
        let Some(link_type) = IoLinkType::from_raw(raw_type) else {
            continue;
        };
        let Some(node_to) = node_to else {
            return Err(malformed(&path, "the link has no node_to property".into()));
        };
        links.push(IoLink { link_type, node_to });
    }
    Ok(links)
}

// ---------------------------------------------------------------------------
// Render nodes
// ---------------------------------------------------------------------------

/// `/dev/dri/renderD<minor>`, or `None` when `minor` is outside 128..=255.
pub fn render_node_path(minor: u32) -> Option<PathBuf> {
    (RENDER_MINOR_FIRST..=RENDER_MINOR_LAST)
        .contains(&minor)
        .then(|| PathBuf::from(format!("/dev/dri/renderD{minor}")))
}

/// The render minors that have a `renderD<minor>` entry in `dev_dri`
/// (normally `/dev/dri`). In a container this is the device list the runtime
/// exposed; use it with [`Topology::retain_accessible`].
pub fn present_render_minors(dev_dri: &Path) -> io::Result<BTreeSet<u32>> {
    let mut minors = BTreeSet::new();
    for (seen, entry) in fs::read_dir(dev_dri)?.enumerate() {
        if seen >= MAX_DIR_ENTRIES {
            break;
        }
        let name = entry?.file_name();
        let Some(digits) = name.to_str().and_then(|n| n.strip_prefix("renderD")) else {
            continue;
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(minor) = digits.parse::<u32>() {
            if (RENDER_MINOR_FIRST..=RENDER_MINOR_LAST).contains(&minor) {
                minors.insert(minor);
            }
        }
    }
    Ok(minors)
}

// ---------------------------------------------------------------------------
// Compatibility switches
// ---------------------------------------------------------------------------

/// The seven `KFD_*_CHECK` switches. All default to on, as upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompatChecks {
    /// `KFD_FW_VER_CHECK`: checkpoint `fw_version` <= restore.
    pub fw_version: bool,
    /// `KFD_SDMA_FW_VER_CHECK`: checkpoint `sdma_fw_version` <= restore.
    pub sdma_fw_version: bool,
    /// `KFD_CACHES_COUNT_CHECK`: checkpoint `caches_count` <= restore.
    pub caches_count: bool,
    /// `KFD_NUM_GWS_CHECK`: checkpoint `num_gws` <= restore.
    pub num_gws: bool,
    /// `KFD_VRAM_SIZE_CHECK`: checkpoint `vram_size` <= restore.
    pub vram_size: bool,
    /// `KFD_NUMA_CHECK`: keep the GPU-to-CPU (NUMA) affinity consistent.
    pub numa: bool,
    /// `KFD_CAPABILITY_CHECK`: `capability` equal.
    pub capability: bool,
}

impl Default for CompatChecks {
    fn default() -> Self {
        Self {
            fw_version: true,
            sdma_fw_version: true,
            caches_count: true,
            num_gws: true,
            vram_size: true,
            numa: true,
            capability: true,
        }
    }
}

impl CompatChecks {
    /// Names of the environment variables, in the order upstream reads them.
    pub const ENV_VARS: [&'static str; 7] = [
        "KFD_FW_VER_CHECK",
        "KFD_SDMA_FW_VER_CHECK",
        "KFD_CACHES_COUNT_CHECK",
        "KFD_NUM_GWS_CHECK",
        "KFD_VRAM_SIZE_CHECK",
        "KFD_NUMA_CHECK",
        "KFD_CAPABILITY_CHECK",
    ];

    /// Reads the switches through `lookup` (an environment lookup). `"0"` or
    /// `NO` (any case) turns a check off, `"1"` or `YES` turns it on; any
    /// other value is logged and ignored, keeping the default.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let mut checks = Self::default();
        let slots: [&mut bool; 7] = [
            &mut checks.fw_version,
            &mut checks.sdma_fw_version,
            &mut checks.caches_count,
            &mut checks.num_gws,
            &mut checks.vram_size,
            &mut checks.numa,
            &mut checks.capability,
        ];
        for (name, slot) in Self::ENV_VARS.into_iter().zip(slots) {
            if let Some(value) = lookup(name) {
                if value == "0" || value.eq_ignore_ascii_case("NO") {
                    *slot = false;
                } else if value == "1" || value.eq_ignore_ascii_case("YES") {
                    *slot = true;
                } else {
                    log::error!("ignoring invalid value for {name}={value:?}, expecting YES or NO");
                }
            }
            log::debug!("param: {name}:{}", if *slot { "Y" } else { "N" });
        }
        checks
    }

    /// [`CompatChecks::from_env`] on the process environment.
    pub fn from_process_env() -> Self {
        Self::from_env(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }
}

// ---------------------------------------------------------------------------
// Mapping result and errors
// ---------------------------------------------------------------------------

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

/// `device_properties_match`: the first property that rules `d` out for `s`.
fn property_mismatch(s: &GpuNode, d: &GpuNode, checks: &CompatChecks) -> Option<String> {
    let exact: [(&str, u64, u64); 18] = [
        ("simd_count", s.simd_count.into(), d.simd_count.into()),
        (
            "mem_banks_count",
            s.mem_banks_count.into(),
            d.mem_banks_count.into(),
        ),
        (
            "io_links_count",
            s.io_links_count.into(),
            d.io_links_count.into(),
        ),
        (
            "max_waves_per_simd",
            s.max_waves_per_simd.into(),
            d.max_waves_per_simd.into(),
        ),
        (
            "lds_size_in_kb",
            s.lds_size_in_kb.into(),
            d.lds_size_in_kb.into(),
        ),
        (
            "wave_front_size",
            s.wave_front_size.into(),
            d.wave_front_size.into(),
        ),
        ("array_count", s.array_count.into(), d.array_count.into()),
        (
            "simd_arrays_per_engine",
            s.simd_arrays_per_engine.into(),
            d.simd_arrays_per_engine.into(),
        ),
        (
            "cu_per_simd_array",
            s.cu_per_simd_array.into(),
            d.cu_per_simd_array.into(),
        ),
        ("simd_per_cu", s.simd_per_cu.into(), d.simd_per_cu.into()),
        (
            "max_slots_scratch_cu",
            s.max_slots_scratch_cu.into(),
            d.max_slots_scratch_cu.into(),
        ),
        ("vendor_id", s.vendor_id.into(), d.vendor_id.into()),
        ("device_id", s.device_id.into(), d.device_id.into()),
        (
            "num_sdma_engines",
            s.num_sdma_engines.into(),
            d.num_sdma_engines.into(),
        ),
        (
            "num_sdma_xgmi_engines",
            s.num_sdma_xgmi_engines.into(),
            d.num_sdma_xgmi_engines.into(),
        ),
        (
            "num_sdma_queues_per_engine",
            s.num_sdma_queues_per_engine.into(),
            d.num_sdma_queues_per_engine.into(),
        ),
        (
            "num_cp_queues",
            s.num_cp_queues.into(),
            d.num_cp_queues.into(),
        ),
        ("vram_public", s.vram_public.into(), d.vram_public.into()),
    ];
    for (name, a, b) in exact {
        if a != b {
            return Some(format!("has {name} {b}, the checkpoint needs {a}"));
        }
    }
    if checks.capability && s.capability != d.capability {
        return Some(format!(
            "has capability {:#x}, the checkpoint needs {:#x} (KFD_CAPABILITY_CHECK)",
            d.capability, s.capability
        ));
    }
    let at_least: [(bool, &str, &str, u64, u64); 5] = [
        (
            checks.vram_size,
            "vram_size",
            "KFD_VRAM_SIZE_CHECK",
            s.vram_size,
            d.vram_size,
        ),
        (
            checks.num_gws,
            "num_gws",
            "KFD_NUM_GWS_CHECK",
            s.num_gws.into(),
            d.num_gws.into(),
        ),
        (
            checks.caches_count,
            "caches_count",
            "KFD_CACHES_COUNT_CHECK",
            s.caches_count.into(),
            d.caches_count.into(),
        ),
        (
            checks.fw_version,
            "fw_version",
            "KFD_FW_VER_CHECK",
            s.fw_version.into(),
            d.fw_version.into(),
        ),
        (
            checks.sdma_fw_version,
            "sdma_fw_version",
            "KFD_SDMA_FW_VER_CHECK",
            s.sdma_fw_version.into(),
            d.sdma_fw_version.into(),
        ),
    ];
    for (on, name, var, a, b) in at_least {
        if on && a > b {
            return Some(format!(
                "has {name} {b}, the checkpoint needs at least {a} ({var})"
            ));
        }
    }
    None
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

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

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
        for i in 0..4u32 {
            t.gpu(i + 2, base + i, dev[0]);
            t.link(i + 2, PCIE, i & 1);
            t.link(i & 1, PCIE, i + 2);
        }
        for i in 0..4u32 {
            for j in 1..4 {
                t.link(i + 2, XGMI, (i + j) % 4 + 2);
            }
            for j in 4..8 {
                let to = (i + j) % 4 + 6;
                if !partial || to < 8 {
                    t.link(i + 2, PCIE, to);
                }
            }
        }
        for i in 4..8u32 {
            t.gpu(i + 2, base + 0x10 + i, dev[1]);
            t.link(i + 2, PCIE, i & 1);
            if !partial || i < 6 {
                t.link(i & 1, PCIE, i + 2);
            }
        }
        for i in 4..8u32 {
            for j in 1..4 {
                t.link(i + 2, XGMI, (i + j) % 4 + 6);
            }
            for j in 4..8 {
                t.link(i + 2, PCIE, (i + j) % 4 + 2);
            }
        }
        t.build()
    }

    /// Tests 3 and 4: two hives (device ids D000, D001), GPU-to-CPU links
    /// everywhere, CPU back-links only to `back[0]` (CPU 0) and `back[1]`.
    fn hives_one_cpu_backlink(base: u32, back: [u32; 2]) -> Topology {
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for i in 0..4u32 {
            t.gpu(i + 2, base + i, 0xD000);
            t.link(i + 2, PCIE, i & 1);
        }
        for i in 0..4u32 {
            for j in 1..4 {
                t.link(i + 2, XGMI, (i + j) % 4 + 2);
            }
        }
        for i in 4..8u32 {
            t.gpu(i + 2, base + 0x10 + i, 0xD001);
            t.link(i + 2, PCIE, i & 1);
        }
        for i in 4..8u32 {
            for j in 1..4 {
                t.link(i + 2, XGMI, (i + j) % 4 + 6);
            }
        }
        t.link(0, PCIE, back[0]);
        t.link(1, PCIE, back[1]);
        t.build()
    }

    /// Test 5: one hive of 4 plus 4 GPUs joined by PCIe only, full P2P.
    fn one_hive_four_pcie(base: u32) -> Topology {
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for i in 0..4u32 {
            t.gpu(i + 2, base + i, 0xD000);
            t.link(i + 2, PCIE, i & 1);
            t.link(i & 1, PCIE, i + 2);
        }
        for i in 0..4u32 {
            for j in 1..4 {
                t.link(i + 2, XGMI, (i + j) % 4 + 2);
            }
            for j in 4..8 {
                t.link(i + 2, PCIE, (i + j) % 4 + 6);
            }
        }
        for i in 4..8u32 {
            t.gpu(i + 2, base + 0x10 + i, 0xD000);
            t.link(i + 2, PCIE, i & 1);
            t.link(i & 1, PCIE, i + 2);
        }
        for i in 4..8u32 {
            for j in 1..4 {
                t.link(i + 2, PCIE, (i + j) % 4 + 6);
            }
            for j in 4..8 {
                t.link(i + 2, PCIE, (i + j) % 4 + 2);
            }
        }
        t.build()
    }

    /// Tests 6 and 8: 5 GPUs behind one CPU, no hive; P2P-PCIe links to the
    /// GPU nodes below `limit`.
    fn five_gpus(base: u32, devs: [u32; 5], limit: u32) -> Topology {
        let mut t = Tb::default();
        t.cpu(0);
        for i in 0..5u32 {
            t.gpu(i + 1, base + i, devs[i as usize]);
            t.link(i + 1, PCIE, 0);
            t.link(0, PCIE, i + 1);
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
        for i in 0..4u32 {
            t.gpu(i + 2, base + i, 0xD000);
            t.link(i + 2, PCIE, i & 1);
        }
        for i in 0..4u32 {
            for j in 1..4 {
                t.link(i + 2, XGMI, (i + j) % 4 + 2);
            }
        }
        for i in 4..8u32 {
            t.gpu(i + 2, base + 0x10 + i, 0xD000);
        }
        if second_hive {
            for i in 4..8u32 {
                for j in 1..4 {
                    t.link(i + 2, XGMI, (i + j) % 4 + 6);
                }
            }
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

    // ----- the nine cases of tests/test_topology_remap.c -------------------

    #[test]
    fn remap_test0_two_hives_device_ids_swapped() {
        let src = two_hives(0xA000, [0xD000, 0xD001], false);
        let dst = two_hives(0xB000, [0xD001, 0xD000], false);
        let map = expect_map(
            &src,
            &dst,
            &[
                (0xA000, 0xB014),
                (0xA001, 0xB015),
                (0xA002, 0xB016),
                (0xA003, 0xB017),
                (0xA014, 0xB000),
                (0xA015, 0xB001),
                (0xA016, 0xB002),
                (0xA017, 0xB003),
            ],
        );
        assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
    }

    #[test]
    fn remap_test1_partial_p2p_identity() {
        let src = two_hives(0xA000, [0xD000, 0xD000], true);
        let dst = two_hives(0xB000, [0xD000, 0xD000], true);
        let map = expect_map(&src, &dst, &identity_pairs(4, true));
        assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
    }

    #[test]
    fn remap_test2_hives_cannot_cross() {
        let src = two_hives(0xA000, [0xD000, 0xD001], true);
        let dst = two_hives(0xB000, [0xD001, 0xD000], true);
        let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
        assert!(
            matches!(
                err,
                MapError::HiveNotPlaceable { .. } | MapError::NoCompatibleGpu { .. }
            ),
            "{err}"
        );
    }

    #[test]
    fn remap_test3_single_bidirectional_cpu_link_per_hive() {
        let src = hives_one_cpu_backlink(0xA000, [4, 9]);
        let dst = hives_one_cpu_backlink(0xB000, [2, 7]);
        let map = expect_map(
            &src,
            &dst,
            &[
                (0xA000, 0xB002),
                (0xA001, 0xB001),
                (0xA002, 0xB000),
                (0xA003, 0xB003),
                (0xA014, 0xB014),
                (0xA015, 0xB017),
                (0xA016, 0xB016),
                (0xA017, 0xB015),
            ],
        );
        assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
    }

    #[test]
    fn remap_test4_cpu_link_moved_fails() {
        let src = hives_one_cpu_backlink(0xA000, [4, 9]);
        let dst = hives_one_cpu_backlink(0xB000, [2, 6]);
        let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
        assert!(err.to_string().contains("0xa017"), "{err}");
    }

    #[test]
    fn remap_test5_one_hive_plus_pcie_identity() {
        let src = one_hive_four_pcie(0xA000);
        let dst = one_hive_four_pcie(0xB000);
        let map = expect_map(&src, &dst, &identity_pairs(4, true));
        assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
    }

    #[test]
    fn remap_test6_five_gpus_mixed_device_ids() {
        let src = five_gpus(0xA000, [0xD000, 0xD000, 0xD001, 0xD000, 0xD001], 5);
        let dst = five_gpus(0xB000, [0xD000, 0xD001, 0xD000, 0xD000, 0xD001], 5);
        let map = expect_map(
            &src,
            &dst,
            &[
                (0xA000, 0xB000),
                (0xA001, 0xB002),
                (0xA002, 0xB001),
                (0xA003, 0xB003),
                (0xA004, 0xB004),
            ],
        );
        assert_eq!(map.cpu_mappings(), &[(0, 0)]);
    }

    #[test]
    fn remap_test7_restore_has_extra_hive() {
        let src = hive_plus_four(0xA000, false);
        let dst = hive_plus_four(0xB000, true);
        let map = expect_map(&src, &dst, &identity_pairs(4, true));
        assert_eq!(map.cpu_mappings(), &[(0, 0), (1, 1)]);
    }

    #[test]
    fn remap_test8_restore_has_more_p2p_links() {
        let devs = [0xD000; 5];
        let src = five_gpus(0xA000, devs, 4);
        let dst = five_gpus(0xB000, devs, 5);
        let map = expect_map(&src, &dst, &identity_pairs(5, false));
        assert_eq!(map.cpu_mappings(), &[(0, 0)]);
    }

    // ----- hives -------------------------------------------------------------

    #[test]
    fn hives_are_detected_in_link_order() {
        let t = two_hives(0xA000, [0xD000, 0xD001], false);
        assert_eq!(
            t.xgmi_hives(),
            vec![
                vec![0xA000, 0xA001, 0xA002, 0xA003],
                vec![0xA014, 0xA015, 0xA016, 0xA017]
            ]
        );
        // One-way XGMI links do not make a hive.
        let mut t = Tb::default();
        t.gpu(1, 0x10, 1);
        t.gpu(2, 0x20, 1);
        t.link(1, XGMI, 2);
        assert!(t.build().xgmi_hives().is_empty());
    }

    #[test]
    fn hives_touching_through_a_partial_mesh_merge() {
        let mut t = Tb::default();
        for i in 1..=4 {
            t.gpu(i, 0x100 + i, 1);
        }
        for (a, b) in [(1, 2), (3, 4), (2, 3)] {
            t.link(a, XGMI, b);
            t.link(b, XGMI, a);
        }
        let hives = t.build().xgmi_hives();
        assert_eq!(hives.len(), 1);
        let mut members = hives[0].clone();
        members.sort_unstable();
        assert_eq!(members, vec![0x101, 0x102, 0x103, 0x104]);
    }

    /// 8 GPUs in two hives of 4, with a chosen device id per hive and a
    /// chosen order of the hives' node ids.
    fn eight_in_two_hives(base: u32, hive_nodes: [[u32; 4]; 2], dev: [u32; 2]) -> Topology {
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for (h, nodes) in hive_nodes.iter().enumerate() {
            for &n in nodes {
                t.gpu(n, base + n, dev[h]);
                let cpu = u32::try_from(h).expect("small");
                t.link(n, PCIE, cpu);
                t.link(cpu, PCIE, n);
            }
        }
        for nodes in &hive_nodes {
            for &a in nodes {
                for &b in nodes {
                    if a != b {
                        t.link(a, XGMI, b);
                    }
                }
            }
        }
        // Nodes must be listed in id order like a parsed topology.
        t.nodes.sort_by_key(TopologyNode::node_id);
        t.build()
    }

    fn hive_of(t: &Topology, gpu_id: u32) -> usize {
        t.xgmi_hives()
            .iter()
            .position(|h| h.contains(&gpu_id))
            .expect("GPU in a hive")
    }

    #[test]
    fn eight_gpus_two_hives_stay_together() {
        let src = eight_in_two_hives(0xA000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD000, 0xD000]);
        // Restore host: hives interleaved over the node ids.
        let dst = eight_in_two_hives(0xB000, [[2, 4, 6, 8], [3, 5, 7, 9]], [0xD000, 0xD000]);
        let map = map_gpus(&src, &dst, &CompatChecks::default()).expect("maps");
        assert_eq!(map.len(), 8);
        for hive in src.xgmi_hives() {
            let targets: BTreeSet<usize> = hive
                .iter()
                .map(|&g| hive_of(&dst, map.restore_gpu_id(g).unwrap()))
                .collect();
            assert_eq!(targets.len(), 1, "hive {hive:x?} was split");
        }
        let restored: BTreeSet<u32> = map.iter().map(|m| m.restore_gpu_id).collect();
        assert_eq!(restored.len(), 8, "one-to-one");
    }

    #[test]
    fn eight_gpus_hive_device_ids_force_a_cross_mapping() {
        let src = eight_in_two_hives(0xA000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD000, 0xD001]);
        let dst = eight_in_two_hives(0xB000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD001, 0xD000]);
        // NUMA: checkpoint hive 0 sits on CPU 0, the matching restore hive on
        // CPU 1; the CPU mapping follows.
        let map = map_gpus(&src, &dst, &CompatChecks::default()).expect("maps");
        for n in 2..6 {
            assert!((0xB006..=0xB009).contains(&map.restore_gpu_id(0xA000 + n).unwrap()));
        }
        assert_eq!(map.cpu_mappings(), &[(0, 1), (1, 0)]);
    }

    #[test]
    fn split_restore_hive_fails_with_named_hive() {
        let src = eight_in_two_hives(0xA000, [[2, 3, 4, 5], [6, 7, 8, 9]], [0xD000, 0xD000]);
        // Restore host: the second hive is split into two pairs, so it has
        // three hives (4 + 2 + 2) and the second checkpoint hive fits nowhere.
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for n in 2..10u32 {
            let cpu = u32::from(n >= 6);
            t.gpu(n, 0xB000 + n, 0xD000);
            t.link(n, PCIE, cpu);
            t.link(cpu, PCIE, n);
        }
        let groups: [&[u32]; 3] = [&[2, 3, 4, 5], &[6, 7], &[8, 9]];
        for g in groups {
            for &a in g {
                for &b in g {
                    if a != b {
                        t.link(a, XGMI, b);
                    }
                }
            }
        }
        // Keep the raw link count equal to the checkpoint's (it is compared
        // exactly) by adding PCIe links inside the split pairs.
        for (a, b) in [(6, 8), (6, 9), (7, 8), (7, 9)] {
            t.link(a, PCIE, b);
            t.link(b, PCIE, a);
        }
        let dst = t.build();
        assert_eq!(dst.xgmi_hives().len(), 3);
        let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
        assert_eq!(
            err,
            MapError::HiveNotPlaceable {
                hive: vec![0xA006, 0xA007, 0xA008, 0xA009]
            }
        );
        assert!(
            err.to_string().contains("0xa006, 0xa007, 0xa008, 0xa009"),
            "{err}"
        );

        // Restore host: one hive of 4 and 4 loose GPUs.
        let mut t = Tb::default();
        t.cpu(0);
        t.cpu(1);
        for n in 2..10u32 {
            let cpu = u32::from(n >= 6);
            t.gpu(n, 0xB000 + n, 0xD000);
            t.link(n, PCIE, cpu);
            t.link(cpu, PCIE, n);
        }
        for a in 2..6 {
            for b in 2..6 {
                if a != b {
                    t.link(a, XGMI, b);
                }
            }
        }
        let err = map_gpus(&src, &t.build(), &CompatChecks::default()).unwrap_err();
        assert!(matches!(err, MapError::HiveCountMismatch { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("2 XGMI hives but this host has only 1"),
            "{err}"
        );
    }

    #[test]
    fn backtracks_across_hives_where_the_c_search_could_not() {
        // Checkpoint hive {2,3} has 16 GiB GPUs, hive {4,5} 32 GiB GPUs.
        // Restore hive {2,3} has 32 GiB GPUs, hive {4,5} 16 GiB GPUs. The
        // first checkpoint hive fits the first restore hive (16 <= 32), which
        // leaves the second nowhere to go; it must move to the second restore
        // hive. Upstream kept the stale maps of the first try and failed.
        let build = |base: u32, small_first: bool| {
            let mut t = Tb::default();
            t.cpu(0);
            for n in 2..6u32 {
                t.gpu(n, base + n, 0xD000);
                t.link(n, PCIE, 0);
                t.link(0, PCIE, n);
            }
            for node in &mut t.nodes {
                if let TopologyNode::Gpu(g) = node {
                    let small = (g.node_id < 4) == small_first;
                    g.vram_size = if small { 16 << 30 } else { 32 << 30 };
                }
            }
            for (a, b) in [(2, 3), (4, 5)] {
                t.link(a, XGMI, b);
                t.link(b, XGMI, a);
            }
            t.build()
        };
        let (src, dst) = (build(0xA000, true), build(0xB000, false));
        let map = expect_map(
            &src,
            &dst,
            &[
                (0xA002, 0xB004),
                (0xA003, 0xB005),
                (0xA004, 0xB002),
                (0xA005, 0xB003),
            ],
        );
        assert_eq!(map.cpu_mappings(), &[(0, 0)]);
        // With the size check off the first restore hive is kept.
        let off = CompatChecks {
            vram_size: false,
            ..CompatChecks::default()
        };
        let map = map_gpus(&src, &dst, &off).unwrap();
        assert_eq!(map.restore_gpu_id(0xA002), Some(0xB002));
    }

    // ----- compatibility switches ---------------------------------------------

    fn single(gpu: GpuNode) -> Topology {
        let node_id = gpu.node_id;
        let mut t = Tb::default();
        t.cpu(0);
        t.nodes.push(TopologyNode::Gpu(gpu));
        t.link(node_id, PCIE, 0);
        t.link(0, PCIE, node_id);
        t.build()
    }

    fn base_gpu(gpu_id: u32) -> GpuNode {
        GpuNode {
            node_id: 1,
            gpu_id,
            simd_count: 416,
            mem_banks_count: 1,
            caches_count: 273,
            io_links_count: 1,
            vendor_id: 0x1002,
            device_id: 0x740f,
            fw_version: 78,
            sdma_fw_version: 8,
            num_gws: 64,
            capability: 0x2c83_2080,
            vram_public: true,
            vram_size: 64 << 30,
            drm_render_minor: 128,
            ..GpuNode::default()
        }
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            owned
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn firmware_mismatch_with_check_on_and_off() {
        let src = single(GpuNode {
            fw_version: 80,
            ..base_gpu(0xA000)
        });
        let dst = single(base_gpu(0xB000));
        let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                MapError::NoCompatibleGpu {
                    checkpoint_gpu_id: 0xA000,
                    ..
                }
            ),
            "{text}"
        );
        assert!(
            text.contains("fw_version 78") && text.contains("KFD_FW_VER_CHECK"),
            "{text}"
        );

        let off = CompatChecks::from_env(env(&[("KFD_FW_VER_CHECK", "no")]));
        assert!(!off.fw_version);
        let map = map_gpus(&src, &dst, &off).expect("maps with the check off");
        assert_eq!(map.restore_gpu_id(0xA000), Some(0xB000));
        // An older checkpoint firmware is always fine.
        let older = single(GpuNode {
            fw_version: 10,
            ..base_gpu(0xA000)
        });
        assert!(map_gpus(&older, &dst, &CompatChecks::default()).is_ok());
    }

    #[test]
    fn each_switch_governs_its_property() {
        type Tweak = fn(&mut GpuNode);
        let cases: [(&str, Tweak); 6] = [
            ("KFD_FW_VER_CHECK", |g| g.fw_version += 1),
            ("KFD_SDMA_FW_VER_CHECK", |g| g.sdma_fw_version += 1),
            ("KFD_CACHES_COUNT_CHECK", |g| g.caches_count += 1),
            ("KFD_NUM_GWS_CHECK", |g| g.num_gws += 1),
            ("KFD_VRAM_SIZE_CHECK", |g| g.vram_size += 1),
            ("KFD_CAPABILITY_CHECK", |g| g.capability ^= 1),
        ];
        let dst = single(base_gpu(0xB000));
        for (var, tweak) in cases {
            let mut g = base_gpu(0xA000);
            tweak(&mut g);
            let src = single(g);
            let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
            assert!(err.to_string().contains(var), "{var}: {err}");
            let off = CompatChecks::from_env(env(&[(var, "0")]));
            assert!(map_gpus(&src, &dst, &off).is_ok(), "{var} off");
        }
        // A property outside the switches always has to match.
        let src = single(GpuNode {
            device_id: 0x7408,
            ..base_gpu(0xA000)
        });
        let all_off = CompatChecks::from_env(env(&CompatChecks::ENV_VARS.map(|v| (v, "NO"))));
        let err = map_gpus(&src, &dst, &all_off).unwrap_err();
        assert!(err.to_string().contains("device_id"), "{err}");
    }

    #[test]
    fn numa_switch() {
        // Checkpoint: both GPUs on CPU 0. Restore: one GPU per CPU.
        let build = |base: u32, cpus: [u32; 2]| {
            let mut t = Tb::default();
            t.cpu(0);
            t.cpu(1);
            for (i, cpu) in cpus.into_iter().enumerate() {
                let n = u32::try_from(i).unwrap() + 2;
                t.gpu(n, base + n, 0xD000);
                t.link(n, PCIE, cpu);
                t.link(cpu, PCIE, n);
            }
            t.build()
        };
        let src = build(0xA000, [0, 0]);
        let dst = build(0xB000, [0, 1]);
        let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
        assert!(matches!(err, MapError::NoConsistentMapping { .. }), "{err}");
        let off = CompatChecks::from_env(env(&[("KFD_NUMA_CHECK", "No")]));
        let map = map_gpus(&src, &dst, &off).expect("maps without NUMA check");
        assert_eq!(map.len(), 2);
        assert!(map.cpu_mappings().is_empty());
    }

    #[test]
    fn env_parsing_matches_upstream() {
        assert_eq!(CompatChecks::from_env(|_| None), CompatChecks::default());
        for (value, want) in [
            ("0", false),
            ("no", false),
            ("NO", false),
            ("nO", false),
            ("1", true),
            ("yes", true),
        ] {
            let c = CompatChecks::from_env(env(&[("KFD_NUMA_CHECK", value)]));
            assert_eq!(c.numa, want, "{value}");
        }
        // Invalid values keep the default (on).
        for value in ["", "false", "off", " 0", "2", "y"] {
            let c = CompatChecks::from_env(env(&[("KFD_VRAM_SIZE_CHECK", value)]));
            assert!(c.vram_size, "{value:?}");
        }
        let c = CompatChecks::from_env(env(&[
            ("KFD_FW_VER_CHECK", "0"),
            ("KFD_SDMA_FW_VER_CHECK", "0"),
            ("KFD_CACHES_COUNT_CHECK", "0"),
            ("KFD_NUM_GWS_CHECK", "0"),
            ("KFD_VRAM_SIZE_CHECK", "0"),
            ("KFD_NUMA_CHECK", "0"),
            ("KFD_CAPABILITY_CHECK", "0"),
        ]));
        assert_eq!(
            c,
            CompatChecks {
                fw_version: false,
                sdma_fw_version: false,
                caches_count: false,
                num_gws: false,
                vram_size: false,
                numa: false,
                capability: false,
            }
        );
    }

    // ----- counts ----------------------------------------------------------------

    #[test]
    fn too_few_gpus_names_what_is_missing() {
        let src = five_gpus(0xA000, [0xD000; 5], 0);
        let mut dst = five_gpus(0xB000, [0xD000; 5], 0);
        dst.retain_accessible(|g| g.gpu_id < 0xB002);
        let err = map_gpus(&src, &dst, &CompatChecks::default()).unwrap_err();
        assert_eq!(
            err,
            MapError::GpuCountMismatch {
                checkpoint: vec![0xA000, 0xA001, 0xA002, 0xA003, 0xA004],
                restore: vec![0xB000, 0xB001],
            }
        );
        let text = err.to_string();
        assert!(text.contains("used 5 GPUs"), "{text}");
        assert!(
            text.contains("0xa000, 0xa001, 0xa002, 0xa003, 0xa004"),
            "{text}"
        );
        assert!(text.contains("only 2 usable GPUs"), "{text}");
        assert!(text.contains("3 missing"), "{text}");

        let err = map_gpus(&dst, &src, &CompatChecks::default()).unwrap_err();
        assert!(err.to_string().contains("hide the extra GPUs"), "{err}");
    }

    #[test]
    fn no_gpus_on_either_side_is_an_empty_map() {
        let mut t = Tb::default();
        t.cpu(0);
        let t = t.build();
        let map = map_gpus(&t, &t, &CompatChecks::default()).expect("trivially maps");
        assert!(map.is_empty());
    }

    #[test]
    fn search_stays_bounded_on_many_identical_gpus() {
        // 16 identical GPUs with no way to satisfy NUMA: every checkpoint GPU
        // sits on CPU 0 but restore GPUs are spread over 2 CPUs.
        let build = |base: u32, spread: bool| {
            let mut t = Tb::default();
            t.cpu(0);
            t.cpu(1);
            for n in 2..18u32 {
                let cpu = if spread { n & 1 } else { 0 };
                t.gpu(n, base + n, 0xD000);
                t.link(n, PCIE, cpu);
                t.link(cpu, PCIE, n);
            }
            t.build()
        };
        let err = map_gpus(
            &build(0xA000, false),
            &build(0xB000, true),
            &CompatChecks::default(),
        )
        .unwrap_err();
        assert!(matches!(err, MapError::NoConsistentMapping { .. }), "{err}");
    }

    // ----- container device lists ------------------------------------------------

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/kfd-topology")
            .join(name)
    }

    fn identity_image(t: &Topology) -> Topology {
        Topology::from_device_entries(&t.to_device_entries(Some)).expect("image round trip")
    }

    #[test]
    fn gpus_hidden_by_container_device_list() {
        let host = Topology::from_sysfs(&fixture("8gpu-2hives")).expect("fixture parses");
        // The checkpoint ran in a container that saw the first hive only.
        let mut ckpt_host = host.clone();
        let visible: BTreeSet<u32> = (128..132).collect();
        let hidden = ckpt_host.retain_accessible(|g| visible.contains(&g.drm_render_minor));
        assert_eq!(hidden, vec![10086, 30511, 47612, 63009]);
        let ckpt = identity_image(&ckpt_host);
        assert_eq!(ckpt.gpu_count(), 4);
        assert_eq!(ckpt.xgmi_hives().len(), 1);
        // The CPU node 1 links to hidden GPUs only: those links are gone.
        let cpu1 = ckpt.nodes().iter().find(|n| n.node_id() == 1).unwrap();
        assert!(cpu1.io_links().is_empty());

        // Restore in a container exposing the *other* hive's render nodes.
        let mut restore = host.clone();
        let visible: BTreeSet<u32> = (132..136).collect();
        restore.retain_accessible(|g| visible.contains(&g.drm_render_minor));
        let map = map_gpus(&ckpt, &restore, &CompatChecks::default()).expect("maps");
        for m in &map {
            assert!(visible.contains(&m.restore_render_minor), "{m:?}");
            assert_eq!(
                map.get_by_checkpoint_render_minor(m.checkpoint_render_minor),
                Some(m)
            );
        }
        assert_eq!(
            map.get(7740)
                .map(|m| (m.restore_gpu_id, m.restore_render_minor)),
            Some((10086, 132))
        );
        assert_eq!(map.cpu_mappings(), &[(0, 1)]);

        // Without the device-list filter the restore host shows 8 GPUs.
        let err = map_gpus(&ckpt, &host, &CompatChecks::default()).unwrap_err();
        assert!(matches!(err, MapError::GpuCountMismatch { .. }), "{err}");
    }

    #[test]
    fn render_minor_helpers() {
        assert_eq!(
            render_node_path(128),
            Some(PathBuf::from("/dev/dri/renderD128"))
        );
        assert_eq!(
            render_node_path(255),
            Some(PathBuf::from("/dev/dri/renderD255"))
        );
        assert_eq!(render_node_path(127), None);
        assert_eq!(render_node_path(256), None);
        assert_eq!(render_node_path(0), None);

        let dir = TempDir::new("dri");
        for name in [
            "renderD128",
            "renderD130",
            "card0",
            "renderD",
            "renderD12x",
            "renderD300",
            "by-path",
        ] {
            fs::write(dir.path().join(name), b"").unwrap();
        }
        let minors = present_render_minors(dir.path()).unwrap();
        assert_eq!(minors, BTreeSet::from([128, 130]));

        let mut t = Topology::from_sysfs(&fixture("2gpu")).unwrap();
        let removed = t.retain_accessible(|g| minors.contains(&g.drm_render_minor));
        assert_eq!(removed, vec![1266]);
        assert_eq!(t.gpus().map(|g| g.gpu_id).collect::<Vec<_>>(), vec![53109]);
    }

    // ----- image conversion ----------------------------------------------------

    #[test]
    fn device_info_round_trip() {
        let host = Topology::from_sysfs(&fixture("8gpu-2hives")).unwrap();
        let infos = host.to_device_entries(|actual| Some(actual ^ 0x8000));
        assert_eq!(infos.len(), 10);
        let cpu = &infos[0];
        assert_eq!(
            (cpu.gpu_id, cpu.cpu_cores_count, cpu.simd_count),
            (0, 64, 0)
        );
        let gpu = &infos[2];
        assert_eq!(gpu.gpu_id, 7740 ^ 0x8000);
        assert_eq!(gpu.cpu_cores_count, 0);
        assert_eq!(gpu.gds_size_in_kb, 0);
        assert_eq!(gpu.vram_public, 1);
        assert_eq!(gpu.iolinks.len(), 4);
        assert!(gpu.iolinks.contains(&EntryLink {
            link_type: 11,
            node_to_id: 3
        }));

        let back = Topology::from_device_entries(&infos).unwrap();
        assert_eq!(back.gpu_count(), 8);
        for (a, b) in host.gpus().zip(back.gpus()) {
            assert_eq!(
                GpuNode {
                    gpu_id: a.gpu_id ^ 0x8000,
                    ..a.clone()
                },
                *b
            );
        }
        assert_eq!(back.xgmi_hives().len(), 2);
        // Checkpoint == restore host, so the mapping is the user-id identity.
        let map = map_gpus(&back, &host, &CompatChecks::default()).unwrap();
        for m in &map {
            assert_eq!(m.checkpoint_gpu_id ^ 0x8000, m.restore_gpu_id);
            assert_eq!(m.checkpoint_render_minor, m.restore_render_minor);
        }
    }

    #[test]
    fn gpus_not_reported_by_kfd_are_left_out_of_the_image() {
        let host = Topology::from_sysfs(&fixture("2gpu")).unwrap();
        let infos = host.to_device_entries(|actual| (actual == 1266).then_some(0x4242));
        assert_eq!(infos.len(), 2, "CPU and the reported GPU");
        assert_eq!(infos[1].gpu_id, 0x4242);
        assert_eq!(infos[1].node_id, 2);
        // The CPU's link to the left-out GPU (node 1) is dropped.
        assert_eq!(
            infos[0].iolinks,
            vec![EntryLink {
                link_type: 2,
                node_to_id: 2
            }]
        );
    }

    #[test]
    fn device_infos_are_validated() {
        let gpu = DeviceEntry {
            node_id: 1,
            gpu_id: 0x10,
            ..DeviceEntry::default()
        };
        let err = Topology::from_device_entries(&[gpu.clone(), gpu.clone()]).unwrap_err();
        assert!(err.to_string().contains("node id 1 appears twice"), "{err}");
        let other = DeviceEntry {
            node_id: 2,
            ..gpu.clone()
        };
        let err = Topology::from_device_entries(&[gpu.clone(), other]).unwrap_err();
        assert!(
            err.to_string().contains("gpu id 0x0010 appears twice"),
            "{err}"
        );
        // Unknown link types are dropped, links to absent nodes are invalid.
        let cpu = DeviceEntry {
            node_id: 0,
            cpu_cores_count: 8,
            iolinks: vec![
                EntryLink {
                    link_type: 1,
                    node_to_id: 1,
                },
                EntryLink {
                    link_type: 2,
                    node_to_id: 7,
                },
            ],
            ..DeviceEntry::default()
        };
        let t = Topology::from_device_entries(&[cpu, gpu]).unwrap();
        assert_eq!(
            t.nodes()[0].io_links(),
            &[IoLink {
                link_type: PCIE,
                node_to: 7
            }]
        );
    }

    // ----- sysfs fixtures ----------------------------------------------------------

    #[test]
    fn parses_one_gpu_fixture() {
        let t = Topology::from_sysfs(&fixture("1gpu")).unwrap();
        assert_eq!(t.nodes().len(), 2);
        let TopologyNode::Cpu(cpu) = &t.nodes()[0] else {
            panic!("node 0 is a CPU")
        };
        assert_eq!(cpu.cpu_cores_count, 32);
        assert_eq!(
            cpu.io_links,
            vec![IoLink {
                link_type: PCIE,
                node_to: 1
            }]
        );
        let g = t.gpu_by_id(53109).expect("GPU present");
        assert_eq!(t.gpu_by_render_minor(128), Some(g));
        let want = GpuNode {
            node_id: 1,
            gpu_id: 53109,
            simd_count: 416,
            mem_banks_count: 1,
            caches_count: 273,
            io_links_count: 1,
            max_waves_per_simd: 8,
            lds_size_in_kb: 64,
            num_gws: 64,
            wave_front_size: 64,
            array_count: 8,
            simd_arrays_per_engine: 1,
            cu_per_simd_array: 13,
            simd_per_cu: 4,
            max_slots_scratch_cu: 32,
            vendor_id: 4098,
            device_id: 29711,
            domain: 0,
            drm_render_minor: 128,
            hive_id: 0,
            num_sdma_engines: 2,
            num_sdma_xgmi_engines: 3,
            num_sdma_queues_per_engine: 8,
            num_cp_queues: 24,
            fw_version: 78,
            capability: 746824320,
            sdma_fw_version: 8,
            vram_public: true,
            vram_size: 68702699520,
            io_links: vec![IoLink {
                link_type: PCIE,
                node_to: 0,
            }],
        };
        assert_eq!(*g, want);
        assert!(t.xgmi_hives().is_empty());
        let same = identity_image(&t);
        let map = map_gpus(&same, &t, &CompatChecks::default()).unwrap();
        assert_eq!(map.restore_gpu_id(53109), Some(53109));
        assert_eq!(map.restore_gpu_id(1), None);
    }

    #[test]
    fn parses_two_gpu_fixture_ignoring_p2p_links() {
        let t = Topology::from_sysfs(&fixture("2gpu")).unwrap();
        assert_eq!(
            t.gpus()
                .map(|g| (g.gpu_id, g.drm_render_minor))
                .collect::<Vec<_>>(),
            vec![(53109, 128), (1266, 129)]
        );
        for g in t.gpus() {
            assert_eq!(
                g.io_links,
                vec![IoLink {
                    link_type: PCIE,
                    node_to: 0
                }]
            );
        }
        // Two identical GPUs: checkpoint order reversed still maps cleanly,
        // searching from the last GPU as upstream does.
        let ckpt = identity_image(&t);
        let map = map_gpus(&ckpt, &t, &CompatChecks::default()).unwrap();
        assert_eq!(
            gpu_pairs(&map),
            BTreeMap::from([(53109, 53109), (1266, 1266)])
        );
    }

    #[test]
    fn parses_eight_gpu_fixture() {
        let t = Topology::from_sysfs(&fixture("8gpu-2hives")).unwrap();
        assert_eq!(t.nodes().len(), 10);
        assert_eq!(t.gpu_count(), 8);
        assert_eq!(
            t.xgmi_hives(),
            vec![
                vec![7740, 22413, 41060, 55027],
                vec![10086, 30511, 47612, 63009]
            ]
        );
        // The CPU-to-CPU link (type 1) is dropped; the four GPU links stay.
        let TopologyNode::Cpu(cpu) = &t.nodes()[1] else {
            panic!("node 1 is a CPU")
        };
        assert_eq!(
            cpu.io_links.iter().map(|l| l.node_to).collect::<Vec<_>>(),
            vec![6, 7, 8, 9]
        );
        let g = t.gpu_by_id(22413).unwrap();
        assert_eq!(g.hive_id, 0x5A1B_2C3D_4E5F_6071);
        assert_eq!(g.vram_size, 34342961152);
        assert_eq!(g.io_links.iter().filter(|l| l.link_type == XGMI).count(), 3);
    }

    // ----- hostile sysfs -------------------------------------------------------------

    static TEMP_SEQ: AtomicUsize = AtomicUsize::new(0);

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            let n = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
            let path =
                std::env::temp_dir().join(format!("kfd-topo-{}-{tag}-{n}", std::process::id()));
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

    /// A minimal tree: CPU node 0 and GPU node 1, with `gpu_props` as the
    /// GPU's properties file.
    fn tree(tag: &str, gpu_props: &[u8]) -> TempDir {
        let dir = TempDir::new(tag);
        let nodes = dir.path().join("nodes");
        let write = |rel: &str, content: &[u8]| {
            let p = nodes.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, content).unwrap();
        };
        write("0/gpu_id", b"0\n");
        write(
            "0/properties",
            b"cpu_cores_count 4\nthis line is never read\n",
        );
        write(
            "0/io_links/0/properties",
            b"type 2\nnode_from 0\nnode_to 1\n",
        );
        write("1/gpu_id", b"4660\n");
        write("1/properties", gpu_props);
        write(
            "1/mem_banks/0/properties",
            b"heap_type 1\nsize_in_bytes 1073741824\n",
        );
        write(
            "1/io_links/0/properties",
            b"type 2\nnode_from 1\nnode_to 0\n",
        );
        dir
    }

    fn parse_err(dir: &TempDir) -> String {
        let err = Topology::from_sysfs(dir.path()).unwrap_err();
        err.to_string()
    }

    #[test]
    fn minimal_tree_parses_and_cpu_stops_early() {
        let dir = tree(
            "ok",
            b"simd_count 4\n\ndevice_id 1\nsome_future_property_with_a_long_name_31 7\n",
        );
        let t = Topology::from_sysfs(dir.path()).unwrap();
        assert_eq!(t.nodes().len(), 2);
        let g = t.gpu_by_id(4660).unwrap();
        assert_eq!((g.simd_count, g.device_id, g.vram_size), (4, 1, 1 << 30));
    }

    #[test]
    fn hostile_values_are_errors() {
        let cases: [(&str, &[u8], &str); 8] = [
            ("nonnum", b"simd_count four\n", "not a decimal number"),
            ("negative", b"simd_count -1\n", "not a decimal number"),
            ("trailing", b"simd_count 12abc\n", "not a decimal number"),
            (
                "u64",
                b"hive_id 18446744073709551616\n",
                "does not fit in 64 bits",
            ),
            ("u32", b"device_id 4294967296\n", "does not fit in 32 bits"),
            ("pair", b"simd_count\n", "not a \"name value\" pair"),
            ("triple", b"simd_count 1 2\n", "not a \"name value\" pair"),
            ("name", &[b'x'; 65], "longer than 64"),
        ];
        for (tag, props, want) in cases {
            let mut props = props.to_vec();
            if tag == "name" {
                props.extend_from_slice(b" 1\n");
            }
            let dir = tree(tag, &props);
            let msg = parse_err(&dir);
            assert!(msg.contains(want), "{tag}: {msg}");
            assert!(msg.contains("nodes/1/properties"), "{tag}: {msg}");
        }
        // A 64-character name is fine.
        let mut ok = vec![b'y'; 64];
        ok.extend_from_slice(b" 1\n");
        let dir = tree("name64", &ok);
        assert!(Topology::from_sysfs(dir.path()).is_ok());
    }

    #[test]
    fn huge_files_are_refused() {
        let mut huge = Vec::new();
        while huge.len() <= MAX_SYSFS_FILE_BYTES {
            huge.extend_from_slice(b"simd_count 1\n");
        }
        let dir = tree("huge", &huge);
        let err = Topology::from_sysfs(dir.path()).unwrap_err();
        assert!(
            matches!(
                err,
                TopologyError::TooLarge {
                    limit: MAX_SYSFS_FILE_BYTES,
                    ..
                }
            ),
            "{err}"
        );

        let dir = tree("hugeid", b"simd_count 1\n");
        fs::write(dir.path().join("nodes/1/gpu_id"), vec![b'1'; 1 << 20]).unwrap();
        let err = Topology::from_sysfs(dir.path()).unwrap_err();
        assert!(matches!(err, TopologyError::TooLarge { .. }), "{err}");

        let dir = tree("binary", b"simd_count 1\n");
        fs::write(dir.path().join("nodes/1/properties"), [0xff, 0xfe, b'\n']).unwrap();
        assert!(parse_err(&dir).contains("not valid UTF-8"));
    }

    #[test]
    fn too_many_directory_entries_are_refused() {
        let dir = TempDir::new("many");
        for i in 0..10 {
            fs::write(dir.path().join(format!("{}", 9 - i)), b"").unwrap();
        }
        let sorted: Vec<u32> = numeric_entries_capped(dir.path(), false, 10)
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        fs::write(dir.path().join("x"), b"").unwrap();
        let err = numeric_entries_capped(dir.path(), false, 10).unwrap_err();
        assert!(
            matches!(err, TopologyError::TooLarge { limit: 10, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("exceeds the limit of 10"), "{err}");
        assert!(
            numeric_entries(&dir.path().join("absent"), true)
                .unwrap()
                .is_empty()
        );
        assert!(numeric_entries(&dir.path().join("absent"), false).is_err());
    }

    #[test]
    fn gpu_id_handling() {
        // Garbage in a readable gpu_id is an error...
        for (tag, content) in [
            ("idtext", &b"abc\n"[..]),
            ("idneg", b"-5\n"),
            ("idbig", b"99999999999\n"),
            ("idempty", b""),
        ] {
            let dir = tree(tag, b"simd_count 1\n");
            fs::write(dir.path().join("nodes/1/gpu_id"), content).unwrap();
            assert!(parse_err(&dir).contains("gpu_id"), "{tag}");
        }
        // ...while an unreadable one skips the node (cgroup masking), and so
        // does a missing one. Links to the skipped node become invalid.
        let dir = tree("idmissing", b"simd_count 1\n");
        fs::remove_file(dir.path().join("nodes/1/gpu_id")).unwrap();
        let t = Topology::from_sysfs(dir.path()).unwrap();
        assert_eq!(t.gpu_count(), 0);
        let dir = tree("iddir", b"simd_count 1\n");
        let id = dir.path().join("nodes/1/gpu_id");
        fs::remove_file(&id).unwrap();
        fs::create_dir(&id).unwrap();
        assert_eq!(Topology::from_sysfs(dir.path()).unwrap().gpu_count(), 0);
        // Duplicate gpu ids are an error.
        let dir = tree("iddup", b"simd_count 1\n");
        let src = dir.path().join("nodes/1");
        let dst = dir.path().join("nodes/2");
        fs::create_dir_all(dst.join("mem_banks/0")).unwrap();
        for f in ["gpu_id", "properties", "mem_banks/0/properties"] {
            fs::copy(src.join(f), dst.join(f)).unwrap();
        }
        assert!(parse_err(&dir).contains("appears twice"));
    }

    #[test]
    fn vram_and_link_rules() {
        // No FB bank.
        let dir = tree("nofb", b"simd_count 1\n");
        fs::write(
            dir.path().join("nodes/1/mem_banks/0/properties"),
            b"heap_type 0\nsize_in_bytes 5\n",
        )
        .unwrap();
        assert!(matches!(
            Topology::from_sysfs(dir.path()).unwrap_err(),
            TopologyError::NoVram { .. }
        ));
        // First FB bank of size 0.
        fs::write(
            dir.path().join("nodes/1/mem_banks/0/properties"),
            b"heap_type 2\nsize_in_bytes 0\n",
        )
        .unwrap();
        assert!(parse_err(&dir).contains("frame-buffer"));
        // A private FB bank after a system bank.
        fs::write(
            dir.path().join("nodes/1/mem_banks/0/properties"),
            b"heap_type 0\nsize_in_bytes 5\n",
        )
        .unwrap();
        fs::create_dir_all(dir.path().join("nodes/1/mem_banks/1")).unwrap();
        fs::write(
            dir.path().join("nodes/1/mem_banks/1/properties"),
            b"heap_type 2\nsize_in_bytes 7\n",
        )
        .unwrap();
        let g = Topology::from_sysfs(dir.path())
            .unwrap()
            .gpu_by_id(4660)
            .unwrap()
            .clone();
        assert_eq!((g.vram_public, g.vram_size), (false, 7));
        // Missing mem_banks on a GPU is an error.
        fs::remove_dir_all(dir.path().join("nodes/1/mem_banks")).unwrap();
        assert!(parse_err(&dir).contains("mem_banks"));

        // A missing io_links directory means no links.
        let dir = tree("nolinks", b"simd_count 1\n");
        fs::remove_dir_all(dir.path().join("nodes/1/io_links")).unwrap();
        let t = Topology::from_sysfs(dir.path()).unwrap();
        assert!(t.gpu_by_id(4660).unwrap().io_links.is_empty());
        // A kept link without node_to is an error; other types are dropped.
        let dir = tree("nodeto", b"simd_count 1\n");
        let link = dir.path().join("nodes/1/io_links/0/properties");
        fs::write(&link, b"type 11\n").unwrap();
        assert!(parse_err(&dir).contains("no node_to"));
        fs::write(&link, b"type 5\nnode_to 0\n").unwrap();
        let t = Topology::from_sysfs(dir.path()).unwrap();
        assert!(t.gpu_by_id(4660).unwrap().io_links.is_empty());
        // An unreadable properties file is an error naming the file.
        fs::remove_file(dir.path().join("nodes/1/properties")).unwrap();
        let err = Topology::from_sysfs(dir.path()).unwrap_err();
        assert!(
            matches!(err, TopologyError::Io { .. }) && err.source().is_some(),
            "{err}"
        );
        assert!(err.to_string().contains("nodes/1/properties"), "{err}");
    }

    #[test]
    fn non_numeric_node_entries_are_ignored_and_root_must_exist() {
        let dir = tree("extra", b"simd_count 1\n");
        fs::create_dir_all(dir.path().join("nodes/foo")).unwrap();
        fs::write(dir.path().join("nodes/7"), b"not a dir").unwrap();
        assert_eq!(Topology::from_sysfs(dir.path()).unwrap().nodes().len(), 2);
        let missing = dir.path().join("absent");
        let err = Topology::from_sysfs(&missing).unwrap_err();
        assert!(err.to_string().starts_with("cannot read"), "{err}");
    }
}
