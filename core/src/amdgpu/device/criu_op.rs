//! The safe layer over the KFD CRIU operation (`AMDKFD_IOC_CRIU_OP`): sizing the bucket
//! arrays, pointing the argument at them, taking ownership of the dma-buf fds the kernel
//! installs, and the KFD version check.

use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};

use kfd_sys::{
    KFD_CRIU_OP_CHECKPOINT, KFD_CRIU_OP_PROCESS_INFO, KFD_CRIU_OP_RESTORE, KFD_CRIU_OP_RESUME,
    KFD_CRIU_OP_UNPAUSE, KFD_INVALID_FD, kfd_criu_bo_bucket, kfd_criu_device_bucket,
    kfd_ioctl_criu_args,
};

use super::{KfdDevice, MIN_KFD_VERSION};
use crate::amdgpu::error::{Error, device_error};

/// What PROCESS_INFO reports about a process (its queues are now evicted).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ProcessInfo {
    /// GPUs the process uses.
    pub num_devices: u32,
    /// BOs.
    pub num_bos: u32,
    /// Queues, events and SVM ranges in the private data.
    pub num_objects: u32,
    /// Bytes of private data CHECKPOINT will write.
    pub priv_data_size: u64,
    /// The process's pid in its own pid namespace.
    pub pid: u32,
}

/// The largest counts and sizes the backend accepts from PROCESS_INFO or an image, so that a
/// bogus number cannot make it allocate without bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CriuLimits {
    /// GPUs per process (KFD supports at most 64 per process, `MAX_GPU_INSTANCE`).
    pub max_devices: u32,
    /// BOs per process.
    pub max_bos: u32,
    /// Private data bytes.
    pub max_priv_data: u64,
}

impl Default for CriuLimits {
    fn default() -> Self {
        Self {
            max_devices: 64,
            max_bos: 1 << 22,
            max_priv_data: 1 << 30,
        }
    }
}

/// The arrays of one CHECKPOINT or RESTORE call.
#[derive(Debug, Default)]
pub struct CriuBuffers {
    /// Device buckets.
    pub devices: Vec<kfd_criu_device_bucket>,
    /// BO buckets.
    pub bos: Vec<kfd_criu_bo_bucket>,
    /// The opaque private data.
    pub priv_data: Vec<u8>,
    /// Number of objects in the private data.
    pub num_objects: u32,
}

impl CriuBuffers {
    /// Zeroed arrays sized as PROCESS_INFO said, after checking the sizes against `limits`.
    pub fn for_checkpoint(info: &ProcessInfo, limits: &CriuLimits) -> io::Result<CriuBuffers> {
        if info.num_devices > limits.max_devices
            || info.num_bos > limits.max_bos
            || info.priv_data_size > limits.max_priv_data
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "KFD reports {} devices, {} BOs and {} bytes of private data, beyond the limits ({}, {}, {})",
                    info.num_devices,
                    info.num_bos,
                    info.priv_data_size,
                    limits.max_devices,
                    limits.max_bos,
                    limits.max_priv_data
                ),
            ));
        }
        Ok(CriuBuffers {
            devices: vec![kfd_criu_device_bucket::default(); info.num_devices as usize],
            bos: vec![kfd_criu_bo_bucket::default(); info.num_bos as usize],
            priv_data: vec![0; info.priv_data_size as usize],
            num_objects: info.num_objects,
        })
    }

    fn args(&mut self, op: u32, pid: u32) -> io::Result<kfd_ioctl_criu_args> {
        let too_many = || io::Error::from_raw_os_error(libc::E2BIG);
        Ok(kfd_ioctl_criu_args {
            devices: self.devices.as_mut_ptr() as u64,
            bos: self.bos.as_mut_ptr() as u64,
            priv_data: self.priv_data.as_mut_ptr() as u64,
            priv_data_size: self.priv_data.len() as u64,
            num_devices: u32::try_from(self.devices.len()).map_err(|_| too_many())?,
            num_bos: u32::try_from(self.bos.len()).map_err(|_| too_many())?,
            num_objects: self.num_objects,
            pid,
            op,
        })
    }
}

/// dma-buf fds installed by CHECKPOINT or RESTORE, one slot per BO bucket.
pub type DmabufFds = Vec<Option<OwnedFd>>;

/// Takes ownership of the dma-buf fds the kernel wrote into `bos` (after a successful
/// CHECKPOINT or RESTORE). Fails when a value is not a plausible fd or appears twice, after
/// closing the valid ones (nothing is leaked and nothing is closed twice).
fn take_dmabufs(bos: &[kfd_criu_bo_bucket]) -> io::Result<DmabufFds> {
    let mut seen = std::collections::HashSet::new();
    let mut bad = None;
    let mut out: DmabufFds = Vec::with_capacity(bos.len());
    for (i, b) in bos.iter().enumerate() {
        if b.dmabuf_fd == KFD_INVALID_FD {
            out.push(None);
            continue;
        }
        let fd = b.dmabuf_fd as RawFd;
        if fd < 0 || !seen.insert(fd) {
            bad.get_or_insert(i);
            out.push(None);
            continue;
        }
        // SAFETY: per the criu_op contract the kernel installed this fd for the caller, who
        // owns it from now on; uniqueness was checked above, so it is wrapped once.
        out.push(Some(unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    match bad {
        None => Ok(out),
        Some(i) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "KFD returned an invalid dma-buf fd {} for BO {i}",
                bos[i].dmabuf_fd as i32
            ),
        )),
    }
}

/// PROCESS_INFO: evicts the process's queues and reports its sizes.
pub fn process_info(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> io::Result<ProcessInfo> {
    let mut args = kfd_ioctl_criu_args {
        op: KFD_CRIU_OP_PROCESS_INFO,
        ..Default::default()
    };
    // SAFETY: PROCESS_INFO reads no user pointers (all are null) and only writes `args`.
    unsafe { dev.criu_op(kfd, &mut args) }?;
    Ok(ProcessInfo {
        num_devices: args.num_devices,
        num_bos: args.num_bos,
        num_objects: args.num_objects,
        priv_data_size: args.priv_data_size,
        pid: args.pid,
    })
}

/// CHECKPOINT into `bufs` (sized by [`CriuBuffers::for_checkpoint`]); returns the dma-buf fds
/// the kernel created in this process, one slot per BO.
pub fn checkpoint(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    bufs: &mut CriuBuffers,
) -> io::Result<DmabufFds> {
    criu_op_on_buffers(dev, kfd, bufs, KFD_CRIU_OP_CHECKPOINT)
}

/// The CRIU operation `op` (CHECKPOINT or RESTORE) over the arrays of `bufs`; returns the
/// dma-buf fds the kernel installed, one slot per BO.
fn criu_op_on_buffers(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    bufs: &mut CriuBuffers,
    op: u32,
) -> io::Result<DmabufFds> {
    for b in &mut bufs.bos {
        b.dmabuf_fd = KFD_INVALID_FD;
    }
    let mut args = bufs.args(op, 0)?;
    // SAFETY: `args` points at the three vectors of `bufs`, whose lengths are the counts and
    // size in `args`; they are exclusively borrowed and outlive the call.
    unsafe { dev.criu_op(kfd, &mut args) }?;
    take_dmabufs(&bufs.bos)
}

/// UNPAUSE: restarts the queues evicted by PROCESS_INFO.
pub fn unpause(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> io::Result<()> {
    let mut args = kfd_ioctl_criu_args {
        op: KFD_CRIU_OP_UNPAUSE,
        ..Default::default()
    };
    // SAFETY: UNPAUSE uses no user pointers.
    unsafe { dev.criu_op(kfd, &mut args) }
}

/// RESTORE from `bufs` on the calling task's own `kfd`; fills `restored_offset` and returns
/// the dma-buf fds of the new BOs.
pub fn restore(
    dev: &dyn KfdDevice,
    kfd: BorrowedFd<'_>,
    bufs: &mut CriuBuffers,
) -> io::Result<DmabufFds> {
    for b in &mut bufs.bos {
        b.restored_offset = 0;
    }
    criu_op_on_buffers(dev, kfd, bufs, KFD_CRIU_OP_RESTORE)
}

/// RESUME of process `pid` (as the caller's pid namespace sees it).
pub fn resume(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>, pid: u32) -> io::Result<()> {
    let mut args = kfd_ioctl_criu_args {
        op: KFD_CRIU_OP_RESUME,
        pid,
        ..Default::default()
    };
    // SAFETY: RESUME uses no user pointers.
    unsafe { dev.criu_op(kfd, &mut args) }
}

/// Checks that the kernel's KFD interface, asked through `kfd` (a `/dev/kfd` the caller
/// opened itself), has the CRIU operations the backend needs.
pub fn check_kfd_version(dev: &dyn KfdDevice, kfd: BorrowedFd<'_>) -> Result<(u32, u32), Error> {
    let v = dev
        .get_version(kfd)
        .map_err(|e| Error::io(&e, "cannot query the KFD version"))?;
    if v.0 != MIN_KFD_VERSION.0 || v.1 < MIN_KFD_VERSION.1 {
        return Err(device_error(
            libc::EOPNOTSUPP,
            format!(
                "the kernel's KFD interface is {}.{}; checkpointing needs {}.{} or a later 1.x",
                v.0, v.1, MIN_KFD_VERSION.0, MIN_KFD_VERSION.1
            ),
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_process_info_is_refused_before_allocating() {
        let info = ProcessInfo {
            num_devices: 2,
            num_bos: u32::MAX,
            num_objects: 1,
            priv_data_size: 16,
            pid: 1,
        };
        assert!(CriuBuffers::for_checkpoint(&info, &CriuLimits::default()).is_err());
        let info = ProcessInfo {
            priv_data_size: 1 << 40,
            num_bos: 1,
            ..info
        };
        assert!(CriuBuffers::for_checkpoint(&info, &CriuLimits::default()).is_err());
    }

    #[test]
    fn duplicate_dmabuf_fds_are_refused_without_double_close() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::IntoRawFd;
        let fa = a.into_raw_fd();
        let mut bos = vec![kfd_criu_bo_bucket::default(); 3];
        bos[0].dmabuf_fd = fa as u32;
        bos[1].dmabuf_fd = fa as u32;
        bos[2].dmabuf_fd = KFD_INVALID_FD;
        // The fd is wrapped (and closed) once; the duplicate is reported.
        assert!(take_dmabufs(&bos).is_err());
        drop(b);
    }
}
