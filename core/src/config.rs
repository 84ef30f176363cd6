//! The plugin's settings: a configuration file, environment overrides and CRIU 4.3's plugin
//! options.
//!
//! Before CRIU 4.3 a container runtime cannot pass a plugin anything through CRIU's RPC, and
//! Podman and CRI-O strip the environment of the runtime they start, so environment variables
//! alone would not reach CRIU there. The plugin therefore reads its own file,
//! `/etc/criu/gpu-plugin.conf` (another path through `CRIU_GPU_PLUGIN_CONFIG`), which every
//! CRIU invocation on the host sees. Environment variables override the file where they do
//! reach CRIU: a key `cuda.device-map` is overridden by `CRIU_GPU_CUDA_DEVICE_MAP`. From CRIU
//! 4.3, plugin options override both: `--plugin-option gpu_plugin.KEY=VALUE` for every key
//! below, from CRIU's command line, its configuration files or an RPC request (how a runtime
//! hands over a GPU map per restore). The C cuda plugin's options are understood too, so a
//! runtime set up for it works unchanged: `cuda_plugin.device-map` is `cuda.device-map`,
//! `cuda_plugin.timeout` (seconds) is `cuda.lock-timeout-ms`, `cuda_plugin.backend` is
//! `cuda.backend`. Other plugins' options are skipped; an unknown `gpu_plugin.*` name is warned
//! about. Every value remembers where it came from, for errors and for the INFO line that lists
//! the settings in force.
//!
//! Format: one `key = value` per line; `#` starts a comment; unknown keys are warned about and
//! ignored so that newer files work with older plugins, and a repeated key keeps its last value,
//! with a warning. The file is read with a size bound, without blocking, and only if regular.
//!
//! Every key, its environment variable, its C plugin name, its default and its documentation
//! are in the settings tables of [`crate::settings`]; this module applies them in the order
//! above ([`Config::apply_env`], [`Config::apply_options`]), for both backends. CRIU's C amdgpu
//! plugin's variables (`KFD_MAX_BUFFER_SIZE`, `KFD_*_CHECK`) come below this plugin's own and
//! above the file; a bad value of one is warned about and ignored, as the C plugin ignores it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use crate::settings::CUDA_PLUGIN_NAMESPACE;
use crate::settings::{CPluginName, SettingError, ValueError, shown};

/// Default location of the configuration file.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/criu/gpu-plugin.conf";

/// Environment variable naming another configuration file.
pub const CONFIG_PATH_ENV: &str = "CRIU_GPU_PLUGIN_CONFIG";

/// Longest configuration file read; anything beyond is an error, not a truncation.
const MAX_CONFIG_BYTES: u64 = 64 * 1024;

/// Problems of a settings file reported one by one; past this, only how many more.
const MAX_WARNINGS: usize = 8;

/// Where a setting's value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A line of the settings file ([`Config::source`]).
    File(usize),
    /// An environment variable.
    Env(String),
    /// An environment variable of CRIU's C plugin.
    CPluginEnv(String),
    /// A CRIU plugin option, by name (`gpu_plugin.cuda.device-map`).
    PluginOption(String),
    /// Set by the program itself (tests and tools).
    Program,
}

/// Why the settings file cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Its bytes are not text.
    #[error("cannot read {}: it is not UTF-8 text", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
    },
    /// Opening or reading it failed (not a regular file, too large, no permission...).
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Parsed settings: raw strings by key, each with where it came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    values: BTreeMap<String, (String, Origin)>,
    /// Where the file was read from, if one was.
    pub source: Option<PathBuf>,
    /// Problems found while reading (unknown keys, bad lines), logged by the caller; at most
    /// eight and a count of the rest.
    pub warnings: Vec<String>,
    /// Facts worth a line at INFO (no file, an empty file, an environment value ignored).
    pub notes: Vec<String>,
    /// Why the settings file could not be read (the plugin then runs on defaults only to
    /// refuse what needs a GPU), `None` when it was read or is absent.
    pub unreadable: Option<String>,
}

/// The plugin-option namespace of this plugin (`--plugin-option gpu_plugin.KEY=VALUE`).
pub const OPTION_NAMESPACE: &str = "gpu_plugin";

impl Config {
    /// Parses configuration text.
    pub fn parse(text: &str) -> Config {
        let mut cfg = Config::default();
        let mut problems = Vec::new();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        // Editors on some systems start a UTF-8 file with a byte-order mark.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let Some((k, v)) = line.split_once('=') else {
                problems.push(format!("line {}: expected `key = value`, ignored", n + 1));
                continue;
            };
            let (k, v) = (k.trim(), v.trim());
            if crate::settings::tables::find(k).is_none() {
                problems.push(format!("line {}: unknown key {k:?}, ignored", n + 1));
                continue;
            }
            if let Some(first) = seen.insert(k.to_string(), n + 1) {
                problems.push(format!(
                    "line {}: {k} set again (line {first} too); the later value is used",
                    n + 1
                ));
            }
            cfg.values
                .insert(k.to_string(), (v.to_string(), Origin::File(n + 1)));
        }
        let more = problems.len().saturating_sub(MAX_WARNINGS);
        problems.truncate(MAX_WARNINGS);
        if more > 0 {
            problems.push(format!("and {more} more lines with problems"));
        }
        cfg.warnings = problems;
        cfg
    }

    /// Reads the file at `path` (missing is fine: empty settings), then applies overrides from
    /// `env` (a lookup, so tests need not touch the process environment).
    pub fn load(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        // Never a blocking open: a FIFO in place of the file would hang every CRIU run.
        let mut cfg = match criu_plugin::files::read_regular(None, path, false, MAX_CONFIG_BYTES) {
            Ok(bytes) => {
                let text = String::from_utf8(bytes).map_err(|_| ConfigError::NotUtf8 {
                    path: path.to_path_buf(),
                })?;
                let mut c = Config::parse(&text);
                if text.trim().is_empty() {
                    c.notes
                        .push(format!("{} is empty: defaults", path.display()));
                }
                c.source = Some(path.to_path_buf());
                c
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut c = Config::default();
                let dangling = std::fs::symlink_metadata(path).is_ok();
                c.notes.push(format!(
                    "no settings file {}{}: defaults",
                    path.display(),
                    if dangling {
                        " (a symbolic link to nothing)"
                    } else {
                        ""
                    }
                ));
                c
            }
            Err(source) => {
                return Err(ConfigError::Unreadable {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        cfg.apply_env(env);
        Ok(cfg)
    }

    /// Applies the environment over the file, for every setting of the tables: its own
    /// variable (`CRIU_GPU_...`), else the C plugin's where it has one. A bad value of a C
    /// plugin's variable is added to [`Config::warnings`] and ignored, as the C plugin ignores
    /// it. A value a plugin option set stays: options come last and win.
    pub fn apply_env(&mut self, env: &dyn Fn(&str) -> Option<String>) {
        for s in crate::settings::tables::all() {
            if matches!(self.origin(s.key), Some(Origin::PluginOption(_))) {
                continue;
            }
            if let Some(v) = env(s.env) {
                self.values
                    .insert(s.key.to_string(), (v, Origin::Env(s.env.to_string())));
                continue;
            }
            let CPluginName::Env(name) = s.c_plugin else {
                continue;
            };
            let Some(v) = env(name) else {
                continue;
            };
            match s.syntax.check(&v) {
                Ok(()) => {
                    self.values
                        .insert(s.key.to_string(), (v, Origin::CPluginEnv(name.to_string())));
                }
                Err(e) => self.warnings.push(format!(
                    "{name} = {} (environment {name}, CRIU's C plugin's variable): {e}; ignored, as CRIU's C plugin does",
                    shown(&v)
                )),
            }
        }
    }

    /// A copy with the environment `env` applied ([`Config::apply_env`]).
    pub fn with_env(&self, env: &dyn Fn(&str) -> Option<String>) -> Config {
        let mut c = self.clone();
        c.apply_env(env);
        c
    }

    /// Loads from the default place (or `CRIU_GPU_PLUGIN_CONFIG`) with the process environment.
    pub fn from_process() -> Result<Config, ConfigError> {
        let ignored = std::cell::RefCell::new(Vec::new());
        let env = |k: &str| match std::env::var(k) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotUnicode(_)) => {
                ignored.borrow_mut().push(k.to_string());
                None
            }
            Err(std::env::VarError::NotPresent) => None,
        };
        let path = env(CONFIG_PATH_ENV).unwrap_or_else(|| DEFAULT_CONFIG_PATH.to_string());
        let mut cfg = Config::load(Path::new(&path), &env)?;
        for k in ignored.into_inner() {
            cfg.notes
                .push(format!("environment variable {k} is not UTF-8: ignored"));
        }
        Ok(cfg)
    }

    /// Applies CRIU's plugin options over the file and the environment: this plugin's own
    /// (`gpu_plugin.KEY`), and the C cuda plugin's that mean the same. A bare flag means
    /// `true`. Problems are added to [`Config::warnings`].
    pub fn apply_options(&mut self, options: &criu_plugin::options::Options) {
        for w in &options.warnings {
            self.warnings.push(format!("plugin options: {w}"));
        }
        for o in &options.all {
            let given = format!("{}.{}", o.plugin, o.name);
            let value = o.value.clone().unwrap_or_else(|| "true".to_string());
            let key = match o.plugin.as_str() {
                OPTION_NAMESPACE => {
                    let k = o.name.as_str();
                    if crate::settings::tables::find(k).is_none() {
                        self.warnings.push(format!(
                            "unknown plugin option {OPTION_NAMESPACE}.{k}, ignored"
                        ));
                        continue;
                    }
                    k.to_string()
                }
                CUDA_PLUGIN_NAMESPACE => match crate::settings::tables::find_c_option(&o.name) {
                    Some((setting, false)) => setting.key.to_string(),
                    Some((setting, true)) => {
                        // Seconds there, milliseconds here; a value that is not a whole
                        // number is kept as given, so that its error names it.
                        let ms = value
                            .trim()
                            .parse::<u64>()
                            .ok()
                            .and_then(|s| s.checked_mul(1000));
                        let value = ms.map_or(value, |ms| ms.to_string());
                        self.values.insert(
                            setting.key.to_string(),
                            (value, Origin::PluginOption(given)),
                        );
                        continue;
                    }
                    None => {
                        self.notes.push(format!(
                            "plugin option {CUDA_PLUGIN_NAMESPACE}.{} means nothing to this plugin: ignored",
                            o.name
                        ));
                        continue;
                    }
                },
                _ => continue,
            };
            self.values
                .insert(key, (value, Origin::PluginOption(given)));
        }
    }

    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(|(v, _)| v.as_str())
    }

    /// Where the value of `key` came from.
    pub fn origin(&self, key: &str) -> Option<&Origin> {
        self.values.get(key).map(|(_, o)| o)
    }

    /// The value of `key` if a plugin option set it (settings that apply environment variables
    /// of their own let an option override those).
    pub fn option_value(&self, key: &str) -> Option<&str> {
        match self.values.get(key) {
            Some((v, Origin::PluginOption(_))) => Some(v),
            _ => None,
        }
    }

    /// Where `key`'s value came from, in words (`line 3 of /etc/criu/gpu-plugin.conf`).
    pub fn describe_origin(&self, key: &str) -> String {
        match self.origin(key) {
            Some(Origin::File(line)) => match &self.source {
                Some(p) => format!("line {line} of {}", p.display()),
                None => format!("line {line} of the settings"),
            },
            Some(Origin::Env(name)) => format!("environment {name}"),
            Some(Origin::CPluginEnv(name)) => {
                format!("environment {name}, CRIU's C plugin's variable")
            }
            Some(Origin::PluginOption(o)) => format!("plugin option {o}"),
            Some(Origin::Program) => "set by the program".to_string(),
            None => "default".to_string(),
        }
    }

    /// One line naming every setting that is not at its default and where it came from, in
    /// the order of the settings tables, or `None` when all are at their defaults.
    pub fn summary(&self) -> Option<String> {
        let items: Vec<String> = crate::settings::tables::all()
            .filter_map(|s| {
                let v = self.get(s.key)?;
                Some(format!(
                    "{}={} ({})",
                    s.key,
                    shown(v),
                    self.describe_origin(s.key)
                ))
            })
            .collect();
        (!items.is_empty()).then(|| items.join(", "))
    }

    /// Sets a value (tests and tools).
    pub fn set(&mut self, key: &str, value: &str) {
        self.values
            .insert(key.to_string(), (value.to_string(), Origin::Program));
    }

    /// `key = value (where from)`, for error messages.
    pub fn quote(&self, key: &str, v: &str) -> String {
        let v = shown(v);
        match self.origin(key) {
            Some(Origin::File(_)) | Some(Origin::Program) | None => format!("{key} = {v}"),
            Some(_) => format!("{key} = {v} ({})", self.describe_origin(key)),
        }
    }

    /// A boolean setting (`true/false`, `yes/no`, `1/0`, `on/off`).
    pub fn get_bool(&self, key: &str, default: bool) -> Result<bool, SettingError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => crate::settings::parse_bool(v).map_err(|source| SettingError::Value {
                quoted: self.quote(key, v),
                source,
            }),
        }
    }

    /// An unsigned number setting.
    pub fn get_u64(&self, key: &str, default: u64) -> Result<u64, SettingError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| SettingError::Value {
                quoted: self.quote(key, v),
                source: ValueError::Expected("a whole number"),
            }),
        }
    }

    /// Whether backend `name` was switched off with `disable`.
    pub fn is_disabled(&self, name: &str) -> bool {
        self.get("disable")
            .map(|v| v.split(',').any(|b| b.trim() == name))
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::env_name;

    #[test]
    fn parses_keys_comments_and_warns_about_the_rest() {
        let c = Config::parse(
            "# comment\nlibcuda = /opt/x/libcuda.so.1  # trailing\n\nbogus\nfoo = 1\ncuda.parallel=no\n",
        );
        assert_eq!(c.get("libcuda"), Some("/opt/x/libcuda.so.1"));
        assert_eq!(c.get_bool("cuda.parallel", true), Ok(false));
        assert_eq!(c.warnings.len(), 2);
        assert_eq!(c.get("foo"), None);
    }

    #[test]
    fn misspelt_and_repeated_keys_a_bom_and_floods_are_reported_briefly() {
        let c = Config::parse(
            "\u{feff}cuda.parallel = no\namdgpu.copy-thread = 2\ncuda.parallel = yes\n",
        );
        assert_eq!(c.get_bool("cuda.parallel", false), Ok(true));
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c.warnings[0].contains("unknown key \"amdgpu.copy-thread\""));
        assert!(c.warnings[1].contains("cuda.parallel set again (line 1 too)"));
        let flood = "bad line\n".repeat(5000);
        let c = Config::parse(&flood);
        assert_eq!(c.warnings.len(), MAX_WARNINGS + 1);
        assert_eq!(
            c.warnings[MAX_WARNINGS],
            "and 4992 more lines with problems"
        );
    }

    #[test]
    fn environment_overrides_the_file() {
        let dir = std::env::temp_dir().join(format!("gpu-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("gpu-plugin.conf");
        std::fs::write(&p, "cuda.device-map = A=B\ndisable = amdgpu\n").unwrap();
        let env = |k: &str| (k == "CRIU_GPU_CUDA_DEVICE_MAP").then(|| "C=D".to_string());
        let c = Config::load(&p, &env).unwrap();
        assert_eq!(c.get("cuda.device-map"), Some("C=D"));
        assert!(c.is_disabled("amdgpu") && !c.is_disabled("cuda"));
        assert_eq!(c.source.as_deref(), Some(p.as_path()));
        std::fs::write(&p, vec![b'#'; 70 * 1024]).unwrap();
        assert!(
            Config::load(&p, &|_| None)
                .unwrap_err()
                .to_string()
                .contains("larger than")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn missing_file_is_empty_and_bad_values_are_errors() {
        let c = Config::load(Path::new("/nonexistent/gpu.conf"), &|_| None).unwrap();
        assert_eq!(
            c.notes,
            ["no settings file /nonexistent/gpu.conf: defaults"]
        );
        assert_eq!(
            Config {
                notes: Vec::new(),
                ..c
            },
            Config::default()
        );
        let c = Config::parse("cuda.lock-timeout-ms = soon\ncuda.parallel = maybe\n");
        assert!(c.get_u64("cuda.lock-timeout-ms", 1).is_err());
        assert!(c.get_bool("cuda.parallel", true).is_err());
        assert_eq!(env_name("cuda.device-map"), "CRIU_GPU_CUDA_DEVICE_MAP");
    }

    fn options(entries: &[&str]) -> criu_plugin::options::Options {
        criu_plugin::options::parse_entries(entries.iter().map(|e| e.as_bytes()))
    }

    #[test]
    fn plugin_options_override_environment_and_file_and_say_where_from() {
        let dir = std::env::temp_dir().join(format!("gpu-cfg-opt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("gpu-plugin.conf");
        std::fs::write(
            &p,
            "cuda.device-map = A=B\ncuda.parallel = no\namdgpu.copy-threads = 2\n",
        )
        .unwrap();
        let env = |k: &str| (k == "CRIU_GPU_CUDA_DEVICE_MAP").then(|| "C=D".to_string());
        let mut c = Config::load(&p, &env).unwrap();
        c.apply_options(&options(&[
            "--gpu_plugin.cuda.device-map=E=F",
            "--gpu_plugin.cuda.device-map=G=H",
            "--gpu_plugin.amdgpu.copy-threads=4",
            "--gpu_plugin.cuda.paralel=yes",
            "--amdgpu_plugin.whatever=1",
            "--cuda_plugin.timeout=30",
            "--cuda_plugin.backend=driver-api",
            "--cuda_plugin.frobnicate",
        ]));
        // The last of a repeated option wins, over the environment and the file.
        assert_eq!(c.get("cuda.device-map"), Some("G=H"));
        assert_eq!(c.option_value("amdgpu.copy-threads"), Some("4"));
        assert_eq!(c.option_value("cuda.parallel"), None);
        assert_eq!(c.get_bool("cuda.parallel", true), Ok(false));
        assert_eq!(c.get_u64("cuda.lock-timeout-ms", 1), Ok(30_000));
        assert_eq!(c.get("cuda.backend"), Some("driver-api"));
        assert_eq!(
            c.warnings,
            ["unknown plugin option gpu_plugin.cuda.paralel, ignored"]
        );
        assert_eq!(
            c.notes,
            ["plugin option cuda_plugin.frobnicate means nothing to this plugin: ignored"]
        );
        let line = c.summary().unwrap();
        assert!(
            line.contains("cuda.device-map=G=H (plugin option gpu_plugin.cuda.device-map)"),
            "{line}"
        );
        assert!(
            line.contains(&format!("cuda.parallel=no (line 2 of {})", p.display())),
            "{line}"
        );
        assert!(
            line.contains("cuda.lock-timeout-ms=30000 (plugin option cuda_plugin.timeout)"),
            "{line}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_table_key_is_read_from_the_environment_in_table_order() {
        let env = |k: &str| match k {
            "CRIU_GPU_AMDGPU_COPY_THREADS" => Some("3".to_string()),
            "CRIU_GPU_DISABLE" => Some("cuda".to_string()),
            "KFD_MAX_BUFFER_SIZE" => Some("1G".to_string()),
            _ => None,
        };
        let c = Config::load(Path::new("/nonexistent/gpu.conf"), &env).unwrap();
        assert_eq!(
            c.summary().unwrap(),
            "disable=cuda (environment CRIU_GPU_DISABLE), amdgpu.max-buffer-size=1G (environment KFD_MAX_BUFFER_SIZE, CRIU's C plugin's variable), amdgpu.copy-threads=3 (environment CRIU_GPU_AMDGPU_COPY_THREADS)"
        );
        // A plugin option stays over an environment applied later.
        let mut c = Config::default();
        c.apply_options(&options(&["--gpu_plugin.amdgpu.copy-threads=5"]));
        assert_eq!(c.with_env(&env).get("amdgpu.copy-threads"), Some("5"));
    }

    #[test]
    fn long_values_are_cut_in_log_lines() {
        let mut c = Config::default();
        c.set("cuda.device-map", &"é".repeat(30_000));
        let line = c.summary().unwrap();
        assert!(line.len() < 400, "{} bytes", line.len());
        assert!(
            line.contains("… (60000 bytes) (set by the program)"),
            "{line}"
        );
        assert_eq!(shown("short"), "short");
        let c = Config::parse(&format!("cuda.parallel = {}\n", "y".repeat(60_000)));
        let e = c.get_bool("cuda.parallel", true).unwrap_err().to_string();
        assert!(e.len() < 400 && e.contains("(60000 bytes)"), "{e}");
    }

    #[test]
    fn bad_option_values_are_kept_for_an_error_that_names_them() {
        let mut c = Config::default();
        c.apply_options(&options(&[
            "--cuda_plugin.timeout=soon",
            "--gpu_plugin.cuda.parallel=maybe",
        ]));
        assert_eq!(
            c.get_u64("cuda.lock-timeout-ms", 1).unwrap_err(),
            "cuda.lock-timeout-ms = soon (plugin option cuda_plugin.timeout): expected a whole number"
        );
        assert!(
            c.get_bool("cuda.parallel", true)
                .unwrap_err()
                .to_string()
                .contains("(plugin option gpu_plugin.cuda.parallel)")
        );
        assert_eq!(Config::default().summary(), None);
    }
}
