//! Unit tests of the SDMA packet encoding and submission logic.

use kfd_sys::{AMDGPU_FAMILY_AI, AMDGPU_FAMILY_CI};

use super::*;

const AI: PacketFormat = PacketFormat {
    count_minus_one: true,
    max_bytes: 1 << 21,
};

#[test]
fn formats_follow_the_family() {
    assert_eq!(PacketFormat::for_family(AMDGPU_FAMILY_AI).unwrap(), AI);
    assert_eq!(
        PacketFormat::for_family(kfd_sys::AMDGPU_FAMILY_NV).unwrap(),
        AI
    );
    let vi = PacketFormat::for_family(kfd_sys::AMDGPU_FAMILY_VI).unwrap();
    assert!(!vi.count_minus_one);
    assert_eq!(vi.max_bytes, 0x1F_FFFF);
    assert_eq!(PacketFormat::for_family(AMDGPU_FAMILY_CI).unwrap(), vi);
    let e = PacketFormat::for_family(kfd_sys::AMDGPU_FAMILY_SI).unwrap_err();
    assert_eq!(e.errno.get(), libc::EOPNOTSUPP);
}

#[test]
fn packets_cover_the_range_with_the_family_count() {
    let mut ib = Vec::new();
    let len = (5 << 20) + 12;
    push_copy(&mut ib, AI, 0x1_0000_1000, 0x2_0000_0000, len);
    assert_eq!(ib.len(), 3 * PACKET_DWORDS);
    let mut covered = 0u64;
    for p in ib.chunks(PACKET_DWORDS) {
        assert_eq!(p[0], 0x0000_0001);
        assert_eq!(p[2], 0);
        let n = u64::from(p[1]) + 1;
        let src = u64::from(p[3]) | (u64::from(p[4]) << 32);
        let dst = u64::from(p[5]) | (u64::from(p[6]) << 32);
        assert_eq!(src, 0x1_0000_1000 + covered);
        assert_eq!(dst, 0x2_0000_0000 + covered);
        covered += n;
    }
    assert_eq!(covered, len);
    assert_eq!(ib[1], (1 << 21) - 1);
    assert_eq!(ib[2 * PACKET_DWORDS + 1], (1 << 20) + 11);

    let vi = PacketFormat::for_family(kfd_sys::AMDGPU_FAMILY_VI).unwrap();
    let mut ib = Vec::new();
    push_copy(&mut ib, vi, 0, 1 << 40, 1 << 21);
    assert_eq!(ib.len(), 2 * PACKET_DWORDS);
    assert_eq!(ib[1], 0x1F_FFFF);
    assert_eq!(ib[PACKET_DWORDS + 1], 1);
    assert_eq!(ib[PACKET_DWORDS + 6], 1 << 8);
}

#[test]
fn ibs_are_padded_and_sized_ahead() {
    let mut ib = Vec::new();
    push_copy(&mut ib, AI, 0, 4096, 4096);
    pad(&mut ib);
    assert_eq!(ib.len(), 8);
    assert_eq!(ib[7], NOP);
    for len in [1u64, 4096, 1 << 21, (1 << 21) + 1, 64 << 20, (64 << 20) - 3] {
        let mut ib = Vec::new();
        push_copy(&mut ib, AI, 0, 1 << 30, len);
        pad(&mut ib);
        assert_eq!(ib.len(), AI.ib_dwords(len), "{len}");
        assert_eq!(ib.len() % IB_ALIGN_DWORDS, 0);
    }
}

#[test]
fn vas_are_aligned_bounded_and_never_reused() {
    let mut va = VaSpace {
        next: 0x20_0000,
        end: 0x20_0000 + (8 << 20),
    };
    let a = va.alloc(4096).unwrap();
    let b = va.alloc(2 << 20).unwrap();
    assert_eq!(a, 0x20_0000);
    assert_eq!(b % VA_ALIGN_LARGE, 0);
    assert!(b >= a + 4096);
    let c = va.alloc(4096).unwrap();
    assert!(c >= b + (2 << 20));
    assert!(va.alloc(8 << 20).is_none());
    assert!(va.alloc(u64::MAX).is_none());
}
