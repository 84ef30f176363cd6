#!/usr/bin/env bash
# Regenerate core/src/amdgpu/image/generated.rs from proto/amdgpu.proto and the CRI test client's
# tools/cri-client/src/runtime_v1.rs from proto/cri/api.proto, and the stand-in device plugin's
# tools/device-plugin/src/v1beta1.rs from proto/deviceplugin/api.proto.
#
# Needs only cargo (the generator uses the pure-Rust protox compiler, so no
# protoc). The generator is a separate crate outside the workspace, built into
# target/gen-proto so the tree stays clean. The result is rustfmt-formatted
# and must be committed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARGO_TARGET_DIR="$root/target/gen-proto" \
    cargo run --quiet --locked --manifest-path "$root/tools/gen-proto/Cargo.toml" -- "$root"
rustfmt --edition 2024 "$root/core/src/amdgpu/image/generated.rs" "$root/tools/cri-client/src/runtime_v1.rs" \
    "$root/tools/device-plugin/src/v1beta1.rs"
