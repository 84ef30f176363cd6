//! Unit tests of the copy pipeline and its staging memory.

use super::*;
use std::sync::atomic::AtomicUsize;

#[test]
fn pieces_cover_every_byte_once() {
    let p = plan([(0, 10), (3, 0), (7, 4096)], 4);
    assert_eq!(p.len(), 3 + 1024);
    assert_eq!(
        p[2],
        Piece {
            bo: 0,
            offset: 8,
            len: 2
        }
    );
    assert_eq!(
        p[3],
        Piece {
            bo: 7,
            offset: 0,
            len: 4
        }
    );
    let total: usize = p.iter().map(|p| p.len).sum();
    assert_eq!(total, 4106);
}

#[test]
fn copies_everything_with_bounded_buffers() {
    let src: Vec<Vec<u8>> = (0..20u8)
        .map(|i| {
            (0..(i as usize * 1000 + 1))
                .map(|b| (b as u8) ^ i)
                .collect()
        })
        .collect();
    let dst: Vec<Mutex<Vec<u8>>> = src.iter().map(|s| Mutex::new(vec![0; s.len()])).collect();
    let pieces = plan(
        src.iter().enumerate().map(|(i, s)| (i, s.len() as u64)),
        4096,
    );
    let live = AtomicUsize::new(0);
    let max_live = AtomicUsize::new(0);
    let stats = run::<io::Error, (), _, _, _>(
        &pieces,
        3,
        4096,
        |_| Ok(()),
        |_, p, buf| {
            let n = live.fetch_add(1, Ordering::SeqCst) + 1;
            max_live.fetch_max(n, Ordering::SeqCst);
            let o = p.offset as usize;
            buf.copy_from_slice(&src[p.bo][o..o + p.len]);
            Ok(())
        },
        |_, p, buf| {
            live.fetch_sub(1, Ordering::SeqCst);
            let o = p.offset as usize;
            lock(&dst[p.bo])[o..o + p.len].copy_from_slice(buf);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(stats.bytes, src.iter().map(|s| s.len() as u64).sum::<u64>());
    assert_eq!(stats.staging_bytes, 3 * 8192);
    assert!(max_live.load(Ordering::SeqCst) <= 3);
    for (s, d) in src.iter().zip(&dst) {
        assert_eq!(s, &*lock(d));
    }
}

#[test]
fn a_copy_thread_that_panics_fails_the_copy_without_unwinding() {
    let pieces = plan((0..64).map(|i| (i, 8192)), 4096);
    let r = run::<io::Error, (), _, _, _>(
        &pieces,
        4,
        4096,
        |_| Ok(()),
        |_, _, _| {
            let me = std::thread::current();
            if me.name().is_some_and(|n| n.starts_with("amdgpu-copy")) {
                panic!("copy thread lost its buffer");
            }
            // The calling thread leaves pieces to the copy threads.
            std::thread::sleep(Duration::from_millis(2));
            Ok(())
        },
        |_, _, _| Ok(()),
    );
    let e = r.unwrap_err();
    assert!(e.to_string().contains("copy thread lost its buffer"), "{e}");
}

#[test]
fn the_first_error_stops_the_copy_and_every_thread_is_joined() {
    let pieces = plan((0..100).map(|i| (i, 8192)), 4096);
    let drained = AtomicUsize::new(0);
    for fail_in_fill in [true, false] {
        drained.store(0, Ordering::SeqCst);
        let r = run::<io::Error, (), _, _, _>(
            &pieces,
            4,
            4096,
            |_| Ok(()),
            |_, p, _| {
                if fail_in_fill && p.bo == 10 {
                    return Err(io::Error::other("device fault"));
                }
                Ok(())
            },
            |_, p, _| {
                if !fail_in_fill && p.bo == 20 {
                    return Err(io::Error::other("disk full"));
                }
                drained.fetch_add(1, Ordering::SeqCst);
                Ok(())
            },
        );
        let e = r.unwrap_err();
        assert!(
            e.to_string()
                .contains(if fail_in_fill { "device" } else { "disk" })
        );
        assert!(drained.load(Ordering::SeqCst) < pieces.len());
    }
}

/// Whether `addr` lies in a mapping of this process (adjacent anonymous mappings merge, so
/// the region need not start a line of the maps file).
fn mapped(addr: usize) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let range = l.split(' ').next()?;
            let (a, b) = range.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .any(|(a, b)| a <= addr && addr < b)
}

#[test]
fn kept_staging_stays_mapped() {
    let pieces = plan([(0, 8192)], 4096);
    let bases = Mutex::new(Vec::new());
    let r = run::<io::Error, StagingRegion, _, _, _>(
        &pieces,
        1,
        4096,
        |region| {
            lock(&bases).push(region.base() as usize);
            assert_eq!(region.len() % page_size(), 0);
            assert_eq!(region.base() as usize % page_size(), 0);
            Ok(region)
        },
        |region, _, _| {
            region.keep_after_use();
            Err(io::Error::from_raw_os_error(libc::ETIMEDOUT))
        },
        |_, _, _| Ok(()),
    );
    assert!(r.is_err());
    // (That an unkept region is unmapped cannot be checked without racing other test
    // threads, which may map the same addresses right away.)
    assert!(
        mapped(lock(&bases)[0]),
        "a kept staging region was unmapped"
    );
}

#[test]
fn interleaved_plans_alternate_streams() {
    let p = plan_interleaved(&[vec![(0, 8), (2, 4)], vec![(1, 4)], vec![]], 4);
    let order: Vec<(usize, u64)> = p.iter().map(|p| (p.bo, p.offset)).collect();
    assert_eq!(order, vec![(0, 0), (1, 0), (0, 4), (2, 0)]);
}

#[test]
fn oversized_pieces_and_empty_copies() {
    let r = run::<io::Error, (), _, _, _>(
        &[Piece {
            bo: 0,
            offset: 0,
            len: 8192,
        }],
        1,
        4096,
        |_| Ok(()),
        |_, _, _| Ok(()),
        |_, _, _| Ok(()),
    );
    assert!(r.is_err());
    let s =
        run::<io::Error, (), _, _, _>(&[], 2, 4096, |_| Ok(()), |_, _, _| Ok(()), |_, _, _| Ok(()))
            .unwrap();
    assert_eq!(s.bytes, 0);
}
