//! The simulated SDMA engine: how it decodes an indirect buffer for a GPU family, how it
//! resolves each copy's addresses in the submitting file's VM, and the copies themselves.

use std::io;
use std::os::unix::fs::FileExt;

use super::vm::{GemMem, SimVm};
use super::{einval, err};

/// What the simulated SDMA engines did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SdmaStats {
    /// Command submissions executed.
    pub submissions: u64,
    /// `COPY_LINEAR` packets executed.
    pub packets: u64,
    /// Bytes copied.
    pub bytes: u64,
    /// Submission contexts created.
    pub contexts: u64,
    /// User memory registrations.
    pub userptrs: u64,
}

/// One decoded copy.
pub(super) struct CopyOp {
    src: (GemMem, u64),
    dst: (GemMem, u64),
    pub(super) len: u64,
}

/// Decodes an IB as the SDMA engine of `family` reads it: `NOP` (with its count of extra
/// dwords) and `COPY_LINEAR` (count − 1 from family AI on, the count itself before).
/// Anything else is an illegal packet.
fn decode_ib(ib: &[u32], family: u32) -> Result<Vec<(u64, u64, u64)>, i32> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < ib.len() {
        let h = ib[i];
        let (op, sub) = (h & 0xff, (h >> 8) & 0xff);
        match (op, sub) {
            (0, _) => i += 1 + ((h >> 16) & 0x3fff) as usize,
            (1, 0) => {
                let p = ib.get(i..i + 7).ok_or(libc::EPROTO)?;
                let len = if family >= kfd_sys::AMDGPU_FAMILY_AI {
                    u64::from(p[1] & 0x3f_ffff) + 1
                } else {
                    u64::from(p[1] & 0x1f_ffff)
                };
                let src = u64::from(p[3]) | (u64::from(p[4]) << 32);
                let dst = u64::from(p[5]) | (u64::from(p[6]) << 32);
                out.push((src, dst, len));
                i += 7;
            }
            _ => return Err(libc::EPROTO),
        }
    }
    Ok(out)
}

/// The copies of `ib`, submitted with the BO list `bos`, as the engine of `family` runs them
/// in `vm`, and the first address a copy could not reach. As on hardware, a packet whose
/// addresses do not resolve to memory this GPU reaches is a page fault: its copy is not done
/// and the job still completes. An illegal packet, or reading the BO at `download_at` or
/// writing the one at `upload_at` (injected device errors), fails the job with that errno.
pub(super) fn plan_copies(
    vm: &SimVm,
    ib: &[u32],
    family: u32,
    bos: &[u32],
    download_at: Option<(u64, i32)>,
    upload_at: Option<(u64, i32)>,
) -> (Result<Vec<CopyOp>, i32>, Option<u64>) {
    let mut page_fault = None;
    let plan = decode_ib(ib, family).and_then(|packets| {
        let mut ops = Vec::with_capacity(packets.len());
        for (src, dst, len) in packets {
            let reach = |va| match vm.resolve(va, len, bos) {
                Ok((m, o, _)) if !matches!(m, GemMem::Foreign) => Some((m, o)),
                _ => None,
            };
            let Some((sm, so)) = reach(src) else {
                page_fault.get_or_insert(src);
                continue;
            };
            let Some((dm, doff)) = reach(dst) else {
                page_fault.get_or_insert(dst);
                continue;
            };
            for (m, fault) in [(&sm, download_at), (&dm, upload_at)] {
                if let (GemMem::Bo(b), Some((addr, errno))) = (m, fault) {
                    if b.addr == addr {
                        return Err(errno);
                    }
                }
            }
            ops.push(CopyOp {
                src: (sm, so),
                dst: (dm, doff),
                len,
            });
        }
        Ok(ops)
    });
    (plan, page_fault)
}

/// Runs one copy; the SDMA engine's view of memory is the BO's contents or user memory.
///
/// # Safety
///
/// User memory in `op` must be registered (its handle open in the VM), per the contract of
/// [`AmdgpuRender::gem_userptr`](criu_gpu_core::amdgpu::device::AmdgpuRender::gem_userptr).
pub(super) unsafe fn run_copy(op: &CopyOp) -> io::Result<()> {
    let len = usize::try_from(op.len).map_err(|_| einval())?;
    let user = |addr: usize, offset: u64| {
        // SAFETY: user memory of `len` bytes at `addr + offset`, resolved inside its
        // registration, which this function's contract keeps alive.
        unsafe { std::slice::from_raw_parts_mut((addr + offset as usize) as *mut u8, len) }
    };
    match (&op.src, &op.dst) {
        ((GemMem::Bo(m) | GemMem::Local(m), so), (GemMem::User { addr, .. }, doff)) => {
            m.file.read_exact_at(user(*addr, *doff), *so)
        }
        ((GemMem::User { addr, .. }, soff), (GemMem::Bo(m) | GemMem::Local(m), doff)) => {
            m.file.write_all_at(user(*addr, *soff), *doff)
        }
        _ => {
            let mut tmp = vec![0u8; len];
            match &op.src {
                (GemMem::Bo(m) | GemMem::Local(m), o) => m.file.read_exact_at(&mut tmp, *o)?,
                (GemMem::User { addr, .. }, o) => tmp.copy_from_slice(user(*addr, *o)),
                (GemMem::Foreign, _) => return Err(err(libc::ENODEV)),
            }
            match &op.dst {
                (GemMem::Bo(m) | GemMem::Local(m), o) => m.file.write_all_at(&tmp, *o),
                (GemMem::User { addr, .. }, o) => {
                    user(*addr, *o).copy_from_slice(&tmp);
                    Ok(())
                }
                (GemMem::Foreign, _) => Err(err(libc::ENODEV)),
            }
        }
    }
}
