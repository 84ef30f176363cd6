//! BO contents between the GPUs and the pages files, both ways: one pages file per GPU
//! (`amdgpu-pages-ID-GPU.img`), read or written through each GPU's SDMA engine
//! ([`super::sdma`]) and the copy pipeline ([`super::copy`]). A dump writes a file for every
//! GPU of the image, as CRIU's C plugin does (its restore opens each); one for a GPU without
//! BO contents is its size header of 0. A restore opens the files of the GPUs with contents
//! only, so that images without the empty files (this plugin's, before it wrote them) restore.
//!
//! Dump ([`Contents::save`]) and restore ([`Contents::load`]) set the pipeline up the same
//! way: the BOs imported into the engines, the staging plan, pieces interleaved over the
//! GPUs' files and the copy threads; they differ only in what each piece does with its file.

use std::collections::HashMap;
use std::os::fd::OwnedFd;

use super::copy::{self, CopyStats, Piece};
use super::device::KfdDevice;
use super::error::{Error, Result, device_error};
use super::image::{KfdCheckpoint, PagesLayout, PagesReader};
use super::sdma::SdmaEngines;
use super::settings::AmdgpuSettings;
use super::store::ImageStore;

/// The pages-file side of a copy, per piece.
enum Files<'a> {
    /// Dump: GPU to staging, then staging to the piece's file.
    Save(&'a (dyn Fn(&Piece, &[u8]) -> Result<()> + Sync)),
    /// Restore: the piece's file to staging, then staging to the GPU.
    Load(&'a (dyn Fn(&Piece, &mut [u8]) -> Result<()> + Sync)),
}

/// The layout of the pages file of each GPU of `gpus`: (user gpu id, layout), in device order.
fn kfd_pages(
    image: &KfdCheckpoint,
    gpus: impl Iterator<Item = u32>,
) -> Result<Vec<(u32, PagesLayout)>> {
    gpus.map(|gpu| {
        PagesLayout::for_kfd_gpu(image, gpu)
            .map(|layout| (gpu, layout))
            .map_err(|e| device_error(libc::EINVAL, format!("pages of GPU {gpu:#x}: {e}")))
    })
    .collect()
}

/// Opens the file of each GPU of `gpus` with `open`; returns the files and, per BO of
/// `image`, the index of the file holding it.
fn open_files<F>(
    image: &KfdCheckpoint,
    gpus: impl Iterator<Item = u32>,
    mut open: impl FnMut(u32, PagesLayout) -> Result<F>,
) -> Result<(Vec<F>, Vec<usize>)> {
    let mut files = Vec::new();
    let mut file_of = vec![usize::MAX; image.bos.len()];
    for (gpu, layout) in kfd_pages(image, gpus)? {
        for span in layout.spans() {
            file_of[span.bo] = files.len();
        }
        files.push(open(gpu, layout)?);
    }
    Ok((files, file_of))
}

/// Opens the pages file of each GPU with contents, checked against the BO list; returns
/// them and, per BO, the index of its file.
pub fn open_pages(
    images: &ImageStore,
    id: u32,
    image: &KfdCheckpoint,
) -> Result<(Vec<PagesReader>, Vec<usize>)> {
    open_files(image, image.content_gpus(), |gpu, layout| {
        Ok(images.dir()?.open_kfd_pages(id, gpu, layout)?)
    })
}

/// The BO contents of one KFD file: its image's VRAM/GTT BOs, behind their dma-bufs, and
/// the file's pages files.
pub struct Contents<'a> {
    /// The kernel.
    pub dev: &'a dyn KfdDevice,
    /// Settings (the staging plan).
    pub settings: &'a AmdgpuSettings,
    /// Where the pages files are.
    pub images: &'a ImageStore,
    /// CRIU file id of the KFD file.
    pub id: u32,
    /// Its image.
    pub image: &'a KfdCheckpoint,
    /// The render node each GPU's copies go through: user gpu id → render minor.
    pub minor_of: &'a HashMap<u32, u32>,
    /// The BOs' dma-bufs, one slot per BO of `image`.
    pub dmabufs: &'a [Option<OwnedFd>],
}

impl Contents<'_> {
    /// Dump: copies the BOs into one pages file per GPU, every GPU of the image.
    pub fn save(&self) -> Result<CopyStats> {
        let (writers, writer_of) = open_files(self.image, self.image.gpus(), |gpu, layout| {
            self.images.create_pages(self.id, gpu, layout)
        })?;
        let stats = self.transfer(
            writers.iter().map(|w| w.layout()),
            Files::Save(&|p, src| {
                writers[writer_of[p.bo]]
                    .write_chunk(p.bo, p.offset, src)
                    .map_err(|e| e.context(format!("saving {}", self.describe(p.bo))))
            }),
        )?;
        for w in writers {
            w.finish()?;
        }
        Ok(stats)
    }

    /// Restore: writes the BOs from their pages files (the render nodes are fresh ones of the
    /// restore GPUs).
    pub fn load(&self) -> Result<CopyStats> {
        let (readers, reader_of) = open_pages(self.images, self.id, self.image)?;
        self.transfer(
            readers.iter().map(|r| r.layout()),
            Files::Load(&|p, dst| {
                readers[reader_of[p.bo]]
                    .read_chunk(p.bo, p.offset, dst)
                    .map_err(|e| Error::from(e).context(format!("reading {}", self.describe(p.bo))))
            }),
        )
    }

    fn describe(&self, bo: usize) -> String {
        self.image.bos[bo].describe(bo)
    }

    /// Copies the BOs through the SDMA engines of their GPUs, in pieces taken from the files
    /// of `layouts` in turn, with `files` doing the file side.
    fn transfer<'l>(
        &self,
        layouts: impl Iterator<Item = &'l PagesLayout>,
        files: Files<'_>,
    ) -> Result<CopyStats> {
        // The SDMA engine's own render-node files, not the ones bound to the process's VMs.
        let mut engines = SdmaEngines::new(self.dev);
        let what = match files {
            Files::Save(_) => "",
            Files::Load(_) => "restored ",
        };
        let (buffers, largest) =
            engines.import_contents(&self.image.bos, self.dmabufs, self.minor_of, what)?;
        let (chunk, threads) = self.settings.staging_plan(largest);
        let streams: Vec<Vec<(usize, u64)>> = layouts
            .map(|l| l.spans().iter().map(|s| (s.bo, s.size)).collect())
            .collect();
        let pieces = copy::plan_interleaved(&streams, chunk);
        let buffer = |p: &Piece| buffers[p.bo].expect("pieces only of BOs with contents");
        // SAFETY: `run` hands each thread's own staging mapping, unmapped only after the
        // thread's lane is dropped, and never once the lane keeps it.
        let lane = |staging| Ok(unsafe { engines.lane(staging) });
        let stats = match files {
            Files::Save(save) => copy::run(
                &pieces,
                threads,
                chunk,
                lane,
                |lane, p, dst| {
                    lane.download(buffer(p), p.offset, dst)
                        .map_err(|e| e.context(format!("reading {}", self.describe(p.bo))))
                },
                |_, p, src| save(p, src),
            ),
            Files::Load(load) => copy::run(
                &pieces,
                threads,
                chunk,
                lane,
                |_, p, dst| load(p, dst),
                |lane, p, src| {
                    lane.upload(buffer(p), p.offset, src)
                        .map_err(|e| e.context(format!("writing {}", self.describe(p.bo))))
                },
            ),
        }?;
        engines
            .finish()
            .map_err(|e| e.context("after the BO copies"))?;
        Ok(stats)
    }
}
