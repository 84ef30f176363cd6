//! The settings tables: every key the plugin reads, one table per backend, each entry with its
//! environment variable, the name CRIU's C plugin gives it, how its value is written, its
//! default and its documentation.
//!
//! Everything that lists keys is derived from these tables: the keys [`crate::config::Config`]
//! accepts (others are warned about), the environment variables and C plugin names it applies
//! in their order of precedence, and the settings part of the manual page and of the README and
//! `docs/settings.md` ([`render`], checked by `scripts/check-generated.sh`).

pub mod render;
pub mod tables;

/// Longest value shown in a log line; the rest is counted, not shown.
pub const MAX_SHOWN_VALUE: usize = 256;

/// `value` as log lines show it: at most [`MAX_SHOWN_VALUE`] bytes (cut at a character
/// boundary), then `… (N bytes)`.
pub fn shown(value: &str) -> std::borrow::Cow<'_, str> {
    if value.len() <= MAX_SHOWN_VALUE {
        return value.into();
    }
    let mut end = MAX_SHOWN_VALUE;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &value[..end], value.len()).into()
}

/// The environment variable that overrides `key`.
pub fn env_name(key: &str) -> String {
    let mut s = String::from("CRIU_GPU_");
    for c in key.chars() {
        s.push(match c {
            '.' | '-' => '_',
            c => c.to_ascii_uppercase(),
        });
    }
    s
}

/// How a value is written; the C plugin's variables are checked against it before they are
/// used (a bad one is ignored, as the C plugin ignores it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syntax {
    /// Text: a name, a path, a list.
    Text,
    /// `true`/`false`, `yes`/`no`, `1`/`0` or `on`/`off`, any case.
    Bool,
    /// `yes`/`no` or `1`/`0`, any case, as the C plugin reads its `KFD_*_CHECK`.
    Switch,
    /// A whole number.
    WholeNumber,
    /// Bytes: decimal, `0x` hexadecimal or `0` octal, with an optional `K`, `M` or `G` suffix.
    Size,
}

impl Syntax {
    /// Whether `value` is written this way; the error says what was expected.
    pub fn check(self, value: &str) -> Result<(), ValueError> {
        match self {
            Syntax::Text => Ok(()),
            Syntax::Bool => parse_bool(value).map(|_| ()),
            Syntax::Switch => parse_switch(value).map(|_| ()),
            Syntax::WholeNumber => value
                .parse::<u64>()
                .map(|_| ())
                .map_err(|_| ValueError::Expected("a whole number")),
            Syntax::Size => parse_size(value).map(|_| ()),
        }
    }
}

/// The name CRIU's C plugin gives a setting, where it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CPluginName {
    /// The C plugin has no such setting.
    None,
    /// A `cuda_plugin.NAME` plugin option meaning the same.
    Option(&'static str),
    /// A `cuda_plugin.NAME` plugin option in seconds where the key is in milliseconds.
    OptionSeconds(&'static str),
    /// An environment variable of the C plugin, below this plugin's own in precedence.
    Env(&'static str),
}

/// One setting.
#[derive(Clone, Copy, Debug)]
pub struct Setting {
    /// The key in the settings file and after `gpu_plugin.` in a plugin option.
    pub key: &'static str,
    /// The environment variable that overrides the file (`CRIU_GPU_` and the key).
    pub env: &'static str,
    /// The name CRIU's C plugin gives it.
    pub c_plugin: CPluginName,
    /// How its value is written.
    pub syntax: Syntax,
    /// The default, as the documentation shows it (Markdown).
    pub default: &'static str,
    /// What it is, in a few words (Markdown): the README's table.
    pub doc: &'static str,
    /// What it does, in full sentences (Markdown): `docs/settings.md` and the manual page.
    pub about: &'static str,
}

/// The namespace of CRIU's C cuda plugin, whose options are understood too.
pub const CUDA_PLUGIN_NAMESPACE: &str = "cuda_plugin";

/// Why a value is bad, without the key (the caller names it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    /// Not written the expected way.
    #[error("expected {0}")]
    Expected(&'static str),
    /// Not a size.
    #[error("{0:?} is not a size (e.g. 268435456, 0x10000000, 256M, 2G)")]
    NotASize(String),
    /// A size beyond 64 bits.
    #[error("{0:?} overflows 64 bits")]
    SizeOverflow(String),
    /// A number out of its range.
    #[error("expected {min} to {max}")]
    OutOfRange {
        /// The smallest accepted.
        min: u64,
        /// The largest accepted.
        max: u64,
    },
    /// A value larger than this machine's addresses (`key = value` as given).
    #[error("{0}: too large")]
    TooLarge(String),
}

/// A bad value of a setting, naming it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    /// The key and value as given (`key = value (where from)`), and what is wrong.
    #[error("{quoted}: {source}")]
    Value {
        /// `key = value`, with where the value came from where that helps.
        quoted: String,
        /// What is wrong with it.
        source: ValueError,
    },
    /// The key, and what is wrong with its value (which the error shows).
    #[error("{key}: {source}")]
    Key {
        /// The key.
        key: &'static str,
        /// What is wrong with its value.
        source: ValueError,
    },
}

impl PartialEq<&str> for SettingError {
    fn eq(&self, other: &&str) -> bool {
        let shown = self.to_string();
        shown == *other
    }
}

/// A boolean (`true/false`, `yes/no`, `1/0`, `on/off`, any case).
pub fn parse_bool(v: &str) -> Result<bool, ValueError> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ValueError::Expected("true or false")),
    }
}

/// A check switch as CRIU's C plugin reads `KFD_*_CHECK` (`0`/`no` off, `1`/`yes` on, any
/// case, blanks around ignored).
pub fn parse_switch(v: &str) -> Result<bool, ValueError> {
    match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        t if t.eq_ignore_ascii_case("no") => Ok(false),
        t if t.eq_ignore_ascii_case("yes") => Ok(true),
        _ => Err(ValueError::Expected("yes or no (or 1 or 0)")),
    }
}

/// Parses a size the way the C plugin parses `KFD_MAX_BUFFER_SIZE` (`strtoul` base 0:
/// decimal, `0x` hex, leading-zero octal) with an optional `K`, `M` or `G` suffix (binary
/// units; lower case is accepted too). Overflow is an error.
pub fn parse_size(text: &str) -> Result<u64, ValueError> {
    let t = text.trim();
    let (digits, shift) = match t.as_bytes().last() {
        Some(b'K' | b'k') => (&t[..t.len() - 1], 10),
        Some(b'M' | b'm') => (&t[..t.len() - 1], 20),
        Some(b'G' | b'g') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let bad = || ValueError::NotASize(shown(text).into_owned());
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
        .ok_or_else(|| ValueError::SizeOverflow(text.to_string()))
}
