#!/usr/bin/env bash
# Builds the test guest of scripts/guest/run.sh from Debian packages only, into <repo>/.guest/:
# a Debian 13 (trixie, kernel 6.12) kernel, a root file system made by mmdebstrap, and a small
# initramfs that loads the modules the kernel needs to mount that root (virtio_blk, ext4); with
# GUEST_SUITE=bookworm the same of Debian 12 (kernel 6.1), into <repo>/.guest/bookworm/. The guest
# exists to give the container tests a cgroup-v2-only system with every controller, which
# this hybrid host cannot (docs/guest.md).
#
#   .guest/kernel/<version>/   the kernel package unpacked (boot/vmlinuz-<version>, its modules)
#   .guest/vmlinuz             the kernel run.sh boots
#   .guest/initrd.img          busybox (busybox-static) and the root's modules, as newc cpio
#   .guest/rootfs/             the root file system: trixie minbase, the tools the tests call
#                              (util-linux, mount, iproute2, procps, tar, gzip, zstd, xz,
#                              iptables, kmod), gcc, libc6-dev and make (the tests compile their
#                              fixtures when they run; scripts/guest/build-module.sh builds
#                              kernel modules in it), the kernel's modules, and its headers
#                              (linux-headers-<version>-amd64, -common, linux-kbuild) in
#                              /usr/src and /usr/lib/linux-kbuild-*, our init
#   .guest/rootfs.img          that tree as an ext4 image; run.sh boots it with -snapshot, so
#                              that every run starts from the same state
#   .guest/VERSION             the stamp: layout, suite, kernel, package versions
#
# The kernel and busybox come through a private apt configuration (scripts/lib/private-apt.sh),
# never through the system's apt state. The host needs mmdebstrap and mke2fs (e2fsprogs);
# scripts/setup.sh installs them (and QEMU for run.sh).
#
# Quick when already built: the stamp names the layout, the package list and the versions, and a
# tree whose stamp matches is left alone without asking the mirror; changed scripts/guest/init.sh
# only re-makes rootfs.img. --update asks the mirror and rebuilds when trixie has a newer
# kernel; --force rebuilds everything.
#
# The kernel's headers are always unpacked into the root (at the absolute paths their Makefile
# names), so that scripts/guest/build-module.sh can build a module against the guest's kernel
# by chroot; --headers is accepted for older callers and does nothing more.
#
# Usage: scripts/guest/build.sh [--force] [--update] [--headers] [--print-kernel] [--print-dir]
#   --print-kernel   prints the built kernel's version and exits
#   --print-dir      prints the guest's folder and exits
# Environment: GUEST_SUITE (default trixie; bookworm: Debian 12, kernel 6.1, the same layout,
# its own folder), GUEST_DIR (default <repo>/.guest for trixie, <repo>/.guest/bookworm for
# bookworm), DEBIAN_MIRROR.
set -euo pipefail

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
HERE=$(dirname "$SCRIPT")
REPO=$(cd "$HERE/../.." && pwd -P)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${GUEST_SUITE:-trixie}
# Each suite its own folder: trixie's the original .guest, another's inside it (ignored by git
# with it), so that both guests can stay built.
case $SUITE in
    trixie) OUT=${GUEST_DIR:-$REPO/.guest} ;;
    bookworm) OUT=${GUEST_DIR:-$REPO/.guest/$SUITE} ;;
    *) printf '[guest-build] ERROR: GUEST_SUITE %s: trixie (Debian 13) or bookworm (Debian 12)\n' "$SUITE" >&2; exit 1 ;;
esac
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
# Bumped when what this script makes changes shape.
LAYOUT=2
# What the root file system holds beyond minbase: the tools the tests and runtimes call, and
# make and pahole for kernel modules (build-module.sh; Debian's kernels give modules BTF).
PACKAGES="kmod util-linux mount iproute2 procps tar gzip zstd xz-utils iptables gcc libc6-dev binutils make pahole openssl curl"
# The modules the initramfs loads (with what they depend on) to mount the root; those a kernel
# has built in are left out. virtio_pci is built into 6.12 and may be a module of 6.1.
ROOT_MODULES="virtio_blk crc32c_generic ext4"
[ "$SUITE" = trixie ] || ROOT_MODULES="virtio_pci $ROOT_MODULES"

say() { printf '[guest-build] %s\n' "$*" >&2; }
die() { printf '[guest-build] ERROR: %s\n' "$*" >&2; exit 1; }

force=0 update=0
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        --update) update=1 ;;
        --headers) ;; # the headers are always in the root now
        --print-dir) echo "$OUT"; exit 0 ;;
        --print-kernel) sed -n 's/^kernel //p' "$OUT/VERSION" 2>/dev/null | grep . || die "no guest built in $OUT"; exit 0 ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        *) die "unknown argument: $arg (try --help)" ;;
    esac
done

[ "$(uname -m)" = x86_64 ] || die "only x86_64 is supported"
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap's root mode, file ownership in the image)"
for tool in mmdebstrap mkfs.ext4 apt-get dpkg; do
    command -v "$tool" >/dev/null || die "$tool is missing: run scripts/setup.sh (it installs what the guest needs)"
done

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock -x 9

init_sum=$(sha256sum "$HERE/init.sh" "$HERE/initramfs-init.sh" | sha256sum | cut -c1-16)
wanted_head="guest layout $LAYOUT suite $SUITE packages $(echo "$PACKAGES" | tr ' ' ',') initramfs $(echo "$ROOT_MODULES" | tr ' ' ',')"

# ---- the quick path -----------------------------------------------------------------------

complete() {
    [ "$(head -n1 "$OUT/VERSION" 2>/dev/null)" = "$wanted_head" ] \
        && [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/initrd.img" ] && [ -d "$OUT/rootfs/usr" ]
}

make_image() {
    # rootfs.img from rootfs/, with our init (re-made when init.sh changed). A module build
    # killed before it cleaned up must not leave its scratch folder in the image.
    rm -rf "$OUT/rootfs/build"
    install -m 0755 "$HERE/init.sh" "$OUT/rootfs/sbin/guest-init"
    local size
    # The tree plus room for what a run writes before tmpfs takes over (logs, apt state).
    size=$(( $(du -sm "$OUT/rootfs" | cut -f1) + 512 ))
    rm -f "$OUT/rootfs.img.new"
    mkfs.ext4 -q -F -L guest-root -d "$OUT/rootfs" "$OUT/rootfs.img.new" "${size}M"
    mv "$OUT/rootfs.img.new" "$OUT/rootfs.img"
    echo "$init_sum" >"$OUT/rootfs.img.init"
}

install_headers() {
    # $1 kernel package, $2 its version: linux-headers-<version> (and what of linux-headers-* and
    # linux-kbuild-* it depends on) unpacked into the root, where its Makefile expects them:
    # /usr/src/linux-headers-<version> includes the -common tree by its absolute path, and its
    # scripts link relatively to /usr/lib/linux-kbuild-*.
    local kver=${1#linux-image-} version=$2 want deb
    want=$(apt_ apt-cache depends "linux-headers-$kver" 2>/dev/null \
        | awk '/Depends:/ && $2 ~ /^linux-(headers|kbuild)-/ { print $2 }' | sort -u)
    say "unpacking into the root: linux-headers-$kver $(echo "$want" | tr '\n' ' ')"
    mkdir -p "$work/hdebs"
    (cd "$work/hdebs" && apt_ apt-get -q download "linux-headers-$kver=$version" $want >/dev/null)
    # Unpacked aside, then copied in: bookworm's packages still name /lib (/lib/modules/<ver>/build),
    # and dpkg-deb -x straight into the merged-/usr root would put a folder in place of its /lib
    # link, and the root would not boot.
    rm -rf "$work/hroot"
    mkdir -p "$work/hroot"
    for deb in "$work"/hdebs/*.deb; do dpkg-deb -x "$deb" "$work/hroot"; done
    local top dest
    for top in "$work"/hroot/*; do
        dest=$OUT/rootfs/${top##*/}
        [ ! -L "$dest" ] || dest=$OUT/rootfs/$(readlink "$dest")
        mkdir -p "$dest"
        cp -a "$top/." "$dest/"
    done
    [ -f "$OUT/rootfs/usr/src/linux-headers-$kver/Makefile" ] \
        || die "no /usr/src/linux-headers-$kver/Makefile in the root after unpacking the headers"
    (cd "$work/hdebs" && for deb in *.deb; do dpkg-deb -f "$deb" Package Version | paste -sd' '; done) \
        >"$OUT/headers.txt"
}

work=""
private_setup() {
    [ -n "$work" ] && return 0
    # shellcheck source=../lib/private-apt.sh
    . "$REPO/scripts/lib/private-apt.sh"
    [ -r "$KEYRING" ] || die "$KEYRING not found; install the 'debian-archive-keyring' package"
    work=$(mktemp -d "${TMPDIR:-/tmp}/guest-build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    private_apt "$work" "$SUITE" "$MIRROR" "$KEYRING"
    say "fetching the $SUITE package indexes from $MIRROR (private)"
    apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 \
        || { cat "$work/update.log" >&2; die "apt-get update failed"; }
}

candidate() { apt_ apt-cache policy "$1" | awk '/Candidate:/ { print $2 }'; }

if [ "$force" = 0 ] && [ "$update" = 0 ] && complete; then
    kver=$(sed -n 's/^kernel //p' "$OUT/VERSION")
    if [ "$(cat "$OUT/rootfs.img.init" 2>/dev/null)" != "$init_sum" ] || [ ! -f "$OUT/rootfs.img" ]; then
        say "init changed: re-making rootfs.img"
        make_image
    fi
    say "guest already built in $OUT (kernel $kver; --update to look for a newer one, --force to rebuild)"
    exit 0
fi

# ---- what trixie has now ------------------------------------------------------------------

private_setup
kpkg=$(apt_ apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ { print $2; exit }')
[ -n "$kpkg" ] || die "linux-image-amd64 of $SUITE depends on no linux-image package"
kver=${kpkg#linux-image-}
kpkg_version=$(candidate "$kpkg")
bb_version=$(candidate busybox-static)
if [ "$force" = 0 ] && complete && [ "$(sed -n 's/^kernel //p' "$OUT/VERSION")" = "$kver" ] \
    && grep -qx "kernel-package $kpkg $kpkg_version" "$OUT/VERSION"; then
    say "guest in $OUT is current (kernel $kver)"
    exit 0
fi

say "building the guest: kernel $kpkg $kpkg_version, busybox-static $bb_version, $SUITE minbase + $PACKAGES"
t0=$(date +%s)
rm -rf "$OUT/kernel" "$OUT/rootfs" "$OUT/rootfs.img" "$OUT/rootfs.img.init" "$OUT/initrd.img" \
    "$OUT/vmlinuz" "$OUT/VERSION" "$OUT/headers" "$OUT/headers.txt"
mkdir -p "$work/debs" "$OUT/kernel/$kver"
(cd "$work/debs" && apt_ apt-get -q download "$kpkg=$kpkg_version" "busybox-static=$bb_version" >/dev/null)
dpkg-deb -x "$work"/debs/linux-image-*.deb "$OUT/kernel/$kver"
dpkg-deb -x "$work"/debs/busybox-static_*.deb "$work/busybox"
cp "$OUT/kernel/$kver/boot/vmlinuz-$kver" "$OUT/vmlinuz"

# ---- the root file system -----------------------------------------------------------------

say "mmdebstrap $SUITE (minbase)"
mmdebstrap --quiet --variant=minbase --mode=root \
    --include="$(echo "$PACKAGES" | tr ' ' ',')" \
    --aptopt='Acquire::Languages "none"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    "$SUITE" "$OUT/rootfs" "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >&2
mkdir -p "$OUT/rootfs/usr/lib/modules"
# trixie's kernel package has its modules in /usr/lib, bookworm's in /lib (both roots merged-usr).
kmods=$OUT/kernel/$kver/usr/lib/modules/$kver
[ -d "$kmods" ] || kmods=$OUT/kernel/$kver/lib/modules/$kver
[ -d "$kmods" ] || die "no modules/$kver in $kpkg"
cp -a "$kmods" "$OUT/rootfs/usr/lib/modules/"
chroot "$OUT/rootfs" depmod -a "$kver"
install_headers "$kpkg" "$kpkg_version"
echo guest >"$OUT/rootfs/etc/hostname"
printf '127.0.0.1 localhost guest\n::1 localhost\n' >"$OUT/rootfs/etc/hosts"
: >"$OUT/rootfs/etc/fstab"
# What the tests read of the distribution (for messages only).
dpkg-query --admindir="$OUT/rootfs/var/lib/dpkg" -W -f '${Package} ${Version}\n' >"$OUT/packages.txt"

# ---- the initramfs ------------------------------------------------------------------------

# The root's modules and their dependencies, in load order (modules.dep lists a module's
# dependencies deepest last), decompressed: busybox's insmod reads plain ELF. A module built
# into the kernel (modules.builtin) needs no loading.
order() {
    local m path deps d
    for m in "$@"; do
        if awk -v m="$m" '{ n = $1; sub(/.*\//, "", n); sub(/\.ko$/, "", n); gsub(/-/, "_", n) }
            n == m { found = 1; exit } END { exit !found }' "$OUT/rootfs/usr/lib/modules/$kver/modules.builtin"; then
            continue
        fi
        path=$(awk -F: -v m="$m" '{ n = $1; sub(/.*\//, "", n); sub(/\.ko(\.xz|\.zst|\.gz)?$/, "", n); gsub(/-/, "_", n) }
            n == m { print; exit }' "$OUT/rootfs/usr/lib/modules/$kver/modules.dep")
        [ -n "$path" ] || die "module $m not in modules.dep of $kver"
        deps=${path#*:}
        for d in $(echo "$deps" | tr ' ' '\n' | tac); do echo "$d"; done
        echo "${path%%:*}"
    done | awk '!seen[$0]++'
}
ird=$work/initrd
mkdir -p "$ird/bin" "$ird/lib/modules" "$ird/proc" "$ird/sys" "$ird/dev" "$ird/newroot"
# trixie's busybox-static has it in /usr/bin, bookworm's in /bin.
for bb in "$work/busybox/usr/bin/busybox" "$work/busybox/bin/busybox" ""; do [ ! -f "$bb" ] || break; done
[ -n "$bb" ] || die "no busybox in busybox-static $bb_version"
cp "$bb" "$ird/bin/busybox"
install -m 0755 "$HERE/initramfs-init.sh" "$ird/init"
: >"$ird/lib/modules/order"
for rel in $(order $ROOT_MODULES); do
    name=$(basename "$rel"); name=${name%.xz}
    case $rel in
        *.xz) xz -dc "$OUT/rootfs/usr/lib/modules/$kver/$rel" >"$ird/lib/modules/$name" ;;
        *) cp "$OUT/rootfs/usr/lib/modules/$kver/$rel" "$ird/lib/modules/$name" ;;
    esac
    echo "$name" >>"$ird/lib/modules/order"
done
(cd "$ird" && find . | LC_ALL=C sort | "$ird/bin/busybox" cpio -o -H newc 2>/dev/null) | gzip -9n >"$OUT/initrd.img"

make_image

{
    echo "$wanted_head"
    echo "kernel $kver"
    echo "kernel-package $kpkg $kpkg_version"
    echo "busybox-static $bb_version"
    sed 's/^/headers /' "$OUT/headers.txt"
    echo "mirror $MIRROR"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - t0 )) s"
} >"$OUT/VERSION"
say "built in $(( $(date +%s) - t0 )) s: $OUT (kernel $kver, initramfs modules: $(tr '\n' ' ' <"$ird/lib/modules/order"))"
