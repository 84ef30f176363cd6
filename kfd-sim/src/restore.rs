//! RESTORE of the simulated amdkfd: every check the kernel makes on the buckets and the
//! private data before anything is made, then the process with its BOs at their addresses,
//! new mmap offsets and dma-bufs installed in the caller.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kfd_sys::{KFD_INVALID_FD, kfd_ioctl_criu_args};

use super::faults::fire;
use super::kfd::{InstalledFds, criu_arrays};
use super::process::{
    Bo, MAX_MAPPED_GPUS, OBJ_EVENT, OBJ_QUEUE, OBJ_SVM, PRIV_MAGIC, Pdd, Reader, device_mmap_offset,
};
use super::{
    FileObj, PAGE, Process, SIM_PRIV_VERSION, SimEvent, SimKfd, SimQueue, State, einval, err,
};
use criu_gpu_core::amdgpu::device::AllocFlags;

impl SimKfd {
    /// # Safety
    /// The pointers in `args` follow the `KfdDevice::criu_op` contract.
    pub(super) unsafe fn op_restore(
        &self,
        st: &mut State,
        file_no: u64,
        args: &mut kfd_ioctl_criu_args,
    ) -> io::Result<()> {
        if args.devices == 0
            || args.bos == 0
            || args.priv_data == 0
            || args.priv_data_size == 0
            || args.num_devices == 0
            || args.num_bos == 0
        {
            return Err(einval());
        }
        let pid = self.inner.current_task.load(Ordering::SeqCst);
        match st.files.get(&file_no) {
            Some(FileObj::Kfd { owner: None }) => {}
            Some(FileObj::Kfd { owner: Some(o) }) if *o == pid => {}
            _ => return Err(einval()),
        }
        if st
            .processes
            .get(&pid)
            .is_some_and(|p| p.restored || !p.bos.is_empty())
        {
            return Err(einval());
        }
        fire(&mut st.faults.restore)?;
        // SAFETY: the pointers in `args` follow the criu_op contract, as this function's
        // contract requires.
        let (devices, bos, priv_data) = unsafe { criu_arrays(args) };
        let priv_data = &*priv_data;
        let mut r = Reader {
            data: priv_data,
            pos: 0,
        };
        if r.u32()? != PRIV_MAGIC || r.u32()? != SIM_PRIV_VERSION {
            return Err(einval());
        }
        let xnack = r.u32()? != 0;
        r.u32()?;
        // A fresh KFD process has one device per GPU it can see.
        let visible = self
            .inner
            .gpus
            .iter()
            .filter(|g| !st.hidden.contains(&g.gpu_id))
            .count();
        if devices.len() != visible {
            return Err(einval());
        }
        let mut pdds = Vec::new();
        let mut bound = Vec::new();
        for d in devices.iter() {
            r.u64()?;
            if self.gpu(d.actual_gpu_id).is_none()
                || st.hidden.contains(&d.actual_gpu_id)
                || pdds.iter().any(|p: &Pdd| {
                    p.actual_gpu_id == d.actual_gpu_id || p.user_gpu_id == d.user_gpu_id
                })
            {
                return Err(einval());
            }
            let n = self
                .file_no(d.drm_fd as i32)
                .ok_or_else(|| err(libc::EBADF))?;
            match st.files.get(&n) {
                Some(FileObj::Render {
                    gpu_id,
                    bound_to: None,
                }) if *gpu_id == d.actual_gpu_id => {}
                _ => return Err(einval()),
            }
            bound.push(n);
            pdds.push(Pdd {
                user_gpu_id: d.user_gpu_id,
                actual_gpu_id: d.actual_gpu_id,
                drm_file: Some(n),
            });
        }
        let mut new_bos = Vec::new();
        let mut vram_used: HashMap<u32, u64> = HashMap::new();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for b in bos.iter() {
            let user_addr = r.u64()?;
            let idr_handle = r.u32()?;
            let n_mapped = r.u32()? as usize;
            let mut mapped = Vec::new();
            for i in 0..MAX_MAPPED_GPUS {
                let g = r.u32()?;
                if i < n_mapped {
                    mapped.push(g);
                }
            }
            let pdd = pdds
                .iter()
                .find(|p| p.user_gpu_id == b.gpu_id)
                .ok_or_else(einval)?;
            if n_mapped > MAX_MAPPED_GPUS
                || mapped
                    .iter()
                    .any(|g| !pdds.iter().any(|p| p.user_gpu_id == *g))
                || b.size == 0
                || b.size % PAGE != 0
                || b.addr.checked_add(b.size).is_none()
            {
                return Err(einval());
            }
            if ranges
                .iter()
                .any(|&(a, s)| b.addr < a + s && a < b.addr + b.size)
            {
                return Err(einval());
            }
            ranges.push((b.addr, b.size));
            if AllocFlags::of(b.alloc_flags).intersects(AllocFlags::VRAM) {
                let used = vram_used.entry(pdd.actual_gpu_id).or_default();
                *used = used.saturating_add(b.size);
                let vram = self
                    .gpu(pdd.actual_gpu_id)
                    .map(|g| g.vram_size)
                    .unwrap_or(0);
                if *used > vram {
                    return Err(err(libc::ENOMEM));
                }
            }
            if AllocFlags::of(b.alloc_flags).intersects(AllocFlags::WITH_CONTENTS)
                && b.size > (1 << 40)
            {
                return Err(err(libc::ENOMEM));
            }
            new_bos.push((
                pdd.clone(),
                b.addr,
                b.size,
                b.alloc_flags,
                idr_handle,
                user_addr,
                mapped,
            ));
        }
        let mut queues = Vec::new();
        let mut events = Vec::new();
        let mut svm = Vec::new();
        for _ in 0..args.num_objects {
            match r.u32()? {
                OBJ_QUEUE => {
                    let id = r.u32()?;
                    let gpu_id = r.u32()?;
                    let kind = r.u32()?;
                    let ring_addr = r.u64()?;
                    let ring_size = r.u32()?;
                    let len = r.u32()? as usize;
                    let mqd = r.bytes(len)?.to_vec();
                    if !pdds.iter().any(|p| p.user_gpu_id == gpu_id) {
                        return Err(einval());
                    }
                    queues.push(SimQueue {
                        id,
                        gpu_id,
                        kind,
                        ring_addr,
                        ring_size,
                        mqd,
                    });
                }
                OBJ_EVENT => {
                    let id = r.u32()?;
                    let kind = r.u32()?;
                    let auto_reset = r.u32()? != 0;
                    let signaled = r.u32()? != 0;
                    events.push(SimEvent {
                        id,
                        kind,
                        auto_reset,
                        signaled,
                    });
                }
                OBJ_SVM => {
                    r.u32()?;
                    svm.push((r.u64()?, r.u64()?));
                }
                _ => return Err(einval()),
            }
        }
        if r.pos != priv_data.len() {
            return Err(einval());
        }
        // Everything checked: create the BOs and export their dma-bufs.
        let mut created = InstalledFds::default();
        let mut made = Vec::new();
        let result = (|| -> io::Result<()> {
            for ((pdd, addr, size, flags, idr_handle, user_addr, mapped), b) in
                new_bos.into_iter().zip(bos.iter_mut())
            {
                let offset = device_mmap_offset(flags, pdd.actual_gpu_id).unwrap_or_else(|| {
                    if AllocFlags::of(flags).intersects(AllocFlags::WITH_CONTENTS) {
                        st.alloc_mmap_offset(size)
                    } else {
                        0
                    }
                });
                let mem = if AllocFlags::of(flags).intersects(AllocFlags::WITH_CONTENTS) {
                    let m = Arc::new(self.bo_mem(addr, size)?);
                    b.dmabuf_fd = created.install(self, st, m.clone(), pdd.actual_gpu_id)?;
                    Some(m)
                } else {
                    b.dmabuf_fd = KFD_INVALID_FD;
                    None
                };
                b.restored_offset = offset;
                made.push(Bo {
                    addr,
                    size,
                    flags,
                    actual_gpu: pdd.actual_gpu_id,
                    user_gpu: pdd.user_gpu_id,
                    idr_handle,
                    offset,
                    user_addr,
                    mapped,
                    mem,
                });
            }
            Ok(())
        })();
        if let Err(e) = result {
            created.close_all();
            return Err(e);
        }
        for n in bound {
            if let Some(FileObj::Render { bound_to, .. }) = st.files.get_mut(&n) {
                *bound_to = Some(pid);
            }
        }
        if let Some(FileObj::Kfd { owner }) = st.files.get_mut(&file_no) {
            *owner = Some(pid);
        }
        st.processes.insert(
            pid,
            Process {
                pid,
                ns_pid: pid,
                pdds,
                bos: made,
                queues,
                events,
                svm,
                xnack,
                evicted: 1,
                awaiting_resume: true,
                resumed: 0,
                restored: true,
            },
        );
        Ok(())
    }
}
