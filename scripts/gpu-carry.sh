#!/usr/bin/env bash
# Prepare .gpu-carry/: what the container checks on the GPU machine need that git does not hold
# and that machine cannot download (it has no network). Run here, then carry .criu,
# target/release/libcriu_gpu_plugin.so and .gpu-carry to the GPU machine.
#
#   .gpu-carry/runc               Debian 12's runc 1.1.5 (runc checkpoint/restore drive criu swrk)
#   .gpu-carry/libseccomp.so.2    the one library runc needs beyond glibc
#   .gpu-carry/busybox            static busybox: the test containers' userland
#   .gpu-carry/cuda_plugin.so     CRIU's C CUDA plugin built from CRIU's source at .criu's version
#                                 (scripts/build-criu-cuda-plugin.sh), for the comparison runs
#   .gpu-carry/bin/cuda-checkpoint NVIDIA's utility, which the C plugin runs from PATH
#
# Usage: CRIU_GIT_DIR=DIR CUDA_CHECKPOINT_GIT_DIR=DIR scripts/gpu-carry.sh
# Environment: CRIU_GIT_DIR (required: a git directory of CRIU's repository, bare is fine),
#   CUDA_CHECKPOINT_GIT_DIR (required: one of NVIDIA's cuda-checkpoint repository, which ships
#   the binary), CARRY (default <repo>/.gpu-carry), PLUGIN (default target/release/libcriu_gpu_plugin.so).
# Prints the size of each carried path; the run tool carries at most 64 MiB in all.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"
CARRY=${CARRY:-$REPO/.gpu-carry}
PLUGIN=${PLUGIN:-target/release/libcriu_gpu_plugin.so}
CRIU_GIT_DIR=${CRIU_GIT_DIR:-}
CUDA_CHECKPOINT_GIT_DIR=${CUDA_CHECKPOINT_GIT_DIR:-}
RUNC_VERSION=1.1.5
LIMIT_MIB=64
say() { printf '[gpu-carry] %s\n' "$*"; }
die() { printf '[gpu-carry] ERROR: %s\n' "$*" >&2; exit 1; }

[ -n "$CRIU_GIT_DIR" ] || die "set CRIU_GIT_DIR to a git directory of CRIU's repository (github.com/checkpoint-restore/criu; a bare clone is fine)"
[ -n "$CUDA_CHECKPOINT_GIT_DIR" ] || die "set CUDA_CHECKPOINT_GIT_DIR to a git directory of NVIDIA's cuda-checkpoint repository (github.com/NVIDIA/cuda-checkpoint; a bare clone is fine)"
[ -x .criu/bin/criu ] || scripts/install-criu.sh
{ command -v apt-get && command -v dpkg; } >/dev/null || die "apt-get and dpkg are needed (Debian 12)"
for d in "$CRIU_GIT_DIR" "$CUDA_CHECKPOINT_GIT_DIR"; do
    [ -d "$d" ] || die "git directory $d is absent: get CRIU's (github.com/checkpoint-restore/criu) and NVIDIA's cuda-checkpoint (github.com/NVIDIA/cuda-checkpoint) repositories and set CRIU_GIT_DIR / CUDA_CHECKPOINT_GIT_DIR"
done

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-carry.XXXXXX")
trap 'rm -rf "$work"' EXIT
new=$work/carry
mkdir -p "$new/bin"

# runc, libseccomp and busybox from this machine's Debian 12 archive (unpacked, not installed).
(cd "$work" && apt-get download runc libseccomp2 busybox-static >"$work/apt.log" 2>&1) \
    || { cat "$work/apt.log" >&2; die "apt-get download failed (run apt-get update?)"; }
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/x"; done
install -m 755 "$work/x/usr/sbin/runc" "$new/runc"
cp -L "$work/x/usr/lib/x86_64-linux-gnu/libseccomp.so.2" "$new/libseccomp.so.2"
install -m 755 "$work/x/bin/busybox" "$new/busybox"
got=$(LD_LIBRARY_PATH=$new "$new/runc" --version | sed -n 's/^runc version //p')
case $got in "$RUNC_VERSION"*) ;; *) die "runc reports version '$got', expected $RUNC_VERSION" ;; esac
file -b "$new/busybox" | grep -q 'statically linked' || die "busybox is not static"
# runc needs nothing else than glibc and libseccomp (checked without the system's copy).
ldd "$new/runc" | grep -v -E 'linux-vdso|libc\.so|ld-linux|libseccomp' | grep . \
    && die "runc needs more libraries than carried"

# NVIDIA's prebuilt cuda-checkpoint.
git --git-dir="$CUDA_CHECKPOINT_GIT_DIR" show HEAD:bin/x86_64_Linux/cuda-checkpoint >"$new/bin/cuda-checkpoint" \
    || die "bin/x86_64_Linux/cuda-checkpoint not in $CUDA_CHECKPOINT_GIT_DIR"
chmod 755 "$new/bin/cuda-checkpoint"
file -b "$new/bin/cuda-checkpoint" | grep -q 'ELF 64-bit' || die "cuda-checkpoint is not an x86-64 ELF binary"
git --git-dir="$CUDA_CHECKPOINT_GIT_DIR" show HEAD:bin/x86_64_Linux/LICENSE >"$new/bin/cuda-checkpoint.LICENSE" || true
say "cuda-checkpoint from $(git --git-dir="$CUDA_CHECKPOINT_GIT_DIR" log -1 --format='%h %s')"

# CRIU's C plugin, with the load check against .criu's binary.
CRIU_GIT_DIR=$CRIU_GIT_DIR scripts/build-criu-cuda-plugin.sh "$new/cuda_plugin.so" --check

rm -rf "$CARRY"
mv "$new" "$CARRY"
say "made $CARRY:"
find "$CARRY" -type f -printf "    %10s  %P\n" | sort -k2

# What the GPU run carries, and whether it fits.
[ -f "$PLUGIN" ] || say "warning: no plugin at $PLUGIN yet (cargo build --release)"
total=0
for p in .criu "$PLUGIN" "${CARRY#"$REPO"/}"; do
    [ -e "$p" ] || continue
    say "du -sh: $(du -shL "$p" | tr '\t' ' ')"
    total=$((total + $(du -skL "$p" | cut -f1)))
done
say "carried in all: $((total / 1024)) MiB of $LIMIT_MIB MiB"
[ "$total" -le $((LIMIT_MIB * 1024)) ] || die "the carry list is over $LIMIT_MIB MiB"
