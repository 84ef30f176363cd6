#!/usr/bin/env python3
"""End-to-end checks and benchmark of the plugin on a machine with an NVIDIA GPU.

Runs real CRIU with the plugin on real CUDA processes: dump, kill, restore, then verifies that
device memory came back bit-exact and that the program kept counting (or training). Prints a
Markdown table of timings and writes logs to --logs.

    python3 tests/gpu/gpu_check.py --criu .criu/bin/criu --libdir DIR --work /dev/shm/gpuck \\
        [--cases basic1,basic8,tree,multi4,torch,leave] [--bench] [--logs DIR]

CRIU 4.3 cases: postfail (DUMP_FINISH after a failing post-dump script), mapopt and mapmissing
(a GPU map given as --plugin-option). Any CRIU: otherarch (core images made to say arm64:
refused before any task, then restored as they were).

The script makes itself a child subreaper, so killed workloads are reaped at once and their pids
are free for the restore (CRIU restores the same pids).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_gone(pids, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        reap()
        if not any(os.path.exists(f"/proc/{p}") for p in pids):
            return
        time.sleep(0.05)
    raise RuntimeError(f"processes {pids} did not go away")


class Ctx:
    def __init__(self, args):
        self.criu = os.path.abspath(args.criu)
        self.libdir = os.path.abspath(args.libdir)
        self.work = args.work
        self.logs = args.logs
        self.results = []
        os.makedirs(self.logs, exist_ok=True)

    def sh(self, argv, log=None, check=True, env=None):
        t = time.time()
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        dt = time.time() - t
        if log:
            with open(os.path.join(self.logs, log), "wb") as f:
                f.write(p.stdout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{argv[:3]} failed ({p.returncode}): {p.stdout.decode()[-2000:]}")
        return p, dt


def lines(prefix, pid):
    try:
        with open(f"{prefix}.{pid}") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def wait_ready(prefix, pids, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        if all(any(l.startswith("ready") for l in lines(prefix, p)) for p in pids):
            return
        for p in pids:
            for l in lines(prefix, p):
                if "error" in l:
                    raise RuntimeError(f"pid {p}: {l}")
        time.sleep(0.1)
    raise RuntimeError("workload not ready")


def last_counter(prefix, pid, key="counter"):
    vals = [int(l.split()[1]) for l in lines(prefix, pid) if l.startswith(key + " ")]
    return vals[-1] if vals else -1


def verify(prefix, pids, key="counter", timeout=120, names=None):
    """SIGUSR1 each process; expect 'verify ok' and a counter that still moves. `names` maps a
    pid to the one its output file is named by (its pid inside its own pid namespace)."""
    name = (names or {}).get
    verifies = lambda p: [l for l in lines(prefix, name(p, p)) if l.startswith("verify")]  # noqa: E731
    before = {p: len(verifies(p)) for p in pids}
    c0 = {p: last_counter(prefix, name(p, p), key) for p in pids}
    for p in pids:
        os.kill(p, signal.SIGUSR1)
    end = time.time() + timeout
    while time.time() < end:
        if all(len(verifies(p)) > before[p] for p in pids):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    out = {}
    for p in pids:
        v = verifies(p)
        ok = len(v) > before[p] and v[-1].startswith("verify ok")
        moved = last_counter(prefix, name(p, p), key) > c0[p]
        out[p] = (ok, moved, v[-1] if v else "no verify line")
    return out


def plugin_figures(log_path):
    """The plugin's own INFO lines: phase wall, driver and own times, per-process lock."""
    fig = {"pause_own_ms": [], "lock_driver_ms": []}
    try:
        text = open(log_path, errors="replace").read()
    except FileNotFoundError:
        return fig
    for m in re.finditer(r"paused: ([\d.]+) ms in the driver, plugin own time ([\d.]+) ms", text):
        fig["lock_driver_ms"].append(float(m.group(1)))
        fig["pause_own_ms"].append(float(m.group(2)))
    for m in re.finditer(
        r"cuda: (checkpoint|restore) phase: (\d+) process\(es\) [^,]*, ([\d.]+) ms wall, ([\d.]+) ms in the driver, "
        r"plugin own time ([\d.]+) ms \(([\d.]+) ms per process\)",
        text,
    ):
        k = m.group(1)
        fig[f"{k}_wall_ms"] = float(m.group(3))
        fig[f"{k}_driver_ms"] = float(m.group(4))
        fig[f"{k}_own_per_process_ms"] = float(m.group(6))
    return fig


def du(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def start_workload(ctx, name, argv, nproc, key_prefix):
    prefix = os.path.join(ctx.work, name, "out")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    p = subprocess.Popen(argv + [prefix] if argv[-1] == "--out" else argv,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(os.path.join(ctx.logs, f"{name}.stderr"), "wb"),
                         start_new_session=True, env=dict(os.environ, NCCL_NVLS_ENABLE="0",
                                                          TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                                                          NVSHMEM_DISABLE_NVLS="1"))
    root = p.pid
    pids = [root]
    end = time.time() + 60
    while len(pids) < nproc and time.time() < end:
        pids = [root] + [int(l.split()[1]) for l in lines(prefix, root) if l.startswith("child ")]
        time.sleep(0.05)
    return prefix, root, pids


def kill_all(pids):
    """SIGKILLs `pids` (those already gone are fine) and waits until they are reaped."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_gone(pids)


def end_case(ctx, res, pids, img):
    """Ends a case: its processes killed and gone, its images removed, its result recorded."""
    kill_all(pids)
    shutil.rmtree(img, ignore_errors=True)
    ctx.results.append(res)
    return res


def dump_restore(ctx, name, argv, nproc, key="counter", leave_running=False, extra_dump=(), env=None):
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        return _dump_restore(ctx, name, argv, nproc, key, leave_running, extra_dump)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _dump_restore(ctx, name, argv, nproc, key, leave_running, extra_dump):
    prefix, root, pids = start_workload(ctx, name, argv, nproc, key)
    wait_ready(prefix, pids)
    time.sleep(1.0)
    img = os.path.join(ctx.work, name, "img")
    shutil.rmtree(img, ignore_errors=True)
    os.makedirs(img)
    dump_argv = [ctx.criu, "dump", "-t", str(root), "-D", img, "-L", ctx.libdir, "-v4",
                 "-o", "dump.log", *extra_dump]
    if leave_running:
        dump_argv.append("--leave-running")
    _, t_dump = ctx.sh(dump_argv, log=f"{name}.dump.out")
    shutil.copy(os.path.join(img, "dump.log"), os.path.join(ctx.logs, f"{name}.dump.log"))
    size = du(img)
    res = {"case": name, "processes": nproc, "dump_s": round(t_dump, 2), "images_gb": round(size / 1e9, 2)}
    res.update({f"dump_{k}": v for k, v in plugin_figures(os.path.join(img, "dump.log")).items()})
    if leave_running:
        time.sleep(1.0)
        v = verify(prefix, pids, key)
        res["ok"] = all(ok and moved for ok, moved, _ in v.values())
        res["detail"] = {str(k): v[k][2] for k in v}
        kill_all(pids)
        ctx.results.append(res)
        return res
    wait_gone(pids)
    counters = {p: last_counter(prefix, p, key) for p in pids}
    _, t_rest = ctx.sh([ctx.criu, "restore", "-D", img, "-L", ctx.libdir, "-d", "-v4", "-o", "restore.log"],
                       log=f"{name}.restore.out")
    shutil.copy(os.path.join(img, "restore.log"), os.path.join(ctx.logs, f"{name}.restore.log"))
    res["restore_s"] = round(t_rest, 2)
    res.update({f"restore_{k}": v for k, v in plugin_figures(os.path.join(img, "restore.log")).items()})
    time.sleep(1.0)
    v = verify(prefix, pids, key)
    res["ok"] = all(ok and moved for ok, moved, _ in v.values()) and all(
        last_counter(prefix, p, key) > counters[p] for p in pids)
    res["detail"] = {str(k): v[k][2] for k in v}
    return end_case(ctx, res, pids, img)


def postfail_case(ctx, wl):
    """A post-dump action script that fails: CRIU resumes the tasks, and from CRIU 4.3 on the
    plugin's DUMP_FINISH puts them back running with their GPU state (a tree of 2, 1 GiB each)."""
    name = "postfail"
    prefix, root, pids = start_workload(ctx, name, [wl, "--gib", "1", "--children", "1", "--out"], 2, "counter")
    wait_ready(prefix, pids)
    time.sleep(1.0)
    img = os.path.join(ctx.work, name, "img")
    shutil.rmtree(img, ignore_errors=True)
    os.makedirs(img)
    script = os.path.join(ctx.work, name, "fail-post-dump.sh")
    with open(script, "w") as f:
        f.write('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && exit 1\nexit 0\n')
    os.chmod(script, 0o755)
    p, t_dump = ctx.sh([ctx.criu, "dump", "-t", str(root), "-D", img, "-L", ctx.libdir, "-v4", "-o", "dump.log",
                        "--action-script", script], log=f"{name}.dump.out", check=False)
    shutil.copy(os.path.join(img, "dump.log"), os.path.join(ctx.logs, f"{name}.dump.log"))
    with open(os.path.join(img, "dump.log"), errors="replace") as f:
        log = f.read()
    size = du(img)
    time.sleep(1.0)
    v = verify(prefix, pids, "counter")
    res = {"case": name, "processes": 2, "dump_s": round(t_dump, 2), "images_gb": round(size / 1e9, 2),
           "dump_exit": p.returncode,
           "dump_finish_seen": "DUMP_FINISH(" in log,
           "ok": p.returncode != 0 and all(ok and moved for ok, moved, _ in v.values()),
           "detail": {str(k): v[k][2] for k in v}}
    return end_case(ctx, res, pids, img)


def gpu_uuids():
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    return [l.strip() for l in out.splitlines() if l.strip()]


def gpu_of(pid):
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         stdout=subprocess.PIPE, text=True).stdout
    return sorted(l.split(",")[1].strip() for l in out.splitlines() if l.split(",")[0].strip() == str(pid))


def dump_only(ctx, name, argv, nproc):
    prefix, root, pids = start_workload(ctx, name, argv, nproc, "counter")
    wait_ready(prefix, pids)
    time.sleep(1.0)
    img = os.path.join(ctx.work, name, "img")
    shutil.rmtree(img, ignore_errors=True)
    os.makedirs(img)
    _, t = ctx.sh([ctx.criu, "dump", "-t", str(root), "-D", img, "-L", ctx.libdir, "-v4", "-o", "dump.log"],
                  log=f"{name}.dump.out")
    shutil.copy(os.path.join(img, "dump.log"), os.path.join(ctx.logs, f"{name}.dump.log"))
    wait_gone(pids)
    return prefix, pids, img, t


def remap_case(ctx, wl):
    """Checkpoint on GPU 0, restore onto GPU 1 through the plugin's UUID map."""
    uuids = gpu_uuids()
    res = {"case": "remap", "gpus": uuids}
    prefix, pids, img, _ = dump_only(ctx, "remap", [wl, "--gib", "1", "--device", "0", "--out"], 1)
    env = dict(os.environ, CRIU_GPU_CUDA_DEVICE_MAP=f"{uuids[0]}={uuids[1]},{uuids[1]}={uuids[0]}")
    ctx.sh([ctx.criu, "restore", "-D", img, "-L", ctx.libdir, "-d", "-v4", "-o", "restore.log"],
           log="remap.restore.out", env=env)
    shutil.copy(os.path.join(img, "restore.log"), os.path.join(ctx.logs, "remap.restore.log"))
    time.sleep(1.0)
    v = verify(prefix, pids)
    res["on_gpus_after"] = gpu_of(pids[0])
    res["detail"] = {str(k): v[k][2] for k in v}
    res["ok"] = all(ok and moved for ok, moved, _ in v.values()) and res["on_gpus_after"] == [uuids[1]]
    return end_case(ctx, res, pids, img)


def refused_restore(ctx, cmd, img, log_name, name):
    """Runs a restore that should fail; keeps CRIU's log `log_name` of `img` as `name`.log and
    returns the exit code and the log."""
    p, _ = ctx.sh(cmd, log=f"{name}.out", check=False)
    log = open(os.path.join(img, log_name), errors="replace").read()
    shutil.copy(os.path.join(img, log_name), os.path.join(ctx.logs, f"{name}.log"))
    return p.returncode, log


def refuse_case(ctx, wl):
    """A two-GPU image restored where only one GPU's device node is reachable: refused early."""
    res = {"case": "refuse"}
    prefix, pids, img, _ = dump_only(ctx, "refuse", [wl, "--gib", "1", "--devices", "2", "--out"], 1)
    script = (f"mount --bind /dev/null /dev/nvidia1 && exec {ctx.criu} restore -D {img} -L {ctx.libdir} "
              f"-d -v4 -o restore.log")
    rc, log = refused_restore(ctx, ["unshare", "-m", "--propagation", "private", "sh", "-c", script], img,
                              "restore.log", "refuse.restore")
    errors, refused = common.refusal(res, rc, log)
    res["ok"] = refused and "no counterpart" in errors[0]
    # The pids were never restored: nothing to clean up but the image.
    shutil.rmtree(img, ignore_errors=True)
    ctx.results.append(res)
    return res


def mapopt_case(ctx, wl):
    """CRIU 4.3 plugin options: a restore given its GPU map as --plugin-option, in this plugin's
    name and then in the C cuda plugin's (GPU 0 onto the last GPU: itself on a one-GPU machine)."""
    uuids = gpu_uuids()
    res = {"case": "mapopt", "gpus": uuids, "runs": []}
    ok = True
    for n, opt in enumerate(["gpu_plugin.cuda.device-map", "cuda_plugin.device-map"]):
        name = f"mapopt{n}"
        prefix, pids, img, _ = dump_only(ctx, name, [wl, "--gib", "1", "--device", "0", "--out"], 1)
        counters = {p: last_counter(prefix, p) for p in pids}
        ctx.sh([ctx.criu, "restore", "-D", img, "-L", ctx.libdir, "-d", "-v4", "-o", "restore.log",
                f"--plugin-option={opt}={uuids[0]}={uuids[-1]}"], log=f"{name}.restore.out")
        log = open(os.path.join(img, "restore.log"), errors="replace").read()
        shutil.copy(os.path.join(img, "restore.log"), os.path.join(ctx.logs, f"{name}.restore.log"))
        time.sleep(1.0)
        v = verify(prefix, pids)
        run = {"option": opt, "named_in_log": f"(plugin option {opt})" in log,
               "on_gpus_after": gpu_of(pids[0]), "detail": {str(k): v[k][2] for k in v}}
        run["ok"] = (all(o and moved for o, moved, _ in v.values()) and run["named_in_log"]
                     and run["on_gpus_after"] == [uuids[-1]]
                     and all(last_counter(prefix, p) > counters[p] for p in pids))
        ok = ok and run["ok"]
        res["runs"].append(run)
        kill_all(pids)
        shutil.rmtree(img, ignore_errors=True)
    res["ok"] = ok
    ctx.results.append(res)
    return res


def restore_after_refusal(ctx, res, prefix, pids, img, refused):
    """The end of a case whose first restore was `refused`: the same images restored as they
    are now and verified. The case passes when the refusal did and every process goes on."""
    ctx.sh([ctx.criu, "restore", "-D", img, "-L", ctx.libdir, "-d", "-v4", "-o", "restore.log"],
           log=f"{res['case']}.restore.out")
    time.sleep(1.0)
    v = verify(prefix, pids)
    res["detail"] = {str(k): v[k][2] for k in v}
    res["ok"] = refused and all(o and moved for o, moved, _ in v.values())
    return end_case(ctx, res, pids, img)


def mapmissing_case(ctx, wl):
    """A GPU map option naming a GPU this machine lacks: refused before any task is forked,
    with a message naming it; the same images then restore without the option."""
    uuids = gpu_uuids()
    missing = "GPU-0badc0de-0000-4000-8000-000000000000"
    res = {"case": "mapmissing"}
    prefix, pids, img, _ = dump_only(ctx, "mapmissing", [wl, "--gib", "1", "--out"], 1)
    rc, log = refused_restore(ctx, [ctx.criu, "restore", "-D", img, "-L", ctx.libdir, "-d", "-v4", "-o",
                                    "refused.log", f"--plugin-option=gpu_plugin.cuda.device-map={uuids[0]}={missing}"],
                              img, "refused.log", "mapmissing.refused")
    errors, refused = common.refusal(res, rc, log)
    return restore_after_refusal(ctx, res, prefix, pids, img, refused and missing in errors[0])


def otherarch_case(ctx, wl):
    """A checkpoint of another CPU architecture: each core-PID.img made to say arm64 (CRIU's
    mtype, the byte after the entry size: 08 01 for x86_64). Refused at the plugin's start,
    naming both architectures, before CRIU forks a task; with the core images put back the
    same images restore and verify."""
    res = {"case": "otherarch"}
    prefix, pids, img, _ = dump_only(ctx, "otherarch", [wl, "--gib", "1", "--out"], 1)
    saved = {}
    for name in os.listdir(img):
        if re.fullmatch(r"core-\d+\.img", name):
            path = os.path.join(img, name)
            with open(path, "rb") as f:
                data = f.read()
            if data[12:14] != b"\x08\x01":
                raise RuntimeError(f"{name} does not start as an x86_64 core image: {data[:16].hex()}")
            saved[path] = data
            with open(path, "wb") as f:
                f.write(data[:13] + bytes([3]) + data[14:])
    rc, log = refused_restore(ctx, [ctx.criu, "restore", "-D", img, "-L", ctx.libdir, "-d", "-v4", "-o",
                                    "refused.log"], img, "refused.log", "otherarch.refused")
    errors, refused = common.refusal(res, rc, log)
    refused = refused and "the checkpoint was made on aarch64" in errors[0]
    for path, data in saved.items():
        with open(path, "wb") as f:
            f.write(data)
    return restore_after_refusal(ctx, res, prefix, pids, img, refused)


def table(results):
    """The benchmark table for docs/performance.md."""
    rows = ["| case | processes | images GB | dump s | restore s | GPU checkpoint ms | GPU restore ms "
            "| plugin own ms per process: pause / checkpoint / restore |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "dump_s" not in r:
            continue
        pause = max(r.get("dump_pause_own_ms") or [0])
        rows.append(
            f"| {r['case']} | {r['processes']} | {r['images_gb']} | {r['dump_s']} | {r.get('restore_s', '-')} "
            f"| {r.get('dump_checkpoint_wall_ms', '-')} | {r.get('restore_restore_wall_ms', '-')} "
            f"| {pause:.3f} / {r.get('dump_checkpoint_own_per_process_ms', 0):.3f} / "
            f"{r.get('restore_restore_own_per_process_ms', 0):.3f} |")
    return "\n".join(rows)


def main():
    ap = common.parser("--criu", "--libdir")
    ap.add_argument("--work", default="/dev/shm/gpuck")
    ap.add_argument("--logs", default="/tmp/gpuck-logs")
    ap.add_argument("--cases", default="basic1,tree,multi4,torch,leave,basic8")
    ap.add_argument("--workload", default=None)
    args = ap.parse_args()
    common.become_subreaper()
    ctx = Ctx(args)
    os.makedirs(ctx.work, exist_ok=True)
    wl = common.workload(ctx, args.workload)
    cases = {
        "basic1": lambda: dump_restore(ctx, "basic1", [wl, "--gib", "1", "--out"], 1),
        "basic8": lambda: dump_restore(ctx, "basic8", [wl, "--gib", "8", "--out"], 1),
        "tree": lambda: dump_restore(ctx, "tree", [wl, "--gib", "1", "--children", "1", "--out"], 2),
        "multi4": lambda: dump_restore(ctx, "multi4", [wl, "--gib", "4", "--children", "3", "--out"], 4),
        "multi4seq": lambda: dump_restore(ctx, "multi4seq", [wl, "--gib", "4", "--children", "3", "--out"], 4,
                                          env={"CRIU_GPU_CUDA_PARALLEL": "false"}),
        "mgpu_two": lambda: dump_restore(ctx, "mgpu_two", [wl, "--gib", "2", "--devices", "2", "--out"], 1),
        "mgpu_conc": lambda: dump_restore(ctx, "mgpu_conc", [wl, "--gib", "8", "--children", "1", "--spread", "1",
                                                              "--out"], 2, env={"WORKLOAD_GPUS": "2"}),
        "mgpu_seq": lambda: dump_restore(ctx, "mgpu_seq", [wl, "--gib", "8", "--children", "1", "--spread", "1",
                                                            "--out"], 2,
                                         env={"WORKLOAD_GPUS": "2", "CRIU_GPU_CUDA_PARALLEL": "false"}),
        "remap": lambda: remap_case(ctx, wl),
        "refuse": lambda: refuse_case(ctx, wl),
        "leave": lambda: dump_restore(ctx, "leave", [wl, "--gib", "1", "--out"], 1, leave_running=True),
        "postfail": lambda: postfail_case(ctx, wl),
        "mapopt": lambda: mapopt_case(ctx, wl),
        "mapmissing": lambda: mapmissing_case(ctx, wl),
        "otherarch": lambda: otherarch_case(ctx, wl),
        "torch": lambda: dump_restore(ctx, "torch", [sys.executable, os.path.join(HERE, "train.py"), "--out"],
                                      1, key="step"),
    }
    failed = 0
    for name in args.cases.split(","):
        r, seconds = common.run_case(cases, name, failures=ctx.results)
        common.say_outcome(name, r, seconds)
        failed += not r.get("ok")
    with open(os.path.join(ctx.logs, "results.json"), "w") as f:
        json.dump(ctx.results, f, indent=1)
    print(table(ctx.results))
    print(f"{len(ctx.results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
