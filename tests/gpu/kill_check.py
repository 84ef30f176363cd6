#!/usr/bin/env python3
"""CRIU killed at random moments of dumps of a CUDA tree, on a machine with an NVIDIA GPU.

For each plugin given (this one, and CRIU's C cuda plugin with NVIDIA's cuda-checkpoint), a tree
of 4 CUDA processes holding --mib MiB each is dumped --kills times; each dump gets SIGKILL,
SIGTERM or SIGINT at a random moment of its measured length. Afterwards each process is one of:

    running   counting again and its GPU memory verified bit for bit
    frozen    alive but not counting within --back-s seconds (locked or checkpointed)
    dead      the dump had completed (CRIU ended the tree: nothing to bring back)

Prints one JSON line per trial and the counts per plugin; exits non-zero when any process of
this plugin was left frozen. The C plugin's counts are reported, not judged.

    python3 tests/gpu/kill_check.py --criu CRIU --libdir DIR [--c-libdir DIR] [--kills 20]
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import gpu_check as g  # noqa: E402

SIGNALS = [(signal.SIGKILL, "SIGKILL"), (signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


def counting_again(prefix, pids, back_s):
    c0 = {p: g.last_counter(prefix, p) for p in pids}
    end = time.time() + back_s
    while time.time() < end:
        if all(g.last_counter(prefix, p) > c0[p] for p in pids):
            return True
        time.sleep(0.02)
    return False


def dump_cut(criu, libdir, root, img, after, sig, env):
    shutil.rmtree(img, ignore_errors=True)
    os.makedirs(img)
    argv = [criu, "dump", "-t", str(root), "-D", img, "-L", libdir, "-v4", "-o", "dump.log"]
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    t = time.time()
    sent = False
    while p.poll() is None:
        if not sent and after is not None and time.time() - t >= after:
            p.send_signal(sig)
            sent = True
        time.sleep(0.001)
    return p.returncode, time.time() - t, time.time()


def run_plugin(ctx, name, libdir, wl, args, env, rng):
    counts = {"running": 0, "frozen": 0, "dead": 0, "criu_exit_0": 0}
    trials = []
    prefix = root = pids = None

    def start():
        prefix, root, pids = g.start_workload(ctx, f"{name}-w{len(trials)}",
                                              [wl, "--mib", str(args.mib), "--children", "3", "--out"], 4, "counter")
        g.wait_ready(prefix, pids)
        time.sleep(0.5)
        return prefix, root, pids

    img = os.path.join(ctx.work, f"{name}-img")
    # The length of a whole dump of this tree (it ends the tree).
    prefix, root, pids = start()
    code, span, _ = dump_cut(ctx.criu, libdir, root, img, None, 0, env)
    g.kill_all(pids)
    print(json.dumps({"plugin": name, "whole_dump_s": round(span, 2), "exit": code}), flush=True)
    prefix = None
    for i in range(args.kills):
        if prefix is None:
            prefix, root, pids = start()
        sig, signame = rng.choice(SIGNALS)
        after = rng.uniform(0, span)
        code, took, ended = dump_cut(ctx.criu, libdir, root, img, after, sig, env)
        g.reap()
        counts["criu_exit_0"] += code == 0
        live = [p for p in pids if alive(p)]
        if not live:
            outcome = "dead"
        elif len(live) == len(pids) and counting_again(prefix, pids, args.back_s - (time.time() - ended)):
            v = g.verify(prefix, pids)
            outcome = "running" if all(ok for ok, _, _ in v.values()) else "frozen"
        else:
            outcome = "frozen"
        counts[outcome] += 1
        shutil.copy(os.path.join(img, "dump.log"), os.path.join(ctx.logs, f"{name}.{i}.dump.log"))
        t = {"plugin": name, "trial": i, "signal": signame, "after_s": round(after, 3),
             "criu_exit": code, "outcome": outcome, "back_within_s": round(time.time() - ended, 2)}
        trials.append(t)
        print(json.dumps(t), flush=True)
        if outcome != "running":
            g.kill_all(pids)
            prefix = None
    if prefix is not None:
        g.kill_all(pids)
    return counts, trials


def common_args(ap, work, logs):
    """The options this script shares with restore_kill_check.py."""
    ap.add_argument("--criu", required=True)
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--c-libdir", default=None, help="directory with CRIU's C cuda_plugin.so")
    ap.add_argument("--c-path", default=None, help="directory with NVIDIA's cuda-checkpoint")
    ap.add_argument("--work", default=work)
    ap.add_argument("--logs", default=logs)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workload", default=None, help="the workload binary (default: built from cuda_workload.cu)")


def setup(args):
    """Makes this process a child subreaper (killed tasks are reaped here at once, freeing their
    pids for the next restore), builds the workload; returns the context, the workload and the
    plugins to run as (name, libdir, environment)."""
    common.become_subreaper()
    ctx = g.Ctx(argparse.Namespace(criu=args.criu, libdir=args.libdir, work=args.work, logs=args.logs))
    os.makedirs(ctx.work, exist_ok=True)
    wl = common.workload(ctx, os.path.abspath(args.workload) if args.workload else None)
    plugins = [("this", os.path.abspath(args.libdir), dict(os.environ))]
    if args.c_libdir:
        env = dict(os.environ)
        if args.c_path:
            env["PATH"] = os.path.abspath(args.c_path) + ":" + env.get("PATH", "")
        plugins.append(("c", os.path.abspath(args.c_libdir), env))
    return ctx, wl, plugins


def main():
    ap = argparse.ArgumentParser()
    common_args(ap, "/dev/shm/gpukill", "/tmp/gpukill-logs")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--back-s", type=float, default=2.0)
    args = ap.parse_args()
    ctx, wl, plugins = setup(args)
    seed = args.seed if args.seed is not None else int(time.time())
    print(json.dumps({"seed": seed}), flush=True)
    summary = {}
    for name, libdir, env in plugins:
        counts, _ = run_plugin(ctx, name, libdir, wl, args, env, random.Random(seed))
        summary[name] = counts
        print(json.dumps({"plugin": name, **counts}), flush=True)
    with open(os.path.join(ctx.logs, "kill-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    frozen = summary["this"]["frozen"]
    print(f"{args.kills - frozen} passed, {frozen} failed")
    return 1 if frozen else 0


if __name__ == "__main__":
    sys.exit(main())
