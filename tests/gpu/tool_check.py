#!/usr/bin/env python3
"""criu-gpu on a machine with an NVIDIA GPU: hot swap in place, status, cgroups, images.

    python3 tests/gpu/tool_check.py --tool target/release/criu-gpu --criu .criu/bin/criu \\
        --libdir DIR [--toggle PATH-to-cuda-checkpoint] [--procs 16 --mib 256] [--scale 64]

Starts a tree of PROCS CUDA processes (tests/gpu/cuda_workload.cu, MIB each), then:
  swap       suspend (GPU memory freed, every process checkpointed), status, resume; verified
  map        suspend, resume with an explicit --device-map (GPU 0 onto the last GPU); verified
  cgroup     the same tree addressed as a cgroup (v2); verified
  toggle     with --toggle: NVIDIA's cuda-checkpoint --toggle one process after another, both ways
  images     a CRIU dump of the tree, then `criu-gpu inspect` and `criu-gpu check` on it (and a
             check with a map to a GPU this machine lacks, which must say no); then restored
  scale      with --scale N: N processes of 64 MiB suspended and resumed by criu-gpu
Prints one JSON line per case and exits non-zero if any failed.
"""

import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import gpu_check  # noqa: E402


def gpu_used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def tool(args, *cmd):
    t = time.monotonic()
    p = subprocess.run([args.tool, *cmd, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dt = time.monotonic() - t
    try:
        out = json.loads(p.stdout) if p.stdout.strip() else {}
    except json.JSONDecodeError:
        out = {"unparsed": p.stdout[-2000:]}
    return p.returncode, out, round(dt, 3), p.stderr[-2000:]


def verified(prefix, pids):
    time.sleep(0.5)
    v = gpu_check.verify(prefix, pids)
    return all(ok and moved for ok, moved, _ in v.values()), {str(k): v[k][2] for k in list(v)[:3]}


def swap_case(args, prefix, root, pids, extra_resume=(), target=None):
    target = target or [str(root)]
    before = gpu_used_mib()
    rc_s, s, t_s, err_s = tool(args, "suspend", *target)
    during = gpu_used_mib()
    rc_st, st, _, _ = tool(args, "status", *target)
    rc_r, r, t_r, err_r = tool(args, "resume", *target, *extra_resume)
    ok_v, detail = verified(prefix, pids)
    states = sorted({p.get("after") for p in s.get("processes", [])})
    res = {
        "suspend_rc": rc_s, "suspend_s": t_s, "suspend_tool_ms": s.get("time_ms"),
        "suspended": len(s.get("processes", [])), "states_after_suspend": states,
        "gpu_bytes_total": s.get("gpu_bytes_total"), "gpu_memory_freed": s.get("gpu_memory_freed"),
        "gpu_used_mib_before_during": [before, during],
        "status_rc": rc_st, "status_states": sorted({p.get("state") for p in st.get("processes", [])}),
        "resume_rc": rc_r, "resume_s": t_r, "resume_tool_ms": r.get("time_ms"),
        "verified": ok_v, "detail": detail,
    }
    if rc_s or rc_r:
        res["stderr"] = (err_s + err_r)[-1500:]
    res["ok"] = (rc_s == 0 and rc_r == 0 and ok_v and len(s.get("processes", [])) == len(pids)
                 and during < before)
    return res


def toggle_case(args, prefix, pids):
    t = time.monotonic()
    for p in pids:
        subprocess.run([args.toggle, "--toggle", "--pid", str(p)], check=True, stdout=subprocess.DEVNULL)
    sus = time.monotonic() - t
    t = time.monotonic()
    for p in pids:
        subprocess.run([args.toggle, "--toggle", "--pid", str(p)], check=True, stdout=subprocess.DEVNULL)
    res = time.monotonic() - t
    ok_v, detail = verified(prefix, pids)
    return {"suspend_s": round(sus, 3), "resume_s": round(res, 3), "verified": ok_v, "ok": ok_v}


def images_case(args, ctx, prefix, root, pids):
    img = os.path.join(args.work, "img")
    shutil.rmtree(img, ignore_errors=True)
    os.makedirs(img)
    ctx.sh([args.criu, "dump", "-t", str(root), "-D", img, "-L", args.libdir, "-v4", "-o", "dump.log"],
           log="tool-images.dump.out")
    gpu_check.wait_gone(pids)
    rc_i, ins, _, _ = tool(args, "inspect", img)
    rc_c, chk, _, _ = tool(args, "check", img)
    missing = "GPU-0badc0de-0000-4000-8000-000000000000"
    uuid = gpu_check.gpu_uuids()[0]
    rc_m, chk_m, _, _ = tool(args, "check", img, "--device-map", f"{uuid}={missing}")
    ctx.sh([args.criu, "restore", "-D", img, "-L", args.libdir, "-d", "-v4", "-o", "restore.log"],
           log="tool-images.restore.out")
    ok_v, detail = verified(prefix, pids)
    shutil.rmtree(img, ignore_errors=True)
    res = {"inspect_rc": rc_i, "inspect": {k: ins.get(k) for k in list(ins)[:6]}, "check_rc": rc_c,
           "check_with_missing_gpu_rc": rc_m, "check_with_missing_gpu": chk_m, "verified_after_restore": ok_v}
    res["ok"] = rc_i == 0 and rc_c == 0 and rc_m == 1 and ok_v and missing in json.dumps(chk_m)
    return res


def cgroup_case(args, prefix, root, pids):
    cg = "/sys/fs/cgroup/criu-gpu-tool-check"
    os.makedirs(cg, exist_ok=True)
    try:
        for p in pids:
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(p))
        res = swap_case(args, prefix, root, pids, target=["--cgroup", cg])
    finally:
        for p in pids:
            try:
                with open("/sys/fs/cgroup/cgroup.procs", "w") as f:
                    f.write(str(p))
            except OSError:
                pass
        try:
            os.rmdir(cg)
        except OSError:
            pass
    return res


def main():
    ap = common.parser("--tool", "--criu", "--libdir")
    ap.add_argument("--toggle", default=None)
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--scale", type=int, default=0)
    ap.add_argument("--work", default="/dev/shm/tool-check")
    ap.add_argument("--logs", default="/tmp/tool-check-logs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.tool, args.criu, args.libdir = (os.path.abspath(x) for x in (args.tool, args.criu, args.libdir))
    common.become_subreaper()
    os.makedirs(args.work, exist_ok=True)
    ctx = gpu_check.Ctx(args)
    wl = common.workload(ctx)
    results = []

    def run(name, f):
        t = time.monotonic()
        try:
            r = f()
        except Exception as e:  # one broken case must not hide the others
            r = {"ok": False, "error": str(e)}
        r = {"case": name, **r, "case_s": round(time.monotonic() - t, 1)}
        print(json.dumps(r), flush=True)
        results.append(r)

    prefix, root, pids = gpu_check.start_workload(
        ctx, "tree", [wl, "--mib", str(args.mib), "--children", str(args.procs - 1), "--out"], args.procs,
        "counter")
    try:
        gpu_check.wait_ready(prefix, pids)
        time.sleep(1.0)
        run("swap", lambda: swap_case(args, prefix, root, pids))
        uuids = gpu_check.gpu_uuids()
        run("map", lambda: swap_case(args, prefix, root, pids,
                                     extra_resume=["--device-map", f"{uuids[0]}={uuids[-1]}"]))
        run("cgroup", lambda: cgroup_case(args, prefix, root, pids))
        if args.toggle:
            run("toggle", lambda: toggle_case(args, prefix, pids))
        run("images", lambda: images_case(args, ctx, prefix, root, pids))
    finally:
        gpu_check.kill_all(pids)
    if args.scale:
        prefix, root, pids = gpu_check.start_workload(
            ctx, "scale", [wl, "--mib", "64", "--children", str(args.scale - 1), "--out"], args.scale, "counter")
        try:
            gpu_check.wait_ready(prefix, pids)
            time.sleep(1.0)
            run(f"scale{args.scale}", lambda: swap_case(args, prefix, root, pids))
        finally:
            gpu_check.kill_all(pids)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    failed = [r["case"] for r in results if not r.get("ok")]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
