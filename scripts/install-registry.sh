#!/usr/bin/env bash
# Install a container image registry for the CRI tests (tests/e2e_cri.rs): Debian 12's
# docker-registry package (the CNCF distribution registry, one static program), unpacked with
# `dpkg -x` into the private prefix <repo>/.registry/ (nothing installed into the system, no
# service started). The tests run it on 127.0.0.1 with storage under their own directory: a
# pod's image must be pulled through the CRI (a checkpoint records the image's repository
# digest, and a restore pulls it again), and the migration test pushes a checkpoint image to it.
#
# Result: .registry/bin/registry
#
# Usage: scripts/install-registry.sh [--force]
# Environment: REGISTRY_PREFIX (default <repo>/.registry).
set -euo pipefail

VERSION=2.8
SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd -P)
PREFIX=${REGISTRY_PREFIX:-$REPO/.registry}

say() { printf '[install-registry] %s\n' "$*"; }
die() { printf '[install-registry] ERROR: %s\n' "$*" >&2; exit 1; }

force=0
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        *) die "unknown argument: $arg (try --help)" ;;
    esac
done

installed() { "$PREFIX/bin/registry" --version 2>/dev/null | grep -q " v\{0,1\}$VERSION\."; }
if [ "$force" = 0 ] && installed; then
    say "docker-registry $VERSION already installed in $PREFIX (use --force to reinstall)"
    exit 0
fi
if [ -e "$PREFIX" ] && [ ! -f "$PREFIX/bin/registry" ]; then
    die "$PREFIX exists and is not this script's: move it away or set REGISTRY_PREFIX"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/install-registry.XXXXXX")
trap 'rm -rf "$work"' EXIT
fetch() { (cd "$work" && apt-get -q download docker-registry) >"$work/download.log" 2>&1; }
if ! fetch; then
    say "refreshing the system's package lists"
    apt-get update -q >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; die "apt-get update failed"; }
    fetch || { cat "$work/download.log" >&2; die "apt-get download docker-registry failed"; }
fi
deb=$(ls "$work"/docker-registry_*.deb)
case $(dpkg-deb --field "$deb" Version) in "$VERSION".*) ;; *) die "docker-registry is $(dpkg-deb --field "$deb" Version), expected $VERSION.x" ;; esac
dpkg -x "$deb" "$work/x"
[ -x "$work/x/usr/bin/docker-registry" ] || die "no /usr/bin/docker-registry in $deb"
rm -rf "$PREFIX"
mkdir -p "$PREFIX/bin"
cp "$work/x/usr/bin/docker-registry" "$PREFIX/bin/registry"
installed || die "$PREFIX/bin/registry does not run: $("$PREFIX/bin/registry" --version 2>&1)"
say "installed $("$PREFIX/bin/registry" --version) in $PREFIX"
