#!/usr/bin/env bash
# Install today's container runtimes beside the Debian 12 ones the container tests use, for
# tests/e2e_containers_2026.rs, into the private prefix <repo>/.runtimes-2026/:
#   runc 1.4, libcriu2 4.3 and Podman 6.1 (Debian experimental); runc 1.3, containerd 2.1 with its
#   containerd-shim-runc-v2 and ctr, crun 1.28, Podman 5.8 with conmon, netavark and the
#   containers-common configuration, docker 28.5 (dockerd, docker, docker-proxy, docker-init),
#   buildah 1.43, skopeo 1.22 and checkpointctl 1.3 (Debian sid).
# Nothing from sid or experimental is installed into the system: packages come from a private
# apt configuration (scripts/lib/private-apt.sh) and are unpacked with `dpkg -x`.
#
# Most of these programs need sid's glibc (2.43), and a loader wrapper does not work for them
# (runc, crun and Podman re-execute /proc/self/exe, which would be the loader): `patchelf`
# (Debian 12's package, installed into the system when missing) points every dynamically linked
# program of the prefix at sid's loader unpacked beside it and gives it an RPATH (not a RUNPATH:
# an RPATH also serves the libraries' own dependencies) of sid's libraries, so that one glibc
# and nothing of the host's libraries serve them all. The libraries are the closure, over
# library packages, of what the programs' packages depend on. The interpreter is an absolute
# path: when the prefix moves, a re-run re-patches it (quickly).
#
# Result:
#   .runtimes-2026/bin/runc                       runc 1.4
#   .runtimes-2026/runc-1.3/runc                  runc 1.3 (not on PATH through bin/)
#   .runtimes-2026/podman-6.1/podman              Podman 6.1 (not on PATH; the same conmon,
#                                                 netavark and configuration as Podman 5.8)
#   .runtimes-2026/bin/containerd, containerd-shim-runc-v2, ctr
#   .runtimes-2026/bin/crun                       crun 1.28 (loads libcriu 4.3 from the prefix)
#   .runtimes-2026/bin/podman, conmon             Podman 5.8, conmon 2.1
#   .runtimes-2026/usr/lib/podman/netavark        (Podman's helper directory)
#   .runtimes-2026/usr/share/containers, etc/containers   containers-common's configuration
#   .runtimes-2026/bin/dockerd, docker, docker-proxy, docker-init
#   .runtimes-2026/bin/buildah, skopeo, checkpointctl
# Put .runtimes-2026/bin first on PATH (of the containerd daemon: it finds its shim there, and
# the shim finds runc there; of dockerd: it finds containerd and runc there).
#
# Usage: scripts/install-runtimes-2026.sh [--force]
#   --force   re-fetch even if the right versions are there
# Environment: RUNTIMES_2026_PREFIX (default <repo>/.runtimes-2026), DEBIAN_MIRROR.
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
MULTIARCH=x86_64-linux-gnu
# "package:suite:upstream version prefix" of what the tests were written for; a suite that now
# has another release stops this script, so that a new release is taken on deliberately.
WANTED="runc:experimental:1.4. containerd:sid:2.1. crun:sid:1.28 podman:sid:5.8.
conmon:sid:2.1. netavark:sid:1. golang-github-containers-common:sid:0.
golang-github-containers-image:sid:5. docker.io:sid:28.5. docker-cli:sid:28.5. tini-static:sid:0.
buildah:sid:1.43. skopeo:sid:1.22. checkpointctl:sid:1.3. libcriu2:experimental:4.3"
# "package:suite:program:directory" of the second releases of a program: each is unpacked
# apart and only its program kept, in that directory of the prefix (the first release of each
# is in WANTED and owns the system's paths). Their versions are in WANTED_ASIDE.
ASIDE="runc:sid:usr/sbin/runc:runc-1.3 podman:experimental:usr/bin/podman:podman-6.1"
WANTED_ASIDE="runc:sid:1.3. podman:experimental:6.1."
# Bumped when the prefix's layout changes.
LAYOUT=3
STAMP="runtimes-2026 layout $LAYOUT: runc 1.4, runc 1.3, containerd 2.1, crun 1.28, podman 5.8, podman 6.1, docker 28.5, buildah 1.43, skopeo 1.22, checkpointctl 1.3"

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd -P)
PREFIX=${RUNTIMES_2026_PREFIX:-$REPO/.runtimes-2026}

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

patch_all() {
    # $1: the prefix. Every program listed in its PATCHED: interpreter the prefix's loader,
    # RPATH the prefix's libraries.
    local p=$1 f
    while read -r f; do
        patchelf --set-interpreter "$p/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" \
            --force-rpath --set-rpath "$p/usr/lib/$MULTIARCH" "$p/$f"
    done <"$p/PATCHED"
}

patched_here() {
    # Whether every program of prefix $1 already points at $1's loader.
    local p=$1 f
    [ -f "$p/PATCHED" ] || return 1
    while read -r f; do
        [ "$(patchelf --print-interpreter "$p/$f" 2>/dev/null)" = "$p/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" ] || return 1
    done <"$p/PATCHED"
}

# "program|arguments|what the first line of its output starts with" for check_prefix.
CHECKS="bin/runc|--version|runc version 1.4.
runc-1.3/runc|--version|runc version 1.3.
bin/containerd|--version|containerd
bin/ctr|--version|ctr
bin/crun|--version|crun version 1.28
bin/podman|--version|podman version 5.8.
podman-6.1/podman|--version|podman version 6.1.
bin/conmon|--version|conmon version 2.
usr/lib/podman/netavark|--version|netavark 1.
bin/dockerd|--version|Docker version 28.5.
bin/docker|--version|Docker version 28.5.
bin/buildah|--version|buildah version 1.43.
bin/skopeo|--version|skopeo version 1.22.
bin/checkpointctl|--help|"
check_one() {
    # $1 prefix, $2 check line; prints what went wrong.
    local p=$1 prog args want out
    IFS='|' read -r prog args want <<<"$2"
    # shellcheck disable=SC2086  # the arguments are words
    if ! out=$("$p/$prog" $args 2>&1 </dev/null); then
        echo "$prog $args failed: $(printf '%s\n' "$out" | head -n2)"
        return 1
    fi
    case $(printf '%s\n' "$out" | head -n1) in
        "$want"*) ;;
        *) echo "$prog $args says '$(printf '%s\n' "$out" | head -n1)', expected '$want...'"; return 1 ;;
    esac
}

check_prefix() {
    # Quiet success when $1 holds a working install of the wanted versions; else prints why.
    local p=$1 line
    [ "$(head -n1 "$p/VERSION" 2>/dev/null)" = "$STAMP" ] || { echo "no or another VERSION stamp"; return 1; }
    while read -r line; do
        check_one "$p" "$line" || return 1
    done <<<"$CHECKS"
    for f in bin/containerd-shim-runc-v2 bin/docker-proxy bin/docker-init \
        usr/lib/$MULTIARCH/libcriu.so.2 etc/containers/policy.json usr/share/containers/containers.conf; do
        [ -e "$p/$f" ] || { echo "$f is missing"; return 1; }
    done
}

if [ "$force" = 0 ] && [ -f "$PREFIX/VERSION" ]; then
    # The prefix may have moved with the repository: re-point the programs at its loader.
    patched_here "$PREFIX" || patch_all "$PREFIX" 2>/dev/null || true
    if why=$(check_prefix "$PREFIX"); then
        say "$(sed -n 2p "$PREFIX/VERSION") already installed in $PREFIX (use --force to reinstall)"
        exit 0
    fi
    say "reinstalling: $PREFIX is incomplete or has other versions ($why)"
fi

# shellcheck source=lib/private-apt.sh
. "$REPO/scripts/lib/private-apt.sh"
private_apt_preflight "$PREFIX" "$KEYRING" ""

work=$(mktemp -d "${TMPDIR:-/tmp}/install-runtimes-2026.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/aside"
private_apt "$work" "sid experimental" "$MIRROR" "$KEYRING"

say "fetching the sid and experimental package indexes from $MIRROR (private)"
apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; die "apt-get update failed"; }

# Each apt-cache run re-reads the indexes (about a second): lookups go in batches.
madison() {
    # Appends "package version suite" lines for packages $@ to $work/madison.
    apt_ apt-cache madison "$@" 2>/dev/null \
        | awk -F'|' '{ gsub(/ /, "", $1); gsub(/ /, "", $2); split($3, s, " "); sub(/\/.*/, "", s[2]); print $1, $2, s[2] }' \
        >>"$work/madison"
}
version_of() {
    # $1 package, $2 suite: the newest version of it there (from $work/madison).
    awk -v p="$1" -v s="$2" '$1 == p && $3 == s { print $2; exit }' "$work/madison"
}
depends_of() {
    # $@ package=version: "package dependency" lines, the first alternative of each
    # Depends/Pre-Depends, names only.
    apt_ apt-cache show "$@" | awk '
        /^Package:/ { p = $2 }
        /^(Pre-)?Depends:/ {
            sub(/^[^:]*: /, ""); n = split($0, d, ",")
            for (i = 1; i <= n; i++) {
                x = d[i]; sub(/\|.*/, "", x); sub(/\(.*/, "", x); sub(/:any/, "", x); gsub(/ /, "", x)
                if (x != "") print p, x
            }
        }'
}
upstream() { local v=${1#*:}; echo "${v%-*}"; }

: >"$work/madison"
# shellcheck disable=SC2046
madison $(for w in $WANTED $WANTED_ASIDE; do echo "${w%%:*}"; done | sort -u)
wanted_version() {
    # $1 "package:suite:upstream version prefix": package=version, or dies.
    local pkg suite want v
    IFS=: read -r pkg suite want <<<"$1"
    v=$(version_of "$pkg" "$suite")
    [ -n "$v" ] || die "$suite has no $pkg"
    case $(upstream "$v") in
        "$want"*) ;;
        *) die "$suite has $pkg $v, expected $want*; update this script deliberately" ;;
    esac
    echo "$pkg=$v"
}
programs=""
for w in $WANTED; do programs="$programs $(wanted_version "$w")"; done
aside=""
for w in $WANTED_ASIDE; do aside="$aside $(wanted_version "$w")"; done

# The programs' libraries: the closure over library packages (lib*, zlib1g) of their Depends,
# always sid's version; libc6 (the loader) whatever the programs say; libcriu2 (crun loads it
# at run time; a Recommends) is already among the programs.
# shellcheck disable=SC2086
queue="libc6 libprotobuf-c1 $(depends_of $programs $aside | awk '{ print $2 }' | tr '\n' ' ')"
seen=" libcriu2 "
libs=""
while [ -n "${queue// /}" ]; do
    fresh=""
    for d in $queue; do
        case $seen in *" $d "*) continue ;; esac
        seen="$seen$d "
        case $d in lib*|zlib1g) fresh="$fresh $d" ;; esac
    done
    [ -n "$fresh" ] || break
    # shellcheck disable=SC2086
    madison $fresh
    specs=""
    for d in $fresh; do
        v=$(version_of "$d" sid)
        [ -n "$v" ] || die "sid has no $d (a library of the runtimes)"
        libs="$libs $d=$v"
        specs="$specs $d=$v"
    done
    # shellcheck disable=SC2086
    queue=$(depends_of $specs | awk '{ print $2 }' | sort -u | tr '\n' ' ')
done
pkgs="$programs$libs"
say "packages ($(echo "$pkgs $aside" | wc -w)):$pkgs$aside"

say "downloading .debs"
# shellcheck disable=SC2086
(cd "$work/debs" && apt_ apt-get -q download $pkgs >"$work/download.log" 2>&1) \
    || { cat "$work/download.log" >&2; die "apt-get download failed"; }
# shellcheck disable=SC2086
(cd "$work/aside" && apt_ apt-get -q download $aside >>"$work/download.log" 2>&1) \
    || { cat "$work/download.log" >&2; die "apt-get download of$aside failed"; }

stage=$PREFIX.new
rm -rf "$stage"
mkdir -p "$stage"
for deb in "$work/debs"/*.deb; do
    dpkg -x "$deb" "$stage"
    dpkg-deb --show --showformat='${Package}=${Version}\n' "$deb" >>"$work/packages"
done
# The second releases have the same paths as the first: each unpacked apart, its program
# moved into its directory.
aside_dirs=""
for a in $ASIDE; do
    IFS=: read -r pkg suite prog dir <<<"$a"
    deb=$(ls "$work/aside/${pkg}_"*.deb)
    dpkg -x "$deb" "$work/aside/$dir"
    mkdir -p "$stage/$dir"
    mv "$work/aside/$dir/$prog" "$stage/$dir/${prog##*/}"
    dpkg-deb --show --showformat="\${Package}=\${Version} ($dir/)\n" "$deb" >>"$work/packages"
    aside_dirs="$aside_dirs $dir"
done
# Only the containers' configuration of etc and usr/share; no services, no hooks.
mkdir -p "$work/keep/etc" "$work/keep/share"
mv "$stage/etc/containers" "$work/keep/etc/"
mv "$stage/usr/share/containers" "$work/keep/share/"
rm -rf "$stage/usr/share" "$stage/etc" "$stage/usr/lib/systemd" "$stage/lib/systemd" \
    "$stage/usr/lib/sysusers.d" "$stage/usr/lib/udev" "$stage/usr/lib/tmpfiles.d"
mkdir -p "$stage/etc" "$stage/usr/share"
mv "$work/keep/etc/containers" "$stage/etc/"
mv "$work/keep/share/containers" "$stage/usr/share/"
[ -f "$stage/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" ] || die "sid's loader not found in libc6"

mkdir -p "$stage/bin"
for rel in usr/sbin/runc usr/bin/containerd usr/bin/containerd-shim-runc-v2 usr/bin/ctr \
    usr/bin/crun usr/bin/podman usr/bin/conmon usr/sbin/dockerd usr/bin/docker \
    usr/sbin/docker-proxy usr/bin/docker-init usr/bin/buildah usr/bin/skopeo usr/bin/checkpointctl; do
    [ -e "$stage/$rel" ] || die "$rel not found in the unpacked packages"
    ln -s "../$rel" "$stage/bin/${rel##*/}"
done

# Every dynamically linked program (not the libraries, not the static ones) runs on sid's
# loader and libraries.
# shellcheck disable=SC2086
(cd "$stage" && find usr/bin usr/sbin usr/lib/podman usr/libexec $aside_dirs -type f -perm -u+x) | sort \
    | while read -r f; do
        if patchelf --print-interpreter "$stage/$f" >/dev/null 2>&1; then echo "$f"; fi
    done >"$stage/PATCHED"
patch_all "$stage"

# Every library of every patched program must resolve inside the prefix, not from the host.
say "checking library resolution"
while read -r f; do
    list=$(env -u LD_LIBRARY_PATH "$stage/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" --list "$stage/$f" 2>&1) \
        || die "sid's loader could not load $f: $list"
    bad=$(printf '%s\n' "$list" | awk -v s="$stage/" '/not found/ { print; next } /=>/ { if (index($3, s) != 1) print }')
    [ -z "$bad" ] || die "libraries of $f not resolved from the prefix:"$'\n'"$bad"
done <"$stage/PATCHED"

{
    echo "$STAMP"
    grep -E '^(runc|containerd|crun|podman|docker.io|buildah|skopeo|checkpointctl)=' "$work/packages" \
        | sed 's/=/ /' | sort | tr '\n' ',' | sed 's/,$//; s/,/, /g'
    echo
} >"$stage/VERSION"
sort "$work/packages" >"$stage/PACKAGES"

say "installing into $PREFIX"
rm -rf "$PREFIX"
mv "$stage" "$PREFIX"
chmod 755 "$PREFIX"
patch_all "$PREFIX"
why=$(check_prefix "$PREFIX") || die "the installed programs do not run or report other versions: $why"
say "installed ($(du -sh "$PREFIX" | cut -f1)) in $PREFIX: $(sed -n 2p "$PREFIX/VERSION")"
