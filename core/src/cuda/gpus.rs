//! The machine's NVIDIA GPUs, as the kernel driver lists them, and restore-time GPU mapping.
//!
//! `/proc/driver/nvidia/gpus/<pci address>/information` names every GPU the kernel driver sees
//! (model, UUID, bus location) without loading libcuda, creating a context or opening a device,
//! so the plugin reads it even in CRIU's main process before restore forks any task. A GPU
//! counts only where its device node can be reached ([`super::devnodes`]). The restore GPU map
//! covers every GPU the image records (those the checkpointed processes could reach), as the
//! driver requires.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use cuda_ckpt_sys::{GpuPair, GpuUuid, ParseUuidError};

use super::devnodes::NodeError;
use super::error::{Cause, FailureKind};

pub use super::gpu::Gpu;

/// Largest `information` file read (they are a few hundred bytes).
const MAX_INFO_BYTES: u64 = 16 * 1024;
/// Most GPUs considered on one machine.
const MAX_GPUS: usize = 256;

/// Why the kernel driver's GPU listing cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ListingError {
    /// The directory cannot be listed.
    #[error("cannot list {dir}: {source}")]
    List {
        /// The listing's directory.
        dir: String,
        /// The system's reason.
        source: std::io::Error,
    },
    /// More GPUs than the plugin considers.
    #[error("more than {MAX_GPUS} GPUs under {0}")]
    TooMany(String),
    /// A GPU's `information` file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The system's reason.
        source: std::io::Error,
    },
    /// A GPU's UUID does not parse.
    #[error("GPU {bus}: bad UUID {value:?}: {source}")]
    BadUuid {
        /// The GPU's PCI address.
        bus: String,
        /// What the file says.
        value: String,
        /// Why it is no UUID.
        source: ParseUuidError,
    },
    /// A line the plugin needs is missing.
    #[error("GPU {bus}: no `{line}` line")]
    NoLine {
        /// The GPU's PCI address.
        bus: String,
        /// The line's key.
        line: &'static str,
    },
}

/// Why a device map cannot be read, or the checkpointed GPUs cannot all be placed here.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// An entry without `=`.
    #[error("device map entry {0:?} is not OLD=NEW")]
    NotAPair(String),
    /// An entry whose UUIDs do not parse.
    #[error("device map entry {entry:?}: {source}")]
    BadUuid {
        /// The entry.
        entry: String,
        /// Why.
        source: ParseUuidError,
    },
    /// A GPU named twice as the old one.
    #[error("device map names {0} twice")]
    Twice(GpuUuid),
    /// The map names a GPU the checkpoint did not use.
    #[error("the device map names {0}, which the checkpoint did not use")]
    Unused(GpuUuid),
    /// The map sends a GPU to one not reachable here.
    #[error("the device map sends {old} to {new}, which is not among the GPUs reachable here")]
    Unreachable {
        /// The checkpointed GPU.
        old: GpuUuid,
        /// Where the map sends it.
        new: GpuUuid,
    },
    /// The map sends two GPUs to one.
    #[error("the device map sends two checkpointed GPUs to {0}")]
    Shared(GpuUuid),
    /// A checkpointed GPU has no GPU of its model left here.
    #[error(
        "checkpointed GPU {uuid} ({model}) has no counterpart here: {checkpointed} GPU(s) checkpointed [{all}], {reachable} reachable here, free: [{free}]"
    )]
    NoCounterpart {
        /// The GPU.
        uuid: GpuUuid,
        /// Its model.
        model: String,
        /// How many GPUs the checkpoint used.
        checkpointed: usize,
        /// Those GPUs, in words.
        all: String,
        /// How many GPUs are reachable here.
        reachable: usize,
        /// Those not taken yet, in words.
        free: String,
    },
    /// Another model.
    #[error(
        "checkpointed GPU {old} is a {old_model}, but {new} here is a {new_model}: the driver restores only onto the same model"
    )]
    OtherModel {
        /// The checkpointed GPU.
        old: GpuUuid,
        /// Its model.
        old_model: String,
        /// The GPU here.
        new: GpuUuid,
        /// Its model.
        new_model: String,
    },
    /// Less memory.
    #[error("GPU {new} has {new_mib} MiB, less than the {old_mib} MiB of checkpointed GPU {old}")]
    LessMemory {
        /// The GPU here.
        new: GpuUuid,
        /// Its memory.
        new_mib: u64,
        /// The checkpointed GPU's memory.
        old_mib: u64,
        /// The checkpointed GPU.
        old: GpuUuid,
    },
}

/// The GPUs cannot be listed: the machine's fault, not the image's.
impl Cause for ListingError {
    fn errno(&self) -> i32 {
        libc::EIO
    }
    fn kind(&self) -> FailureKind {
        FailureKind::System
    }
}

/// A device map that cannot be read or followed: the settings' fault.
impl Cause for MapError {
    fn errno(&self) -> i32 {
        libc::EINVAL
    }
    fn kind(&self) -> FailureKind {
        FailureKind::Settings
    }
}

fn parse_information(bus: &str, text: &str) -> Result<Gpu, ListingError> {
    let mut model = None;
    let mut uuid = None;
    let mut minor = None;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        match k.trim() {
            "Model" => model = Some(v.trim().to_string()),
            "GPU UUID" => {
                let v = v.trim();
                uuid = Some(
                    v.parse::<GpuUuid>()
                        .map_err(|source| ListingError::BadUuid {
                            bus: bus.to_string(),
                            value: v.to_string(),
                            source,
                        })?,
                )
            }
            "Device Minor" => minor = v.trim().parse().ok(),
            _ => {}
        }
    }
    Ok(Gpu {
        uuid: uuid.ok_or_else(|| no_line(bus, "GPU UUID"))?,
        model: model.ok_or_else(|| no_line(bus, "Model"))?,
        bus: bus.to_string(),
        memory: 0,
        minor,
    })
}

fn no_line(bus: &str, line: &'static str) -> ListingError {
    ListingError::NoLine {
        bus: bus.to_string(),
        line,
    }
}

/// Whether this process can reach the GPU through its device node under `dev_dir`
/// ([`super::devnodes::check_here`]); `Err` says why not. The kernel driver's listing names
/// every GPU of the host, while a container is given some: its device cgroup refuses the
/// others' nodes, and its `/dev` lacks them. A GPU whose minor the listing does not give is
/// taken as reachable.
fn reachable(gpu: &Gpu, dev_dir: &Path) -> Result<(), NodeError> {
    match gpu.minor {
        Some(minor) => super::devnodes::check_here(dev_dir, minor),
        None => Ok(()),
    }
}

/// The machine's GPUs as this process can reach them.
#[derive(Clone, Debug, Default)]
pub struct GpuListing {
    /// In PCI order.
    pub reachable: Vec<Gpu>,
    /// The others, each with why it cannot be reached.
    pub left_out: Vec<(Gpu, String)>,
}

impl GpuListing {
    /// The reachable GPUs and the others with their reasons, for a message.
    pub fn describe(&self) -> String {
        let list = |v: Vec<String>| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        let reachable = list(
            self.reachable
                .iter()
                .map(|g| format!("{} ({}, {})", g.uuid, g.model, g.bus))
                .collect(),
        );
        let left_out = list(
            self.left_out
                .iter()
                .map(|(g, why)| format!("{} ({}): {why}", g.uuid, g.bus))
                .collect(),
        );
        format!("GPUs reachable here: {reachable}; not reachable: {left_out}")
    }
}

/// Reads every GPU under `dir` (normally `/proc/driver/nvidia/gpus`), in PCI order, keeping
/// those whose device node under `dev_dir` (normally `/dev`) this process can reach.
pub fn read_gpus(dir: &Path, dev_dir: &Path) -> Result<Vec<Gpu>, ListingError> {
    read_listing(dir, dev_dir).map(|l| l.reachable)
}

/// [`read_gpus`], with the GPUs left out and why.
pub fn read_listing(dir: &Path, dev_dir: &Path) -> Result<GpuListing, ListingError> {
    let list = |source| ListingError::List {
        dir: dir.display().to_string(),
        source,
    };
    let rd = std::fs::read_dir(dir).map_err(list)?;
    let mut buses: Vec<String> = Vec::new();
    for ent in rd {
        let ent = ent.map_err(list)?;
        buses.push(ent.file_name().to_string_lossy().into_owned());
        if buses.len() > MAX_GPUS {
            return Err(ListingError::TooMany(dir.display().to_string()));
        }
    }
    buses.sort();
    let mut out = GpuListing::default();
    for bus in buses {
        let path = dir.join(&bus).join("information");
        let mut text = String::new();
        criu_plugin::files::read_regular(None, &path, false, MAX_INFO_BYTES)
            .map(|b| text.push_str(&String::from_utf8_lossy(&b)))
            .map_err(|source| ListingError::Read {
                path: path.display().to_string(),
                source,
            })?;
        let gpu = parse_information(&bus, &text)?;
        match reachable(&gpu, dev_dir) {
            Ok(()) => out.reachable.push(gpu),
            Err(why) => {
                log::info!(
                    "cuda: GPU {} ({bus}) is not reachable here ({why}); left out",
                    gpu.uuid
                );
                out.left_out.push((gpu, why.to_string()));
            }
        }
    }
    Ok(out)
}

/// Parses a device map: `GPU-old=GPU-new` pairs separated by commas or spaces.
pub fn parse_device_map(text: &str) -> Result<Vec<GpuPair>, MapError> {
    let mut pairs = Vec::new();
    for item in text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
    {
        let (old, new) = item
            .split_once('=')
            .ok_or_else(|| MapError::NotAPair(item.to_string()))?;
        let bad = |source| MapError::BadUuid {
            entry: item.to_string(),
            source,
        };
        let old = old.parse::<GpuUuid>().map_err(bad)?;
        let new = new.parse::<GpuUuid>().map_err(bad)?;
        if pairs.iter().any(|p: &GpuPair| p.old == old) {
            return Err(MapError::Twice(old));
        }
        pairs.push(GpuPair { old, new });
    }
    Ok(pairs)
}

/// Chooses where each checkpointed GPU goes on this machine.
///
/// `local` is the GPUs this restore can reach (in a container: those it was given). Explicit
/// pairs come first. A GPU not named keeps its UUID when it is reachable and not taken by a
/// pair; otherwise it takes the first unused reachable GPU of the same model, in PCI order (a
/// migration to an identical machine, or a container given other GPUs, needs no settings). The result covers every checkpointed GPU, or
/// explains which one cannot be placed.
pub fn plan_gpu_map(
    checkpointed: &[Gpu],
    local: &[Gpu],
    explicit: &[GpuPair],
) -> Result<Vec<GpuPair>, MapError> {
    let by_uuid: BTreeMap<GpuUuid, &Gpu> = local.iter().map(|g| (g.uuid, g)).collect();
    let mut used: BTreeSet<GpuUuid> = BTreeSet::new();
    let mut out: Vec<Option<GpuPair>> = vec![None; checkpointed.len()];
    for p in explicit {
        if !checkpointed.iter().any(|g| g.uuid == p.old) {
            return Err(MapError::Unused(p.old));
        }
    }
    // Pass 1: explicit pairs, which win over a GPU keeping its UUID.
    for (i, g) in checkpointed.iter().enumerate() {
        let Some(new) = explicit.iter().find(|p| p.old == g.uuid).map(|p| p.new) else {
            continue;
        };
        let Some(l) = by_uuid.get(&new) else {
            return Err(MapError::Unreachable { old: g.uuid, new });
        };
        check_model(g, l)?;
        if !used.insert(new) {
            return Err(MapError::Shared(new));
        }
        out[i] = Some(GpuPair { old: g.uuid, new });
    }
    // Pass 2: GPUs reachable here keep their UUID, unless the map gave it to another.
    for (i, g) in checkpointed.iter().enumerate() {
        if out[i].is_some() || used.contains(&g.uuid) {
            continue;
        }
        if let Some(l) = by_uuid.get(&g.uuid) {
            check_model(g, l)?;
            used.insert(g.uuid);
            out[i] = Some(GpuPair {
                old: g.uuid,
                new: g.uuid,
            });
        }
    }
    // Pass 3: the rest go to free GPUs of the same model.
    for (i, g) in checkpointed.iter().enumerate() {
        if out[i].is_some() {
            continue;
        }
        let Some(l) = local
            .iter()
            .find(|l| !used.contains(&l.uuid) && l.model == g.model)
        else {
            let free: Vec<String> = local
                .iter()
                .filter(|l| !used.contains(&l.uuid))
                .map(|l| format!("{} ({})", l.uuid, l.model))
                .collect();
            let all: Vec<String> = checkpointed
                .iter()
                .map(|c| format!("{} ({}, {})", c.uuid, c.model, c.bus))
                .collect();
            return Err(MapError::NoCounterpart {
                uuid: g.uuid,
                model: g.model.clone(),
                checkpointed: checkpointed.len(),
                all: all.join(", "),
                reachable: local.len(),
                free: free.join(", "),
            });
        };
        used.insert(l.uuid);
        out[i] = Some(GpuPair {
            old: g.uuid,
            new: l.uuid,
        });
    }
    Ok(out.into_iter().flatten().collect())
}

fn check_model(old: &Gpu, new: &Gpu) -> Result<(), MapError> {
    if old.model != new.model {
        return Err(MapError::OtherModel {
            old: old.uuid,
            old_model: old.model.clone(),
            new: new.uuid,
            new_model: new.model.clone(),
        });
    }
    if old.memory != 0 && new.memory != 0 && new.memory < old.memory {
        return Err(MapError::LessMemory {
            new: new.uuid,
            new_mib: new.memory >> 20,
            old_mib: old.memory >> 20,
            old: old.uuid,
        });
    }
    Ok(())
}

/// Whether a planned map changes anything (only then is it passed to the driver).
pub fn is_identity(pairs: &[GpuPair]) -> bool {
    pairs.iter().all(|p| p.old == p.new)
}

#[cfg(test)]
mod tests;
