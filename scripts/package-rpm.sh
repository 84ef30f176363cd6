#!/usr/bin/env bash
# Builds the RPM of the plugin (Fedora and openSUSE layout: /usr/lib64/criu/gpu_plugin.so) from
# this source tree with packaging/rpm/criu-gpu-plugin.spec, `rpmbuild -bb --build-in-place`,
# into target/package/. Works on an RPM distribution and on Debian or Ubuntu with their `rpm`
# package (installed with apt-get if rpmbuild is missing and we are root); there the build
# dependencies are checked here, since rpm's own database knows no packages.
# Prints the path of the .rpm as its last line.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"

say() { printf '[package-rpm] %s\n' "$*"; }
die() { printf '[package-rpm] ERROR: %s\n' "$*" >&2; exit 1; }

SPEC=packaging/rpm/criu-gpu-plugin.spec
OUT=$REPO/target/package

[ "$(uname -m)" = x86_64 ] || die "the spec is for x86_64; this machine is $(uname -m)"
command -v cargo >/dev/null || die "cargo (Rust) is needed"
command -v cc >/dev/null || die "a C toolchain (gcc) is needed as the linker"
if ! command -v rpmbuild >/dev/null; then
    if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
        die "rpmbuild is needed (package rpm-build, or rpm on Debian and Ubuntu)"
    fi
    say "installing rpm (rpmbuild)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends rpm
fi

pkgid=$(cargo pkgid --locked -p criu-gpu-plugin)
upstream=${pkgid##*[@#]}
spec_version=$(sed -n 's/^Version: *//p' "$SPEC")
[ "$spec_version" = "$upstream" ] ||
    die "$SPEC has Version $spec_version but Cargo.toml says $upstream: update Version and %changelog"

opts=()
# An rpm database that does not know rpm itself belongs to a non-RPM system.
rpm -q rpm >/dev/null 2>&1 || opts+=(--nodeps)
# Debian's /bin/sh is dash, which cannot run rpm's brp-compress.
[ "$(readlink -f /bin/sh)" = "$(readlink -f /bin/bash)" ] ||
    opts+=(--define "__brp_compress bash %{_rpmconfigdir}/brp-compress %{?_prefix}")

top=$OUT/rpmbuild
rm -rf "$top"
rm -f "$OUT"/criu-gpu-plugin-*.rpm
mkdir -p "$top"
say "rpmbuild -bb --build-in-place $SPEC"
rpmbuild -bb --build-in-place --define "_topdir $top" "${opts[@]}" "$SPEC"
rpm_file=$(find "$top/RPMS" -name "criu-gpu-plugin-$upstream-*.x86_64.rpm" | head -n 1)
[ -n "$rpm_file" ] || die "rpmbuild made no criu-gpu-plugin-$upstream RPM"
cp "$rpm_file" "$OUT/"
rpm_file=$OUT/${rpm_file##*/}
rpm -qip "$rpm_file"
rpm -qlvp "$rpm_file"
say "conffiles: $(rpm -qp --configfiles "$rpm_file" | tr '\n' ' ')"
echo "$rpm_file"
