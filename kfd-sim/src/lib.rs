//! A simulated amdkfd: the kernel side of the CRIU interface, in host memory, so that the
//! backend's real dump and restore paths run in tests and benchmarks without an AMD GPU.
//!
//! A crate of its own, a dev-dependency of the tests and benchmarks only: the plugin never
//! links it.
//!
//! # What it models (the kernel's rules as amdkfd's CRIU ioctls apply them)
//!
//! * GPUs from a KFD topology (a sysfs tree such as `tests/fixtures/kfd-topology/2gpu`):
//!   gpu id, render minor, VRAM size.
//! * Processes with per-GPU data (user and actual gpu id, the render file their VM is bound
//!   to), BOs of every kind KFD has (VRAM, GTT, userptr, doorbell, MMIO remap) at GPU virtual
//!   addresses, with mmap offsets as KFD encodes them, and queues, events and SVM ranges
//!   that exist only as records in the private data.
//! * The CRIU operations with the kernel's order and size rules: PROCESS_INFO evicts the
//!   queues and reports counts and the private data size (`ENODEV` without GPUs);
//!   CHECKPOINT requires evicted queues and exactly the reported counts and size, fills the
//!   buckets, writes the private data, and installs one dma-buf fd per VRAM/GTT BO in the
//!   caller (closing them again when it fails); UNPAUSE requires evicted queues; RESTORE, on
//!   a fresh `/dev/kfd` file of the calling task, requires non-null arrays and non-zero
//!   counts, as many devices as the process has GPUs, render fds of the right GPUs not bound
//!   to another process, BOs on known GPUs within VRAM, a private data blob of the right
//!   version that is consumed exactly; it recreates the BOs at the same addresses with new
//!   mmap offsets (doorbell and MMIO offsets carry the new gpu id), exports their dma-bufs,
//!   and leaves the queues evicted until RESUME, which finds the process by pid (`ESRCH`).
//! * The calling task ([`SimKfd::set_current_task`]) and who traces whom
//!   ([`SimKfd::seize`], [`SimKfd::set_tracer`]): as amdkfd, a CRIU operation on a process's
//!   KFD file is taken only from the process itself or from its tracer (`EBADF`), and the
//!   holder of a KFD file is found only among the processes the caller traces.
//! * What a dump's guardian asks: the process behind a KFD file (its simulated pid, the fd
//!   number the test passed), and UNPAUSE of that process from outside (the UNPAUSE fault
//!   applies).
//! * BO contents live in memfds, filled with a deterministic pattern, so a restore can be
//!   verified byte for byte; dma-buf fds are memfds the simulator recognises by name. A
//!   process can export a BO as a dma-buf of its own ([`SimKfd::export_dmabuf`]); importing
//!   a dma-buf into a render file gives a GEM handle that is stable per file and BO, and a
//!   new one for another GPU's BO.
//! * GPUs hidden from processes (a container's device list, [`SimKfd::hide_gpu`]): sysfs
//!   still lists them, new KFD processes do not get them.
//! * The render-node side of the SDMA copy engine: per render file a GEM handle table
//!   (imported dma-bufs, userptr registrations of page-aligned user memory, GTT command
//!   buffers backed by memfds the caller maps), a GPU VM (page-aligned, non-overlapping
//!   mappings within a VA range), contexts, and submissions to the DMA ring that run the IB
//!   as the SDMA engine of the GPU's family reads it: `NOP`s with their dword count and
//!   `COPY_LINEAR` with the count − 1 from family AI on (the count itself before), every
//!   address resolved in the VM and required to lie in one mapping of a BO of the
//!   submission's list; anything else is a GPU page fault that, as on hardware, leaves that
//!   packet undone and the job completing, and is reported only by the VM's fault query
//!   (`AMDGPU_INFO_GPUVM_FAULT`). Copies are done for real between BO memfds and user
//!   memory. A BO of another GPU is not reachable. An illegal packet fails the job.
//! * Fault injection at every operation, at the SDMA copy of a chosen BO, at submission, at
//!   userptr registration, a submission that never completes, and at opening a render node.
//!
//! # What it does not model
//!
//! `CAP_CHECKPOINT_RESTORE`, the opener of a KFD file not yet bound to a process (it is the
//! caller's own), pid namespaces beyond a
//! distinct in-namespace pid, mmap of files (CPU mappings are checked with
//! [`SimKfd::check_vma`] instead), SVM migration, XNACK semantics, GPU work other than SDMA copies,
//! render-node (DRM, non-KFD) BOs of the process, the cost and asynchrony of GPU copies (a
//! submission is executed before the ioctl returns, as CPU copies), userptr pinning limits,
//! and the real layout of KFD's private data.
//!
//! # Layout
//!
//! This file holds the machine ([`SimKfd`], its shared state and the files it hands out) and
//! the specs tests build processes from; its submodules hold the rest: `process.rs` the
//! process model (BOs, queues, events, private data), `kfd.rs` the KFD ioctls with the CRIU
//! operations but RESTORE, `restore.rs` RESTORE, `render.rs` the render node (GEM handles,
//! VMs, submissions), `sdma.rs` the SDMA engine (IB decoding and copies), `faults.rs` fault
//! injection, `inspect.rs` what tests look at, `copies.rs` a log of the backend's BO copies,
//! and `conformance.rs` the list of KFD behaviours the plugin relies on with the simulator
//! test and the stand-in kernel module code that check each.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use criu_gpu_core::amdgpu::device::AllocFlags;
use criu_gpu_core::amdgpu::topology::Topology;

pub mod conformance;
mod copies;
mod faults;
mod inspect;
mod kfd;
mod process;
mod render;
mod restore;
mod sdma;
mod vm;

pub use copies::CopyLog;
pub use faults::{Fault, Faults};
pub use inspect::{ProcessView, SimVma, gpu_ids};
pub use process::{SimEvent, SimQueue};
pub use sdma::SdmaStats;

use process::{BoMem, Process};
use vm::SimVm;

/// KFD interface version the simulator reports.
pub const SIM_KFD_VERSION: (u32, u32) = (1, 14);
/// Version of the simulator's private data layout (the kernel's `KFD_CRIU_PRIV_VERSION`).
pub const SIM_PRIV_VERSION: u32 = 1;
/// Major number of the simulated `/dev/kfd`.
pub const SIM_KFD_MAJOR: u32 = 511;

const PAGE: u64 = 4096;

static INSTANCES: AtomicU64 = AtomicU64::new(1);

fn err(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

fn einval() -> io::Error {
    err(libc::EINVAL)
}

fn memfd(name: &str) -> io::Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| einval())?;
    // SAFETY: `c` is a valid NUL-terminated name; memfd_create returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A simulated GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimGpu {
    /// KFD gpu id (the actual id on this simulated machine).
    pub gpu_id: u32,
    /// Render-node minor.
    pub render_minor: u32,
    /// VRAM size in bytes.
    pub vram_size: u64,
    /// `AMDGPU_FAMILY_*` (the SDMA packet encoding depends on it).
    pub family: u32,
}

#[derive(Clone)]
enum FileObj {
    Kfd { owner: Option<u32> },
    Render { gpu_id: u32, bound_to: Option<u32> },
    DmaBuf { mem: Arc<BoMem>, gpu_id: u32 },
}

struct State {
    next_file: u64,
    files: HashMap<u64, FileObj>,
    processes: BTreeMap<u32, Process>,
    next_offset: u64,
    faults: Faults,
    hsakmt: Option<(u64, u32)>,
    hsakmt_restored: Vec<(u64, u32)>,
    hidden: HashSet<u32>,
    /// Tracee → tracer (ptrace), what amdkfd's caller rule for CRIU operations looks at.
    tracers: HashMap<u32, u32>,
    handles: HashMap<(u64, usize), u32>,
    next_handle: HashMap<u64, u32>,
    vms: HashMap<u64, SimVm>,
    sdma: SdmaStats,
}

struct Inner {
    prefix: String,
    gpus: Vec<SimGpu>,
    state: Mutex<State>,
    current_task: AtomicU32,
}

/// The simulated machine: GPUs, KFD processes and the files that refer to them.
#[derive(Clone)]
pub struct SimKfd {
    inner: Arc<Inner>,
}

/// A BO to create in a simulated process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoSpec {
    /// Index into [`ProcessSpec::gpus`].
    pub gpu: usize,
    /// Size in bytes (a page multiple).
    pub size: u64,
    /// `KFD_IOC_ALLOC_MEM_FLAGS_*` (VRAM, GTT or USERPTR; doorbell and MMIO pages are added
    /// for every GPU automatically).
    pub flags: u32,
}

/// A simulated process to create.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessSpec {
    /// Pid in the simulator's (the caller's) pid namespace.
    pub pid: u32,
    /// Pid in the process's own namespace (what PROCESS_INFO reports).
    pub ns_pid: u32,
    /// (user gpu id, actual gpu id) of each GPU the process uses.
    pub gpus: Vec<(u32, u32)>,
    /// The BOs.
    pub bos: Vec<BoSpec>,
    /// Queues per GPU.
    pub queues_per_gpu: u32,
    /// Events.
    pub events: u32,
    /// SVM ranges.
    pub svm_ranges: u32,
    /// XNACK mode.
    pub xnack: bool,
    /// Seed of the BO contents and queue states.
    pub seed: u64,
}

impl ProcessSpec {
    /// A process using the GPUs `gpus` (actual ids, which are also its user ids) with no BOs.
    pub fn new(pid: u32, gpus: &[u32]) -> ProcessSpec {
        ProcessSpec {
            pid,
            ns_pid: pid,
            gpus: gpus.iter().map(|&g| (g, g)).collect(),
            bos: Vec::new(),
            queues_per_gpu: 2,
            events: 3,
            svm_ranges: 1,
            xnack: false,
            seed: u64::from(pid),
        }
    }

    /// Adds `count` BOs spread over the GPUs, sizes cycling from 4 KiB up to `max_size` in
    /// powers of two, kinds cycling VRAM, VRAM, GTT, USERPTR.
    pub fn with_mixed_bos(mut self, count: usize, max_size: u64) -> ProcessSpec {
        let steps = (max_size / PAGE).max(1).ilog2() + 1;
        for i in 0..count {
            let size = PAGE << (i as u32 % steps);
            let flags = match i % 4 {
                0 | 1 => (AllocFlags::VRAM | AllocFlags::WRITABLE).bits(),
                2 => (AllocFlags::GTT | AllocFlags::WRITABLE).bits(),
                _ => (AllocFlags::USERPTR | AllocFlags::WRITABLE).bits(),
            };
            self.bos.push(BoSpec {
                gpu: i % self.gpus.len().max(1),
                size,
                flags,
            });
        }
        self
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn readlink_fd(fd: RawFd) -> Option<String> {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

impl SimKfd {
    /// A simulated machine with the GPUs of the KFD topology at `root` (a sysfs tree).
    pub fn from_sysfs(root: &Path) -> io::Result<SimKfd> {
        let topo = Topology::from_sysfs(root).map_err(|e| io::Error::other(e.to_string()))?;
        Ok(Self::from_topology(&topo))
    }

    /// A simulated machine with the GPUs of `topology` (Vega-class SDMA: family AI).
    pub fn from_topology(topology: &Topology) -> SimKfd {
        Self::from_topology_with_family(topology, kfd_sys::AMDGPU_FAMILY_AI)
    }

    /// A simulated machine with the GPUs of `topology`, all of GPU family `family`.
    pub fn from_topology_with_family(topology: &Topology, family: u32) -> SimKfd {
        let gpus = topology
            .gpus()
            .map(|g| SimGpu {
                gpu_id: g.gpu_id,
                render_minor: g.drm_render_minor,
                vram_size: g.vram_size,
                family,
            })
            .collect();
        Self::with_gpus(gpus)
    }

    /// A simulated machine with these GPUs.
    pub fn with_gpus(gpus: Vec<SimGpu>) -> SimKfd {
        let n = INSTANCES.fetch_add(1, Ordering::Relaxed);
        SimKfd {
            inner: Arc::new(Inner {
                prefix: format!("kfdsim{n}-"),
                gpus,
                state: Mutex::new(State {
                    next_file: 1,
                    files: HashMap::new(),
                    processes: BTreeMap::new(),
                    // Offsets differ between machines, so restores must remap them.
                    next_offset: 0x10_0000_0000 + (n << 32),
                    faults: Faults::default(),
                    hsakmt: None,
                    hsakmt_restored: Vec::new(),
                    hidden: HashSet::new(),
                    tracers: HashMap::new(),
                    handles: HashMap::new(),
                    next_handle: HashMap::new(),
                    vms: HashMap::new(),
                    sdma: SdmaStats::default(),
                }),
                current_task: AtomicU32::new(1),
            }),
        }
    }

    /// The simulated GPUs.
    pub fn gpus(&self) -> &[SimGpu] {
        &self.inner.gpus
    }

    fn gpu(&self, gpu_id: u32) -> Option<&SimGpu> {
        self.inner.gpus.iter().find(|g| g.gpu_id == gpu_id)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.inner.state)
    }

    /// Sets the calling task: the pid of the task every later call comes from (the process
    /// RESTORE makes, the caller amdkfd's rule for CRIU operations checks).
    pub fn set_current_task(&self, pid: u32) {
        self.inner.current_task.store(pid, Ordering::SeqCst);
    }

    /// The current task seizes `pid` (`PTRACE_SEIZE`), as CRIU seizes each task it dumps:
    /// from then on it may issue CRIU operations on `pid`'s KFD file.
    pub fn seize(&self, pid: u32) {
        let me = self.inner.current_task.load(Ordering::SeqCst);
        self.set_tracer(pid, Some(me));
    }

    /// Sets the tracer of `pid`, or clears it (`None`: detached, or the tracer ended).
    pub fn set_tracer(&self, pid: u32, tracer: Option<u32>) {
        let mut st = self.state();
        match tracer {
            Some(t) => st.tracers.insert(pid, t),
            None => st.tracers.remove(&pid),
        };
    }

    /// amdkfd's caller rule: a CRIU operation on the KFD file of process `pid` comes from
    /// that process or from its tracer (`EBADF`, "Using KFD FD in wrong process", otherwise).
    fn may_criu(&self, st: &State, pid: u32) -> bool {
        let me = self.inner.current_task.load(Ordering::SeqCst);
        me == pid || st.tracers.get(&pid) == Some(&me)
    }

    /// Hides a GPU from the processes of this machine, as a container's device list or
    /// device cgroup does: its render node is absent and new KFD processes do not get it
    /// (sysfs still lists it).
    pub fn hide_gpu(&self, gpu_id: u32) {
        self.state().hidden.insert(gpu_id);
    }

    /// Makes libhsakmt's shared memory file exist with this size and magic.
    pub fn set_hsakmt_shared_mem(&self, v: Option<(u64, u32)>) {
        self.state().hsakmt = v;
    }

    fn new_file(&self, st: &mut State, obj: FileObj) -> io::Result<OwnedFd> {
        let n = st.next_file;
        st.next_file += 1;
        let fd = memfd(&format!("{}{n}", self.inner.prefix))?;
        st.files.insert(n, obj);
        Ok(fd)
    }

    fn file_no(&self, fd: RawFd) -> Option<u64> {
        let link = readlink_fd(fd)?;
        let rest = link
            .strip_prefix("/memfd:")?
            .strip_prefix(&self.inner.prefix)?;
        rest.split(' ').next()?.parse().ok()
    }

    fn file(&self, st: &State, fd: RawFd) -> io::Result<(u64, FileObj)> {
        let n = self.file_no(fd).ok_or_else(|| err(libc::EBADF))?;
        let obj = st.files.get(&n).cloned().ok_or_else(|| err(libc::EBADF))?;
        Ok((n, obj))
    }
}
