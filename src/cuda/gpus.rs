//! The machine's NVIDIA GPUs, as the kernel driver lists them, and restore-time GPU mapping.
//!
//! `/proc/driver/nvidia/gpus/<pci address>/information` names every GPU the kernel driver sees
//! (model, UUID, bus location) without loading libcuda, creating a context or opening a device,
//! so the plugin reads it even in CRIU's main process before restore forks any task. The restore
//! GPU map covers every GPU of the checkpointing machine, as the driver requires.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use cuda_ckpt_sys::{GpuPair, GpuUuid};

/// One GPU as the kernel driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// `GPU-…` UUID.
    pub uuid: GpuUuid,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// PCI address, e.g. `0000:00:06.0`.
    pub bus: String,
    /// Total memory in bytes, when known (from the CUDA driver or NVML; 0 = unknown).
    pub memory: u64,
    /// Minor number of its device node `/dev/nvidia<minor>`, when the driver says.
    pub minor: Option<u32>,
}

/// Major number of NVIDIA's GPU device nodes.
const NVIDIA_MAJOR: u32 = 195;

/// Largest `information` file read (they are a few hundred bytes).
const MAX_INFO_BYTES: u64 = 16 * 1024;
/// Most GPUs considered on one machine.
const MAX_GPUS: usize = 256;

fn parse_information(bus: &str, text: &str) -> Result<Gpu, String> {
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
                        .map_err(|e| format!("GPU {bus}: bad UUID {v:?}: {e}"))?,
                )
            }
            "Device Minor" => minor = v.trim().parse().ok(),
            _ => {}
        }
    }
    Ok(Gpu {
        uuid: uuid.ok_or_else(|| format!("GPU {bus}: no `GPU UUID` line"))?,
        model: model.ok_or_else(|| format!("GPU {bus}: no `Model` line"))?,
        bus: bus.to_string(),
        memory: 0,
        minor,
    })
}

/// Whether this process can reach the GPU: its device node exists and is NVIDIA's. A
/// container's device list hides the nodes of GPUs it was not given, while the kernel driver's
/// listing still names every GPU of the host.
fn reachable(gpu: &Gpu, dev_dir: &Path) -> bool {
    let Some(minor) = gpu.minor else {
        return true;
    };
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    match std::fs::metadata(dev_dir.join(format!("nvidia{minor}"))) {
        Ok(m) => m.file_type().is_char_device() && libc::major(m.rdev()) == NVIDIA_MAJOR,
        Err(_) => false,
    }
}

/// Reads every GPU under `dir` (normally `/proc/driver/nvidia/gpus`), in PCI order, keeping
/// those whose device node under `dev_dir` (normally `/dev`) this process can reach.
pub fn read_gpus(dir: &Path, dev_dir: &Path) -> Result<Vec<Gpu>, String> {
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut buses: Vec<String> = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        buses.push(ent.file_name().to_string_lossy().into_owned());
        if buses.len() > MAX_GPUS {
            return Err(format!("more than {MAX_GPUS} GPUs under {}", dir.display()));
        }
    }
    buses.sort();
    let mut gpus = Vec::with_capacity(buses.len());
    for bus in buses {
        let path = dir.join(&bus).join("information");
        let mut text = String::new();
        criu_plugin::files::read_regular(None, &path, false, MAX_INFO_BYTES)
            .map(|b| text.push_str(&String::from_utf8_lossy(&b)))
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let gpu = parse_information(&bus, &text)?;
        if reachable(&gpu, dev_dir) {
            gpus.push(gpu);
        } else {
            log::info!(
                "cuda: GPU {} ({bus}) is not reachable here (no /dev/nvidia{} device); left out",
                gpu.uuid,
                gpu.minor.unwrap_or(0)
            );
        }
    }
    Ok(gpus)
}

/// Parses a device map: `GPU-old=GPU-new` pairs separated by commas or spaces.
pub fn parse_device_map(text: &str) -> Result<Vec<GpuPair>, String> {
    let mut pairs = Vec::new();
    for item in text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
    {
        let (old, new) = item
            .split_once('=')
            .ok_or_else(|| format!("device map entry {item:?} is not OLD=NEW"))?;
        let old = old
            .parse::<GpuUuid>()
            .map_err(|e| format!("device map entry {item:?}: {e}"))?;
        let new = new
            .parse::<GpuUuid>()
            .map_err(|e| format!("device map entry {item:?}: {e}"))?;
        if pairs.iter().any(|p: &GpuPair| p.old == old) {
            return Err(format!("device map names {old} twice"));
        }
        pairs.push(GpuPair { old, new });
    }
    Ok(pairs)
}

/// Chooses where each checkpointed GPU goes on this machine.
///
/// Explicit pairs come first. A GPU not named keeps its UUID when this machine has it;
/// otherwise it takes the first unused local GPU of the same model, in PCI order (a migration
/// to an identical machine needs no settings). The result covers every checkpointed GPU, or
/// explains which one cannot be placed.
pub fn plan_gpu_map(
    checkpointed: &[Gpu],
    local: &[Gpu],
    explicit: &[GpuPair],
) -> Result<Vec<GpuPair>, String> {
    let by_uuid: BTreeMap<GpuUuid, &Gpu> = local.iter().map(|g| (g.uuid, g)).collect();
    let mut used: BTreeSet<GpuUuid> = BTreeSet::new();
    let mut out: Vec<Option<GpuPair>> = vec![None; checkpointed.len()];
    for p in explicit {
        if !checkpointed.iter().any(|g| g.uuid == p.old) {
            return Err(format!(
                "the device map names {}, which the checkpoint did not use",
                p.old
            ));
        }
    }
    // Pass 1: explicit pairs and GPUs present here.
    for (i, g) in checkpointed.iter().enumerate() {
        let target = explicit
            .iter()
            .find(|p| p.old == g.uuid)
            .map(|p| p.new)
            .or_else(|| by_uuid.contains_key(&g.uuid).then_some(g.uuid));
        if let Some(new) = target {
            let Some(l) = by_uuid.get(&new) else {
                return Err(format!(
                    "the device map sends {} to {new}, which this machine does not have",
                    g.uuid
                ));
            };
            check_model(g, l)?;
            if !used.insert(new) {
                return Err(format!("two checkpointed GPUs would share {new}"));
            }
            out[i] = Some(GpuPair { old: g.uuid, new });
        }
    }
    // Pass 2: the rest go to free GPUs of the same model.
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
            return Err(format!(
                "checkpointed GPU {} ({}) has no counterpart here: {} GPU(s) checkpointed, {} here, free: [{}]",
                g.uuid,
                g.model,
                checkpointed.len(),
                local.len(),
                free.join(", ")
            ));
        };
        used.insert(l.uuid);
        out[i] = Some(GpuPair {
            old: g.uuid,
            new: l.uuid,
        });
    }
    Ok(out.into_iter().flatten().collect())
}

fn check_model(old: &Gpu, new: &Gpu) -> Result<(), String> {
    if old.model != new.model {
        return Err(format!(
            "checkpointed GPU {} is a {}, but {} here is a {}: the driver restores only onto the same model",
            old.uuid, old.model, new.uuid, new.model
        ));
    }
    if old.memory != 0 && new.memory != 0 && new.memory < old.memory {
        return Err(format!(
            "GPU {} has {} MiB, less than the {} MiB of checkpointed GPU {}",
            new.uuid,
            new.memory >> 20,
            old.memory >> 20,
            old.uuid
        ));
    }
    Ok(())
}

/// Whether a planned map changes anything (only then is it passed to the driver).
pub fn is_identity(pairs: &[GpuPair]) -> bool {
    pairs.iter().all(|p| p.old == p.new)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uuid(n: u8) -> GpuUuid {
        GpuUuid([n; 16])
    }

    fn gpu(n: u8, model: &str) -> Gpu {
        Gpu {
            uuid: uuid(n),
            model: model.into(),
            bus: format!("0000:00:0{n}.0"),
            memory: 0,
            minor: None,
        }
    }

    #[test]
    fn reads_the_kernel_driver_listing() {
        let dir = std::env::temp_dir().join(format!("nv-gpus-{}", std::process::id()));
        for (bus, n) in [("0000:00:07.0", 2u8), ("0000:00:06.0", 1)] {
            std::fs::create_dir_all(dir.join(bus)).unwrap();
            std::fs::write(
                dir.join(bus).join("information"),
                format!(
                    "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nGPU UUID: \t {}\nBus Location: \t {bus}\n",
                    uuid(n)
                ),
            )
            .unwrap();
        }
        let gpus = read_gpus(&dir, Path::new("/dev")).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].bus, "0000:00:06.0");
        assert_eq!(gpus[0].uuid, uuid(1));
        assert_eq!(gpus[1].model, "NVIDIA H100 80GB HBM3");
        // A GPU whose device node is missing (a container's device list) is left out.
        let info = format!("Model: M\nGPU UUID: {}\nDevice Minor: 7\n", uuid(1));
        std::fs::write(dir.join("0000:00:06.0/information"), info).unwrap();
        let gpus = read_gpus(&dir, &dir).unwrap();
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].uuid, uuid(2));
        std::fs::write(dir.join("0000:00:06.0/information"), "Model: X\n").unwrap();
        assert!(
            read_gpus(&dir, Path::new("/dev"))
                .unwrap_err()
                .contains("no `GPU UUID`")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn device_map_syntax() {
        let m =
            parse_device_map(&format!("{}={}, {}={}", uuid(1), uuid(2), uuid(3), uuid(4))).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!((m[1].old, m[1].new), (uuid(3), uuid(4)));
        assert!(parse_device_map("GPU-1").is_err());
        assert!(parse_device_map(&format!("{0}={1},{0}={1}", uuid(1), uuid(2))).is_err());
        assert_eq!(parse_device_map(" ").unwrap(), vec![]);
    }

    #[test]
    fn same_machine_maps_to_itself() {
        let here = vec![gpu(1, "H100"), gpu(2, "H100")];
        let map = plan_gpu_map(&here, &here, &[]).unwrap();
        assert!(is_identity(&map));
        assert_eq!(map.len(), 2);
    }

    #[test]
    fn explicit_pairs_then_same_model_in_order() {
        let ckpt = vec![gpu(1, "H100"), gpu(2, "H100")];
        let here = vec![gpu(7, "H100"), gpu(8, "H100"), gpu(9, "H100")];
        let explicit = [GpuPair {
            old: uuid(2),
            new: uuid(7),
        }];
        let map = plan_gpu_map(&ckpt, &here, &explicit).unwrap();
        assert_eq!(map[0].new, uuid(8));
        assert_eq!(map[1].new, uuid(7));
        assert!(!is_identity(&map));
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        let ckpt = vec![gpu(1, "H100"), gpu(2, "H100")];
        let err = plan_gpu_map(&ckpt, &[gpu(1, "H100")], &[]).unwrap_err();
        assert!(err.contains("no counterpart") && err.contains("2 GPU(s) checkpointed, 1 here"));
        let err = plan_gpu_map(&ckpt[..1], &[gpu(5, "A100")], &[]).unwrap_err();
        assert!(err.contains("no counterpart"), "{err}");
        let explicit = [GpuPair {
            old: uuid(1),
            new: uuid(5),
        }];
        let err = plan_gpu_map(&ckpt[..1], &[gpu(5, "A100")], &explicit).unwrap_err();
        assert!(err.contains("same model"), "{err}");
        let explicit = [GpuPair {
            old: uuid(9),
            new: uuid(1),
        }];
        assert!(
            plan_gpu_map(&ckpt, &ckpt, &explicit)
                .unwrap_err()
                .contains("did not use")
        );
        let mut small = gpu(1, "H100");
        small.memory = 40 << 30;
        let mut big = gpu(1, "H100");
        big.memory = 80 << 30;
        assert!(
            plan_gpu_map(&[big], &[small], &[])
                .unwrap_err()
                .contains("less than")
        );
    }
}
