//! Pages files: their layout per GPU, concurrent chunked writes and reads,
//! and the errors of short or inconsistent files.

use super::*;

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
    let layout = gpu_a_layout();
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
    let mut expected = with_header(4196, &[]);
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
    let layout = gpu_a_layout();
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
    let layout = gpu_a_layout();
    let name = "amdgpu-pages-5-1a2b.img";
    // Right header, but BO 3 has only 40 of its 100 bytes.
    let bytes = with_header(4196, &[0; 4096 + 40]);
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
    let bytes = with_header(4000, &[0; 4196]);
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
    let expected = with_header(3, &[7, 8, 9]);
    assert_eq!(t.get("amdgpu-drm-pages-4-129-0002.img"), expected);

    // An absurd BO size from a hostile image is refused, not allocated.
    assert!(t.dir().open_drm_pages(4, 129, 1, u64::MAX).is_err());
}
