#!/usr/bin/env bash
# Runs end-to-end suites in the test guests (scripts/guest/run.sh as cargo's runner), on demand:
# the kernels users run (Debian 12's 6.1, Debian 13's 6.12) rather than the host's. The tests
# are built here; each test binary boots the guest once. Every run's output is kept in
# target/guest-suites/<guest>-criu<release>-<set>.log and a line per run is added to
# target/guest-suites/summary.txt (guest, kernel, CRIU, set, result, seconds, counts).
#
# Fails when a test fails, when a binary did not run to its end, or when a test printed a
# SKIPPED line that is not expected (expected: e2e_criu_4_3's "older than 4.3" with a CRIU
# before 4.3, e2e_cuda_restore_state's "reads pstree.img before calling plugins" with one after
# 4.1, and what --allow-skip matches).
#
# Usage: scripts/guest/suites.sh [--suite trixie|bookworm|all] [--criu RELEASES]
#                                [--allow-skip REGEX] [--keep-going] SET... [-- TEST ARGS...]
#   --suite       the guest(s), comma-separated or "all" (default bookworm)
#   --criu        CRIU release(s), comma-separated: 4.3, 4.2.1 or default (.criu) (default 4.3)
#   --allow-skip  SKIPPED lines matching this (grep -E) are expected too
#   --keep-going  runs every chosen combination before failing
#   SET           plain      e2e_criu e2e_criu_4_3 (CRIU dump and restore with the plugin)
#                 cuda       e2e_cuda_fake e2e_cuda_fake_failures e2e_cuda_settings
#                            e2e_cuda_restore_state (the stand-in CUDA driver)
#                 cut-short  e2e_cut_short
#                 containers e2e_containers e2e_containers_2026
#                 cri        e2e_cri (builds criu-gpu first)
#                 e2e_NAME   one test binary by name (tests/e2e_NAME.rs)
#   TEST ARGS     passed to the test binaries (a name filter, --skip NAME, --exact)
# Example: scripts/guest/suites.sh --suite all --criu 4.3 plain cuda
set -euo pipefail

SCRIPT=$(readlink -f -- "${BASH_SOURCE[0]}")
HERE=$(dirname "$SCRIPT")
REPO=$(cd "$HERE/../.." && pwd -P)

say() { printf '[guest-suites] %s\n' "$*" >&2; }
die() { printf '[guest-suites] ERROR: %s\n' "$*" >&2; exit 2; }

guests=bookworm releases=4.3 allow="" keep_going=0 sets=() targs=()
while [ $# -gt 0 ]; do
    case $1 in
        --suite) guests=${2:?--suite needs a value}; shift 2 ;;
        --criu) releases=${2:?--criu needs a value}; shift 2 ;;
        --allow-skip) allow=${2:?--allow-skip needs a value}; shift 2 ;;
        --keep-going) keep_going=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SCRIPT"; exit 0 ;;
        --) shift; targs=("$@"); break ;;
        -*) die "unknown option $1 (try --help)" ;;
        *) sets+=("$1"); shift ;;
    esac
done
[ ${#sets[@]} -gt 0 ] || die "name at least one set: plain cuda cut-short containers cri e2e_NAME (try --help)"
[ "$guests" != all ] || guests=bookworm,trixie

binaries() {
    # The test binaries of set $1.
    case $1 in
        plain) echo e2e_criu e2e_criu_4_3 ;;
        cuda) echo e2e_cuda_fake e2e_cuda_fake_failures e2e_cuda_settings e2e_cuda_restore_state ;;
        cut-short) echo e2e_cut_short ;;
        containers) echo e2e_containers e2e_containers_2026 ;;
        cri) echo e2e_cri ;;
        e2e_*) [ -f "$REPO/tests/$1.rs" ] || die "no tests/$1.rs"; echo "$1" ;;
        *) die "unknown set $1 (plain cuda cut-short containers cri e2e_NAME)" ;;
    esac
}
criu_of() {
    case $1 in
        default) echo "$REPO/.criu/bin/criu" ;;
        *) echo "$REPO/.criu-$1/bin/criu" ;;
    esac
}
for s in "${sets[@]}"; do binaries "$s" >/dev/null; done
for r in ${releases//,/ }; do
    [ -x "$(criu_of "$r")" ] || die "no CRIU $r at $(criu_of "$r") (scripts/setup.sh installs it)"
done
for g in ${guests//,/ }; do
    case $g in trixie|bookworm) ;; *) die "unknown guest $g (trixie, bookworm or all)" ;; esac
done
why=$("$HERE/run.sh" --check) || die "no guest can run here: $why"

cd "$REPO"
out=$REPO/target/guest-suites
mkdir -p "$out"
# What every suite runs: the release plugin; the CRI tests run criu-gpu, which the guest cannot
# build.
say "building the release plugin"
cargo build --release --locked -p criu-gpu-plugin --lib
case " ${sets[*]} " in *" cri "*|*" e2e_cri "*) cargo build --locked -p criu-gpu ;; esac

failed=()
for g in ${guests//,/ }; do
    GUEST_SUITE=$g "$HERE/build.sh"
    kver=$(GUEST_SUITE=$g "$HERE/build.sh" --print-kernel)
    for r in ${releases//,/ }; do
        for s in "${sets[@]}"; do
            log=$out/$g-criu$r-$s.log
            tests=()
            for b in $(binaries "$s"); do tests+=(--test "$b"); done
            say "$g ($kver), CRIU $r: $s (${tests[*]}) ${targs[*]:+-- ${targs[*]}}; output in $log"
            t0=$(date +%s)
            # Only the test lines, the guest's own and panics on the terminal, as they come;
            # everything in the log.
            {
                rc=0
                GUEST_SUITE=$g CRIU_BIN=$(criu_of "$r") \
                    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$HERE/run.sh --" \
                    cargo test --all-features --locked --no-fail-fast "${tests[@]}" -- "${targs[@]}" --nocapture \
                    2>&1 || rc=$?
                echo "$rc" >"$log.rc"
            } | tee "$log" | grep --line-buffered -E '^test .* \.\.\. |^test result|SKIPPED|^\[guest\]|panicked' >&2 || true
            rc=$(cat "$log.rc")
            rm -f "$log.rc"
            took=$(( $(date +%s) - t0 ))
            passed=$(grep -cE '^test .* \.\.\. ok$' "$log" || true)
            nfail=$(grep -cE '^test .* \.\.\. FAILED$' "$log" || true)
            # The skips a CRIU release makes expected, as the tests word them: e2e_criu_4_3 skips
            # before 4.3; the pstree.img case of e2e_cuda_restore_state runs on 4.0 and 4.1 only.
            ver=$("$(criu_of "$r")" --version | sed -n 's/^Version: *//p')
            expected='^$'
            case $ver in 4.[0-2]|4.[0-2].*) expected="$expected|is older than 4\.3" ;; esac
            case $ver in 4.[01]|4.[01].*) ;; *) expected="$expected|reads pstree\.img before calling plugins" ;; esac
            unexpected=$(grep SKIPPED "$log" | grep -vE "$expected" | { [ -z "$allow" ] && cat || grep -vE "$allow"; } || true)
            nskip=$(grep -c SKIPPED "$log" || true)
            result=pass
            if [ "$rc" != 0 ]; then
                result="FAIL (cargo exit $rc)"
            elif [ -n "$unexpected" ]; then
                result="FAIL (unexpected SKIPPED)"
                printf '%s\n' "$unexpected" >&2
            fi
            line="$g $kver criu-$r $s: $result in ${took} s ($passed passed, $nfail failed, $nskip skipped)"
            echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $line${targs[*]:+ [${targs[*]}]}" >>"$out/summary.txt"
            say "$line"
            if [ "$result" != pass ]; then
                failed+=("$g/criu-$r/$s")
                [ "$keep_going" = 1 ] || { say "FAILED: $g, CRIU $r, $s (see $log)"; exit 1; }
            fi
        done
    done
done
if [ ${#failed[@]} -gt 0 ]; then
    say "FAILED: ${failed[*]} (logs in $out)"
    exit 1
fi
say "all passed (summary in $out/summary.txt)"
