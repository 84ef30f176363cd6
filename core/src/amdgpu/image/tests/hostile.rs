//! Hostile images: truncated or oversized files, garbage protobuf, missing
//! required fields, counts and references that do not agree, and files that
//! are not regular.

use super::*;

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
    let bytes = with_header(100, &[0x08, 0x05]);
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
    let bytes = with_header(usize::MAX, &[0x08, 0x05]);
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
    t.put_dmabuf(2, 1);
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
    let mut r = render_node_proto();
    r.num_of_bos = Some(1);
    for e in [
        expect_err(decode_proto::<KfdCheckpoint>(&p), "img"),
        expect_err(decode_proto::<RenderNodeImage>(&r), "img"),
    ] {
        assert!(matches!(
            e,
            ImageError::Format {
                error: FormatError::CountMismatch { .. },
                ..
            }
        ));
    }

    let mut r = render_node_proto();
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
    let mut r = render_node_proto();
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
    t.put_dmabuf(1, 5);
    std::os::unix::fs::symlink(t.file("amdgpu-dmabuf_1.img"), t.file("amdgpu-dmabuf_2.img"))
        .unwrap();
    let e = expect_err(t.dir().read_dmabuf(2, &limits()), "amdgpu-dmabuf_2.img");
    assert!(matches!(e, ImageError::Io { .. }), "{e}");

    // A FIFO must neither block the open nor be read.
    let fifo = t.file("amdgpu-dmabuf_3.img");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let e = expect_err(t.dir().read_dmabuf(3, &limits()), "amdgpu-dmabuf_3.img");
    assert!(matches!(e, ImageError::NotRegularFile { .. }), "{e}");

    fs::create_dir(t.file("amdgpu-dmabuf_4.img")).unwrap();
    assert!(t.dir().read_dmabuf(4, &limits()).is_err());
}
