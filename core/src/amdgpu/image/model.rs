//! Plain structs for the AMD image messages, and their conversion to and
//! from the prost types.
//!
//! Each image type has one `validate` routine, used both when converting
//! from the wire form (after reading) and to it (before writing), so the
//! format rules live in one place.

use std::collections::HashSet;
use std::fmt;

use super::proto;
use super::wire::{self, MessageRules};
use super::{ImageMessage, NO_GEM_HANDLE};
use crate::amdgpu::device::AllocFlags;

/// A message that decodes but breaks a rule of the format.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatError {
    /// A `required` field is absent.
    MissingField {
        message: &'static str,
        field: &'static str,
    },
    /// The wire data is not well-formed protobuf.
    Malformed {
        message: &'static str,
        detail: &'static str,
    },
    /// A stored count differs from the number of entries present.
    CountMismatch {
        message: &'static str,
        field: &'static str,
        declared: u64,
        actual: u64,
    },
    /// Any other rule.
    Invalid {
        message: &'static str,
        detail: String,
    },
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingField { message, field } => {
                write!(f, "required field {message}.{field} is missing")
            }
            Self::Malformed { message, detail } => {
                write!(f, "{message} is not valid protobuf ({detail})")
            }
            Self::CountMismatch {
                message,
                field,
                declared,
                actual,
            } => write!(
                f,
                "{message}.{field} says {declared} but {actual} entries are present"
            ),
            Self::Invalid { message, detail } => write!(f, "{message}: {detail}"),
        }
    }
}

impl std::error::Error for FormatError {}

fn invalid(message: &'static str, detail: String) -> FormatError {
    FormatError::Invalid { message, detail }
}

fn check_count(
    message: &'static str,
    field: &'static str,
    declared: u64,
    actual: usize,
) -> Result<(), FormatError> {
    let actual = actual as u64;
    if declared != actual {
        return Err(FormatError::CountMismatch {
            message,
            field,
            declared,
            actual,
        });
    }
    Ok(())
}

/// Converts an entry count to the width of the field that stores it.
fn count_u32(message: &'static str, field: &'static str, n: usize) -> Result<u32, FormatError> {
    u32::try_from(n).map_err(|_| invalid(message, format!("{n} entries do not fit {field}")))
}

/// A valid io link of a topology node (`dev_iolink`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IoLink {
    /// Link type (PCIe = 2, XGMI = 11).
    pub link_type: u32,
    /// Topology node id at the other end.
    pub node_to_id: u32,
}

/// One KFD topology node, CPU or GPU (`kfd_device_entry`). Field meanings
/// are those of the KFD sysfs topology properties of the same names.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceEntry {
    pub node_id: u32,
    /// 0 for a CPU node, else the user (image) gpu_id.
    pub gpu_id: u32,
    /// Nonzero only for CPU nodes; that is how restore tells CPUs from GPUs.
    pub cpu_cores_count: u32,
    pub simd_count: u32,
    pub mem_banks_count: u32,
    pub caches_count: u32,
    pub io_links_count: u32,
    pub max_waves_per_simd: u32,
    pub lds_size_in_kb: u32,
    pub gds_size_in_kb: u32,
    pub num_gws: u32,
    pub wave_front_size: u32,
    pub array_count: u32,
    pub simd_arrays_per_engine: u32,
    pub cu_per_simd_array: u32,
    pub simd_per_cu: u32,
    pub max_slots_scratch_cu: u32,
    pub vendor_id: u32,
    pub device_id: u32,
    pub domain: u32,
    pub drm_render_minor: u32,
    pub hive_id: u64,
    pub num_sdma_engines: u32,
    pub num_sdma_xgmi_engines: u32,
    pub num_sdma_queues_per_engine: u32,
    pub num_cp_queues: u32,
    pub fw_version: u32,
    pub capability: u32,
    pub sdma_fw_version: u32,
    pub vram_public: u32,
    pub vram_size: u64,
    /// Valid links only (may be fewer than `io_links_count`).
    pub iolinks: Vec<IoLink>,
}

impl DeviceEntry {
    /// Whether restore treats this node as a CPU (`cpu_cores_count != 0`).
    pub fn is_cpu(&self) -> bool {
        self.cpu_cores_count != 0
    }
}

/// One KFD buffer object (`kfd_bo_entry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BoEntry {
    /// GPU virtual address.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// mmap offset at checkpoint time.
    pub offset: u64,
    /// `KFD_IOC_ALLOC_MEM_FLAGS_*`.
    pub alloc_flags: u32,
    /// User (image) gpu_id of the GPU owning the BO.
    pub gpu_id: u32,
    /// GEM handle used as the cross-reference key with render-node BOs and
    /// dma-bufs. `None` when there is none (written as `0xFFFFFFFF`) or when
    /// the image comes from CRIU v4.2, which did not record it.
    pub handle: Option<u32>,
}

impl BoEntry {
    /// Whether the BO's contents are saved in the GPU's pages file
    /// (VRAM or GTT; userptr, doorbell and MMIO BOs are not).
    pub fn has_contents(&self) -> bool {
        AllocFlags::of(self.alloc_flags).intersects(AllocFlags::WITH_CONTENTS)
    }
}

/// Content of `amdgpu-kfd-ID.img` (`criu_kfd`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KfdCheckpoint {
    /// The process's pid in its own pid namespace (from `PROCESS_INFO`).
    pub pid: u32,
    /// Number of GPUs KFD reported for the process.
    pub num_of_gpus: u32,
    /// Topology nodes minus `num_of_gpus`.
    pub num_of_cpus: u32,
    /// One per topology node, CPUs included, in topology order.
    pub devices: Vec<DeviceEntry>,
    /// In kernel bucket order; the order defines the pages file layout.
    pub bos: Vec<BoEntry>,
    /// Number of objects in `priv_data`, as the kernel reported.
    pub num_of_objects: u32,
    /// Size of `/dev/shm/hsakmt_shared_mem`, 0 if absent.
    pub shared_mem_size: u64,
    /// First four bytes of that file.
    pub shared_mem_magic: u32,
    /// Opaque kernel blob handed back to KFD on restore.
    pub priv_data: Vec<u8>,
}

const CRIU_KFD: &str = "criu_kfd";

impl KfdCheckpoint {
    /// The BOs whose contents the image's pages files hold (VRAM or GTT), as
    /// `(index, size)` in image order.
    pub fn content_bos(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.bos
            .iter()
            .enumerate()
            .filter(|(_, b)| b.has_contents())
            .map(|(i, b)| (i, b.size))
    }

    /// Every GPU of the image, by user gpu_id, in device order. A dump writes a pages file
    /// for each, an empty one (its size header of 0) for a GPU without BO contents: CRIU's C
    /// plugin opens the pages file of every GPU at restore.
    pub fn gpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.devices
            .iter()
            .filter(|d| d.gpu_id != 0)
            .map(|d| d.gpu_id)
    }

    /// The GPUs whose pages file holds contents (at least one BO with contents), by user
    /// gpu_id, in device order: the files a restore needs (images of this plugin from before
    /// it wrote empty ones have no file for the other GPUs).
    pub fn content_gpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.gpus()
            .filter(|&gpu| self.bos.iter().any(|b| b.gpu_id == gpu && b.has_contents()))
    }

    /// Checks the rules the C plugin's restore relies on:
    /// `num_of_gpus + num_of_cpus` equals the number of device entries,
    /// GPU ids are unique, every BO belongs to a GPU listed among the
    /// devices, and no BO stores the "no handle" sentinel as a handle.
    pub fn validate(&self) -> Result<(), FormatError> {
        check_count(
            CRIU_KFD,
            "num_of_gpus + num_of_cpus",
            u64::from(self.num_of_gpus) + u64::from(self.num_of_cpus),
            self.devices.len(),
        )?;
        let mut gpus = HashSet::new();
        for d in self.devices.iter().filter(|d| d.gpu_id != 0) {
            if !gpus.insert(d.gpu_id) {
                return Err(invalid(
                    CRIU_KFD,
                    format!(
                        "gpu_id {:#x} appears in more than one device entry",
                        d.gpu_id
                    ),
                ));
            }
        }
        for (i, bo) in self.bos.iter().enumerate() {
            if !gpus.contains(&bo.gpu_id) {
                return Err(invalid(
                    CRIU_KFD,
                    format!(
                        "BO {i} belongs to gpu_id {:#x}, which no device entry lists",
                        bo.gpu_id
                    ),
                ));
            }
            if bo.handle == Some(NO_GEM_HANDLE) {
                return Err(invalid(
                    CRIU_KFD,
                    format!("BO {i} stores the no-handle value as a handle; use None"),
                ));
            }
        }
        Ok(())
    }
}

impl From<proto::DevIolink> for IoLink {
    fn from(p: proto::DevIolink) -> Self {
        Self {
            link_type: p.r#type,
            node_to_id: p.node_to_id,
        }
    }
}

impl From<&IoLink> for proto::DevIolink {
    fn from(l: &IoLink) -> Self {
        Self {
            r#type: l.link_type,
            node_to_id: l.node_to_id,
        }
    }
}

/// Copies the scalar fields that have the same name on both sides.
macro_rules! device_fields {
    ($dst:ident, $src:ident, $($f:ident),* $(,)?) => {
        $( $dst.$f = $src.$f; )*
    };
}

macro_rules! copy_device_scalars {
    ($dst:ident, $src:ident) => {
        device_fields!(
            $dst,
            $src,
            node_id,
            gpu_id,
            cpu_cores_count,
            simd_count,
            mem_banks_count,
            caches_count,
            io_links_count,
            max_waves_per_simd,
            lds_size_in_kb,
            gds_size_in_kb,
            num_gws,
            wave_front_size,
            array_count,
            simd_arrays_per_engine,
            cu_per_simd_array,
            simd_per_cu,
            max_slots_scratch_cu,
            vendor_id,
            device_id,
            domain,
            drm_render_minor,
            hive_id,
            num_sdma_engines,
            num_sdma_xgmi_engines,
            num_sdma_queues_per_engine,
            num_cp_queues,
            fw_version,
            capability,
            sdma_fw_version,
            vram_public,
            vram_size,
        )
    };
}

impl From<proto::KfdDeviceEntry> for DeviceEntry {
    fn from(p: proto::KfdDeviceEntry) -> Self {
        let mut d = DeviceEntry::default();
        copy_device_scalars!(d, p);
        d.iolinks = p.iolinks.into_iter().map(IoLink::from).collect();
        d
    }
}

impl From<&DeviceEntry> for proto::KfdDeviceEntry {
    fn from(d: &DeviceEntry) -> Self {
        let mut p = proto::KfdDeviceEntry::default();
        copy_device_scalars!(p, d);
        p.iolinks = d.iolinks.iter().map(proto::DevIolink::from).collect();
        p
    }
}

impl From<proto::KfdBoEntry> for BoEntry {
    fn from(p: proto::KfdBoEntry) -> Self {
        Self {
            addr: p.addr,
            size: p.size,
            offset: p.offset,
            alloc_flags: p.alloc_flags,
            gpu_id: p.gpu_id,
            handle: p.handle.filter(|&h| h != NO_GEM_HANDLE),
        }
    }
}

impl From<&BoEntry> for proto::KfdBoEntry {
    fn from(b: &BoEntry) -> Self {
        Self {
            addr: b.addr,
            size: b.size,
            offset: b.offset,
            alloc_flags: b.alloc_flags,
            gpu_id: b.gpu_id,
            // Always written, so criu-dev's C reader finds its required field.
            handle: Some(b.handle.unwrap_or(NO_GEM_HANDLE)),
        }
    }
}

impl TryFrom<proto::CriuKfd> for KfdCheckpoint {
    type Error = FormatError;

    fn try_from(p: proto::CriuKfd) -> Result<Self, FormatError> {
        check_count(CRIU_KFD, "num_of_bos", p.num_of_bos, p.bo_entries.len())?;
        let image = Self {
            pid: p.pid,
            num_of_gpus: p.num_of_gpus,
            num_of_cpus: p.num_of_cpus,
            devices: p
                .device_entries
                .into_iter()
                .map(DeviceEntry::from)
                .collect(),
            bos: p.bo_entries.into_iter().map(BoEntry::from).collect(),
            num_of_objects: p.num_of_objects,
            shared_mem_size: p.shared_mem_size,
            shared_mem_magic: p.shared_mem_magic,
            priv_data: p.priv_data,
        };
        image.validate()?;
        Ok(image)
    }
}

impl TryFrom<&KfdCheckpoint> for proto::CriuKfd {
    type Error = FormatError;

    fn try_from(k: &KfdCheckpoint) -> Result<Self, FormatError> {
        k.validate()?;
        Ok(Self {
            pid: k.pid,
            num_of_gpus: k.num_of_gpus,
            num_of_cpus: k.num_of_cpus,
            device_entries: k.devices.iter().map(proto::KfdDeviceEntry::from).collect(),
            num_of_bos: k.bos.len() as u64,
            bo_entries: k.bos.iter().map(proto::KfdBoEntry::from).collect(),
            num_of_objects: k.num_of_objects,
            shared_mem_size: k.shared_mem_size,
            shared_mem_magic: k.shared_mem_magic,
            priv_data: k.priv_data.clone(),
        })
    }
}

impl ImageMessage for KfdCheckpoint {
    type Proto = proto::CriuKfd;
    const MESSAGE: &'static str = CRIU_KFD;
    fn rules() -> &'static MessageRules {
        &wire::CRIU_KFD
    }
    fn from_proto(proto: Self::Proto) -> Result<Self, FormatError> {
        Self::try_from(proto)
    }
    fn to_proto(&self) -> Result<Self::Proto, FormatError> {
        proto::CriuKfd::try_from(self)
    }
}

/// One GPU VA mapping of a render-node BO (`drm_vm_entry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DrmVmEntry {
    /// GPU virtual address.
    pub addr: u64,
    /// Mapping size in bytes.
    pub size: u64,
    /// Offset in the BO.
    pub offset: u64,
    /// `AMDGPU_VM_PAGE_*` flags.
    pub flags: u64,
}

/// One GEM buffer object of a render node (`drm_bo_entry`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DrmBoEntry {
    /// VA of the last mapping.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Fake mmap offset at checkpoint time.
    pub offset: u64,
    /// GEM_CREATE domain flags.
    pub alloc_flags: u64,
    /// Alignment (for userptr BOs the kernel reports the address here).
    pub alignment: u64,
    /// `AMDGPU_GEM_DOMAIN_*`.
    pub preferred_domains: u32,
    /// Original GEM handle.
    pub handle: u32,
    /// Whether the BO was imported from another device or process.
    pub is_import: bool,
    /// GPU VA mappings.
    pub vms: Vec<DrmVmEntry>,
}

/// The criu-dev part of a render-node image.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RenderNodeDrm {
    /// CRIU file id (also in the file name).
    pub id: u32,
    /// Render minor at checkpoint time.
    pub drm_render_minor: u32,
    /// The node's GEM BOs; index `i` has its contents in the DRM pages file
    /// with index `i`.
    pub bos: Vec<DrmBoEntry>,
}

/// Content of `amdgpu-renderD-ID.img` (`criu_render_node`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RenderNodeImage {
    /// User (image) gpu_id of the node's GPU.
    pub gpu_id: u32,
    /// `None` for a CRIU v4.2 image, which recorded only `gpu_id`. Images we
    /// write for the criu-dev C plugin need `Some`: that plugin refuses a
    /// render-node image without these fields.
    pub drm: Option<RenderNodeDrm>,
}

const CRIU_RENDER_NODE: &str = "criu_render_node";
const DRM_BO_ENTRY: &str = "drm_bo_entry";

impl RenderNodeImage {
    /// Checks that counts fit their fields. (Counts read from the wire are
    /// compared with the entries present during conversion.)
    pub fn validate(&self) -> Result<(), FormatError> {
        if let Some(drm) = &self.drm {
            for bo in &drm.bos {
                count_u32(DRM_BO_ENTRY, "num_of_vms", bo.vms.len())?;
            }
        }
        Ok(())
    }
}

impl From<proto::DrmVmEntry> for DrmVmEntry {
    fn from(p: proto::DrmVmEntry) -> Self {
        Self {
            addr: p.addr,
            size: p.size,
            offset: p.offset,
            flags: p.flags,
        }
    }
}

impl From<&DrmVmEntry> for proto::DrmVmEntry {
    fn from(v: &DrmVmEntry) -> Self {
        Self {
            addr: v.addr,
            size: v.size,
            offset: v.offset,
            flags: v.flags,
        }
    }
}

impl TryFrom<proto::DrmBoEntry> for DrmBoEntry {
    type Error = FormatError;

    fn try_from(p: proto::DrmBoEntry) -> Result<Self, FormatError> {
        check_count(
            DRM_BO_ENTRY,
            "num_of_vms",
            u64::from(p.num_of_vms),
            p.vm_entries.len(),
        )?;
        let is_import = match p.is_import {
            0 => false,
            1 => true,
            other => {
                return Err(invalid(
                    DRM_BO_ENTRY,
                    format!("is_import is {other}, expected 0 or 1"),
                ));
            }
        };
        Ok(Self {
            addr: p.addr,
            size: p.size,
            offset: p.offset,
            alloc_flags: p.alloc_flags,
            alignment: p.alignment,
            preferred_domains: p.preferred_domains,
            handle: p.handle,
            is_import,
            vms: p.vm_entries.into_iter().map(DrmVmEntry::from).collect(),
        })
    }
}

impl TryFrom<&DrmBoEntry> for proto::DrmBoEntry {
    type Error = FormatError;

    fn try_from(b: &DrmBoEntry) -> Result<Self, FormatError> {
        Ok(Self {
            addr: b.addr,
            size: b.size,
            offset: b.offset,
            alloc_flags: b.alloc_flags,
            alignment: b.alignment,
            preferred_domains: b.preferred_domains,
            handle: b.handle,
            is_import: u32::from(b.is_import),
            num_of_vms: count_u32(DRM_BO_ENTRY, "num_of_vms", b.vms.len())?,
            vm_entries: b.vms.iter().map(proto::DrmVmEntry::from).collect(),
        })
    }
}

impl TryFrom<proto::CriuRenderNode> for RenderNodeImage {
    type Error = FormatError;

    fn try_from(p: proto::CriuRenderNode) -> Result<Self, FormatError> {
        let drm = match (p.id, p.drm_render_minor, p.num_of_bos) {
            (None, None, None) => {
                if !p.bo_entries.is_empty() {
                    return Err(invalid(
                        CRIU_RENDER_NODE,
                        "bo_entries are present without num_of_bos".to_owned(),
                    ));
                }
                None
            }
            (Some(id), Some(drm_render_minor), Some(num_of_bos)) => {
                check_count(
                    CRIU_RENDER_NODE,
                    "num_of_bos",
                    num_of_bos,
                    p.bo_entries.len(),
                )?;
                let bos = p
                    .bo_entries
                    .into_iter()
                    .map(DrmBoEntry::try_from)
                    .collect::<Result<Vec<_>, _>>()?;
                Some(RenderNodeDrm {
                    id,
                    drm_render_minor,
                    bos,
                })
            }
            _ => {
                return Err(invalid(
                    CRIU_RENDER_NODE,
                    "id, drm_render_minor and num_of_bos must be all present (criu-dev) or all absent (CRIU 4.2)".to_owned(),
                ));
            }
        };
        let image = Self {
            gpu_id: p.gpu_id,
            drm,
        };
        image.validate()?;
        Ok(image)
    }
}

impl TryFrom<&RenderNodeImage> for proto::CriuRenderNode {
    type Error = FormatError;

    fn try_from(r: &RenderNodeImage) -> Result<Self, FormatError> {
        r.validate()?;
        let mut p = proto::CriuRenderNode {
            gpu_id: r.gpu_id,
            ..Default::default()
        };
        if let Some(drm) = &r.drm {
            p.id = Some(drm.id);
            p.drm_render_minor = Some(drm.drm_render_minor);
            p.num_of_bos = Some(drm.bos.len() as u64);
            p.bo_entries = drm
                .bos
                .iter()
                .map(proto::DrmBoEntry::try_from)
                .collect::<Result<_, _>>()?;
        }
        Ok(p)
    }
}

impl ImageMessage for RenderNodeImage {
    type Proto = proto::CriuRenderNode;
    const MESSAGE: &'static str = CRIU_RENDER_NODE;
    fn rules() -> &'static MessageRules {
        &wire::CRIU_RENDER_NODE
    }
    fn from_proto(proto: Self::Proto) -> Result<Self, FormatError> {
        Self::try_from(proto)
    }
    fn to_proto(&self) -> Result<Self::Proto, FormatError> {
        proto::CriuRenderNode::try_from(self)
    }
}

/// Content of `amdgpu-dmabuf_ID.img` (`criu_dmabuf_node`): which GEM handle
/// (in the shared handle namespace) a dumped dma-buf fd refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DmabufImage {
    /// GEM handle of the exporting BO.
    pub gem_handle: u32,
}

impl From<proto::CriuDmabufNode> for DmabufImage {
    fn from(p: proto::CriuDmabufNode) -> Self {
        Self {
            gem_handle: p.gem_handle,
        }
    }
}

impl From<&DmabufImage> for proto::CriuDmabufNode {
    fn from(d: &DmabufImage) -> Self {
        Self {
            gem_handle: d.gem_handle,
        }
    }
}

impl ImageMessage for DmabufImage {
    type Proto = proto::CriuDmabufNode;
    const MESSAGE: &'static str = "criu_dmabuf_node";
    fn rules() -> &'static MessageRules {
        &wire::CRIU_DMABUF_NODE
    }
    fn from_proto(proto: Self::Proto) -> Result<Self, FormatError> {
        Ok(proto.into())
    }
    fn to_proto(&self) -> Result<Self::Proto, FormatError> {
        Ok(self.into())
    }
}
