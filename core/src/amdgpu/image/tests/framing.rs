//! Framing and encoding: file names, round trips and byte-exact
//! compatibility with the C plugin's images.

use super::*;

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

/// Encodes `k` with the C plugin's framing and checks that it decodes to `k`.
fn assert_framed_round_trip(k: &KfdCheckpoint) {
    let bytes = encode_framed(k, "x").unwrap();
    assert_eq!(
        decode_framed::<KfdCheckpoint>(&bytes, "x", &limits()).unwrap(),
        *k
    );
}

#[test]
fn kfd_round_trip() {
    let t = TempDir::new();
    let k = sample_kfd();
    t.dir().write_kfd(5, &k).unwrap();
    assert_eq!(t.dir().read_kfd(5, &limits()).unwrap(), k);
    assert_framed_round_trip(&k);
}

#[test]
fn render_node_round_trip_both_shapes() {
    let t = TempDir::new();
    let legacy = RenderNodeImage {
        gpu_id: GPU_B,
        drm: None,
    };
    let empty = RenderNodeImage {
        gpu_id: GPU_B,
        drm: Some(RenderNodeDrm::default()),
    };
    for (id, r) in [(7, sample_render_node()), (8, legacy), (9, empty)] {
        t.dir().write_render_node(id, &r).unwrap();
        assert_eq!(t.dir().read_render_node(id, &limits()).unwrap(), r);
    }
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
    assert_framed_round_trip(&KfdCheckpoint::default());
}

// ---------------------------------------------------------------------------
// Byte-exact compatibility with the C plugin

#[test]
fn dmabuf_file_bytes_are_exact() {
    let t = TempDir::new();
    t.put_dmabuf(3, 5);
    let expected = with_header(2, &[0x08, 0x05]);
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
    t.put_dmabuf(1, 5);
    assert_eq!(t.get("amdgpu-dmabuf_1.img"), framed(&[0x08, 0x05]));
}
