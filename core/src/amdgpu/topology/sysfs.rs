//! Reading the KFD topology from sysfs (`nodes/N/{gpu_id,properties}`,
//! `mem_banks`, `io_links`) with bounded reads, and the render-node helpers.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::properties::{PROPERTIES, PropertySetter};
use super::{
    CpuNode, GpuNode, IoLink, IoLinkType, MAX_DIR_ENTRIES, MAX_PROPERTY_NAME_LEN,
    MAX_SYSFS_FILE_BYTES, RENDER_MINOR_FIRST, RENDER_MINOR_LAST, Topology, TopologyError,
    TopologyNode,
};

const HEAP_TYPE_FB_PUBLIC: u32 = 1;
const HEAP_TYPE_FB_PRIVATE: u32 = 2;
const GPU_ID_FILE_LIMIT: usize = 64;

impl Topology {
    /// Parses the KFD topology under `root` (normally
    /// [`DEFAULT_SYSFS_ROOT`](super::DEFAULT_SYSFS_ROOT)).
    ///
    /// Nodes whose directory or `gpu_id` cannot be read are skipped, as
    /// upstream does for GPUs masked by the device cgroup. Any other problem
    /// (an unreadable `properties` file, a malformed line, an oversized file,
    /// a GPU without VRAM) is an error.
    pub fn from_sysfs(root: &Path) -> Result<Self, TopologyError> {
        let nodes_dir = root.join("nodes");
        let mut nodes = Vec::new();
        for (node_id, dir) in numeric_entries(&nodes_dir, false)? {
            match fs::metadata(&dir) {
                Ok(meta) if meta.is_dir() => {}
                Ok(_) => continue,
                Err(e) => {
                    log::info!("skipping KFD node {}: {e}", dir.display());
                    continue;
                }
            }
            let Some(gpu_id) = read_gpu_id(&dir)? else {
                continue;
            };
            nodes.push(parse_node(&dir, node_id, gpu_id)?);
        }
        Self::from_nodes(nodes)
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> TopologyError + '_ {
    move |source| TopologyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn malformed(path: &Path, detail: String) -> TopologyError {
    TopologyError::Malformed {
        path: path.to_path_buf(),
        detail,
    }
}

fn read_capped(path: &Path, limit: usize) -> Result<Vec<u8>, TopologyError> {
    let file = File::open(path).map_err(io_error(path))?;
    read_capped_from(file, path, limit)
}

fn read_capped_from(file: File, path: &Path, limit: usize) -> Result<Vec<u8>, TopologyError> {
    let mut buf = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    file.take(cap)
        .read_to_end(&mut buf)
        .map_err(io_error(path))?;
    if buf.len() > limit {
        return Err(TopologyError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(buf)
}

fn read_text(path: &Path) -> Result<String, TopologyError> {
    let bytes = read_capped(path, MAX_SYSFS_FILE_BYTES)?;
    String::from_utf8(bytes).map_err(|_| malformed(path, "the file is not valid UTF-8".into()))
}

/// Numeric entries of `dir`, sorted by number. A missing directory gives an
/// empty list when `optional`.
pub(super) fn numeric_entries(
    dir: &Path,
    optional: bool,
) -> Result<Vec<(u32, PathBuf)>, TopologyError> {
    numeric_entries_capped(dir, optional, MAX_DIR_ENTRIES)
}

pub(super) fn numeric_entries_capped(
    dir: &Path,
    optional: bool,
    limit: usize,
) -> Result<Vec<(u32, PathBuf)>, TopologyError> {
    let iter = match fs::read_dir(dir) {
        Ok(iter) => iter,
        Err(e) if optional && e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error(dir)(e)),
    };
    let mut out = Vec::new();
    for (seen, entry) in iter.enumerate() {
        if seen >= limit {
            return Err(TopologyError::TooLarge {
                path: dir.to_path_buf(),
                limit,
            });
        }
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(n) = name.parse::<u32>() {
            out.push((n, entry.path()));
        }
    }
    out.sort_unstable_by_key(|(n, _)| *n);
    Ok(out)
}

/// Reads `gpu_id`. `Ok(None)` when it cannot be read (node skipped).
fn read_gpu_id(node_dir: &Path) -> Result<Option<u32>, TopologyError> {
    let path = node_dir.join("gpu_id");
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) => {
            log::info!(
                "skipping KFD node {}: cannot open gpu_id: {e}",
                node_dir.display()
            );
            return Ok(None);
        }
    };
    let bytes = match read_capped_from(file, &path, GPU_ID_FILE_LIMIT) {
        Ok(b) => b,
        Err(TopologyError::Io { source, .. }) => {
            log::info!(
                "skipping KFD node {}: cannot read gpu_id: {source}",
                node_dir.display()
            );
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim_ascii();
    let valid = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    match text.parse::<u32>() {
        Ok(id) if valid => Ok(Some(id)),
        _ => Err(malformed(
            &path,
            format!("gpu_id {text:?} is not a 32-bit decimal number"),
        )),
    }
}

/// Calls `visit(name, value)` for each `name value` line of a properties
/// file; `visit` returns false to stop early. Blank lines are skipped; any
/// other line must be exactly a name (at most 64 characters) and a decimal
/// 64-bit value.
fn for_each_property(
    path: &Path,
    text: &str,
    mut visit: impl FnMut(&str, u64) -> Result<bool, TopologyError>,
) -> Result<(), TopologyError> {
    for (index, line) in text.lines().enumerate() {
        let mut words = line.split_ascii_whitespace();
        let Some(name) = words.next() else { continue };
        let line_no = index + 1;
        let shown: String = line.chars().take(80).collect();
        let (Some(value), None) = (words.next(), words.next()) else {
            return Err(malformed(
                path,
                format!("line {line_no} is not a \"name value\" pair: {shown:?}"),
            ));
        };
        if name.len() > MAX_PROPERTY_NAME_LEN {
            return Err(malformed(
                path,
                format!(
                    "line {line_no} has a property name longer than {MAX_PROPERTY_NAME_LEN} characters"
                ),
            ));
        }
        if !value.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed(
                path,
                format!("line {line_no}: the value of {name} is not a decimal number: {shown:?}"),
            ));
        }
        let value: u64 = value.parse().map_err(|_| {
            malformed(
                path,
                format!("line {line_no}: the value of {name} does not fit in 64 bits"),
            )
        })?;
        if !visit(name, value)? {
            break;
        }
    }
    Ok(())
}

fn narrow(path: &Path, name: &str, value: u64) -> Result<u32, TopologyError> {
    u32::try_from(value).map_err(|_| too_wide(path, name, value))
}

fn too_wide(path: &Path, name: &str, value: u64) -> TopologyError {
    malformed(
        path,
        format!("the value {value} of {name} does not fit in 32 bits"),
    )
}

/// How to store the GPU property `name` of a `properties` file; `None` for
/// names the plugin does not keep.
fn gpu_property_setter(name: &str) -> Option<PropertySetter> {
    PROPERTIES
        .iter()
        .find(|p| p.name == name)
        .and_then(|p| p.set)
}

fn parse_node(dir: &Path, node_id: u32, gpu_id: u32) -> Result<TopologyNode, TopologyError> {
    let path = dir.join("properties");
    let text = read_text(&path)?;
    let mut gpu = GpuNode {
        node_id,
        gpu_id,
        ..GpuNode::default()
    };
    let mut cores = 0u32;
    for_each_property(&path, &text, |name, value| {
        if name == "cpu_cores_count" {
            cores = narrow(&path, name, value)?;
        } else if let Some(set) = gpu_property_setter(name) {
            set(&mut gpu, value).map_err(|_| too_wide(&path, name, value))?;
        }
        // A CPU node needs nothing past its core count (as upstream).
        Ok(!(gpu_id == 0 && cores >= 1))
    })?;
    let io_links = parse_io_links(dir)?;
    if gpu_id == 0 {
        return Ok(TopologyNode::Cpu(CpuNode {
            node_id,
            cpu_cores_count: cores,
            io_links,
        }));
    }
    let (vram_public, vram_size) = parse_vram(dir)?;
    gpu.vram_public = vram_public;
    gpu.vram_size = vram_size;
    gpu.io_links = io_links;
    Ok(TopologyNode::Gpu(gpu))
}

/// The `properties` files of the numbered subdirectories of `dir` (memory
/// banks or io links), as (path, text), each read only when reached so that
/// a caller that stops early reads no further.
fn numbered_properties(
    dir: &Path,
    optional: bool,
) -> Result<impl Iterator<Item = Result<(PathBuf, String), TopologyError>>, TopologyError> {
    Ok(numeric_entries(dir, optional)?
        .into_iter()
        .filter(|(_, sub)| sub.is_dir())
        .map(|(_, sub)| {
            let path = sub.join("properties");
            read_text(&path).map(|text| (path, text))
        }))
}

/// The first frame-buffer bank: (public, size).
fn parse_vram(dir: &Path) -> Result<(bool, u64), TopologyError> {
    for entry in numbered_properties(&dir.join("mem_banks"), false)? {
        let (path, text) = entry?;
        let mut heap_type = 0u32;
        let mut size = 0u64;
        for_each_property(&path, &text, |name, value| {
            match name {
                "heap_type" => heap_type = narrow(&path, name, value)?,
                "size_in_bytes" => size = value,
                _ => {}
            }
            Ok(true)
        })?;
        if heap_type == HEAP_TYPE_FB_PUBLIC || heap_type == HEAP_TYPE_FB_PRIVATE {
            if size == 0 {
                break;
            }
            return Ok((heap_type == HEAP_TYPE_FB_PUBLIC, size));
        }
    }
    Err(TopologyError::NoVram {
        node_dir: dir.to_path_buf(),
    })
}

fn parse_io_links(dir: &Path) -> Result<Vec<IoLink>, TopologyError> {
    let mut links = Vec::new();
    for entry in numbered_properties(&dir.join("io_links"), true)? {
        let (path, text) = entry?;
        let mut raw_type = 0u32;
        let mut node_to = None;
        for_each_property(&path, &text, |name, value| {
            match name {
                "type" => raw_type = narrow(&path, name, value)?,
                "node_to" => node_to = Some(narrow(&path, name, value)?),
                _ => {}
            }
            Ok(true)
        })?;
        let Some(link_type) = IoLinkType::from_raw(raw_type) else {
            continue;
        };
        let Some(node_to) = node_to else {
            return Err(malformed(&path, "the link has no node_to property".into()));
        };
        links.push(IoLink { link_type, node_to });
    }
    Ok(links)
}

// ---------------------------------------------------------------------------
// Render nodes
// ---------------------------------------------------------------------------

/// `/dev/dri/renderD<minor>`, or `None` when `minor` is outside 128..=255.
pub fn render_node_path(minor: u32) -> Option<PathBuf> {
    (RENDER_MINOR_FIRST..=RENDER_MINOR_LAST)
        .contains(&minor)
        .then(|| PathBuf::from(format!("/dev/dri/renderD{minor}")))
}

/// The render minors that have a `renderD<minor>` entry in `dev_dri`
/// (normally `/dev/dri`). In a container this is the device list the runtime
/// exposed; use it with [`Topology::retain_accessible`].
pub fn present_render_minors(dev_dri: &Path) -> io::Result<BTreeSet<u32>> {
    let mut minors = BTreeSet::new();
    for (seen, entry) in fs::read_dir(dev_dri)?.enumerate() {
        if seen >= MAX_DIR_ENTRIES {
            break;
        }
        let name = entry?.file_name();
        let Some(digits) = name.to_str().and_then(|n| n.strip_prefix("renderD")) else {
            continue;
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(minor) = digits.parse::<u32>() {
            if (RENDER_MINOR_FIRST..=RENDER_MINOR_LAST).contains(&minor) {
                minors.insert(minor);
            }
        }
    }
    Ok(minors)
}
