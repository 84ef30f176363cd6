//! A copy thread's lane: its submission context, command buffer and registered staging
//! memory on each GPU it touches, the submission of one piece and its fence wait.

use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use super::{BufferId, GpuEngine, SdmaEngines, pad, page, push_copy, round_up};
use crate::amdgpu::copy::StagingRegion;
use crate::amdgpu::device::{Bytes, HostMapping, KfdDevice};
use crate::amdgpu::error::{Error, Result, device_error};

/// What a lane holds on one GPU: context, command buffer and staging registration.
pub(super) struct LaneGpu {
    ctx: u32,
    ib_handle: u32,
    ib_va: u64,
    ib_size: u64,
    ib: HostMapping,
    staging_handle: u32,
    staging_va: u64,
    staging_size: u64,
}

/// One copy thread's access to the engines: see the module documentation.
pub struct Lane<'e, 'd> {
    pub(super) engines: &'e SdmaEngines<'d>,
    pub(super) staging: StagingRegion,
    pub(super) gpus: Vec<Option<LaneGpu>>,
    pub(super) ib: Vec<u32>,
}

enum Direction {
    ToHost,
    ToGpu,
}

impl Lane<'_, '_> {
    /// The staging memory the lane copies through.
    pub fn staging(&self) -> &StagingRegion {
        &self.staging
    }

    /// Copies `dst.len()` bytes at `offset` of BO `bo` into `dst`, which lies in this lane's
    /// staging memory.
    pub fn download(&mut self, bo: BufferId, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.copy(
            bo,
            offset,
            dst.as_mut_ptr() as usize,
            dst.len(),
            Direction::ToHost,
        )
    }

    /// Copies `src`, which lies in this lane's staging memory, to `offset` of BO `bo`.
    pub fn upload(&mut self, bo: BufferId, offset: u64, src: &[u8]) -> Result<()> {
        self.copy(
            bo,
            offset,
            src.as_ptr() as usize,
            src.len(),
            Direction::ToGpu,
        )
    }

    fn gpu(&mut self, gpu: usize) -> Result<&mut LaneGpu> {
        if self.gpus[gpu].is_none() {
            let lg = self.setup(gpu)?;
            self.gpus[gpu] = Some(lg);
        }
        Ok(self.gpus[gpu].as_mut().expect("set above"))
    }

    fn setup(&self, gpu: usize) -> Result<LaneGpu> {
        let dev = self.engines.dev;
        let g = &self.engines.gpus[gpu];
        let r = g.render.as_fd();
        let fail = |what: &str, e: std::io::Error| {
            Error::io(&e, format!("SDMA on renderD{}: cannot {what}", g.minor))
        };
        let ib_size = round_up(
            g.format.ib_dwords(self.staging.len() as u64) as u64 * 4,
            page(),
        )
        .ok_or_else(|| device_error(libc::EINVAL, "staging buffer too large"))?;
        let ctx = dev.ctx_create(r).map_err(|e| fail("create a context", e))?;
        let mut lg = PartialLane {
            dev,
            render: r,
            ctx: Some(ctx),
            bos: Vec::new(),
        };
        let (ib_handle, ib) = dev
            .gem_create_mapped(r, ib_size)
            .map_err(|e| fail("allocate a command buffer", e))?;
        lg.bos.push((ib_handle, None));
        let ib_va = g.alloc_va(ib_size)?;
        dev.gem_va(r, ib_handle, ib_va, ib_size, true)
            .map_err(|e| fail("map the command buffer", e))?;
        lg.bos.last_mut().expect("pushed").1 = Some((ib_va, ib_size));
        let staging_size = self.staging.len() as u64;
        // SAFETY: the staging region is page-aligned anonymous memory that stays mapped while
        // this lane (which closes the handle when dropped) lives: the contract of `lane`.
        let staging_handle = unsafe { dev.gem_userptr(r, self.staging.base(), staging_size) }
            .map_err(|e| {
                fail(
                    &format!("register {} of staging memory", Bytes(staging_size)),
                    e,
                )
            })?;
        lg.bos.push((staging_handle, None));
        let staging_va = g.alloc_va(staging_size)?;
        dev.gem_va(r, staging_handle, staging_va, staging_size, true)
            .map_err(|e| fail("map the staging memory", e))?;
        lg.bos.last_mut().expect("pushed").1 = Some((staging_va, staging_size));
        lg.disarm();
        Ok(LaneGpu {
            ctx,
            ib_handle,
            ib_va,
            ib_size,
            ib,
            staging_handle,
            staging_va,
            staging_size,
        })
    }

    fn copy(
        &mut self,
        bo: BufferId,
        offset: u64,
        host: usize,
        len: usize,
        dir: Direction,
    ) -> Result<()> {
        let engines = self.engines;
        let b = engines
            .bos
            .get(bo.0)
            .ok_or_else(|| device_error(libc::EINVAL, "unknown BO"))?;
        let len64 = len as u64;
        if offset.checked_add(len64).is_none_or(|end| end > b.size) {
            return Err(device_error(
                libc::EINVAL,
                format!(
                    "copy of {len} bytes at {offset:#x} exceeds the BO ({} bytes)",
                    b.size
                ),
            ));
        }
        let base = self.staging.base() as usize;
        let within = host
            .checked_sub(base)
            .filter(|&o| o.checked_add(len).is_some_and(|e| e <= self.staging.len()));
        let Some(host_offset) = within else {
            return Err(device_error(
                libc::EINVAL,
                "host memory of an SDMA copy is outside the lane's staging buffer",
            ));
        };
        if len == 0 {
            return Ok(());
        }
        let g = &engines.gpus[b.gpu];
        let timeout = engines.timeout;
        let mut ib = std::mem::take(&mut self.ib);
        let lg = self.gpu(b.gpu)?;
        let host_va = lg.staging_va + host_offset as u64;
        let bo_va = b.va + offset;
        let (src, dst) = match dir {
            Direction::ToHost => (bo_va, host_va),
            Direction::ToGpu => (host_va, bo_va),
        };
        ib.clear();
        push_copy(&mut ib, g.format, src, dst, len64);
        pad(&mut ib);
        let outcome = submit(engines.dev, g, lg, &ib, b.handle, timeout);
        self.ib = ib;
        match outcome {
            Submission::Done => Ok(()),
            Submission::Failed(e) => Err(e),
            Submission::Unfinished(e) => {
                // The copy may still be writing the staging memory after this lane closes its
                // registration: that memory must never be reused.
                self.staging.keep_after_use();
                Err(e)
            }
        }
    }
}

/// How a submission ended.
enum Submission {
    /// Completed, no page fault seen.
    Done,
    /// Failed before the GPU got it, or completed with an error or a page fault.
    Failed(Error),
    /// Submitted, but its completion was not seen (timeout, failed wait): the GPU may still
    /// be copying.
    Unfinished(Error),
}

fn submit(
    dev: &dyn KfdDevice,
    g: &GpuEngine,
    lg: &mut LaneGpu,
    ib: &[u32],
    bo: u32,
    timeout: Duration,
) -> Submission {
    let r = g.render.as_fd();
    let bytes = ib.len() * 4;
    if bytes as u64 > lg.ib_size {
        return Submission::Failed(device_error(
            libc::EOVERFLOW,
            format!(
                "SDMA command buffer of {bytes} bytes exceeds its {} bytes",
                lg.ib_size
            ),
        ));
    }
    if let Err(e) = lg.ib.write_dwords(ib) {
        return Submission::Failed(Error::io(&e, "writing the SDMA command buffer"));
    }
    let seq = match dev.submit_dma(
        r,
        lg.ctx,
        &[bo, lg.staging_handle, lg.ib_handle],
        lg.ib_va,
        bytes as u32,
    ) {
        Ok(seq) => seq,
        Err(e) => {
            return Submission::Failed(Error::io(
                &e,
                format!("SDMA submission on renderD{} failed", g.minor),
            ));
        }
    };
    match dev.wait_dma(r, lg.ctx, seq, timeout) {
        Ok(true) => match g.check_faults(dev) {
            Ok(()) => Submission::Done,
            Err(e) => Submission::Failed(e),
        },
        Ok(false) => Submission::Unfinished(device_error(
            libc::ETIMEDOUT,
            format!(
                "SDMA copy on renderD{} did not complete within {} s",
                g.minor,
                timeout.as_secs()
            ),
        )),
        // A job that ended with an error (a reset) and a wait that itself failed look the
        // same here: assume the worst.
        Err(e) => Submission::Unfinished(Error::io(
            &e,
            format!("SDMA copy on renderD{} failed", g.minor),
        )),
    }
}

/// Undoes a lane's half-made set-up on a GPU when a step fails.
struct PartialLane<'a> {
    dev: &'a dyn KfdDevice,
    render: BorrowedFd<'a>,
    ctx: Option<u32>,
    bos: Vec<(u32, Option<(u64, u64)>)>,
}

impl PartialLane<'_> {
    fn disarm(mut self) {
        self.ctx = None;
        self.bos.clear();
    }
}

impl Drop for PartialLane<'_> {
    fn drop(&mut self) {
        release(self.dev, self.render, self.ctx.take(), &self.bos);
    }
}

pub(super) fn release(
    dev: &dyn KfdDevice,
    render: BorrowedFd<'_>,
    ctx: Option<u32>,
    bos: &[(u32, Option<(u64, u64)>)],
) {
    if let Some(ctx) = ctx {
        if let Err(e) = dev.ctx_free(render, ctx) {
            log::debug!("amdgpu: freeing SDMA context {ctx}: {e}");
        }
    }
    for &(handle, mapping) in bos.iter().rev() {
        if let Some((va, size)) = mapping {
            if let Err(e) = dev.gem_va(render, handle, va, size, false) {
                log::debug!("amdgpu: unmapping {va:#x}: {e}");
            }
        }
        if let Err(e) = dev.gem_close(render, handle) {
            log::debug!("amdgpu: closing GEM handle {handle}: {e}");
        }
    }
}

impl Drop for Lane<'_, '_> {
    fn drop(&mut self) {
        for (gpu, lg) in self.gpus.iter_mut().enumerate() {
            let Some(lg) = lg.take() else { continue };
            let g = &self.engines.gpus[gpu];
            // The context goes first: no work of this lane is queued once it is freed.
            let bos = [
                (lg.ib_handle, Some((lg.ib_va, lg.ib_size))),
                (lg.staging_handle, Some((lg.staging_va, lg.staging_size))),
            ];
            release(self.engines.dev, g.render.as_fd(), Some(lg.ctx), &bos);
            drop(lg.ib);
        }
    }
}
