//! `inspect`: the GPU state a checkpoint holds, read with the plugin's own image readers
//! (the NVIDIA metadata, the AMD KFD and render-node messages), as text and JSON.

use criu_gpu_core::amdgpu::device::AllocFlags;
use criu_gpu_core::images::amd::{
    self as amd, ImageError, KfdCheckpoint, PagesLayout, ReadLimits, RenderNodeImage,
};
use criu_gpu_core::images::metadata::{self, CudaMetadata, MetadataError};
use criu_plugin::core_image;
use serde_json::{Value, json};

use crate::images::ImageSet;
use crate::report::mib;

/// What the checkpoint holds, read once for `inspect` and `check`.
pub struct Contents {
    /// Pids of the image's process tree, when `pstree.img` could be read.
    pub tree: Option<Vec<u32>>,
    /// Whether the inventory names the C plugins' inventory entries.
    pub lists_cuda: bool,
    pub lists_amdgpu: bool,
    /// The NVIDIA metadata, when present (or why it cannot be read).
    pub cuda: Option<Result<CudaMetadata, MetadataError>>,
    /// Each KFD image by CRIU file id.
    pub kfd: Vec<(u32, Result<KfdCheckpoint, ImageError>)>,
    /// Each render-node image by name.
    pub render: Vec<(String, Result<RenderNodeImage, ImageError>)>,
    /// Problems of the image as a whole (files too large, pages files of the wrong size).
    pub errors: Vec<String>,
    /// The container's OCI spec, where a runtime's archive holds one (`spec.dump`).
    pub spec: Option<Vec<u8>>,
    /// The CPU architecture the checkpoint was made on (CRIU's number), from the core image
    /// named (one that cannot be read is among `errors`).
    pub march: Option<(String, u64)>,
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Reads every GPU file of `set`.
pub fn read(set: &ImageSet) -> Contents {
    let inventory = set.files.get("inventory.img");
    let mut c = Contents {
        tree: set
            .files
            .get("pstree.img")
            .and_then(|b| criu_plugin::pstree::parse_pids(b).ok()),
        // The inventory's plugin list holds the names as plain strings.
        lists_cuda: inventory.is_some_and(|b| contains(b, b"cuda_plugin")),
        lists_amdgpu: inventory.is_some_and(|b| contains(b, b"amdgpu_plugin")),
        cuda: set
            .files
            .get(metadata::FILE_NAME)
            .map(|b| CudaMetadata::decode_bytes(b)),
        kfd: Vec::new(),
        render: Vec::new(),
        errors: Vec::new(),
        spec: set.files.get(crate::mounts::SPEC_FILE).cloned(),
        march: None,
    };
    if let Some((name, bytes)) = set.core.as_ref().and_then(|n| Some((n, set.files.get(n)?))) {
        match core_image::parse_march(bytes, name) {
            Ok(m) => c.march = Some((name.clone(), m)),
            Err(e) => c.errors.push(e.to_string()),
        }
    }
    c.errors.extend(set.refused.iter().cloned());
    if !set.has_inventory() && !set.refused.iter().any(|r| r.contains("inventory.img")) {
        c.errors
            .push("no inventory.img: not a complete CRIU image, CRIU cannot restore it".into());
    }
    for (name, size, limit) in &set.too_large {
        c.errors.push(format!(
            "{name} is {size} bytes, more than the {limit} the plugin reads: damaged or forged"
        ));
    }
    let limits = ReadLimits::default();
    for (name, bytes) in set.files.range(amd::KFD_FILE_PREFIX.to_string()..) {
        let Some(id) = amd::kfd_file_id(name) else {
            if !name.starts_with(amd::KFD_FILE_PREFIX) {
                break;
            }
            continue;
        };
        let img = amd::decode_framed::<KfdCheckpoint>(bytes, name, &limits);
        if let Ok(img) = &img {
            check_pages(set, id, img, &mut c.errors);
        }
        c.kfd.push((id, img));
    }
    for (name, bytes) in set.files.range("amdgpu-renderD-".to_string()..) {
        if !name.starts_with("amdgpu-renderD-") {
            break;
        }
        let img = amd::decode_framed::<RenderNodeImage>(bytes, name, &limits);
        c.render.push((name.clone(), img));
    }
    c
}

/// Each GPU's pages file must hold its BOs' contents exactly.
fn check_pages(set: &ImageSet, id: u32, img: &KfdCheckpoint, errors: &mut Vec<String>) {
    for gpu in img.content_gpus() {
        let name = amd::kfd_pages_file_name(id, gpu);
        let need = match PagesLayout::for_kfd_gpu(img, gpu) {
            Ok(l) => l.total().saturating_add(amd::HEADER_LEN as u64),
            Err(e) => {
                errors.push(format!("{name}: {e}"));
                continue;
            }
        };
        match set.sizes.get(&name) {
            None => errors.push(format!(
                "{name} is missing: the BO contents of GPU {gpu:#06x} are not in the image"
            )),
            Some(&have) if have < need => errors.push(format!(
                "{name} is {have} bytes, less than the {need} its BOs need: truncated"
            )),
            Some(_) => {}
        }
    }
}

/// BOs by kind: (kind, count, bytes).
fn bo_kinds(img: &KfdCheckpoint) -> Vec<(&'static str, usize, u64)> {
    let kinds = [
        ("VRAM", AllocFlags::VRAM),
        ("GTT", AllocFlags::GTT),
        ("userptr", AllocFlags::USERPTR),
        ("doorbell", AllocFlags::DOORBELL),
        ("MMIO", AllocFlags::MMIO_REMAP),
    ];
    let mut out: Vec<(&'static str, usize, u64)> = kinds.iter().map(|k| (k.0, 0, 0)).collect();
    out.push(("other", 0, 0));
    for b in &img.bos {
        let i = kinds
            .iter()
            .position(|k| AllocFlags::of(b.alloc_flags).intersects(k.1))
            .unwrap_or(kinds.len());
        out[i].1 += 1;
        out[i].2 = out[i].2.saturating_add(b.size);
    }
    out.retain(|k| k.1 > 0);
    out
}

/// `inspect`'s text and JSON, and whether the image is sound.
pub fn show(set: &ImageSet, c: &Contents) -> (String, Value, bool) {
    let mut t = format!("{}\n", set.source);
    if let Some(tree) = &c.tree {
        t.push_str(&format!("process tree: {} task(s)\n", tree.len()));
    }
    let mut errors = c.errors.clone();
    let mut arch_json = Value::Null;
    if let Some((name, m)) = &c.march {
        let arch = core_image::march_name(*m);
        t.push_str(&format!("made on: {arch} ({name})\n"));
        arch_json = json!(arch);
    }
    let mut cuda_json = Value::Null;
    match &c.cuda {
        Some(Ok(md)) => {
            t.push_str(&format!(
                "NVIDIA: driver {} (CUDA {}), {} GPU(s), {} CUDA process(es)\n",
                md.driver_release.as_deref().unwrap_or("of unknown release"),
                cuda_ckpt_sys::format_version(md.driver_version),
                md.gpus.len(),
                md.processes.len()
            ));
            for g in &md.gpus {
                t.push_str(&format!(
                    "  GPU {} {} ({}), {}\n",
                    g.uuid,
                    g.model,
                    g.bus,
                    if g.memory == 0 { "memory unknown".into() } else { mib(g.memory) }
                ));
            }
            for p in &md.processes {
                t.push_str(&format!(
                    "  process {} (restore thread {}): {} when dumped, {} of GPU memory\n",
                    p.pid,
                    p.restore_tid,
                    p.found.as_str(),
                    mib(p.host_bytes)
                ));
            }
            cuda_json = cuda_to_json(md);
        }
        Some(Err(e)) => errors.push(e.to_string()),
        None if c.lists_cuda => t.push_str(
            "NVIDIA: CUDA processes were checkpointed by a plugin that writes no metadata (CRIU's C cuda_plugin): their GPUs are not recorded\n",
        ),
        None => {}
    }
    let mut kfd_json = Vec::new();
    for (id, img) in &c.kfd {
        match img {
            Ok(img) => {
                let gpus: Vec<_> = img.devices.iter().filter(|d| d.gpu_id != 0).collect();
                t.push_str(&format!(
                    "AMD: {} (pid {}): {} GPU(s), {} BO(s), {} queue/event/SVM object(s) in {} bytes of kernel data\n",
                    amd::kfd_file_name(*id),
                    img.pid,
                    gpus.len(),
                    img.bos.len(),
                    img.num_of_objects,
                    img.priv_data.len()
                ));
                for d in &gpus {
                    t.push_str(&format!(
                        "  GPU {:#06x}: device {:#06x}, renderD{}, {} VRAM, {} CU(s), hive {:#x}\n",
                        d.gpu_id,
                        d.device_id,
                        d.drm_render_minor,
                        mib(d.vram_size),
                        d.simd_count / d.simd_per_cu.max(1),
                        d.hive_id
                    ));
                }
                for (kind, n, bytes) in bo_kinds(img) {
                    t.push_str(&format!("  {kind}: {n} BO(s), {}\n", mib(bytes)));
                }
                kfd_json.push(kfd_to_json(*id, img));
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    let mut render_json = Vec::new();
    for (name, img) in &c.render {
        match img {
            Ok(r) => {
                let (n, bytes) = r.drm.as_ref().map_or((0, 0), |d| {
                    (
                        d.bos.len(),
                        d.bos.iter().map(|b| b.size).fold(0u64, u64::saturating_add),
                    )
                });
                t.push_str(&format!(
                    "AMD: {name}: GPU {:#06x}, {n} render-node BO(s), {}\n",
                    r.gpu_id,
                    mib(bytes)
                ));
                render_json.push(json!({
                    "file": name,
                    "gpu_id": r.gpu_id,
                    "bos": n,
                    "bytes": bytes,
                }));
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    if c.lists_amdgpu && c.kfd.is_empty() && c.render.is_empty() {
        errors.push("the inventory lists amdgpu_plugin but the image holds no amdgpu-kfd-*.img or render-node image: files are missing".into());
    }
    if c.cuda.is_none()
        && !c.lists_cuda
        && !c.lists_amdgpu
        && c.kfd.is_empty()
        && c.render.is_empty()
    {
        t.push_str("no GPU state: CRIU restores this checkpoint without the GPU plugin\n");
    }
    for n in &set.notes {
        t.push_str(&format!("ignored: {n}\n"));
    }
    if set.more_ignored() > 0 {
        t.push_str(&format!("ignored: {} more entries\n", set.more_ignored()));
    }
    for e in &errors {
        t.push_str(&format!("error: {e}\n"));
    }
    let j = json!({
        "source": set.source,
        "tasks": c.tree.as_ref().map(Vec::len),
        "architecture": arch_json,
        "nvidia": cuda_json,
        "nvidia_without_metadata": c.cuda.is_none() && c.lists_cuda,
        "amd_kfd": kfd_json,
        "amd_render_nodes": render_json,
        "ignored": set.notes,
        "errors": errors,
    });
    (t, j, errors.is_empty())
}

fn cuda_to_json(md: &CudaMetadata) -> Value {
    let gpus: Vec<Value> = md
        .gpus
        .iter()
        .map(|g| {
            json!({
                "uuid": g.uuid.to_string(),
                "model": g.model,
                "bus": g.bus,
                "memory": g.memory,
            })
        })
        .collect();
    let processes: Vec<Value> = md
        .processes
        .iter()
        .map(|p| {
            json!({
                "pid": p.pid,
                "restore_tid": p.restore_tid,
                "state": p.found.as_str(),
                "gpu_bytes": p.host_bytes,
            })
        })
        .collect();
    json!({
        "driver_version": md.driver_version,
        "driver_release": md.driver_release,
        "gpus": gpus,
        "processes": processes,
    })
}

fn kfd_to_json(id: u32, img: &KfdCheckpoint) -> Value {
    let gpus: Vec<Value> = img
        .devices
        .iter()
        .filter(|d| d.gpu_id != 0)
        .map(|d| {
            json!({
                "gpu_id": d.gpu_id,
                "device_id": d.device_id,
                "render_minor": d.drm_render_minor,
                "vram_size": d.vram_size,
                "hive_id": d.hive_id,
            })
        })
        .collect();
    let bos: Vec<Value> = bo_kinds(img)
        .into_iter()
        .map(|(k, n, b)| json!({"kind": k, "count": n, "bytes": b}))
        .collect();
    json!({
        "file": amd::kfd_file_name(id),
        "pid": img.pid,
        "gpus": gpus,
        "bos": bos,
        "objects": img.num_of_objects,
        "kernel_data_bytes": img.priv_data.len(),
    })
}
