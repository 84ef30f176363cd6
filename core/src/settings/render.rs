//! The settings tables as the documentation shows them: the key table of the README, the one of
//! `docs/settings.md` and the keys of the manual page's SETTINGS section. Each sits in its file
//! between two marker lines; the test below fails when a committed copy differs from the tables
//! (`scripts/check-generated.sh` runs it) and, with `CRIU_GPU_REGENERATE_DOCS=1`, rewrites them.

use super::{CPluginName, Setting};

/// The line before a generated Markdown table.
pub const MARKDOWN_BEGIN: &str = "<!-- generated from the settings tables (core/src/settings.rs): edit those, then run CRIU_GPU_REGENERATE_DOCS=1 cargo test -p criu-gpu-core --lib settings::render -->";
/// The line after a generated Markdown table.
pub const MARKDOWN_END: &str = "<!-- end of the generated settings table -->";
/// The line before the generated keys of the manual page.
pub const MAN_BEGIN: &str = ".\\\" generated from the settings tables (core/src/settings.rs): edit those, then run CRIU_GPU_REGENERATE_DOCS=1 cargo test -p criu-gpu-core --lib settings::render";
/// The line after the generated keys of the manual page.
pub const MAN_END: &str = ".\\\" end of the generated settings keys";

/// Consecutive settings documented as one (the seven compatibility checks).
fn groups() -> Vec<Vec<&'static Setting>> {
    let mut out: Vec<Vec<&'static Setting>> = Vec::new();
    for s in super::tables::all() {
        match out.last_mut() {
            Some(g)
                if g[0].doc == s.doc
                    && g[0].about == s.about
                    && g[0].default == s.default
                    && g[0].syntax == s.syntax =>
            {
                g.push(s)
            }
            _ => out.push(vec![s]),
        }
    }
    out
}

/// The keys of a group, in Markdown (`` `a`, `b` ``).
fn keys(g: &[&Setting]) -> String {
    let keys: Vec<String> = g.iter().map(|s| format!("`{}`", s.key)).collect();
    keys.join(", ")
}

/// The C plugin's names of a group, as a sentence to append (`` Also `KFD_X`. ``), or empty.
fn c_names(g: &[&Setting]) -> String {
    let names: Vec<String> = g
        .iter()
        .filter_map(|s| match s.c_plugin {
            CPluginName::None => None,
            CPluginName::Option(n) => Some(format!("`{}.{n}`", super::CUDA_PLUGIN_NAMESPACE)),
            CPluginName::OptionSeconds(n) => Some(format!(
                "`{}.{n}` (in seconds)",
                super::CUDA_PLUGIN_NAMESPACE
            )),
            CPluginName::Env(n) => Some(format!("`{n}`")),
        })
        .collect();
    if names.is_empty() {
        String::new()
    } else {
        format!(" Also {}.", names.join(", "))
    }
}

/// What a group does, in full, with the C plugin's names.
fn meaning(g: &[&Setting]) -> String {
    format!("{}{}", g[0].about, c_names(g))
}

/// The README's table: key, default, what (one line each).
pub fn readme_table() -> String {
    let mut t = String::from("| key | default | what |\n|---|---|---|\n");
    for g in groups() {
        t.push_str(&format!(
            "| {} | {} | {} |\n",
            keys(&g),
            g[0].default,
            g[0].doc
        ));
    }
    t
}

/// The table of `docs/settings.md`: key, meaning in full, default.
pub fn reference_table() -> String {
    let mut t = String::from("| key | meaning | default |\n|---|---|---|\n");
    for g in groups() {
        t.push_str(&format!(
            "| {} | {} | {} |\n",
            keys(&g),
            meaning(&g),
            g[0].default
        ));
    }
    t
}

/// Markdown inline text (code spans only) as roff: code in bold, `-` and `\` escaped.
fn roff(text: &str) -> String {
    let mut out = String::new();
    let mut code = false;
    for c in text.chars() {
        match c {
            '`' => {
                out.push_str(if code { "\\fP" } else { "\\fB" });
                code = !code;
            }
            '-' => out.push_str("\\-"),
            '\\' => out.push_str("\\e"),
            c => out.push(c),
        }
    }
    out
}

/// Roff text lines, one per sentence (as roff wants them), none read as a request.
fn text_line(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    loop {
        // A sentence ends at ". " before a capital or code.
        let end = rest.match_indices(". ").map(|(i, _)| i).find(|&i| {
            rest[i + 2..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_uppercase() || c == '`')
        });
        let (sentence, next) = match end {
            Some(i) => (&rest[..=i], Some(&rest[i + 2..])),
            None => (rest, None),
        };
        let line = roff(sentence);
        if line.starts_with('.') || line.starts_with('\'') {
            out.push_str("\\&");
        }
        out.push_str(&line);
        out.push('\n');
        match next {
            Some(n) => rest = n,
            None => return out,
        }
    }
}

/// The keys of the manual page's SETTINGS section: one tagged paragraph per key.
pub fn man_keys() -> String {
    let mut t = String::new();
    for g in groups() {
        t.push_str(".TP\n");
        if g.len() == 1 {
            t.push_str(&format!(".B {}\n", roff(g[0].key)));
        } else {
            let names: Vec<String> = g.iter().map(|s| roff(s.key)).collect();
            t.push_str(&format!(".BR {}\n", names.join(" \", \" ")));
        }
        t.push_str(&text_line(&meaning(&g)));
        t.push_str(&text_line(&format!(
            "Default: {}.",
            g[0].default.trim_end_matches('.')
        )));
    }
    t
}

/// Why a file's generated part cannot be replaced.
#[derive(Debug, thiserror::Error)]
#[error("{file}: no `{marker}` line")]
pub struct MissingMarker {
    /// The file.
    pub file: String,
    /// The marker line missing.
    pub marker: &'static str,
}

/// `text` with the lines between `begin` and `end` replaced by `generated`.
pub fn replace_generated(
    file: &str,
    text: &str,
    begin: &'static str,
    end: &'static str,
    generated: &str,
) -> Result<String, MissingMarker> {
    let missing = |marker| MissingMarker {
        file: file.to_string(),
        marker,
    };
    let start = text.find(begin).ok_or_else(|| missing(begin))? + begin.len();
    let start = start + text[start..].find('\n').map_or(0, |n| n + 1);
    let stop = start + text[start..].find(end).ok_or_else(|| missing(end))?;
    Ok(format!("{}{generated}{}", &text[..start], &text[stop..]))
}

/// Every generated part: the file (from the workspace root), its markers and its text.
pub fn generated_parts() -> [(&'static str, &'static str, &'static str, String); 3] {
    [
        ("README.md", MARKDOWN_BEGIN, MARKDOWN_END, readme_table()),
        (
            "docs/settings.md",
            MARKDOWN_BEGIN,
            MARKDOWN_END,
            reference_table(),
        ),
        (
            "packaging/criu-gpu-plugin.7",
            MAN_BEGIN,
            MAN_END,
            man_keys(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_docs_match_the_settings_tables() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let fix = std::env::var_os("CRIU_GPU_REGENERATE_DOCS").is_some();
        let mut stale = Vec::new();
        for (file, begin, end, generated) in generated_parts() {
            let path = root.join(file);
            let text = std::fs::read_to_string(&path).unwrap();
            let fresh = replace_generated(file, &text, begin, end, &generated).unwrap();
            if fresh != text {
                if fix {
                    std::fs::write(&path, fresh).unwrap();
                } else {
                    stale.push(file);
                }
            }
        }
        assert!(
            stale.is_empty(),
            "{stale:?} differ from the settings tables: run CRIU_GPU_REGENERATE_DOCS=1 cargo test -p criu-gpu-core --lib settings::render"
        );
    }

    #[test]
    fn the_installed_settings_file_shows_every_key() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let conf = std::fs::read_to_string(root.join("packaging/gpu-plugin.conf")).unwrap();
        for s in crate::settings::tables::all() {
            let line = format!("# {} =", s.key);
            assert!(
                conf.lines().any(|l| l.starts_with(&line)),
                "packaging/gpu-plugin.conf has no `{line}` line"
            );
        }
        // Installed as it is, it sets nothing.
        assert!(crate::config::Config::parse(&conf).summary().is_none());
    }

    #[test]
    fn roff_escapes_and_groups_merge() {
        assert_eq!(roff("`a-b` c\\d"), "\\fBa\\-b\\fP c\\ed");
        assert_eq!(text_line(".x"), "\\&.x\n");
        assert_eq!(text_line("A b. C d. `e` f"), "A b.\nC d.\n\\fBe\\fP f\n");
        let checks = groups()
            .into_iter()
            .find(|g| g[0].key == "amdgpu.kfd-fw-ver-check")
            .unwrap();
        assert_eq!(checks.len(), 7);
        assert!(c_names(&checks).contains("`KFD_CAPABILITY_CHECK`"));
    }
}
