//! Tests of the AMD image format: round trips, byte-exact compatibility with
//! the C plugin's framing and encoding (expected bytes are built by hand, not
//! by prost), CRIU 4.2 <-> criu-dev compatibility, hostile images and a
//! no-panic loop over random input.
//!
//! This file holds the fixtures the test files share: a scratch images
//! directory, a hand-written proto2 encoder, sample images and their hand
//! encodings.

use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use super::*;

mod criu_versions;
mod framing;
mod hostile;
mod pages;
mod random_input;

/// A scratch images directory, removed on drop.
struct TempDir {
    path: PathBuf,
    fd: OwnedFd,
}

impl TempDir {
    fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "amdgpu-image-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir(&path).unwrap();
        let fd = open_image_dir(&path).unwrap();
        Self { path, fd }
    }

    fn dir(&self) -> ImageDir<'_> {
        ImageDir::new(self.fd.as_fd())
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn put(&self, name: &str, bytes: &[u8]) {
        fs::write(self.file(name), bytes).unwrap();
    }

    fn get(&self, name: &str) -> Vec<u8> {
        fs::read(self.file(name)).unwrap()
    }

    /// Writes dma-buf image `id` holding `gem_handle`.
    fn put_dmabuf(&self, id: u32, gem_handle: u32) {
        self.dir()
            .write_dmabuf(id, &DmabufImage { gem_handle })
            .unwrap();
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Hand-written proto2 encoder pieces, independent of prost.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_varint(out: &mut Vec<u8>, tag: u32, v: u64) {
    varint(out, u64::from(tag) << 3);
    varint(out, v);
}

fn field_bytes(out: &mut Vec<u8>, tag: u32, bytes: &[u8]) {
    varint(out, (u64::from(tag) << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A native-endian size_t header holding `size`, then `body`.
fn with_header(size: usize, body: &[u8]) -> Vec<u8> {
    let mut out = size.to_ne_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

/// The C plugin's framing: native-endian size_t, then the payload.
fn framed(payload: &[u8]) -> Vec<u8> {
    with_header(payload.len(), payload)
}

/// Device entry whose 31 scalar fields (tags 1..=31) hold `vals`.
fn device_from_vals(v: [u64; 31], iolinks: &[(u32, u32)]) -> DeviceEntry {
    let u = |i: usize| v[i] as u32;
    DeviceEntry {
        node_id: u(0),
        gpu_id: u(1),
        cpu_cores_count: u(2),
        simd_count: u(3),
        mem_banks_count: u(4),
        caches_count: u(5),
        io_links_count: u(6),
        max_waves_per_simd: u(7),
        lds_size_in_kb: u(8),
        gds_size_in_kb: u(9),
        num_gws: u(10),
        wave_front_size: u(11),
        array_count: u(12),
        simd_arrays_per_engine: u(13),
        cu_per_simd_array: u(14),
        simd_per_cu: u(15),
        max_slots_scratch_cu: u(16),
        vendor_id: u(17),
        device_id: u(18),
        domain: u(19),
        drm_render_minor: u(20),
        hive_id: v[21],
        num_sdma_engines: u(22),
        num_sdma_xgmi_engines: u(23),
        num_sdma_queues_per_engine: u(24),
        num_cp_queues: u(25),
        fw_version: u(26),
        capability: u(27),
        sdma_fw_version: u(28),
        vram_public: u(29),
        vram_size: v[30],
        iolinks: iolinks
            .iter()
            .map(|&(link_type, node_to_id)| IoLink {
                link_type,
                node_to_id,
            })
            .collect(),
    }
}

fn hand_device(v: [u64; 31], iolinks: &[(u32, u32)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, &val) in v.iter().enumerate() {
        field_varint(&mut out, i as u32 + 1, val);
    }
    for &(t, n) in iolinks {
        let mut link = Vec::new();
        field_varint(&mut link, 1, t.into());
        field_varint(&mut link, 2, n.into());
        field_bytes(&mut out, 32, &link);
    }
    out
}

fn gpu_vals(node_id: u64, gpu_id: u64) -> [u64; 31] {
    let mut v = [0u64; 31];
    for (i, x) in v.iter_mut().enumerate() {
        *x = 100 + i as u64;
    }
    v[0] = node_id;
    v[1] = gpu_id;
    v[2] = 0; // GPUs have no CPU cores
    v[9] = 0; // gds_size_in_kb: never filled by the C plugin
    v[21] = 0x1122_3344_5566_7788; // hive_id (u64)
    v[30] = 64 << 30; // vram_size (u64)
    v
}

fn cpu_vals(node_id: u64, cores: u64) -> [u64; 31] {
    let mut v = [0u64; 31];
    v[0] = node_id;
    v[2] = cores;
    v
}

const GPU_A: u32 = 0x1a2b;
const GPU_B: u32 = 0x3c4d;
const KFD_USERPTR: u32 = crate::amdgpu::device::AllocFlags::USERPTR.bits();

fn sample_kfd() -> KfdCheckpoint {
    KfdCheckpoint {
        pid: 4242,
        num_of_gpus: 2,
        num_of_cpus: 1,
        devices: vec![
            device_from_vals(cpu_vals(0, 16), &[(2, 1), (2, 2)]),
            device_from_vals(gpu_vals(1, GPU_A.into()), &[(2, 0), (11, 2)]),
            device_from_vals(gpu_vals(2, GPU_B.into()), &[(2, 0), (11, 1)]),
        ],
        bos: vec![
            BoEntry {
                addr: 0x7f00_0000_0000,
                size: 4096,
                offset: 0x1_0000,
                alloc_flags: KFD_ALLOC_MEM_FLAGS_VRAM,
                gpu_id: GPU_A,
                handle: Some(3),
            },
            BoEntry {
                addr: 0x7f00_0001_0000,
                size: 8192,
                offset: 0x2_0000,
                alloc_flags: KFD_USERPTR,
                gpu_id: GPU_A,
                handle: None,
            },
            BoEntry {
                addr: 0x7f00_0002_0000,
                size: 12288,
                offset: 0x3_0000,
                alloc_flags: KFD_ALLOC_MEM_FLAGS_GTT,
                gpu_id: GPU_B,
                handle: Some(9),
            },
            BoEntry {
                addr: 0x7f00_0003_0000,
                size: 100,
                offset: 0x4_0000,
                alloc_flags: KFD_ALLOC_MEM_FLAGS_VRAM,
                gpu_id: GPU_A,
                handle: None,
            },
        ],
        num_of_objects: 7,
        shared_mem_size: 4096,
        shared_mem_magic: 0xdead_beef,
        priv_data: (0..=255u8).cycle().take(1000).collect(),
    }
}

fn sample_render_node() -> RenderNodeImage {
    RenderNodeImage {
        gpu_id: GPU_A,
        drm: Some(RenderNodeDrm {
            id: 7,
            drm_render_minor: 128,
            bos: vec![
                DrmBoEntry {
                    addr: 0x7f00_1000_0000,
                    size: 4096,
                    offset: 0x10_0000,
                    alloc_flags: 4,
                    alignment: 4096,
                    preferred_domains: 4,
                    handle: 1,
                    is_import: false,
                    vms: vec![DrmVmEntry {
                        addr: 0x7f00_1000_0000,
                        size: 4096,
                        offset: 0,
                        flags: 0xe,
                    }],
                },
                DrmBoEntry {
                    addr: 0,
                    size: 8192,
                    offset: 0x20_0000,
                    alloc_flags: 0,
                    alignment: 0,
                    preferred_domains: 2,
                    handle: 2,
                    is_import: true,
                    vms: vec![],
                },
            ],
        }),
    }
}

/// Hand-encoded `kfd_bo_entry`; `handle: None` leaves field 6 out, as CRIU 4.2.
fn hand_bo(b: &BoEntry, handle: Option<u32>) -> Vec<u8> {
    let mut out = Vec::new();
    field_varint(&mut out, 1, b.addr);
    field_varint(&mut out, 2, b.size);
    field_varint(&mut out, 3, b.offset);
    field_varint(&mut out, 4, b.alloc_flags.into());
    field_varint(&mut out, 5, b.gpu_id.into());
    if let Some(h) = handle {
        field_varint(&mut out, 6, h.into());
    }
    out
}

/// Hand-encoded `criu_kfd` for `sample_kfd()`; `criu_dev` adds the handles.
fn hand_sample_kfd(criu_dev: bool) -> Vec<u8> {
    let k = sample_kfd();
    let mut out = Vec::new();
    field_varint(&mut out, 1, k.pid.into());
    field_varint(&mut out, 2, k.num_of_gpus.into());
    field_varint(&mut out, 3, k.num_of_cpus.into());
    field_bytes(
        &mut out,
        4,
        &hand_device(cpu_vals(0, 16), &[(2, 1), (2, 2)]),
    );
    field_bytes(
        &mut out,
        4,
        &hand_device(gpu_vals(1, GPU_A.into()), &[(2, 0), (11, 2)]),
    );
    field_bytes(
        &mut out,
        4,
        &hand_device(gpu_vals(2, GPU_B.into()), &[(2, 0), (11, 1)]),
    );
    field_varint(&mut out, 5, k.bos.len() as u64);
    for b in &k.bos {
        let handle = criu_dev.then_some(b.handle.unwrap_or(0xffff_ffff));
        field_bytes(&mut out, 6, &hand_bo(b, handle));
    }
    field_varint(&mut out, 7, k.num_of_objects.into());
    field_varint(&mut out, 8, k.shared_mem_size);
    field_varint(&mut out, 9, k.shared_mem_magic.into());
    field_bytes(&mut out, 10, &k.priv_data);
    out
}

fn hand_sample_render_node() -> Vec<u8> {
    let r = sample_render_node();
    let drm = r.drm.as_ref().unwrap();
    let mut out = Vec::new();
    field_varint(&mut out, 1, r.gpu_id.into());
    field_varint(&mut out, 2, drm.id.into());
    field_varint(&mut out, 3, drm.drm_render_minor.into());
    field_varint(&mut out, 4, drm.bos.len() as u64);
    for b in &drm.bos {
        let mut bo = Vec::new();
        field_varint(&mut bo, 1, b.addr);
        field_varint(&mut bo, 2, b.size);
        field_varint(&mut bo, 3, b.offset);
        field_varint(&mut bo, 4, b.alloc_flags);
        field_varint(&mut bo, 5, b.alignment);
        field_varint(&mut bo, 6, b.preferred_domains.into());
        field_varint(&mut bo, 7, b.handle.into());
        field_varint(&mut bo, 8, u64::from(b.is_import));
        field_varint(&mut bo, 9, b.vms.len() as u64);
        for v in &b.vms {
            let mut vm = Vec::new();
            field_varint(&mut vm, 1, v.addr);
            field_varint(&mut vm, 2, v.size);
            field_varint(&mut vm, 3, v.offset);
            field_varint(&mut vm, 4, v.flags);
            field_bytes(&mut bo, 10, &vm);
        }
        field_bytes(&mut out, 5, &bo);
    }
    out
}

fn expect_err<T: std::fmt::Debug>(r: Result<T, ImageError>, file: &str) -> ImageError {
    let e = r.expect_err("expected an error");
    let text = e.to_string();
    assert!(
        text.contains(file),
        "error message {text:?} does not name {file}"
    );
    assert_eq!(e.file(), file);
    e
}

fn limits() -> ReadLimits {
    ReadLimits::default()
}

/// The pages layout of GPU A in `sample_kfd()`.
fn gpu_a_layout() -> PagesLayout {
    PagesLayout::for_kfd_gpu(&sample_kfd(), GPU_A).unwrap()
}

/// `sample_kfd()` as the protobuf message.
fn kfd_proto() -> proto::CriuKfd {
    proto::CriuKfd::try_from(&sample_kfd()).unwrap()
}

/// `sample_render_node()` as the protobuf message.
fn render_node_proto() -> proto::CriuRenderNode {
    proto::CriuRenderNode::try_from(&sample_render_node()).unwrap()
}
