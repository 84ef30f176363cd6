#!/usr/bin/env python3
"""What decides how fast many CUDA processes are restored at once: a bench on a GPU machine.

Starts N CUDA processes (tests/gpu/cuda_workload.cu, M MiB each), then suspends them all in
place (lock + checkpoint, every process at once) and resumes them (restore + unlock) under
several policies, calling the driver's checkpoint API directly (ctypes, one thread per call in
flight, the GIL released during each call). Every round ends with every process verified
(its GPU memory pattern and a counter that moves). For each call it records when it started and
ended, so that the output shows whether the driver overlaps the restores or serializes them.

    python3 tests/gpu/batch_bench.py --procs 64 --mib 64 [--policies all,inflight16,...]
        [--toggle PATH-to-cuda-checkpoint] [--out results.json]

Policies (resume side; the suspend is always every process at once):
  all          restore+unlock of every process at once (what the plugin does)
  inflightK    at most K processes in restore+unlock at a time
  split        every restore at once, then every unlock at once
  pinned       as all, with each process's restore thread pinned to its own CPU
  reverse      as all, started in reverse pid order
  single       one process alone (the others stay suspended), four times: the cost of one
               restore without contention
With --toggle, NVIDIA's cuda-checkpoint --toggle one process after another, both ways.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import gpu_check  # noqa: E402  (workload start, reaping and verification helpers)


class Args64(ctypes.Structure):
    """CUcheckpoint{Lock,Checkpoint,Unlock}Args: 64 bytes, timeoutMs first (lock only)."""
    _fields_ = [("timeout_ms", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [("gpu_pairs", ctypes.c_void_p), ("gpu_pairs_count", ctypes.c_uint),
                ("reserved", ctypes.c_char * 52)]


class Cuda:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name in ["Lock", "Checkpoint", "Restore", "Unlock", "GetState", "GetRestoreThreadId"]:
            getattr(self.lib, f"cuCheckpointProcess{name}").restype = ctypes.c_int

    def call(self, what, pid):
        f = getattr(self.lib, f"cuCheckpointProcess{what}")
        if what == "Lock":
            a = Args64(timeout_ms=30000)
        elif what == "Restore":
            a = RestoreArgs()
        else:
            a = Args64()
        rc = f(ctypes.c_int(pid), ctypes.byref(a))
        if rc != 0:
            raise RuntimeError(f"cuCheckpointProcess{what}({pid}) = {rc}")

    def restore_tid(self, pid):
        tid = ctypes.c_int(0)
        rc = self.lib.cuCheckpointProcessGetRestoreThreadId(ctypes.c_int(pid), ctypes.byref(tid))
        if rc != 0:
            raise RuntimeError(f"GetRestoreThreadId({pid}) = {rc}")
        return tid.value


def run_calls(cuda, pids, steps, inflight, t0):
    """Runs `steps` (driver calls in order) for each pid, at most `inflight` pids at once.
    Returns per-pid (start, end) of each step, relative to t0."""
    times = {p: {} for p in pids}
    errors = []
    sem = threading.Semaphore(inflight)

    def work(p):
        with sem:
            for s in steps:
                a = time.monotonic() - t0
                try:
                    cuda.call(s, p)
                except Exception as e:  # recorded, the round is failed
                    errors.append(str(e))
                    return
                times[p][s] = (round(a, 4), round(time.monotonic() - t0, 4))

    threads = [threading.Thread(target=work, args=(p,)) for p in pids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors[:4]))
    return times


def suspend_all(cuda, pids):
    t0 = time.monotonic()
    run_calls(cuda, pids, ["Lock", "Checkpoint"], len(pids), t0)
    return time.monotonic() - t0


def summarize(times, step):
    ends = sorted(v[step][1] for v in times.values() if step in v)
    starts = sorted(v[step][0] for v in times.values() if step in v)
    durs = sorted(v[step][1] - v[step][0] for v in times.values() if step in v)
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return {
        "first_end_s": round(ends[0], 3), "last_end_s": round(ends[-1], 3),
        "last_start_s": round(starts[-1], 3),
        "call_s_min_median_max": [round(durs[0], 3), round(durs[len(durs) // 2], 3), round(durs[-1], 3)],
        "completion_gap_s_median": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else None,
    }


def resume_policy(cuda, pids, policy):
    t0 = time.monotonic()
    res = {"policy": policy}
    if policy == "all" or policy.startswith("inflight") or policy in ("pinned", "reverse"):
        k = int(policy[len("inflight"):]) if policy.startswith("inflight") else len(pids)
        order = list(reversed(pids)) if policy == "reverse" else pids
        if policy == "pinned":
            ncpu = os.cpu_count() or 1
            for i, p in enumerate(pids):
                os.sched_setaffinity(cuda.restore_tid(p), {i % ncpu})
            t0 = time.monotonic()
        times = run_calls(cuda, order, ["Restore", "Unlock"], k, t0)
        res["restore"] = summarize(times, "Restore")
        res["unlock"] = summarize(times, "Unlock")
    elif policy == "split":
        times = run_calls(cuda, pids, ["Restore"], len(pids), t0)
        res["restore"] = summarize(times, "Restore")
        t1 = time.monotonic()
        times2 = run_calls(cuda, pids, ["Unlock"], len(pids), t0)
        res["unlock"] = summarize(times2, "Unlock")
        res["unlock_phase_s"] = round(time.monotonic() - t1, 3)
    else:
        raise ValueError(policy)
    res["wall_s"] = round(time.monotonic() - t0, 3)
    if policy == "pinned":
        for p in pids:
            try:
                os.sched_setaffinity(cuda.restore_tid(p), set(range(os.cpu_count() or 1)))
            except Exception:
                pass
    return res


def single_restores(cuda, pids, count=4):
    out = []
    for p in pids[:count]:
        t = time.monotonic()
        cuda.call("Restore", p)
        r = time.monotonic() - t
        cuda.call("Unlock", p)
        out.append({"pid": p, "restore_s": round(r, 3), "restore_unlock_s": round(time.monotonic() - t, 3)})
        # Back to suspended, so the next one is alone again.
        cuda.call("Lock", p)
        cuda.call("Checkpoint", p)
    return out


def toggle_round(tool, pids):
    t = time.monotonic()
    for p in pids:
        subprocess.run([tool, "--toggle", "--pid", str(p)], check=True, stdout=subprocess.DEVNULL)
    return round(time.monotonic() - t, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=64)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--policies", default="all,inflight16,split,pinned,reverse,single")
    ap.add_argument("--toggle", default=None, help="cuda-checkpoint, for the one-by-one baseline")
    ap.add_argument("--work", default="/dev/shm/batch-bench")
    ap.add_argument("--logs", default="/tmp/batch-bench-logs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    common.become_subreaper()
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.logs, exist_ok=True)

    class A:
        criu = "/bin/true"
        libdir = args.work
        work = args.work
        logs = args.logs
    ctx = gpu_check.Ctx(A)
    wl = common.workload(ctx)
    prefix, root, pids = gpu_check.start_workload(
        ctx, "bench", [wl, "--mib", str(args.mib), "--children", str(args.procs - 1), "--out"],
        args.procs, "counter")
    gpu_check.wait_ready(prefix, pids)
    time.sleep(1.0)
    cuda = Cuda()
    results = {"procs": len(pids), "mib": args.mib, "cpus": os.cpu_count(), "rounds": []}
    try:
        for policy in args.policies.split(","):
            sus = suspend_all(cuda, pids)
            if policy == "single":
                r = {"policy": "single", "suspend_s": round(sus, 3), "alone": single_restores(cuda, pids)}
                resume_policy(cuda, pids, "all")
            else:
                r = resume_policy(cuda, pids, policy)
                r["suspend_s"] = round(sus, 3)
            time.sleep(0.5)
            v = gpu_check.verify(prefix, pids)
            r["verified"] = all(ok and moved for ok, moved, _ in v.values())
            print(json.dumps(r), flush=True)
            results["rounds"].append(r)
        if args.toggle:
            sus = toggle_round(args.toggle, pids)
            res = toggle_round(args.toggle, pids)
            time.sleep(0.5)
            v = gpu_check.verify(prefix, pids)
            r = {"policy": "cuda-checkpoint --toggle one after another", "suspend_s": sus, "wall_s": res,
                 "verified": all(ok and moved for ok, moved, _ in v.values())}
            print(json.dumps(r), flush=True)
            results["rounds"].append(r)
    finally:
        gpu_check.kill_all(pids)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(r.get("verified") for r in results["rounds"])
    print(f"{len(results['rounds'])} rounds, {'all verified' if ok else 'NOT all verified'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
