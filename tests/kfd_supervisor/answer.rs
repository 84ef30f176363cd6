//! The answers: `open`/`openat` of `/dev/kfd` and render nodes, and the KFD and amdgpu ioctls
//! the plugin and the workload issue, each translated to the simulator (`SimKfd`) running in
//! the supervisor: arguments read from and results written to the caller's memory, fds of
//! the caller mapped to the supervisor's own files, fds the simulator creates installed in
//! the caller.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use criu_gpu_core::amdgpu::device::{AmdgpuRender, HostMapping, KfdDevice};
use kfd_sim::{ProcessSpec, SimKfd};
use kfd_sys::*;

use super::seccomp::{self, Answer, Notif};

/// `struct kfd_process_device_apertures`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Apertures {
    pub lds_base: u64,
    pub lds_limit: u64,
    pub scratch_base: u64,
    pub scratch_limit: u64,
    pub gpuvm_base: u64,
    pub gpuvm_limit: u64,
    pub gpu_id: u32,
    pub pad: u32,
}

/// `struct kfd_ioctl_get_process_apertures_new_args`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AperturesNewArgs {
    pub apertures_ptr: u64,
    pub num_of_nodes: u32,
    pub pad: u32,
}

/// `AMDKFD_IOWR(0x14, struct kfd_ioctl_get_process_apertures_new_args)`.
pub const AMDKFD_IOC_GET_PROCESS_APERTURES_NEW: u32 =
    kfd_sys::ioc::iowr::<AperturesNewArgs>(AMDKFD_IOCTL_BASE, 0x14);

/// The apertures amdkfd gives a GFX9-or-later GPU: LDS and scratch in their fixed 4 GiB
/// windows, GPU VM from 64 KiB to the 47-bit limit.
pub fn apertures_of(gpu_id: u32) -> Apertures {
    let lds_base = 1u64 << 48;
    let scratch_base = 2u64 << 48;
    Apertures {
        lds_base,
        lds_limit: lds_base | 0xFFFF_FFFF,
        scratch_base,
        scratch_limit: scratch_base | 0xFFFF_FFFF,
        gpuvm_base: 1 << 16,
        gpuvm_limit: (1 << 47) - 1,
        gpu_id,
        pad: 0,
    }
}

/// Anonymous memory of the supervisor standing in for a caller's userptr range.
struct LocalMem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: owned by the supervisor thread alone; the simulator reads and writes it only
// during calls made from that thread.
unsafe impl Send for LocalMem {}

impl LocalMem {
    fn new(len: usize) -> io::Result<LocalMem> {
        // SAFETY: a new private anonymous mapping chosen by the kernel.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(LocalMem { ptr: p.cast(), len })
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the live mapping, borrowed exclusively through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for LocalMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

struct CmdBuf {
    off: u64,
    size: u64,
    map: HostMapping,
}

struct Userptr {
    pid: u32,
    addr: u64,
    local: LocalMem,
}

/// A render-node file handed out: a memfd (so that the caller can map its command buffers),
/// the simulator's file behind it, and what lives in it.
pub struct RenderFile {
    sim: OwnedFd,
    pub gpu_id: u32,
    backing: File,
    next_off: u64,
    cmdbufs: HashMap<u32, CmdBuf>,
    userptrs: HashMap<u32, Userptr>,
}

pub enum Obj {
    Kfd { sim: OwnedFd },
    Render(RenderFile),
}

/// A file the supervisor handed out: its own reference to the open file, and what it is.
pub struct Handed {
    own: OwnedFd,
    pub obj: Obj,
}

/// Who a listener's processes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A GPU workload: its first open of `/dev/kfd` creates its process in the simulator.
    Workload,
    /// CRIU and what it forks (the plugin's dumper and restorer).
    Criu,
}

/// The supervisor's model: the simulator, the files handed out, a log of answered calls.
pub struct Model {
    pub sim: SimKfd,
    /// What a workload's process is made of (its pid is filled in).
    pub spec: ProcessSpec,
    /// The device the handed-out `/dev/kfd` files are opened from.
    pub kfd_device: String,
    pub files: Vec<Handed>,
    spawned: HashSet<u32>,
    pub log: Vec<String>,
}

fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn answer(r: io::Result<i64>) -> Answer {
    match r {
        Ok(v) => Answer::Value(v),
        Err(e) => Answer::Errno(errno_of(&e)),
    }
}

fn monotonic_ns() -> u64 {
    // SAFETY: plain data filled by clock_gettime.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock and pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

impl Model {
    pub fn new(sim: SimKfd, spec: ProcessSpec, kfd_device: String) -> Model {
        Model {
            sim,
            spec,
            kfd_device,
            files: Vec::new(),
            spawned: HashSet::new(),
            log: Vec::new(),
        }
    }

    fn find(&self, pid: u32, fd: i32) -> Option<usize> {
        if fd < 0 {
            return None;
        }
        self.files
            .iter()
            .position(|h| seccomp::same_file(pid, fd, h.own.as_fd()))
    }

    /// Answers one notification of a process of role `role`.
    pub fn handle(&mut self, listener: BorrowedFd<'_>, role: Role, n: &Notif) -> Answer {
        match n.nr {
            libc::SYS_openat => self.open(listener, role, n, n.args[1], n.args[2]),
            libc::SYS_open => self.open(listener, role, n, n.args[0], n.args[1]),
            libc::SYS_ioctl => self.ioctl(listener, n),
            _ => Answer::Continue,
        }
    }

    fn open(
        &mut self,
        listener: BorrowedFd<'_>,
        role: Role,
        n: &Notif,
        path: u64,
        flags: u64,
    ) -> Answer {
        let Ok(path) = seccomp::read_path(n.pid, path) else {
            return Answer::Continue;
        };
        let cloexec = flags as i32 & libc::O_CLOEXEC != 0;
        let tgid = seccomp::tgid_of(n.pid);
        let made = if path == kfd_sys::KFD_DEVICE_PATH {
            self.open_kfd(role, tgid)
        } else if let Some(minor) = path
            .strip_prefix(kfd_sys::DRM_RENDER_NODE_PREFIX)
            .and_then(|m| m.parse::<u32>().ok())
        {
            self.open_render(minor)
        } else {
            return Answer::Continue;
        };
        let handed = match made {
            Ok(h) => h,
            Err(e) => {
                self.log.push(format!("pid {tgid}: open {path}: {e}"));
                return Answer::Errno(errno_of(&e));
            }
        };
        match seccomp::addfd(listener, n.id, handed.own.as_fd(), cloexec, true) {
            Ok(fd) => {
                self.log.push(format!("pid {tgid}: open {path} -> fd {fd}"));
                self.files.push(handed);
                Answer::Done
            }
            Err(e) => Answer::Errno(errno_of(&e)),
        }
    }

    fn open_kfd(&mut self, role: Role, tgid: u32) -> io::Result<Handed> {
        let sim = if role == Role::Workload && self.spawned.insert(tgid) {
            let mut spec = self.spec.clone();
            spec.pid = tgid;
            spec.ns_pid = tgid;
            spec.seed = u64::from(tgid);
            self.sim.spawn(&spec)?
        } else {
            self.sim.open_kfd()?
        };
        let own = File::options()
            .read(true)
            .write(true)
            .open(&self.kfd_device)
            .or_else(|_| File::open(&self.kfd_device))?;
        Ok(Handed {
            own: own.into(),
            obj: Obj::Kfd { sim },
        })
    }

    fn open_render(&mut self, minor: u32) -> io::Result<Handed> {
        let gpu_id = self
            .sim
            .gpus()
            .iter()
            .find(|g| g.render_minor == minor)
            .map(|g| g.gpu_id)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
        let sim = self.sim.open_render_node(minor)?;
        let name = std::ffi::CString::new(format!("kfd-supervisor-renderD{minor}")).unwrap();
        // SAFETY: a valid name; returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just created, owned here.
        let own = unsafe { OwnedFd::from_raw_fd(fd) };
        let backing = File::from(own.try_clone()?);
        Ok(Handed {
            own,
            obj: Obj::Render(RenderFile {
                sim,
                gpu_id,
                backing,
                next_off: 0,
                cmdbufs: HashMap::new(),
                userptrs: HashMap::new(),
            }),
        })
    }

    fn ioctl(&mut self, listener: BorrowedFd<'_>, n: &Notif) -> Answer {
        let fd = n.args[0] as i32;
        let cmd = n.args[1] as u32;
        let argp = n.args[2];
        let Some(i) = self.find(n.pid, fd) else {
            return Answer::Continue;
        };
        let tgid = seccomp::tgid_of(n.pid);
        let a = match &self.files[i].obj {
            Obj::Kfd { .. } => self.kfd_ioctl(listener, n, i, cmd, argp),
            Obj::Render(_) => self.render_ioctl(n, i, cmd, argp),
        };
        let what = match &a {
            Answer::Value(v) => format!("{v}"),
            Answer::Errno(e) => format!("errno {e}"),
            _ => "done".into(),
        };
        self.log.push(format!(
            "pid {tgid}: ioctl {} on fd {fd} -> {what}",
            ioctl_name(cmd)
        ));
        a
    }

    fn sim_fd(&self, i: usize) -> BorrowedFd<'_> {
        match &self.files[i].obj {
            Obj::Kfd { sim } => sim.as_fd(),
            Obj::Render(r) => r.sim.as_fd(),
        }
    }

    fn kfd_ioctl(
        &mut self,
        listener: BorrowedFd<'_>,
        n: &Notif,
        i: usize,
        cmd: u32,
        argp: u64,
    ) -> Answer {
        let pid = n.pid;
        match cmd {
            AMDKFD_IOC_GET_VERSION => answer((|| {
                let (major_version, minor_version) = self.sim.get_version(self.sim_fd(i))?;
                seccomp::write_obj(
                    pid,
                    argp,
                    &kfd_ioctl_get_version_args {
                        major_version,
                        minor_version,
                    },
                )?;
                Ok(0)
            })()),
            AMDKFD_IOC_ACQUIRE_VM => answer((|| {
                let a: kfd_ioctl_acquire_vm_args = seccomp::read_obj(pid, argp)?;
                match self.find(pid, a.drm_fd as i32).map(|j| &self.files[j].obj) {
                    Some(Obj::Render(r)) if r.gpu_id == a.gpu_id => Ok(0),
                    _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
                }
            })()),
            AMDKFD_IOC_GET_PROCESS_APERTURES_NEW => answer((|| {
                let mut a: AperturesNewArgs = seccomp::read_obj(pid, argp)?;
                let gpus: Vec<u32> = self.sim.gpus().iter().map(|g| g.gpu_id).collect();
                if a.num_of_nodes > 0 {
                    for (k, g) in gpus.iter().take(a.num_of_nodes as usize).enumerate() {
                        seccomp::write_obj(
                            pid,
                            a.apertures_ptr + (k * size_of::<Apertures>()) as u64,
                            &apertures_of(*g),
                        )?;
                    }
                    a.num_of_nodes = a.num_of_nodes.min(gpus.len() as u32);
                } else {
                    a.num_of_nodes = gpus.len() as u32;
                }
                seccomp::write_obj(pid, argp, &a)?;
                Ok(0)
            })()),
            AMDKFD_IOC_CRIU_OP => answer(self.criu_op(listener, n, i, argp)),
            _ => Answer::Errno(libc::EINVAL),
        }
    }

    fn criu_op(
        &mut self,
        listener: BorrowedFd<'_>,
        n: &Notif,
        i: usize,
        argp: u64,
    ) -> io::Result<i64> {
        let pid = n.pid;
        let mut args: kfd_ioctl_criu_args = seccomp::read_obj(pid, argp)?;
        self.sim.set_current_task(seccomp::tgid_of(pid));
        // The simulator's caller rule (the process itself or its tracer) sees the real
        // ptrace relation: CRIU's seize of the workload, the dump guardian's.
        if let Some(owner) = self.sim.kfd_process(self.sim_fd(i)) {
            self.sim
                .set_tracer(owner, seccomp::tracer_of(owner).map(seccomp::tgid_of));
        }
        let with_arrays = args.op == KFD_CRIU_OP_CHECKPOINT || args.op == KFD_CRIU_OP_RESTORE;
        if !with_arrays {
            // SAFETY: these operations read no user pointers.
            unsafe { self.sim.criu_op(self.sim_fd(i), &mut args) }?;
            seccomp::write_obj(pid, argp, &args)?;
            return Ok(0);
        }
        if args.devices == 0 || args.bos == 0 || args.priv_data == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut devices = vec![kfd_criu_device_bucket::default(); args.num_devices as usize];
        let mut bos = vec![kfd_criu_bo_bucket::default(); args.num_bos as usize];
        let mut priv_data = vec![0u8; args.priv_data_size as usize];
        let bytes = |v: &mut [kfd_criu_device_bucket]| -> &mut [u8] {
            // SAFETY: plain data viewed as bytes.
            unsafe {
                std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v))
            }
        };
        seccomp::read_mem(pid, args.devices, bytes(&mut devices))?;
        // SAFETY: plain data viewed as bytes.
        let bo_bytes = unsafe {
            std::slice::from_raw_parts_mut(
                bos.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(&bos[..]),
            )
        };
        seccomp::read_mem(pid, args.bos, bo_bytes)?;
        seccomp::read_mem(pid, args.priv_data, &mut priv_data)?;
        // RESTORE names render files of the caller: the simulator wants its own.
        let caller_drm: Vec<u32> = devices.iter().map(|d| d.drm_fd).collect();
        if args.op == KFD_CRIU_OP_RESTORE {
            for d in devices.iter_mut() {
                let j = self
                    .find(pid, d.drm_fd as i32)
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
                d.drm_fd = self.sim_fd(j).as_raw_fd() as u32;
            }
        }
        let mut local = kfd_ioctl_criu_args {
            devices: devices.as_mut_ptr() as u64,
            bos: bos.as_mut_ptr() as u64,
            priv_data: priv_data.as_mut_ptr() as u64,
            ..args
        };
        // SAFETY: the pointers in `local` are the three vectors above with their lengths.
        unsafe { self.sim.criu_op(self.sim_fd(i), &mut local) }?;
        for (d, fd) in devices.iter_mut().zip(&caller_drm) {
            d.drm_fd = *fd;
        }
        // The dma-bufs the simulator installed here go to the caller.
        for b in bos.iter_mut() {
            if b.dmabuf_fd == KFD_INVALID_FD {
                continue;
            }
            // SAFETY: the simulator installed this fd in this process for the caller.
            let mine = unsafe { OwnedFd::from_raw_fd(b.dmabuf_fd as i32) };
            b.dmabuf_fd = seccomp::addfd(listener, n.id, mine.as_fd(), true, false)? as u32;
        }
        seccomp::write_mem(pid, args.devices, bytes(&mut devices))?;
        // SAFETY: plain data viewed as bytes.
        let bo_bytes = unsafe {
            std::slice::from_raw_parts(bos.as_ptr().cast::<u8>(), std::mem::size_of_val(&bos[..]))
        };
        seccomp::write_mem(pid, args.bos, bo_bytes)?;
        seccomp::write_mem(pid, args.priv_data, &priv_data)?;
        args.num_objects = local.num_objects;
        args.pid = local.pid;
        seccomp::write_obj(pid, argp, &args)?;
        Ok(0)
    }

    fn render(&mut self, i: usize) -> &mut RenderFile {
        match &mut self.files[i].obj {
            Obj::Render(r) => r,
            Obj::Kfd { .. } => unreachable!("checked by the caller"),
        }
    }

    fn render_ioctl(&mut self, n: &Notif, i: usize, cmd: u32, argp: u64) -> Answer {
        let pid = n.pid;
        let sim = self.sim.clone();
        answer((|| -> io::Result<i64> {
            match cmd {
                DRM_IOCTL_AMDGPU_INFO => {
                    let a: drm_amdgpu_info = seccomp::read_obj(pid, argp)?;
                    let r = self.render(i);
                    let bytes: Vec<u8> = match a.query {
                        AMDGPU_INFO_DEV_INFO => {
                            let info = sim.render_info(r.sim.as_fd())?;
                            let d = drm_amdgpu_info_device {
                                family: info.family,
                                virtual_address_offset: info.va_start,
                                virtual_address_max: info.va_end,
                                ..Default::default()
                            };
                            // SAFETY: plain data viewed as bytes.
                            unsafe {
                                std::slice::from_raw_parts(
                                    (&raw const d).cast::<u8>(),
                                    size_of_val(&d),
                                )
                            }
                            .to_vec()
                        }
                        v6_18::AMDGPU_INFO_GPUVM_FAULT => {
                            let mut f = v6_18::drm_amdgpu_info_gpuvm_fault::default();
                            if let criu_gpu_core::amdgpu::device::VmFaultState::Faulted {
                                addr,
                                status,
                            } = sim.vm_fault(r.sim.as_fd())?
                            {
                                f.addr = addr;
                                f.status = status;
                            }
                            // SAFETY: plain data viewed as bytes.
                            unsafe {
                                std::slice::from_raw_parts(
                                    (&raw const f).cast::<u8>(),
                                    size_of_val(&f),
                                )
                            }
                            .to_vec()
                        }
                        _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
                    };
                    let len = bytes.len().min(a.return_size as usize);
                    seccomp::write_mem(pid, a.return_pointer, &bytes[..len])?;
                    Ok(0)
                }
                DRM_IOCTL_PRIME_FD_TO_HANDLE => {
                    let mut a: drm_prime_handle = seccomp::read_obj(pid, argp)?;
                    let dmabuf = seccomp::take_fd(pid, a.fd)?;
                    a.handle = sim.gem_import(self.render(i).sim.as_fd(), dmabuf.as_fd())?;
                    seccomp::write_obj(pid, argp, &a)?;
                    Ok(0)
                }
                DRM_IOCTL_AMDGPU_GEM_USERPTR => {
                    let mut a: drm_amdgpu_gem_userptr = seccomp::read_obj(pid, argp)?;
                    let mut local = LocalMem::new(a.size as usize)?;
                    let r = self.render(i);
                    // SAFETY: `local` is anonymous memory of this process kept until the
                    // handle is closed (it lives in the userptr table).
                    a.handle = unsafe {
                        sim.gem_userptr(r.sim.as_fd(), local.bytes().as_mut_ptr(), a.size)
                    }?;
                    r.userptrs.insert(
                        a.handle,
                        Userptr {
                            pid: seccomp::tgid_of(pid),
                            addr: a.addr,
                            local,
                        },
                    );
                    seccomp::write_obj(pid, argp, &a)?;
                    Ok(0)
                }
                DRM_IOCTL_AMDGPU_GEM_CREATE => {
                    let a: drm_amdgpu_gem_create = seccomp::read_obj(pid, argp)?;
                    // SAFETY: the caller filled the `in` member.
                    let size = unsafe { a.in_.bo_size };
                    let r = self.render(i);
                    let (handle, map) = sim.gem_create_mapped(r.sim.as_fd(), size)?;
                    let off = r.next_off;
                    r.next_off += size.div_ceil(4096) * 4096;
                    r.backing.set_len(r.next_off)?;
                    r.cmdbufs.insert(handle, CmdBuf { off, size, map });
                    let mut out = drm_amdgpu_gem_create::default();
                    out.out.handle = handle;
                    seccomp::write_obj(pid, argp, &out)?;
                    Ok(0)
                }
                DRM_IOCTL_AMDGPU_GEM_MMAP => {
                    let a: drm_amdgpu_gem_mmap = seccomp::read_obj(pid, argp)?;
                    // SAFETY: the caller filled the `in` member.
                    let handle = unsafe { a.in_.handle };
                    let off = self
                        .render(i)
                        .cmdbufs
                        .get(&handle)
                        .map(|c| c.off)
                        .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
                    seccomp::write_obj(
                        pid,
                        argp,
                        &drm_amdgpu_gem_mmap {
                            out: drm_amdgpu_gem_mmap_out { addr_ptr: off },
                        },
                    )?;
                    Ok(0)
                }
                DRM_IOCTL_AMDGPU_GEM_VA => {
                    let a: drm_amdgpu_gem_va = seccomp::read_obj(pid, argp)?;
                    sim.gem_va(
                        self.render(i).sim.as_fd(),
                        a.handle,
                        a.va_address,
                        a.map_size,
                        a.operation == AMDGPU_VA_OP_MAP,
                    )?;
                    Ok(0)
                }
                DRM_IOCTL_AMDGPU_CTX => {
                    let a: drm_amdgpu_ctx = seccomp::read_obj(pid, argp)?;
                    // SAFETY: the caller filled the `in` member.
                    let inp = unsafe { a.in_ };
                    let r = self.render(i);
                    match inp.op {
                        AMDGPU_CTX_OP_ALLOC_CTX => {
                            let ctx = sim.ctx_create(r.sim.as_fd())?;
                            seccomp::write_obj(pid, argp, &ctx)?;
                        }
                        AMDGPU_CTX_OP_FREE_CTX => sim.ctx_free(r.sim.as_fd(), inp.ctx_id)?,
                        _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
                    }
                    Ok(0)
                }
                DRM_IOCTL_AMDGPU_CS => self.submit(pid, i, argp),
                DRM_IOCTL_AMDGPU_WAIT_CS => {
                    let a: drm_amdgpu_wait_cs = seccomp::read_obj(pid, argp)?;
                    // SAFETY: the caller filled the `in` member.
                    let w = unsafe { a.in_ };
                    let left = Duration::from_nanos(w.timeout.saturating_sub(monotonic_ns()));
                    let done =
                        sim.wait_dma(self.render(i).sim.as_fd(), w.ctx_id, w.handle, left)?;
                    seccomp::write_obj(pid, argp, &u64::from(!done))?;
                    Ok(0)
                }
                DRM_IOCTL_GEM_CLOSE => {
                    let a: drm_gem_close = seccomp::read_obj(pid, argp)?;
                    let r = self.render(i);
                    sim.gem_close(r.sim.as_fd(), a.handle)?;
                    r.cmdbufs.remove(&a.handle);
                    r.userptrs.remove(&a.handle);
                    Ok(0)
                }
                _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
            }
        })())
    }

    /// `AMDGPU_CS`: the caller's command buffers and userptr memory are brought into the
    /// simulator's copies, the job runs (the simulator finishes it before returning), and
    /// userptr memory goes back to the caller.
    fn submit(&mut self, pid: u32, i: usize, argp: u64) -> io::Result<i64> {
        let einval = || io::Error::from_raw_os_error(libc::EINVAL);
        let cs: drm_amdgpu_cs = seccomp::read_obj(pid, argp)?;
        // SAFETY: the caller filled the `in` member.
        let cs = unsafe { cs.in_ };
        let mut ib = None;
        let mut handles = Vec::new();
        for k in 0..u64::from(cs.num_chunks) {
            let p: u64 = seccomp::read_obj(pid, cs.chunks + 8 * k)?;
            let c: drm_amdgpu_cs_chunk = seccomp::read_obj(pid, p)?;
            match c.chunk_id {
                AMDGPU_CHUNK_ID_IB => {
                    ib = Some(seccomp::read_obj::<drm_amdgpu_cs_chunk_ib>(
                        pid,
                        c.chunk_data,
                    )?)
                }
                AMDGPU_CHUNK_ID_BO_HANDLES => {
                    let l: drm_amdgpu_bo_list_in = seccomp::read_obj(pid, c.chunk_data)?;
                    for e in 0..u64::from(l.bo_number) {
                        let ent: drm_amdgpu_bo_list_entry =
                            seccomp::read_obj(pid, l.bo_info_ptr + e * u64::from(l.bo_info_size))?;
                        handles.push(ent.bo_handle);
                    }
                }
                _ => return Err(einval()),
            }
        }
        let ib = ib.ok_or_else(einval)?;
        let sim = self.sim.clone();
        let r = self.render(i);
        for h in &handles {
            if let Some(c) = r.cmdbufs.get_mut(h) {
                let mut bytes = vec![0u8; c.size as usize];
                r.backing.read_exact_at(&mut bytes, c.off)?;
                let dwords: Vec<u32> = bytes
                    .chunks_exact(4)
                    .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
                    .collect();
                c.map.write_dwords(&dwords)?;
            }
            if let Some(u) = r.userptrs.get_mut(h) {
                let (upid, addr) = (u.pid, u.addr);
                seccomp::read_mem(upid, addr, u.local.bytes())?;
            }
        }
        let seq = sim.submit_dma(r.sim.as_fd(), cs.ctx_id, &handles, ib.va_start, ib.ib_bytes)?;
        for h in &handles {
            if let Some(u) = r.userptrs.get_mut(h) {
                let (upid, addr) = (u.pid, u.addr);
                seccomp::write_mem(upid, addr, u.local.bytes())?;
            }
        }
        seccomp::write_obj(pid, argp, &seq)?;
        Ok(0)
    }
}

/// A name for the logs.
pub fn ioctl_name(cmd: u32) -> &'static str {
    match cmd {
        AMDKFD_IOC_GET_VERSION => "GET_VERSION",
        AMDKFD_IOC_ACQUIRE_VM => "ACQUIRE_VM",
        AMDKFD_IOC_GET_PROCESS_APERTURES_NEW => "GET_PROCESS_APERTURES_NEW",
        AMDKFD_IOC_CRIU_OP => "CRIU_OP",
        DRM_IOCTL_AMDGPU_INFO => "AMDGPU_INFO",
        DRM_IOCTL_PRIME_FD_TO_HANDLE => "PRIME_FD_TO_HANDLE",
        DRM_IOCTL_AMDGPU_GEM_USERPTR => "AMDGPU_GEM_USERPTR",
        DRM_IOCTL_AMDGPU_GEM_CREATE => "AMDGPU_GEM_CREATE",
        DRM_IOCTL_AMDGPU_GEM_MMAP => "AMDGPU_GEM_MMAP",
        DRM_IOCTL_AMDGPU_GEM_VA => "AMDGPU_GEM_VA",
        DRM_IOCTL_AMDGPU_CTX => "AMDGPU_CTX",
        DRM_IOCTL_AMDGPU_CS => "AMDGPU_CS",
        DRM_IOCTL_AMDGPU_WAIT_CS => "AMDGPU_WAIT_CS",
        DRM_IOCTL_GEM_CLOSE => "GEM_CLOSE",
        _ => "other",
    }
}
