#!/usr/bin/env bash
# Builds the Debian package criu-gpu-plugin_<version>_amd64.deb into target/package/:
# the release plugin as /usr/lib/criu/gpu_plugin.so (CRIU's default plugin directory on Debian
# and Ubuntu), the operator's tool /usr/bin/criu-gpu, the commented example
# /etc/criu/gpu-plugin.conf (a conffile), the manual pages criu-gpu-plugin(7) and criu-gpu(8),
# the copyright file and changelog.Debian.gz. Sources: packaging/.
#
# Needs only cargo, dpkg-deb, binutils (objdump) and gzip, no debhelper: on a Debian 12
# machine set up by scripts/setup.sh all are there; binutils is installed with apt-get if
# missing.
# If lintian is installed it is run and its report printed; it never fails the build.
#
# The package version is Cargo.toml's version plus the Debian revision of the newest entry of
# packaging/deb/changelog, whose upstream part must equal Cargo.toml's version.
# Prints the path of the .deb as its last line.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"

say() { printf '[package-deb] %s\n' "$*"; }
die() { printf '[package-deb] ERROR: %s\n' "$*" >&2; exit 1; }

PKG=criu-gpu-plugin
ARCH=amd64
SRC=packaging
OUT=target/package

[ "$(uname -m)" = x86_64 ] || die "the package is for amd64; this machine is $(uname -m)"
command -v cargo >/dev/null || die "cargo (Rust) is needed"
command -v dpkg-deb >/dev/null || die "dpkg-deb is needed (package dpkg)"
command -v gzip >/dev/null || die "gzip is needed"
if ! command -v objdump >/dev/null; then
    [ "$(id -u)" = 0 ] || die "objdump is needed (package binutils); run as root or install it"
    say "installing binutils (objdump)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends binutils
fi

# Version: Cargo's, checked against the changelog's newest entry.
pkgid=$(cargo pkgid --locked -p "$PKG")
upstream=${pkgid##*[@#]}
head=$(head -n 1 "$SRC/deb/changelog")
version=$(printf '%s\n' "$head" | sed -n "s/^$PKG (\([^)]*\)) .*/\1/p")
[ -n "$version" ] || die "cannot read the version from the first line of $SRC/deb/changelog: $head"
if [ "${version%-*}" != "$upstream" ] || [ "${version%-*}" = "$version" ]; then
    die "$SRC/deb/changelog's newest entry is $version but Cargo.toml says $upstream: add an entry '$PKG ($upstream-1) ...'"
fi
trailer=$(grep -m 1 '^ -- ' "$SRC/deb/changelog")
maintainer=$(printf '%s\n' "$trailer" | sed -n 's/^ -- \(.*>\)  .*/\1/p')
changelog_date=$(printf '%s\n' "$trailer" | sed -n 's/^ -- .*>  //p')
if [ -z "$maintainer" ] || [ -z "$changelog_date" ]; then
    die "malformed trailer line in $SRC/deb/changelog: $trailer"
fi
# Reproducible timestamps: the changelog's date, unless the caller set one.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(date -d "$changelog_date" +%s)}
export SOURCE_DATE_EPOCH

say "cargo build --release --locked ($PKG $version, and criu-gpu)"
# Two cargo runs: one run builds every crate once, with the union of the features its packages
# ask for, so the plugin built with criu-gpu would carry what criu-gpu's dependencies turn on in
# crates they share (libc, nix, ...) and would not be the file the end-to-end suites load
# (scripts/test.sh builds it alone, as here, and checks the two are the same bytes).
cargo build --release --locked -p "$PKG" --lib
cargo build --release --locked -p criu-gpu
so=target/release/libcriu_gpu_plugin.so
tool=target/release/criu-gpu
[ -f "$so" ] || die "$so was not built"
[ -x "$tool" ] || die "$tool was not built"

stage=$OUT/deb/${PKG}_${version}_$ARCH
deb=$OUT/${PKG}_${version}_$ARCH.deb
rm -rf "$OUT/deb"
rm -f "$OUT/${PKG}"_*_"$ARCH".deb
umask 022
mkdir -p "$stage/DEBIAN"

# The plugin and the tool as the build made them (the release profile strips them, as Debian
# policy asks): the plugin shipped is the file the end-to-end suites loaded; 0644: dlopen
# needs no execute bit.
install -D -m 0644 "$so" "$stage/usr/lib/criu/gpu_plugin.so"
install -D -m 0755 "$tool" "$stage/usr/bin/criu-gpu"
chmod 0755 "$stage/usr/bin/criu-gpu"

install -D -m 0644 "$SRC/gpu-plugin.conf" "$stage/etc/criu/gpu-plugin.conf"

doc=$stage/usr/share/doc/$PKG
install -D -m 0644 "$SRC/deb/copyright" "$doc/copyright"
gzip -9n -c "$SRC/deb/changelog" >"$doc/changelog.Debian.gz"

install -D -m 0644 "$SRC/deb/lintian-overrides" "$stage/usr/share/lintian/overrides/$PKG"

man=$stage/usr/share/man/man7
install -d "$man"
# The page's footer carries the package version.
sed "s/^\(\.TH .*\)\"criu\\\\-gpu\\\\-plugin\"/\1\"criu\\\\-gpu\\\\-plugin $upstream\"/" \
    "$SRC/criu-gpu-plugin.7" | gzip -9n >"$man/criu-gpu-plugin.7.gz"
install -d "$stage/usr/share/man/man8"
sed "s/^\(\.TH .*\)\"criu\\\\-gpu\\\\-plugin\"/\1\"criu\\\\-gpu\\\\-plugin $upstream\"/" \
    "$SRC/criu-gpu.8" | gzip -9n >"$stage/usr/share/man/man8/criu-gpu.8.gz"
chmod 0644 "$doc/changelog.Debian.gz" "$man/criu-gpu-plugin.7.gz" "$stage/usr/share/man/man8/criu-gpu.8.gz"

# Depends from the libraries the plugin and the tool link and the newest symbol version they
# need of each.
binaries=("$stage/usr/lib/criu/gpu_plugin.so" "$stage/usr/bin/criu-gpu")
newest() { # newest() PREFIX: the highest PREFIX_x.y version the binaries reference
    objdump -T "${binaries[@]}" | grep -o "(${1}_[0-9.]*)" | tr -d '()' |
        sed "s/^${1}_//" | sort -uV | tail -n 1
}
depends=""
for lib in $(objdump -p "${binaries[@]}" | awk '$1 == "NEEDED" { print $2 }' | sort -u); do
    case $lib in
        libc.so.6 | ld-linux-x86-64.so.2 | libm.so.6 | libdl.so.2 | libpthread.so.0 | librt.so.1)
            dep="libc6 (>= $(newest GLIBC))" ;;
        libgcc_s.so.1)
            dep="libgcc-s1 (>= $(newest GCC))" ;;
        *) die "the plugin or the tool links $lib, which this script does not map to a package: add it here" ;;
    esac
    case ", $depends, " in *", $dep, "*) ;; *) depends=${depends:+$depends, }$dep ;; esac
done
[ -n "$depends" ] || die "found no library dependencies of the plugin"
depends=$(printf '%s\n' "$depends" | tr ',' '\n' | sed 's/^ *//' | LC_ALL=C sort | paste -sd, | sed 's/,/, /g')

# md5sums of everything but conffiles, which dpkg tracks itself.
(cd "$stage" && find usr -type f -print0 | LC_ALL=C sort -z | xargs -0 md5sum) >"$stage/DEBIAN/md5sums"
install -m 0644 "$SRC/deb/conffiles" "$stage/DEBIAN/conffiles"
installed_size=$(du -sk --exclude=DEBIAN "$stage" | cut -f 1)
grep -v '^#' "$SRC/deb/control.in" |
    sed -e "s|@VERSION@|$version|" -e "s|@MAINTAINER@|$maintainer|" \
        -e "s|@INSTALLED_SIZE@|$installed_size|" -e "s|@DEPENDS@|$depends|" \
        >"$stage/DEBIAN/control"
! grep -n '@[A-Z_]*@' "$stage/DEBIAN/control" || die "unfilled field in the control file"
chmod 0644 "$stage/DEBIAN/control" "$stage/DEBIAN/md5sums"
find "$stage" -type d -exec chmod 0755 {} +
find "$stage" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

dpkg-deb --root-owner-group --build "$stage" "$deb" >/dev/null
say "built $deb"
dpkg-deb --info "$deb"
dpkg-deb --contents "$deb"
if command -v lintian >/dev/null; then
    say "lintian (report only)"
    lintian --display-info "$deb" || say "lintian reported problems (not fatal)"
fi
echo "$deb"
