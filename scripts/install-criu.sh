#!/usr/bin/env bash
# Install CRIU into <repo>/.criu/ (or, with --release, <repo>/.criu-RELEASE/) as a private,
# relocatable prefix.
#
# Debian 12's own CRIU (3.17.1) cannot checkpoint on the kernels we use, so we
# take Debian 13 (trixie)'s build instead. That build needs glibc >= 2.38, which
# Debian 12 does not have, so the prefix carries trixie's libc and dynamic
# loader too, and .criu/bin/criu runs criu through that loader. Nothing from
# trixie is installed into the system: packages are fetched with a private apt
# configuration and unpacked with `dpkg -x`.
#
# The wrapper finds the prefix from its own location at run time, so the whole
# .criu folder can be copied to another machine (e.g. Ubuntu 24.04) at any path.
#
# Other releases: --release 4.2.1 (Debian sid) or --release 4.3 (Debian experimental, 4.3-1~exp2),
# or any later upstream release Debian has in sid or experimental, installs into a prefix of its
# own, <repo>/.criu-RELEASE/. Their criu and libcompel1 come from the newest sid or experimental
# package of that upstream version (pinned), every other library from sid (libnet9, libnl-3 >=
# 3.11, ...), and glibc with its loader from trixie, as for 4.1.1. Use one with
# CRIU_BIN=<repo>/.criu-RELEASE/bin/criu.
#
# Usage: scripts/install-criu.sh [--release R] [--force] [--no-system-deps]
#   --release R       upstream CRIU release to install (default 4.1.1, from trixie, into .criu)
#   --force           reinstall even if the right version is already there
#   --no-system-deps  do not apt-get install the host tools the tests use
# Environment: CRIU_PREFIX (default <repo>/.criu, or <repo>/.criu-R for --release R other
# than 4.1.1), DEBIAN_MIRROR.
set -euo pipefail

DEFAULT_VERSION=4.1.1
CRIU_VERSION=$DEFAULT_VERSION
SUITE=trixie
# Suites searched for a --release other than the default; packages of experimental are used
# only where pinned (criu, libcompel1), as experimental is NotAutomatic.
NEWER_SUITES="trixie sid experimental"
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
MULTIARCH=x86_64-linux-gnu

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd -P)

say() { printf '[install-criu] %s\n' "$*"; }
die() { printf '[install-criu] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; printf "[install-criu] ERROR: command failed (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

force=0
system_deps=1
while [ $# -gt 0 ]; do
    case $1 in
        --force) force=1 ;;
        --no-system-deps) system_deps=0 ;;
        --release) [ $# -ge 2 ] || die "--release needs a value (e.g. 4.3)"; CRIU_VERSION=$2; shift ;;
        --release=*) CRIU_VERSION=${1#--release=} ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        *) die "unknown argument: $1 (try --help)" ;;
    esac
    shift
done
printf '%s\n' "$CRIU_VERSION" | grep -Eqx '[0-9]+\.[0-9]+(\.[0-9]+)?' \
    || die "--release wants an upstream CRIU version such as 4.3 or 4.2.1, not '$CRIU_VERSION'"
if [ "$CRIU_VERSION" = "$DEFAULT_VERSION" ]; then
    PREFIX=${CRIU_PREFIX:-$REPO/.criu}
else
    PREFIX=${CRIU_PREFIX:-$REPO/.criu-$CRIU_VERSION}
fi

[ "$(uname -m)" = x86_64 ] || die "only x86_64 is supported (this is $(uname -m))"
case $PREFIX in
    *:*) die "prefix path must not contain ':' (the loader's --library-path is ':'-separated): $PREFIX" ;;
esac

# Host tools the tests rely on, as "command:debian-package".
HOST_TOOLS="gcc:gcc setsid:util-linux pgrep:procps readlink:coreutils"

ensure_host_tools() {
    local missing="" pair
    for pair in $HOST_TOOLS; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing="$missing ${pair#*:}"
    done
    [ -n "$missing" ] || return 0
    if [ "$system_deps" = 0 ]; then
        say "warning: missing host packages (not installed because of --no-system-deps):$missing"
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "missing host packages:$missing; run as root or install them yourself"
    command -v apt-get >/dev/null || die "missing host packages:$missing, and there is no apt-get to install them"
    say "installing host packages with the system's apt:$missing"
    apt-get update -q
    # shellcheck disable=SC2086  # word splitting is wanted: a list of packages
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
}

installed_version() {
    # Prints the version the prefix's criu reports, or nothing.
    [ -x "$PREFIX/bin/criu" ] || return 0
    "$PREFIX/bin/criu" --version 2>/dev/null | sed -n 's/^Version: *//p' || true
}

ensure_host_tools

# Serialise concurrent runs (the lock is on this script file, so no stray lock file).
if command -v flock >/dev/null; then
    exec 9<"$SCRIPT"
    flock -x 9
fi

have=$(installed_version)
if [ "$force" = 0 ] && [ "$have" = "$CRIU_VERSION" ] \
    && [ "$(head -n1 "$PREFIX/VERSION" 2>/dev/null)" = "$CRIU_VERSION" ]; then
    say "CRIU $CRIU_VERSION already installed in $PREFIX (use --force to reinstall)"
    exit 0
fi
[ -n "$have" ] && say "reinstalling: $PREFIX has CRIU '$have', want $CRIU_VERSION (stamp: $(head -n1 "$PREFIX/VERSION" 2>/dev/null || echo none))"

# shellcheck source=lib/private-apt.sh
. "$REPO/scripts/lib/private-apt.sh"
private_apt_preflight "$PREFIX" "$KEYRING" " to fetch CRIU"

work=$(mktemp -d "${TMPDIR:-/tmp}/install-criu.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/stage"
if [ "$CRIU_VERSION" = "$DEFAULT_VERSION" ]; then
private_apt "$work" "$SUITE" "$MIRROR" "$KEYRING"

say "fetching the $SUITE package index from $MIRROR (private, not in the system's apt lists)"
apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; die "apt-get update for $SUITE failed"; }

deb_version=$(apt_ apt-cache show --no-all-versions criu 2>/dev/null | sed -n 's/^Version: *//p' | head -n1)
[ -n "$deb_version" ] || die "no 'criu' package in $SUITE"
upstream=${deb_version#*:}
upstream=${upstream%-*}
[ "$upstream" = "$CRIU_VERSION" ] || die "$SUITE has criu $deb_version, expected upstream $CRIU_VERSION; update CRIU_VERSION in this script deliberately"

# Run-time dependency closure (Depends and Pre-Depends only: Recommends such as
# iproute2 and python3-pycriu are not needed for check/dump/restore/swrk).
# Lines starting with '<' are virtual packages, which are satisfied by real ones in the list.
pkgs=$(apt_ apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances criu | grep -E '^[a-z0-9]' | sort -u)
echo "$pkgs" | grep -qx criu || die "dependency resolution did not return criu itself"
say "packages ($(echo "$pkgs" | wc -l)): $(echo "$pkgs" | tr '\n' ' ')"
else
# A newer release: criu and libcompel1 from sid or experimental, pinned to the newest package
# of that upstream version; glibc (and its loader) from trixie; everything else at its newest
# in trixie/sid, i.e. from sid. apt's own resolver picks the closure (against an empty dpkg
# status), so every versioned dependency (libnl-3-200 >= 3.11, libc6 >= 2.38, ...) is checked.
private_apt "$work" "$NEWER_SUITES" "$MIRROR" "$KEYRING"

say "fetching the ${NEWER_SUITES// /, } package indexes from $MIRROR (private, not in the system's apt lists)"
apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; die "apt-get update for $NEWER_SUITES failed"; }

# "criu | 4.3-1~exp2 | http://deb.debian.org/debian experimental/main amd64 Packages", newest first.
deb_version="" SUITE=""
while IFS='|' read -r _ v src; do
    v=$(echo "$v" | tr -d ' ')
    u=${v#*:}; u=${u%-*}
    if [ "$u" = "$CRIU_VERSION" ]; then
        deb_version=$v
        SUITE=$(echo "$src" | awk '{ print $2 }'); SUITE=${SUITE%%/*}
        break
    fi
done < <(apt_ apt-cache madison criu 2>/dev/null)
if [ -z "$deb_version" ]; then
    die "no criu package of upstream version $CRIU_VERSION in $NEWER_SUITES (there are: $(apt_ apt-cache madison criu | awk -F'|' '{ gsub(/ /, "", $2); printf "%s ", $2 }'))"
fi
[ "$SUITE" != trixie ] || die "criu $CRIU_VERSION is trixie's: install it without --release"
say "criu $CRIU_VERSION is Debian $SUITE's package $deb_version"

private_apt_pin "criu libcompel1" "version $deb_version" 1001
private_apt_pin "libc6" "release n=trixie" 1001
cand=$(apt_ apt-cache policy libcompel1 | sed -n 's/^ *Candidate: *//p')
[ "$cand" = "$deb_version" ] || die "no libcompel1 $deb_version next to criu $deb_version (candidate: ${cand:-none})"

# Run-time dependency closure (Depends and Pre-Depends only: Recommends such as
# iproute2 and python3-pycriu are not needed for check/dump/restore/swrk).
apt_ apt-get -s -q install --no-install-recommends criu >"$work/resolve.log" 2>&1 \
    || { cat "$work/resolve.log" >&2; die "apt could not resolve criu $deb_version's dependencies"; }
# "Inst libnet9 (1.3+dfsg-3+b2 Debian:unstable [amd64])" -> libnet9=1.3+dfsg-3+b2
pkgs=$(sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) .*/\1=\2/p' "$work/resolve.log" | sort -u)
echo "$pkgs" | grep -qx "criu=$deb_version" || { cat "$work/resolve.log" >&2; die "dependency resolution did not return criu $deb_version itself"; }
echo "$pkgs" | grep -q '^libc6=' || die "dependency resolution did not return libc6"
say "packages ($(echo "$pkgs" | wc -l)): $(echo "$pkgs" | tr '\n' ' ')"
fi

say "downloading .debs"
# shellcheck disable=SC2086
(cd "$work/debs" && apt_ apt-get -q download $pkgs >"$work/download.log" 2>&1) \
    || { cat "$work/download.log" >&2; die "apt-get download failed"; }

stage=$work/stage
for deb in "$work/debs"/*.deb; do
    dpkg -x "$deb" "$stage"
    dpkg-deb --show --showformat='${Package}=${Version}\n' "$deb" >>"$work/packages"
done

# Trim what criu never reads: docs, manuals, translations, iconv modules.
rm -rf "$stage/usr/share/doc" "$stage/usr/share/man" "$stage/usr/share/info" \
    "$stage/usr/share/locale" "$stage/usr/share/lintian" "$stage/usr/share/bug" \
    "$stage/usr/lib/$MULTIARCH/gconv"
rmdir "$stage/usr/share" 2>/dev/null || true

loader_rel=usr/lib/$MULTIARCH/ld-linux-x86-64.so.2
[ -f "$stage/$loader_rel" ] || die "trixie's loader not found at $loader_rel"
[ -x "$stage/usr/sbin/criu" ] || die "criu binary not found at usr/sbin/criu"

# The loader is started through a symlink named "criu" so that the process's
# comm (ps, pgrep) reads "criu" rather than "ld-linux-x86-64".
mkdir -p "$stage/bin" "$stage/libexec"
ln -s "../$loader_rel" "$stage/libexec/criu"

# The wrapper (scripts/lib/criu-wrapper.sh); a --release prefix names its release on line 2.
if [ "$CRIU_VERSION" = "$DEFAULT_VERSION" ]; then
    cp "$REPO/scripts/lib/criu-wrapper.sh" "$stage/bin/criu"
else
    sed "2s|.*|# CRIU $CRIU_VERSION from Debian $SUITE ($deb_version) in a private prefix, with sid's libraries and trixie's glibc (made by scripts/install-criu.sh --release $CRIU_VERSION).|" \
        "$REPO/scripts/lib/criu-wrapper.sh" >"$stage/bin/criu"
fi
chmod 755 "$stage/bin/criu"

# Every library criu needs must resolve inside the prefix, not from the host.
say "checking library resolution under the private loader"
list=$(env -u LD_LIBRARY_PATH "$stage/$loader_rel" --library-path "$stage/usr/lib/$MULTIARCH" \
        --list "$stage/usr/sbin/criu") || die "the private loader could not load criu"
printf '%s\n' "$list" | sed 's/^/    /'
bad=$(printf '%s\n' "$list" | awk -v p="$stage/" '
    /not found/ { print; next }
    /=>/ { if (index($3, p) != 1) print }')
[ -z "$bad" ] || die "libraries not resolved from the prefix:"$'\n'"$bad"

got=$(env -u LD_LIBRARY_PATH "$stage/bin/criu" --version | sed -n 's/^Version: *//p')
[ "$got" = "$CRIU_VERSION" ] || die "staged criu reports version '$got', expected $CRIU_VERSION"

{ echo "$CRIU_VERSION"; echo "debian $SUITE criu $deb_version"; } >"$stage/VERSION"
sort "$work/packages" >"$stage/PACKAGES"

say "installing into $PREFIX"
rm -rf "$PREFIX"
mkdir -p "$(dirname "$PREFIX")"
mv "$stage" "$PREFIX"
chmod 755 "$PREFIX"

# Checked again from the final place: the move doubles as a relocation test.
got=$(installed_version)
[ "$got" = "$CRIU_VERSION" ] || die "installed criu reports version '$got', expected $CRIU_VERSION"

say "installed CRIU $got ($(du -sh "$PREFIX" | cut -f1)) at $PREFIX/bin/criu"
if [ "$(id -u)" = 0 ]; then
    # Informational: a build container may lack the privileges criu check needs.
    if out=$("$PREFIX/bin/criu" check 2>&1); then
        say "criu check: $out"
    else
        say "warning: 'criu check' failed here (kernel or privileges?):"
        printf '%s\n' "$out" | sed 's/^/    /' >&2
    fi
fi
if [ "$CRIU_VERSION" = "$DEFAULT_VERSION" ]; then
    say "use it via CRIU_BIN=$PREFIX/bin/criu, or: source scripts/criu-env.sh"
else
    say "use it via CRIU_BIN=$PREFIX/bin/criu"
fi
