#!/usr/bin/env bash
# Build the cluster's upstream programs (Kubernetes, etcd, containerd, runc, crictl, nvidia-ctk,
# NVIDIA's device plugin, CRI-O)
# from their published Go modules into <repo>/.upstream/<component>/bin/.
#
# Each component is a small Go module of ours under tools/upstream/<component>/ whose go.mod pins
# the upstream release exactly and whose committed go.sum is verified on every build
# (GOFLAGS=-mod=readonly): nothing of upstream's source is kept in the repository. Modules come
# from the Go module proxy; GOMODCACHE, GOCACHE, GOPATH and GOTMPDIR are under
# <repo>/.upstream/go/, so nothing outside the checkout is written. Binaries are built with -trimpath and -ldflags "-s -w" and
# carry the version stamps their projects' own builds set. A stamp file per component (go.mod and
# go.sum hashes, Go version, the build recipe) makes a second run with nothing changed take
# seconds; for each component built, the wall time and the CPU time (user + sys) are printed.
#
# Components (default: all, in this order, the largest last):
#   runc-1.5         runc (v1.5.3, tag seccomp, libseccomp linked statically; no libpathrs)
#   crictl-1.37      crictl (sigs.k8s.io/cri-tools v1.37.0)
#   nvidia-ctk-1.20  nvidia-ctk (github.com/NVIDIA/nvidia-container-toolkit v1.20.2)
#   nvidia-device-plugin-0.17
#                    nvidia-device-plugin (github.com/NVIDIA/k8s-device-plugin v0.17.4), for the
#                    GPU machine's kubelet check (scripts/gpu-carry-kubelet.sh)
#   etcd-3.7         etcd                               (go.etcd.io/etcd/server/v3 v3.7.3)
#   containerd-2.3   containerd, containerd-shim-runc-v2, ctr   (v2.3.7, static: no btrfs)
#   containerd-2.4   the same from v2.4.2
#   cri-o-1.36       crio (github.com/cri-o/cri-o v1.36.3, cgo: SQLite from go-sqlite3's module;
#                    no seccomp, SELinux, AppArmor or btrfs), pinns (C, static, CRI-O's Makefile
#                    in the module's source) and Debian 12's conmon: the prefix
#                    tests/e2e_crio.rs takes as CRIU_GPU_TEST_CRIO (not built by scripts/test.sh)
#   kubernetes-1.37  kubelet, kube-apiserver, kubectl   (k8s.io/kubernetes v1.37.2, static)
#
# runc's seccomp support needs libseccomp's headers and library: Debian's libseccomp-dev when it
# is installed, otherwise the same package of Debian 12 fetched with a private apt setup
# (scripts/lib/private-apt.sh) and unpacked with `dpkg -x` into .upstream/libseccomp/; nothing
# is installed into the system. CRI-O's conmon is Debian 12's package, fetched the same way into
# .upstream/conmon/.
#
# Needs Go 1.26.8 or later (containerd 2.3.7 asks for it; `go` on PATH or /usr/local/go/bin/go,
# where CI machines have it), gcc and pkg-config for runc and nvidia-ctk, and gcc, make and
# glibc's static libc (libc6-dev) for CRI-O. Builds run under `nice -n 10`.
#
# Usage: scripts/build-upstream.sh [--force] [--drop-build-cache] [--list] [COMPONENT...]
#   --force             rebuild even where the stamp says the binaries are up to date
#   --drop-build-cache  afterwards empty Go's build cache (about 5 GB after a build of all; the
#                       stamps still make a re-run quick, a version change then compiles all of
#                       that component again)
#   --list              print the components and exit
# Environment: UPSTREAM_DIR (default <repo>/.upstream), GO (the go command), DEBIAN_MIRROR.
set -euo pipefail

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd -P)
MODULES=$REPO/tools/upstream
OUT=${UPSTREAM_DIR:-$REPO/.upstream}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
GO_MIN=go1.26.8
ALL="runc-1.5 crictl-1.37 nvidia-ctk-1.20 nvidia-device-plugin-0.17 etcd-3.7 containerd-2.3 containerd-2.4 cri-o-1.36 kubernetes-1.37"

say() { printf '[build-upstream] %s\n' "$*"; }
die() { printf '[build-upstream] ERROR: %s\n' "$*" >&2; exit 1; }

force=0 drop_cache=0
while [ $# -gt 0 ]; do
    case $1 in
        --force) force=1 ;;
        --drop-build-cache) drop_cache=1 ;;
        --list) printf '%s\n' $ALL; exit 0 ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        -*) die "unknown option: $1 (try --help)" ;;
        *) break ;;
    esac
    shift
done
components=${*:-$ALL}
for c in $components; do
    case " $ALL " in *" $c "*) ;; *) die "unknown component '$c' (one of: $ALL)" ;; esac
done

# --- Go --------------------------------------------------------------------------------------
GO=${GO:-}
if [ -z "$GO" ]; then
    if command -v go >/dev/null 2>&1; then GO=$(command -v go)
    elif [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go
    else die "Go ${GO_MIN#go} or later is needed and was not found (not on PATH, not /usr/local/go/bin/go); install it from https://go.dev/dl/ or set GO=/path/to/go"
    fi
fi
go_version=$("$GO" env GOVERSION 2>/dev/null) || die "$GO does not run"
[ "$(printf '%s\n' "$GO_MIN" "$go_version" | sort -V | head -n1)" = "$GO_MIN" ] \
    || die "Go ${GO_MIN#go} or later is needed; $GO is $go_version"

mkdir -p "$OUT/go/tmp"
# -modcacherw: the module cache stays deletable with a plain rm -rf .upstream. -buildvcs=false:
# our checkout's git state is no part of these programs.
# GOTMPDIR: the compiler's work files (over a GiB for kubelet) stay off /tmp as well.
export GOMODCACHE=$OUT/go/mod GOCACHE=$OUT/go/cache GOPATH=$OUT/go GOTMPDIR=$OUT/go/tmp
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -modcacherw -buildvcs=false" GOWORK=off GO111MODULE=on
unset GOBIN GOOS GOARCH

# --- Debian 12's packages, privately ---------------------------------------------------------
# debian12_unpack PACKAGE PREFIX: Debian 12's PACKAGE downloaded with a private apt setup
# (scripts/lib/private-apt.sh) and unpacked into PREFIX with `dpkg -x`, its version in
# PREFIX/VERSION; nothing is installed into the system.
debian12_unpack() {
    local package=$1 prefix=$2 work
    # shellcheck source=lib/private-apt.sh
    . "$REPO/scripts/lib/private-apt.sh"
    private_apt_preflight "$prefix" "$KEYRING" " to fetch $package"
    work=$(mktemp -d "$prefix.work.XXXXXX")
    private_apt "$work" bookworm "$MIRROR" "$KEYRING"
    apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 \
        || { cat "$work/update.log" >&2; die "apt-get update for bookworm failed"; }
    (cd "$work" && apt_ apt-get -q download "$package" >"$work/download.log" 2>&1) \
        || { cat "$work/download.log" >&2; die "downloading $package failed"; }
    rm -rf "$prefix"
    dpkg -x "$work/${package}"_*.deb "$prefix"
    dpkg-deb -f "$work/${package}"_*.deb Version >"$prefix/VERSION"
    rm -rf "$work"
}

# --- libseccomp for runc ----------------------------------------------------------------------
# Sets PKG_CONFIG_PATH so that libseccomp-golang's `#cgo pkg-config: libseccomp` finds it.
libseccomp_ready=0
ensure_libseccomp() {
    [ "$libseccomp_ready" = 1 ] && return 0
    command -v pkg-config >/dev/null 2>&1 || die "pkg-config is needed for runc's seccomp build (Debian: pkg-config)"
    command -v cc >/dev/null 2>&1 || die "a C compiler is needed for runc (Debian: gcc)"
    if pkg-config --exists libseccomp; then
        say "libseccomp: the system's $(pkg-config --modversion libseccomp)"
        libseccomp_ready=1
        return 0
    fi
    local prefix=$OUT/libseccomp
    if [ ! -f "$prefix/VERSION" ]; then
        say "libseccomp-dev is not installed: fetching Debian 12's into $prefix (private apt, dpkg -x)"
        debian12_unpack libseccomp-dev "$prefix"
    fi
    local libdir=$prefix/usr/lib/x86_64-linux-gnu
    [ -f "$libdir/libseccomp.a" ] && [ -f "$prefix/usr/include/seccomp.h" ] \
        || die "$prefix lacks libseccomp.a or seccomp.h; remove it and run again"
    # Our own .pc: the package's names /usr as its prefix, and the static library keeps runc
    # free of a runtime dependency on the host's libseccomp.
    mkdir -p "$prefix/pkgconfig"
    cat >"$prefix/pkgconfig/libseccomp.pc" <<PC
Name: libseccomp
Description: libseccomp-dev $(cat "$prefix/VERSION") from Debian 12, unpacked by build-upstream.sh
Version: $(sed 's/-.*//' "$prefix/VERSION")
Cflags: -I$prefix/usr/include
Libs: $libdir/libseccomp.a
PC
    export PKG_CONFIG_PATH=$prefix/pkgconfig
    say "libseccomp: $(cat "$prefix/VERSION") (Debian 12, private, static)"
    libseccomp_ready=1
}

# --- CRI-O's pinns and conmon -----------------------------------------------------------------
# crio_helpers COMPONENT DEST puts beside crio what it runs: pinns, built
# from the pinned module's source (a copy: the module cache stays untouched) with CRI-O's own
# Makefile (static, stripped), and Debian 12's conmon, fetched once into .upstream/conmon/.
crio_helpers() {
    local c=$1 dest=$2 src work prefix=$OUT/conmon
    command -v make >/dev/null 2>&1 || die "$c needs make (Debian: make)"
    src=$(cd "$MODULES/$c" && "$GO" list -m -f '{{.Dir}}' "$main")
    [ -f "$src/pinns/Makefile" ] || die "$c: $main has no pinns/Makefile (in $src)"
    work=$OUT/$c.pinns
    rm -rf "$work"
    mkdir -p "$work"
    cp -R "$src/pinns" "$work/"
    chmod -R u+w "$work"
    say "$c: building pinns ($version)"
    nice -n 10 make -s -C "$work/pinns" || die "$c: building pinns failed (a static glibc is needed: Debian's libc6-dev)"
    install -m 755 "$work/bin/pinns" "$dest/pinns"
    rm -rf "$work"
    if [ ! -f "$prefix/VERSION" ]; then
        say "$c: fetching Debian 12's conmon into $prefix (private apt, dpkg -x)"
        debian12_unpack conmon "$prefix"
    fi
    [ -x "$prefix/usr/bin/conmon" ] || die "$prefix lacks usr/bin/conmon; remove it and run again"
    install -m 755 "$prefix/usr/bin/conmon" "$dest/conmon"
    say "$c: conmon $(cat "$prefix/VERSION") (Debian 12)"
}

# --- recipes ----------------------------------------------------------------------------------
# recipe COMPONENT sets: main (the upstream module whose version is stamped), version and time
# (its version and release time), bins ("name=package" ...), tags, cgo, cflags (CGO_CFLAGS),
# ldflags (the -X stamps; -s -w are added for all) and helpers (what else goes into bin/, built
# by the component's own function: CRI-O's pinns and conmon).
recipe() {
    local c=$1
    main="" bins="" tags="" cgo=0 ldflags="" cflags="-O2 -g" helpers=""
    case $c in
        kubernetes-*) main=k8s.io/kubernetes ;;
        etcd-*) main=go.etcd.io/etcd/server/v3 ;;
        containerd-*) main=github.com/containerd/containerd/v2 ;;
        runc-*) main=github.com/opencontainers/runc ;;
        crictl-*) main=sigs.k8s.io/cri-tools ;;
        nvidia-ctk-*) main=github.com/NVIDIA/nvidia-container-toolkit ;;
        nvidia-device-plugin-*) main=github.com/NVIDIA/k8s-device-plugin ;;
        cri-o-*) main=github.com/cri-o/cri-o ;;
    esac
    # Version and release time of the pinned module, from go.mod and the proxy's .info.
    read -r version time < <(cd "$MODULES/$c" && "$GO" list -m -f '{{.Version}} {{if .Time}}{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}' "$main")
    [ -n "$version" ] || die "$c: reading the version of $main failed (its go.mod, or the proxy for its .info)"
    case $c in
        kubernetes-*)
            # Kubernetes' own tags for release builds; CGO off for all three (its build links only
            # kubelet with cgo, where it serves nothing but libc's resolver and user lookups):
            # static binaries also run on the GPU machine whatever its libc.
            tags="selinux notest grpcnotrace"
            bins="kubelet=k8s.io/kubernetes/cmd/kubelet kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver kubectl=k8s.io/kubernetes/cmd/kubectl"
            # What hack/lib/version.sh stamps, with the tree state Kubernetes uses for builds
            # from a source archive (no git).
            local major=${version#v} minor
            minor=${major#*.}; minor=${minor%%.*}; major=${major%%.*}
            local p
            for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
                ldflags+=" -X $p.gitVersion=$version -X $p.gitMajor=$major -X $p.gitMinor=$minor"
                ldflags+=" -X $p.gitTreeState=archive -X $p.buildDate=$time"
            done
            ;;
        etcd-*)
            bins="etcd=."
            ;;
        containerd-*)
            bins="containerd=$main/cmd/containerd containerd-shim-runc-v2=$main/cmd/containerd-shim-runc-v2 ctr=$main/cmd/ctr"
            tags=urfave_cli_no_docs
            ldflags="-X $main/version.Version=$version -X $main/version.Package=$main"
            ;;
        runc-*)
            bins="runc=$main"
            # runc's Makefile's default tags less libpathrs (a Rust library not in Debian 12);
            # runc then resolves paths with its Go fallback (filepath-securejoin).
            tags="seccomp urfave_cli_no_docs"
            cgo=1
            ;;
        crictl-*)
            bins="crictl=$main/cmd/crictl"
            ldflags="-X $main/pkg/version.Version=${version#v}"
            ;;
        nvidia-ctk-*)
            bins="nvidia-ctk=$main/cmd/nvidia-ctk"
            # go-nvml opens libnvidia-ml at run time: its symbols stay unresolved at link time,
            # as in the project's Makefile.
            # NVML's header marks many functions deprecated: those warnings are upstream's.
            cgo=1 cflags="-O2 -g -Wno-deprecated-declarations"
            ldflags="-X $main/internal/info.version=${version#v}"
            ldflags+=" '-extldflags=-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files -Wl,-z,lazy'"
            ;;
        nvidia-device-plugin-*)
            # NVML opened at run time, as for nvidia-ctk.
            bins="nvidia-device-plugin=$main/cmd/nvidia-device-plugin"
            cgo=1 cflags="-O2 -g -Wno-deprecated-declarations"
            ldflags="-X $main/internal/info.version=${version#v}"
            ldflags+=" '-extldflags=-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files -Wl,-z,lazy'"
            ;;
        cri-o-*)
            # The tags CRI-O's Makefile picks on a machine without the btrfs, gpgme, libseccomp,
            # SELinux, AppArmor and libsubid headers.
            # cgo on, as in its Makefile: go-sqlite3 compiles the SQLite amalgamation its module
            # carries, so no system libsqlite3 is needed.
            bins="crio=$main/cmd/crio"
            helpers="pinns conmon"
            tags="containers_image_ostree_stub exclude_graphdriver_btrfs btrfs_noversion containers_image_openpgp"
            cgo=1
            # What its Makefile stamps besides the version (a constant in the source): the build
            # date (the release time here, as for Kubernetes) and the commit, where the proxy's
            # .info of the release records it (its Origin; not covered by go.sum). The module
            # path has no capitals, so it is its own path in the module cache.
            ldflags="-X $main/internal/version.buildDate=$time"
            local commit
            commit=$(sed -n 's/.*"Origin":{[^}]*"Hash":"\([0-9a-f]\{40\}\)".*/\1/p' \
                "$GOMODCACHE/cache/download/$main/@v/$version.info" 2>/dev/null || true)
            [ -z "$commit" ] || ldflags+=" -X $main/internal/version.buildCommit=$commit"
            ;;
    esac
}

# --- build ------------------------------------------------------------------------------------
cpu_seconds() {
    # Sets cpu to the user + sys seconds of this shell's waited-for children so far (the builds
    # and their compilers). `times` runs in this shell: a subshell would count only its own.
    times >"$OUT/.times"
    cpu=$(tail -n1 "$OUT/.times" | awk '{ s = 0
        for (i = 1; i <= NF; i++) { split($i, b, "m"); sub("s", "", b[2]); s += b[1] * 60 + b[2] }
        printf "%.1f", s }')
}
now() { date +%s.%N; }
report=""

build_component() {
    local c=$1 dir=$MODULES/$1
    [ -f "$dir/go.mod" ] && [ -f "$dir/go.sum" ] || die "$c: $dir/go.mod or go.sum is missing"
    recipe "$c"
    local bindir=$OUT/$c/bin stamp=$OUT/$c/STAMP want b missing=0
    want=$(
        cd "$dir"
        sha256sum go.mod go.sum
        echo "$go_version"
        echo "bins=$bins tags=$tags cgo=$cgo cflags=$cflags ldflags=$ldflags${helpers:+ helpers=$helpers}"
    )
    for b in $bins; do [ -x "$bindir/${b%%=*}" ] || missing=1; done
    for b in $helpers; do [ -x "$bindir/$b" ] || missing=1; done
    if [ "$force" = 0 ] && [ "$missing" = 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        say "$c: up to date ($version)"
        report+=$(printf '%-16s %-9s %8s %8s  up to date' "$c" "$version" - -)$'\n'
        return 0
    fi
    if [ "$cgo" = 1 ] && ! command -v cc >/dev/null 2>&1; then
        die "$c needs a C compiler (Debian: gcc)"
    fi
    case $c in runc-*) ensure_libseccomp ;; esac
    local t0 c0 cpu try pkgs=""
    t0=$(now); cpu_seconds; c0=$cpu
    for b in $bins; do pkgs+=" ${b#*=}"; done
    # Fetch (and check against go.sum) every module the packages need; a failed download from the
    # proxy is tried again.
    for try in 1 2 3; do
        # shellcheck disable=SC2086
        (cd "$dir" && "$GO" list -deps -tags "$tags" $pkgs >/dev/null) && break
        [ "$try" = 3 ] && die "$c: fetching its modules failed three times"
        say "$c: fetching modules failed; trying again in 10 s"
        sleep 10
    done
    rm -rf "$OUT/$c.new"
    mkdir -p "$OUT/$c.new"
    for b in $bins; do
        say "$c: building ${b%%=*} ($version)"
        # go build splits -ldflags itself, honouring the quotes in nvidia-ctk's -extldflags.
        (cd "$dir" && CGO_ENABLED=$cgo CGO_CFLAGS=$cflags nice -n 10 "$GO" build -trimpath -tags "$tags" \
            -ldflags "-s -w $ldflags" -o "$OUT/$c.new/${b%%=*}" "${b#*=}") \
            || die "$c: building ${b%%=*} failed"
    done
    case $c in cri-o-*) crio_helpers "$c" "$OUT/$c.new" ;; esac
    rm -rf "$bindir"
    mkdir -p "$OUT/$c"
    mv "$OUT/$c.new" "$bindir"
    printf '%s\n' "$want" >"$stamp"
    local wall
    wall=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')
    cpu_seconds
    cpu=$(awk -v a="$c0" -v b="$cpu" 'BEGIN { printf "%.0f", b - a }')
    say "$c: built in ${wall} s wall, ${cpu} s CPU (user+sys)"
    report+=$(printf '%-16s %-9s %8s %8s  built' "$c" "$version" "$wall" "$cpu")$'\n'
}

say "Go: $go_version ($GO); output: $OUT"
for c in $components; do
    build_component "$c"
done
if [ "$drop_cache" = 1 ]; then
    "$GO" clean -cache
    rm -rf "${GOTMPDIR:?}"/*
    say "build cache emptied"
fi
printf '%-16s %-9s %8s %8s\n' component version "wall s" "CPU s"
printf '%s' "$report"
