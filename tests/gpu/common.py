"""What the GPU checks share: becoming the reaper of their workloads, the CUDA workload binary,
running named cases one by one, and reading a refused restore's log."""

import argparse
import ctypes
import json
import os
import time

PR_SET_CHILD_SUBREAPER = 36
HERE = os.path.dirname(os.path.abspath(__file__))


def parser(*required):
    """An argument parser that starts with the `required` options (paths every run needs)."""
    ap = argparse.ArgumentParser()
    for name in required:
        ap.add_argument(name, required=True)
    return ap


def become_subreaper():
    """Killed workloads are reaped here at once, so their pids are free for the restore (CRIU
    restores the same pids)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def workload(ctx, given=None):
    """The CUDA workload binary: `given`, or built once from cuda_workload.cu into the work folder."""
    wl = given or os.path.join(ctx.work, "cuda_workload")
    if not os.path.exists(wl):
        ctx.sh(["nvcc", "-O2", "-o", wl, os.path.join(HERE, "cuda_workload.cu")], log="nvcc.out")
    return wl


def run_case(cases, name, failures=None):
    """Runs case `name` of `cases` and prints its JSON line; an exception becomes a failed result (added to
    `failures` when given) so that one broken case does not hide the others. Returns the result
    and the case's seconds."""
    t = time.time()
    try:
        r = cases[name]()
    except Exception as e:  # one broken case must not hide the others
        r = {"case": name, "ok": False, "error": str(e)}
        if failures is not None:
            failures.append(r)
    print(json.dumps(r), flush=True)
    return r, time.time() - t


def say_outcome(name, r, seconds):
    print(f"# {name}: {'ok' if r.get('ok') else 'FAILED'} in {seconds:.1f}s", flush=True)


def plugin_errors(log):
    """The plugin's error lines of a CRIU log."""
    return [line for line in log.splitlines() if "Error" in line and "gpu_plugin" in line]


def refusal(res, rc, log):
    """Records in `res` how CRIU ended a restore that should be refused: its exit code, the
    plugin's first error and whether CRIU forked a task; returns the plugin's errors and whether
    the restore was refused before any task was forked."""
    errors = plugin_errors(log)
    res["restore_rc"] = rc
    res["first_plugin_error"] = errors[0] if errors else None
    res["forked_tasks"] = "Forking task" in log
    return errors, rc != 0 and bool(errors) and not res["forked_tasks"]
