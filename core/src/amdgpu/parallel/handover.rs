//! The hand-over policy: which task's copy goes to CRIU's main process, which dma-bufs are
//! published for other tasks, and the main process serving the queue.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use super::fdstore::FdStore;
use super::keys::KeyTable;
use super::queue::{QueueOutcome, Request, RestoreQueue};
use crate::amdgpu::contents;
use crate::amdgpu::copy::CopyStats;
use crate::amdgpu::device::KfdDevice;
use crate::amdgpu::error::{Error, Result, device_error};
use crate::amdgpu::settings::AmdgpuSettings;
use crate::amdgpu::store::ImageStore;

/// What restore processes pass each other, set up in CRIU's main process before it forks:
/// CRIU's fdstore and, over it, the parallel-restore queue and the table of published
/// dma-bufs.
pub struct Handover {
    store: Arc<dyn FdStore>,
    queue: Option<RestoreQueue>,
    keys: Option<KeyTable>,
}

impl Handover {
    /// The queue (when `parallel`) and the key table (when `dmabufs`) over `store`; what
    /// cannot be mapped is left out, with a warning.
    pub fn create(store: Arc<dyn FdStore>, parallel: bool, dmabufs: bool) -> Handover {
        let queue = if parallel {
            RestoreQueue::create()
                .map_err(|e| log::warn!("amdgpu: no parallel restore: {e}"))
                .ok()
        } else {
            None
        };
        let keys = if dmabufs {
            KeyTable::create()
                .map_err(|e| log::warn!("amdgpu: dma-bufs only within a task: {e}"))
                .ok()
        } else {
            None
        };
        Handover { store, queue, keys }
    }

    /// Whether tasks may hand their copies to CRIU's main process.
    pub fn parallel(&self) -> bool {
        self.queue.is_some()
    }

    /// Forgets every fd passed, at the end of the restore.
    pub fn clear(&self) {
        self.store.clear();
    }

    /// Hands the copy of KFD file `id` (its GPUs `minor_of`: user gpu id → restore minor,
    /// and the dma-bufs of its BOs) to CRIU's main process; false when that is not possible
    /// (the caller then copies itself).
    pub fn hand_over(
        &self,
        id: u32,
        minor_of: &HashMap<u32, u32>,
        dmabufs: &[Option<OwnedFd>],
    ) -> bool {
        let Some(q) = &self.queue else {
            return false;
        };
        let fds: Vec<&OwnedFd> = dmabufs.iter().flatten().collect();
        let Some(r) = q.reserve(fds.len()) else {
            log::info!("amdgpu: file {id}: parallel restore queue full; copying in the task");
            return false;
        };
        let mut ids = Vec::with_capacity(fds.len());
        for fd in fds {
            match self.store.add(fd.as_fd()) {
                Ok(n) => ids.push(n),
                Err(e) => {
                    log::warn!("amdgpu: file {id}: {e}; copying in the task");
                    q.abandon(r);
                    return false;
                }
            }
        }
        let mut gpus: Vec<(u32, u32)> = minor_of.iter().map(|(&u, &m)| (u, m)).collect();
        gpus.sort_unstable();
        match q.publish(r, id, &gpus, &ids) {
            Ok(()) => true,
            Err(e) => {
                log::warn!("amdgpu: file {id}: {e}; copying in the task");
                false
            }
        }
    }

    /// Publishes the dma-buf `fd` of the restored BO with cross-reference key `key` for
    /// every task; false when it could not be (no key table, or the table is full).
    pub fn publish(&self, key: u32, fd: BorrowedFd<'_>) -> Result<bool> {
        let Some(table) = &self.keys else {
            return Ok(false);
        };
        let id = self
            .store
            .add(fd)
            .map_err(|e| Error::io(&e, "cannot pass a dma-buf to CRIU's fdstore"))?;
        if !table.insert(key, id) {
            log::warn!("amdgpu: dma-buf key {key} published twice or table full");
            return Ok(false);
        }
        Ok(true)
    }

    /// A dma-buf of the BO with key `key` that another task published; `None` when none did
    /// (yet).
    pub fn find(&self, key: u32) -> Result<Option<OwnedFd>> {
        let Some(sid) = self.keys.as_ref().and_then(|t| t.get(key)) else {
            return Ok(None);
        };
        self.store
            .get(sid)
            .map(Some)
            .map_err(|e| Error::io(&e, "cannot take a dma-buf from CRIU's fdstore"))
    }

    /// Serves every request ready in the queue now, here (CRIU's main process).
    pub fn serve_ready(
        &self,
        dev: &dyn KfdDevice,
        settings: &AmdgpuSettings,
        images: &ImageStore,
    ) -> Vec<Served> {
        let mut out = Vec::new();
        let Some(queue) = &self.queue else {
            return out;
        };
        while let Some(req) = queue.take() {
            let result = self.serve(dev, settings, images, &req);
            queue.complete(
                req.slot,
                result.as_ref().err().map(|e| e.errno.get()).unwrap_or(0),
            );
            out.push(Served {
                file_id: req.file_id,
                result,
            });
        }
        out
    }

    /// How the queued requests ended; `None` without a parallel restore.
    pub fn outcome(&self) -> Option<QueueOutcome> {
        self.queue.as_ref().map(RestoreQueue::outcome)
    }

    /// Does the copy of one request.
    fn serve(
        &self,
        dev: &dyn KfdDevice,
        settings: &AmdgpuSettings,
        images: &ImageStore,
        req: &Request,
    ) -> Result<CopyStats> {
        let image = images.dir()?.read_kfd(req.file_id, &images.limits)?;
        let minor_of: HashMap<u32, u32> = req.gpus.iter().copied().collect();
        let content: Vec<usize> = image.content_bos().map(|(i, _)| i).collect();
        if content.len() != req.fds.len() {
            return Err(device_error(
                libc::EINVAL,
                format!(
                    "the request for file {} carries {} dma-bufs for {} BOs with contents",
                    req.file_id,
                    req.fds.len(),
                    content.len()
                ),
            ));
        }
        let mut dmabufs: Vec<Option<OwnedFd>> = (0..image.bos.len()).map(|_| None).collect();
        for (&i, &fid) in content.iter().zip(&req.fds) {
            dmabufs[i] = Some(
                self.store
                    .get(fid)
                    .map_err(|e| Error::io(&e, "cannot take a dma-buf from CRIU's fdstore"))?,
            );
        }
        contents::Contents {
            dev,
            settings,
            images,
            id: req.file_id,
            image: &image,
            minor_of: &minor_of,
            dmabufs: &dmabufs,
        }
        .load()
    }
}

/// The result of one parallel-restore request.
pub struct Served {
    /// KFD file id.
    pub file_id: u32,
    /// What the copy did, or why it failed.
    pub result: Result<CopyStats>,
}
