//! A simulated amdkfd: the kernel side of the CRIU interface, in host memory, so that the
//! backend's real dump and restore paths run in tests and benchmarks without an AMD GPU.
//!
//! Built only for tests and with the `kfd-sim` feature.
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
//! Permissions (ptrace parenthood, `CAP_CHECKPOINT_RESTORE`), pid namespaces beyond a
//! distinct in-namespace pid, mmap of files (CPU mappings are checked with
//! [`SimKfd::check_vma`] instead), SVM migration, XNACK semantics, GPU work other than SDMA copies,
//! render-node (DRM, non-KFD) BOs of the process, the cost and asynchrony of GPU copies (a
//! submission is executed before the ioctl returns, as CPU copies), userptr pinning limits,
//! and the real layout of KFD's private data.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kfd_sys::{
    KFD_CRIU_OP_CHECKPOINT, KFD_CRIU_OP_PROCESS_INFO, KFD_CRIU_OP_RESTORE, KFD_CRIU_OP_RESUME,
    KFD_CRIU_OP_UNPAUSE, KFD_INVALID_FD, kfd_criu_bo_bucket, kfd_criu_device_bucket,
    kfd_ioctl_criu_args,
};

use super::device::{
    AmdgpuRender, DRM_MAJOR, FileIdentity, GemCensus, HostMapping, KFD_MMAP_GPU_ID_SHIFT,
    KFD_MMAP_TYPE_DOORBELL, KFD_MMAP_TYPE_EVENTS, KFD_MMAP_TYPE_MMIO, KfdDevice, RenderInfo,
    VmFaultState, alloc_flags,
};
use super::topology::Topology;

/// KFD interface version the simulator reports.
pub const SIM_KFD_VERSION: (u32, u32) = (1, 14);
/// Version of the simulator's private data layout (the kernel's `KFD_CRIU_PRIV_VERSION`).
pub const SIM_PRIV_VERSION: u32 = 1;
/// Major number of the simulated `/dev/kfd`.
pub const SIM_KFD_MAJOR: u32 = 511;

const PRIV_MAGIC: u32 = 0x5346_444b; // "KDFS"
const OBJ_QUEUE: u32 = 0;
const OBJ_EVENT: u32 = 1;
const OBJ_SVM: u32 = 2;
const MAX_MAPPED_GPUS: usize = 8;
const MQD_BYTES: usize = 96;
const PAGE: u64 = 4096;

static INSTANCES: AtomicU64 = AtomicU64::new(1);

fn err(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

fn einval() -> io::Error {
    err(libc::EINVAL)
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

/// A one-shot or repeated injected failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The errno returned.
    pub errno: i32,
    /// How many more times it fires (`u32::MAX`: always).
    pub times: u32,
}

impl Fault {
    /// Fails every time with `errno`.
    pub fn always(errno: i32) -> Fault {
        Fault {
            errno,
            times: u32::MAX,
        }
    }

    /// Fails once with `errno`.
    pub fn once(errno: i32) -> Fault {
        Fault { errno, times: 1 }
    }
}

fn fire(slot: &mut Option<Fault>) -> io::Result<()> {
    if let Some(f) = slot {
        if f.times != u32::MAX {
            f.times -= 1;
        }
        let errno = f.errno;
        if f.times == 0 {
            *slot = None;
        }
        return Err(err(errno));
    }
    Ok(())
}

/// Failures to inject.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// PROCESS_INFO fails (queues stay running, as in the kernel).
    pub process_info: Option<Fault>,
    /// CHECKPOINT fails before doing anything.
    pub checkpoint: Option<Fault>,
    /// CHECKPOINT fails after exporting this many dma-bufs (it closes them, as the kernel).
    pub checkpoint_after_dmabufs: Option<(usize, i32)>,
    /// UNPAUSE fails (queues stay evicted).
    pub unpause: Option<Fault>,
    /// RESTORE fails before doing anything.
    pub restore: Option<Fault>,
    /// RESUME fails.
    pub resume: Option<Fault>,
    /// SDMA work that reads the BO at this (process) GPU address fails: its fence carries
    /// this errno (a device error, not a page fault).
    pub download_at: Option<(u64, i32)>,
    /// SDMA work that writes the BO at this (process) GPU address fails the same way.
    pub upload_at: Option<(u64, i32)>,
    /// The command submission ioctl fails.
    pub sdma_submit: Option<Fault>,
    /// Submitted SDMA work never completes (its fence wait times out).
    pub sdma_hang: bool,
    /// Registering user memory (userptr) fails.
    pub userptr: Option<Fault>,
    /// The kernel lacks `GEM_LIST_HANDLES` (before Linux 6.18).
    pub no_gem_list: bool,
    /// Opening this render minor fails with this errno.
    pub open_render: Option<(u32, i32)>,
}

/// BO contents: a memfd of the BO's size.
struct BoMem {
    file: File,
    size: u64,
    addr: u64,
}

impl BoMem {
    fn new(name: &str, size: u64, addr: u64) -> io::Result<BoMem> {
        let file = File::from(memfd(name)?);
        file.set_len(size)?;
        Ok(BoMem { file, size, addr })
    }
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

#[derive(Clone)]
enum FileObj {
    Kfd { owner: Option<u32> },
    Render { gpu_id: u32, bound_to: Option<u32> },
    DmaBuf { mem: Arc<BoMem>, gpu_id: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Pdd {
    user_gpu_id: u32,
    actual_gpu_id: u32,
    drm_file: Option<u64>,
}

#[derive(Clone)]
struct Bo {
    addr: u64,
    size: u64,
    flags: u32,
    actual_gpu: u32,
    user_gpu: u32,
    idr_handle: u32,
    offset: u64,
    user_addr: u64,
    mapped: Vec<u32>,
    mem: Option<Arc<BoMem>>,
}

/// A queue, as recorded in the private data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimQueue {
    /// Queue id.
    pub id: u32,
    /// User gpu id of its GPU.
    pub gpu_id: u32,
    /// 0 compute, 1 SDMA.
    pub kind: u32,
    /// Ring buffer address.
    pub ring_addr: u64,
    /// Ring size.
    pub ring_size: u32,
    /// Opaque queue state (MQD).
    pub mqd: Vec<u8>,
}

/// An event, as recorded in the private data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimEvent {
    /// Event id.
    pub id: u32,
    /// Event type.
    pub kind: u32,
    /// Auto-reset.
    pub auto_reset: bool,
    /// Signaled.
    pub signaled: bool,
}

#[derive(Clone)]
struct Process {
    pid: u32,
    ns_pid: u32,
    pdds: Vec<Pdd>,
    bos: Vec<Bo>,
    queues: Vec<SimQueue>,
    events: Vec<SimEvent>,
    svm: Vec<(u64, u64)>,
    xnack: bool,
    evicted: u32,
    awaiting_resume: bool,
    resumed: u32,
    restored: bool,
}

impl Process {
    fn num_objects(&self) -> u32 {
        (self.queues.len() + self.events.len() + self.svm.len()) as u32
    }

    fn priv_data(&self) -> Vec<u8> {
        let mut w = Vec::new();
        put32(&mut w, PRIV_MAGIC);
        put32(&mut w, SIM_PRIV_VERSION);
        put32(&mut w, u32::from(self.xnack));
        put32(&mut w, 0);
        for _ in &self.pdds {
            put64(&mut w, 0);
        }
        for bo in &self.bos {
            put64(&mut w, bo.user_addr);
            put32(&mut w, bo.idr_handle);
            put32(&mut w, bo.mapped.len() as u32);
            for i in 0..MAX_MAPPED_GPUS {
                put32(&mut w, bo.mapped.get(i).copied().unwrap_or(0));
            }
        }
        for q in &self.queues {
            put32(&mut w, OBJ_QUEUE);
            put32(&mut w, q.id);
            put32(&mut w, q.gpu_id);
            put32(&mut w, q.kind);
            put64(&mut w, q.ring_addr);
            put32(&mut w, q.ring_size);
            put32(&mut w, q.mqd.len() as u32);
            w.extend_from_slice(&q.mqd);
        }
        for e in &self.events {
            put32(&mut w, OBJ_EVENT);
            put32(&mut w, e.id);
            put32(&mut w, e.kind);
            put32(&mut w, u32::from(e.auto_reset));
            put32(&mut w, u32::from(e.signaled));
        }
        for (start, size) in &self.svm {
            put32(&mut w, OBJ_SVM);
            put32(&mut w, 0);
            put64(&mut w, *start);
            put64(&mut w, *size);
        }
        w
    }
}

fn put32(w: &mut Vec<u8>, v: u32) {
    w.extend_from_slice(&v.to_le_bytes());
}

fn put64(w: &mut Vec<u8>, v: u64) {
    w.extend_from_slice(&v.to_le_bytes());
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn bytes(&mut self, n: usize) -> io::Result<&[u8]> {
        let end = self.pos.checked_add(n).ok_or_else(einval)?;
        let s = self.data.get(self.pos..end).ok_or_else(einval)?;
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
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
                0 | 1 => alloc_flags::VRAM | alloc_flags::WRITABLE,
                2 => alloc_flags::GTT | alloc_flags::WRITABLE,
                _ => alloc_flags::USERPTR | alloc_flags::WRITABLE,
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

/// What a simulated process looks like (a snapshot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessView {
    /// Pid.
    pub pid: u32,
    /// Whether its queues are evicted.
    pub paused: bool,
    /// Eviction count (PROCESS_INFO calls minus UNPAUSEs).
    pub evictions: u32,
    /// Restored and waiting for RESUME.
    pub awaiting_resume: bool,
    /// RESUME calls that succeeded.
    pub resumed: u32,
    /// Created by RESTORE.
    pub restored: bool,
    /// (user gpu id, actual gpu id) per GPU.
    pub gpus: Vec<(u32, u32)>,
    /// BOs: (addr, size, flags, user gpu id, mmap offset).
    pub bos: Vec<(u64, u64, u32, u32, u64)>,
    /// Queues.
    pub queues: Vec<SimQueue>,
    /// Events.
    pub events: Vec<SimEvent>,
    /// SVM ranges.
    pub svm: Vec<(u64, u64)>,
    /// XNACK mode.
    pub xnack: bool,
}

/// A CPU mapping of a device file in a simulated process, as CRIU would record it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimVma {
    /// Path of the mapped file.
    pub path: String,
    /// Start address.
    pub addr: u64,
    /// File offset in bytes.
    pub pgoff: u64,
}

/// Splitmix64: the pattern generator.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Fills `mem` with the pattern of `seed`: a pseudo-random 64 KiB block, each 64 KiB block
/// of the BO stamped with its index, so misplaced pieces are detected.
fn fill_pattern(mem: &BoMem, seed: u64) -> io::Result<()> {
    const BLOCK: usize = 64 << 10;
    const WRITE: usize = 1 << 20;
    let mut base = vec![0u8; BLOCK];
    let mut x = mix(seed);
    for w in base.chunks_exact_mut(8) {
        x = mix(x);
        w.copy_from_slice(&x.to_le_bytes());
    }
    let mut buf = Vec::with_capacity(WRITE);
    while buf.len() < WRITE {
        buf.extend_from_slice(&base);
    }
    let mut off = 0u64;
    while off < mem.size {
        let len = (mem.size - off).min(WRITE as u64) as usize;
        for (j, block) in buf[..len].chunks_mut(BLOCK).enumerate() {
            let stamp = (off / BLOCK as u64 + j as u64) ^ seed.rotate_left(17);
            let n = block.len().min(8);
            block[..n].copy_from_slice(&stamp.to_le_bytes()[..n]);
        }
        mem.file.write_all_at(&buf[..len], off)?;
        off += len as u64;
    }
    Ok(())
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

    /// Sets the failures to inject.
    pub fn set_faults(&self, faults: Faults) {
        self.state().faults = faults;
    }

    /// Changes the failures to inject.
    pub fn update_faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.state().faults);
    }

    /// Sets the pid `open_kfd` and RESTORE act for (the "current task").
    pub fn set_current_task(&self, pid: u32) {
        self.inner.current_task.store(pid, Ordering::SeqCst);
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

    /// Every (size, magic) RESTORE asked to recreate libhsakmt's shared memory with.
    pub fn hsakmt_restores(&self) -> Vec<(u64, u32)> {
        self.state().hsakmt_restored.clone()
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

    /// Creates a process and returns its pid and its `/dev/kfd` fd (as CRIU's parasite
    /// would hand it to the dumper). BO contents get the pattern of `spec.seed`.
    pub fn spawn(&self, spec: &ProcessSpec) -> io::Result<OwnedFd> {
        let mut st = self.state();
        if st.processes.contains_key(&spec.pid) {
            return Err(err(libc::EEXIST));
        }
        let mut pdds = Vec::new();
        for &(user, actual) in &spec.gpus {
            self.gpu(actual).ok_or_else(einval)?;
            pdds.push(Pdd {
                user_gpu_id: user,
                actual_gpu_id: actual,
                drm_file: None,
            });
        }
        let mut bos = Vec::new();
        let mut addr = 0x7f00_0000_0000u64 + (u64::from(spec.pid) << 36);
        let mut idr = 1;
        let mut add = |st: &mut State, size: u64, flags: u32, pdd: &Pdd| -> io::Result<Bo> {
            let size = size.div_ceil(PAGE).max(1) * PAGE;
            let bo_addr = addr;
            addr += size.div_ceil(1 << 21) * (1 << 21) + (1 << 21);
            let offset = if flags & alloc_flags::DOORBELL != 0 {
                KFD_MMAP_TYPE_DOORBELL | (u64::from(pdd.actual_gpu_id) << KFD_MMAP_GPU_ID_SHIFT)
            } else if flags & alloc_flags::MMIO_REMAP != 0 {
                KFD_MMAP_TYPE_MMIO | (u64::from(pdd.actual_gpu_id) << KFD_MMAP_GPU_ID_SHIFT)
            } else {
                let o = st.next_offset;
                st.next_offset += size;
                o
            };
            let mem = if flags & alloc_flags::WITH_CONTENTS != 0 {
                let m = BoMem::new(
                    &format!("{}bo-{bo_addr:x}", self.inner.prefix),
                    size,
                    bo_addr,
                )?;
                fill_pattern(&m, spec.seed ^ bo_addr)?;
                Some(Arc::new(m))
            } else {
                None
            };
            let bo = Bo {
                addr: bo_addr,
                size,
                flags,
                actual_gpu: pdd.actual_gpu_id,
                user_gpu: pdd.user_gpu_id,
                idr_handle: idr,
                offset,
                user_addr: if flags & alloc_flags::USERPTR != 0 {
                    bo_addr
                } else {
                    0
                },
                mapped: vec![pdd.user_gpu_id],
                mem,
            };
            idr += 1;
            Ok(bo)
        };
        for pdd in &pdds {
            bos.push(add(
                &mut st,
                PAGE * 2,
                alloc_flags::DOORBELL | alloc_flags::WRITABLE,
                pdd,
            )?);
            bos.push(add(
                &mut st,
                PAGE,
                alloc_flags::MMIO_REMAP | alloc_flags::WRITABLE,
                pdd,
            )?);
        }
        for b in &spec.bos {
            let pdd = pdds.get(b.gpu).ok_or_else(einval)?.clone();
            bos.push(add(&mut st, b.size, b.flags, &pdd)?);
        }
        let mut queues = Vec::new();
        let mut qid = 0;
        for pdd in &pdds {
            for k in 0..spec.queues_per_gpu {
                let mut mqd = vec![0u8; MQD_BYTES];
                let mut x = mix(spec.seed ^ u64::from(qid));
                for w in mqd.chunks_exact_mut(8) {
                    x = mix(x);
                    w.copy_from_slice(&x.to_le_bytes());
                }
                queues.push(SimQueue {
                    id: qid,
                    gpu_id: pdd.user_gpu_id,
                    kind: k % 2,
                    ring_addr: 0x1000_0000 + u64::from(qid) * 0x10_0000,
                    ring_size: 64 << 10,
                    mqd,
                });
                qid += 1;
            }
        }
        let events = (0..spec.events)
            .map(|i| SimEvent {
                id: i,
                kind: i % 3,
                auto_reset: i % 2 == 0,
                signaled: i % 3 == 1,
            })
            .collect();
        let svm = (0..u64::from(spec.svm_ranges))
            .map(|i| (0x5000_0000_0000 + i * (1 << 30), 1 << 21))
            .collect();
        let p = Process {
            pid: spec.pid,
            ns_pid: spec.ns_pid,
            pdds,
            bos,
            queues,
            events,
            svm,
            xnack: spec.xnack,
            evicted: 0,
            awaiting_resume: false,
            resumed: 0,
            restored: false,
        };
        st.processes.insert(spec.pid, p);
        self.new_file(
            &mut st,
            FileObj::Kfd {
                owner: Some(spec.pid),
            },
        )
    }

    /// The process exports its BO at `addr` as a dma-buf (as ROCm's IPC does) and gets the fd.
    pub fn export_dmabuf(&self, pid: u32, addr: u64) -> io::Result<OwnedFd> {
        let mut st = self.state();
        let p = st.processes.get(&pid).ok_or_else(|| err(libc::ESRCH))?;
        let bo = p.bos.iter().find(|b| b.addr == addr).ok_or_else(einval)?;
        let mem = bo.mem.clone().ok_or_else(einval)?;
        let gpu_id = bo.actual_gpu;
        self.new_file(&mut st, FileObj::DmaBuf { mem, gpu_id })
    }

    /// Whether `fd` is a dma-buf of the BO at `addr` of process `pid`.
    pub fn dmabuf_is(&self, fd: BorrowedFd<'_>, pid: u32, addr: u64) -> bool {
        let st = self.state();
        let Ok((_, FileObj::DmaBuf { mem, .. })) = self.file(&st, fd.as_raw_fd()) else {
            return false;
        };
        st.processes.get(&pid).is_some_and(|p| {
            p.bos
                .iter()
                .any(|b| b.addr == addr && b.mem.as_ref().is_some_and(|m| Arc::ptr_eq(m, &mem)))
        })
    }

    /// A snapshot of process `pid`.
    pub fn process(&self, pid: u32) -> Option<ProcessView> {
        let st = self.state();
        let p = st.processes.get(&pid)?;
        Some(ProcessView {
            pid: p.pid,
            paused: p.evicted > 0,
            evictions: p.evicted,
            awaiting_resume: p.awaiting_resume,
            resumed: p.resumed,
            restored: p.restored,
            gpus: p
                .pdds
                .iter()
                .map(|d| (d.user_gpu_id, d.actual_gpu_id))
                .collect(),
            bos: p
                .bos
                .iter()
                .map(|b| (b.addr, b.size, b.flags, b.user_gpu, b.offset))
                .collect(),
            queues: p.queues.clone(),
            events: p.events.clone(),
            svm: p.svm.clone(),
            xnack: p.xnack,
        })
    }

    /// The CPU mappings of device files in process `pid`, as CRIU records them at dump: VRAM
    /// and GTT BOs through their GPU's render node, doorbell and MMIO pages and the events
    /// page through `/dev/kfd`.
    pub fn cpu_vmas(&self, pid: u32) -> Vec<SimVma> {
        let st = self.state();
        let Some(p) = st.processes.get(&pid) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for b in &p.bos {
            if b.flags & alloc_flags::WITH_CONTENTS != 0 {
                let minor = self.gpu(b.actual_gpu).map(|g| g.render_minor).unwrap_or(0);
                out.push(SimVma {
                    path: format!("/dev/dri/renderD{minor}"),
                    addr: b.addr,
                    pgoff: b.offset,
                });
            } else if b.flags & (alloc_flags::DOORBELL | alloc_flags::MMIO_REMAP) != 0 {
                out.push(SimVma {
                    path: "/dev/kfd".into(),
                    addr: b.addr,
                    pgoff: b.offset,
                });
            }
        }
        out.push(SimVma {
            path: "/dev/kfd".into(),
            addr: 0x6000_0000_0000,
            pgoff: KFD_MMAP_TYPE_EVENTS,
        });
        out
    }

    /// Checks that mapping `path` at file offset `pgoff` (through `fd` when given, as CRIU does
    /// with the fd `UPDATE_VMA_MAP` returns) at `addr` in process `pid` reaches the BO at
    /// `addr`: the offset is the BO's current one, and a render-node mapping goes through the
    /// render file the process's VM for that GPU is bound to.
    pub fn check_vma(
        &self,
        pid: u32,
        path: &str,
        addr: u64,
        pgoff: u64,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), String> {
        let st = self.state();
        let p = st
            .processes
            .get(&pid)
            .ok_or_else(|| format!("no process {pid}"))?;
        if pgoff == KFD_MMAP_TYPE_EVENTS {
            return if path == "/dev/kfd" {
                Ok(())
            } else {
                Err(format!("events page mapped through {path}"))
            };
        }
        let bo = p
            .bos
            .iter()
            .find(|b| b.addr == addr)
            .ok_or_else(|| format!("no BO at {addr:#x}"))?;
        if bo.offset != pgoff {
            return Err(format!(
                "mapping at {addr:#x} uses offset {pgoff:#x}, the BO's is {:#x}",
                bo.offset
            ));
        }
        if bo.flags & alloc_flags::WITH_CONTENTS != 0 {
            let fd = fd.ok_or_else(|| format!("render mapping at {addr:#x} without an fd"))?;
            let (n, obj) = self
                .file(&st, fd.as_raw_fd())
                .map_err(|e| format!("fd of mapping at {addr:#x}: {e}"))?;
            let FileObj::Render { gpu_id, .. } = obj else {
                return Err(format!("mapping at {addr:#x} is not through a render node"));
            };
            let pdd = p
                .pdds
                .iter()
                .find(|d| d.actual_gpu_id == bo.actual_gpu)
                .ok_or("BO on an unknown GPU")?;
            if gpu_id != bo.actual_gpu || pdd.drm_file != Some(n) {
                return Err(format!(
                    "mapping at {addr:#x} goes through a render file that is not the one the VM of GPU {:#x} is bound to",
                    bo.actual_gpu
                ));
            }
        } else if path != "/dev/kfd" {
            return Err(format!("doorbell/MMIO mapping at {addr:#x} through {path}"));
        }
        Ok(())
    }

    /// Compares the contents of every VRAM/GTT BO of process `pid` with the BO at the same
    /// address of process `other_pid` on `other`. Returns the addresses that differ.
    pub fn compare_contents(
        &self,
        pid: u32,
        other: &SimKfd,
        other_pid: u32,
    ) -> io::Result<Vec<u64>> {
        let mine: Vec<(u64, Arc<BoMem>)> = {
            let st = self.state();
            let p = st.processes.get(&pid).ok_or_else(|| err(libc::ESRCH))?;
            p.bos
                .iter()
                .filter_map(|b| b.mem.clone().map(|m| (b.addr, m)))
                .collect()
        };
        let theirs: HashMap<u64, Arc<BoMem>> = {
            let st = other.state();
            let p = st
                .processes
                .get(&other_pid)
                .ok_or_else(|| err(libc::ESRCH))?;
            p.bos
                .iter()
                .filter_map(|b| b.mem.clone().map(|m| (b.addr, m)))
                .collect()
        };
        let mut differ = Vec::new();
        let mut a = vec![0u8; 1 << 20];
        let mut b = vec![0u8; 1 << 20];
        for (addr, m) in mine {
            let Some(t) = theirs.get(&addr) else {
                differ.push(addr);
                continue;
            };
            if t.size != m.size {
                differ.push(addr);
                continue;
            }
            let mut off = 0;
            while off < m.size {
                let n = (m.size - off).min(a.len() as u64) as usize;
                m.file.read_exact_at(&mut a[..n], off)?;
                t.file.read_exact_at(&mut b[..n], off)?;
                if a[..n] != b[..n] {
                    differ.push(addr);
                    break;
                }
                off += n as u64;
            }
        }
        Ok(differ)
    }

    /// Overwrites BO contents of process `pid` at `addr` (tests of content checks).
    pub fn scribble(&self, pid: u32, addr: u64, offset: u64, data: &[u8]) -> io::Result<()> {
        let st = self.state();
        let p = st.processes.get(&pid).ok_or_else(|| err(libc::ESRCH))?;
        let bo = p.bos.iter().find(|b| b.addr == addr).ok_or_else(einval)?;
        let mem = bo.mem.as_ref().ok_or_else(einval)?;
        mem.file.write_all_at(data, offset)
    }

    /// Total bytes of VRAM/GTT contents of process `pid`.
    pub fn content_bytes(&self, pid: u32) -> u64 {
        let st = self.state();
        st.processes
            .get(&pid)
            .map(|p| {
                p.bos
                    .iter()
                    .filter(|b| b.mem.is_some())
                    .map(|b| b.size)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Open fds of this simulator in the calling process, by kind ("kfd", "render",
    /// "dmabuf").
    pub fn open_fds(&self, kind: &str) -> usize {
        let st = self.state();
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            return 0;
        };
        dir.filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<RawFd>().ok()))
            .filter_map(|fd| self.file_no(fd))
            .filter(|n| {
                matches!(
                    (st.files.get(n), kind),
                    (Some(FileObj::Kfd { .. }), "kfd")
                        | (Some(FileObj::Render { .. }), "render")
                        | (Some(FileObj::DmaBuf { .. }), "dmabuf")
                )
            })
            .count()
    }

    /// A `stat` of the simulated `/dev/kfd` (for `HANDLE_DEVICE_VMA`).
    pub fn kfd_stat(&self) -> libc::stat {
        chr_stat(libc::makedev(SIM_KFD_MAJOR, 0))
    }

    /// A `stat` of render node `minor`.
    pub fn render_stat(&self, minor: u32) -> libc::stat {
        chr_stat(libc::makedev(DRM_MAJOR, minor))
    }

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
        // SAFETY: per the criu_op contract, `devices` points to `num_devices` writable
        // buckets, `bos` to `num_bos` and `priv_data` to `priv_data_size` bytes, valid and not
        // aliased by anything else for the duration of the call.
        let (devices, bos, out) = unsafe {
            (
                std::slice::from_raw_parts_mut(
                    args.devices as *mut kfd_criu_device_bucket,
                    args.num_devices as usize,
                ),
                std::slice::from_raw_parts_mut(
                    args.bos as *mut kfd_criu_bo_bucket,
                    args.num_bos as usize,
                ),
                std::slice::from_raw_parts_mut(
                    args.priv_data as *mut u8,
                    args.priv_data_size as usize,
                ),
            )
        };
        let mut created: Vec<RawFd> = Vec::new();
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
                        if created.len() >= n {
                            return Err(err(errno));
                        }
                    }
                    let fd = self.new_file(
                        st,
                        FileObj::DmaBuf {
                            mem: mem.clone(),
                            gpu_id: bo.actual_gpu,
                        },
                    )?;
                    let raw = fd.into_raw_fd();
                    created.push(raw);
                    b.dmabuf_fd = raw as u32;
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            for fd in created {
                // SAFETY: these fds were created above and not yet handed to the caller.
                drop(unsafe { OwnedFd::from_raw_fd(fd) });
            }
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

    /// # Safety
    /// The pointers in `args` follow the [`KfdDevice::criu_op`] contract.
    unsafe fn op_restore(
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
        // SAFETY: per the criu_op contract, `devices` points to `num_devices` writable
        // buckets, `bos` to `num_bos` and `priv_data` to `priv_data_size` bytes, valid and not
        // aliased by anything else for the duration of the call.
        let (devices, bos, priv_data) = unsafe {
            (
                std::slice::from_raw_parts_mut(
                    args.devices as *mut kfd_criu_device_bucket,
                    args.num_devices as usize,
                ),
                std::slice::from_raw_parts_mut(
                    args.bos as *mut kfd_criu_bo_bucket,
                    args.num_bos as usize,
                ),
                std::slice::from_raw_parts(
                    args.priv_data as *const u8,
                    args.priv_data_size as usize,
                ),
            )
        };
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
            if b.alloc_flags & alloc_flags::VRAM != 0 {
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
            if b.alloc_flags & alloc_flags::WITH_CONTENTS != 0 && b.size > (1 << 40) {
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
        let mut created: Vec<RawFd> = Vec::new();
        let mut made = Vec::new();
        let result = (|| -> io::Result<()> {
            for ((pdd, addr, size, flags, idr_handle, user_addr, mapped), b) in
                new_bos.into_iter().zip(bos.iter_mut())
            {
                let offset = if flags & alloc_flags::DOORBELL != 0 {
                    KFD_MMAP_TYPE_DOORBELL | (u64::from(pdd.actual_gpu_id) << KFD_MMAP_GPU_ID_SHIFT)
                } else if flags & alloc_flags::MMIO_REMAP != 0 {
                    KFD_MMAP_TYPE_MMIO | (u64::from(pdd.actual_gpu_id) << KFD_MMAP_GPU_ID_SHIFT)
                } else if flags & alloc_flags::WITH_CONTENTS != 0 {
                    let o = st.next_offset;
                    st.next_offset += size;
                    o
                } else {
                    0
                };
                let mem = if flags & alloc_flags::WITH_CONTENTS != 0 {
                    let m = Arc::new(BoMem::new(
                        &format!("{}bo-{addr:x}", self.inner.prefix),
                        size,
                        addr,
                    )?);
                    let fd = self.new_file(
                        st,
                        FileObj::DmaBuf {
                            mem: m.clone(),
                            gpu_id: pdd.actual_gpu_id,
                        },
                    )?;
                    let raw = fd.into_raw_fd();
                    created.push(raw);
                    b.dmabuf_fd = raw as u32;
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
            for fd in created {
                // SAFETY: these fds were created above and not yet handed to the caller.
                drop(unsafe { OwnedFd::from_raw_fd(fd) });
            }
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

fn chr_stat(rdev: u64) -> libc::stat {
    // SAFETY: `stat` is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_mode = libc::S_IFCHR | 0o666;
    st.st_rdev = rdev;
    st
}

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

/// Memory behind a GEM handle of a simulated render-node file.
#[derive(Clone)]
enum GemMem {
    /// A KFD BO of this file's GPU, imported through its dma-buf.
    Bo(Arc<BoMem>),
    /// A BO of another GPU: not reachable by this GPU's SDMA engine here.
    Foreign,
    /// A GTT BO created in the file (command buffers).
    Local(Arc<BoMem>),
    /// User memory (userptr) of the calling process.
    User { addr: usize, size: u64 },
}

impl GemMem {
    fn size(&self) -> u64 {
        match self {
            GemMem::Bo(m) | GemMem::Local(m) => m.size,
            GemMem::Foreign => 0,
            GemMem::User { size, .. } => *size,
        }
    }
}

/// Outcome of a submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Job {
    Done,
    Failed(i32),
    Hung,
}

/// The GPU VM and submission state of one render-node file.
#[derive(Default)]
struct SimVm {
    objects: HashMap<u32, GemMem>,
    /// VA → (handle, size).
    maps: BTreeMap<u64, (u32, u64)>,
    contexts: HashMap<u32, u64>,
    next_ctx: u32,
    jobs: HashMap<(u32, u64), Job>,
    /// Last GPU page fault: (page address, status).
    fault: Option<(u64, u32)>,
}

/// Start and end of the VA range simulated render files offer.
const SIM_VA_START: u64 = 0x80_0000;
const SIM_VA_END: u64 = 1 << 47;

impl SimVm {
    /// The memory and offset behind `len` bytes at `va`, which must lie in one mapping of a
    /// BO in `allowed` (the submission's BO list); otherwise a GPU page fault.
    fn resolve(&self, va: u64, len: u64, allowed: &[u32]) -> Result<(GemMem, u64, u32), i32> {
        let (&start, &(handle, size)) = self.maps.range(..=va).next_back().ok_or(libc::EFAULT)?;
        let end = va.checked_add(len).ok_or(libc::EFAULT)?;
        if end > start + size {
            return Err(libc::EFAULT);
        }
        if !allowed.contains(&handle) {
            return Err(libc::EFAULT);
        }
        let mem = self.objects.get(&handle).ok_or(libc::EFAULT)?;
        Ok((mem.clone(), va - start, handle))
    }
}

/// One decoded copy.
struct CopyOp {
    src: (GemMem, u64),
    dst: (GemMem, u64),
    len: u64,
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

/// Runs one copy; the SDMA engine's view of memory is the BO's contents or user memory.
///
/// # Safety
///
/// User memory in `op` must be registered (its handle open in the VM), per the contract of
/// [`AmdgpuRender::gem_userptr`].
unsafe fn run_copy(op: &CopyOp) -> io::Result<()> {
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

impl SimKfd {
    /// Allocates a GTT BO of `size` bytes through render-node file `render` (not through
    /// KFD), as a process using render-node allocation does; returns its GEM handle.
    pub fn alloc_render_bo(&self, render: BorrowedFd<'_>, size: u64) -> io::Result<u32> {
        let mem = Arc::new(BoMem::new("kfdsim-render-bo", size, 0)?);
        self.add_object(&mut self.state(), render, GemMem::Local(mem))
    }

    /// A new GEM handle in render file `render` for `gem`.
    fn add_object(&self, st: &mut State, render: BorrowedFd<'_>, gem: GemMem) -> io::Result<u32> {
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

    /// What the simulated SDMA engines have done so far.
    pub fn sdma_stats(&self) -> SdmaStats {
        self.state().sdma
    }

    /// GEM objects open in simulated render files: the copy engine's (imported BOs, userptr
    /// registrations, command buffers) and those made with [`SimKfd::alloc_render_bo`].
    pub fn gem_objects(&self) -> usize {
        self.state().vms.values().map(|vm| vm.objects.len()).sum()
    }

    fn render_vm<'s>(
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

    fn new_handle(st: &mut State, rn: u64) -> u32 {
        let next = st.next_handle.entry(rn).or_insert(1);
        let h = *next;
        *next += 1;
        h
    }

    /// PRIME import: one handle per (file, BO); a BO of another GPU is an object of its own.
    fn prime_import(
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
                && size > obj.size().next_multiple_of(super::copy::page_size() as u64))
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
        let mut page_fault = None;
        let plan = decode_ib(&ib, family).and_then(|packets| {
            let mut ops = Vec::with_capacity(packets.len());
            for (src, dst, len) in packets {
                let (sm, so) = match vm.resolve(src, len, bos) {
                    Ok((m, o, _)) if !matches!(m, GemMem::Foreign) => (m, o),
                    _ => {
                        page_fault.get_or_insert(src);
                        continue;
                    }
                };
                let (dm, doff) = match vm.resolve(dst, len, bos) {
                    Ok((m, o, _)) if !matches!(m, GemMem::Foreign) => (m, o),
                    _ => {
                        page_fault.get_or_insert(dst);
                        continue;
                    }
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
}

/// The set of gpu ids of `sim` (helper for tests).
pub fn gpu_ids(sim: &SimKfd) -> HashSet<u32> {
    sim.gpus().iter().map(|g| g.gpu_id).collect()
}
