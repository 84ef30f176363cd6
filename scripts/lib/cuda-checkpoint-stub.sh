#!/bin/sh
# Stand-in cuda-checkpoint for scripts/build-criu-cuda-plugin.sh --check: records its arguments;
# answers for the one pid in $STUB_PID; its second
# --get-restore-tid says "no CUDA" so that nothing is ptrace-resumed.
echo "$*" >>"$STUB_LOG"
case "$1" in
    -h) echo "--action --get-state --get-restore-tid --pid --timeout"; exit 0 ;;
    --get-restore-tid)
        n=$(grep -c -- '^--get-restore-tid' "$STUB_LOG")
        [ "$3" = "$STUB_PID" ] && [ "$n" = 1 ] && { echo "$3"; exit 0; }
        exit 1 ;;
    --get-state) echo running; exit 0 ;;
    --action) exit 0 ;;
esac
exit 1
