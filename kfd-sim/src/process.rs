//! The process model of the simulated amdkfd: per-GPU data, BOs with their contents in
//! memfds, queues, events and SVM ranges, the private data CHECKPOINT writes for them, and
//! the creation of a process from a [`ProcessSpec`].

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::{FileObj, PAGE, ProcessSpec, SIM_PRIV_VERSION, SimKfd, State, einval, err, memfd};
use criu_gpu_core::amdgpu::device::{
    AllocFlags, KFD_MMAP_GPU_ID_SHIFT, KFD_MMAP_TYPE_DOORBELL, KFD_MMAP_TYPE_MMIO,
};

pub(super) const PRIV_MAGIC: u32 = 0x5346_444b; // "KDFS"
pub(super) const OBJ_QUEUE: u32 = 0;
pub(super) const OBJ_EVENT: u32 = 1;
pub(super) const OBJ_SVM: u32 = 2;
pub(super) const MAX_MAPPED_GPUS: usize = 8;
const MQD_BYTES: usize = 96;

/// BO contents: a memfd of the BO's size.
pub(super) struct BoMem {
    pub(super) file: File,
    pub(super) size: u64,
    pub(super) addr: u64,
}

impl BoMem {
    pub(super) fn new(name: &str, size: u64, addr: u64) -> io::Result<BoMem> {
        let file = File::from(memfd(name)?);
        file.set_len(size)?;
        Ok(BoMem { file, size, addr })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Pdd {
    pub(super) user_gpu_id: u32,
    pub(super) actual_gpu_id: u32,
    pub(super) drm_file: Option<u64>,
}

#[derive(Clone)]
pub(super) struct Bo {
    pub(super) addr: u64,
    pub(super) size: u64,
    pub(super) flags: u32,
    pub(super) actual_gpu: u32,
    pub(super) user_gpu: u32,
    pub(super) idr_handle: u32,
    pub(super) offset: u64,
    pub(super) user_addr: u64,
    pub(super) mapped: Vec<u32>,
    pub(super) mem: Option<Arc<BoMem>>,
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
pub(super) struct Process {
    pub(super) pid: u32,
    pub(super) ns_pid: u32,
    pub(super) pdds: Vec<Pdd>,
    pub(super) bos: Vec<Bo>,
    pub(super) queues: Vec<SimQueue>,
    pub(super) events: Vec<SimEvent>,
    pub(super) svm: Vec<(u64, u64)>,
    pub(super) xnack: bool,
    pub(super) evicted: u32,
    pub(super) awaiting_resume: bool,
    pub(super) resumed: u32,
    pub(super) restored: bool,
}

impl Process {
    pub(super) fn num_objects(&self) -> u32 {
        (self.queues.len() + self.events.len() + self.svm.len()) as u32
    }

    pub(super) fn priv_data(&self) -> Vec<u8> {
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

pub(super) struct Reader<'a> {
    pub(super) data: &'a [u8],
    pub(super) pos: usize,
}

impl Reader<'_> {
    pub(super) fn bytes(&mut self, n: usize) -> io::Result<&[u8]> {
        let end = self.pos.checked_add(n).ok_or_else(einval)?;
        let s = self.data.get(self.pos..end).ok_or_else(einval)?;
        self.pos = end;
        Ok(s)
    }
    pub(super) fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    pub(super) fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
}

/// Splitmix64: the pattern generator.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Fills `buf` with the pseudo-random words that follow `seed`.
fn mix_fill(buf: &mut [u8], seed: u64) {
    let mut x = mix(seed);
    for w in buf.chunks_exact_mut(8) {
        x = mix(x);
        w.copy_from_slice(&x.to_le_bytes());
    }
}

/// Fills `mem` with the pattern of `seed`: a pseudo-random 64 KiB block, each 64 KiB block
/// of the BO stamped with its index, so misplaced pieces are detected.
fn fill_pattern(mem: &BoMem, seed: u64) -> io::Result<()> {
    const BLOCK: usize = 64 << 10;
    const WRITE: usize = 1 << 20;
    let mut base = vec![0u8; BLOCK];
    mix_fill(&mut base, seed);
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

/// The mmap offset of a doorbell or MMIO remap BO, which encodes the GPU it belongs to;
/// `None` for other BOs, whose offsets come from [`State::alloc_mmap_offset`].
pub(super) fn device_mmap_offset(flags: u32, actual_gpu_id: u32) -> Option<u64> {
    let gpu = u64::from(actual_gpu_id) << KFD_MMAP_GPU_ID_SHIFT;
    if AllocFlags::of(flags).intersects(AllocFlags::DOORBELL) {
        Some(KFD_MMAP_TYPE_DOORBELL | gpu)
    } else if AllocFlags::of(flags).intersects(AllocFlags::MMIO_REMAP) {
        Some(KFD_MMAP_TYPE_MMIO | gpu)
    } else {
        None
    }
}

impl State {
    /// A new mmap offset range of `size` bytes for a BO.
    pub(super) fn alloc_mmap_offset(&mut self, size: u64) -> u64 {
        let o = self.next_offset;
        self.next_offset += size;
        o
    }
}

impl SimKfd {
    /// Memory for the contents of a BO of `size` bytes at `addr`.
    pub(super) fn bo_mem(&self, addr: u64, size: u64) -> io::Result<BoMem> {
        BoMem::new(&format!("{}bo-{addr:x}", self.inner.prefix), size, addr)
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
            let offset = device_mmap_offset(flags, pdd.actual_gpu_id)
                .unwrap_or_else(|| st.alloc_mmap_offset(size));
            let mem = if AllocFlags::of(flags).intersects(AllocFlags::WITH_CONTENTS) {
                let m = self.bo_mem(bo_addr, size)?;
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
                user_addr: if AllocFlags::of(flags).intersects(AllocFlags::USERPTR) {
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
                (AllocFlags::DOORBELL | AllocFlags::WRITABLE).bits(),
                pdd,
            )?);
            bos.push(add(
                &mut st,
                PAGE,
                (AllocFlags::MMIO_REMAP | AllocFlags::WRITABLE).bits(),
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
                mix_fill(&mut mqd, spec.seed ^ u64::from(qid));
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
}
