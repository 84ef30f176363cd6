#!/usr/bin/env bash
# Installs everything the build, the main job and the tests need on a fresh Debian 12 machine:
# the C toolchain and headers (gcc, make, libc6-dev, linux-libc-dev, libdrm-dev for the kfd-sys
# layout checks),
# gzip, zstd, xz and tar (criu-gpu's archive tests),
# CRIU 4.1.1 in <repo>/.criu and 4.2.1 and 4.3 in <repo>/.criu-<release> (scripts/install-criu.sh),
# and the runtimes of the container tests: runc, Podman and containerd from Debian 12, crun,
# libcriu and checkpointctl from Debian 13 in <repo>/.runtimes (scripts/install-runtimes.sh),
# and QEMU and mmdebstrap for the test guest of scripts/guest/ (unless GPU_PLUGIN_SKIP_GUEST=1).
# Quick when all is present.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)

need=""
command -v cc >/dev/null 2>&1 || need="$need gcc"
# CRI-O's pinns (scripts/build-upstream.sh cri-o-1.36): make, and glibc's static libc.
command -v make >/dev/null 2>&1 || need="$need make"
[ -f "/usr/lib/$(uname -m)-linux-gnu/libc.a" ] || need="$need libc6-dev"
[ -f /usr/include/linux/kfd_ioctl.h ] || need="$need linux-libc-dev"
[ -f /usr/include/libdrm/amdgpu_drm.h ] || need="$need libdrm-dev"
# criu-gpu unpacks gzip, zstd and xz checkpoint archives with the system's tools.
command -v gzip >/dev/null 2>&1 || need="$need gzip"
command -v zstd >/dev/null 2>&1 || need="$need zstd"
command -v xz >/dev/null 2>&1 || need="$need xz-utils"
command -v tar >/dev/null 2>&1 || need="$need tar"
if [ -n "$need" ]; then
    echo "[setup] installing:$need"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends $need
fi
# The cgroup-v2-only guest of scripts/guest/ (scripts/test.sh's guest block): QEMU, mmdebstrap
# for its root file system and mke2fs for the root's image; the guest itself is built from
# Debian packages by scripts/guest/build.sh, never installed into the system.
if [ "${GPU_PLUGIN_SKIP_GUEST:-0}" != 1 ]; then
    need=""
    command -v qemu-system-x86_64 >/dev/null 2>&1 || need="$need qemu-system-x86"
    command -v mmdebstrap >/dev/null 2>&1 || need="$need mmdebstrap"
    command -v mkfs.ext4 >/dev/null 2>&1 || need="$need e2fsprogs"
    if [ -n "$need" ]; then
        echo "[setup] installing for the guest:$need"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        apt-get install -y -q --no-install-recommends $need
    fi
fi
command -v cargo >/dev/null 2>&1 || { echo "[setup] ERROR: cargo (Rust) is needed" >&2; exit 1; }
"$REPO/scripts/install-criu.sh"
# The newer releases the end-to-end suites also run against, each in a prefix of its own.
for release in 4.2.1 4.3; do
    "$REPO/scripts/install-criu.sh" --release "$release"
done
"$REPO/scripts/install-runtimes.sh"
# Today's runtimes (runc 1.4 and 1.3, containerd 2.1, crun 1.28, Podman 5.8, docker 28.5, buildah,
# skopeo, checkpointctl; sid/experimental) in <repo>/.runtimes-2026.
"$REPO/scripts/install-runtimes-2026.sh"
"$REPO/scripts/install-registry.sh"
