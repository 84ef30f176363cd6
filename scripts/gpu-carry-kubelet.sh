#!/usr/bin/env bash
# Prepare .gpu-kubelet/: what the kubelet case of scripts/gpu-check.sh (--kubelet,
# tests/gpu/kubelet_check.py) needs on the GPU machine, which has no network. Run here (after
# scripts/setup.sh); then carry .gpu-kubelet there.
#
#   .gpu-kubelet/bundle.tar.xz  built from their Go modules (scripts/build-upstream.sh): the
#                               kubelet 1.37, containerd 2.3 (containerd, its runc shim, ctr),
#                               runc 1.5, nvidia-ctk 1.20, NVIDIA's device plugin 0.17; the
#                               registry; CRIU 4.3 (.criu-4.3); all under bin/ but CRIU, whose
#                               folder keeps its name
#   .gpu-kubelet/gpu_plugin.so  this plugin (release build, debug info stripped)
#   .gpu-kubelet/busybox        static busybox, the containers' userland
#
# Usage: scripts/gpu-carry-kubelet.sh   (prints the size of each carried file; at most 64 MiB in all)
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"
OUT=$REPO/.gpu-kubelet
scripts/build-upstream.sh kubernetes-1.37 containerd-2.3 runc-1.5 nvidia-ctk-1.20 nvidia-device-plugin-0.17
bins=(.upstream/kubernetes-1.37/bin/kubelet .upstream/containerd-2.3/bin/containerd
      .upstream/containerd-2.3/bin/containerd-shim-runc-v2 .upstream/containerd-2.3/bin/ctr
      .upstream/runc-1.5/bin/runc .upstream/nvidia-ctk-1.20/bin/nvidia-ctk
      .upstream/nvidia-device-plugin-0.17/bin/nvidia-device-plugin .registry/bin/registry)
for f in "${bins[@]}" .criu-4.3/bin/criu .runtimes/bin/busybox; do
    [ -e "$f" ] || { echo "[gpu-carry-kubelet] $f is missing: run scripts/setup.sh" >&2; exit 1; }
done
cargo build --release --locked -p criu-gpu-plugin --lib
rm -rf "$OUT.new"
mkdir -p "$OUT.new/stage/bin"
cp "${bins[@]}" "$OUT.new/stage/bin/"
tar -C "$OUT.new/stage" -cf - bin -C "$REPO" .criu-4.3 | xz -T0 -9 >"$OUT.new/bundle.tar.xz"
rm -rf "$OUT.new/stage"
strip --strip-debug -o "$OUT.new/gpu_plugin.so" target/release/libcriu_gpu_plugin.so
cp .runtimes/bin/busybox "$OUT.new/busybox"
rm -rf "$OUT"
mv "$OUT.new" "$OUT"
du -sh "$OUT"/*
du -sh "$OUT"
