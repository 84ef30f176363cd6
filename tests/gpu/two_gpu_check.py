#!/usr/bin/env python3
"""Moving CUDA work between GPUs, on a machine with two or more NVIDIA GPUs.

Real CRIU, the plugin and criu-gpu on real CUDA processes; every case is verified bit for bit
(the workload checks its whole pattern on the GPU) with its counter still moving, and with
nvidia-smi showing each process on the GPU it should be on.

    python3 tests/gpu/two_gpu_check.py --criu .criu-4.3/bin/criu --libdir DIR \\
        --tool target/release/criu-gpu [--c-libdir DIR --c-path DIR] [--cases LIST]

  pair      a tree of two processes, one per GPU, 8 GiB each: dumped and restored as it is;
            timed beside one 8 GiB process alone and, with --c-libdir/--c-path (CRIU's C cuda
            plugin and cuda-checkpoint), beside the C plugin in the same run
  swap      the pair's image restored with the GPUs swapped, through
            --plugin-option=gpu_plugin.cuda.device-map and then cuda_plugin.device-map
  onto_one  the pair's image restored with both processes on GPU 0; a refusal by the driver
            must come before CRIU forks a task, naming the GPUs
  suspend   criu-gpu suspend of the pair, then resume --device-map swapping the GPUs, in place
  check     criu-gpu check of a one-process image against a map to each GPU (accepted) and to
            a GPU this machine lacks (refused, naming it); runs on one GPU too

Cases that need two GPUs print "SKIPPED: ..." on a one-GPU machine and count as skipped, not
passed. Prints one JSON line per case and "N passed, M failed, K skipped".
"""

import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import gpu_check  # noqa: E402
import tool_check  # noqa: E402

MISSING = "GPU-0badc0de-0000-4000-8000-000000000000"


def discard(pids, img):
    """Kills a case's processes (waiting until they are gone) and removes its images."""
    gpu_check.kill_all(pids)
    shutil.rmtree(img, ignore_errors=True)


def needs_two(name):
    """A case that needs two GPUs (`uuids`, its last argument): skipped on fewer, saying why."""
    def wrap(case):
        def run(*args):
            uuids = args[-1]
            if len(uuids) < 2:
                return {"case": name, "skipped": f"needs two GPUs; this machine has {len(uuids)}"}
            return case(*args)
        return run
    return wrap


def pair_argv(wl, gib):
    return [wl, "--gib", str(gib), "--children", "1", "--spread", "1", "--out"]


def dump_pair(ctx, name, wl, gib, libdir=None, env=None):
    """Starts the pair, dumps it; returns prefix, pids, image folder and the dump's seconds."""
    saved = dict(os.environ)
    os.environ.update(env or {}, WORKLOAD_GPUS="2")
    try:
        prefix, root, pids = gpu_check.start_workload(ctx, name, pair_argv(wl, gib), 2, "counter")
        gpu_check.wait_ready(prefix, pids)
        time.sleep(1.0)
        on = {p: gpu_check.gpu_of(p) for p in pids}
        img = os.path.join(ctx.work, name, "img")
        shutil.rmtree(img, ignore_errors=True)
        os.makedirs(img)
        _, t = ctx.sh([ctx.criu, "dump", "-t", str(root), "-D", img, "-L", libdir or ctx.libdir, "-v4",
                       "-o", "dump.log"], log=f"{name}.dump.out")
        shutil.copy(os.path.join(img, "dump.log"), os.path.join(ctx.logs, f"{name}.dump.log"))
        gpu_check.wait_gone(pids)
        return prefix, pids, img, round(t, 2), on
    finally:
        os.environ.clear()
        os.environ.update(saved)


def restore(ctx, name, img, extra=(), libdir=None, env=None, check=True):
    p, t = ctx.sh([ctx.criu, "restore", "-D", img, "-L", libdir or ctx.libdir, "-d", "-v4", "-o",
                   f"{name}.restore.log", *extra], log=f"{name}.restore.out", check=check,
                  env=dict(os.environ, **(env or {})))
    log = open(os.path.join(img, f"{name}.restore.log"), errors="replace").read()
    shutil.copy(os.path.join(img, f"{name}.restore.log"), os.path.join(ctx.logs, f"{name}.restore.log"))
    return p.returncode, round(t, 2), log


def verified_on(prefix, pids, want):
    """Bit for bit, counting, and each pid on the GPU `want` names."""
    time.sleep(1.0)
    v = gpu_check.verify(prefix, pids)
    on = {p: gpu_check.gpu_of(p) for p in pids}
    ok = all(o and moved for o, moved, _ in v.values()) and all(on[p] == [want[p]] for p in pids)
    return ok, {str(p): {"verify": v[p][2], "on": on[p], "want": want[p]} for p in pids}


@needs_two("pair")
def pair_case(ctx, wl, args, uuids):
    res = {"case": "pair", "gpus": uuids}
    prefix, pids, img, t_dump, on = dump_pair(ctx, "pair", wl, 8)
    rc, t_rest, _ = restore(ctx, "pair", img)
    ok, detail = verified_on(prefix, pids, {pids[0]: on[pids[0]][0], pids[1]: on[pids[1]][0]})
    res.update(dump_s=t_dump, restore_s=t_rest, detail=detail, ok=ok and rc == 0)
    gpu_check.kill_all(pids)
    shutil.rmtree(img, ignore_errors=True)
    alone = gpu_check.dump_restore(ctx, "alone8", [wl, "--gib", "8", "--out"], 1)
    res["alone8"] = {k: alone.get(k) for k in ("dump_s", "restore_s", "ok")}
    res["ok"] = res["ok"] and alone.get("ok", False)
    if args.c_libdir:
        env = {"PATH": f"{os.path.abspath(args.c_path)}:{os.environ['PATH']}"}
        prefix, pids, img, t_dump, on = dump_pair(ctx, "pair_c", wl, 8, libdir=args.c_libdir, env=env)
        rc, t_rest, _ = restore(ctx, "pair_c", img, libdir=args.c_libdir, env=env)
        ok_c, _ = verified_on(prefix, pids, {pids[0]: on[pids[0]][0], pids[1]: on[pids[1]][0]})
        res["c_plugin"] = {"dump_s": t_dump, "restore_s": t_rest, "ok": ok_c and rc == 0}
        discard(pids, img)
    ctx.results.append(res)
    return res


@needs_two("swap")
def swap_case(ctx, wl, uuids):
    a, b = uuids[0], uuids[1]
    res = {"case": "swap", "runs": []}
    for opt in ("gpu_plugin.cuda.device-map", "cuda_plugin.device-map"):
        name = "swap_" + opt.split(".")[0]
        prefix, pids, img, _, on = dump_pair(ctx, name, wl, 1)
        want = {p: (b if on[p] == [a] else a) for p in pids}
        rc, t, log = restore(ctx, name, img, [f"--plugin-option={opt}={a}={b},{b}={a}"])
        ok, detail = verified_on(prefix, pids, want)
        res["runs"].append({"option": opt, "restore_s": t, "named_in_log": f"(plugin option {opt})" in log,
                            "detail": detail, "ok": ok and rc == 0})
        discard(pids, img)
    res["ok"] = all(r["ok"] and r["named_in_log"] for r in res["runs"])
    ctx.results.append(res)
    return res


@needs_two("onto_one")
def onto_one_case(ctx, wl, uuids):
    a, b = uuids[0], uuids[1]
    res = {"case": "onto_one"}
    prefix, pids, img, _, _ = dump_pair(ctx, "onto_one", wl, 1)
    rc, t, log = restore(ctx, "onto_one", img, [f"--plugin-option=gpu_plugin.cuda.device-map={a}={a},{b}={a}"],
                         check=False)
    res["restore_rc"] = rc
    if rc == 0:
        ok, detail = verified_on(prefix, pids, {p: a for p in pids})
        res.update(outcome="restored onto one GPU", detail=detail, ok=ok)
        gpu_check.kill_all(pids)
    else:
        errors, refused = common.refusal(res, rc, log)
        res["outcome"] = "refused"
        res["ok"] = refused and (a in errors[0] or b in errors[0])
        # Refused before anything ran: the same image restores without the map.
        rc2, _, _ = restore(ctx, "onto_one_plain", img, check=False)
        res["ok"] = res["ok"] and rc2 == 0 and verified_on(prefix, pids, {p: gpu_check.gpu_of(p)[0]
                                                                          for p in pids})[0]
        gpu_check.kill_all(pids)
    shutil.rmtree(img, ignore_errors=True)
    ctx.results.append(res)
    return res


@needs_two("suspend")
def suspend_case(ctx, wl, args, uuids):
    a, b = uuids[0], uuids[1]
    os.environ["WORKLOAD_GPUS"] = "2"
    prefix, root, pids = gpu_check.start_workload(ctx, "suspend", pair_argv(wl, 1), 2, "counter")
    gpu_check.wait_ready(prefix, pids)
    on = {p: gpu_check.gpu_of(p) for p in pids}
    rc_s, _, _, err_s = tool_check.tool(args, "suspend", str(root))
    rc_r, _, _, err_r = tool_check.tool(args, "resume", str(root), "--device-map", f"{a}={b},{b}={a}")
    ok, detail = verified_on(prefix, pids, {p: (b if on[p] == [a] else a) for p in pids})
    res = {"case": "suspend", "suspend_rc": rc_s, "resume_rc": rc_r, "stderr": (err_s + err_r)[-500:],
           "detail": detail, "ok": ok and rc_s == 0 and rc_r == 0}
    gpu_check.kill_all(pids)
    ctx.results.append(res)
    return res


def check_case(ctx, wl, args, uuids):
    res = {"case": "check", "maps": []}
    prefix, pids, img, _ = gpu_check.dump_only(ctx, "check", [wl, "--gib", "1", "--device", "0", "--out"], 1)
    ok = True
    for u in uuids:
        rc, _, _, _ = tool_check.tool(args, "check", img, "--device-map", f"{uuids[0]}={u}")
        res["maps"].append({"to": u, "rc": rc, "ok": rc == 0})
        ok = ok and rc == 0
    rc, out, _, err = tool_check.tool(args, "check", img, "--device-map", f"{uuids[0]}={MISSING}")
    said = MISSING in json.dumps(out) or MISSING in err
    res["maps"].append({"to": MISSING, "rc": rc, "named": said, "ok": rc != 0 and said})
    ok = ok and rc != 0 and said
    restore(ctx, "check", img)
    time.sleep(1.0)
    v = gpu_check.verify(prefix, pids)
    res["ok"] = ok and all(o and moved for o, moved, _ in v.values())
    return gpu_check.end_case(ctx, res, pids, img)


def main():
    ap = common.parser("--criu", "--libdir", "--tool")
    ap.add_argument("--c-libdir", default=None)
    ap.add_argument("--c-path", default=None)
    ap.add_argument("--work", default="/dev/shm/two-gpu-check")
    ap.add_argument("--logs", default="/tmp/two-gpu-check-logs")
    ap.add_argument("--cases", default="pair,swap,onto_one,suspend,check")
    args = ap.parse_args()
    common.become_subreaper()
    ctx = gpu_check.Ctx(args)
    os.makedirs(ctx.work, exist_ok=True)
    wl = common.workload(ctx)
    args.tool = os.path.abspath(args.tool)
    uuids = gpu_check.gpu_uuids()
    cases = {
        "pair": lambda: pair_case(ctx, wl, args, uuids),
        "swap": lambda: swap_case(ctx, wl, uuids),
        "onto_one": lambda: onto_one_case(ctx, wl, uuids),
        "suspend": lambda: suspend_case(ctx, wl, args, uuids),
        "check": lambda: check_case(ctx, wl, args, uuids),
    }
    passed = failed = skipped = 0
    for name in args.cases.split(","):
        r, seconds = common.run_case(cases, name)
        if "skipped" in r:
            skipped += 1
            print(f"# {name}: SKIPPED: {r['skipped']}", flush=True)
            continue
        common.say_outcome(name, r, seconds)
        passed += bool(r.get("ok"))
        failed += not r.get("ok")
    with open(os.path.join(ctx.logs, "results.json"), "w") as f:
        json.dump(ctx.results, f, indent=1)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
