//! The seven `KFD_*_CHECK` switches and the property comparison of a
//! checkpointed GPU with a restore GPU (upstream `device_properties_match`).

use super::GpuNode;

/// The seven `KFD_*_CHECK` switches. All default to on, as upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompatChecks {
    /// `KFD_FW_VER_CHECK`: checkpoint `fw_version` <= restore.
    pub fw_version: bool,
    /// `KFD_SDMA_FW_VER_CHECK`: checkpoint `sdma_fw_version` <= restore.
    pub sdma_fw_version: bool,
    /// `KFD_CACHES_COUNT_CHECK`: checkpoint `caches_count` <= restore.
    pub caches_count: bool,
    /// `KFD_NUM_GWS_CHECK`: checkpoint `num_gws` <= restore.
    pub num_gws: bool,
    /// `KFD_VRAM_SIZE_CHECK`: checkpoint `vram_size` <= restore.
    pub vram_size: bool,
    /// `KFD_NUMA_CHECK`: keep the GPU-to-CPU (NUMA) affinity consistent.
    pub numa: bool,
    /// `KFD_CAPABILITY_CHECK`: `capability` equal.
    pub capability: bool,
}

impl Default for CompatChecks {
    fn default() -> Self {
        Self {
            fw_version: true,
            sdma_fw_version: true,
            caches_count: true,
            num_gws: true,
            vram_size: true,
            numa: true,
            capability: true,
        }
    }
}

impl CompatChecks {
    /// Names of the environment variables, in the order upstream reads them.
    pub const ENV_VARS: [&'static str; 7] = [
        "KFD_FW_VER_CHECK",
        "KFD_SDMA_FW_VER_CHECK",
        "KFD_CACHES_COUNT_CHECK",
        "KFD_NUM_GWS_CHECK",
        "KFD_VRAM_SIZE_CHECK",
        "KFD_NUMA_CHECK",
        "KFD_CAPABILITY_CHECK",
    ];

    /// Reads the switches through `lookup` (an environment lookup). `"0"` or
    /// `NO` (any case) turns a check off, `"1"` or `YES` turns it on; any
    /// other value is logged and ignored, keeping the default.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let mut checks = Self::default();
        let slots: [&mut bool; 7] = [
            &mut checks.fw_version,
            &mut checks.sdma_fw_version,
            &mut checks.caches_count,
            &mut checks.num_gws,
            &mut checks.vram_size,
            &mut checks.numa,
            &mut checks.capability,
        ];
        for (name, slot) in Self::ENV_VARS.into_iter().zip(slots) {
            if let Some(value) = lookup(name) {
                if value == "0" || value.eq_ignore_ascii_case("NO") {
                    *slot = false;
                } else if value == "1" || value.eq_ignore_ascii_case("YES") {
                    *slot = true;
                } else {
                    log::error!("ignoring invalid value for {name}={value:?}, expecting YES or NO");
                }
            }
            log::debug!("param: {name}:{}", if *slot { "Y" } else { "N" });
        }
        checks
    }

    /// [`CompatChecks::from_env`] on the process environment.
    pub fn from_process_env() -> Self {
        Self::from_env(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }
}
/// `device_properties_match`: the first property that rules `d` out for `s`.
pub(super) fn property_mismatch(s: &GpuNode, d: &GpuNode, checks: &CompatChecks) -> Option<String> {
    let exact: [(&str, u64, u64); 18] = [
        ("simd_count", s.simd_count.into(), d.simd_count.into()),
        (
            "mem_banks_count",
            s.mem_banks_count.into(),
            d.mem_banks_count.into(),
        ),
        (
            "io_links_count",
            s.io_links_count.into(),
            d.io_links_count.into(),
        ),
        (
            "max_waves_per_simd",
            s.max_waves_per_simd.into(),
            d.max_waves_per_simd.into(),
        ),
        (
            "lds_size_in_kb",
            s.lds_size_in_kb.into(),
            d.lds_size_in_kb.into(),
        ),
        (
            "wave_front_size",
            s.wave_front_size.into(),
            d.wave_front_size.into(),
        ),
        ("array_count", s.array_count.into(), d.array_count.into()),
        (
            "simd_arrays_per_engine",
            s.simd_arrays_per_engine.into(),
            d.simd_arrays_per_engine.into(),
        ),
        (
            "cu_per_simd_array",
            s.cu_per_simd_array.into(),
            d.cu_per_simd_array.into(),
        ),
        ("simd_per_cu", s.simd_per_cu.into(), d.simd_per_cu.into()),
        (
            "max_slots_scratch_cu",
            s.max_slots_scratch_cu.into(),
            d.max_slots_scratch_cu.into(),
        ),
        ("vendor_id", s.vendor_id.into(), d.vendor_id.into()),
        ("device_id", s.device_id.into(), d.device_id.into()),
        (
            "num_sdma_engines",
            s.num_sdma_engines.into(),
            d.num_sdma_engines.into(),
        ),
        (
            "num_sdma_xgmi_engines",
            s.num_sdma_xgmi_engines.into(),
            d.num_sdma_xgmi_engines.into(),
        ),
        (
            "num_sdma_queues_per_engine",
            s.num_sdma_queues_per_engine.into(),
            d.num_sdma_queues_per_engine.into(),
        ),
        (
            "num_cp_queues",
            s.num_cp_queues.into(),
            d.num_cp_queues.into(),
        ),
        ("vram_public", s.vram_public.into(), d.vram_public.into()),
    ];
    for (name, a, b) in exact {
        if a != b {
            return Some(format!("has {name} {b}, the checkpoint needs {a}"));
        }
    }
    if checks.capability && s.capability != d.capability {
        return Some(format!(
            "has capability {:#x}, the checkpoint needs {:#x} (KFD_CAPABILITY_CHECK)",
            d.capability, s.capability
        ));
    }
    let at_least: [(bool, &str, &str, u64, u64); 5] = [
        (
            checks.vram_size,
            "vram_size",
            "KFD_VRAM_SIZE_CHECK",
            s.vram_size,
            d.vram_size,
        ),
        (
            checks.num_gws,
            "num_gws",
            "KFD_NUM_GWS_CHECK",
            s.num_gws.into(),
            d.num_gws.into(),
        ),
        (
            checks.caches_count,
            "caches_count",
            "KFD_CACHES_COUNT_CHECK",
            s.caches_count.into(),
            d.caches_count.into(),
        ),
        (
            checks.fw_version,
            "fw_version",
            "KFD_FW_VER_CHECK",
            s.fw_version.into(),
            d.fw_version.into(),
        ),
        (
            checks.sdma_fw_version,
            "sdma_fw_version",
            "KFD_SDMA_FW_VER_CHECK",
            s.sdma_fw_version.into(),
            d.sdma_fw_version.into(),
        ),
    ];
    for (on, name, var, a, b) in at_least {
        if on && a > b {
            return Some(format!(
                "has {name} {b}, the checkpoint needs at least {a} ({var})"
            ));
        }
    }
    None
}
