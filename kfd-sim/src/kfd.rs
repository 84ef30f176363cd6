//! The KFD side of the simulator: `/dev/kfd` files and their ioctls, above all the CRIU
//! operations (PROCESS_INFO, CHECKPOINT, UNPAUSE, RESUME here, RESTORE in `restore.rs`)
//! with the kernel's order and size rules and its caller rule.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kfd_sys::{
    KFD_CRIU_OP_CHECKPOINT, KFD_CRIU_OP_PROCESS_INFO, KFD_CRIU_OP_RESTORE, KFD_CRIU_OP_RESUME,
    KFD_CRIU_OP_UNPAUSE, KFD_INVALID_FD, kfd_criu_bo_bucket, kfd_criu_device_bucket,
    kfd_ioctl_criu_args,
};

use super::faults::fire;
use super::{BoMem, FileObj, Process, SIM_KFD_MAJOR, SIM_KFD_VERSION, SimKfd, State, einval, err};
use criu_gpu_core::amdgpu::device::{DRM_MAJOR, FileIdentity, KfdDevice, KfdHolder};

/// The caller's device buckets, BO buckets and private data of a CHECKPOINT or RESTORE.
///
/// # Safety
///
/// The pointers in `args` follow the [`KfdDevice::criu_op`] contract, and nothing else uses
/// the arrays while the slices live.
pub(super) unsafe fn criu_arrays<'a>(
    args: &kfd_ioctl_criu_args,
) -> (
    &'a mut [kfd_criu_device_bucket],
    &'a mut [kfd_criu_bo_bucket],
    &'a mut [u8],
) {
    // SAFETY: per the criu_op contract, `devices` points to `num_devices` writable
    // buckets, `bos` to `num_bos` and `priv_data` to `priv_data_size` bytes, valid and not
    // aliased by anything else for the duration of the call.
    unsafe {
        (
            std::slice::from_raw_parts_mut(
                args.devices as *mut kfd_criu_device_bucket,
                args.num_devices as usize,
            ),
            std::slice::from_raw_parts_mut(
                args.bos as *mut kfd_criu_bo_bucket,
                args.num_bos as usize,
            ),
            std::slice::from_raw_parts_mut(args.priv_data as *mut u8, args.priv_data_size as usize),
        )
    }
}

/// The dma-buf fds a CHECKPOINT or RESTORE installs in the caller: the caller's once the
/// operation succeeds, closed again when it fails, as the kernel does.
#[derive(Default)]
pub(super) struct InstalledFds(Vec<RawFd>);

impl InstalledFds {
    pub(super) fn count(&self) -> usize {
        self.0.len()
    }

    /// Exports `mem` (a BO of GPU `gpu_id`) as a new dma-buf; returns its fd for the bucket.
    pub(super) fn install(
        &mut self,
        sim: &SimKfd,
        st: &mut State,
        mem: Arc<BoMem>,
        gpu_id: u32,
    ) -> io::Result<u32> {
        let fd = sim.new_file(st, FileObj::DmaBuf { mem, gpu_id })?;
        let raw = fd.into_raw_fd();
        self.0.push(raw);
        Ok(raw as u32)
    }

    pub(super) fn close_all(self) {
        for fd in self.0 {
            // SAFETY: these fds were created by `install` and not yet handed to the caller.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

impl SimKfd {
    fn process_mut(st: &mut State, owner: Option<u32>) -> io::Result<&mut Process> {
        let pid = owner.ok_or_else(einval)?;
        st.processes.get_mut(&pid).ok_or_else(|| err(libc::ESRCH))
    }

    fn op_process_info(
        &self,
        st: &mut State,
        owner: Option<u32>,
        args: &mut kfd_ioctl_criu_args,
    ) -> io::Result<()> {
        fire(&mut st.faults.process_info)?;
        let p = Self::process_mut(st, owner)?;
        if p.pdds.is_empty() {
            return Err(err(libc::ENODEV));
        }
        p.evicted += 1;
        args.num_devices = p.pdds.len() as u32;
        args.num_bos = p.bos.len() as u32;
        args.num_objects = p.num_objects();
        args.priv_data_size = p.priv_data().len() as u64;
        args.pid = p.ns_pid;
        Ok(())
    }

    /// # Safety
    /// The pointers in `args` follow the [`KfdDevice::criu_op`] contract.
    unsafe fn op_checkpoint(
        &self,
        st: &mut State,
        owner: Option<u32>,
        args: &mut kfd_ioctl_criu_args,
    ) -> io::Result<()> {
        if args.devices == 0 || args.bos == 0 || args.priv_data == 0 {
            return Err(einval());
        }
        let p = Self::process_mut(st, owner)?.clone();
        if p.evicted == 0 {
            return Err(einval());
        }
        let priv_data = p.priv_data();
        if args.num_devices as usize != p.pdds.len()
            || args.num_bos as usize != p.bos.len()
            || args.num_objects != p.num_objects()
            || args.priv_data_size != priv_data.len() as u64
        {
            return Err(einval());
        }
        fire(&mut st.faults.checkpoint)?;
        // SAFETY: the pointers in `args` follow the criu_op contract, as this function's
        // contract requires.
        let (devices, bos, out) = unsafe { criu_arrays(args) };
        let mut created = InstalledFds::default();
        let fail_after = st.faults.checkpoint_after_dmabufs.take();
        let result = (|| -> io::Result<()> {
            for (b, bo) in bos.iter_mut().zip(&p.bos) {
                *b = kfd_criu_bo_bucket {
                    addr: bo.addr,
                    size: bo.size,
                    offset: bo.offset,
                    restored_offset: 0,
                    gpu_id: bo.user_gpu,
                    alloc_flags: bo.flags,
                    dmabuf_fd: KFD_INVALID_FD,
                    pad: 0,
                };
                if let Some(mem) = &bo.mem {
                    if let Some((n, errno)) = fail_after {
                        if created.count() >= n {
                            return Err(err(errno));
                        }
                    }
                    b.dmabuf_fd = created.install(self, st, mem.clone(), bo.actual_gpu)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            created.close_all();
            for b in bos.iter_mut() {
                b.dmabuf_fd = KFD_INVALID_FD;
            }
            return Err(e);
        }
        for (d, pdd) in devices.iter_mut().zip(&p.pdds) {
            *d = kfd_criu_device_bucket {
                user_gpu_id: pdd.user_gpu_id,
                actual_gpu_id: pdd.actual_gpu_id,
                drm_fd: 0,
                pad: 0,
            };
        }
        out.copy_from_slice(&priv_data);
        Ok(())
    }
}

impl KfdDevice for SimKfd {
    fn describe(&self) -> String {
        format!(
            "KFD simulator with {} GPU(s) {:x?}",
            self.inner.gpus.len(),
            self.inner.gpus.iter().map(|g| g.gpu_id).collect::<Vec<_>>()
        )
    }

    fn kfd_rdev(&self) -> io::Result<u64> {
        Ok(libc::makedev(SIM_KFD_MAJOR, 0))
    }

    fn identify(&self, fd: BorrowedFd<'_>) -> io::Result<FileIdentity> {
        let st = self.state();
        if let Ok((_, obj)) = self.file(&st, fd.as_raw_fd()) {
            return Ok(match obj {
                FileObj::Kfd { .. } => FileIdentity {
                    mode: libc::S_IFCHR | 0o666,
                    rdev: libc::makedev(SIM_KFD_MAJOR, 0),
                    dmabuf: false,
                },
                FileObj::Render { gpu_id, .. } => FileIdentity {
                    mode: libc::S_IFCHR | 0o666,
                    rdev: libc::makedev(
                        DRM_MAJOR,
                        self.gpu(gpu_id).map(|g| g.render_minor).unwrap_or(0),
                    ),
                    dmabuf: false,
                },
                FileObj::DmaBuf { .. } => FileIdentity {
                    mode: libc::S_IFREG | 0o600,
                    rdev: 0,
                    dmabuf: true,
                },
            });
        }
        drop(st);
        let meta = File::from(fd.try_clone_to_owned()?).metadata()?;
        use std::os::unix::fs::MetadataExt;
        Ok(FileIdentity {
            mode: meta.mode(),
            rdev: meta.rdev(),
            dmabuf: false,
        })
    }

    fn open_kfd(&self) -> io::Result<OwnedFd> {
        let mut st = self.state();
        self.new_file(&mut st, FileObj::Kfd { owner: None })
    }

    fn get_version(&self, kfd: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
        let st = self.state();
        match self.file(&st, kfd.as_raw_fd())? {
            (_, FileObj::Kfd { .. }) => Ok(SIM_KFD_VERSION),
            _ => Err(err(libc::ENOTTY)),
        }
    }

    unsafe fn criu_op(
        &self,
        kfd: BorrowedFd<'_>,
        args: &mut kfd_ioctl_criu_args,
    ) -> io::Result<()> {
        let mut st = self.state();
        let (n, obj) = self.file(&st, kfd.as_raw_fd())?;
        let FileObj::Kfd { owner } = obj else {
            return Err(err(libc::ENOTTY));
        };
        if owner.is_some_and(|pid| !self.may_criu(&st, pid)) {
            return Err(err(libc::EBADF));
        }
        match args.op {
            KFD_CRIU_OP_PROCESS_INFO => self.op_process_info(&mut st, owner, args),
            // SAFETY: the caller upholds the criu_op contract for the pointers in `args`.
            KFD_CRIU_OP_CHECKPOINT => unsafe { self.op_checkpoint(&mut st, owner, args) },
            KFD_CRIU_OP_UNPAUSE => {
                let p = Self::process_mut(&mut st, owner)?;
                if p.evicted == 0 {
                    return Err(einval());
                }
                fire(&mut st.faults.unpause)?;
                let p = Self::process_mut(&mut st, owner)?;
                p.evicted -= 1;
                Ok(())
            }
            // SAFETY: the caller upholds the criu_op contract for the pointers in `args`.
            KFD_CRIU_OP_RESTORE => unsafe { self.op_restore(&mut st, n, args) },
            KFD_CRIU_OP_RESUME => {
                let p = st
                    .processes
                    .get(&args.pid)
                    .ok_or_else(|| err(libc::ESRCH))?;
                if !p.awaiting_resume {
                    return Err(einval());
                }
                fire(&mut st.faults.resume)?;
                let p = st
                    .processes
                    .get_mut(&args.pid)
                    .ok_or_else(|| err(libc::ESRCH))?;
                p.awaiting_resume = false;
                p.evicted = 0;
                p.resumed += 1;
                Ok(())
            }
            _ => Err(einval()),
        }
    }

    fn render_node_present(&self, minor: u32) -> bool {
        let st = self.state();
        self.inner
            .gpus
            .iter()
            .any(|g| g.render_minor == minor && !st.hidden.contains(&g.gpu_id))
    }

    fn open_render_node(&self, minor: u32) -> io::Result<OwnedFd> {
        let mut st = self.state();
        if let Some((m, errno)) = st.faults.open_render {
            if m == minor {
                return Err(err(errno));
            }
        }
        let gpu = self
            .inner
            .gpus
            .iter()
            .find(|g| g.render_minor == minor && !st.hidden.contains(&g.gpu_id))
            .ok_or_else(|| err(libc::ENOENT))?;
        let gpu_id = gpu.gpu_id;
        self.new_file(
            &mut st,
            FileObj::Render {
                gpu_id,
                bound_to: None,
            },
        )
    }

    fn buffer_key(&self, render: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32> {
        // The same import; the handle is only a key and the simulator tracks no object for
        // it, so that `gem_objects` counts the copy engine's objects alone.
        let mut st = self.state();
        Ok(self.prime_import(&mut st, render, dmabuf)?.1)
    }

    fn hsakmt_shared_mem(&self) -> io::Result<Option<(u64, u32)>> {
        Ok(self.state().hsakmt)
    }

    fn restore_hsakmt_shared_mem(&self, size: u64, magic: u32) -> io::Result<()> {
        let mut st = self.state();
        st.hsakmt_restored.push((size, magic));
        if st.hsakmt.is_none() {
            st.hsakmt = Some((size, magic));
        }
        Ok(())
    }

    fn current_task(&self) -> u32 {
        self.inner.current_task.load(Ordering::SeqCst)
    }

    fn kfd_holder(&self, kfd: BorrowedFd<'_>) -> io::Result<Option<KfdHolder>> {
        let st = self.state();
        // The test hands the backend the process's own fd, as CRIU hands it a copy; the
        // holder is found among the processes the caller traces, as by the kernel's search.
        Ok(match self.file(&st, kfd.as_raw_fd())? {
            (_, FileObj::Kfd { owner: Some(pid) })
                if st.tracers.get(&pid) == Some(&self.current_task()) =>
            {
                Some(KfdHolder {
                    pid: pid as i32,
                    start: 0,
                    fd: kfd.as_raw_fd(),
                })
            }
            _ => None,
        })
    }

    fn unpause_holder(
        &self,
        holder: &KfdHolder,
        _pidfd: Option<BorrowedFd<'_>>,
    ) -> io::Result<u32> {
        let mut st = self.state();
        let pid = Some(holder.pid as u32);
        let mut done = 0;
        while done < 8 && Self::process_mut(&mut st, pid)?.evicted > 0 {
            if let Err(e) = fire(&mut st.faults.unpause) {
                return if done == 0 { Err(e) } else { Ok(done) };
            }
            Self::process_mut(&mut st, pid)?.evicted -= 1;
            done += 1;
        }
        Ok(done)
    }
}
