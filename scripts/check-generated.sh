#!/usr/bin/env bash
# Checks that the committed generated code is what its generators make today:
# kfd-sys/src/bindings.rs (bindgen over the uAPI headers, kfd-sys/gen/regen.sh --check) and
# src/amdgpu/image/generated.rs (prost over proto/amdgpu.proto, scripts/regen-proto.sh).
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

generated=src/amdgpu/image/generated.rs
saved=$(mktemp)
trap 'cp "$saved" "$generated"; rm -f "$saved"' EXIT
cp "$generated" "$saved"
scripts/regen-proto.sh
if cmp -s "$saved" "$generated"; then
    echo "[check-generated] $generated is up to date"
else
    diff -u "$saved" "$generated" || true
    echo "[check-generated] $generated differs from a fresh regeneration (run scripts/regen-proto.sh)" >&2
    exit 1
fi
