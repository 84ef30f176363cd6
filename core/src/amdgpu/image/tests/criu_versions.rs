//! CRIU 4.2 <-> criu-dev: images without the fields criu-dev added are read,
//! a 4.2 reader reads ours, and ours carry every field criu-dev requires.

use super::*;
use crate::amdgpu::image::wire::{self, FieldRule, MessageRules};

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
    // Some of the fields criu-dev added, not all.
    let mut partial = Vec::new();
    field_varint(&mut partial, 1, 1);
    field_varint(&mut partial, 2, 7);

    // bo_entries without num_of_bos
    let mut uncounted = Vec::new();
    field_varint(&mut uncounted, 1, 1);
    let mut bo = Vec::new();
    for tag in 1..=9 {
        field_varint(&mut bo, tag, 0);
    }
    field_bytes(&mut uncounted, 5, &bo);

    for p in [partial, uncounted] {
        let e = expect_err(decode_payload::<RenderNodeImage>(&p, "rn"), "rn");
        assert!(matches!(
            e,
            ImageError::Format {
                error: FormatError::Invalid { .. },
                ..
            }
        ));
    }
}
