//! Adapter between the image's device entries ([`super::image::DeviceEntry`]) and the
//! topology module's plain form of the same message ([`super::topology::DeviceInfo`]). The
//! two structs carry the same `kfd_device_entry` fields; they were written separately.

use super::image::{DeviceEntry, IoLink};
use super::topology::{DevIoLink, DeviceInfo};

macro_rules! same_fields {
    ($dst:ident, $src:ident) => {
        $dst.node_id = $src.node_id;
        $dst.gpu_id = $src.gpu_id;
        $dst.cpu_cores_count = $src.cpu_cores_count;
        $dst.simd_count = $src.simd_count;
        $dst.mem_banks_count = $src.mem_banks_count;
        $dst.caches_count = $src.caches_count;
        $dst.io_links_count = $src.io_links_count;
        $dst.max_waves_per_simd = $src.max_waves_per_simd;
        $dst.lds_size_in_kb = $src.lds_size_in_kb;
        $dst.gds_size_in_kb = $src.gds_size_in_kb;
        $dst.num_gws = $src.num_gws;
        $dst.wave_front_size = $src.wave_front_size;
        $dst.array_count = $src.array_count;
        $dst.simd_arrays_per_engine = $src.simd_arrays_per_engine;
        $dst.cu_per_simd_array = $src.cu_per_simd_array;
        $dst.simd_per_cu = $src.simd_per_cu;
        $dst.max_slots_scratch_cu = $src.max_slots_scratch_cu;
        $dst.vendor_id = $src.vendor_id;
        $dst.device_id = $src.device_id;
        $dst.domain = $src.domain;
        $dst.drm_render_minor = $src.drm_render_minor;
        $dst.hive_id = $src.hive_id;
        $dst.num_sdma_engines = $src.num_sdma_engines;
        $dst.num_sdma_xgmi_engines = $src.num_sdma_xgmi_engines;
        $dst.num_sdma_queues_per_engine = $src.num_sdma_queues_per_engine;
        $dst.num_cp_queues = $src.num_cp_queues;
        $dst.fw_version = $src.fw_version;
        $dst.capability = $src.capability;
        $dst.sdma_fw_version = $src.sdma_fw_version;
        $dst.vram_public = $src.vram_public;
        $dst.vram_size = $src.vram_size;
    };
}

/// The image entry for a topology node.
pub fn to_entry(d: &DeviceInfo) -> DeviceEntry {
    let mut e = DeviceEntry::default();
    same_fields!(e, d);
    e.iolinks = d
        .iolinks
        .iter()
        .map(|l| IoLink {
            link_type: l.r#type,
            node_to_id: l.node_to_id,
        })
        .collect();
    e
}

/// The topology form of an image entry.
pub fn to_info(e: &DeviceEntry) -> DeviceInfo {
    let mut d = DeviceInfo::default();
    same_fields!(d, e);
    d.iolinks = e
        .iolinks
        .iter()
        .map(|l| DevIoLink {
            r#type: l.link_type,
            node_to_id: l.node_to_id,
        })
        .collect();
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_every_field() {
        let mut d = DeviceInfo {
            node_id: 3,
            gpu_id: 0xabcd,
            hive_id: 0x1234_5678_9abc,
            vram_size: 64 << 30,
            iolinks: vec![DevIoLink {
                r#type: 11,
                node_to_id: 4,
            }],
            ..Default::default()
        };
        d.sdma_fw_version = 9;
        d.simd_count = 416;
        assert_eq!(to_info(&to_entry(&d)), d);
    }
}
