//! [`KfdDevice`] on the real kernel: `/dev/kfd` and `/dev/dri/renderD*` through `kfd-sys`.
//!
//! **Not verified on AMD hardware.** The project's test machines have no AMD GPU; this code
//! follows the kernel uAPI as `kfd-sys` documents it and the kernel behaviour that CRIU's C
//! amdgpu plugin relies on, and is kept minimal.
//!
//! The [`AmdgpuRender`] methods are one ioctl each, on the render-node file the SDMA engine
//! ([`super::sdma`]) opened: `PRIME_FD_TO_HANDLE`, `AMDGPU_GEM_USERPTR` (anonymous memory,
//! validated and registered), `AMDGPU_GEM_CREATE` of a write-combined GTT BO mapped through
//! `AMDGPU_GEM_MMAP`, `AMDGPU_GEM_VA`, `AMDGPU_CTX`, `AMDGPU_CS` with an IB chunk for ring 0
//! of the DMA IP and a BO-handles chunk (no BO list object), and `AMDGPU_WAIT_CS` with an
//! absolute `CLOCK_MONOTONIC` deadline.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use kfd_sys::{
    AMDGPU_CHUNK_ID_BO_HANDLES, AMDGPU_CHUNK_ID_IB, AMDGPU_CTX_OP_ALLOC_CTX,
    AMDGPU_CTX_OP_FREE_CTX, AMDGPU_GEM_CREATE_CPU_GTT_USWC, AMDGPU_GEM_DOMAIN_GTT,
    AMDGPU_GEM_USERPTR_ANONONLY, AMDGPU_GEM_USERPTR_REGISTER, AMDGPU_GEM_USERPTR_VALIDATE,
    AMDGPU_HW_IP_DMA, AMDGPU_VA_OP_MAP, AMDGPU_VA_OP_UNMAP, AMDGPU_VM_PAGE_EXECUTABLE,
    AMDGPU_VM_PAGE_READABLE, AMDGPU_VM_PAGE_WRITEABLE, drm_amdgpu_bo_list_entry,
    drm_amdgpu_bo_list_in, drm_amdgpu_cs, drm_amdgpu_cs_chunk, drm_amdgpu_cs_chunk_ib,
    drm_amdgpu_cs_in, drm_amdgpu_ctx, drm_amdgpu_gem_create, drm_amdgpu_gem_create_in,
    drm_amdgpu_gem_userptr, drm_amdgpu_gem_va, drm_amdgpu_wait_cs, drm_amdgpu_wait_cs_in,
    kfd_ioctl_criu_args,
};

use super::device::{
    AmdgpuRender, FileIdentity, GemCensus, HostMapping, KfdDevice, KfdHolder, RenderInfo,
    VmFaultState,
};
use super::holder;

/// Path of libhsakmt's shared memory file.
const HSAKMT_SHM_PATH: &str = "/dev/shm/hsakmt_shared_mem";
/// `shm_open` name of that file.
const HSAKMT_SHM_NAME: &std::ffi::CStr = c"/hsakmt_shared_mem";
/// Name of libhsakmt's semaphore.
const HSAKMT_SEM_NAME: &std::ffi::CStr = c"hsakmt_semaphore";

/// The real kernel.
#[derive(Debug, Default)]
pub struct KernelKfd {
    /// The processes a dump traces, looked up once for every KFD file of the dump.
    tracees: holder::Tracees,
}

impl KernelKfd {
    /// The machine's amdkfd.
    pub fn new() -> KernelKfd {
        KernelKfd::default()
    }
}

fn open_rw(path: &str) -> io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let flags = nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC;
    Ok(nix::fcntl::open(
        c.as_c_str(),
        flags,
        nix::sys::stat::Mode::empty(),
    )?)
}

/// Absolute `CLOCK_MONOTONIC` time `timeout` from now, in ns, as `WAIT_CS` wants it.
fn deadline_ns(timeout: Duration) -> u64 {
    // CLOCK_MONOTONIC cannot fail; a zero "now" would only shorten the wait.
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        (t.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(t.tv_nsec() as u64)
    });
    // Kept below 2^63: the kernel reads larger values as "wait forever".
    now.saturating_add(timeout.as_nanos().min(u64::MAX as u128) as u64)
        .min(i64::MAX as u64)
}

impl AmdgpuRender for KernelKfd {
    fn render_info(&self, render: BorrowedFd<'_>) -> io::Result<RenderInfo> {
        // SAFETY: the engine passes render nodes it opened itself.
        let info = unsafe { kfd_sys::amdgpu_query_device_info(render) }?;
        Ok(RenderInfo {
            family: info.family,
            va_start: info.virtual_address_offset,
            va_end: info.virtual_address_max,
        })
    }

    fn gem_census(&self, render: BorrowedFd<'_>) -> io::Result<Option<GemCensus>> {
        let mut entries = vec![kfd_sys::v6_18::drm_amdgpu_gem_list_handles_entry::default(); 64];
        // The list may grow between calls; a few rounds, each with room for what was there.
        for _ in 0..4 {
            // SAFETY: a render node CRIU drained from the process; the call only lists.
            let n = match unsafe { kfd_sys::amdgpu_gem_list_handles(render, &mut entries) } {
                Ok(n) => n,
                // DRM answers EINVAL for an amdgpu ioctl it does not know.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
                Err(e) => return Err(e),
            };
            if n <= entries.len() {
                let imported = entries[..n]
                    .iter()
                    .filter(|e| {
                        e.flags & kfd_sys::v6_18::AMDGPU_GEM_LIST_HANDLES_FLAG_IS_IMPORT != 0
                    })
                    .count();
                return Ok(Some(GemCensus { bos: n, imported }));
            }
            if n > 1 << 22 {
                return Err(io::Error::from_raw_os_error(libc::E2BIG));
            }
            entries.resize(n + 16, Default::default());
        }
        Err(io::Error::from_raw_os_error(libc::EAGAIN))
    }

    fn gem_import(&self, render: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32> {
        // SAFETY: `render` is a render node the engine opened; the dma-buf is open.
        unsafe { kfd_sys::prime_fd_to_handle(render, dmabuf) }
    }

    unsafe fn gem_userptr(
        &self,
        render: BorrowedFd<'_>,
        addr: *mut u8,
        size: u64,
    ) -> io::Result<u32> {
        let mut args = drm_amdgpu_gem_userptr {
            addr: addr as u64,
            size,
            // Anonymous memory only, its pages looked up now (a bad range fails here, not in
            // the middle of a copy; they are not pinned), and followed by an MMU notifier.
            flags: AMDGPU_GEM_USERPTR_ANONONLY
                | AMDGPU_GEM_USERPTR_VALIDATE
                | AMDGPU_GEM_USERPTR_REGISTER,
            handle: 0,
        };
        // SAFETY: the caller guarantees the memory range, per this method's contract.
        unsafe { kfd_sys::amdgpu_gem_userptr(render, &mut args) }?;
        Ok(args.handle)
    }

    fn gem_create_mapped(
        &self,
        render: BorrowedFd<'_>,
        size: u64,
    ) -> io::Result<(u32, HostMapping)> {
        let len = usize::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        let mut args = drm_amdgpu_gem_create::default();
        args.in_ = drm_amdgpu_gem_create_in {
            bo_size: size,
            alignment: 4096,
            domains: u64::from(AMDGPU_GEM_DOMAIN_GTT),
            // Written by the CPU, read by the GPU: write-combined.
            domain_flags: u64::from(AMDGPU_GEM_CREATE_CPU_GTT_USWC),
        };
        // SAFETY: an amdgpu render node the engine opened; the argument has no pointers.
        unsafe { kfd_sys::amdgpu_gem_create(render, &mut args) }?;
        // SAFETY: a successful GEM_CREATE wrote the `out` member.
        let handle = unsafe { args.out.handle };
        let mapped = (|| {
            // SAFETY: `handle` is a BO just created in `render`.
            let offset = unsafe { kfd_sys::amdgpu_gem_mmap_offset(render, handle) }?;
            // SAFETY: the fake offset of a BO of `len` bytes in the same file.
            unsafe { HostMapping::map(render, offset, len) }
        })();
        match mapped {
            Ok(m) => Ok((handle, m)),
            Err(e) => {
                // SAFETY: the handle was created above and is not used elsewhere.
                let _ = unsafe { kfd_sys::gem_close(render, handle) };
                Err(e)
            }
        }
    }

    fn gem_close(&self, render: BorrowedFd<'_>, handle: u32) -> io::Result<()> {
        // SAFETY: the engine closes only handles it created in its own file.
        unsafe { kfd_sys::gem_close(render, handle) }
    }

    fn gem_va(
        &self,
        render: BorrowedFd<'_>,
        handle: u32,
        va: u64,
        size: u64,
        map: bool,
    ) -> io::Result<()> {
        let args = drm_amdgpu_gem_va {
            handle,
            operation: if map {
                AMDGPU_VA_OP_MAP
            } else {
                AMDGPU_VA_OP_UNMAP
            },
            flags: AMDGPU_VM_PAGE_READABLE | AMDGPU_VM_PAGE_WRITEABLE | AMDGPU_VM_PAGE_EXECUTABLE,
            va_address: va,
            offset_in_bo: 0,
            map_size: size,
            ..Default::default()
        };
        // SAFETY: an amdgpu render node the engine opened, in whose VM only the engine maps.
        unsafe { kfd_sys::amdgpu_gem_va(render, &args) }
    }

    fn ctx_create(&self, render: BorrowedFd<'_>) -> io::Result<u32> {
        let mut args = drm_amdgpu_ctx::default();
        args.in_.op = AMDGPU_CTX_OP_ALLOC_CTX;
        // SAFETY: an amdgpu render node; the argument has no pointers.
        unsafe { kfd_sys::amdgpu_ctx(render, &mut args) }?;
        // SAFETY: ALLOC_CTX wrote the `alloc` member of the output.
        Ok(unsafe { args.out.alloc.ctx_id })
    }

    fn ctx_free(&self, render: BorrowedFd<'_>, ctx: u32) -> io::Result<()> {
        let mut args = drm_amdgpu_ctx::default();
        args.in_.op = AMDGPU_CTX_OP_FREE_CTX;
        args.in_.ctx_id = ctx;
        // SAFETY: an amdgpu render node; the argument has no pointers.
        unsafe { kfd_sys::amdgpu_ctx(render, &mut args) }
    }

    fn submit_dma(
        &self,
        render: BorrowedFd<'_>,
        ctx: u32,
        bos: &[u32],
        ib_va: u64,
        ib_bytes: u32,
    ) -> io::Result<u64> {
        let mut entries: Vec<drm_amdgpu_bo_list_entry> = bos
            .iter()
            .map(|&bo_handle| drm_amdgpu_bo_list_entry {
                bo_handle,
                bo_priority: 0,
            })
            .collect();
        let mut list = drm_amdgpu_bo_list_in {
            operation: u32::MAX,
            list_handle: 0,
            bo_number: entries.len() as u32,
            bo_info_size: std::mem::size_of::<drm_amdgpu_bo_list_entry>() as u32,
            bo_info_ptr: entries.as_mut_ptr() as u64,
        };
        let mut ib = drm_amdgpu_cs_chunk_ib {
            va_start: ib_va,
            ib_bytes,
            ip_type: AMDGPU_HW_IP_DMA,
            ip_instance: 0,
            ring: 0,
            ..Default::default()
        };
        let mut chunks = [
            drm_amdgpu_cs_chunk {
                chunk_id: AMDGPU_CHUNK_ID_IB,
                length_dw: (std::mem::size_of::<drm_amdgpu_cs_chunk_ib>() / 4) as u32,
                chunk_data: (&raw mut ib) as u64,
            },
            drm_amdgpu_cs_chunk {
                chunk_id: AMDGPU_CHUNK_ID_BO_HANDLES,
                length_dw: (std::mem::size_of::<drm_amdgpu_bo_list_in>() / 4) as u32,
                chunk_data: (&raw mut list) as u64,
            },
        ];
        let mut chunk_ptrs = [(&raw mut chunks[0]) as u64, (&raw mut chunks[1]) as u64];
        let mut args = drm_amdgpu_cs::default();
        args.in_ = drm_amdgpu_cs_in {
            ctx_id: ctx,
            bo_list_handle: 0,
            num_chunks: chunks.len() as u32,
            flags: 0,
            chunks: chunk_ptrs.as_mut_ptr() as u64,
        };
        // SAFETY: every pointer in the chunks points to a local above that outlives the
        // call, with the lengths given; the IB copies between BOs the engine mapped in its
        // own VM (a BO of the process and the lane's staging memory).
        unsafe { kfd_sys::amdgpu_cs(render, &mut args) }?;
        // SAFETY: a successful CS wrote the `out` member.
        Ok(unsafe { args.out.handle })
    }

    fn vm_fault(&self, render: BorrowedFd<'_>) -> io::Result<VmFaultState> {
        // SAFETY: a render node the engine opened; the query only reads kernel state.
        match unsafe { kfd_sys::amdgpu_query_gpuvm_fault(render) } {
            Ok(f) if f.addr == 0 && f.status == 0 => Ok(VmFaultState::Clean),
            Ok(f) => Ok(VmFaultState::Faulted {
                addr: f.addr,
                status: f.status,
            }),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(VmFaultState::Unknown),
            Err(e) => Err(e),
        }
    }

    fn wait_dma(
        &self,
        render: BorrowedFd<'_>,
        ctx: u32,
        seq: u64,
        timeout: Duration,
    ) -> io::Result<bool> {
        let mut args = drm_amdgpu_wait_cs::default();
        args.in_ = drm_amdgpu_wait_cs_in {
            handle: seq,
            timeout: deadline_ns(timeout),
            ip_type: AMDGPU_HW_IP_DMA,
            ip_instance: 0,
            ring: 0,
            ctx_id: ctx,
        };
        // SAFETY: an amdgpu render node; the argument has no pointers.
        unsafe { kfd_sys::amdgpu_wait_cs(render, &mut args) }?;
        // SAFETY: a successful WAIT_CS wrote the `out` member.
        Ok(unsafe { args.out.status } == 0)
    }
}

impl KfdDevice for KernelKfd {
    fn describe(&self) -> String {
        "amdkfd".to_string()
    }

    fn kfd_rdev(&self) -> io::Result<u64> {
        Ok(std::fs::metadata(kfd_sys::KFD_DEVICE_PATH)?.rdev())
    }

    fn identify(&self, fd: BorrowedFd<'_>) -> io::Result<FileIdentity> {
        let meta = File::from(fd.try_clone_to_owned()?).metadata()?;
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(FileIdentity {
            mode: meta.mode(),
            rdev: meta.rdev(),
            dmabuf: link.starts_with("/dmabuf:") || link.starts_with("anon_inode:dmabuf"),
        })
    }

    fn open_kfd(&self) -> io::Result<OwnedFd> {
        open_rw(kfd_sys::KFD_DEVICE_PATH)
    }

    fn get_version(&self, kfd: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
        // SAFETY: callers pass fds they opened as /dev/kfd or classified as KFD.
        let v = unsafe { kfd_sys::get_version(kfd) }?;
        Ok((v.major_version, v.minor_version))
    }

    unsafe fn criu_op(
        &self,
        kfd: BorrowedFd<'_>,
        args: &mut kfd_ioctl_criu_args,
    ) -> io::Result<()> {
        // SAFETY: this method has the same contract as kfd_sys::criu_op, which the caller
        // upholds.
        unsafe { kfd_sys::criu_op(kfd, args) }
    }

    fn render_node_present(&self, minor: u32) -> bool {
        std::path::Path::new(&format!("{}{minor}", kfd_sys::DRM_RENDER_NODE_PREFIX)).exists()
    }

    fn open_render_node(&self, minor: u32) -> io::Result<OwnedFd> {
        open_rw(&format!("{}{minor}", kfd_sys::DRM_RENDER_NODE_PREFIX))
    }

    fn buffer_key(&self, render: BorrowedFd<'_>, dmabuf: BorrowedFd<'_>) -> io::Result<u32> {
        // SAFETY: `render` is a render node the caller opened for keys only; the handle
        // stays in that file (never closed) until the file is closed.
        unsafe { kfd_sys::prime_fd_to_handle(render, dmabuf) }
    }

    fn hsakmt_shared_mem(&self) -> io::Result<Option<(u64, u32)>> {
        let f = match File::open(HSAKMT_SHM_PATH) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let size = f.metadata()?.len();
        let mut magic = [0u8; 4];
        let mut r = f.take(4);
        let n = r.read(&mut magic)?;
        if n < 4 {
            magic = [0; 4];
        }
        Ok(Some((size, u32::from_ne_bytes(magic))))
    }

    fn restore_hsakmt_shared_mem(&self, size: u64, magic: u32) -> io::Result<()> {
        if size > 0 && !std::path::Path::new(HSAKMT_SHM_PATH).exists() {
            use nix::fcntl::OFlag;
            let fd = nix::sys::mman::shm_open(
                HSAKMT_SHM_NAME,
                OFlag::O_CREAT | OFlag::O_RDWR | OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
            )?;
            let f = File::from(fd);
            f.set_len(size)?;
            use std::os::unix::fs::FileExt;
            f.write_all_at(&magic.to_ne_bytes()[..(size.min(4) as usize)], 0)?;
        }
        // SAFETY: valid name; the variadic mode and value are passed as sem_open expects.
        let sem = unsafe {
            libc::sem_open(
                HSAKMT_SEM_NAME.as_ptr(),
                libc::O_CREAT,
                0o666 as libc::c_uint,
                1 as libc::c_uint,
            )
        };
        if sem == libc::SEM_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `sem` was returned by sem_open above.
        unsafe { libc::sem_close(sem) };
        Ok(())
    }

    fn current_task(&self) -> u32 {
        std::process::id()
    }

    fn kfd_holder(&self, kfd: BorrowedFd<'_>) -> io::Result<Option<KfdHolder>> {
        Ok(self.tracees.holder_of(kfd))
    }

    fn unpause_holder(&self, holder: &KfdHolder, pidfd: Option<BorrowedFd<'_>>) -> io::Result<u32> {
        let unpause = |file: BorrowedFd<'_>| super::device::unpause(self, file);
        holder::unpause_from_outside(holder, pidfd, self.kfd_rdev()?, &unpause)
    }
}
