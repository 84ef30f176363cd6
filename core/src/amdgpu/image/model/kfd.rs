//! The `criu_kfd` message ([`KfdCheckpoint`], `amdgpu-kfd-ID.img`): the KFD devices with
//! their topology, the BOs and the kernel's private data, and their wire form.

use std::collections::HashSet;

use super::{FormatError, check_count, invalid};
use crate::amdgpu::device::{AllocFlags, Bytes};
use crate::amdgpu::image::wire::{self, MessageRules};
use crate::amdgpu::image::{ImageMessage, NO_GEM_HANDLE, proto};

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

    /// The BO as error messages name it: kind, index `index`, size, address and GPU.
    pub fn describe(&self, index: usize) -> String {
        format!(
            "{} BO {index} ({} at {:#x}) of GPU {:#x}",
            AllocFlags::of(self.alloc_flags).kind(),
            Bytes(self.size),
            self.addr,
            self.gpu_id
        )
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
