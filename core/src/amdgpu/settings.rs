//! The AMD backend's settings: their table (`amdgpu.*` keys, with the variables of CRIU's C
//! plugin, `KFD_MAX_BUFFER_SIZE` and `KFD_*_CHECK`, which keep working), and their values read
//! from [`crate::config::Config`], which applies the precedence of every setting.

use std::path::PathBuf;

use super::topology::{CompatChecks, DEFAULT_SYSFS_ROOT};
use crate::config::Config;
pub use crate::settings::parse_size;
use crate::settings::{CPluginName, SettingError, ValueError, parse_switch};

pub mod table;
pub use table::SETTINGS;

/// Default staging memory (all copy threads together).
pub const DEFAULT_STAGING_BYTES: u64 = 256 << 20;
/// Most copy threads by default (the default is the number of CPUs, 2 to this).
pub const DEFAULT_MAX_COPY_THREADS: usize = 8;
/// Default piece size.
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;
/// Smallest piece size and staging budget honoured (one page).
pub const MIN_CHUNK_BYTES: usize = 4096;
/// Most copy threads accepted.
pub const MAX_COPY_THREADS: usize = 64;

/// The AMD backend's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmdgpuSettings {
    /// KFD sysfs topology root.
    pub topology_root: PathBuf,
    /// Staging memory for BO copies, in bytes (all threads together).
    pub staging_bytes: u64,
    /// Copy threads.
    pub copy_threads: usize,
    /// Largest piece of a BO moved at once.
    pub chunk_bytes: usize,
    /// Restore BO contents in CRIU's main process where the host allows.
    pub parallel_restore: bool,
    /// GPU compatibility checks for the restore mapping.
    pub checks: CompatChecks,
}

impl Default for AmdgpuSettings {
    fn default() -> Self {
        Self {
            topology_root: PathBuf::from(DEFAULT_SYSFS_ROOT),
            staging_bytes: DEFAULT_STAGING_BYTES,
            copy_threads: default_copy_threads(),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            parallel_restore: false,
            checks: CompatChecks::default(),
        }
    }
}

/// One copy thread per CPU, at least 2 (so that device and file work overlap) and at most
/// [`DEFAULT_MAX_COPY_THREADS`]: the copies are CPU work on the file side, and more threads
/// than CPUs only contend (measured).
pub fn default_copy_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, DEFAULT_MAX_COPY_THREADS)
}

impl AmdgpuSettings {
    /// Reads the settings from `cfg`, with the environment `env` applied over it
    /// ([`Config::apply_env`]; pass `|_| None` to add nothing); the first bad value is an error.
    pub fn from_config(
        cfg: &Config,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingError> {
        let (s, errors) = Self::from_config_lenient(cfg, env);
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(s),
        }
    }

    /// Reads the settings like [`Self::from_config`], but a bad value keeps its default and is
    /// returned among the errors, so that a typo in an AMD setting fails only a run that
    /// needs an AMD GPU. A bad value of a C plugin's variable (`KFD_MAX_BUFFER_SIZE`,
    /// `KFD_*_CHECK`) is ignored, as the C plugin ignores it, and is not among the errors.
    pub fn from_config_lenient(
        cfg: &Config,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> (Self, Vec<SettingError>) {
        let cfg = cfg.with_env(env);
        let mut errors = Vec::new();
        let mut s = AmdgpuSettings::default();
        if let Some(v) = cfg.get("amdgpu.topology") {
            s.topology_root = PathBuf::from(v);
        }
        if let Some(v) = cfg.get("amdgpu.max-buffer-size") {
            match parse_size(v) {
                // 0 means "no limit" for the C plugin; here it keeps the default bound.
                Ok(0) => s.staging_bytes = DEFAULT_STAGING_BYTES,
                Ok(n) => s.staging_bytes = n.max(MIN_CHUNK_BYTES as u64),
                Err(source) => errors.push(SettingError::Key {
                    key: "amdgpu.max-buffer-size",
                    source,
                }),
            }
        }
        if let Some(v) = cfg.get("amdgpu.copy-threads") {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_COPY_THREADS).contains(&n) => s.copy_threads = n,
                Ok(n) => errors.push(SettingError::Value {
                    quoted: format!("amdgpu.copy-threads = {n}"),
                    source: ValueError::OutOfRange {
                        min: 1,
                        max: MAX_COPY_THREADS as u64,
                    },
                }),
                Err(_) => errors.push(SettingError::Value {
                    quoted: format!("amdgpu.copy-threads = {}", crate::settings::shown(v)),
                    source: ValueError::Expected("a whole number"),
                }),
            }
        }
        if let Some(v) = cfg.get("amdgpu.chunk-size") {
            let n = parse_size(v).and_then(|n| {
                usize::try_from(n)
                    .map_err(|_| ValueError::TooLarge(format!("amdgpu.chunk-size = {v}")))
            });
            match n {
                Ok(n) => s.chunk_bytes = n.max(MIN_CHUNK_BYTES),
                Err(source) => errors.push(SettingError::Key {
                    key: "amdgpu.chunk-size",
                    source,
                }),
            }
        }
        match cfg.get_bool("amdgpu.parallel-restore", false) {
            Ok(b) => s.parallel_restore = b,
            Err(e) => errors.push(e),
        }
        // Each check by its key, as the other settings: a bad value is named with where it
        // came from and fails only a run that needs an AMD GPU. CompatChecks sees good values
        // only.
        let mut switches = std::collections::BTreeMap::new();
        for name in CompatChecks::ENV_VARS {
            let Some(setting) = SETTINGS
                .iter()
                .find(|s| s.c_plugin == CPluginName::Env(name))
            else {
                continue;
            };
            let Some(v) = cfg.get(setting.key) else {
                continue;
            };
            match parse_switch(v) {
                Ok(_) => {
                    switches.insert(name, v.trim().to_string());
                }
                Err(source) => errors.push(SettingError::Value {
                    quoted: format!(
                        "{} = {} ({})",
                        setting.key,
                        crate::settings::shown(v),
                        cfg.describe_origin(setting.key)
                    ),
                    source,
                }),
            }
        }
        s.checks = CompatChecks::from_env(|name| switches.get(name).cloned());
        (s, errors)
    }

    /// The piece size and the number of copy threads for a copy: every thread has one
    /// staging buffer of one piece; pieces are page multiples, at most `chunk_bytes` and no
    /// larger than the largest BO; all buffers together stay within `staging_bytes` (fewer
    /// threads, then smaller pieces, down to one page, when the budget is small).
    pub fn staging_plan(&self, largest_bo: u64) -> (usize, usize) {
        let page = MIN_CHUNK_BYTES as u64;
        let budget = self.staging_bytes.max(page);
        let largest = largest_bo.div_ceil(page).max(1) * page;
        let threads = (self.copy_threads.max(1) as u64).min(budget / page);
        let per_thread = budget / threads;
        let mut chunk = (self.chunk_bytes as u64).min(largest).min(per_thread);
        chunk = (chunk / page).max(1) * page;
        (chunk as usize, threads as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_the_c_plugin() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0x1000"), Ok(4096));
        assert_eq!(parse_size("010"), Ok(8));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("0"), Ok(0));
        assert!(parse_size("2T").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("17179869184G").is_err());
    }

    #[test]
    fn settings_come_from_file_then_legacy_env_then_our_env() {
        let cfg = Config::parse(
            "amdgpu.topology = /tmp/topo\namdgpu.max-buffer-size = 64M\namdgpu.copy-threads = 2\namdgpu.kfd-numa-check = no\n",
        );
        let s = AmdgpuSettings::from_config(&cfg, &|_| None).unwrap();
        assert_eq!(s.topology_root, PathBuf::from("/tmp/topo"));
        assert_eq!(s.staging_bytes, 64 << 20);
        assert_eq!(s.copy_threads, 2);
        assert!(!s.checks.numa && s.checks.fw_version);

        let env = |k: &str| match k {
            "KFD_MAX_BUFFER_SIZE" => Some("1G".to_string()),
            "KFD_FW_VER_CHECK" => Some("NO".to_string()),
            _ => None,
        };
        let s = AmdgpuSettings::from_config(&cfg, &env).unwrap();
        assert_eq!(s.staging_bytes, 1 << 30);
        assert!(!s.checks.fw_version);

        let env2 = |k: &str| match k {
            "KFD_MAX_BUFFER_SIZE" => Some("1G".to_string()),
            "CRIU_GPU_AMDGPU_MAX_BUFFER_SIZE" => Some("8M".to_string()),
            _ => None,
        };
        let s = AmdgpuSettings::from_config(&cfg, &env2).unwrap();
        assert_eq!(s.staging_bytes, 8 << 20);

        let bad = Config::parse("amdgpu.copy-threads = 0\n");
        assert!(AmdgpuSettings::from_config(&bad, &|_| None).is_err());
        let bad = Config::parse("amdgpu.max-buffer-size = lots\n");
        assert!(AmdgpuSettings::from_config(&bad, &|_| None).is_err());
    }

    #[test]
    fn bad_check_values_name_their_key_and_origin() {
        let cfg = Config::parse("amdgpu.kfd-fw-ver-check = maybe\namdgpu.kfd-numa-check = No\n");
        let (s, errors) = AmdgpuSettings::from_config_lenient(&cfg, &|_| None);
        assert_eq!(
            errors,
            [
                "amdgpu.kfd-fw-ver-check = maybe (line 1 of the settings): expected yes or no (or 1 or 0)"
            ]
        );
        assert!(s.checks.fw_version && !s.checks.numa);
        let env = |k: &str| match k {
            "CRIU_GPU_AMDGPU_KFD_VRAM_SIZE_CHECK" => Some("sure".to_string()),
            "KFD_CAPABILITY_CHECK" => Some("perhaps".to_string()),
            "KFD_NUM_GWS_CHECK" => Some(" 0 ".to_string()),
            _ => None,
        };
        let (s, errors) = AmdgpuSettings::from_config_lenient(&Config::default(), &env);
        // The C plugin's own variable is ignored as it ignores it; ours is an error.
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].to_string().starts_with(
            "amdgpu.kfd-vram-size-check = sure (environment CRIU_GPU_AMDGPU_KFD_VRAM_SIZE_CHECK)"
        ));
        assert!(s.checks.capability && s.checks.vram_size && !s.checks.num_gws);
        let long = Config::parse(&format!("amdgpu.kfd-numa-check = {}\n", "x".repeat(60_000)));
        let (_, errors) = AmdgpuSettings::from_config_lenient(&long, &|_| None);
        assert!(
            errors[0].to_string().len() < 400 && errors[0].to_string().contains("(60000 bytes)"),
            "{errors:?}"
        );
    }

    #[test]
    fn a_bad_c_plugin_variable_is_ignored_for_every_key_and_the_file_is_used() {
        let cfg = Config::parse("amdgpu.kfd-numa-check = no\namdgpu.max-buffer-size = 8M\n");
        let env = |k: &str| match k {
            "KFD_NUMA_CHECK" => Some("perhaps".to_string()),
            "KFD_MAX_BUFFER_SIZE" => Some("lots".to_string()),
            "KFD_FW_VER_CHECK" => Some("0".to_string()),
            _ => None,
        };
        let (s, errors) = AmdgpuSettings::from_config_lenient(&cfg, &env);
        assert!(errors.is_empty(), "{errors:?}");
        assert!(!s.checks.numa && !s.checks.fw_version);
        assert_eq!(s.staging_bytes, 8 << 20);
        let with_env = cfg.with_env(&env);
        assert_eq!(with_env.warnings.len(), 2, "{:?}", with_env.warnings);
        assert!(with_env.warnings[0].starts_with(
            "KFD_MAX_BUFFER_SIZE = lots (environment KFD_MAX_BUFFER_SIZE, CRIU's C plugin's variable): "
        ));
        assert_eq!(
            with_env.describe_origin("amdgpu.kfd-fw-ver-check"),
            "environment KFD_FW_VER_CHECK, CRIU's C plugin's variable"
        );
    }

    #[test]
    fn plugin_options_win_over_every_environment_variable() {
        let mut cfg = Config::parse("amdgpu.copy-threads = 2\n");
        cfg.apply_options(&criu_plugin::options::parse_entries([
            b"--gpu_plugin.amdgpu.copy-threads=3".as_slice(),
            b"--gpu_plugin.amdgpu.max-buffer-size=16M",
            b"--gpu_plugin.amdgpu.kfd-fw-ver-check=yes",
        ]));
        let env = |k: &str| match k {
            "CRIU_GPU_AMDGPU_COPY_THREADS" => Some("4".to_string()),
            "KFD_MAX_BUFFER_SIZE" => Some("1G".to_string()),
            "CRIU_GPU_AMDGPU_MAX_BUFFER_SIZE" => Some("8M".to_string()),
            "KFD_FW_VER_CHECK" => Some("NO".to_string()),
            _ => None,
        };
        let s = AmdgpuSettings::from_config(&cfg, &env).unwrap();
        assert_eq!(s.copy_threads, 3);
        assert_eq!(s.staging_bytes, 16 << 20);
        assert!(s.checks.fw_version);
    }

    #[test]
    fn staging_stays_within_the_budget() {
        let mut s = AmdgpuSettings {
            staging_bytes: 64 << 20,
            copy_threads: 4,
            chunk_bytes: 4 << 20,
            ..Default::default()
        };
        assert_eq!(s.staging_plan(1 << 30), (4 << 20, 4));
        // Small BOs: pieces no larger than the largest BO.
        assert_eq!(s.staging_plan(10_000), (12288, 4));
        // A tiny budget: one page-sized buffer.
        s.staging_bytes = 4096;
        assert_eq!(s.staging_plan(1 << 30), (4096, 1));
        s.staging_bytes = 3 * 4096;
        assert_eq!(s.staging_plan(1 << 30), (4096, 3));
        s.staging_bytes = 6 << 20;
        let (chunk, n) = s.staging_plan(1 << 30);
        assert_eq!(n, 4);
        assert!(chunk as u64 * n as u64 <= 6 << 20);
    }
}
