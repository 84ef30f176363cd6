//! Plugin options (`criu --plugin-option PLUGIN.NAME[=VALUE]`, CRIU 4.3).
//!
//! CRIU 4.3 takes options for plugins from its command line, its configuration files and RPC
//! requests (the way a container runtime hands a plugin per-request settings) and gives every
//! plugin all of them through `criu_plugin_get_options(int *argc, char ***argv)`: `argv[0]` is
//! a placeholder, each other entry is `--PLUGIN.NAME[=VALUE]`, in the order given, and CRIU owns
//! the strings. CRIU checks only that outer form, so a plugin skips other plugins' options and
//! must itself report a misspelt name of its own. Older CRIUs lack the function: it is looked
//! up at run time, never linked.
//!
//! What the host hands over is bounded here (entry count and length) and copied, so that
//! nothing keeps pointing into CRIU's memory after the call.

use std::ffi::{CStr, c_char, c_int};

/// Most entries read; the rest are dropped with a warning.
pub const MAX_OPTIONS: usize = 256;
/// Longest entry read; a longer one is dropped with a warning.
pub const MAX_OPTION_LEN: usize = 4096;

/// One plugin option: `--PLUGIN.NAME[=VALUE]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginOption {
    /// The plugin the option is for (before the first dot).
    pub plugin: String,
    /// The option's name (after the first dot, before `=`).
    pub name: String,
    /// The value after `=`; `None` for a bare flag.
    pub value: Option<String>,
}

impl std::fmt::Display for PluginOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.plugin, self.name)?;
        if let Some(v) = &self.value {
            write!(f, "={v}")?;
        }
        Ok(())
    }
}

/// The options the host gave, and what was wrong with the list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Whether the host has plugin options at all (CRIU 4.3 and later).
    pub supported: bool,
    /// Every well-formed option, in the host's order (the last of a repeated one wins).
    pub all: Vec<PluginOption>,
    /// Entries that were dropped, and why.
    pub warnings: Vec<String>,
}

impl Options {
    /// The options for `plugin`, in order.
    pub fn of<'a>(&'a self, plugin: &'a str) -> impl Iterator<Item = &'a PluginOption> + 'a {
        self.all.iter().filter(move |o| o.plugin == plugin)
    }
}

/// Why an entry is not a plugin option.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadOption {
    /// Its bytes are not text (shown with replacement characters).
    #[error("plugin option {0:?} is not UTF-8")]
    NotUtf8(String),
    /// Not `PLUGIN.NAME[=VALUE]`.
    #[error("plugin option {0:?} is not PLUGIN.NAME[=VALUE]")]
    NotPluginDotName(String),
}

/// Parses one entry (`--PLUGIN.NAME[=VALUE]`; the leading dashes are optional).
pub fn parse_entry(entry: &[u8]) -> Result<PluginOption, BadOption> {
    let text = std::str::from_utf8(entry)
        .map_err(|_| BadOption::NotUtf8(String::from_utf8_lossy(entry).into_owned()))?;
    let body = text.strip_prefix("--").unwrap_or(text);
    let (key, value) = match body.split_once('=') {
        Some((k, v)) => (k, Some(v.to_string())),
        None => (body, None),
    };
    match key.split_once('.') {
        Some((plugin, name)) if !plugin.is_empty() && !name.is_empty() => Ok(PluginOption {
            plugin: plugin.to_string(),
            name: name.to_string(),
            value,
        }),
        _ => Err(BadOption::NotPluginDotName(text.to_string())),
    }
}

/// Parses a whole list of entries, with the bounds above.
pub fn parse_entries<'a>(entries: impl IntoIterator<Item = &'a [u8]>) -> Options {
    let mut out = Options {
        supported: true,
        ..Options::default()
    };
    for (n, e) in entries.into_iter().enumerate() {
        if n == MAX_OPTIONS {
            out.warnings.push(format!(
                "more than {MAX_OPTIONS} plugin options: the rest are ignored"
            ));
            break;
        }
        if e.len() > MAX_OPTION_LEN {
            out.warnings.push(format!(
                "a plugin option of {} bytes (more than {MAX_OPTION_LEN}) is ignored",
                e.len()
            ));
            continue;
        }
        match parse_entry(e) {
            Ok(o) => out.all.push(o),
            Err(w) => out.warnings.push(format!("{w}: ignored")),
        }
    }
    out
}

type GetOptionsFn = unsafe extern "C" fn(argc: *mut c_int, argv: *mut *mut *mut c_char) -> c_int;

/// The options of the CRIU that loaded us; `supported` is false where CRIU has none (before
/// 4.3, or not CRIU), and then the list is empty.
pub fn from_host() -> Options {
    let Some(sym) = crate::symbols::lookup(c"criu_plugin_get_options") else {
        return Options::default();
    };
    // SAFETY: CRIU 4.3 exports `int criu_plugin_get_options(int *argc, char ***argv)` under
    // this name; nothing else in CRIU's global scope uses it.
    let get: GetOptionsFn = unsafe { std::mem::transmute::<*mut std::ffi::c_void, _>(sym) };
    let mut argc: c_int = 0;
    let mut argv: *mut *mut c_char = std::ptr::null_mut();
    // SAFETY: both outputs point to locals; CRIU fills them with its own list.
    let rc = unsafe { get(&mut argc, &mut argv) };
    if rc != 0 || argv.is_null() || argc < 1 {
        let mut o = Options {
            supported: true,
            ..Options::default()
        };
        if rc != 0 {
            o.warnings.push(format!(
                "CRIU could not give the plugin options (error {rc})"
            ));
        }
        return o;
    }
    // Entry 0 is CRIU's placeholder; read one past the bound to say that more were dropped.
    let count = (argc as usize - 1).min(MAX_OPTIONS + 1);
    let mut entries: Vec<&[u8]> = Vec::with_capacity(count);
    for i in 1..=count {
        // SAFETY: CRIU's argv holds `argc` entries; `i < argc`.
        let p = unsafe { *argv.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: CRIU's entries are NUL-terminated strings that live at least until the
        // hook returns; the bytes are copied before that.
        entries.push(unsafe { CStr::from_ptr(p) }.to_bytes());
    }
    parse_entries(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_split_into_plugin_name_and_value() {
        let o = parse_entries([
            b"--gpu_plugin.cuda.device-map=GPU-a=GPU-b".as_slice(),
            b"--cuda_plugin.timeout=30",
            b"gpu_plugin.flag",
            b"--nodot=1",
            b"--.x=1",
            b"--p.=1",
            b"--p.x=",
            &[0xff, b'.', b'x'],
        ]);
        assert_eq!(
            o.all[0],
            PluginOption {
                plugin: "gpu_plugin".into(),
                name: "cuda.device-map".into(),
                value: Some("GPU-a=GPU-b".into()),
            }
        );
        assert_eq!(o.all[1].to_string(), "cuda_plugin.timeout=30");
        assert_eq!(o.all[2].value, None);
        assert_eq!(o.all[3].value.as_deref(), Some(""));
        assert_eq!(o.all.len(), 4);
        assert_eq!(o.warnings.len(), 4, "{:?}", o.warnings);
        assert!(o.warnings[0].contains("\"--nodot=1\" is not PLUGIN.NAME"));
        assert_eq!(o.of("gpu_plugin").count(), 2);
    }

    #[test]
    fn hostile_lists_are_bounded() {
        let long = vec![b'a'; MAX_OPTION_LEN + 1];
        let many: Vec<Vec<u8>> = (0..MAX_OPTIONS + 10)
            .map(|i| format!("--p.k{i}=v").into_bytes())
            .collect();
        let o =
            parse_entries(std::iter::once(long.as_slice()).chain(many.iter().map(Vec::as_slice)));
        assert_eq!(o.all.len(), MAX_OPTIONS - 1);
        assert_eq!(o.warnings.len(), 2, "{:?}", o.warnings);
    }

    #[test]
    fn outside_criu_there_are_none() {
        let o = from_host();
        assert!(!o.supported && o.all.is_empty() && o.warnings.is_empty());
    }
}
