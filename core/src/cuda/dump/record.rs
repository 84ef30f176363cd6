//! What the image records of a dump: its driver, the GPUs the dumped processes could reach,
//! and each process as the dump found it.

use super::super::devnodes;
use super::super::driver;
use super::super::gpus::Gpu;
use super::super::metadata::{CudaMetadata, ProcessRecord};
use super::DumpRun;

impl DumpRun {
    /// The GPUs the dumped processes could reach: what the driver checkpointed, and what a
    /// restore must map. Processes in a container see only its GPUs' nodes in its `/dev`,
    /// while this CRIU (in the host's mount namespace under runc) sees every GPU's.
    fn checkpointed_gpus(&self) -> Vec<Gpu> {
        let mut seen: Option<Vec<Gpu>> = None;
        for &pid in self.dumped.keys() {
            if devnodes::other_mount_ns(pid) != Some(true) {
                return self.gpus.clone();
            }
            let Some(v) = devnodes::seen_by_task(pid, &self.gpus) else {
                return self.gpus.clone();
            };
            let all = seen.get_or_insert_with(Vec::new);
            for g in v {
                if !all.iter().any(|a| a.uuid == g.uuid) {
                    all.push(g);
                }
            }
        }
        match seen {
            Some(mut v) if !v.is_empty() => {
                v.sort_by(|a, b| a.bus.cmp(&b.bus));
                if v.len() < self.gpus.len() {
                    let names: Vec<String> = v.iter().map(|g| g.uuid.to_string()).collect();
                    log::info!(
                        "cuda: the dumped processes reach {} of the {} GPU(s) here: {}",
                        v.len(),
                        self.gpus.len(),
                        names.join(", ")
                    );
                }
                v
            }
            _ => self.gpus.clone(),
        }
    }

    /// What the image records of this dump.
    pub(super) fn metadata(&self) -> CudaMetadata {
        CudaMetadata {
            driver_version: self.driver_version,
            driver_release: driver::read_release(&self.settings.nvidia_proc),
            gpus: self.checkpointed_gpus(),
            processes: self
                .dumped
                .values()
                .map(|p| ProcessRecord {
                    pid: p.ns_pid,
                    restore_tid: p.restore_tid,
                    found: p.found,
                    host_bytes: p.host_bytes,
                })
                .collect(),
        }
    }
}
