/*
 * fake_cuda_checkpoint.c - the command line of NVIDIA's cuda-checkpoint utility, over the
 * stand-in driver (tests/fixtures/fake-cuda/fake_libcuda.c), so that CRIU's C CUDA plugin,
 * which runs `cuda-checkpoint` for every step, can be driven on a machine without a GPU
 * (container_check.py --fake-cuda). The real utility reaches the driver through interfaces the
 * stand-in does not model.
 *
 * Build: cc -O2 -o DIR/cuda-checkpoint fake_cuda_checkpoint.c -LDIR -l:libcuda.so.1 \
 *           -Wl,-rpath,'$ORIGIN' -Wl,--disable-new-dtags
 *
 *   cuda-checkpoint -h
 *   cuda-checkpoint --get-restore-tid --pid PID     prints the TID
 *   cuda-checkpoint --get-state --pid PID           prints running | locked | checkpointed | failed
 *   cuda-checkpoint --action lock|checkpoint|restore|unlock --pid PID [--timeout MS]
 * Exit status 0, or 1 with the driver's error on stdout (the C plugin reads stdout and stderr).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../fixtures/fake-cuda/cuda_checkpoint_types.h"

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);
CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
CUresult cuGetErrorString(CUresult error, const char **str);

static int fail(const char *what, CUresult rc)
{
    const char *s = "?";
    cuGetErrorString(rc, &s);
    printf("%s failed: %d (%s)\n", what, rc, s);
    return 1;
}

int main(int argc, char **argv)
{
    const char *action = NULL, *query = NULL;
    int pid = 0;
    unsigned int timeout = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: cuda-checkpoint --action ACTION --pid PID [--timeout MS] | --get-state --pid PID | "
                   "--get-restore-tid --pid PID\n");
            return 0;
        } else if (!strcmp(argv[i], "--action") && i + 1 < argc) {
            action = argv[++i];
        } else if (!strcmp(argv[i], "--pid") && i + 1 < argc) {
            pid = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
            timeout = (unsigned int)strtoul(argv[++i], NULL, 0);
        } else if (!strcmp(argv[i], "--get-state") || !strcmp(argv[i], "--get-restore-tid")) {
            query = argv[i];
        } else {
            printf("unknown argument %s\n", argv[i]);
            return 1;
        }
    }
    if (pid <= 0) {
        printf("--pid is needed\n");
        return 1;
    }
    CUresult rc;
    if (query && !strcmp(query, "--get-restore-tid")) {
        int tid = 0;
        if ((rc = cuCheckpointProcessGetRestoreThreadId(pid, &tid)))
            return fail("get restore tid", rc);
        printf("%d\n", tid);
        return 0;
    }
    if (query) {
        static const char *names[] = {"running", "locked", "checkpointed", "failed"};
        CUprocessState st = 0;
        if ((rc = cuCheckpointProcessGetState(pid, &st)))
            return fail("get state", rc);
        printf("%s\n", st < 4 ? names[st] : "unknown");
        return 0;
    }
    if (!action) {
        printf("--action or --get-state is needed\n");
        return 1;
    }
    CUcheckpointReservedArgs zero = {{0}};
    if (!strcmp(action, "lock")) {
        CUcheckpointLockArgs la = {0};
        la.timeoutMs = timeout;
        rc = cuCheckpointProcessLock(pid, &la);
    } else if (!strcmp(action, "checkpoint")) {
        rc = cuCheckpointProcessCheckpoint(pid, &zero);
    } else if (!strcmp(action, "restore")) {
        CUcheckpointRestoreArgs ra = {0}; /* no GPU pairs */
        rc = cuCheckpointProcessRestore(pid, &ra);
    } else if (!strcmp(action, "unlock")) {
        rc = cuCheckpointProcessUnlock(pid, &zero);
    } else {
        printf("unknown action %s\n", action);
        return 1;
    }
    return rc ? fail(action, rc) : 0;
}
