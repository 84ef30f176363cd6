//! The AMD backend's settings: `amdgpu.*` keys of the plugin's settings file, the
//! `CRIU_GPU_AMDGPU_*` environment overrides, and the environment variables of CRIU's C
//! plugin (`KFD_MAX_BUFFER_SIZE`, `KFD_*_CHECK`), which keep working.
//!
//! | key | C plugin variable | meaning | default |
//! |---|---|---|---|
//! | `amdgpu.topology` | — | KFD sysfs topology root | `/sys/class/kfd/kfd/topology` |
//! | `amdgpu.max-buffer-size` | `KFD_MAX_BUFFER_SIZE` | staging memory for BO copies, all copy threads together (`K`/`M`/`G` suffixes, `0x` hex) | 256 MiB |
//! | `amdgpu.copy-threads` | — | copy threads (each moves pieces device ↔ host ↔ file) | CPUs, 2 to 8 |
//! | `amdgpu.chunk-size` | — | largest piece of a BO moved at once | 4 MiB |
//! | `amdgpu.parallel-restore` | — | restored tasks hand their BO copies to CRIU's main process, which does them at `RESUME_DEVICES_LATE` (CRIU 4.2 and later); off, each task copies its own while CRIU restores the others | false |
//! | `amdgpu.kfd-fw-ver-check` ... | `KFD_FW_VER_CHECK` ... | the seven GPU compatibility checks at restore | on |
//!
//! Precedence: `CRIU_GPU_AMDGPU_<KEY>` environment, then the C plugin's variable, then the
//! settings file, then the default. Container runtimes strip the environment, so the file is
//! the dependable place.

use std::path::PathBuf;

use super::topology::{CompatChecks, DEFAULT_SYSFS_ROOT};
use crate::config::{Config, env_name};

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

/// Parses a size the way the C plugin parses `KFD_MAX_BUFFER_SIZE` (`strtoul` base 0:
/// decimal, `0x` hex, leading-zero octal) with an optional `K`, `M` or `G` suffix (binary
/// units; lower case is accepted too). Overflow is an error.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, shift) = match t.as_bytes().last() {
        Some(b'K' | b'k') => (&t[..t.len() - 1], 10),
        Some(b'M' | b'm') => (&t[..t.len() - 1], 20),
        Some(b'G' | b'g') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let bad = || {
        format!(
            "{:?} is not a size (e.g. 268435456, 0x10000000, 256M, 2G)",
            crate::config::shown(text)
        )
    };
    let value = if let Some(hex) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        u64::from_str_radix(hex, 16).map_err(|_| bad())?
    } else if digits.len() > 1 && digits.starts_with('0') {
        u64::from_str_radix(&digits[1..], 8).map_err(|_| bad())?
    } else {
        digits.parse::<u64>().map_err(|_| bad())?
    };
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} overflows 64 bits"))
}

/// A check switch as CRIU's C plugin reads `KFD_*_CHECK` (`0`/`no` off, `1`/`yes` on, any
/// case), `None` for anything else.
fn switch_value(v: &str) -> Option<bool> {
    match v.trim() {
        "0" => Some(false),
        "1" => Some(true),
        t if t.eq_ignore_ascii_case("no") => Some(false),
        t if t.eq_ignore_ascii_case("yes") => Some(true),
        _ => None,
    }
}

impl AmdgpuSettings {
    /// Reads the settings from `cfg`, with environment overrides looked up through `env`
    /// (pass `|_| None` to ignore the environment); the first bad value is an error.
    pub fn from_config(cfg: &Config, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, String> {
        let (s, errors) = Self::from_config_lenient(cfg, env);
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(s),
        }
    }

    /// Reads the settings like [`Self::from_config`], but a bad value keeps its default and is
    /// returned among the errors, so that a typo in an AMD setting fails only a run that
    /// needs an AMD GPU. A bad `KFD_MAX_BUFFER_SIZE` (CRIU's C plugin's variable) is warned
    /// about and ignored, as the C plugin does, and is not among the errors.
    pub fn from_config_lenient(
        cfg: &Config,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> (Self, Vec<String>) {
        // A plugin option (CRIU 4.3) wins over every environment variable, ours or the C
        // plugin's; the environment wins over the file.
        let option = |key: &str| cfg.option_value(key).map(str::to_string);
        let ours_env = |key: &str| option(key).or_else(|| env(&env_name(key)));
        let file = |key: &str| cfg.get(key).map(str::to_string);
        let ours = |key: &str| ours_env(key).or_else(|| file(key));
        let mut errors = Vec::new();
        let mut s = AmdgpuSettings::default();
        if let Some(v) = ours("amdgpu.topology") {
            s.topology_root = PathBuf::from(v);
        }
        let size = |v: &str| -> Result<u64, String> {
            let n = parse_size(v)?;
            // 0 means "no limit" for the C plugin; here it keeps the default bound.
            Ok(if n == 0 {
                DEFAULT_STAGING_BYTES
            } else {
                n.max(MIN_CHUNK_BYTES as u64)
            })
        };
        // Precedence: our variable, then the C plugin's, then the file. A bad value of the C
        // plugin's variable is ignored, as the C plugin does.
        let legacy = env("KFD_MAX_BUFFER_SIZE");
        if let Some(v) = ours_env("amdgpu.max-buffer-size") {
            match size(&v) {
                Ok(n) => s.staging_bytes = n,
                Err(e) => errors.push(format!("amdgpu.max-buffer-size: {e}")),
            }
        } else if let Some(n) = legacy.as_deref().and_then(|v| {
            size(v)
                .map_err(|e| {
                    log::warn!("amdgpu: KFD_MAX_BUFFER_SIZE: {e}; ignored, as CRIU's C plugin does")
                })
                .ok()
        }) {
            s.staging_bytes = n;
        } else if let Some(v) = file("amdgpu.max-buffer-size") {
            match size(&v) {
                Ok(n) => s.staging_bytes = n,
                Err(e) => errors.push(format!("amdgpu.max-buffer-size: {e}")),
            }
        }
        if let Some(v) = ours("amdgpu.copy-threads") {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_COPY_THREADS).contains(&n) => s.copy_threads = n,
                Ok(n) => errors.push(format!(
                    "amdgpu.copy-threads = {n}: expected 1 to {MAX_COPY_THREADS}"
                )),
                Err(_) => errors.push(format!(
                    "amdgpu.copy-threads = {}: expected a whole number",
                    crate::config::shown(&v)
                )),
            }
        }
        if let Some(v) = ours("amdgpu.chunk-size") {
            match parse_size(&v).and_then(|n| {
                usize::try_from(n).map_err(|_| format!("amdgpu.chunk-size = {v}: too large"))
            }) {
                Ok(n) => s.chunk_bytes = n.max(MIN_CHUNK_BYTES),
                Err(e) => errors.push(format!("amdgpu.chunk-size: {e}")),
            }
        }
        if let Some(v) = ours("amdgpu.parallel-restore") {
            let mut c = Config::default();
            c.set("amdgpu.parallel-restore", &v);
            match c.get_bool("amdgpu.parallel-restore", false) {
                Ok(b) => s.parallel_restore = b,
                Err(e) => errors.push(e),
            }
        }
        // Each check by its key, as the other settings: a bad value is named with where it
        // came from and fails only a run that needs an AMD GPU. CompatChecks sees good values
        // only.
        let mut switches = std::collections::BTreeMap::new();
        for name in CompatChecks::ENV_VARS {
            let key = format!("amdgpu.{}", name.to_ascii_lowercase().replace('_', "-"));
            let found = if let Some(v) = option(&key) {
                Some((v, cfg.describe_origin(&key)))
            } else if let Some(v) = env(&env_name(&key)) {
                Some((v, format!("environment {}", env_name(&key))))
            } else if let Some(v) = env(name) {
                Some((v, format!("environment {name}, CRIU's C plugin's variable")))
            } else {
                file(&key).map(|v| (v, cfg.describe_origin(&key)))
            };
            let Some((v, origin)) = found else {
                continue;
            };
            if switch_value(&v).is_some() {
                switches.insert(name, v.trim().to_string());
            } else if origin.starts_with("environment KFD_") {
                // As the C plugin does with its own variables: ignored, keeping the default.
                log::warn!(
                    "amdgpu: {name} = {} ({origin}) is not yes or no: ignored, the check stays on",
                    crate::config::shown(&v)
                );
            } else {
                errors.push(format!(
                    "{key} = {} ({origin}): expected yes or no (or 1 or 0)",
                    crate::config::shown(&v)
                ));
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
        assert!(errors[0].starts_with(
            "amdgpu.kfd-vram-size-check = sure (environment CRIU_GPU_AMDGPU_KFD_VRAM_SIZE_CHECK)"
        ));
        assert!(s.checks.capability && s.checks.vram_size && !s.checks.num_gws);
        let long = Config::parse(&format!("amdgpu.kfd-numa-check = {}\n", "x".repeat(60_000)));
        let (_, errors) = AmdgpuSettings::from_config_lenient(&long, &|_| None);
        assert!(
            errors[0].len() < 400 && errors[0].contains("(60000 bytes)"),
            "{errors:?}"
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
