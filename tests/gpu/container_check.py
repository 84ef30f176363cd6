#!/usr/bin/env python3
"""Container checks on a machine with an NVIDIA GPU: runc checkpoint and restore of CUDA
containers, with this plugin and with CRIU's C CUDA plugin.

Each case starts a runc container whose rootfs holds static busybox, the CUDA workload
(cuda_workload.cu, the protocol of gpu_check.py) and the driver's user libraries, with the
NVIDIA device nodes in the spec; checkpoints it with `runc checkpoint` (images in /dev/shm),
checks that it is gone, restores it with `runc restore -d` and checks every workload's GPU memory
bit-exact (SIGUSR1 -> "verify ok") and its device counter continuing from where it was.

    python3 tests/gpu/container_check.py --criu .criu/bin/criu --out results.json \\
        [--cases one,tree,leave] [--plugins rust,c,rust-nonvml] [--fake-cuda]

Cases: one (a 1 GiB container), tree (busybox sh starting 4 workloads of 1 GiB), leave
(`runc checkpoint --leave-running`, then it must still run and verify). Plugins: rust (this
plugin, default settings), rust-nonvml (this plugin with `nvml = /nonexistent`), c (CRIU's C
plugin with NVIDIA's cuda-checkpoint on PATH). Each plugin reaches CRIU through `libdir` in a CRIU
configuration file named by the container's `org.criu.config` annotation; this plugin's settings
through CRIU_GPU_PLUGIN_CONFIG in runc's environment, which runc passes on to criu.

--fake-cuda runs the same flow without a GPU: the stand-in driver of tests/fixtures/fake-cuda
(built with cc) replaces libcuda in the container and in this plugin, fake_cuda_checkpoint.c
replaces cuda-checkpoint for the C plugin (told to skip its look for /proc/driver/nvidia by
CRIU's fault 138), and a copy of /dev/zero stands for the NVIDIA device nodes. The stand-in's
processes are named by an abstract socket of their pid and thread ids, so two such containers of
other runs must not be up at the same time (no network namespace keeps them apart).
container_rehearsal.sh runs the GPU machine's paths themselves with stand-ins.

Writes the results as JSON to --out after every case, CRIU's logs to --logs, a summary to stdout;
exits non-zero when a case failed. Every wait is bounded; every container is deleted at the end.
"""

import argparse
import ctypes
import gzip
import json
import os
import shutil
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import gpu_check  # noqa: E402  (same directory: the workload protocol and log parsing)
from container_bundle import build_rootfs, make_spec  # noqa: E402
from container_proc import Failure, log, ns_members, output, run, tail, wait_gone, write_json  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
PLUGIN_NAMES = {"rust": "gpu_plugin", "rust-nonvml": "gpu_plugin", "c": "cuda_plugin"}


# ---------------------------------------------------------------------------------------------
# Plugins
# ---------------------------------------------------------------------------------------------

def setup_plugin(ctx, variant):
    """Writes the variant's libdir, CRIU configuration and plugin settings; returns
    (CRIU config path, environment for runc)."""
    d = os.path.join(ctx.work, "plugins", variant)
    shutil.rmtree(d, ignore_errors=True)
    libdir = os.path.join(d, "lib")
    os.makedirs(libdir)
    env = dict(os.environ)
    for k in ("CRIU_LIBS_DIR", "CRIU_FAULT"):
        env.pop(k, None)
    lib_path = [ctx.fake_dir] if ctx.fake else [ctx.nvidia_lib_dir]
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(lib_path)
    settings = os.path.join(d, "gpu-plugin.conf")
    lines = [f"# {variant}: written by container_check.py"]
    if variant.startswith("rust"):
        shutil.copy2(ctx.plugin, os.path.join(libdir, "gpu_plugin.so"))
        if variant == "rust-nonvml" or ctx.fake:
            lines.append("nvml = /nonexistent")
        if ctx.fake:
            lines += [f"libcuda = {ctx.fake_libcuda}", f"cuda.nvidia-proc = {ctx.fake_proc}"]
    elif variant == "c":
        shutil.copy2(ctx.c_plugin, os.path.join(libdir, "cuda_plugin.so"))
        # The C plugin runs cuda-checkpoint from PATH.
        env["PATH"] = os.path.dirname(ctx.cuda_checkpoint) + ":" + env.get("PATH", "/usr/bin:/bin")
        if ctx.fake:
            # It looks for /proc/driver/nvidia first; CRIU's fault 138 skips that look.
            env["CRIU_FAULT"] = "138"
    else:
        raise Failure(f"unknown plugin variant {variant}")
    with open(settings, "w") as f:
        f.write("\n".join(lines) + "\n")
    # Read by this plugin (a file, as on a host where runtimes strip the environment).
    env["CRIU_GPU_PLUGIN_CONFIG"] = settings
    conf = os.path.join(d, "criu.conf")
    with open(conf, "w") as f:
        f.write(f"libdir {libdir}\n")
    return conf, env


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------

class Container:
    def __init__(self, ctx, cid, env):
        self.ctx, self.id, self.env = ctx, cid, env
        self.dir = os.path.join(ctx.work, "c", cid)
        self.bundle = os.path.join(self.dir, "bundle")
        self.logdir = os.path.join(ctx.logs, cid)
        os.makedirs(self.logdir, exist_ok=True)

    def runc(self, *args, timeout=120, log_name="runc.out", check=True, what=None):
        argv = [self.ctx.runc, "--root", self.ctx.runc_root, "--log", os.path.join(self.logdir, "runc.log"),
                "--criu", self.ctx.criu, *args]
        # log_name None: /dev/null, for `run`, whose stdio the container keeps (CRIU cannot
        # dump a host file); runc's own messages are in runc.log then.
        out = os.path.join(self.logdir, log_name) if log_name else None
        try:
            return run(argv, timeout, out, env=self.env, check=check, what=what or f"runc {args[0]} {self.id}")
        except Failure as e:
            raise Failure(f"{e}\n--- runc.log ---\n{tail(os.path.join(self.logdir, 'runc.log'), 20)}")

    def state(self):
        rc, out = output([self.ctx.runc, "--root", self.ctx.runc_root, "state", self.id], 30, env=self.env)
        if rc != 0:
            return None
        try:
            return json.loads(out)
        except ValueError:
            raise Failure(f"runc state {self.id}: not JSON: {out[:500]}")

    def delete(self):
        rc, out = output([self.ctx.runc, "--root", self.ctx.runc_root, "delete", "-f", self.id], 60, env=self.env)
        if rc != 0 and "does not exist" not in out and "not exist" not in out:
            log(f"# runc delete -f {self.id}: exit {rc}: {out.strip()[-500:]}")


def out_prefix(ctx, cid):
    """The workload's --out inside the container, and the same prefix seen from the host."""
    return f"/out/{cid}/w", os.path.join(ctx.rootfs, "out", cid, "w")


def workload_argv(ctx, inner_prefix):
    if ctx.fake:
        return ["/fake/workload", "--mib", str(ctx.fake_mib), "--out", inner_prefix]
    return ["/cuda_workload", "--gib", str(ctx.gib), "--out", inner_prefix]


def find_workloads(ctx, c, n, host_prefix, timeout=120):
    """Waits for n workloads of container c to run and be ready: {pid in container: host pid}."""
    end = time.time() + timeout
    members = {}
    while time.time() < end:
        st = c.state()
        if st is None or st.get("status") not in ("running", "created"):
            raise Failure(f"container {c.id} is not running: {st}\n{tail(os.path.join(c.logdir, 'runc.log'), 20)}")
        members = ns_members(st["pid"], ctx.workload_comm)
        for nsp in members:
            for line in gpu_check.lines(host_prefix, nsp):
                if "error" in line:
                    raise Failure(f"workload {nsp} in {c.id}: {line}")
        if len(members) >= n and all(any(l.startswith("ready") for l in gpu_check.lines(host_prefix, p))
                                     for p in members):
            return members
        time.sleep(0.1)
    raise Failure(f"{c.id}: {len(members)} of {n} workloads ready after {timeout} s: {members}")


def marks(host_prefix, nspids):
    """Per workload: the last counter and the number of lines written so far."""
    return {p: (gpu_check.last_counter(host_prefix, p), len(gpu_check.lines(host_prefix, p))) for p in nspids}


def check_running(host_prefix, members, before):
    """SIGUSR1 to each workload (host pids), then: 'verify ok', no new 'ready' (not restarted),
    the first counter written after `before` beyond the one before, and still counting."""
    # gpu_check.verify names the files by host pid; here they carry the pid in the container.
    counts = {p: len([l for l in gpu_check.lines(host_prefix, p) if l.startswith("verify")]) for p in members}
    c0 = {p: gpu_check.last_counter(host_prefix, p) for p in members}
    for p, hp in members.items():
        os.kill(hp, signal.SIGUSR1)
    end = time.time() + 120
    while time.time() < end:
        if all(len([l for l in gpu_check.lines(host_prefix, p) if l.startswith("verify")]) > counts[p]
               for p in members):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    detail, ok = {}, True
    for p in members:
        ls = gpu_check.lines(host_prefix, p)
        new = ls[before[p][1]:]
        v = [l for l in ls if l.startswith("verify")]
        first = next((int(l.split()[1]) for l in new if l.startswith("counter ")), -1)
        d = {
            "verify": v[-1] if len(v) > counts[p] else "no verify line",
            "counter_before": before[p][0],
            "first_counter_after": first,
            "counter_now": gpu_check.last_counter(host_prefix, p),
            "restarted": any(l.startswith("ready") for l in new),
        }
        d["ok"] = (d["verify"].startswith("verify ok") and not d["restarted"]
                   and first > before[p][0] >= 0 and d["counter_now"] > c0[p])
        errors = [l for l in new if "error" in l]
        if errors:
            d["ok"], d["error_line"] = False, errors[0]
        ok &= d["ok"]
        detail[str(p)] = d
    return ok, detail


def save_log(src, dst):
    """CRIU's log, gzipped (a -v4 log of a GPU dump is large)."""
    if not os.path.exists(src):
        return None
    with open(src, "rb") as f, gzip.open(dst + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    return dst + ".gz"


def criu_failure(what, c, work_dir, log_name, err):
    msg = [f"{what} of {c.id} failed: {err}"]
    path = os.path.join(work_dir, log_name)
    text = tail(path, 400)
    errors = [l for l in text.splitlines() if "Error" in l]
    if errors:
        msg.append(f"--- errors in {log_name} ---\n" + "\n".join(errors[-25:]))
    msg.append(f"--- last lines of {path} ---\n{tail(path, 30)}")
    return Failure("\n".join(msg))


def runc_criu(ctx, c, args, work, log, out):
    """`runc ARGS` of a step that runs CRIU, which writes `log` into `work`: returns the seconds it
    took and the log's path. A failure says the errors of CRIU's log; the log is kept, gzipped,
    with the container's logs either way."""
    path = os.path.join(work, log)
    try:
        _, t = c.runc(*args, timeout=ctx.criu_timeout, log_name=out)
    except Failure as e:
        raise criu_failure(f"runc {args[0]}", c, work, log, e)
    finally:
        save_log(path, os.path.join(c.logdir, log))
    return t, path


def gpu_memory_used_mib():
    rc, out = output(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], 30)
    vals = [int(x) for x in out.split() if x.isdigit()]
    return vals if rc == 0 and vals else None


def run_case(ctx, variant, case):
    cid = f"gpuck-{variant}-{case}"
    res = {"plugin": variant, "case": case, "container": cid, "ok": False}
    conf, env = setup_plugin(ctx, variant)
    c = Container(ctx, cid, env)
    shutil.rmtree(c.dir, ignore_errors=True)
    c.delete()
    inner, host_prefix = out_prefix(ctx, cid)
    shutil.rmtree(os.path.dirname(host_prefix), ignore_errors=True)
    os.makedirs(os.path.dirname(host_prefix))
    if case == "tree":
        n = 4
        wl = " ".join(workload_argv(ctx, inner))
        args = ["/bin/sh", "-c", f"for i in 1 2 3 4; do {wl} & done; wait"]
    else:
        n = 1
        args = workload_argv(ctx, inner)
    res["processes"] = n
    make_spec(ctx, c.bundle, ctx.rootfs, args, conf, cid[:60])
    images = os.path.join(c.dir, "images")
    work = os.path.join(c.dir, "work")
    try:
        # Its stdio is runc's: /dev/null (CRIU cannot dump a host file the container holds).
        c.runc("run", "-d", "--bundle", c.bundle, cid, timeout=120, log_name=None)
        members = find_workloads(ctx, c, n, host_prefix)
        res["pids_in_container"] = sorted(members)
        time.sleep(1.0)
        old_hosts = list(members.values())
        before = marks(host_prefix, members)
        os.makedirs(images)
        os.makedirs(work)
        ck = ["checkpoint", "--image-path", images, "--work-path", work]
        if case == "leave":
            ck.append("--leave-running")
        t, dump_log = runc_criu(ctx, c, [*ck, cid], work, "dump.log", "checkpoint.out")
        res["checkpoint_s"] = round(t, 2)
        text = open(dump_log, errors="replace").read()
        if f'Plugin "{PLUGIN_NAMES[variant]}"' not in text:
            raise Failure(f"dump.log does not show {PLUGIN_NAMES[variant]} loaded: is {conf} read?\n{tail(dump_log)}")
        res["images_gb"] = round(gpu_check.du(images) / 1e9, 2)
        res.update({f"dump_{k}": v for k, v in gpu_check.plugin_figures(dump_log).items() if v != []})
        if case == "leave":
            st = c.state()
            if not st or st.get("status") != "running":
                raise Failure(f"after --leave-running the container is {st}")
            time.sleep(1.0)
            now = ns_members(st["pid"], ctx.workload_comm)
            if sorted(now.values()) != sorted(old_hosts):
                raise Failure(f"after --leave-running the workloads are {now}, were {members}")
            res["ok"], res["detail"] = check_running(host_prefix, now, before)
            return res
        # Gone: the container's state and its processes.
        wait_gone(old_hosts)
        st = c.state()
        if st is not None and st.get("status") != "stopped":
            raise Failure(f"after runc checkpoint the container is still {st.get('status')}")
        if not ctx.fake:
            res["gpu_memory_used_mib_while_checkpointed"] = gpu_memory_used_mib()
        before = marks(host_prefix, members)
        t, restore_log = runc_criu(ctx, c, ["restore", "-d", "--image-path", images, "--work-path", work,
                                            "--bundle", c.bundle, cid], work, "restore.log", "restore.out")
        res["restore_s"] = round(t, 2)
        if f'Plugin "{PLUGIN_NAMES[variant]}"' not in open(restore_log, errors="replace").read():
            raise Failure(f"restore.log does not show {PLUGIN_NAMES[variant]} loaded\n{tail(restore_log)}")
        res.update({f"restore_{k}": v for k, v in gpu_check.plugin_figures(restore_log).items() if v != []})
        st = c.state()
        if not st or st.get("status") != "running":
            raise Failure(f"after runc restore the container is {st}")
        end = time.time() + 30
        now = {}
        while time.time() < end:
            now = ns_members(st["pid"], ctx.workload_comm)
            if sorted(now) == sorted(members):
                break
            time.sleep(0.1)
        else:
            raise Failure(f"after restore the container runs workloads {sorted(now)}, expected {sorted(members)}")
        time.sleep(1.0)
        res["ok"], res["detail"] = check_running(host_prefix, now, before)
        return res
    finally:
        c.delete()
        st = c.state()
        if st is not None:
            # Mutates what is returned; an exception on its way keeps its own message.
            res["ok"] = False
            res["error"] = f"runc delete -f left {cid}: {st}"
        gpu_check.reap()
        shutil.rmtree(images, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------

def ensure_runc_libs(ctx):
    """runc re-executes itself from a memory copy for `runc init`, with an environment of its own,
    so its libseccomp must be where the system's loader looks; install the carried copy if not."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    rc, out = output(["ldd", ctx.runc], env=env)
    if "not found" not in out:
        return
    lib = os.path.join(os.path.dirname(ctx.runc), "libseccomp.so.2")
    if not os.path.exists(lib):
        raise Failure(f"runc needs libraries this machine lacks and none is carried:\n{out}")
    # The multiarch directory is on the loader's built-in path even without ld.so.cache.
    d = "/usr/lib/x86_64-linux-gnu"
    dst = os.path.join(d if os.path.isdir(d) else "/usr/local/lib", "libseccomp.so.2")
    log(f"# this machine has no libseccomp.so.2: installing the carried one as {dst} and running ldconfig")
    shutil.copy2(lib, dst)
    output(["ldconfig"])
    rc, out = output(["ldd", ctx.runc], env=env)
    if "not found" in out:
        raise Failure(f"runc still lacks libraries after installing {dst}:\n{out}")


def build_fake(ctx):
    d = ctx.fake_dir
    os.makedirs(d, exist_ok=True)
    fx = os.path.join(REPO, "tests", "fixtures")
    link = [f"-L{d}", "-l:libcuda.so.1", "-Wl,-rpath,$ORIGIN", "-Wl,--disable-new-dtags", "-lpthread"]
    srcs = ["fake_libcuda.c", "fake_cuda_runtime.c", "fake_cuda_controller.c", "gpu_nodes.c"]
    run(["cc", "-shared", "-fPIC", "-O2", "-o", ctx.fake_libcuda,
         *(os.path.join(fx, "fake-cuda", s) for s in srcs), "-lpthread"], 120,
        os.path.join(ctx.logs, "cc.out"), what="cc fake_libcuda.c")
    run(["cc", "-O2", "-o", ctx.workload, os.path.join(fx, "fake-cuda", "workload.c"), *link], 120,
        os.path.join(ctx.logs, "cc.out"), what="cc workload.c")
    gpu_list = os.path.join(d, "gpu_list")
    run(["cc", "-O2", "-o", gpu_list, os.path.join(fx, "e2e", "gpu_list.c"), *link], 120,
        os.path.join(ctx.logs, "cc.out"), what="cc gpu_list.c")
    # CRIU's C plugin drives the stand-in through a cuda-checkpoint of the same command line.
    os.makedirs(os.path.join(d, "bin"), exist_ok=True)
    run(["cc", "-O2", "-o", ctx.cuda_checkpoint, os.path.join(HERE, "fake_cuda_checkpoint.c"), f"-L{d}",
         "-l:libcuda.so.1", f"-Wl,-rpath,{d}", "-Wl,--disable-new-dtags"], 120, os.path.join(ctx.logs, "cc.out"),
        what="cc fake_cuda_checkpoint.c")
    rc, out = output([gpu_list])
    if rc != 0 or not out.strip():
        raise Failure(f"gpu_list: {out}")
    uuid, model = out.splitlines()[0].split(" ", 1)
    # A /proc/driver/nvidia/gpus of one GPU, for the plugin's "is there a driver" look.
    g = os.path.join(ctx.fake_proc, "0000:00:06.0")
    os.makedirs(g, exist_ok=True)
    with open(os.path.join(g, "information"), "w") as f:
        f.write(f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nVideo BIOS: \t 00.00.00.00.00\n"
                f"Bus Type: \t PCIe\nBus Location: \t 0000:00:06.0\n")


def build_workload(ctx):
    if os.path.exists(ctx.workload):
        return
    if not shutil.which("nvcc"):
        raise Failure("nvcc not found")
    run(["nvcc", "-O2", "-o", ctx.workload, os.path.join(HERE, "cuda_workload.cu")], 600,
        os.path.join(ctx.logs, "nvcc.out"), what="nvcc cuda_workload.cu")


class Ctx:
    pass


def summary(results):
    rows = ["| plugin | case | processes | checkpoint s | restore s | images GB | result |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['plugin']} | {r['case']} | {r.get('processes', '-')} | {r.get('checkpoint_s', '-')} "
                    f"| {r.get('restore_s', '-')} | {r.get('images_gb', '-')} | "
                    f"{'ok' if r.get('ok') else 'FAILED'} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    carry = os.path.join(REPO, ".gpu-carry")
    ap.add_argument("--criu", required=True)
    ap.add_argument("--runc", default=os.path.join(carry, "runc"))
    ap.add_argument("--busybox", default=os.path.join(carry, "busybox"))
    ap.add_argument("--plugin", default=os.path.join(REPO, "target", "release", "libcriu_gpu_plugin.so"))
    ap.add_argument("--c-plugin", default=os.path.join(carry, "cuda_plugin.so"))
    ap.add_argument("--cuda-checkpoint", default=os.path.join(carry, "bin", "cuda-checkpoint"))
    ap.add_argument("--nvidia-lib-dir", default=None, help="where libcuda.so.1 is (default: found)")
    ap.add_argument("--work", default="/dev/shm/gpuck-containers")
    ap.add_argument("--out", default=None, help="results JSON (default WORK/results.json)")
    ap.add_argument("--logs", default=None, help="CRIU logs (default: container-logs next to --out)")
    ap.add_argument("--cases", default="one,tree,leave")
    ap.add_argument("--plugins", default="rust,c,rust-nonvml")
    ap.add_argument("--gib", type=int, default=1)
    ap.add_argument("--criu-timeout", type=int, default=150, help="seconds one runc checkpoint/restore may take")
    ap.add_argument("--deadline-s", type=int, default=0, help="start no case after this many seconds (0: none)")
    ap.add_argument("--fake-cuda", action="store_true", help="no GPU: the stand-in driver of tests/fixtures")
    args = ap.parse_args()
    t_start = time.time()

    ctx = Ctx()
    ctx.fake = args.fake_cuda
    ctx.criu = os.path.abspath(args.criu)
    ctx.runc = os.path.abspath(args.runc)
    ctx.busybox = os.path.abspath(args.busybox)
    ctx.plugin = os.path.abspath(args.plugin)
    ctx.c_plugin = os.path.abspath(args.c_plugin)
    ctx.cuda_checkpoint = os.path.abspath(args.cuda_checkpoint)
    ctx.work = os.path.abspath(args.work)
    ctx.out = os.path.abspath(args.out or os.path.join(ctx.work, "results.json"))
    ctx.logs = os.path.abspath(args.logs or os.path.join(os.path.dirname(ctx.out), "container-logs"))
    ctx.gib = args.gib
    ctx.fake_mib = 64
    ctx.criu_timeout = args.criu_timeout
    ctx.runc_root = os.path.join(ctx.work, "runc-root")
    ctx.fake_dir = os.path.join(ctx.work, "fake")
    ctx.fake_libcuda = os.path.join(ctx.fake_dir, "libcuda.so.1")
    ctx.fake_proc = os.path.join(ctx.fake_dir, "nvidia-gpus")
    ctx.workload = os.path.join(ctx.fake_dir if ctx.fake else ctx.work, "workload" if ctx.fake else "cuda_workload")
    ctx.workload_comm = "workload" if ctx.fake else "cuda_workload"
    if ctx.fake:
        ctx.cuda_checkpoint = os.path.join(ctx.fake_dir, "bin", "cuda-checkpoint")
    variants = [v for v in args.plugins.split(",") if v]
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in ("one", "tree", "leave"):
            ap.error(f"unknown case {c}")
    for v in variants:
        if v not in PLUGIN_NAMES:
            ap.error(f"unknown plugin {v}")

    libc = ctypes.CDLL(None, use_errno=True)
    # Containers' inits are reparented here when runc exits, and reaped at once.
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.makedirs(ctx.work, exist_ok=True)
    os.makedirs(ctx.logs, exist_ok=True)
    os.makedirs(os.path.dirname(ctx.out), exist_ok=True)
    results = []
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "fake_cuda": ctx.fake, "results": results}

    try:
        need = [ctx.criu, ctx.runc, ctx.busybox]
        if any(v.startswith("rust") for v in variants):
            need.append(ctx.plugin)
        if "c" in variants:
            need += [ctx.c_plugin] + ([] if ctx.fake else [ctx.cuda_checkpoint])
        missing = [p for p in need if not os.path.exists(p)]
        if missing:
            raise Failure(f"missing: {missing} (scripts/gpu-carry.sh makes .gpu-carry; cargo build --release)")
        if not ctx.fake:
            ctx.nvidia_lib_dir = args.nvidia_lib_dir or next(
                (d for d in ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")
                 if os.path.exists(os.path.join(d, "libcuda.so.1"))), None)
            if not ctx.nvidia_lib_dir:
                raise Failure("no libcuda.so.1 found (--nvidia-lib-dir)")
        ensure_runc_libs(ctx)
        rc, v = output([ctx.runc, "--version"])
        report["runc"] = v.strip().splitlines()[:1]
        rc, v = output([ctx.criu, "--version"])
        report["criu"] = v.strip().splitlines()[:1]
        report["cgroup"] = "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1 or hybrid"
        report["kernel"] = os.uname().release
        if not ctx.fake:
            rc, v = output(["nvidia-smi", "--query-gpu=name,driver_version,uuid", "--format=csv,noheader"])
            report["gpus"] = v.strip().splitlines()
            build_workload(ctx)
        else:
            build_fake(ctx)
        log(f"# {report['runc']} {report['criu']} cgroup {report['cgroup']}, kernel {report['kernel']}, "
            f"{report.get('gpus', 'fake CUDA')}")
        os.makedirs(ctx.runc_root, exist_ok=True)
        ctx.rootfs = build_rootfs(ctx)
    except Exception as e:  # noqa: BLE001  (whatever it is, it goes into the JSON)
        report["error"] = f"{type(e).__name__}: {e}"
        write_json(ctx.out, report)
        log(f"SETUP FAILED: {report['error']}")
        return 1

    def on_term(sig, frame):
        raise KeyboardInterrupt(f"signal {sig}")

    # `timeout` sends SIGTERM: the running case still deletes its container.
    signal.signal(signal.SIGTERM, on_term)
    interrupted = False
    try:
        run_all(ctx, args, variants, cases, results, report, t_start)
    except KeyboardInterrupt as e:
        report["error"] = f"interrupted ({e}) after {len(results)} case(s)"
        log(f"INTERRUPTED: {report['error']}")
        interrupted = True
    finally:
        sweep(ctx)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_json(ctx.out, report)
    log(summary(results))
    passed = sum(1 for r in results if r.get("ok"))
    failed = len(results) - passed + interrupted
    log(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def sweep(ctx):
    """Deletes whatever container is left under this run's runc root."""
    rc, out = output([ctx.runc, "--root", ctx.runc_root, "list", "-q"], 30)
    for cid in out.split() if rc == 0 else []:
        log(f"# deleting leftover container {cid}")
        output([ctx.runc, "--root", ctx.runc_root, "delete", "-f", cid], 60)


def run_all(ctx, args, variants, cases, results, report, t_start):
    for variant in variants:
        for case in cases:
            if args.deadline_s and time.time() - t_start > args.deadline_s:
                r = {"plugin": variant, "case": case, "ok": False, "error": "not run: past --deadline-s"}
            else:
                t = time.time()
                try:
                    r = run_case(ctx, variant, case)
                except Exception as e:  # one broken case must not hide the others
                    r = {"plugin": variant, "case": case, "ok": False, "error": f"{type(e).__name__}: {e}"}
                r["case_s"] = round(time.time() - t, 1)
            results.append(r)
            write_json(ctx.out, report)
            short = {k: r[k] for k in ("plugin", "case", "ok", "processes", "checkpoint_s", "restore_s", "images_gb",
                                       "dump_checkpoint_wall_ms", "restore_restore_wall_ms") if k in r}
            if "detail" in r:
                short["workloads"] = {p: f"{d['verify']}, counter {d['counter_before']} -> "
                                         f"{d['first_counter_after']} .. {d['counter_now']}"
                                      f"{', RESTARTED' if d['restarted'] else ''}"
                                      for p, d in r["detail"].items()}
            log(json.dumps(short))
            if r.get("error"):
                log(f"--- {variant}/{case} error ---\n{r['error']}")
            log(f"# {variant}/{case}: {'ok' if r.get('ok') else 'FAILED'} in {r.get('case_s', 0)}s")


if __name__ == "__main__":
    sys.exit(main())
