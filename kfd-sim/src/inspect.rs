//! What tests look at: snapshots of simulated processes, their CPU mappings of device
//! files and the checks on them, BO contents, open fds and the render side's counters.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::{BoMem, FileObj, SIM_KFD_MAJOR, SdmaStats, SimEvent, SimKfd, SimQueue, einval, err};
use criu_gpu_core::amdgpu::device::{AllocFlags, DRM_MAJOR, KFD_MMAP_TYPE_EVENTS};

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

impl SimKfd {
    /// The process the KFD file `fd` is bound to (`None`: a file of no process yet, or not
    /// a KFD file of this machine).
    pub fn kfd_process(&self, fd: BorrowedFd<'_>) -> Option<u32> {
        let st = self.state();
        match self.file(&st, fd.as_raw_fd()).ok()? {
            (_, FileObj::Kfd { owner }) => owner,
            _ => None,
        }
    }

    /// Every (size, magic) RESTORE asked to recreate libhsakmt's shared memory with.
    pub fn hsakmt_restores(&self) -> Vec<(u64, u32)> {
        self.state().hsakmt_restored.clone()
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
            if AllocFlags::of(b.flags).intersects(AllocFlags::WITH_CONTENTS) {
                let minor = self.gpu(b.actual_gpu).map(|g| g.render_minor).unwrap_or(0);
                out.push(SimVma {
                    path: format!("/dev/dri/renderD{minor}"),
                    addr: b.addr,
                    pgoff: b.offset,
                });
            } else if AllocFlags::of(b.flags)
                .intersects(AllocFlags::DOORBELL | AllocFlags::MMIO_REMAP)
            {
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
        if AllocFlags::of(bo.flags).intersects(AllocFlags::WITH_CONTENTS) {
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
        let mine = self.content_bos(pid)?;
        let theirs: HashMap<u64, Arc<BoMem>> = other.content_bos(other_pid)?.into_iter().collect();
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

    /// (address, contents) of the VRAM/GTT BOs of process `pid`.
    fn content_bos(&self, pid: u32) -> io::Result<Vec<(u64, Arc<BoMem>)>> {
        let st = self.state();
        let p = st.processes.get(&pid).ok_or_else(|| err(libc::ESRCH))?;
        Ok(p.bos
            .iter()
            .filter_map(|b| b.mem.clone().map(|m| (b.addr, m)))
            .collect())
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

    /// What the simulated SDMA engines have done so far.
    pub fn sdma_stats(&self) -> SdmaStats {
        self.state().sdma
    }

    /// GEM objects open in simulated render files: the copy engine's (imported BOs, userptr
    /// registrations, command buffers) and those made with [`SimKfd::alloc_render_bo`].
    pub fn gem_objects(&self) -> usize {
        self.state().vms.values().map(|vm| vm.objects.len()).sum()
    }
}

fn chr_stat(rdev: u64) -> libc::stat {
    // SAFETY: `stat` is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_mode = libc::S_IFCHR | 0o666;
    st.st_rdev = rdev;
    st
}

/// The set of gpu ids of `sim` (helper for tests).
pub fn gpu_ids(sim: &SimKfd) -> HashSet<u32> {
    sim.gpus().iter().map(|g| g.gpu_id).collect()
}
