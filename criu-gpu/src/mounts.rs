//! The container's bind mounts that a restore cannot rebuild on this machine. A runtime's
//! checkpoint archive (containerd's, CRI-O's, Podman's) holds the container's OCI spec as
//! `spec.dump`. runc hands CRIU each bind mount's host path as the spec writes it, and CRIU's
//! default mount engine binds a symlink there as the link itself, then fails to remount it
//! (every CRIU release with that engine: 4.1 to 4.3). NVIDIA's CDI specs can mount such paths.

use std::path::Path;

use serde_json::Value;

/// The name of the OCI spec in a runtime's checkpoint archive.
pub const SPEC_FILE: &str = "spec.dump";

/// How many mounts of a spec are looked at: a hostile spec may list any number.
const MAX_MOUNTS: usize = 4096;

/// Why the bind mounts of `spec` (the bytes of [`SPEC_FILE`]) would not restore here: one line
/// per bind mount whose host path is a symlink on this machine. `Err` when the spec is not an
/// OCI spec.
pub fn symlinked_bind_sources(spec: &[u8]) -> Result<Vec<String>, String> {
    let v: Value = serde_json::from_slice(spec)
        .map_err(|e| format!("{SPEC_FILE} is not JSON ({e}): its mounts are not checked"))?;
    let Some(mounts) = v.get("mounts").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    let mut reasons = Vec::new();
    for m in mounts.iter().take(MAX_MOUNTS) {
        let (Some(source), Some(destination)) = (
            m.get("source").and_then(Value::as_str),
            m.get("destination").and_then(Value::as_str),
        ) else {
            continue;
        };
        if !is_bind(m) || !source.starts_with('/') {
            continue;
        }
        // Not followed: only whether the path itself is a link.
        let Ok(meta) = std::fs::symlink_metadata(source) else {
            continue;
        };
        if !meta.file_type().is_symlink() {
            continue;
        }
        let target = std::fs::canonicalize(Path::new(source)).map_or_else(
            |_| "a missing target".to_string(),
            |t| t.display().to_string(),
        );
        reasons.push(format!(
            "bind mount {destination}: its host path {source} is a symlink here (to {target}); \
             CRIU's default mount engine cannot restore a bind mount of a symlink (runc hands \
             CRIU the link): make {source} a file or folder of its own, or restore with CRIU's \
             mntns-compat-mode (docs/kubernetes.md, \"CDI host paths that are symlinks\")"
        ));
    }
    Ok(reasons)
}

/// Whether OCI mount `m` is a bind mount: its type says so, or its options do.
fn is_bind(m: &Value) -> bool {
    m.get("type").and_then(Value::as_str) == Some("bind")
        || m.get("options").and_then(Value::as_array).is_some_and(|o| {
            o.iter()
                .any(|x| matches!(x.as_str(), Some("bind" | "rbind")))
        })
}
