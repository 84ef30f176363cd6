//! The `criu_dmabuf_node` message ([`DmabufImage`], `amdgpu-dmabuf_ID.img`) and its wire
//! form.

use super::FormatError;
use crate::amdgpu::image::wire::{self, MessageRules};
use crate::amdgpu::image::{ImageMessage, proto};

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
