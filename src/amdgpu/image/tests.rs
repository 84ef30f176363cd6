//! Tests of the AMD image format: round trips, byte-exact compatibility with
//! the C plugin's framing and encoding (expected bytes are built by hand, not
//! by prost), CRIU 4.2 <-> criu-dev compatibility, hostile images and a
//! no-panic loop over random input.

use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use super::wire::{self, FieldRule, MessageRules};
use super::*;

// ---------------------------------------------------------------------------
// Helpers

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

/// The C plugin's framing: native-endian size_t, then the payload.
fn framed(payload: &[u8]) -> Vec<u8> {
    let mut out = payload.len().to_ne_bytes().to_vec();
    out.extend_from_slice(payload);
    out
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
const KFD_USERPTR: u32 = 1 << 2;

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

// ---------------------------------------------------------------------------
// File names

#[test]
fn file_names_match_the_c_templates() {
    assert_eq!(kfd_file_name(5), "amdgpu-kfd-5.img");
    assert_eq!(render_node_file_name(12), "amdgpu-renderD-12.img");
    assert_eq!(dmabuf_file_name(3), "amdgpu-dmabuf_3.img");
    assert_eq!(kfd_pages_file_name(5, 0xab), "amdgpu-pages-5-00ab.img");
    assert_eq!(kfd_pages_file_name(5, 0x1a2b), "amdgpu-pages-5-1a2b.img");
    assert_eq!(kfd_pages_file_name(5, 0x12345), "amdgpu-pages-5-12345.img");
    assert_eq!(
        drm_pages_file_name(4, 129, 0x1f),
        "amdgpu-drm-pages-4-129-001f.img"
    );
    // checkpointctl counts GPU memory by this prefix.
    assert!(kfd_pages_file_name(1, 1).starts_with("amdgpu-pages-"));
}

#[test]
fn names_that_leave_the_directory_are_refused() {
    let t = TempDir::new();
    for bad in [
        "",
        ".",
        "..",
        "../amdgpu-kfd-1.img",
        "a/b",
        "/etc/passwd",
        "x\0y",
    ] {
        assert!(matches!(
            check_file_name(bad),
            Err(ImageError::InvalidName { .. })
        ));
        let r = t.dir().read_message::<DmabufImage>(bad, &limits());
        assert!(matches!(r, Err(ImageError::InvalidName { .. })), "{bad:?}");
        let w = t.dir().write_message(bad, &DmabufImage { gem_handle: 1 });
        assert!(matches!(w, Err(ImageError::InvalidName { .. })), "{bad:?}");
    }
    assert!(check_file_name("amdgpu-kfd-1.img").is_ok());
}

// ---------------------------------------------------------------------------
// Round trips

#[test]
fn kfd_round_trip() {
    let t = TempDir::new();
    let k = sample_kfd();
    t.dir().write_kfd(5, &k).unwrap();
    assert_eq!(t.dir().read_kfd(5, &limits()).unwrap(), k);
    let bytes = encode_framed(&k, "x").unwrap();
    assert_eq!(
        decode_framed::<KfdCheckpoint>(&bytes, "x", &limits()).unwrap(),
        k
    );
}

#[test]
fn render_node_round_trip_both_shapes() {
    let t = TempDir::new();
    let r = sample_render_node();
    t.dir().write_render_node(7, &r).unwrap();
    assert_eq!(t.dir().read_render_node(7, &limits()).unwrap(), r);

    let legacy = RenderNodeImage {
        gpu_id: GPU_B,
        drm: None,
    };
    t.dir().write_render_node(8, &legacy).unwrap();
    assert_eq!(t.dir().read_render_node(8, &limits()).unwrap(), legacy);

    let empty = RenderNodeImage {
        gpu_id: GPU_B,
        drm: Some(RenderNodeDrm::default()),
    };
    t.dir().write_render_node(9, &empty).unwrap();
    assert_eq!(t.dir().read_render_node(9, &limits()).unwrap(), empty);
}

#[test]
fn dmabuf_round_trip() {
    let t = TempDir::new();
    for h in [0, 1, 0x7fff_ffff, u32::MAX] {
        let d = DmabufImage { gem_handle: h };
        t.dir().write_dmabuf(h % 1000, &d).unwrap();
        assert_eq!(t.dir().read_dmabuf(h % 1000, &limits()).unwrap(), d);
    }
}

#[test]
fn empty_kfd_round_trip() {
    let k = KfdCheckpoint::default();
    let bytes = encode_framed(&k, "x").unwrap();
    assert_eq!(
        decode_framed::<KfdCheckpoint>(&bytes, "x", &limits()).unwrap(),
        k
    );
}

// ---------------------------------------------------------------------------
// Byte-exact compatibility with the C plugin

#[test]
fn dmabuf_file_bytes_are_exact() {
    let t = TempDir::new();
    t.dir()
        .write_dmabuf(3, &DmabufImage { gem_handle: 5 })
        .unwrap();
    let mut expected = 2usize.to_ne_bytes().to_vec();
    expected.extend_from_slice(&[0x08, 0x05]);
    assert_eq!(t.get("amdgpu-dmabuf_3.img"), expected);
}

#[test]
fn required_zero_fields_are_still_encoded() {
    // protobuf-c emits every required field, zero or not; so must we, or the
    // C reader refuses the image. Fields in number order, priv_data empty.
    let bytes = encode_framed(&KfdCheckpoint::default(), "x").unwrap();
    let payload = [
        0x08, 0x00, // pid
        0x10, 0x00, // num_of_gpus
        0x18, 0x00, // num_of_cpus
        0x28, 0x00, // num_of_bos
        0x38, 0x00, // num_of_objects
        0x40, 0x00, // shared_mem_size
        0x48, 0x00, // shared_mem_magic
        0x52, 0x00, // priv_data, empty
    ];
    assert_eq!(bytes, framed(&payload));

    let legacy = RenderNodeImage {
        gpu_id: 0,
        drm: None,
    };
    assert_eq!(encode_framed(&legacy, "x").unwrap(), framed(&[0x08, 0x00]));
}

#[test]
fn kfd_file_bytes_are_exact() {
    let t = TempDir::new();
    t.dir().write_kfd(5, &sample_kfd()).unwrap();
    assert_eq!(t.get("amdgpu-kfd-5.img"), framed(&hand_sample_kfd(true)));
}

#[test]
fn render_node_file_bytes_are_exact() {
    let t = TempDir::new();
    t.dir().write_render_node(7, &sample_render_node()).unwrap();
    assert_eq!(
        t.get("amdgpu-renderD-7.img"),
        framed(&hand_sample_render_node())
    );
}

#[test]
fn no_handle_is_written_as_all_ones() {
    let bo = BoEntry {
        gpu_id: 1,
        ..BoEntry::default()
    };
    let k = KfdCheckpoint {
        num_of_gpus: 1,
        devices: vec![device_from_vals(gpu_vals(1, 1), &[])],
        bos: vec![bo],
        ..KfdCheckpoint::default()
    };
    let payload = encode_payload(&k, "x").unwrap();
    let mut expected_bo = hand_bo(&bo, None);
    expected_bo.extend_from_slice(&[0x30, 0xff, 0xff, 0xff, 0xff, 0x0f]);
    let mut needle = Vec::new();
    field_bytes(&mut needle, 6, &expected_bo);
    assert!(payload.windows(needle.len()).any(|w| w == needle));
}

#[test]
fn hand_built_images_decode_to_the_expected_structs() {
    let t = TempDir::new();
    t.put("amdgpu-kfd-1.img", &framed(&hand_sample_kfd(true)));
    assert_eq!(t.dir().read_kfd(1, &limits()).unwrap(), sample_kfd());
    t.put("amdgpu-renderD-2.img", &framed(&hand_sample_render_node()));
    assert_eq!(
        t.dir().read_render_node(2, &limits()).unwrap(),
        sample_render_node()
    );
}

#[test]
fn field_order_does_not_matter_on_read() {
    // proto2 allows fields in any order; protobuf-c accepts that too.
    let mut shuffled = Vec::new();
    field_varint(&mut shuffled, 4, 0);
    field_varint(&mut shuffled, 3, 130);
    field_varint(&mut shuffled, 1, 0x1a2b);
    field_varint(&mut shuffled, 2, 9);
    let r: RenderNodeImage = decode_payload(&shuffled, "x").unwrap();
    assert_eq!(
        r,
        RenderNodeImage {
            gpu_id: 0x1a2b,
            drm: Some(RenderNodeDrm {
                id: 9,
                drm_render_minor: 130,
                bos: vec![]
            })
        }
    );
}

#[test]
fn stale_tail_after_the_payload_is_ignored() {
    // The C plugin opens without O_TRUNC, so a re-dump can leave old bytes
    // behind its payload; it reads only `size` bytes. So do we.
    let t = TempDir::new();
    let mut bytes = framed(&[0x08, 0x05]);
    bytes.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
    t.put("amdgpu-dmabuf_1.img", &bytes);
    assert_eq!(
        t.dir().read_dmabuf(1, &limits()).unwrap(),
        DmabufImage { gem_handle: 5 }
    );
}

#[test]
fn writing_truncates_an_existing_longer_file() {
    let t = TempDir::new();
    t.put("amdgpu-dmabuf_1.img", &[0xaa; 100]);
    t.dir()
        .write_dmabuf(1, &DmabufImage { gem_handle: 5 })
        .unwrap();
    assert_eq!(t.get("amdgpu-dmabuf_1.img"), framed(&[0x08, 0x05]));
}

// ---------------------------------------------------------------------------
// CRIU 4.2 <-> criu-dev

/// `kfd_bo_entry` as CRIU 4.2 knows it (no handle).
#[derive(Clone, PartialEq, prost::Message)]
struct V42BoEntry {
    #[prost(uint64, required, tag = "1")]
    addr: u64,
    #[prost(uint64, required, tag = "2")]
    size: u64,
    #[prost(uint64, required, tag = "3")]
    offset: u64,
    #[prost(uint32, required, tag = "4")]
    alloc_flags: u32,
    #[prost(uint32, required, tag = "5")]
    gpu_id: u32,
}

/// `criu_kfd` as CRIU 4.2 knows it.
#[derive(Clone, PartialEq, prost::Message)]
struct V42CriuKfd {
    #[prost(uint32, required, tag = "1")]
    pid: u32,
    #[prost(uint32, required, tag = "2")]
    num_of_gpus: u32,
    #[prost(uint32, required, tag = "3")]
    num_of_cpus: u32,
    #[prost(message, repeated, tag = "4")]
    device_entries: Vec<proto::KfdDeviceEntry>,
    #[prost(uint64, required, tag = "5")]
    num_of_bos: u64,
    #[prost(message, repeated, tag = "6")]
    bo_entries: Vec<V42BoEntry>,
    #[prost(uint32, required, tag = "7")]
    num_of_objects: u32,
    #[prost(uint64, required, tag = "8")]
    shared_mem_size: u64,
    #[prost(uint32, required, tag = "9")]
    shared_mem_magic: u32,
    #[prost(bytes = "vec", required, tag = "10")]
    priv_data: Vec<u8>,
}

/// `criu_render_node` as CRIU 4.2 knows it.
#[derive(Clone, PartialEq, prost::Message)]
struct V42RenderNode {
    #[prost(uint32, required, tag = "1")]
    gpu_id: u32,
}

/// Presence rules of the criu-dev C reader, where every field is required.
static CRIU_DEV_BO: MessageRules = MessageRules {
    name: "kfd_bo_entry",
    fields: &[FieldRule {
        tag: 6,
        name: "handle",
        required: true,
        nested: None,
    }],
};
static CRIU_DEV_KFD: MessageRules = MessageRules {
    name: "criu_kfd",
    fields: &[FieldRule {
        tag: 6,
        name: "bo_entries",
        required: false,
        nested: Some(&CRIU_DEV_BO),
    }],
};
static CRIU_DEV_RENDER_NODE: MessageRules = MessageRules {
    name: "criu_render_node",
    fields: &[
        FieldRule {
            tag: 2,
            name: "id",
            required: true,
            nested: None,
        },
        FieldRule {
            tag: 3,
            name: "drm_render_minor",
            required: true,
            nested: None,
        },
        FieldRule {
            tag: 4,
            name: "num_of_bos",
            required: true,
            nested: None,
        },
    ],
};

#[test]
fn criu_4_2_images_are_read() {
    // Direction that breaks the criu-dev C plugin (its proto2 parser rejects a
    // message that lacks a required field): images without the fields criu-dev
    // added. We accept them.
    let t = TempDir::new();
    t.put("amdgpu-kfd-1.img", &framed(&hand_sample_kfd(false)));
    let k = t.dir().read_kfd(1, &limits()).unwrap();
    let mut expected = sample_kfd();
    for b in &mut expected.bos {
        b.handle = None;
    }
    assert_eq!(k, expected);

    t.put("amdgpu-renderD-2.img", &framed(&[0x08, 0xab, 0x34]));
    assert_eq!(
        t.dir().read_render_node(2, &limits()).unwrap(),
        RenderNodeImage {
            gpu_id: 0x1a2b,
            drm: None
        }
    );
}

#[test]
fn criu_4_2_reader_reads_our_images() {
    // A 4.2 reader skips the fields it does not know (protobuf-c and prost
    // both skip unknown fields) and sees the same values for the rest.
    use prost::Message as _;
    let k = sample_kfd();
    let payload = encode_payload(&k, "x").unwrap();
    let old = V42CriuKfd::decode(&payload[..]).unwrap();
    assert_eq!(old.pid, k.pid);
    assert_eq!(old.num_of_gpus, k.num_of_gpus);
    assert_eq!(old.num_of_cpus, k.num_of_cpus);
    assert_eq!(old.device_entries.len(), k.devices.len());
    assert_eq!(old.num_of_bos, k.bos.len() as u64);
    for (o, n) in old.bo_entries.iter().zip(&k.bos) {
        assert_eq!(
            (o.addr, o.size, o.offset, o.alloc_flags, o.gpu_id),
            (n.addr, n.size, n.offset, n.alloc_flags, n.gpu_id)
        );
    }
    assert_eq!(old.num_of_objects, k.num_of_objects);
    assert_eq!(old.shared_mem_size, k.shared_mem_size);
    assert_eq!(old.shared_mem_magic, k.shared_mem_magic);
    assert_eq!(old.priv_data, k.priv_data);
    // And our decoder's view of the devices equals what 4.2 sees.
    let devices: Vec<DeviceEntry> = old.device_entries.into_iter().map(Into::into).collect();
    assert_eq!(devices, k.devices);

    let r = sample_render_node();
    let payload = encode_payload(&r, "x").unwrap();
    assert_eq!(
        V42RenderNode::decode(&payload[..]).unwrap().gpu_id,
        r.gpu_id
    );
}

#[test]
fn our_images_carry_every_field_criu_dev_requires() {
    let payload = encode_payload(&sample_kfd(), "x").unwrap();
    wire::check_required(&payload, &CRIU_DEV_KFD).unwrap();
    wire::check_required(&payload, &wire::CRIU_KFD).unwrap();
    let payload = encode_payload(&sample_render_node(), "x").unwrap();
    wire::check_required(&payload, &CRIU_DEV_RENDER_NODE).unwrap();
    wire::check_required(&payload, &wire::CRIU_RENDER_NODE).unwrap();
    // The 4.2 image without handles would fail the criu-dev C reader.
    assert!(matches!(
        wire::check_required(&hand_sample_kfd(false), &CRIU_DEV_KFD),
        Err(FormatError::MissingField {
            field: "handle",
            ..
        })
    ));
}

#[test]
fn partial_criu_dev_render_node_is_refused() {
    let mut p = Vec::new();
    field_varint(&mut p, 1, 1);
    field_varint(&mut p, 2, 7);
    let e = expect_err(decode_payload::<RenderNodeImage>(&p, "rn"), "rn");
    assert!(matches!(
        e,
        ImageError::Format {
            error: FormatError::Invalid { .. },
            ..
        }
    ));

    // bo_entries without num_of_bos
    let mut p = Vec::new();
    field_varint(&mut p, 1, 1);
    let mut bo = Vec::new();
    for tag in 1..=9 {
        field_varint(&mut bo, tag, 0);
    }
    field_bytes(&mut p, 5, &bo);
    let e = expect_err(decode_payload::<RenderNodeImage>(&p, "rn"), "rn");
    assert!(matches!(
        e,
        ImageError::Format {
            error: FormatError::Invalid { .. },
            ..
        }
    ));
}

// ---------------------------------------------------------------------------
// Hostile images

#[test]
fn file_shorter_than_the_header() {
    let t = TempDir::new();
    for len in [0, 1, HEADER_LEN - 1] {
        t.put("amdgpu-kfd-1.img", &vec![0; len]);
        let e = expect_err(t.dir().read_kfd(1, &limits()), "amdgpu-kfd-1.img");
        assert!(matches!(e, ImageError::MissingHeader { .. }), "{e}");
        assert_eq!(e.errno(), libc::EIO);
    }
}

#[test]
fn length_prefix_larger_than_the_file() {
    let t = TempDir::new();
    let mut bytes = 100usize.to_ne_bytes().to_vec();
    bytes.extend_from_slice(&[0x08, 0x05]);
    t.put("amdgpu-dmabuf_1.img", &bytes);
    let e = expect_err(t.dir().read_dmabuf(1, &limits()), "amdgpu-dmabuf_1.img");
    assert!(
        matches!(
            e,
            ImageError::LengthExceedsFile {
                declared: 100,
                available: 2,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn length_over_the_maximum_is_refused_before_allocating() {
    let t = TempDir::new();
    // Huge declared size on a tiny file: refused by the limit, not by an
    // allocation failure.
    let mut bytes = usize::MAX.to_ne_bytes().to_vec();
    bytes.extend_from_slice(&[0x08, 0x05]);
    t.put("amdgpu-kfd-1.img", &bytes);
    let e = expect_err(t.dir().read_kfd(1, &limits()), "amdgpu-kfd-1.img");
    assert!(matches!(e, ImageError::LengthExceedsLimit { .. }), "{e}");

    // A real payload over a configured limit.
    let k = sample_kfd();
    t.dir().write_kfd(2, &k).unwrap();
    let small = ReadLimits {
        max_message_size: 64,
    };
    let e = expect_err(t.dir().read_kfd(2, &small), "amdgpu-kfd-2.img");
    assert!(
        matches!(e, ImageError::LengthExceedsLimit { limit: 64, .. }),
        "{e}"
    );
    assert!(t.dir().read_kfd(2, &limits()).is_ok());
}

#[test]
fn garbage_protobuf_is_refused() {
    let t = TempDir::new();
    let cases: [&[u8]; 6] = [
        &[0xff; 16],               // endless varint key
        &[0x0a, 0x7f, 0x01],       // length past the end
        &[0x0b, 0x00],             // group start
        &[0x08],                   // key without value
        &[0x07, 0x00],             // field number 0
        &[0x22, 0x02, 0xff, 0xff], // device entry holding garbage
    ];
    for (i, payload) in cases.iter().enumerate() {
        let name = kfd_file_name(i as u32);
        t.put(&name, &framed(payload));
        let e = expect_err(t.dir().read_kfd(i as u32, &limits()), &name);
        assert!(
            matches!(e, ImageError::Format { .. } | ImageError::Decode { .. }),
            "{e}"
        );
        assert_eq!(e.errno(), libc::EINVAL);
    }
}

#[test]
fn missing_required_fields_are_refused() {
    let t = TempDir::new();
    // Empty payload: prost alone would accept it as all zeros.
    t.put("amdgpu-kfd-1.img", &framed(&[]));
    let e = expect_err(t.dir().read_kfd(1, &limits()), "amdgpu-kfd-1.img");
    assert!(matches!(
        e,
        ImageError::Format {
            error: FormatError::MissingField {
                message: "criu_kfd",
                field: "pid"
            },
            ..
        }
    ));
    // A dma-buf image is not a KFD image.
    t.dir()
        .write_dmabuf(2, &DmabufImage { gem_handle: 1 })
        .unwrap();
    let e = t
        .dir()
        .read_message::<KfdCheckpoint>("amdgpu-dmabuf_2.img", &limits())
        .unwrap_err();
    assert!(matches!(e, ImageError::Format { .. }), "{e}");
    // A nested required field: device entry without vram_size.
    let mut dev = Vec::new();
    for (i, &v) in gpu_vals(1, 1)[..30].iter().enumerate() {
        field_varint(&mut dev, i as u32 + 1, v);
    }
    let mut p = hand_sample_kfd(true);
    field_bytes(&mut p, 4, &dev);
    let e = expect_err(decode_payload::<KfdCheckpoint>(&p, "k"), "k");
    assert!(
        matches!(
            e,
            ImageError::Format {
                error: FormatError::MissingField {
                    message: "kfd_device_entry",
                    field: "vram_size"
                },
                ..
            }
        ),
        "{e}"
    );
}

fn kfd_proto() -> proto::CriuKfd {
    proto::CriuKfd::try_from(&sample_kfd()).unwrap()
}

fn decode_proto<T: ImageMessage>(p: &T::Proto) -> Result<T, ImageError> {
    use prost::Message as _;
    decode_payload::<T>(&p.encode_to_vec(), "img")
}

#[test]
fn count_mismatches_are_refused() {
    let mut p = kfd_proto();
    p.num_of_bos = 3;
    let e = expect_err(decode_proto::<KfdCheckpoint>(&p), "img");
    assert!(
        matches!(
            e,
            ImageError::Format {
                error: FormatError::CountMismatch {
                    field: "num_of_bos",
                    declared: 3,
                    actual: 4,
                    ..
                },
                ..
            }
        ),
        "{e}"
    );

    let mut p = kfd_proto();
    p.num_of_cpus = 5;
    let e = expect_err(decode_proto::<KfdCheckpoint>(&p), "img");
    assert!(matches!(
        e,
        ImageError::Format {
            error: FormatError::CountMismatch { .. },
            ..
        }
    ));

    let mut r = proto::CriuRenderNode::try_from(&sample_render_node()).unwrap();
    r.num_of_bos = Some(1);
    let e = expect_err(decode_proto::<RenderNodeImage>(&r), "img");
    assert!(matches!(
        e,
        ImageError::Format {
            error: FormatError::CountMismatch { .. },
            ..
        }
    ));

    let mut r = proto::CriuRenderNode::try_from(&sample_render_node()).unwrap();
    r.bo_entries[0].num_of_vms = 2;
    let e = expect_err(decode_proto::<RenderNodeImage>(&r), "img");
    assert!(
        matches!(
            e,
            ImageError::Format {
                error: FormatError::CountMismatch {
                    message: "drm_bo_entry",
                    field: "num_of_vms",
                    ..
                },
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn inconsistent_images_are_refused() {
    // BO on a GPU no device entry lists.
    let mut p = kfd_proto();
    p.bo_entries[0].gpu_id = 0x9999;
    let e = expect_err(decode_proto::<KfdCheckpoint>(&p), "img");
    assert!(e.to_string().contains("0x9999"), "{e}");
    // Two device entries with one gpu_id.
    let mut p = kfd_proto();
    p.device_entries[2].gpu_id = GPU_A;
    assert!(decode_proto::<KfdCheckpoint>(&p).is_err());
    // is_import other than 0/1.
    let mut r = proto::CriuRenderNode::try_from(&sample_render_node()).unwrap();
    r.bo_entries[0].is_import = 2;
    assert!(decode_proto::<RenderNodeImage>(&r).is_err());
    // The writer validates too.
    let mut k = sample_kfd();
    k.num_of_gpus = 9;
    let t = TempDir::new();
    assert!(t.dir().write_kfd(1, &k).is_err());
    let mut k = sample_kfd();
    k.bos[0].handle = Some(NO_GEM_HANDLE);
    assert!(t.dir().write_kfd(1, &k).is_err());
}

#[test]
fn missing_file_is_reported_as_not_found() {
    let t = TempDir::new();
    let e = expect_err(t.dir().read_kfd(77, &limits()), "amdgpu-kfd-77.img");
    assert!(e.is_not_found());
    assert_eq!(e.errno(), libc::ENOENT);
}

#[test]
fn symlinks_and_special_files_are_refused() {
    let t = TempDir::new();
    t.dir()
        .write_dmabuf(1, &DmabufImage { gem_handle: 5 })
        .unwrap();
    std::os::unix::fs::symlink(t.file("amdgpu-dmabuf_1.img"), t.file("amdgpu-dmabuf_2.img"))
        .unwrap();
    let e = expect_err(t.dir().read_dmabuf(2, &limits()), "amdgpu-dmabuf_2.img");
    assert!(matches!(e, ImageError::Io { .. }), "{e}");

    // A FIFO must neither block the open nor be read.
    let fifo = std::ffi::CString::new(t.file("amdgpu-dmabuf_3.img").as_os_str().as_encoded_bytes())
        .unwrap();
    // SAFETY: `fifo` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let e = expect_err(t.dir().read_dmabuf(3, &limits()), "amdgpu-dmabuf_3.img");
    assert!(matches!(e, ImageError::NotRegularFile { .. }), "{e}");

    fs::create_dir(t.file("amdgpu-dmabuf_4.img")).unwrap();
    assert!(t.dir().read_dmabuf(4, &limits()).is_err());
}

// ---------------------------------------------------------------------------
// Pages files

fn pattern(bo: usize, i: u64) -> u8 {
    (bo as u64 * 31 + i * 7 + i / 251) as u8
}

#[test]
fn kfd_pages_layout_follows_the_c_plugin() {
    let k = sample_kfd();
    let a = PagesLayout::for_kfd_gpu(&k, GPU_A).unwrap();
    // BO 1 is userptr (no contents), BO 2 belongs to GPU B.
    assert_eq!(
        a.spans(),
        &[
            BoSpan {
                bo: 0,
                offset: 0,
                size: 4096
            },
            BoSpan {
                bo: 3,
                offset: 4096,
                size: 100
            }
        ]
    );
    assert_eq!(a.total(), 4196);
    let b = PagesLayout::for_kfd_gpu(&k, GPU_B).unwrap();
    assert_eq!(b.total(), 12288);
    assert!(a.find(1).is_none());
    let chunks: Vec<_> = a.spans()[1].chunks(30).collect();
    assert_eq!(chunks, [(0, 30), (30, 30), (60, 30), (90, 10)]);
    assert!(PagesLayout::from_sizes([(1, 1), (1, 1)]).is_err());
    assert!(PagesLayout::from_sizes([(0, u64::MAX), (1, 1)]).is_err());
    assert!(PagesLayout::from_sizes([(0, u64::MAX)]).is_err());
}

#[test]
fn kfd_pages_concurrent_write_and_read_back_exact_bytes() {
    let t = TempDir::new();
    let k = sample_kfd();
    let layout = PagesLayout::for_kfd_gpu(&k, GPU_A).unwrap();
    let writer = t.dir().create_kfd_pages(5, GPU_A, layout.clone()).unwrap();
    assert_eq!(writer.file_name(), "amdgpu-pages-5-1a2b.img");

    // Every chunk of every BO, spread over four threads, in reverse order.
    let mut jobs = Vec::new();
    for span in layout.spans() {
        for (off, len) in span.chunks(1000) {
            jobs.push((span.bo, off, len));
        }
    }
    jobs.reverse();
    std::thread::scope(|s| {
        for part in jobs.chunks(jobs.len().div_ceil(4)) {
            let writer = &writer;
            s.spawn(move || {
                for &(bo, off, len) in part {
                    let data: Vec<u8> = (off..off + len as u64).map(|i| pattern(bo, i)).collect();
                    writer.write_chunk(bo, off, &data).unwrap();
                }
            });
        }
    });
    writer.finish().unwrap();

    // Header = sum of the sizes, then the BOs back to back in image order.
    let mut expected = 4196usize.to_ne_bytes().to_vec();
    expected.extend((0..4096).map(|i| pattern(0, i)));
    expected.extend((0..100).map(|i| pattern(3, i)));
    assert_eq!(t.get("amdgpu-pages-5-1a2b.img"), expected);

    let reader = t.dir().open_kfd_pages(5, GPU_A, layout.clone()).unwrap();
    std::thread::scope(|s| {
        for span in layout.spans() {
            let reader = &reader;
            s.spawn(move || {
                let mut buf = [0u8; 333];
                for (off, len) in span.chunks(buf.len()) {
                    reader.read_chunk(span.bo, off, &mut buf[..len]).unwrap();
                    for (j, &b) in buf[..len].iter().enumerate() {
                        assert_eq!(b, pattern(span.bo, off + j as u64));
                    }
                }
            });
        }
    });
}

#[test]
fn pages_chunk_errors() {
    let t = TempDir::new();
    let layout = PagesLayout::for_kfd_gpu(&sample_kfd(), GPU_A).unwrap();
    let w = t.dir().create_kfd_pages(5, GPU_A, layout.clone()).unwrap();
    let name = "amdgpu-pages-5-1a2b.img";
    let e = expect_err(w.write_chunk(3, 90, &[0; 11]), name);
    assert!(matches!(e, ImageError::BoRange { bo: 3, .. }), "{e}");
    let e = expect_err(w.write_chunk(3, u64::MAX, &[0; 2]), name);
    assert!(matches!(e, ImageError::BoRange { .. }), "{e}");
    let e = expect_err(w.write_chunk(1, 0, &[0; 1]), name);
    assert!(matches!(e, ImageError::NoSuchBo { bo: 1, .. }), "{e}");
    w.write_chunk(0, 0, &[1; 4096]).unwrap();
    w.write_chunk(3, 0, &[1; 50]).unwrap();
    let e = expect_err(w.finish(), name);
    assert!(
        matches!(
            e,
            ImageError::BoIncomplete {
                bo: 3,
                written: 50,
                size: 100,
                ..
            }
        ),
        "{e}"
    );

    let w = t.dir().create_kfd_pages(5, GPU_A, layout.clone()).unwrap();
    w.write_chunk(0, 0, &[1; 4096]).unwrap();
    w.write_chunk(3, 0, &[1; 100]).unwrap();
    w.finish().unwrap();
    let r = t.dir().open_kfd_pages(5, GPU_A, layout).unwrap();
    let mut buf = [0u8; 8];
    let e = expect_err(r.read_chunk(3, 95, &mut buf), name);
    assert!(matches!(e, ImageError::BoRange { .. }), "{e}");
}

#[test]
fn pages_file_shorter_than_a_bo_names_the_bo() {
    let t = TempDir::new();
    let layout = PagesLayout::for_kfd_gpu(&sample_kfd(), GPU_A).unwrap();
    let name = "amdgpu-pages-5-1a2b.img";
    // Right header, but BO 3 has only 40 of its 100 bytes.
    let mut bytes = 4196usize.to_ne_bytes().to_vec();
    bytes.extend(std::iter::repeat_n(0u8, 4096 + 40));
    t.put(name, &bytes);
    let e = expect_err(t.dir().open_kfd_pages(5, GPU_A, layout.clone()), name);
    assert!(
        matches!(
            e,
            ImageError::BoTruncated {
                bo: 3,
                size: 100,
                present: 40,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("BO 3"));

    // Wrong header: the C plugin refuses it with -EINVAL, so do we.
    let mut bytes = 4000usize.to_ne_bytes().to_vec();
    bytes.extend(std::iter::repeat_n(0u8, 4196));
    t.put(name, &bytes);
    let e = expect_err(t.dir().open_kfd_pages(5, GPU_A, layout.clone()), name);
    assert!(matches!(
        e,
        ImageError::PagesSizeMismatch {
            header: 4000,
            expected: 4196,
            ..
        }
    ));

    t.put(name, &[1, 2, 3]);
    let e = expect_err(t.dir().open_kfd_pages(5, GPU_A, layout), name);
    assert!(matches!(e, ImageError::MissingHeader { .. }));
}

#[test]
fn drm_pages_ignore_the_c_plugins_garbage_header() {
    let t = TempDir::new();
    let name = "amdgpu-drm-pages-4-129-0001.img";
    let mut bytes = 0x5a5a_5a5a_5a5a_5a5au64.to_ne_bytes().to_vec();
    bytes.extend((0..300).map(|i| pattern(1, i)));
    t.put(name, &bytes);
    let r = t.dir().open_drm_pages(4, 129, 1, 300).unwrap();
    let mut buf = vec![0u8; 300];
    r.read_chunk(1, 0, &mut buf).unwrap();
    assert!(
        buf.iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(1, i as u64))
    );

    let e = expect_err(t.dir().open_drm_pages(4, 129, 1, 301), name);
    assert!(matches!(e, ImageError::BoTruncated { bo: 1, .. }), "{e}");

    // We write a correct header.
    let w = t.dir().create_drm_pages(4, 129, 2, 3).unwrap();
    w.write_chunk(2, 0, &[7, 8, 9]).unwrap();
    w.finish().unwrap();
    let mut expected = 3usize.to_ne_bytes().to_vec();
    expected.extend_from_slice(&[7, 8, 9]);
    assert_eq!(t.get("amdgpu-drm-pages-4-129-0002.img"), expected);

    // An absurd BO size from a hostile image is refused, not allocated.
    assert!(t.dir().open_drm_pages(4, 129, 1, u64::MAX).is_err());
}

// ---------------------------------------------------------------------------
// Random input never panics

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn decode_all(payload: &[u8]) {
    let _ = decode_payload::<KfdCheckpoint>(payload, "fuzz");
    let _ = decode_payload::<RenderNodeImage>(payload, "fuzz");
    let _ = decode_payload::<DmabufImage>(payload, "fuzz");
    let _ = decode_framed::<KfdCheckpoint>(payload, "fuzz", &limits());
    for rules in [
        &wire::CRIU_KFD,
        &wire::CRIU_RENDER_NODE,
        &wire::CRIU_DMABUF_NODE,
    ] {
        let _ = wire::check_required(payload, rules);
    }
}

#[test]
fn decoders_never_panic_on_random_bytes() {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for _ in 0..5000 {
        let len = rng.below(200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        decode_all(&bytes);
    }
}

#[test]
fn decoders_never_panic_on_mutated_images() {
    let mut rng = XorShift(0x0123_4567_89ab_cdef);
    let seeds = [
        encode_payload(&sample_kfd(), "x").unwrap(),
        encode_payload(&sample_render_node(), "x").unwrap(),
        hand_sample_kfd(false),
    ];
    for _ in 0..3000 {
        let mut bytes = seeds[rng.below(seeds.len())].clone();
        match rng.below(3) {
            0 => {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(bytes.len());
                    bytes[i] ^= 1 << rng.below(8);
                }
            }
            1 => bytes.truncate(rng.below(bytes.len())),
            _ => {
                let i = rng.below(bytes.len());
                bytes.insert(i, rng.next() as u8);
            }
        }
        decode_all(&bytes);
    }
}

#[test]
fn random_files_never_panic_the_file_readers() {
    let t = TempDir::new();
    let mut rng = XorShift(0xfeed_face_cafe_beef);
    let layout = PagesLayout::for_kfd_gpu(&sample_kfd(), GPU_A).unwrap();
    for i in 0..200u32 {
        let len = rng.below(64);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if rng.below(2) == 0 && bytes.len() >= HEADER_LEN {
            // Plausible header.
            let n = (bytes.len() - HEADER_LEN + rng.below(3)).saturating_sub(1);
            bytes[..HEADER_LEN].copy_from_slice(&n.to_ne_bytes());
        }
        t.put(&kfd_file_name(i), &bytes);
        let _ = t.dir().read_kfd(i, &limits());
        let _ = t
            .dir()
            .read_message::<RenderNodeImage>(&kfd_file_name(i), &limits());
        t.put(&kfd_pages_file_name(i, GPU_A), &bytes);
        let _ = t.dir().open_kfd_pages(i, GPU_A, layout.clone());
    }
}
