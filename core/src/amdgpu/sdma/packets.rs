//! `COPY_LINEAR` and `NOP` packets of the SDMA engine, encoded per GPU family (the format
//! is described in the [module documentation](super)).

use kfd_sys::{AMDGPU_FAMILY_AI, AMDGPU_FAMILY_CI};

use crate::amdgpu::error::{Result, device_error};

/// `COPY_LINEAR` header: op 1, sub-op 0.
pub const HEADER_COPY_LINEAR: u32 = 0x0000_0001;
/// A one-dword `NOP`.
pub const NOP: u32 = 0;
/// Dwords of a `COPY_LINEAR` packet.
pub const PACKET_DWORDS: usize = 7;
/// IBs are padded to a multiple of this many dwords.
pub const IB_ALIGN_DWORDS: usize = 8;

/// How a GPU family encodes `COPY_LINEAR`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketFormat {
    /// Whether the count field holds the byte count minus one (SDMA 4 and later).
    pub count_minus_one: bool,
    /// Most bytes one packet copies.
    pub max_bytes: u32,
}

impl PacketFormat {
    /// The encoding of family `family` (`AMDGPU_FAMILY_*`).
    pub fn for_family(family: u32) -> Result<PacketFormat> {
        if family >= AMDGPU_FAMILY_AI {
            Ok(PacketFormat {
                count_minus_one: true,
                max_bytes: 1 << 21,
            })
        } else if family >= AMDGPU_FAMILY_CI {
            Ok(PacketFormat {
                count_minus_one: false,
                max_bytes: (1 << 21) - 1,
            })
        } else {
            Err(device_error(
                libc::EOPNOTSUPP,
                format!(
                    "GPU family {family} has no SDMA engine this plugin drives (CIK or later needed)"
                ),
            ))
        }
    }

    /// Dwords of an IB that copies `len` bytes, padding included.
    pub fn ib_dwords(&self, len: u64) -> usize {
        let packets = len.div_ceil(u64::from(self.max_bytes)) as usize;
        (packets * PACKET_DWORDS).div_ceil(IB_ALIGN_DWORDS) * IB_ALIGN_DWORDS
    }
}

/// Appends `COPY_LINEAR` packets that copy `len` bytes from GPU address `src` to `dst`.
pub fn push_copy(ib: &mut Vec<u32>, format: PacketFormat, src: u64, dst: u64, len: u64) {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(u64::from(format.max_bytes)) as u32;
        let count = if format.count_minus_one { n - 1 } else { n };
        let (s, d) = (src + done, dst + done);
        ib.extend_from_slice(&[
            HEADER_COPY_LINEAR,
            count,
            0,
            s as u32,
            (s >> 32) as u32,
            d as u32,
            (d >> 32) as u32,
        ]);
        done += u64::from(n);
    }
}

/// Pads `ib` with `NOP`s to a multiple of [`IB_ALIGN_DWORDS`].
pub fn pad(ib: &mut Vec<u32>) {
    while ib.len() % IB_ALIGN_DWORDS != 0 {
        ib.push(NOP);
    }
}
