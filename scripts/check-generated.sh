#!/usr/bin/env bash
# Checks that the committed generated code is what its generators make today:
# kfd-sys/src/bindings.rs (bindgen over the uAPI headers, kfd-sys/gen/regen.sh --check) and
# core/src/amdgpu/image/generated.rs (prost over proto/amdgpu.proto) and
# tools/cri-client/src/runtime_v1.rs (prost and tonic over proto/cri/api.proto) and
# tools/device-plugin/src/v1beta1.rs (the same over proto/deviceplugin/api.proto), all made by
# scripts/regen-proto.sh, and the settings keys of README.md, docs/settings.md and the manual page
# packaging/criu-gpu-plugin.7, made from the settings tables (core/src/settings.rs and the
# backends' settings.rs) by a test of the core: regenerate them with
# CRIU_GPU_REGENERATE_DOCS=1 cargo test -p criu-gpu-core --lib settings::render
# Building the plugin needs neither generator; this check installs bindgen and libclang-dev
# (Debian packages) when they are missing. Exits non-zero on any drift.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"

need=""
command -v bindgen >/dev/null 2>&1 || need="$need bindgen"
dpkg-query -W -f='${Status}' libclang-dev 2>/dev/null | grep -q "ok installed" || need="$need libclang-dev"
if [ -n "$need" ]; then
    echo "[check-generated] installing:$need"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends $need >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $need >/dev/null; }
fi

kfd-sys/gen/regen.sh --check

if out=$(cargo test -q -p criu-gpu-core --lib --locked settings::render 2>&1); then
    echo "[check-generated] the settings keys of README.md, docs/settings.md and packaging/criu-gpu-plugin.7 are up to date"
else
    printf '%s\n' "$out" | tail -n 20 >&2
    echo "[check-generated] the settings keys of README.md, docs/settings.md or packaging/criu-gpu-plugin.7 differ from the settings tables (run CRIU_GPU_REGENERATE_DOCS=1 cargo test -p criu-gpu-core --lib settings::render)" >&2
    settings_drift=1
fi

generated=(core/src/amdgpu/image/generated.rs tools/cri-client/src/runtime_v1.rs tools/device-plugin/src/v1beta1.rs)
saved=$(mktemp -d)
trap 'for f in "${generated[@]}"; do cp "$saved/$(basename "$f")" "$f"; done; rm -rf "$saved"' EXIT
for f in "${generated[@]}"; do cp "$f" "$saved/$(basename "$f")"; done
scripts/regen-proto.sh
drift=0
for f in "${generated[@]}"; do
    if cmp -s "$saved/$(basename "$f")" "$f"; then
        echo "[check-generated] $f is up to date"
    else
        diff -u "$saved/$(basename "$f")" "$f" || true
        echo "[check-generated] $f differs from a fresh regeneration (run scripts/regen-proto.sh)" >&2
        drift=1
    fi
done
exit $((drift | ${settings_drift:-0}))
