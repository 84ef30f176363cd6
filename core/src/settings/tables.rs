//! Every settings table: the common one here, the NVIDIA side's and the AMD side's from their
//! backends' `settings/table.rs`; what looks a key up in all of them.

use super::{CPluginName, Setting, Syntax};

/// The settings of no one backend.
pub const COMMON: &[Setting] = &[Setting {
    key: "disable",
    env: "CRIU_GPU_DISABLE",
    c_plugin: CPluginName::None,
    syntax: Syntax::Text,
    default: "none",
    doc: "`cuda`, `amdgpu`: switch a side off",
    about: "Backends to switch off, comma-separated: `cuda`, `amdgpu`. With `cuda` off, a restore still asks the driver (where there is one) about every restored task, and fails, ending the restored tree, when one is a CUDA process left checkpointed or locked.",
}];

/// Every table: the common settings, then the NVIDIA side's, then the AMD side's.
pub fn tables() -> [&'static [Setting]; 3] {
    [
        COMMON,
        crate::cuda::settings::table::SETTINGS,
        crate::amdgpu::settings::table::SETTINGS,
    ]
}

/// Every setting, in table order.
pub fn all() -> impl Iterator<Item = &'static Setting> {
    tables().into_iter().flatten()
}

/// The setting of `key`, if there is one.
pub fn find(key: &str) -> Option<&'static Setting> {
    all().find(|s| s.key == key)
}

/// The setting a `cuda_plugin.NAME` option stands for, and whether its value is in seconds.
pub fn find_c_option(name: &str) -> Option<(&'static Setting, bool)> {
    all().find_map(|s| match s.c_plugin {
        CPluginName::Option(n) if n == name => Some((s, false)),
        CPluginName::OptionSeconds(n) if n == name => Some((s, true)),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::env_name;

    #[test]
    fn every_key_is_once_in_the_tables_with_its_environment_name() {
        let mut keys: Vec<&str> = all().map(|s| s.key).collect();
        let n = keys.len();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), n, "a key is listed twice");
        for s in all() {
            assert_eq!(s.env, env_name(s.key), "{}", s.key);
            assert!(!s.doc.is_empty() && !s.default.is_empty(), "{}", s.key);
        }
        assert_eq!(
            find_c_option("timeout").map(|(s, secs)| (s.key, secs)),
            Some(("cuda.lock-timeout-ms", true))
        );
        assert_eq!(find("cuda.parallel").map(|s| s.syntax), Some(Syntax::Bool));
        assert!(find("amdgpu.copy-thread").is_none());
    }
}
