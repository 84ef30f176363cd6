#!/usr/bin/env bash
# Prepare .gpu-cri/: what the CRI case of scripts/gpu-check.sh (--cri, tests/gpu/cri_check.py)
# needs on the GPU machine, which has no network. Run here (after scripts/setup.sh), then carry
# .gpu-cri and .criu-4.3 there.
#
#   .gpu-cri/runtimes.tar.xz   containerd 2.1, its shim and ctr, runc 1.4 with the sid glibc it
#                              is patched onto, and the registry, at their absolute paths here
#                              (runc's ELF interpreter is an absolute path): gpu-check.sh --cri
#                              unpacks it at / on the GPU machine
#   .gpu-cri/cri-client        tools/cri-client (release build, stripped)
#   .gpu-cri/busybox           static busybox, the containers' userland
#   .gpu-cri/gpu_plugin.so     this plugin (release build, debug info stripped)
#
# Usage: scripts/gpu-carry-cri.sh   (prints the size of each carried path; at most 64 MiB in all)
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"
OUT=$REPO/.gpu-cri
rt=$REPO/.runtimes-2026
for f in "$rt/usr/bin/containerd" "$rt/usr/bin/containerd-shim-runc-v2" "$rt/usr/bin/ctr" \
         "$rt/usr/sbin/runc" .registry/bin/registry .runtimes/bin/busybox; do
    [ -e "$f" ] || { echo "[gpu-carry-cri] $f is missing: run scripts/setup.sh" >&2; exit 1; }
done
cargo build --release --locked -p criu-gpu-plugin --lib
cargo build --release --locked -p cri-client --bin cri-client
rm -rf "$OUT.new"
mkdir -p "$OUT.new"
tar -C / -cf - "${rt#/}/usr/bin/containerd" "${rt#/}/usr/bin/containerd-shim-runc-v2" "${rt#/}/usr/bin/ctr" \
    "${rt#/}/usr/sbin/runc" "${rt#/}/usr/lib/x86_64-linux-gnu" "${REPO#/}/.registry/bin/registry" \
    | xz -T0 -6 >"$OUT.new/runtimes.tar.xz"
strip -o "$OUT.new/cri-client" target/release/cri-client
strip --strip-debug -o "$OUT.new/gpu_plugin.so" target/release/libcriu_gpu_plugin.so
cp .runtimes/bin/busybox "$OUT.new/busybox"
echo "$rt" >"$OUT.new/PREFIX"
rm -rf "$OUT"
mv "$OUT.new" "$OUT"
du -sh "$OUT"/* .criu-4.3
