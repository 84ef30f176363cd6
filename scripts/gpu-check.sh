#!/usr/bin/env bash
# Checks and benchmark on a machine with NVIDIA GPUs (real CRIU, real CUDA processes).
#   scripts/gpu-check.sh            every check: 1 GiB, parent+child, 4 x 4 GiB, PyTorch, --leave-running,
#                                   8 GiB, and with two or more GPUs the multi-GPU cases
#   scripts/gpu-check.sh --bench    the benchmark: 1 x 8 GiB, 4 x 4 GiB all at once and one after another
#   scripts/gpu-check.sh --containers [ARGS]
#                                   runc checkpoint/restore of CUDA containers (1 GiB, a tree of 4,
#                                   --leave-running) with this plugin and with CRIU's C plugin
#                                   (tests/gpu/container_check.py; ARGS go to it, e.g. --out FILE);
#                                   runc, busybox and the C plugin come from .gpu-carry/
#                                   (scripts/gpu-carry.sh)
#   scripts/gpu-check.sh --kills [ARGS] CRIU killed (SIGKILL, SIGTERM, SIGINT) at random moments of 20
#                                   dumps of a 4-process CUDA tree: every process must run again
#                                   with its memory verified (tests/gpu/kill_check.py); with
#                                   .gpu-carry/cuda_plugin.so and .gpu-carry/bin/cuda-checkpoint
#                                   (scripts/gpu-carry.sh) CRIU's C plugin is counted beside it
#   scripts/gpu-check.sh --restore-kills [ARGS]
#                                   CRIU SIGKILLed in restores of a CUDA tree, under a reaper that frees
#                                   killed tasks' pids at once (tests/gpu/restore_kill_check.py): at
#                                   random moments of 20 restores of a 4-process tree, each followed by
#                                   a restore from the same images that must succeed and verify; with
#                                   --late also the targeted kill as RESUME_DEVICES_LATE starts, plain,
#                                   --restore-sibling and in a pid namespace (3 each); the tree must
#                                   run verified or be gone. With .gpu-carry the C plugin is counted
#                                   beside it. ARGS go to it, e.g. --restores 0 --late
#   scripts/gpu-check.sh --cri [ARGS]   the Kubernetes path: containerd 2.1's CRI with runc 1.4 checkpoints
#                                   a pod's CUDA container (1 GiB) and a PyTorch loop, restores each in
#                                   a new pod, verified bit for bit, timed beside `runc checkpoint`
#                                   (tests/gpu/cri_check.py); the plugin from /usr/lib/criu of a
#                                   private mount namespace; needs .gpu-cri (scripts/gpu-carry-cri.sh)
#                                   and CRIU 4.2 or newer (CRIU=.criu-4.3/bin/criu)
#   scripts/gpu-check.sh --kubelet [ARGS]
#                                   the same through a real kubelet 1.37 (standalone, static pods)
#                                   on containerd 2.3 (restore through CreateContainer opted in)
#                                   and runc 1.5, the GPU handed out by NVIDIA's device plugin as
#                                   a CDI device, `nvidia-ctk cdi generate` run and checked: the
#                                   kubelet's checkpoint API, a new pod from the checkpoint image,
#                                   `runc checkpoint` beside it (tests/gpu/kubelet_check.py); where
#                                   the device plugin's CDI spec mounts host paths that are
#                                   symlinks, the restores run with CRIU's mntns-compat-mode
#                                   (GPU_KUBELET_RESTORE_CRIU_CONF=none: without; docs/kubernetes.md);
#                                   needs .gpu-kubelet (scripts/gpu-carry-kubelet.sh), which brings
#                                   CRIU 4.3 along
#   scripts/gpu-check.sh --cases LIST   the named cases of tests/gpu/gpu_check.py (e.g. the CRIU 4.3
#                                   ones: postfail,mapopt,mapmissing)
#   scripts/gpu-check.sh --two-gpus [ARGS]
#                                   moving work between GPUs (tests/gpu/two_gpu_check.py): a pair
#                                   of 8 GiB processes one per GPU (beside one alone and, with
#                                   .gpu-carry, CRIU's C plugin), restored with the GPUs swapped
#                                   (both option names), both onto one GPU, criu-gpu suspend and
#                                   resume --device-map swapping them, criu-gpu check against each
#                                   GPU and a missing one; the two-GPU cases say SKIPPED on one
#                                   GPU; needs target/release/criu-gpu and CRIU 4.3
#                                   (CRIU=.criu-4.3/bin/criu). The default run ends with it.
# The plugin comes from $PLUGIN (default target/release/libcriu_gpu_plugin.so) and CRIU from
# $CRIU (default .criu/bin/criu, scripts/install-criu.sh; e.g. CRIU=.criu-4.3/bin/criu; copy the
# folder along where the GPU machine has no network).
# Images go to $WORK (default /dev/shm/gpu-check: host memory, the preemption use case).
# Prints one JSON line per case, a Markdown table, and "N passed, M failed"; exits non-zero on failure.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"
LOGS=${LOGS:-/tmp/gpu-check-logs}
# Multicast over NVLink stays off in everything started here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The driver library may live outside the loader's default paths (for example /usr/local/nvidia).
for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libcuda.so.1" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
done
if [ "${1:-}" = --kubelet ]; then
    shift
    [ -f .gpu-kubelet/bundle.tar.xz ] || { echo "no .gpu-kubelet: run scripts/gpu-carry-kubelet.sh and carry it" >&2; exit 1; }
    bundle=/var/tmp/gpu-kubelet-bundle
    rm -rf "$bundle" && mkdir -p "$bundle"
    xz -dc .gpu-kubelet/bundle.tar.xz | tar -C "$bundle" -xf -
    exec env PYTHONUNBUFFERED=1 python3 tests/gpu/kubelet_check.py --bundle "$bundle" \
        --criu "$bundle/.criu-4.3/bin/criu" --plugin .gpu-kubelet/gpu_plugin.so \
        --busybox .gpu-kubelet/busybox --out "$LOGS/kubelet/results.json" "$@"
fi
PLUGIN=${PLUGIN:-target/release/libcriu_gpu_plugin.so}
WORK=${WORK:-/dev/shm/gpu-check}
CRIU=${CRIU:-.criu/bin/criu}
[ -x "$CRIU" ] || [ "$CRIU" != .criu/bin/criu ] || scripts/install-criu.sh
[ -x "$CRIU" ] || { echo "no CRIU at $CRIU" >&2; exit 1; }
[ -f "$PLUGIN" ] || { echo "no plugin at $PLUGIN: run cargo build --release" >&2; exit 1; }
lib=$(mktemp -d)
cp "$PLUGIN" "$lib/gpu_plugin.so"
if [ "${1:-}" = --containers ]; then
    shift
    # Later options win: ARGS can replace these defaults.
    exec env PYTHONUNBUFFERED=1 python3 tests/gpu/container_check.py --criu "$CRIU" --plugin "$PLUGIN" \
        --work "$WORK/containers" --out "$LOGS/containers/results.json" "$@"
fi
if [ "${1:-}" = --cri ]; then
    shift
    [ -f .gpu-cri/runtimes.tar.xz ] || { echo "no .gpu-cri: run scripts/gpu-carry-cri.sh and carry it" >&2; exit 1; }
    rt=$(cat .gpu-cri/PREFIX)
    # The runtimes at the absolute paths they were patched for.
    [ -x "$rt/usr/sbin/runc" ] || xz -dc .gpu-cri/runtimes.tar.xz | tar -C / -xf -
    registry=$(dirname "$rt")/.registry/bin/registry
    exec env PYTHONUNBUFFERED=1 python3 tests/gpu/cri_check.py --criu "$CRIU" --plugin .gpu-cri/gpu_plugin.so \
        --containerd-bin "$rt/usr/bin" --runc "$rt/usr/sbin/runc" --registry "$registry" \
        --cri-client .gpu-cri/cri-client --busybox .gpu-cri/busybox --out "$LOGS/cri/results.json" "$@"
fi
# CRIU's C plugin and cuda-checkpoint from .gpu-carry (scripts/gpu-carry.sh), when both are
# there: the options that put them beside this plugin, in the array c.
c=()
if [ -f .gpu-carry/cuda_plugin.so ] && [ -x .gpu-carry/bin/cuda-checkpoint ]; then
    clib=$(mktemp -d)
    cp .gpu-carry/cuda_plugin.so "$clib/"
    c=(--c-libdir "$clib" --c-path .gpu-carry/bin)
fi
if [ "${1:-}" = --kills ]; then
    shift
    exec env PYTHONUNBUFFERED=1 python3 tests/gpu/kill_check.py --criu "$CRIU" --libdir "$lib" \
        --work "$WORK/kills" --logs "$LOGS/kills" "${c[@]}" "$@"
fi
if [ "${1:-}" = --restore-kills ]; then
    shift
    exec env PYTHONUNBUFFERED=1 python3 tests/gpu/restore_kill_check.py --criu "$CRIU" --libdir "$lib" \
        --work "$WORK/restore-kills" --logs "$LOGS/restore-kills" "${c[@]}" "$@"
fi
two_gpus() {
    PYTHONUNBUFFERED=1 python3 tests/gpu/two_gpu_check.py --criu "$CRIU" --libdir "$lib" \
        --tool "${TOOL:-target/release/criu-gpu}" --work "$WORK/two-gpus" --logs "$LOGS/two-gpus" "${c[@]}" "$@"
}
if [ "${1:-}" = --two-gpus ]; then
    shift
    two_gpus "$@"
    exit
fi
gpus=$(nvidia-smi -L | grep -c '^GPU ')
if [ "${1:-}" = --cases ]; then
    cases=${2:?--cases needs a list}
elif [ "${1:-}" = --bench ]; then
    cases=basic8,multi4,multi4seq
else
    cases=basic1,tree,multi4,torch,leave,basic8
    [ "$gpus" -ge 2 ] && cases=$cases,mgpu_two,mgpu_conc,mgpu_seq,remap,refuse
fi
rc=0
PYTHONUNBUFFERED=1 python3 tests/gpu/gpu_check.py --criu "$CRIU" --libdir "$lib" \
    --work "$WORK" --logs "$LOGS" --cases "$cases" || rc=1
if [ "${1:-}" != --cases ] && [ "${1:-}" != --bench ]; then
    two_gpus || rc=1
fi
exit "$rc"
