#!/usr/bin/env bash
# Builds an out-of-tree kernel module against the test guest's kernel (scripts/guest/build.sh;
# docs/guest.md), natively on this host: SRC_DIR (a folder whose Kbuild or Makefile names the
# module with obj-m) is copied into a scratch folder of the guest's root tree
# (<guest>/rootfs/build/<name>), built there by chroot with the kernel's own headers
# (/usr/src/linux-headers-<version>, which build.sh unpacks into the root) and the root's gcc,
# and the resulting *.ko are copied to OUT_DIR. The guest's rootfs.img is not re-made:
# scripts/guest/run.sh shares OUT_DIR (give a folder under the checkout, or add it to
# GUEST_SHARES) and the program running there loads the module with insmod.
#
# Prints the kernel version and the path of each module built (on stdout, one per line after
# "kernel <version>"); make's output goes to stderr.
#
# Usage: scripts/guest/build-module.sh SRC_DIR OUT_DIR
# Environment: GUEST_SUITE, GUEST_DIR (which guest; as for build.sh and run.sh). The caller's
# environment (MAKEFLAGS with a jobserver of a make above us among it) stays outside the chroot.
set -euo pipefail

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
HERE=$(dirname "$SCRIPT")

say() { printf '[guest-module] %s\n' "$*" >&2; }
die() { printf '[guest-module] ERROR: %s\n' "$*" >&2; exit 1; }

case ${1:-} in
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
esac
[ $# = 2 ] || die "usage: scripts/guest/build-module.sh SRC_DIR OUT_DIR"
src=$(readlink -f -- "$1") || die "no folder $1"
[ -d "$src" ] || die "no folder $1"
[ -f "$src/Kbuild" ] || [ -f "$src/Makefile" ] || die "$1 has neither a Kbuild nor a Makefile"
mkdir -p "$2"
dest=$(readlink -f -- "$2")
[ "$(id -u)" = 0 ] || die "needs root (chroot into the guest's root)"

# The guest, built when missing (quick when it is there); its folder as build.sh chooses it.
"$HERE/build.sh" >&2 || die "scripts/guest/build.sh failed"
guest=$("$HERE/build.sh" --print-dir)
kver=$("$HERE/build.sh" --print-kernel)
root=$guest/rootfs
headers=/usr/src/linux-headers-$kver
[ -f "$root$headers/Makefile" ] || die "no $headers in $root (rebuild the guest: scripts/guest/build.sh --force)"

# A shared lock on the guest's own lock keeps build.sh from rebuilding or imaging the root while
# a module is built in it; an exclusive one of our own serialises module builds, which share
# the scratch folder's name.
exec 8<>"$guest/.lock"
flock -s 8
exec 9<>"$guest/.module.lock"
flock -x 9

name=$(basename "$src" | tr -c 'A-Za-z0-9._\n-' _)
scratch=/build/$name
rm -rf "$root$scratch"
mkdir -p "$root/build"
trap 'rm -rf "$root$scratch"' EXIT
cp -a "$src" "$root$scratch"
# The build artefacts of an earlier build on the host would be taken as up to date.
find "$root$scratch" \( -name '*.o' -o -name '*.ko' -o -name '*.mod' -o -name '*.mod.c' \
    -o -name '.*.cmd' -o -name Module.symvers -o -name modules.order \) -delete

say "building $src against $kver (chroot $root, make -C $headers M=$scratch modules)"
# The private mount namespace gives make a /proc (kbuild's shell calls read it) that
# disappears with the build; the root already has /dev's nodes from mmdebstrap.
if ! unshare --mount --propagation private sh -c '
        mount -t proc proc "$1/proc" && shift && exec chroot "$@"' sh \
        "$root" "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 \
        make -C "$headers" M="$scratch" -j"$(nproc)" modules >&2; then
    die "the module build of $src failed (against $kver)"
fi

mapfile -t kos < <(cd "$root$scratch" && find . -name '*.ko' | LC_ALL=C sort)
[ ${#kos[@]} -gt 0 ] || die "make built no *.ko from $src (does its Kbuild/Makefile set obj-m?)"
echo "kernel $kver"
for ko in "${kos[@]}"; do
    install -m 0644 "$root$scratch/$ko" "$dest/$(basename "$ko")"
    echo "$dest/$(basename "$ko")"
done
say "built ${#kos[@]} module(s) for $kver into $dest"
