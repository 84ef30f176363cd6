#!/usr/bin/env bash
# Install today's runc and containerd beside the Debian 12 ones the container tests use, for
# tests/e2e_containers_2026.rs: runc 1.4 (Debian experimental) and containerd 2.1 with its
# containerd-shim-runc-v2 and ctr (Debian sid), into the private prefix <repo>/.runtimes-2026/.
# Nothing from sid or experimental is installed into the system: packages come from a private
# apt configuration (scripts/lib/private-apt.sh) and are unpacked with `dpkg -x`.
#
# containerd, its shim and ctr run on Debian 12's glibc. Sid's runc needs sid's glibc (2.43),
# and a loader wrapper does not work for it (runc re-executes /proc/self/exe, which would be the
# loader): `patchelf` (Debian 12's package, installed into the system when missing) points its
# ELF interpreter at sid's loader unpacked beside it and its rpath at sid's libraries. The
# interpreter is an absolute path: when the prefix moves, a re-run re-patches it (quickly).
#
# Result:
#   .runtimes-2026/bin/runc                    runc 1.4 (patched, runs directly)
#   .runtimes-2026/bin/containerd              containerd 2.1
#   .runtimes-2026/bin/containerd-shim-runc-v2
#   .runtimes-2026/bin/ctr
# Put .runtimes-2026/bin first on PATH (of the containerd daemon: it finds its shim there, and
# the shim finds runc there).
#
# Usage: scripts/install-runtimes-2026.sh [--force]
#   --force   re-fetch even if the right versions are there
# Environment: RUNTIMES_2026_PREFIX (default <repo>/.runtimes-2026), DEBIAN_MIRROR.
set -euo pipefail

RUNC_VERSION=1.4
CONTAINERD_VERSION=2.1
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
MULTIARCH=x86_64-linux-gnu

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd -P)
PREFIX=${RUNTIMES_2026_PREFIX:-$REPO/.runtimes-2026}
STAMP="runc $RUNC_VERSION, containerd $CONTAINERD_VERSION"

say() { printf '[install-runtimes-2026] %s\n' "$*"; }
die() { printf '[install-runtimes-2026] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; printf "[install-runtimes-2026] ERROR: command failed (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

force=0
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        *) die "unknown argument: $arg (try --help)" ;;
    esac
done

[ "$(uname -m)" = x86_64 ] || die "only x86_64 is supported (this is $(uname -m))"

if ! command -v patchelf >/dev/null; then
    [ "$(id -u)" = 0 ] || die "patchelf is missing; run as root or install Debian's patchelf package"
    say "installing patchelf with the system's apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends patchelf
fi

if command -v flock >/dev/null; then
    exec 9<"$SCRIPT"
    flock -x 9
fi

patch_runc() {
    # $1: the prefix. Interpreter: the prefix's loader; rpath: the prefix's libraries.
    local p=$1
    patchelf --set-interpreter "$p/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" \
        --set-rpath "$p/usr/lib/$MULTIARCH" "$p/usr/sbin/runc"
}

check_prefix() {
    local p=$1
    [ "$(head -n1 "$p/VERSION" 2>/dev/null)" = "$STAMP" ] || return 1
    "$p/bin/runc" --version 2>/dev/null | grep -q "^runc version $RUNC_VERSION\." || return 1
    "$p/bin/containerd" --version 2>/dev/null | grep -q " v\{0,1\}$CONTAINERD_VERSION\." || return 1
    "$p/bin/ctr" --version 2>/dev/null | grep -q " v\{0,1\}$CONTAINERD_VERSION\." || return 1
    [ -x "$p/bin/containerd-shim-runc-v2" ] || return 1
}

if [ "$force" = 0 ] && [ -f "$PREFIX/VERSION" ]; then
    # The prefix may have moved with the repository: re-point runc at its loader.
    [ "$(patchelf --print-interpreter "$PREFIX/usr/sbin/runc" 2>/dev/null)" = "$PREFIX/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" ] \
        || patch_runc "$PREFIX" 2>/dev/null || true
    if check_prefix "$PREFIX"; then
        say "$STAMP already installed in $PREFIX (use --force to reinstall)"
        exit 0
    fi
    say "reinstalling: $PREFIX is incomplete or has other versions"
fi

# shellcheck source=lib/private-apt.sh
. "$REPO/scripts/lib/private-apt.sh"
private_apt_preflight "$PREFIX" "$KEYRING" ""

work=$(mktemp -d "${TMPDIR:-/tmp}/install-runtimes-2026.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs"
private_apt "$work" "sid experimental" "$MIRROR" "$KEYRING"

say "fetching the sid and experimental package indexes from $MIRROR (private)"
apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; die "apt-get update failed"; }

version_of() {
    # $1 package, $2 suite: the newest version of it there.
    apt_ apt-cache madison "$1" | awk -F'|' -v s="$2/main" 'index($3, s) { gsub(/ /, "", $2); print $2; exit }'
}
runc_v=$(version_of runc experimental)
containerd_v=$(version_of containerd sid)
case $runc_v in "$RUNC_VERSION".*) ;; *) die "experimental has runc '$runc_v', expected $RUNC_VERSION.x; update this script deliberately" ;; esac
case $containerd_v in "$CONTAINERD_VERSION".*) ;; *) die "sid has containerd '$containerd_v', expected $CONTAINERD_VERSION.x; update this script deliberately" ;; esac
libc_v=$(version_of libc6 sid)
seccomp_v=$(version_of libseccomp2 sid)
[ -n "$libc_v" ] && [ -n "$seccomp_v" ] || die "no libc6 or libseccomp2 in sid"
pkgs="runc=$runc_v containerd=$containerd_v libc6=$libc_v libseccomp2=$seccomp_v"
say "packages: $pkgs"

say "downloading .debs"
# shellcheck disable=SC2086
(cd "$work/debs" && apt_ apt-get -q download $pkgs >"$work/download.log" 2>&1) \
    || { cat "$work/download.log" >&2; die "apt-get download failed"; }

stage=$PREFIX.new
rm -rf "$stage"
mkdir -p "$stage"
for deb in "$work/debs"/*.deb; do
    dpkg -x "$deb" "$stage"
    dpkg-deb --show --showformat='${Package}=${Version}\n' "$deb" >>"$work/packages"
done
rm -rf "$stage/usr/share" "$stage/etc" "$stage/usr/lib/systemd" "$stage/lib/systemd"
[ -f "$stage/usr/sbin/runc" ] || die "runc not found in its package"
[ -f "$stage/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" ] || die "sid's loader not found in libc6"
mkdir -p "$stage/bin"
ln -s ../usr/sbin/runc "$stage/bin/runc"
for b in containerd containerd-shim-runc-v2 ctr; do
    [ -x "$stage/usr/bin/$b" ] || die "$b not found in containerd's package"
    ln -s "../usr/bin/$b" "$stage/bin/$b"
done
{ echo "$STAMP"; echo "runc $runc_v (experimental), containerd $containerd_v (sid)"; } >"$stage/VERSION"
sort "$work/packages" >"$stage/PACKAGES"

say "installing into $PREFIX"
rm -rf "$PREFIX"
mv "$stage" "$PREFIX"
chmod 755 "$PREFIX"
patch_runc "$PREFIX"
check_prefix "$PREFIX" || die "the installed programs do not run or report other versions: $("$PREFIX/bin/runc" --version 2>&1 | head -n1); $("$PREFIX/bin/containerd" --version 2>&1)"
say "installed $STAMP ($(du -sh "$PREFIX" | cut -f1)) in $PREFIX: $("$PREFIX/bin/runc" --version | head -n1), $("$PREFIX/bin/containerd" --version)"
