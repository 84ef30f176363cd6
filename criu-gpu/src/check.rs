//! `check`: would the checkpoint restore on this machine? The plugin's own restore preflight
//! (`criu_gpu_core::images::cuda_check`, `criu_gpu_core::images::amd_check`) run against this
//! machine's driver, GPUs and free memory, listing the GPU map and every reason it would not;
//! for a runtime's archive also the container's bind mounts that CRIU could not rebuild here
//! ([`crate::mounts`]).

use std::path::Path;

use criu_gpu_core::config::Config;
use criu_gpu_core::images::amd_check::{
    self as amd_restore, AmdgpuSettings, CriuLimits, Topology, present_render_minors,
};
use criu_gpu_core::images::cuda_check::{self as preflight, CudaSettings};
use criu_gpu_core::images::metadata::{self, CudaMetadata};
use criu_plugin::core_image;

use crate::inspect::Contents;
use crate::mounts;

/// The verdict: the GPU map lines and every reason it would not restore.
#[derive(Default)]
pub struct Verdict {
    pub map: Vec<String>,
    pub reasons: Vec<String>,
    pub notes: Vec<String>,
}

/// Runs the preflight of every GPU side the checkpoint needs.
pub fn check(c: &Contents, cfg: &Config, device_map: Option<&str>) -> Verdict {
    let mut v = Verdict::default();
    v.reasons.extend(c.errors.iter().cloned());
    if let Some((name, m)) = &c.march {
        if *m != core_image::THIS_MARCH {
            v.reasons.push(core_image::dumped_elsewhere(name, *m));
        }
    }
    match &c.cuda {
        Some(Ok(md)) => check_cuda(md, c, cfg, device_map, &mut v),
        Some(Err(e)) => v.reasons.push(e.to_string()),
        None if c.lists_cuda => v.notes.push(
            "NVIDIA: no metadata (CRIU's C cuda_plugin made the image): the driver and GPUs can only be checked by the restore itself".into(),
        ),
        None => {}
    }
    if c.cuda.is_none() && device_map.is_some() {
        v.notes
            .push("--device-map applies only to NVIDIA images with metadata".into());
    }
    if !c.kfd.is_empty() {
        check_amd(c, cfg, &mut v);
    }
    if let Some(spec) = &c.spec {
        match mounts::symlinked_bind_sources(spec) {
            Ok(reasons) => v.reasons.extend(reasons),
            Err(e) => v.notes.push(e),
        }
    }
    if c.cuda.is_none() && !c.lists_cuda && c.kfd.is_empty() && c.render.is_empty() {
        v.notes
            .push("no GPU state: CRIU restores this checkpoint without the GPU plugin".into());
    }
    v
}

fn check_cuda(
    md: &CudaMetadata,
    c: &Contents,
    cfg: &Config,
    device_map: Option<&str>,
    v: &mut Verdict,
) {
    if md.processes.is_empty() {
        if c.lists_cuda {
            v.reasons.push(format!(
                "the image needs cuda_plugin but {} records no CUDA process (truncated or edited?)",
                metadata::FILE_NAME
            ));
        }
        return;
    }
    match &c.tree {
        Some(tree) => {
            let missing = preflight::records_not_in_tree(md, tree);
            if !missing.is_empty() {
                let shown: Vec<String> = missing.iter().take(8).map(|p| p.to_string()).collect();
                v.reasons.push(format!(
                    "{} records CUDA process(es) {}{} that the image's process tree does not hold (a damaged or mismatched image)",
                    metadata::FILE_NAME,
                    shown.join(", "),
                    if missing.len() > 8 { format!(" and {} more", missing.len() - 8) } else { String::new() }
                ));
            }
        }
        None => v.notes.push(
            "pstree.img missing or unreadable: the process records are not checked against it"
                .into(),
        ),
    }
    let settings = CudaSettings::from_config(cfg);
    for p in &settings.problems {
        v.reasons.push(format!("a setting is bad: {p}"));
    }
    let explicit = match preflight::parse_device_map(device_map.unwrap_or(&settings.device_map)) {
        Ok(m) => m,
        Err(e) => {
            v.reasons.push(format!("device map: {e}"));
            return;
        }
    };
    if let Some(problem) = settings.nvidia_proc_problem() {
        v.reasons.push(format!(
            "the image holds {} CUDA process(es) but this machine has no NVIDIA driver ({problem})",
            md.processes.len(),
        ));
        return;
    }
    let version = match preflight::load_driver(&settings) {
        Ok((_, version)) => version,
        Err(e) => {
            v.reasons
                .push(format!("the image holds CUDA processes but {e}"));
            return;
        }
    };
    let mut local = match preflight::read_gpus(&settings.nvidia_proc, &settings.nvidia_dev) {
        Ok(l) => l,
        Err(e) => {
            v.reasons
                .push(format!("cannot list this machine's GPUs: {e}"));
            return;
        }
    };
    let free = preflight::fill_memory(&settings.nvml, &mut local);
    if free.is_none() {
        v.notes
            .push("NVIDIA: free GPU memory unknown (NVML did not answer): not checked".into());
    }
    let p = preflight::preflight(md, version, &local, free.as_ref(), &explicit);
    if let Some(plan) = &p.plan {
        for pair in plan {
            let model = local
                .iter()
                .find(|g| g.uuid == pair.new)
                .map_or("", |g| g.model.as_str());
            v.map
                .push(format!("NVIDIA GPU {} -> {} ({model})", pair.old, pair.new));
        }
    }
    if let Some(free) = p.free_bytes {
        v.notes.push(format!(
            "NVIDIA: the processes need about {} MiB of GPU memory; the target GPUs have {} MiB free",
            p.need_bytes >> 20,
            free >> 20
        ));
    }
    v.reasons.extend(p.refusals.into_iter().map(|r| r.message));
}

fn check_amd(c: &Contents, cfg: &Config, v: &mut Verdict) {
    let env = |k: &str| std::env::var(k).ok();
    let (settings, errors) = AmdgpuSettings::from_config_lenient(cfg, &env);
    v.reasons
        .extend(errors.into_iter().map(|e| format!("a setting is bad: {e}")));
    let root = &settings.topology_root;
    let mut local = match Topology::from_sysfs(root) {
        Ok(t) => t,
        Err(e) => {
            v.reasons.push(format!(
                "the image holds AMD GPU state but this machine's KFD topology cannot be read at {} ({e}): no AMD GPU driver (amdgpu/KFD) here?",
                root.display()
            ));
            return;
        }
    };
    match present_render_minors(Path::new("/dev/dri")) {
        Ok(present) => {
            for g in local.retain_accessible(|g| present.contains(&g.drm_render_minor)) {
                v.notes.push(format!(
                    "AMD: GPU {g:#x} has no render node here; not a restore candidate"
                ));
            }
        }
        Err(e) => v.notes.push(format!(
            "AMD: /dev/dri cannot be listed ({e}): render nodes not checked"
        )),
    }
    for (id, img) in &c.kfd {
        let Ok(img) = img else {
            // Already among the reasons, from the image reader.
            continue;
        };
        let name = criu_gpu_core::images::amd::kfd_file_name(*id);
        if let Err(e) = amd_restore::check_image(img, &CriuLimits::default()) {
            v.reasons.push(format!("{name}: {e}"));
            continue;
        }
        match amd_restore::map_onto(img, &local, &settings.checks) {
            Ok(map) => {
                for m in map.iter() {
                    v.map.push(format!(
                        "AMD {name}: GPU {:#06x} (renderD{}) -> {:#06x} (renderD{})",
                        m.checkpoint_gpu_id,
                        m.checkpoint_render_minor,
                        m.restore_gpu_id,
                        m.restore_render_minor
                    ));
                }
            }
            Err(e) => v.reasons.push(format!("{name}: {e}")),
        }
    }
}

impl Verdict {
    pub fn ok(&self) -> bool {
        self.reasons.is_empty()
    }

    pub fn text(&self, source: &str) -> String {
        let mut t = format!("{source}\n");
        for m in &self.map {
            t.push_str(&format!("map: {m}\n"));
        }
        for n in &self.notes {
            t.push_str(&format!("note: {n}\n"));
        }
        for r in &self.reasons {
            t.push_str(&format!("would fail: {r}\n"));
        }
        t.push_str(if self.ok() {
            "verdict: would restore on this machine\n"
        } else {
            "verdict: would NOT restore on this machine\n"
        });
        t
    }

    pub fn json(&self, source: &str) -> serde_json::Value {
        serde_json::json!({
            "source": source,
            "would_restore": self.ok(),
            "gpu_map": self.map,
            "reasons": self.reasons,
            "notes": self.notes,
        })
    }
}
