#!/usr/bin/env bash
# Runs one program inside the test guest (scripts/guest/build.sh; docs/guest.md): a QEMU virtual
# machine with Debian 13's kernel (6.12; GUEST_SUITE=bookworm: Debian 12's, 6.1) booted
# cgroup-v2-only (cgroup_no_v1=all), every controller in the unified hierarchy. The checkout is shared at the same path (9p), with the folders its
# top-level links point at (the tools .criu-*, .runtimes* of another checkout) and those of
# GUEST_SHARES; cargo's scratch folder (<target>/tmp) is a tmpfs in the guest. The program
# runs as root in the current folder with the environment the tests read (below); its stdout
# and stderr come back as they are written; this exits with its exit status, then the guest is
# powered off.
#
# As a cargo runner:
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/guest/run.sh --" \
#       CRIU_BIN=$PWD/.criu-4.3/bin/criu cargo test --all-features --test e2e_cri cgroup2
# builds on the host and runs the test binary in the guest. The guest has no Rust: build what
# the tests would build on demand (criu-gpu: `cargo build -p criu-gpu`) beforehand.
#
# Accelerator: KVM when /dev/kvm can boot the guest's kernel, else QEMU's TCG (software, about
# ten times slower). The answer of a probe boot is cached in .guest/accel-* per host kernel,
# QEMU and guest kernel. GUEST_ACCEL=kvm|tcg forces one.
#
# Usage: scripts/guest/run.sh [--] PROGRAM [ARGS...]
#        scripts/guest/run.sh --check    exits 1, saying why, where no guest can run here
# Environment:
#   GUEST_ACCEL     auto (default), kvm or tcg
#   GUEST_TIMEOUT   seconds before the guest is killed (default 3600); exit status 124 then
#   GUEST_MEM       memory in MiB (default 4096); GUEST_CPUS (default: the host's, at most 4)
#   GUEST_CPU       QEMU's CPU model (default: host under KVM, Nehalem under TCG)
#   GUEST_TCG_THREAD  single (default: every vCPU on one host thread) or multi (a thread per
#                   vCPU: faster, but the guest kernel's text patching can race; see qemu_args)
#   GUEST_SHARES    more host folders to share at their paths (space-separated)
#   GUEST_ENV       more variable names to pass in (space-separated); always passed: CRIU_*,
#                   GPU_PLUGIN_*, FAKE_CUDA_*, RUST_*, CARGO_*, NO_COLOR
#   GUEST_KEEP=1    keeps the run folder (console log, control files) and says where
#   GUEST_SUITE     trixie (default) or bookworm: which guest (built when missing)
#   GUEST_DIR       the guest's folder (default <repo>/.guest, <repo>/.guest/bookworm for bookworm)
#   GUEST_BOOT_TRIES  boots before giving up when the guest ends before the program started, or
#                   its init has not run after GUEST_BOOT_TIMEOUT s (default 600) (default 3);
#                   never booted again once the program has started
# Exit status: the program's; 124 on timeout; 125 when the guest could not run it (or died
# while it ran).
set -euo pipefail

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
HERE=$(dirname "$SCRIPT")
REPO=$(cd "$HERE/../.." && pwd -P)
QEMU=${GUEST_QEMU:-qemu-system-x86_64}
# The guest's folder as build.sh chooses it (GUEST_DIR, else by GUEST_SUITE).
OUT=$("$HERE/build.sh" --print-dir)

say() { printf '[guest] %s\n' "$*" >&2; }
die() { printf '[guest] ERROR: %s\n' "$*" >&2; exit 125; }

# Why no guest can run here (QEMU missing, or neither KVM nor TCG in it), or nothing.
unable() {
    command -v "$QEMU" >/dev/null || { echo "$QEMU is missing (scripts/setup.sh installs qemu-system-x86)"; return; }
    local accels
    accels=$("$QEMU" -accel help 2>/dev/null | tail -n +2 | tr '\n' ' ')
    case " $accels " in *" tcg "*|*" kvm "*) ;; *) echo "$QEMU offers neither KVM nor TCG (it offers: $accels)" ;; esac
}

case ${1:-} in
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
    --check) why=$(unable); [ -z "$why" ] || { echo "$why"; exit 1; }; exit 0 ;;
esac
[ "${1:-}" = -- ] && shift
[ $# -ge 1 ] || die "usage: scripts/guest/run.sh [--] PROGRAM [ARGS...]"
why=$(unable)
[ -z "$why" ] || die "$why"

# The guest, built when missing (quick when it is there).
if ! blog=$("$HERE/build.sh" 2>&1); then
    printf '%s\n' "$blog" >&2
    die "scripts/guest/build.sh failed"
fi
kver=$("$HERE/build.sh" --print-kernel)

timeout_s=${GUEST_TIMEOUT:-3600}
mem=${GUEST_MEM:-4096}
cpus=${GUEST_CPUS:-$(n=$(nproc); [ "$n" -gt 4 ] && n=4; echo "$n")}

run=$(mktemp -d "${TMPDIR:-/tmp}/guest-run.XXXXXX")
qemu_pid="" readers=""
cleanup() {
    [ -z "$qemu_pid" ] || kill "$qemu_pid" 2>/dev/null || true
    for p in $readers; do kill "$p" 2>/dev/null || true; done
    if [ "${GUEST_KEEP:-0}" = 1 ]; then say "kept $run"; else rm -rf "$run"; fi
}
trap cleanup EXIT

# ---- what the guest shares with the host --------------------------------------------------

shares=()
shared() {
    # Whether $1 is under a folder already shared.
    local s
    for s in "${shares[@]}"; do
        case $1/ in "$s"/*) return 0 ;; esac
    done
    return 1
}
share() {
    # The guest's own system folders stay the guest's (a program in /usr/bin runs the guest's).
    local d
    d=$(readlink -f -- "$1") || return 0
    [ -d "$d" ] || return 0
    case $d in
        /|/usr|/usr/*|/bin|/bin/*|/sbin|/sbin/*|/lib|/lib/*|/lib64|/lib64/*|/etc|/etc/*) return 0 ;;
        /proc|/proc/*|/sys|/sys/*|/dev|/dev/*|/run|/run/*|/tmp) return 0 ;;
    esac
    shared "$d" || shares+=("$d")
}
share "$REPO"
for l in "$REPO"/.[!.]* "$REPO"/*; do
    [ -L "$l" ] && [ -d "$l" ] && share "$l"
done
# The built tools (CRIU, the runtimes, the cluster's programs): shares of their own, which the
# guest caches (9p's cache=loose): nothing changes them while the guest runs, and a program
# run from an uncached share is read over 9p again at each start, seconds under TCG for a
# Go program of 60 MB that a test runs dozens of times (kubectl, ctr, runc).
tools=()
for l in "$REPO"/.criu* "$REPO"/.runtimes* "$REPO"/.upstream; do
    d=$(readlink -f -- "$l") && [ -d "$d" ] && tools+=("$d")
done
program=$1
case $program in
    */*) program=$(readlink -f -- "$program") || die "no program $1" ;;
    *) ;;
esac
[[ $program == /* ]] && share "$(dirname "$program")"
share "$PWD"
[ -z "${CARGO_TARGET_DIR:-}" ] || share "$CARGO_TARGET_DIR"
for d in ${GUEST_SHARES:-}; do
    [ -d "$d" ] || die "GUEST_SHARES: no folder $d"
    share "$d"
done

# cargo's target folder of the program (the nearest folder above it with cargo's CACHEDIR.TAG
# or .rustc_info.json: cargo writes the tag only into a target folder it creates itself, and one
# made before, by `mkdir -p target/x`, has none): its tmp/ is the tests' scratch folder
# (CARGO_TARGET_TMPDIR), a tmpfs in the guest.
tmpfs=()
if [[ $program == /* ]]; then
    d=$(dirname "$program")
    while [ "$d" != / ]; do
        if [ -f "$d/CACHEDIR.TAG" ] || [ -f "$d/.rustc_info.json" ]; then
            mkdir -p "$d/tmp"; tmpfs+=("$d/tmp"); break
        fi
        d=$(dirname "$d")
    done
fi

: >"$run/shares"
virtfs=()
i=0
# Parents before children, so that a share inside another is mounted over it; a tool folder's
# tag says the guest may cache it.
while IFS= read -r d; do
    [ -n "$d" ] || continue
    kind=share
    for t in "${tools[@]}"; do [ "$d" != "$t" ] || kind=tool; done
    echo "guest.$kind$i $d" >>"$run/shares"
    virtfs+=(-virtfs "local,path=$d,mount_tag=guest.$kind$i,security_model=passthrough,multidevs=remap")
    i=$((i + 1))
done < <(printf '%s\n' "${shares[@]}" "${tools[@]}" | sort -u | awk '{ print length($0), $0 }' | sort -n | cut -d' ' -f2-)
printf '%s\n' "${tmpfs[@]}" >"$run/tmpfs"

# ---- what the program gets ----------------------------------------------------------------

printf '%s\0' "$program" "${@:2}" >"$run/argv"
printf '%s' "$PWD" >"$run/cwd"
: >"$run/env"
extra=" ${GUEST_ENV:-} "
while IFS= read -r -d '' kv; do
    name=${kv%%=*}
    case $name in
        CRIU_*|GPU_PLUGIN_*|FAKE_CUDA_*|RUST_*|CARGO_*|NO_COLOR) printf '%s\0' "$kv" >>"$run/env" ;;
        *) [[ $extra == *" $name "* ]] && printf '%s\0' "$kv" >>"$run/env" ;;
    esac
done < <(env -0)
printf '%s\0' HOME=/root TERM=dumb >>"$run/env"

# ---- the machine --------------------------------------------------------------------------

cmdline="console=ttyS0 loglevel=4 cgroup_no_v1=all panic=-1 mitigations=off rootwait"
qemu_args() {
    # $1 accelerator, $2 run folder
    local accel=$1 dir=$2 cpu=max
    # TCG: one host thread for all vCPUs by default (with a thread per vCPU, a vCPU can run a
    # stale translation of kernel text another vCPU is patching, static keys or alternatives,
    # and hit the patch's int3 after it is done: "Oops: int3" and a panic, seen in CI); a
    # larger translation cache than the default for a guest this busy; a CPU without AVX,
    # whose emulation costs most (glibc's and Go's string and memory functions take the AVX
    # paths when the CPU has them). KVM: the host's CPU.
    if [ "$accel" = kvm ]; then cpu=host; else accel=tcg,thread=${GUEST_TCG_THREAD:-single},tb-size=512; cpu=Nehalem; fi
    cpu=${GUEST_CPU:-$cpu}
    printf '%s\0' -nodefaults -no-user-config -display none -no-reboot \
        -machine q35 -accel "$accel" -cpu "$cpu" -smp "$cpus" -m "$mem" \
        -kernel "$OUT/vmlinuz" -initrd "$OUT/initrd.img" -append "$cmdline" \
        -serial "file:$dir/console.log" \
        -drive "file=$OUT/rootfs.img,format=raw,if=virtio,snapshot=on" \
        -device virtio-rng-pci \
        -device virtio-serial-pci \
        -chardev "pipe,id=out,path=$dir/out" -device virtserialport,chardev=out,name=guest.stdout \
        -chardev "pipe,id=err,path=$dir/err" -device virtserialport,chardev=err,name=guest.stderr \
        -virtfs "local,path=$dir,mount_tag=guest.ctl,security_model=none"
    [ "$dir" != "$run" ] || printf '%s\0' "${virtfs[@]}"
}
fifos() { local f; for f in out.in out.out err.in err.out; do rm -f "$1/$f"; mkfifo "$1/$f"; done; }

# Whether KVM boots this kernel: a probe boot running `true`, cached.
accel=${GUEST_ACCEL:-auto}
if [ "$accel" = auto ]; then
    key="$(uname -r)-$("$QEMU" --version | head -n1 | awk '{ print $4 }')-$kver"
    cache=$OUT/accel-$key
    case $(head -n1 "$cache" 2>/dev/null) in
        kvm|tcg) accel=$(head -n1 "$cache") ;;
        *) rm -f "$cache" ;;
    esac
    if [ "$accel" != auto ]; then
        :
    elif [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then
        accel=tcg
        printf 'tcg\nno usable /dev/kvm\n' >"$cache.$$" && mv -f "$cache.$$" "$cache"
    else
        probe=$run/probe
        mkdir -p "$probe"
        printf '%s\0' /bin/true >"$probe/argv"
        printf / >"$probe/cwd"
        : >"$probe/env"; : >"$probe/shares"; : >"$probe/tmpfs"
        fifos "$probe"
        cat "$probe/out.out" >/dev/null & p1=$!
        cat "$probe/err.out" >/dev/null & p2=$!
        mapfile -d '' -t a < <(qemu_args kvm "$probe")
        { timeout -k 5 60 "$QEMU" "${a[@]}" </dev/null >"$probe/qemu.log" 2>&1 || true; } 2>/dev/null
        kill "$p1" "$p2" 2>/dev/null || true
        if [ "$(cat "$probe/rc" 2>/dev/null)" = 0 ]; then
            accel=kvm
            echo kvm >"$cache.$$" && mv -f "$cache.$$" "$cache"
        else
            accel=tcg
            why=$(head -c 300 "$probe/qemu.log" | tr '\n' ' ')
            [ -n "$why" ] || why="the guest did not reach its init (console: $(grep -v '^$' "$probe/console.log" 2>/dev/null | tail -n1 | head -c 200))"
            printf 'tcg\nKVM probe: %s\n' "$why" >"$cache.$$" && mv -f "$cache.$$" "$cache"
        fi
    fi
    note=$(sed -n 2p "$cache")
    say "accelerator: $accel${note:+ ($note)} (cached in $cache)"
else
    say "accelerator: $accel (GUEST_ACCEL)"
fi

case $accel in kvm|tcg) ;; *) die "no accelerator '$accel' (GUEST_ACCEL: auto, kvm or tcg)" ;; esac
# One boot of the guest running the program. When the guest ends before the program started
# (QEMU failed or the kernel died on the way: infrastructure, not the program's doing), it is
# booted again, up to GUEST_BOOT_TRIES times in all; once the program has started (init.sh
# writes `started` to the control share just before running it), its end is final.
tries=${GUEST_BOOT_TRIES:-3}
boot_limit=${GUEST_BOOT_TIMEOUT:-600}
mapfile -d '' -t a < <(qemu_args "$accel" "$run")
t0=$(date +%s)
try=1
while :; do
    rm -f "$run/rc" "$run/started" "$run/booted" "$run/console.log" "$run/qemu.log"
    fifos "$run"
    cat "$run/out.out" & readers="$!"
    cat "$run/err.out" >&2 & readers="$readers $!"
    tb=$(date +%s)
    timeout -k 10 "$timeout_s" "$QEMU" "${a[@]}" </dev/null >"$run/qemu.log" 2>&1 &
    qemu_pid=$!
    # A boot that hangs before the guest's init runs counts as one that failed.
    hung=0
    while kill -0 "$qemu_pid" 2>/dev/null; do
        if [ ! -e "$run/booted" ] && [ $(( $(date +%s) - tb )) -ge "$boot_limit" ]; then
            hung=1
            kill "$qemu_pid" 2>/dev/null || true
            break
        fi
        sleep 1
    done
    set +e
    wait "$qemu_pid"
    qrc=$?
    set -e
    qemu_pid=""
    # The readers end when the last writer (QEMU) has gone. One still waiting to open its FIFO
    # (QEMU failed before it opened the pipes) is let through by an open and close of the write
    # end here, which never blocks read-write.
    for f in out.out err.out; do exec {w}<>"$run/$f"; exec {w}>&-; done
    for p in $readers; do wait "$p" 2>/dev/null || true; done
    readers=""
    [ ! -f "$run/rc" ] && [ ! -e "$run/started" ] && [ "$qrc" != 124 ] || break
    [ "$try" -lt "$tries" ] || break
    try=$((try + 1))
    if [ "$hung" = 1 ]; then
        why="the guest's init had not run after $boot_limit s (GUEST_BOOT_TIMEOUT)"
    else
        why="the guest ended before running the program (QEMU exit $qrc)"
    fi
    last=""
    [ "$hung" = 1 ] || last=$(grep -v '^$' "$run/qemu.log" 2>/dev/null | head -n1 | head -c 200 || true)
    [ -n "$last" ] || last="console: $(grep -v '^$' "$run/console.log" 2>/dev/null | tail -n1 | head -c 200 || true)"
    say "$why; booting again, try $try of $tries ($last)"
done
took=$(( $(date +%s) - t0 ))
if [ -f "$run/rc" ]; then
    rc=$(cat "$run/rc")
    say "guest ($accel, $kver) ran $(basename "$program"): exit status $rc in ${took} s"
    exit "$rc"
fi
if [ "$hung" = 1 ]; then
    say "the guest's init had not run after $boot_limit s (GUEST_BOOT_TIMEOUT), $try boot(s) tried; console:"
    rc=125
elif [ "$qrc" = 124 ]; then
    say "timeout: the guest was still running after $timeout_s s (GUEST_TIMEOUT); console:"
    rc=124
elif [ -e "$run/started" ]; then
    say "the guest ended while the program ran, without its exit status (QEMU exit $qrc: $(head -c 500 "$run/qemu.log")); console:"
    rc=125
else
    say "the guest ended before running the program, $try boot(s) tried (QEMU exit $qrc: $(head -c 500 "$run/qemu.log")); console:"
    rc=125
fi
# A kernel oops: from its first line (what failed, where), not only the panic's tail.
oops=$(grep -n -m1 -E 'BUG: |Oops: |general protection fault|WARNING: CPU|Kernel panic' "$run/console.log" 2>/dev/null | cut -d: -f1 || true)
if [ -n "$oops" ]; then
    sed -n "$(( oops > 5 ? oops - 5 : 1 )),$(( oops + 60 ))p" "$run/console.log" >&2 || true
    echo "[guest] ... (the console's last lines:)" >&2
fi
tail -n 30 "$run/console.log" >&2 2>/dev/null || true
exit "$rc"
