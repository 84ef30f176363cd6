#!/usr/bin/env bash
# The main job: build the plugin, install CRIU if it is missing, start a sample workload, dump it
# with the plugin loaded, kill it, restore it, and show that it carried on where it was.
# On a machine with an NVIDIA GPU (nvidia-smi and nvcc present) the workload holds 1 GiB of
# patterned GPU memory and a GPU counter; elsewhere it is an ordinary process.
# It uses the newest CRIU the setup installs (4.3, in .criu-4.3/); CRIU_BIN picks another, e.g.
# CRIU_BIN=.criu/bin/criu for 4.1.1.
# Needs root (CRIU does). Usage: scripts/demo.sh [--cpu]   (--cpu: ordinary process even with a GPU)
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"
scripts/setup.sh
echo "[demo] building the plugin (release)"
cargo build --release --locked -p criu-gpu-plugin
work=$(mktemp -d /tmp/gpu-plugin-demo.XXXXXX)
mkdir -p "$work/lib"
cp target/release/libcriu_gpu_plugin.so "$work/lib/gpu_plugin.so"
criu=${CRIU_BIN:-$REPO/.criu-4.3/bin/criu}
echo "[demo] CRIU: $criu ($("$criu" --version | head -n1))"
exec python3 "$REPO/scripts/demo.py" --criu "$criu" --libdir "$work/lib" --work "$work" "$@"
