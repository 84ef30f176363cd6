//! The seven `KFD_*_CHECK` switches and the property comparison of a
//! checkpointed GPU with a restore GPU (upstream `device_properties_match`).

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
/// A `KFD_*_CHECK` switch, as a property rule refers to it.
#[derive(Clone, Copy)]
pub(super) struct Switch {
    /// The environment variable, named in mismatch messages.
    pub env_var: &'static str,
    /// Whether the check is on.
    pub on: fn(&CompatChecks) -> bool,
}

/// How a restore GPU's value of a property is compared with the
/// checkpoint's.
#[derive(Clone, Copy)]
pub(super) enum Rule {
    /// Must be equal.
    Equal,
    /// A bit mask that must be equal while the switch is on.
    SameBits(Switch),
    /// Restore must have at least the checkpoint's value while the switch is on.
    AtLeast(Switch),
    /// Recorded, not compared.
    Ignored,
}
