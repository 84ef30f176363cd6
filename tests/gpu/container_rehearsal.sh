#!/usr/bin/env bash
# A rehearsal of `scripts/gpu-check.sh --containers` on a machine without a GPU: the GPU
# machine's code paths (nvcc, driver libraries copied from their directory, /dev/nvidia* nodes,
# /proc/driver/nvidia, nvidia-smi, cuda-checkpoint on PATH) with stand-ins:
#   - a private mount namespace gets /dev/nvidia{0,ctl,-uvm,-uvm-tools} and
#     /dev/nvidia-caps/nvidia-cap1 (NVIDIA's device numbers, no driver behind them: nothing opens
#     them) and a /proc/driver/nvidia/gpus of one GPU;
#   - "nvcc" builds the stand-in driver's workload (tests/fixtures/fake-cuda) with --gib read as
#     MiB, linked to a libcuda.so.1 that it finds only through LD_LIBRARY_PATH;
#   - the driver directory holds the stand-in as libcuda.so.580.159.04 with the usual symlinks;
#   - cuda-checkpoint is tests/gpu/fake_cuda_checkpoint.c over the stand-in.
# Needs root, cc, .criu, .gpu-carry and the plugin. Usage: tests/gpu/container_rehearsal.sh [ARGS]
# (ARGS go to container_check.py, e.g. --plugins rust --cases one).
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/../.." && pwd -P)
if [ "${1:-}" != --inside ]; then
    exec unshare -m --propagation private "$0" --inside "$@"
fi
shift
cd "$REPO"
t=$(mktemp -d /tmp/ctr-rehearsal.XXXXXX)
fx=$REPO/tests/fixtures
nv=$t/nvidia/lib64
mkdir -p "$nv" "$t/bin" "$t/cc"

# The driver directory, laid out as NVIDIA's installer does.
cc -shared -fPIC -O2 -o "$nv/libcuda.so.580.159.04" "$fx/fake-cuda/fake_libcuda.c" "$fx/fake-cuda/fake_cuda_runtime.c" \
    "$fx/fake-cuda/fake_cuda_controller.c" "$fx/fake-cuda/gpu_nodes.c" -lpthread
ln -s libcuda.so.580.159.04 "$nv/libcuda.so.1"
ln -s libcuda.so.1 "$nv/libcuda.so"
cp "$nv/libcuda.so.580.159.04" "$nv/libnvidia-ptxjitcompiler.so.580.159.04"
ln -s libnvidia-ptxjitcompiler.so.580.159.04 "$nv/libnvidia-ptxjitcompiler.so.1"
cp "$nv/libcuda.so.580.159.04" "$nv/libnvidia-ml.so.1" # must not be copied into the rootfs

# "nvcc -O2 -o OUT SRC": the stand-in workload, --gib read as --mib.
cat >"$t/cc/main.c" <<'EOF'
#include <string.h>
int workload_main(int argc, char **argv);
int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--gib"))
            argv[i] = "--mib";
    return workload_main(argc, argv);
}
EOF
cat >"$t/bin/nvcc" <<EOF
#!/bin/sh
# stand-in nvcc: \$3 is the output
cc -O2 -c -o "$t/cc/workload.o" -Dmain=workload_main "$fx/fake-cuda/workload.c" || exit 1
exec cc -O2 -o "\$3" "$t/cc/workload.o" "$t/cc/main.c" -L"$nv" -l:libcuda.so.1 -lpthread
EOF
cat >"$t/bin/nvidia-smi" <<'EOF'
#!/bin/sh
echo "stand-in nvidia-smi: $*"
EOF
chmod 755 "$t/bin/nvcc" "$t/bin/nvidia-smi"
cc -O2 -o "$t/bin/cuda-checkpoint" tests/gpu/fake_cuda_checkpoint.c -L"$nv" -l:libcuda.so.1 \
    -Wl,-rpath,"$nv" -Wl,--disable-new-dtags

# Device nodes, in this mount namespace only: /dev becomes a tmpfs with copies of the real
# nodes (its mounts bound back), so nothing appears in the machine's own /dev.
# (Outside $t, so that removing $t can never reach the real /dev through this bind.)
olddev=$(mktemp -d /tmp/ctr-olddev.XXXXXX)
mount --rbind /dev "$olddev"
mount -t tmpfs -o mode=755 tmpfs /dev
for e in "$olddev"/* "$olddev"/.[!.]*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    n=${e##*/}
    if mountpoint -q "$e"; then
        mkdir -p "/dev/$n"
        mount --rbind "$e" "/dev/$n"
    else
        cp -a "$e" /dev/
    fi
done
for n in nvidia0:195:0 nvidiactl:195:255 nvidia-uvm:510:0 nvidia-uvm-tools:510:1; do
    IFS=: read -r name major minor <<<"$n"
    mknod -m 666 "/dev/$name" c "$major" "$minor"
done
mkdir -p /dev/nvidia-caps
mknod -m 444 /dev/nvidia-caps/nvidia-cap1 c 511 1
# /proc/driver/nvidia/gpus of the stand-in's one GPU, for both plugins' "is there a driver" look.
cc -O2 -o "$t/gpu_list" "$fx/e2e/gpu_list.c" -L"$nv" -l:libcuda.so.1 -Wl,-rpath,"$nv" -Wl,--disable-new-dtags
read -r uuid model < <("$t/gpu_list")
mkdir -p "$t/driver/nvidia/gpus/0000:00:06.0"
printf 'Model: \t\t %s\nGPU UUID: \t %s\nBus Location: \t 0000:00:06.0\n' "$model" "$uuid" \
    >"$t/driver/nvidia/gpus/0000:00:06.0/information"
mount --bind "$t/driver" /proc/driver
trap 'umount -l /proc/driver 2>/dev/null; umount -l /dev 2>/dev/null; umount -l "$olddev" && rmdir "$olddev"; rm -rf "$t"' EXIT

PATH=$t/bin:$PATH WORK=/dev/shm/ctr-rehearsal scripts/gpu-check.sh --containers --nvidia-lib-dir "$nv" \
    --cuda-checkpoint "$t/bin/cuda-checkpoint" "$@"
