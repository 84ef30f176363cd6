//! The render-node side of the simulator: per render-node file a GEM handle table (imported
//! dma-bufs, userptr registrations, GTT command buffers), a GPU VM, contexts and the
//! submissions to the DMA ring that the SDMA engine (`sdma.rs`) runs.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::faults::fire;
use super::sdma::{plan_copies, run_copy};
use super::vm::{GemMem, Job, SIM_VA_END, SIM_VA_START, SimVm};
use super::{BoMem, FileObj, PAGE, SimKfd, State, einval, err};
use criu_gpu_core::amdgpu::device::{
    AmdgpuRender, GemCensus, HostMapping, RenderInfo, VmFaultState,
};

impl SimKfd {
    /// Allocates a GTT BO of `size` bytes through render-node file `render` (not through
    /// KFD), as a process using render-node allocation does; returns its GEM handle.
    pub fn alloc_render_bo(&self, render: BorrowedFd<'_>, size: u64) -> io::Result<u32> {
        let mem = Arc::new(BoMem::new("kfdsim-render-bo", size, 0)?);
        self.add_object(&mut self.state(), render, GemMem::Local(mem))
    }

    /// A new GEM handle in render file `render` for `gem`.
    pub(super) fn add_object(
        &self,
        st: &mut State,
        render: BorrowedFd<'_>,
        gem: GemMem,
    ) -> io::Result<u32> {
        let (rn, _, _) = self.render_vm(st, render)?;
        let h = Self::new_handle(st, rn);
        st.vms.entry(rn).or_default().objects.insert(h, gem);
        Ok(h)
    }

    /// Records a GPU page fault at `addr` in the VM of render file `render`, as a fault whose
    /// interrupt is handled after the fence of the job that caused it.
    pub fn record_page_fault(&self, render: BorrowedFd<'_>, addr: u64) -> io::Result<()> {
        let mut st = self.state();
        let (_, _, vm) = self.render_vm(&mut st, render)?;
        vm.fault = Some((addr, 1));
        Ok(())
    }

    pub(super) fn render_vm<'s>(
        &self,
        st: &'s mut State,
        render: BorrowedFd<'_>,
    ) -> io::Result<(u64, u32, &'s mut SimVm)> {
        let (n, obj) = self.file(st, render.as_raw_fd())?;
        let FileObj::Render { gpu_id, .. } = obj else {
            return Err(err(libc::ENOTTY));
        };
        Ok((n, gpu_id, st.vms.entry(n).or_default()))
    }

    pub(super) fn new_handle(st: &mut State, rn: u64) -> u32 {
        let next = st.next_handle.entry(rn).or_insert(1);
        let h = *next;
        *next += 1;
        h
    }

    /// PRIME import: one handle per (file, BO); a BO of another GPU is an object of its own.
    pub(super) fn prime_import(
        &self,
        st: &mut State,
        render: BorrowedFd<'_>,
        dmabuf: BorrowedFd<'_>,
    ) -> io::Result<(u64, u32, GemMem)> {
        let (rn, r) = self.file(st, render.as_raw_fd())?;
        let (_, d) = self.file(st, dmabuf.as_raw_fd())?;
        let (FileObj::Render { gpu_id: rg, .. }, FileObj::DmaBuf { mem, gpu_id }) = (r, d) else {
            return Err(einval());
        };
        let (key, gem) = if rg == gpu_id {
            (Arc::as_ptr(&mem) as usize, GemMem::Bo(mem))
        } else {
            (usize::MAX - st.handles.len(), GemMem::Foreign)
        };
        if let Some(h) = st.handles.get(&(rn, key)) {
            return Ok((rn, *h, gem));
        }
        let h = Self::new_handle(st, rn);
        st.handles.insert((rn, key), h);
        Ok((rn, h, gem))
    }
}

impl AmdgpuRender for SimKfd {
    fn render_info(&self, render: BorrowedFd<'_>) -> io::Result<RenderInfo> {
        let mut st = self.state();
        let (_, gpu_id, _) = self.render_vm(&mut st, render)?;
        let family = self
            .gpu(gpu_id)
            .map(|g| g.family)
            .ok_or_else(|| err(libc::ENODEV))?;
        Ok(RenderInfo {
            family,
            va_start: SIM_VA_START,
            va_end: SIM_VA_END,
        })
    }

    fn gem_census(&self, render: BorrowedFd<'_>) -> io::Result<Option<GemCensus>> {
        let mut st = self.state();
        if st.faults.no_gem_list {
            return Ok(None);
        }
        let (_, _, vm) = self.render_vm(&mut st, render)?;
        Ok(Some(GemCensus {
            bos: vm.objects.len(),
            // As the kernel: only dma-bufs of other devices are flagged; a BO of this GPU
            // imported into the file is the same object.
            imported: vm
                .objects
                .values()
                .filter(|m| matches!(m, GemMem::Foreign))
                .count(),
        }))
    }

    fn gem_import(&self, render: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32> {
        let mut st = self.state();
        let (rn, h, gem) = self.prime_import(&mut st, render, dmabuf)?;
        st.vms.entry(rn).or_default().objects.insert(h, gem);
        Ok(h)
    }

    unsafe fn gem_userptr(
        &self,
        render: BorrowedFd<'_>,
        addr: *mut u8,
        size: u64,
    ) -> io::Result<u32> {
        let mut st = self.state();
        fire(&mut st.faults.userptr)?;
        if (addr as u64 | size) % PAGE != 0 || size == 0 || addr.is_null() {
            return Err(einval());
        }
        let user = GemMem::User {
            addr: addr as usize,
            size,
        };
        let h = self.add_object(&mut st, render, user)?;
        st.sdma.userptrs += 1;
        Ok(h)
    }

    fn gem_create_mapped(
        &self,
        render: BorrowedFd<'_>,
        size: u64,
    ) -> io::Result<(u32, HostMapping)> {
        if size == 0 || size % PAGE != 0 {
            return Err(einval());
        }
        let mem = Arc::new(BoMem::new("kfdsim-gtt", size, 0)?);
        // SAFETY: a memfd of `size` bytes, mapped shared; the simulator only reads it with
        // `pread` while executing submissions.
        let mapping =
            unsafe { HostMapping::map(std::os::fd::AsFd::as_fd(&mem.file), 0, size as usize) }?;
        let h = self.add_object(&mut self.state(), render, GemMem::Local(mem))?;
        Ok((h, mapping))
    }

    fn gem_close(&self, render: BorrowedFd<'_>, handle: u32) -> io::Result<()> {
        let mut st = self.state();
        let (rn, _, vm) = self.render_vm(&mut st, render)?;
        vm.objects.remove(&handle).ok_or_else(einval)?;
        vm.maps.retain(|_, (h, _)| *h != handle);
        st.handles.retain(|(f, _), h| !(*f == rn && *h == handle));
        Ok(())
    }

    fn gem_va(
        &self,
        render: BorrowedFd<'_>,
        handle: u32,
        va: u64,
        size: u64,
        map: bool,
    ) -> io::Result<()> {
        let mut st = self.state();
        let (_, _, vm) = self.render_vm(&mut st, render)?;
        let obj = vm.objects.get(&handle).ok_or_else(|| err(libc::ENOENT))?;
        if !map {
            return match vm.maps.get(&va) {
                Some(&(h, s)) if h == handle && s == size => {
                    vm.maps.remove(&va);
                    Ok(())
                }
                _ => Err(einval()),
            };
        }
        if (va | size) % PAGE != 0
            || size == 0
            || va < SIM_VA_START
            || va.checked_add(size).is_none_or(|e| e > SIM_VA_END)
            || (!matches!(obj, GemMem::Foreign)
                && size
                    > obj
                        .size()
                        .next_multiple_of(criu_gpu_core::amdgpu::page_size() as u64))
        {
            return Err(einval());
        }
        let overlaps = vm
            .maps
            .range(..va + size)
            .next_back()
            .is_some_and(|(&s, &(_, len))| s + len > va);
        if overlaps {
            return Err(einval());
        }
        vm.maps.insert(va, (handle, size));
        Ok(())
    }

    fn ctx_create(&self, render: BorrowedFd<'_>) -> io::Result<u32> {
        let mut st = self.state();
        let (_, _, vm) = self.render_vm(&mut st, render)?;
        vm.next_ctx += 1;
        let id = vm.next_ctx;
        vm.contexts.insert(id, 0);
        st.sdma.contexts += 1;
        Ok(id)
    }

    fn ctx_free(&self, render: BorrowedFd<'_>, ctx: u32) -> io::Result<()> {
        let mut st = self.state();
        let (_, _, vm) = self.render_vm(&mut st, render)?;
        vm.contexts.remove(&ctx).ok_or_else(einval)?;
        vm.jobs.retain(|(c, _), _| *c != ctx);
        Ok(())
    }

    fn submit_dma(
        &self,
        render: BorrowedFd<'_>,
        ctx: u32,
        bos: &[u32],
        ib_va: u64,
        ib_bytes: u32,
    ) -> io::Result<u64> {
        let mut st = self.state();
        fire(&mut st.faults.sdma_submit)?;
        let hang = st.faults.sdma_hang;
        let (download_at, upload_at) = (st.faults.download_at, st.faults.upload_at);
        let (rn, gpu_id, vm) = self.render_vm(&mut st, render)?;
        if !vm.contexts.contains_key(&ctx) {
            return Err(einval());
        }
        if bos.iter().any(|h| !vm.objects.contains_key(h)) {
            return Err(err(libc::ENOENT));
        }
        if ib_bytes == 0 || ib_bytes % 4 != 0 || ib_va % 32 != 0 {
            return Err(einval());
        }
        // The kernel checks the IB's address when it parses the submission.
        let (ib_mem, ib_off, _) = vm
            .resolve(ib_va, u64::from(ib_bytes), bos)
            .map_err(|_| einval())?;
        let GemMem::Local(ib_mem) = ib_mem else {
            return Err(einval());
        };
        let mut raw = vec![0u8; ib_bytes as usize];
        ib_mem.file.read_exact_at(&mut raw, ib_off)?;
        let ib: Vec<u32> = raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let family = self.gpu(gpu_id).map(|g| g.family).unwrap_or(0);
        // The GPU's part: decode and resolve every packet, then copy outside the lock. As on
        // hardware, a packet whose addresses do not resolve is a page fault: recorded in the
        // VM, its copy not done, the job still completes. An illegal packet or an injected
        // device error fails the job (its fence carries the error).
        let (plan, page_fault) = plan_copies(vm, &ib, family, bos, download_at, upload_at);
        if let Some(va) = page_fault {
            // The address of the first page the copy could not reach, as the VM hub reports.
            let page_of = |v: u64| v & !(PAGE - 1);
            vm.fault = Some((page_of(va), 1));
        }
        let seq = {
            let s = vm.contexts.get_mut(&ctx).expect("checked above");
            *s += 1;
            *s
        };
        st.sdma.submissions += 1;
        drop(st);
        let job = match plan {
            _ if hang => Job::Hung,
            Err(errno) => Job::Failed(errno),
            Ok(ops) => {
                let mut job = Job::Done;
                for op in &ops {
                    // SAFETY: user memory in `ops` was resolved through open registrations of
                    // this VM, whose owner keeps them open while it waits for this job.
                    if let Err(e) = unsafe { run_copy(op) } {
                        job = Job::Failed(e.raw_os_error().unwrap_or(libc::EIO));
                        break;
                    }
                }
                let mut st = self.state();
                st.sdma.packets += ops.len() as u64;
                st.sdma.bytes += ops.iter().map(|o| o.len).sum::<u64>();
                job
            }
        };
        let mut st = self.state();
        if let Some(vm) = st.vms.get_mut(&rn) {
            vm.jobs.insert((ctx, seq), job);
        }
        Ok(seq)
    }

    fn vm_fault(&self, render: BorrowedFd<'_>) -> io::Result<VmFaultState> {
        let mut st = self.state();
        let (_, _, vm) = self.render_vm(&mut st, render)?;
        Ok(match vm.fault {
            None => VmFaultState::Clean,
            Some((addr, status)) => VmFaultState::Faulted { addr, status },
        })
    }

    fn wait_dma(
        &self,
        render: BorrowedFd<'_>,
        ctx: u32,
        seq: u64,
        _timeout: std::time::Duration,
    ) -> io::Result<bool> {
        let mut st = self.state();
        let (_, _, vm) = self.render_vm(&mut st, render)?;
        match vm.jobs.get(&(ctx, seq)) {
            Some(Job::Done) => Ok(true),
            Some(Job::Hung) => Ok(false),
            Some(Job::Failed(errno)) => Err(err(*errno)),
            None => Err(einval()),
        }
    }
}
