#!/usr/bin/env bash
# Checks scripts/guest/run.sh's handling of a guest that ends without an exit status, with a
# QEMU wrapper that fails the first boots: a boot that fails before the program started is
# tried again (up to three boots), one where the program started and the kernel then died is
# not (exit status 125). About a minute under TCG.
#
# Usage: scripts/guest/selftest.sh     (GUEST_SUITE / GUEST_DIR choose the guest as for run.sh)
set -euo pipefail
HERE=$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")
say() { printf '[guest-selftest] %s\n' "$*" >&2; }
fail() { printf '[guest-selftest] FAILED: %s\n' "$*" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/guest-selftest.XXXXXX")
trap 'rm -rf "$work"' EXIT
real=${GUEST_QEMU:-qemu-system-x86_64}
# Fails a boot (an invocation with -kernel; --version and -accel help pass) while the count in
# $work/fail is above 0.
cat >"$work/qemu" <<WRAP
#!/bin/bash
case " \$* " in *" -kernel "*)
    n=\$(cat "$work/fail")
    if [ "\$n" -gt 0 ]; then echo \$((n - 1)) >"$work/fail"; echo "selftest: this boot fails" >&2; exit 1; fi ;;
esac
exec "$real" "\$@"
WRAP
chmod +x "$work/qemu"
export GUEST_QEMU=$work/qemu

check() {
    # $1 boots to fail, $2 expected exit status, $3 expected count of "booting again", then the program
    local n=$1 want=$2 again=$3 rc=0 got
    shift 3
    echo "$n" >"$work/fail"
    "$HERE/run.sh" -- "$@" >"$work/out" 2>"$work/err" || rc=$?
    got=$(grep -c 'booting again' "$work/err" || true)
    [ "$rc" = "$want" ] && [ "$got" = "$again" ] \
        || { cat "$work/err" >&2; fail "$n failing boot(s), $*: exit status $rc (wanted $want), $got retries (wanted $again)"; }
    say "ok: $n failing boot(s), $*: exit status $rc after $got retries"
}
check 1 0 1 /bin/true
check 2 3 2 /bin/sh -c 'exit 3'
check 3 125 2 /bin/true
# Started, then the kernel dies: final, no boot again.
check 0 125 0 /bin/sh -c 'echo c >/proc/sysrq-trigger'
say "run.sh boots again only before the program started"
