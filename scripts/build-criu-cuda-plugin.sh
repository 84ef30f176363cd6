#!/usr/bin/env bash
# Build CRIU's own C CUDA plugin (plugins/cuda/cuda_plugin.so) for comparison runs against
# this plugin, from CRIU's source at the tag of the CRIU in .criu/.
#
#   scripts/build-criu-cuda-plugin.sh OUT.so [--check]
#
# Needs a git directory of CRIU's repository (bare is fine) in $CRIU_GIT_DIR (required: there
# is no default, the clone lives wherever this machine keeps it). Only what the plugin includes is generated (compel's headers, config.h,
# version.h); CRIU itself is not built. The plugin calls CRIU's logging, inventory and compel
# functions, which the criu binary exports, so it is built the way CRIU's Makefile builds it
# (-shared -fPIC -nostartfiles, CRIU's include paths) and every CRIU symbol it needs is checked
# against the binary's dynamic symbols.
#
# --check: load it into .criu/bin/criu and dump a sleeping process with a stand-in
# cuda-checkpoint that records its arguments, with the plugin forced on (CRIU_FAULT=138): shows
# the plugin loads, that it reads CRIU's --timeout (the lock is given timeout*1000) and sees
# --leave-running (it then resumes the process), i.e. that its view of CRIU's options matches
# this binary. Needs root.
# Environment: CRIU_GIT_DIR, CRIU_TAG (default v<version of .criu/bin/criu>), CRIU (binary).
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
CRIU=${CRIU:-$REPO/.criu/bin/criu}
CRIU_GIT_DIR=${CRIU_GIT_DIR:-}
say() { printf '[build-criu-cuda-plugin] %s\n' "$*"; }
die() { printf '[build-criu-cuda-plugin] ERROR: %s\n' "$*" >&2; exit 1; }

out=${1:?usage: CRIU_GIT_DIR=DIR $0 OUT.so [--check]}
[ -n "$CRIU_GIT_DIR" ] || die "set CRIU_GIT_DIR to a git directory of CRIU's repository (github.com/checkpoint-restore/criu; a bare clone is fine)"
check=${2:-}
[ -x "$CRIU" ] || die "no CRIU at $CRIU (scripts/install-criu.sh)"
version=$("$CRIU" --version | sed -n 's/^Version: *//p')
tag=${CRIU_TAG:-v$version}
[ -d "$CRIU_GIT_DIR" ] || die "no CRIU git directory at $CRIU_GIT_DIR: get CRIU's repository (github.com/checkpoint-restore/criu) and set CRIU_GIT_DIR"
git --git-dir="$CRIU_GIT_DIR" rev-parse -q --verify "refs/tags/$tag^{commit}" >/dev/null \
    || die "tag $tag (CRIU $version) not in $CRIU_GIT_DIR; tags there: $(git --git-dir="$CRIU_GIT_DIR" tag | tr '\n' ' ')"
for t in gcc make; do command -v $t >/dev/null || die "$t is needed"; done
src=$(mktemp -d "${TMPDIR:-/tmp}/criu-src.XXXXXX")
trap 'rm -rf "$src"' EXIT
# CRIU's option header includes <sys/capability.h>: without libcap-dev installed, its header
# comes from the package unpacked here (nothing is installed on this machine).
capinc=()
if [ ! -e /usr/include/sys/capability.h ]; then
    say "no <sys/capability.h>: unpacking libcap-dev's headers into $src"
    (cd "$src" && apt-get download libcap-dev >"$src/apt.log" 2>&1) \
        || { cat "$src/apt.log" >&2; die "apt-get download libcap-dev failed (run apt-get update?)"; }
    dpkg -x "$src"/libcap-dev_*.deb "$src/libcap"
    capinc=(-isystem "$src/libcap/usr/include")
fi
git --git-dir="$CRIU_GIT_DIR" archive "$tag" | tar -x -C "$src"
say "CRIU source $tag ($(git --git-dir="$CRIU_GIT_DIR" rev-parse "$tag^{commit}")) in $src"
# The generated headers the plugin's includes reach; compel-host prints compel's include path.
make -C "$src" -s compel/compel-host include/common/config.h include/common/asm criu/include/version.h \
    >"$src/make.log" 2>&1 || { tail -30 "$src/make.log" >&2; die "generating CRIU's headers failed"; }
(
    cd "$src/plugins/cuda"
    # shellcheck disable=SC2046  # compel prints several words of flags
    gcc -g -O2 -Wall -shared -nostartfiles -fPIC $(../../compel/compel-host includes) "${capinc[@]}" cuda_plugin.c \
        -o cuda_plugin.so -iquote../../include -iquote../../criu/include \
        -iquote../../criu/arch/x86/include/ -iquote../../
) || die "compiling cuda_plugin.c failed"
so=$src/plugins/cuda/cuda_plugin.so

# Every symbol the plugin takes from CRIU must be exported by this criu binary.
bin=$(dirname "$(readlink -f "$CRIU")")/../usr/sbin/criu
[ -f "$bin" ] || bin=$(readlink -f "$CRIU")
if file -b "$bin" | grep -q ELF; then
    nm -D --defined-only "$bin" | awk '{print $3}' | sort -u >"$src/criu.syms"
    # libc's functions come from libc, not from criu.
    libc=$(dirname "$bin")/../lib/x86_64-linux-gnu/libc.so.6
    [ -f "$libc" ] || libc=/lib/x86_64-linux-gnu/libc.so.6
    nm -D --defined-only "$libc" | awk '{print $3}' | sed 's/@.*//' | sort -u >"$src/libc.syms"
    missing=""
    for s in $(nm -D --undefined-only "$so" | awk '{print $2}' | sed 's/@.*//'); do
        case $s in __gmon_start__|_ITM_*|__cxa_finalize) continue ;; esac
        grep -qx "$s" "$src/criu.syms" "$src/libc.syms" || missing="$missing $s"
    done
    [ -z "$missing" ] || die "symbols neither in $bin nor in libc:$missing"
    say "every CRIU symbol the plugin uses is exported by $bin"
fi
mkdir -p "$(dirname "$out")"
install -m 755 "$so" "$out"
say "built $out ($(stat -c %s "$out") bytes) from CRIU $tag"

[ "$check" = --check ] || exit 0

# Load check with a stand-in cuda-checkpoint (the real one needs a GPU driver).
t=$src/check
mkdir -p "$t/lib" "$t/bin" "$t/img"
cp "$out" "$t/lib/"
install -m 755 "$REPO/scripts/lib/cuda-checkpoint-stub.sh" "$t/bin/cuda-checkpoint"
one_dump() { # $1: extra criu option or empty
    rm -rf "$t/img"/* "$t/stub.log"
    setsid sleep 600 </dev/null >/dev/null 2>&1 &
    local pid=$!
    disown "$pid"
    sleep 0.3
    STUB_LOG=$t/stub.log STUB_PID=$pid CRIU_FAULT=138 PATH="$t/bin:$PATH" \
        "$CRIU" dump -t "$pid" -D "$t/img" -L "$t/lib" -v4 -o dump.log --timeout 37 ${1:+"$1"} \
        || { tail -40 "$t/img/dump.log" >&2; kill -9 "$pid" 2>/dev/null; die "criu dump with the C plugin failed"; }
    kill -9 "$pid" 2>/dev/null || true
    grep -q 'Plugin "cuda_plugin"' "$t/img/dump.log" || die "dump.log does not show cuda_plugin loaded"
    grep -q 'cuda_plugin: initialized' "$t/img/dump.log" || die "cuda_plugin did not initialise (see $t/img/dump.log)"
    grep -q -- "--action lock --pid $pid --timeout 37000" "$t/stub.log" \
        || { cat "$t/stub.log" >&2; die "the lock did not get CRIU's --timeout 37 as 37000 ms: the plugin's view of CRIU's options differs from this binary"; }
}
one_dump ""
[ "$(grep -c -- '^--get-restore-tid' "$t/stub.log")" = 2 ] \
    || { cat "$t/stub.log" >&2; die "plain dump: expected no resume call"; }
one_dump --leave-running
[ "$(grep -c -- '^--get-restore-tid' "$t/stub.log")" = 3 ] \
    || { cat "$t/stub.log" >&2; die "--leave-running: the plugin did not try to resume the process"; }
sed 's/^/    cuda-checkpoint /' "$t/stub.log"
say "check: $CRIU loads it; it reads --timeout and --leave-running as this CRIU sets them"
