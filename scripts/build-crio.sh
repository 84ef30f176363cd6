#!/usr/bin/env bash
# Build CRI-O (not in Debian) from a copy of its source with its vendored modules, offline,
# with Debian sid's Go 1.26, into the private prefix <repo>/.cri-o/; optionally start it on its
# own socket and check that it answers the CRI (Version, Status) and has checkpointing on.
#
# An on-demand, local step, not part of scripts/setup.sh: CRI-O's source comes from GitHub,
# which CI machines cannot reach. Give it a source tree or a bare git directory of
# github.com/cri-o/cri-o. From the Debian archive (reachable from CI) it takes, through a
# private apt setup (scripts/lib/private-apt.sh) and `dpkg -x`: golang-1.26-go and
# golang-1.26-src (sid) and conmon (Debian 12). Go runs with GOFLAGS=-mod=vendor
# GOTOOLCHAIN=local GOPROXY=off, so nothing is downloaded by the build.
#
# Copies of the repository may lack large blobs. The one seen missing is go-sqlite3's
# amalgamation (vendor/.../sqlite3-binding.c): the build always uses the `libsqlite3` tag, which
# links Debian 12's libsqlite3 (libsqlite3-dev, installed into the system when missing) instead.
# A missing vendor/modules.txt is refused with a clear error (the go command rejects a vendor
# tree without it as "inconsistent vendoring").
#
# Build tags: containers_image_ostree_stub exclude_graphdriver_btrfs btrfs_noversion
# containers_image_openpgp libsqlite3 (no seccomp, SELinux or AppArmor: the smoke test does
# not need them, and libseccomp-dev would be one more system package).
#
# Result:
#   .cri-o/bin/crio     CRI-O
#   .cri-o/bin/pinns    its namespace pinner (C, static)
#   .cri-o/bin/conmon   Debian 12's conmon 2.1.6
#   .cri-o/cri-api/api.proto  the CRI definition CRI-O vendors (for clients)
#
# Usage: scripts/build-crio.sh --src DIR [--smoke] [--force]
#   --src DIR  CRI-O source: a work tree, or a (bare) git directory whose HEAD is archived
#   --smoke    afterwards start crio (runc 1.4 from .runtimes-2026, CRIU 4.3 from .criu-4.3,
#              cgroupfs, vfs storage, all state under a temporary directory) and drive it over
#              gRPC with Python grpcio (from PyPI, in .cri-o/venv) and CRI-O's vendored api.proto:
#              Version, Status, then checkpoint and restore of a counter container
#              (scripts/lib/cri_smoke.py)
#   --force    rebuild even if .cri-o has a build of the same source commit
# Environment: CRIO_PREFIX (default <repo>/.cri-o), CRIO_BUILD (default <repo>/.cri-o-build,
#   kept: Go's build cache makes a rebuild quick), DEBIAN_MIRROR.
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
GO_SERIES=1.26
BUILDTAGS="containers_image_ostree_stub exclude_graphdriver_btrfs btrfs_noversion containers_image_openpgp libsqlite3"

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd -P)
PREFIX=${CRIO_PREFIX:-$REPO/.cri-o}
BUILD=${CRIO_BUILD:-$REPO/.cri-o-build}

say() { printf '[build-crio] %s\n' "$*"; }
die() { printf '[build-crio] ERROR: %s\n' "$*" >&2; exit 1; }

src="" smoke=0 force=0
while [ $# -gt 0 ]; do
    case $1 in
        --src) [ $# -ge 2 ] || die "--src needs a directory"; src=$2; shift ;;
        --smoke) smoke=1 ;;
        --force) force=1 ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        *) die "unknown argument: $1 (try --help)" ;;
    esac
    shift
done
[ -n "$src" ] || die "--src DIR is required (a copy of github.com/cri-o/cri-o; CI machines cannot fetch it)"
[ -d "$src" ] || die "$src is not a directory"
[ "$(uname -m)" = x86_64 ] || die "only x86_64 is supported (this is $(uname -m))"

system_package() {
    # $1: a file the package provides, $2: the Debian 12 package.
    [ -e "$1" ] && return 0
    [ "$(id -u)" = 0 ] || die "$2 is missing; run as root or install Debian's $2 package"
    say "installing $2 with the system's apt"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$2" \
        || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$2"; }
}
system_package /usr/include/sqlite3.h libsqlite3-dev
command -v cc >/dev/null || system_package /usr/bin/gcc gcc
command -v make >/dev/null || system_package /usr/bin/make make

# The source: HEAD of a git directory (blobs absent from the copy are left out), or a tree.
mkdir -p "$BUILD"
if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
    commit=$(git -C "$src" rev-parse HEAD)
    describe=$(git -C "$src" describe --tags HEAD 2>/dev/null || echo "$commit")
else
    commit=tree:$(cd "$src" && pwd -P)
    describe=$commit
fi
stamp="cri-o $describe ($commit)"
if [ "$force" = 0 ] && [ "$(head -n1 "$PREFIX/VERSION" 2>/dev/null)" = "$stamp" ] && "$PREFIX/bin/crio" --version >/dev/null 2>&1; then
    say "$stamp already built in $PREFIX (use --force to rebuild)"
else
    tree=$BUILD/src
    rm -rf "$tree"
    mkdir -p "$tree"
    if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
        missing=$(git -C "$src" ls-tree -r HEAD | awk '$2 == "blob" {print $3}' \
            | git -C "$src" cat-file --batch-check | awk '$2 == "missing" {print $1}')
        excludes=()
        if [ -n "$missing" ]; then
            while read -r path; do
                say "absent from this copy, left out: $path"
                excludes+=(":(exclude)$path")
            done < <(git -C "$src" ls-tree -r HEAD | awk 'NR==FNR {m[$1]=1; next} m[$3] {sub(/^[^\t]*\t/, ""); print}' <(echo "$missing") -)
        fi
        # git archive still names each absent blob on stderr ("invalid object") and goes on.
        git -C "$src" archive HEAD -- . "${excludes[@]}" 2> >(grep -v '^error: invalid object' >&2) | tar -x -C "$tree"
    else
        cp -a "$src"/. "$tree"/
    fi
    [ -f "$tree/go.mod" ] && [ -d "$tree/cmd/crio" ] || die "$src is not CRI-O's source (no go.mod or cmd/crio)"
    [ -f "$tree/vendor/modules.txt" ] || die "$src has no vendor/modules.txt: go build -mod=vendor refuses it (inconsistent vendoring)"

    # Go and conmon from the Debian archive, privately.
    # shellcheck source=lib/private-apt.sh
    . "$REPO/scripts/lib/private-apt.sh"
    private_apt_preflight "$BUILD/go" "$KEYRING" ""
    work=$BUILD/apt
    rm -rf "$work"
    private_apt "$work" "sid bookworm" "$MIRROR" "$KEYRING"
    say "fetching the sid and bookworm package indexes from $MIRROR (private)"
    apt_ apt-get -q --error-on=any update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; die "apt-get update failed"; }
    version_of() { apt_ apt-cache madison "$1" | awk -F'|' -v s="$2/main" 'index($3, s) { gsub(/ /, "", $2); print $2; exit }'; }
    go_v=$(version_of "golang-$GO_SERIES-go" sid)
    conmon_v=$(version_of conmon bookworm)
    [ -n "$go_v" ] || die "sid has no golang-$GO_SERIES-go; update this script deliberately"
    [ -n "$conmon_v" ] || die "bookworm has no conmon"
    mkdir -p "$work/debs"
    (cd "$work/debs" && apt_ apt-get -q download "golang-$GO_SERIES-go=$go_v" "golang-$GO_SERIES-src=$go_v" "conmon=$conmon_v" >"$work/download.log" 2>&1) \
        || { cat "$work/download.log" >&2; die "apt-get download failed"; }
    rm -rf "$BUILD/go" "$BUILD/conmon"
    mkdir -p "$BUILD/go" "$BUILD/conmon"
    dpkg -x "$work/debs/golang-$GO_SERIES-go_"*.deb "$BUILD/go"
    dpkg -x "$work/debs/golang-$GO_SERIES-src_"*.deb "$BUILD/go"
    dpkg -x "$work/debs/conmon_"*.deb "$BUILD/conmon"
    goroot=$BUILD/go/usr/lib/go-$GO_SERIES
    echo "go $go_v" >"$BUILD/go/VERSION"

    say "building crio $describe with $("$goroot/bin/go" version | cut -d' ' -f3) (offline, vendored; about 7 CPU-minutes)"
    (
        cd "$tree"
        export GOROOT=$goroot PATH=$goroot/bin:$PATH GOFLAGS=-mod=vendor GOTOOLCHAIN=local GOPROXY=off \
            GOCACHE=$BUILD/gocache GOPATH=$BUILD/gopath GOTELEMETRY=off
        nice -n 10 go build -trimpath -tags "$BUILDTAGS" -o bin/crio ./cmd/crio
        nice -n 10 make -s -C pinns
    ) >"$BUILD/build.log" 2>&1 || { tail -n 40 "$BUILD/build.log" >&2; die "the build failed (log: $BUILD/build.log)"; }

    stage=$PREFIX.new
    rm -rf "$stage"
    mkdir -p "$stage/bin"
    install -m 755 "$tree/bin/crio" "$tree/bin/pinns" "$BUILD/conmon/usr/bin/conmon" "$stage/bin/"
    { echo "$stamp"; echo "go $go_v (sid), conmon $conmon_v (bookworm), tags: $BUILDTAGS"; } >"$stage/VERSION"
    mkdir -p "$stage/cri-api"
    cp "$tree/vendor/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto" "$stage/cri-api/api.proto"
    rm -rf "$PREFIX"
    mv "$stage" "$PREFIX"
    say "installed in $PREFIX: $("$PREFIX/bin/crio" --version | head -n1), conmon $conmon_v"
fi

[ "$smoke" = 1 ] || exit 0

# The smoke test (scripts/lib/cri_smoke.py): crio on its own socket and state; Version, Status,
# CheckpointContainer enabled, then a counter container checkpointed and restored through CRI.
# Images are put into crio's storage with Debian 12's Podman (`podman import`, no registry):
# the counter (.runtimes' static busybox) and a pause image (a static C program built here).
RUNC=$REPO/.runtimes-2026/bin/runc
CRIU_BIN_DIR=$REPO/.criu-4.3/bin
BUSYBOX=$REPO/.runtimes/bin/busybox
[ -x "$RUNC" ] || die "$RUNC is missing: run scripts/install-runtimes-2026.sh"
[ -x "$CRIU_BIN_DIR/criu" ] || die "$CRIU_BIN_DIR/criu is missing: run scripts/install-criu.sh"
[ -x "$BUSYBOX" ] && command -v podman >/dev/null || die "busybox or podman missing: run scripts/install-runtimes.sh"
if [ ! -x "$PREFIX/venv/bin/python" ] || ! "$PREFIX/venv/bin/python" -c 'import grpc, grpc_tools' 2>/dev/null; then
    say "installing grpcio and grpcio-tools from PyPI into $PREFIX/venv"
    python3 -m venv "$PREFIX/venv"
    "$PREFIX/venv/bin/pip" install -q grpcio grpcio-tools
fi
run=$(mktemp -d "${TMPDIR:-/tmp}/crio-smoke.XXXXXX")
crio_pid=""
cleanup() {
    if [ -n "$crio_pid" ]; then kill "$crio_pid" 2>/dev/null || true; wait "$crio_pid" 2>/dev/null || true; fi
    rm -rf "$run"
}
trap cleanup EXIT
mkdir -p "$run/conf.d" "$run/net" "$run/cni-bin" "$run/hooks" "$run/py" "$run/img/counter/bin" "$run/img/pause"
cp "$BUSYBOX" "$run/img/counter/bin/busybox"
ln -s busybox "$run/img/counter/bin/sh"
printf '#include <signal.h>\n#include <unistd.h>\nstatic void stop(int s) { (void)s; _exit(0); }\nint main(void) { signal(SIGTERM, stop); signal(SIGINT, stop); for (;;) pause(); }\n' >"$run/img/pause.c"
cc -static -Os -o "$run/img/pause/pause" "$run/img/pause.c"
podman_() { podman --root "$run/root" --runroot "$run/runroot" --storage-driver vfs "$@" >>"$run/podman.log" 2>&1 || { cat "$run/podman.log" >&2; die "podman $1 failed"; }; }
tar -C "$run/img/counter" -cf "$run/img/counter.tar" .
tar -C "$run/img/pause" -cf "$run/img/pause.tar" .
podman_ import --change 'CMD ["/bin/busybox", "sh", "-c", "i=0; while true; do echo $i; i=$((i+1)); sleep 1; done"]' \
    "$run/img/counter.tar" localhost/crio-smoke-counter:latest
podman_ import "$run/img/pause.tar" localhost/crio-smoke-pause:latest
# No signature_policy here: CRI-O refuses to restore from an archive when one is set ("user
# specified image not specified, cannot verify image signature"); the system's
# /etc/containers/policy.json (Podman's) applies.
cat >"$run/crio.conf" <<CONF
[crio]
root = "$run/root"
runroot = "$run/runroot"
storage_driver = "vfs"
log_dir = "$run/log"
version_file = "$run/runroot/version"
version_file_persist = "$run/root/version"
clean_shutdown_file = "$run/root/clean.shutdown"
[crio.api]
listen = "$run/crio.sock"
stream_address = "127.0.0.1"
stream_port = "0"
[crio.runtime]
default_runtime = "runc"
cgroup_manager = "cgroupfs"
conmon_cgroup = "pod"
container_exits_dir = "$run/runroot/exits"
container_attach_socket_dir = "$run/runroot/attach"
namespaces_dir = "$run/runroot/ns"
pinns_path = "$PREFIX/bin/pinns"
hooks_dir = ["$run/hooks"]
default_mounts_file = ""
[crio.runtime.runtimes.runc]
runtime_path = "$RUNC"
runtime_root = "$run/runroot/runc"
monitor_path = "$PREFIX/bin/conmon"
[crio.checkpoint_restore]
container_level_enabled = "checkpoint_restore"
[crio.image]
pause_image = "localhost/crio-smoke-pause:latest"
pause_command = "/pause"
[crio.network]
network_dir = "$run/net"
plugin_dirs = ["$run/cni-bin"]
[crio.nri]
enable_nri = false
CONF
"$PREFIX/venv/bin/python" -m grpc_tools.protoc -I "$PREFIX/cri-api" --python_out="$run/py" --grpc_python_out="$run/py" api.proto
# CRI-O finds CRIU on PATH (as runc does); its mounts stay in a private mount namespace.
PATH=$CRIU_BIN_DIR:$PATH unshare -m --propagation private \
    "$PREFIX/bin/crio" --config "$run/crio.conf" --config-dir "$run/conf.d" --log-level info >"$run/crio.log" 2>&1 &
crio_pid=$!
for _ in $(seq 60); do [ -S "$run/crio.sock" ] && break; kill -0 "$crio_pid" 2>/dev/null || break; sleep 0.5; done
[ -S "$run/crio.sock" ] || { tail -n 30 "$run/crio.log" >&2; die "crio did not open its socket"; }
"$PREFIX/venv/bin/python" "$REPO/scripts/lib/cri_smoke.py" "$run/crio.sock" "$run/py" "$run" \
    || { grep -v 'Current CRI-O configuration' "$run/crio.log" | tail -n 20 >&2; die "the smoke test failed"; }
say "smoke test passed"
