//! [`ImageDir`]: the plugin's image files in CRIU's images directory, opened relative to
//! its directory fd, read and written with the framing of the parent module.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

use criu_plugin::files;

use super::error::not_regular_or;
use super::{
    DmabufImage, HEADER_LEN, ImageError, ImageMessage, KfdCheckpoint, PagesLayout, PagesReader,
    PagesWriter, ReadLimits, RenderNodeImage, check_file_name, check_header, decode_payload,
    dmabuf_file_name, drm_pages_file_name, encode_framed, io_error, kfd_file_name,
    kfd_pages_file_name, render_node_file_name,
};

/// Layout of a DRM pages file: one BO.
fn single_bo_layout(file: &str, bo_index: u32, size: u64) -> Result<PagesLayout, ImageError> {
    PagesLayout::from_sizes([(bo_index as usize, size)]).map_err(|error| ImageError::Format {
        file: file.to_owned(),
        error,
    })
}

/// Opens a directory to use as an [`ImageDir`] (`O_RDONLY | O_DIRECTORY`).
pub fn open_image_dir(path: &Path) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    use nix::fcntl::OFlag;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    Ok(nix::fcntl::open(
        c_path.as_c_str(),
        flags,
        nix::sys::stat::Mode::empty(),
    )?)
}

/// The images directory, as the fd CRIU gives plugins
/// (`criu_get_image_dir()`) or one from [`open_image_dir`]. All file access
/// is relative to it.
#[derive(Debug, Clone, Copy)]
pub struct ImageDir<'fd> {
    fd: BorrowedFd<'fd>,
}

impl<'fd> ImageDir<'fd> {
    /// Wraps a directory fd.
    pub fn new(fd: BorrowedFd<'fd>) -> Self {
        Self { fd }
    }

    /// Creates (or truncates) an image file for writing, mode 0600, refusing a
    /// link or anything but a regular file.
    pub(crate) fn create(&self, name: &str) -> Result<File, ImageError> {
        check_file_name(name)?;
        files::create_regular(self.fd, Path::new(name))
            .map_err(|e| not_regular_or(name, "create", e))
    }

    /// Opens an existing image file for reading, through the plugin crate's
    /// hardened open: `O_NONBLOCK` keeps a FIFO planted under the name from
    /// blocking the open (it has no effect on regular files), `O_NOFOLLOW`
    /// refuses a link, and only a regular file is accepted.
    pub(crate) fn open_read(&self, name: &str) -> Result<File, ImageError> {
        check_file_name(name)?;
        files::open_regular(Some(self.fd), Path::new(name), true)
            .map_err(|e| not_regular_or(name, "open", e))
    }

    /// Reads the one message held in file `name`.
    pub fn read_message<T: ImageMessage>(
        &self,
        name: &str,
        limits: &ReadLimits,
    ) -> Result<T, ImageError> {
        let file = self.open_read(name)?;
        let file_len = file
            .metadata()
            .map_err(|e| io_error(name, "inspect", e))?
            .len();
        let mut header = [0u8; HEADER_LEN];
        let header_present = if file_len >= HEADER_LEN as u64 {
            file.read_exact_at(&mut header, 0)
                .map_err(|e| io_error(name, "read", e))?;
            Some(&header[..])
        } else {
            None
        };
        let declared = check_header(name, header_present, file_len, limits)?;
        // Bounded by the limit (a usize) and by the file length.
        let mut payload = vec![0u8; declared as usize];
        file.read_exact_at(&mut payload, HEADER_LEN as u64)
            .map_err(|e| io_error(name, "read", e))?;
        decode_payload(&payload, name)
    }

    /// Writes `msg` as the one message of file `name` (created or truncated).
    pub fn write_message<T: ImageMessage>(&self, name: &str, msg: &T) -> Result<(), ImageError> {
        check_file_name(name)?;
        self.write_framed(name, &encode_framed(msg, name)?)
    }

    /// Writes `bytes` (a message with its size header, from [`encode_framed`]) as file
    /// `name` (created or truncated).
    pub fn write_framed(&self, name: &str, bytes: &[u8]) -> Result<(), ImageError> {
        let file = self.create(name)?;
        file.write_all_at(bytes, 0)
            .map_err(|e| io_error(name, "write", e))
    }

    /// Reads `amdgpu-kfd-ID.img`.
    pub fn read_kfd(&self, id: u32, limits: &ReadLimits) -> Result<KfdCheckpoint, ImageError> {
        self.read_message(&kfd_file_name(id), limits)
    }

    /// Writes `amdgpu-kfd-ID.img`.
    pub fn write_kfd(&self, id: u32, image: &KfdCheckpoint) -> Result<(), ImageError> {
        self.write_message(&kfd_file_name(id), image)
    }

    /// Reads `amdgpu-renderD-ID.img`.
    pub fn read_render_node(
        &self,
        id: u32,
        limits: &ReadLimits,
    ) -> Result<RenderNodeImage, ImageError> {
        self.read_message(&render_node_file_name(id), limits)
    }

    /// Writes `amdgpu-renderD-ID.img`.
    pub fn write_render_node(&self, id: u32, image: &RenderNodeImage) -> Result<(), ImageError> {
        self.write_message(&render_node_file_name(id), image)
    }

    /// Reads `amdgpu-dmabuf_ID.img`.
    pub fn read_dmabuf(&self, id: u32, limits: &ReadLimits) -> Result<DmabufImage, ImageError> {
        self.read_message(&dmabuf_file_name(id), limits)
    }

    /// Writes `amdgpu-dmabuf_ID.img`.
    pub fn write_dmabuf(&self, id: u32, image: &DmabufImage) -> Result<(), ImageError> {
        self.write_message(&dmabuf_file_name(id), image)
    }

    /// Creates `amdgpu-pages-ID-GPU.img` for the BOs in `layout` (see
    /// [`PagesLayout::for_kfd_gpu`]).
    pub fn create_kfd_pages(
        &self,
        id: u32,
        gpu_id: u32,
        layout: PagesLayout,
    ) -> Result<PagesWriter, ImageError> {
        PagesWriter::create(self, kfd_pages_file_name(id, gpu_id), layout)
    }

    /// Opens `amdgpu-pages-ID-GPU.img`; its header must equal the layout's
    /// total size and the file must hold every BO in full.
    pub fn open_kfd_pages(
        &self,
        id: u32,
        gpu_id: u32,
        layout: PagesLayout,
    ) -> Result<PagesReader, ImageError> {
        PagesReader::open(self, kfd_pages_file_name(id, gpu_id), layout, true)
    }

    /// Creates `amdgpu-drm-pages-ID-MINOR-IDX.img` for one BO of `size` bytes.
    pub fn create_drm_pages(
        &self,
        id: u32,
        render_minor: u32,
        bo_index: u32,
        size: u64,
    ) -> Result<PagesWriter, ImageError> {
        let name = drm_pages_file_name(id, render_minor, bo_index);
        let layout = single_bo_layout(&name, bo_index, size)?;
        PagesWriter::create(self, name, layout)
    }

    /// Opens `amdgpu-drm-pages-ID-MINOR-IDX.img` for one BO of `size` bytes.
    /// The header is not checked: the C plugin writes garbage there.
    pub fn open_drm_pages(
        &self,
        id: u32,
        render_minor: u32,
        bo_index: u32,
        size: u64,
    ) -> Result<PagesReader, ImageError> {
        let name = drm_pages_file_name(id, render_minor, bo_index);
        let layout = single_bo_layout(&name, bo_index, size)?;
        PagesReader::open(self, name, layout, false)
    }
}
