#!/usr/bin/env bash
# Install the container runtimes the container tests (tests/e2e_containers.rs) drive.
#
# From Debian 12 (the system's apt, into the system): runc 1.1.5, Podman 4.3.1 (with conmon)
# and containerd 1.6 (with ctr and its runc shim). No iptables: the test containers share the
# host's network namespace, so CRIU never locks a network.
#
# From Debian 13 (trixie), into the private prefix <repo>/.runtimes/: crun 1.21 (Debian 12's
# 1.8.1 has no checkpoint support), libcriu2 4.1.1 (which crun loads at run time),
# checkpointctl 1.3.0 and a static busybox (the test containers' userland). They need a newer
# glibc than Debian 12 has, so, as scripts/install-criu.sh does for CRIU, they run through
# trixie's loader: the one in <repo>/.criu/, with .criu's libraries after the prefix's own.
# Nothing from trixie is installed into the system: packages come from a private apt
# configuration and are unpacked with `dpkg -x`; what .criu already carries is not fetched again.
#
# Result:
#   .runtimes/bin/criu           -> the private CRIU (runtimes look for `criu` on PATH)
#   .runtimes/bin/crun           crun 1.21 through the private loader
#   .runtimes/bin/checkpointctl  checkpointctl 1.3.0 through the private loader
#   .runtimes/bin/busybox        static busybox
#   .runtimes/criu               link to the CRIU prefix whose loader and libraries are used
# Put .runtimes/bin first on PATH to use them.
#
# Usage: scripts/install-runtimes.sh [--force]
#   --force   re-fetch the trixie part even if the right versions are there
# Environment: RUNTIMES_PREFIX (default <repo>/.runtimes), CRIU_PREFIX (default <repo>/.criu),
#   DEBIAN_MIRROR.
set -euo pipefail

CRUN_VERSION=1.21
LIBCRIU_VERSION=4.1.1
CHECKPOINTCTL_VERSION=1.3.0
SUITE=trixie
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
MULTIARCH=x86_64-linux-gnu
# Debian 12 packages, as "command-or-file:package:version-prefix".
SYSTEM_PACKAGES="/usr/sbin/runc:runc:1.1.5 /usr/bin/podman:podman:4.3.1 /usr/bin/containerd:containerd:1.6."

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd -P)
PREFIX=${RUNTIMES_PREFIX:-$REPO/.runtimes}
CRIU_PREFIX=${CRIU_PREFIX:-$REPO/.criu}
STAMP="crun $CRUN_VERSION, libcriu2 $LIBCRIU_VERSION, checkpointctl $CHECKPOINTCTL_VERSION, busybox"

say() { printf '[install-runtimes] %s\n' "$*"; }
die() { printf '[install-runtimes] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; printf "[install-runtimes] ERROR: command failed (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

force=0
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        *) die "unknown argument: $arg (try --help)" ;;
    esac
done

[ "$(uname -m)" = x86_64 ] || die "only x86_64 is supported (this is $(uname -m))"
case $PREFIX in
    *:*) die "prefix path must not contain ':' (the loader's --library-path is ':'-separated): $PREFIX" ;;
esac
loader=$CRIU_PREFIX/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2
[ -x "$CRIU_PREFIX/bin/criu" ] && [ -f "$loader" ] \
    || die "no private CRIU at $CRIU_PREFIX (its loader is reused here): run scripts/install-criu.sh first"

# ---- Debian 12 packages, into the system ----------------------------------------------------

installed_version() { dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null | sed -n 's/^install ok installed //p' || true; }

missing=""
for entry in $SYSTEM_PACKAGES; do
    file=${entry%%:*}; rest=${entry#*:}; pkg=${rest%%:*}; want=${rest#*:}
    have=$(installed_version "$pkg")
    if [ -x "$file" ] && [ -n "$have" ]; then
        case $have in
            "$want"*) ;;
            *) say "warning: $pkg $have is installed, the tests were written for $want" ;;
        esac
    else
        missing="$missing $pkg"
    fi
done
if [ -n "$missing" ]; then
    [ "$(id -u)" = 0 ] || die "missing packages:$missing; run as root or install them yourself"
    say "installing with the system's apt:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # runc named explicitly so that podman's "crun | runc" is met by runc, not Debian 12's crun.
    # shellcheck disable=SC2086  # a list of packages
    apt-get install -y -q --no-install-recommends runc $missing
fi

# ---- trixie packages, into the private prefix -----------------------------------------------

# Serialise concurrent runs (the lock is on this script file, so no stray lock file).
if command -v flock >/dev/null; then
    exec 9<"$SCRIPT"
    flock -x 9
fi

link_criu() {
    # $1: the prefix. A relative link when both prefixes share a parent, so the repository can
    # move; otherwise an absolute one.
    local target=$CRIU_PREFIX
    [ "$(dirname "$CRIU_PREFIX")" = "$(dirname "$1")" ] && target=../$(basename "$CRIU_PREFIX")
    ln -sfn "$target" "$1/criu"
}

check_prefix() {
    # Quiet success when $1 holds a working install of the wanted versions.
    local p=$1
    [ "$(head -n1 "$p/VERSION" 2>/dev/null)" = "$STAMP" ] || return 1
    # --root: without it crun creates its default state directory, /run/crun, even for this.
    "$p/bin/crun" --root "$p" --version 2>/dev/null | grep -qx "crun version $CRUN_VERSION" || return 1
    # checkpointctl 1.3.0 has no version command: its package version says it.
    grep -q "^checkpointctl=$CHECKPOINTCTL_VERSION" "$p/PACKAGES" || return 1
    "$p/bin/checkpointctl" --help >/dev/null 2>&1 || return 1
    "$p/bin/busybox" true 2>/dev/null || return 1
    [ -f "$p/usr/lib/$MULTIARCH/libcriu.so.2" ] || return 1
    [ "$("$p/bin/criu" --version 2>/dev/null | sed -n 's/^Version: *//p')" != "" ] || return 1
}

if [ "$force" = 0 ] && [ -f "$PREFIX/VERSION" ]; then
    # The CRIU prefix may have moved with the repository: point at the current one.
    [ -L "$PREFIX/criu" ] && link_criu "$PREFIX"
    if check_prefix "$PREFIX"; then
        say "$STAMP already installed in $PREFIX (use --force to reinstall)"
        exit 0
    fi
    say "reinstalling: $PREFIX is incomplete or has other versions"
fi

# shellcheck source=lib/private-apt.sh
. "$REPO/scripts/lib/private-apt.sh"
private_apt_preflight "$PREFIX" "$KEYRING" ""

work=$(mktemp -d "${TMPDIR:-/tmp}/install-runtimes.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs"
private_apt "$work" "$SUITE" "$MIRROR" "$KEYRING"

say "fetching the $SUITE package index from $MIRROR (private, not in the system's apt lists)"
apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; die "apt-get update for $SUITE failed"; }

upstream_of() {
    local v
    v=$(apt_ apt-cache show --no-all-versions "$1" 2>/dev/null | sed -n 's/^Version: *//p' | head -n1)
    [ -n "$v" ] || die "no '$1' package in $SUITE"
    v=${v#*:}
    v=${v%-*}
    # Repacked upstream sources (+ds1, +dfsg) are the same release.
    echo "${v%%+*}"
}
for want in crun:$CRUN_VERSION libcriu2:$LIBCRIU_VERSION checkpointctl:$CHECKPOINTCTL_VERSION; do
    got=$(upstream_of "${want%%:*}")
    [ "$got" = "${want#*:}" ] || die "$SUITE has ${want%%:*} $got, expected ${want#*:}; update this script deliberately"
done

# Depends/Pre-Depends closure, less what the CRIU prefix already carries (its loader and libc
# among them: one glibc for everything run through that loader).
roots="crun libcriu2 checkpointctl busybox-static"
# shellcheck disable=SC2086
pkgs=$(apt_ apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances $roots | grep -E '^[a-z0-9]' | sort -u)
have=$(sed 's/=.*//' "$CRIU_PREFIX/PACKAGES" 2>/dev/null | sort -u)
pkgs=$(comm -23 <(echo "$pkgs") <(echo "$have"))
for r in $roots; do echo "$pkgs" | grep -qx "$r" || die "dependency resolution did not return $r"; done
say "packages ($(echo "$pkgs" | wc -l)): $(echo "$pkgs" | tr '\n' ' ')"

say "downloading .debs"
# shellcheck disable=SC2086
(cd "$work/debs" && apt_ apt-get -q download $pkgs >"$work/download.log" 2>&1) \
    || { cat "$work/download.log" >&2; die "apt-get download failed"; }

stage=$work/stage
mkdir -p "$stage"
for deb in "$work/debs"/*.deb; do
    dpkg -x "$deb" "$stage"
    dpkg-deb --show --showformat='${Package}=${Version}\n' "$deb" >>"$work/packages"
done
rm -rf "$stage/usr/share/doc" "$stage/usr/share/man" "$stage/usr/share/info" \
    "$stage/usr/share/locale" "$stage/usr/share/lintian" "$stage/usr/share/bug" \
    "$stage/usr/share/bash-completion" "$stage/usr/share/zsh" "$stage/usr/share/fish"

bin_of() {
    # The unpacked path of program $1 (trixie is usr-merged; older layouts have /bin).
    local d
    for d in usr/bin usr/sbin bin sbin; do
        [ -x "$stage/$d/$1" ] && { echo "$d/$1"; return 0; }
    done
    die "$1 not found in the unpacked packages"
}
crun_rel=$(bin_of crun)
ckpt_rel=$(bin_of checkpointctl)
busybox_rel=$(bin_of busybox)
[ -f "$stage/usr/lib/$MULTIARCH/libcriu.so.2" ] || die "libcriu.so.2 not found in libcriu2"

link_criu "$stage"
mkdir -p "$stage/bin" "$stage/libexec"
ln -s ../criu/bin/criu "$stage/bin/criu"
ln -s "../$busybox_rel" "$stage/bin/busybox"
# Each program starts through a link to the loader named after it, so that its comm (ps,
# pgrep) reads "crun" rather than "ld-linux-x86-64".
wrapper() {
    # $1: name, $2: the program's path inside the prefix.
    ln -s "../criu/usr/lib/$MULTIARCH/ld-linux-x86-64.so.2" "$stage/libexec/$1"
    cat >"$stage/bin/$1" <<EOF
#!/bin/sh
# $1 from Debian $SUITE in a private prefix (made by scripts/install-runtimes.sh), run through
# the private CRIU prefix's loader: the prefix's libraries first, then the CRIU prefix's
# (glibc), then an inherited LD_LIBRARY_PATH. No LD_* variable is exported to what it starts.
self=\$(readlink -f -- "\$0") || exit 127
prefix=\${self%/*/*}
criu=\$(readlink -f -- "\$prefix/criu") || exit 127
case \$prefix:\$criu in
    *:*:*) echo "$1 wrapper: prefix paths must not contain ':': \$prefix \$criu" >&2; exit 127 ;;
esac
exec "\$prefix/libexec/$1" \\
    --library-path "\$prefix/usr/lib/$MULTIARCH:\$criu/usr/lib/$MULTIARCH\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" \\
    --argv0 "\$0" "\$prefix/$2" "\$@"
EOF
    chmod 755 "$stage/bin/$1"
}
wrapper crun "$crun_rel"
wrapper checkpointctl "$ckpt_rel"

# Every library must resolve inside the two prefixes, not from the host.
say "checking library resolution under the private loader"
libpath="$stage/usr/lib/$MULTIARCH:$CRIU_PREFIX/usr/lib/$MULTIARCH"
for f in "$crun_rel" "$ckpt_rel" "usr/lib/$MULTIARCH/libcriu.so.2"; do
    if ! list=$(env -u LD_LIBRARY_PATH "$loader" --library-path "$libpath" --list "$stage/$f" 2>&1); then
        # A static program has nothing to resolve.
        printf '%s\n' "$list" | grep -q 'not a dynamic executable' && continue
        die "the private loader could not load $f: $list"
    fi
    bad=$(printf '%s\n' "$list" | awk -v s="$stage/" -v c="$CRIU_PREFIX/" '
        /not found/ { print; next }
        /=>/ { if (index($3, s) != 1 && index($3, c) != 1) print }')
    [ -z "$bad" ] || die "libraries of $f not resolved from the prefixes:"$'\n'"$bad"
done

{ echo "$STAMP"; echo "debian $SUITE"; } >"$stage/VERSION"
sort "$work/packages" >"$stage/PACKAGES"
check_prefix "$stage" || die "the staged programs do not run or report other versions: $("$stage/bin/crun" --root "$stage" --version 2>&1 | head -n1); $(grep checkpointctl "$stage/PACKAGES")"

say "installing into $PREFIX"
rm -rf "$PREFIX"
mkdir -p "$(dirname "$PREFIX")"
mv "$stage" "$PREFIX"
chmod 755 "$PREFIX"
link_criu "$PREFIX"
# Checked again from the final place: the move doubles as a relocation test.
check_prefix "$PREFIX" || die "the installed programs do not run from $PREFIX"
say "installed $STAMP ($(du -sh "$PREFIX" | cut -f1)) in $PREFIX; put $PREFIX/bin first on PATH"
