//! The `criu_render_node` message ([`RenderNodeImage`], `amdgpu-renderD-ID.img`): a render
//! node's BOs and their GPU VA mappings, and their wire form.

use super::{FormatError, check_count, count_u32, invalid};
use crate::amdgpu::image::wire::{self, MessageRules};
use crate::amdgpu::image::{ImageMessage, proto};

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
