//! The restore preflight: whether an image's CUDA processes can be restored on this machine,
//! from the image's metadata, this machine's driver version, GPUs and free GPU memory.
//!
//! Pure functions, shared by the plugin's restore `init` (which fails on the first refusal)
//! and the `criu-gpu check` tool (which lists every one).

use std::collections::{BTreeMap, BTreeSet};

use cuda_ckpt_sys::{GpuPair, GpuUuid};

use super::gpus::{self, Gpu};
use super::metadata::CudaMetadata;
use super::nvml;

/// One reason a restore would fail, with the errno the plugin reports for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// What it is about: this machine, nearly always.
    pub kind: criu_plugin::FailureKind,
    /// Positive errno.
    pub errno: i32,
    /// What is wrong, as the plugin logs it.
    pub message: String,
}

impl Refusal {
    fn new(errno: i32, message: impl Into<String>) -> Refusal {
        Refusal {
            kind: criu_plugin::FailureKind::Machine,
            errno,
            message: message.into(),
        }
    }
}

/// What the preflight found: the GPU map a restore would use (each checkpointed GPU with its
/// GPU here; `None` when no map could be made) and every reason the restore would fail.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Preflight {
    /// Every checkpointed GPU and where it goes, identity pairs included.
    pub plan: Option<Vec<GpuPair>>,
    /// Bytes the image's processes held on their GPUs (those to be restored).
    pub need_bytes: u64,
    /// Free bytes of the target GPUs, when NVML answered.
    pub free_bytes: Option<u64>,
    /// Every refusal, in the order the plugin checks them.
    pub refusals: Vec<Refusal>,
}

impl Preflight {
    /// The map to pass to the driver: empty when every GPU restores onto itself.
    pub fn gpu_pairs(&self) -> Vec<GpuPair> {
        match &self.plan {
            Some(p) if !gpus::is_identity(p) => p.clone(),
            _ => Vec::new(),
        }
    }
}

/// Refuses a driver older than the one the image was made with.
pub fn check_driver(md: &CudaMetadata, driver_version: i32) -> Option<Refusal> {
    (driver_version < md.driver_version).then(|| {
        // An image records no release where the dump could not read it (or made by an older
        // plugin).
        let release = md.driver_release.as_deref().map_or_else(
            || "a CUDA driver whose release it does not record".to_string(),
            |r| format!("CUDA driver {r}"),
        );
        Refusal::new(
            libc::EINVAL,
            format!(
                "the image was made with {release} (CUDA {}); this machine's driver supports only CUDA {}",
                cuda_ckpt_sys::format_version(md.driver_version),
                cuda_ckpt_sys::format_version(driver_version)
            ),
        )
    })
}

/// Plans where the image's GPUs go among `local` (with `explicit` pairs first) and checks free
/// memory (`free` by UUID, from NVML; `None` skips the check) and the driver's support for
/// restoring onto other GPUs. The driver version itself is [`check_driver`]'s.
pub fn plan(
    md: &CudaMetadata,
    driver_version: i32,
    local: &[Gpu],
    free: Option<&BTreeMap<GpuUuid, u64>>,
    explicit: &[GpuPair],
) -> Preflight {
    let mut out = Preflight {
        // Every recorded process gets its GPU state back, whatever state it was found in.
        need_bytes: total_bytes(md.processes.iter().map(|p| p.host_bytes)),
        ..Preflight::default()
    };
    if md.gpus.is_empty() && !md.processes.is_empty() {
        // A dump records the GPUs it saw: none beside CUDA processes is a damaged image, and
        // the memory check would report "0 MiB free" of no GPUs.
        out.refusals.push(Refusal::new(
            libc::EINVAL,
            format!(
                "the image records {} CUDA process(es) but no GPUs (its gpu-plugin-cuda.img has no gpu lines): it is damaged or was edited",
                md.processes.len()
            ),
        ));
        return out;
    }
    let plan = match gpus::plan_gpu_map(&md.gpus, local, explicit) {
        Ok(p) => p,
        Err(e) => {
            out.refusals.push(Refusal::new(
                libc::ENODEV,
                format!("cannot restore onto the GPUs reachable here: {e}"),
            ));
            return out;
        }
    };
    if let Some(free) = free {
        let targets: BTreeSet<_> = plan.iter().map(|p| p.new).collect();
        let have = total_bytes(targets.iter().filter_map(|u| free.get(u).copied()));
        out.free_bytes = Some(have);
        if let Err(e) = nvml::check_free_memory(out.need_bytes, have, targets.len()) {
            out.refusals
                .push(Refusal::new(libc::ENOMEM, format!("cannot restore: {e}")));
        }
    }
    if !gpus::is_identity(&plan) && driver_version < cuda_ckpt_sys::GPU_PAIRS_VERSION {
        out.refusals.push(Refusal::new(
            libc::EOPNOTSUPP,
            "restoring onto other GPUs needs driver 580 (CUDA 13.0) or later",
        ));
    }
    out.plan = Some(plan);
    out
}

/// The whole preflight: `check_driver`, then `plan`.
pub fn preflight(
    md: &CudaMetadata,
    driver_version: i32,
    local: &[Gpu],
    free: Option<&BTreeMap<GpuUuid, u64>>,
    explicit: &[GpuPair],
) -> Preflight {
    let mut out = plan(md, driver_version, local, free, explicit);
    if let Some(r) = check_driver(md, driver_version) {
        out.refusals.insert(0, r);
    }
    out
}

/// The processes `md` records that the image's process tree (`tree`, the pids of its
/// `pstree.img`) does not hold: their GPU state would be restored nowhere.
pub fn records_not_in_tree(md: &CudaMetadata, tree: &[u32]) -> Vec<i32> {
    let pids: BTreeSet<u32> = tree.iter().copied().collect();
    md.processes
        .iter()
        .map(|p| p.pid)
        .filter(|&p| u32::try_from(p).map_or(true, |p| !pids.contains(&p)))
        .collect()
}

/// The sum of sizes that come from an image or a driver, saturating instead of wrapping: a
/// record claiming 2^64 − 1 bytes must not add up with another to a small number.
pub fn total_bytes(sizes: impl Iterator<Item = u64>) -> u64 {
    sizes.fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::metadata::{FoundState, ProcessRecord};

    fn gpu(n: u8, model: &str) -> Gpu {
        Gpu {
            uuid: GpuUuid([n; 16]),
            model: model.into(),
            bus: format!("0000:00:0{n}.0"),
            memory: 0,
            minor: None,
        }
    }

    fn md(gpus: Vec<Gpu>, bytes: u64) -> CudaMetadata {
        CudaMetadata {
            driver_version: 13000,
            driver_release: Some("580.1".into()),
            gpus,
            processes: vec![ProcessRecord {
                pid: 7,
                restore_tid: 8,
                found: FoundState::Running,
                host_bytes: bytes,
            }],
        }
    }

    #[test]
    fn every_refusal_is_listed() {
        let m = md(vec![gpu(1, "H100")], 10 << 30);
        let free: BTreeMap<_, _> = [(GpuUuid([2; 16]), 1u64 << 30)].into();
        let p = preflight(&m, 12080, &[gpu(2, "H100")], Some(&free), &[]);
        let errnos: Vec<i32> = p.refusals.iter().map(|r| r.errno).collect();
        assert_eq!(errnos, [libc::EINVAL, libc::ENOMEM, libc::EOPNOTSUPP]);
        assert_eq!(p.gpu_pairs().len(), 1);
        assert!(
            p.refusals[0]
                .message
                .contains("made with CUDA driver 580.1")
        );
    }

    #[test]
    fn a_driver_release_the_image_lacks_is_said_to_be_unrecorded() {
        let m = CudaMetadata {
            driver_release: None,
            ..md(vec![gpu(1, "H100")], 1 << 20)
        };
        let r = check_driver(&m, 12080).expect("an older driver is refused");
        assert_eq!(
            r.message,
            "the image was made with a CUDA driver whose release it does not record (CUDA 13.0); \
             this machine's driver supports only CUDA 12.8"
        );
        assert!(check_driver(&m, 13000).is_none());
    }

    #[test]
    fn same_machine_needs_no_pairs() {
        let m = md(vec![gpu(1, "H100")], 1 << 20);
        let p = preflight(&m, 13000, &[gpu(1, "H100")], None, &[]);
        assert!(p.refusals.is_empty(), "{p:?}");
        assert!(p.gpu_pairs().is_empty());
        assert_eq!(p.plan.as_ref().map(Vec::len), Some(1));
        let p = preflight(&m, 13000, &[gpu(3, "A100")], None, &[]);
        assert!(p.plan.is_none());
        assert!(p.refusals[0].message.contains("no counterpart"));
    }

    #[test]
    fn an_image_without_gpus_is_said_to_record_none() {
        let m = md(vec![], 1 << 30);
        let free: BTreeMap<_, _> = [(GpuUuid([1; 16]), 80u64 << 30)].into();
        let p = preflight(&m, 13000, &[gpu(1, "H100")], Some(&free), &[]);
        assert_eq!(p.refusals.len(), 1, "{p:?}");
        assert!(
            p.refusals[0]
                .message
                .contains("records 1 CUDA process(es) but no GPUs"),
            "{p:?}"
        );
        assert!(!p.refusals[0].message.contains("free GPU memory"));
    }

    #[test]
    fn records_outside_the_tree_are_named() {
        let m = md(vec![], 0);
        assert_eq!(records_not_in_tree(&m, &[7, 9]), Vec::<i32>::new());
        assert_eq!(records_not_in_tree(&m, &[9]), vec![7]);
    }
}
