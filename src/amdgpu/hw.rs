//! [`KfdDevice`] on the real kernel: `/dev/kfd` and `/dev/dri/renderD*` through `kfd-sys`.
//!
//! **Not verified on AMD hardware.** The project's test machines have no AMD GPU; this code
//! follows the kernel uAPI as `kfd-sys` documents it and the behaviour described in the
//! project's amdgpu specification, and is kept minimal.
//!
//! BO contents are accessed by the CPU, not by the GPU's SDMA engine as CRIU's C plugin
//! does: the dma-buf fd KFD exports for a BO is imported into a render-node file
//! (`DRM_IOCTL_PRIME_FD_TO_HANDLE`), its fake offset is queried (`DRM_IOCTL_AMDGPU_GEM_MMAP`)
//! and the BO is mapped through that file. Consequences, to be checked on hardware:
//!
//! * VRAM BOs must be CPU-visible (large BAR / resizable BAR, as on Instinct parts) and not
//!   created with `AMDGPU_GEM_CREATE_NO_CPU_ACCESS`; otherwise the mapping fails and the
//!   dump or restore fails with that error (it is never silently skipped).
//! * CPU reads of VRAM through the BAR are uncached and much slower than SDMA; the copy
//!   pipeline's parallelism hides part of it.
//!
//! An SDMA path (userptr staging BO, IB of `COPY_LINEAR` packets, `AMDGPU_CS` on
//! `AMDGPU_HW_IP_DMA`, fence wait) fits behind the same [`GpuBuffer`] interface and is the
//! planned replacement; it needs hardware to be written and checked (spec §4.1, B9).

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;

use kfd_sys::kfd_ioctl_criu_args;

use super::device::{FileIdentity, GpuBuffer, KfdDevice};

/// Path of libhsakmt's shared memory file.
const HSAKMT_SHM_PATH: &str = "/dev/shm/hsakmt_shared_mem";
/// `shm_open` name of that file.
const HSAKMT_SHM_NAME: &std::ffi::CStr = c"/hsakmt_shared_mem";
/// Name of libhsakmt's semaphore.
const HSAKMT_SEM_NAME: &std::ffi::CStr = c"hsakmt_semaphore";

/// The real kernel.
#[derive(Debug, Default, Clone, Copy)]
pub struct HwDevice;

impl HwDevice {
    /// The machine's amdkfd.
    pub fn new() -> HwDevice {
        HwDevice
    }
}

fn open_rw(path: &str) -> io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is a valid NUL-terminated path; open returns a new fd or -1.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A BO imported into a render-node file and mapped for CPU access.
struct MappedBo {
    render: OwnedFd,
    handle: u32,
    ptr: NonNull<u8>,
    size: u64,
}

// SAFETY: the mapping is shared memory of a GPU BO; concurrent access to disjoint ranges from
// several threads is what the pipeline does and is as safe as for any MAP_SHARED mapping.
unsafe impl Send for MappedBo {}
// SAFETY: see `Send`; methods only copy bytes in or out of the mapping.
unsafe impl Sync for MappedBo {}

impl MappedBo {
    fn range(&self, offset: u64, len: usize) -> io::Result<*mut u8> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => {
                // SAFETY: `offset < size`, within the mapping.
                Ok(unsafe { self.ptr.as_ptr().add(offset as usize) })
            }
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }
}

impl GpuBuffer for MappedBo {
    fn size(&self) -> u64 {
        self.size
    }

    fn download(&self, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        let src = self.range(offset, dst.len())?;
        // SAFETY: `src..src+len` lies in the live mapping (checked by `range`); `dst` is a
        // distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn upload(&self, offset: u64, src: &[u8]) -> io::Result<()> {
        let dst = self.range(offset, src.len())?;
        // SAFETY: `dst..dst+len` lies in the live, writable mapping (checked by `range`);
        // `src` is a distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }
}

impl Drop for MappedBo {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`size` describe the mapping made in `import_buffer`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.size as usize) };
        // SAFETY: the handle was created by our PRIME import into our own render file.
        if let Err(e) = unsafe { kfd_sys::gem_close(self.render.as_fd(), self.handle) } {
            log::warn!("amdgpu: closing GEM handle {}: {e}", self.handle);
        }
    }
}

impl KfdDevice for HwDevice {
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

    fn import_buffer(
        &self,
        render: BorrowedFd<'_>,
        dmabuf: BorrowedFd<'_>,
        size: u64,
    ) -> io::Result<Box<dyn GpuBuffer>> {
        let len = usize::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // Our own file description, so the GEM handle lives in a namespace we control.
        let render = render.try_clone_to_owned()?;
        // SAFETY: `render` is a render node the caller opened; the dma-buf stays open for
        // the call.
        let handle = unsafe { kfd_sys::prime_fd_to_handle(render.as_fd(), dmabuf) }?;
        // SAFETY: `render` is an amdgpu render node and `handle` one of its GEM handles.
        let offset = match unsafe { kfd_sys::amdgpu_gem_mmap_offset(render.as_fd(), handle) } {
            Ok(o) => o,
            Err(e) => {
                // SAFETY: the handle was just created by the import above.
                let _ = unsafe { kfd_sys::gem_close(render.as_fd(), handle) };
                if e.raw_os_error() == Some(libc::EPERM) {
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "the BO has no CPU access (VRAM allocated without KFD's PUBLIC flag); \
                         this build copies BO contents through CPU mappings only, the SDMA path \
                         that can reach such BOs is not implemented",
                    ));
                }
                return Err(e);
            }
        };
        // SAFETY: mapping `len` bytes of the BO through its fake offset in the same render
        // file; the kernel validates offset and size.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                render.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // SAFETY: the handle was created by the import above.
            let _ = unsafe { kfd_sys::gem_close(render.as_fd(), handle) };
            return Err(e);
        }
        Ok(Box::new(MappedBo {
            render,
            handle,
            ptr: NonNull::new(ptr.cast()).expect("mmap succeeded"),
            size,
        }))
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
            // SAFETY: valid name; shm_open returns a new fd or -1.
            let fd = unsafe {
                libc::shm_open(
                    HSAKMT_SHM_NAME.as_ptr(),
                    libc::O_CREAT | libc::O_RDWR | libc::O_CLOEXEC,
                    0o666,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` was just created and is owned by nobody else.
            let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
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
}
