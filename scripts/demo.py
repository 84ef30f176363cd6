#!/usr/bin/env python3
"""Checkpoint and restore one workload with CRIU and the plugin, and show that it continued.

Called by scripts/demo.sh, which builds the plugin and installs CRIU first.
"""
import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reap_until_gone(pid, timeout=30):
    """The demo is a child subreaper: it reaps the killed workload itself, so its pid is free."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.05)
    sys.exit(f"[demo] pid {pid} did not go away")


def last(path, prefix):
    try:
        vals = [l.split()[1] for l in open(path).read().splitlines() if l.startswith(prefix)]
        return vals[-1] if vals else None
    except FileNotFoundError:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--criu", required=True)
    ap.add_argument("--libdir", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--cpu", action="store_true", help="use an ordinary process even with a GPU")
    a = ap.parse_args()
    # CRIU resolves a relative --libdir after changing directory: pass absolute paths.
    a.criu, a.libdir, a.work = (os.path.abspath(p) for p in (a.criu, a.libdir, a.work))
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    gpu = not a.cpu and shutil.which("nvidia-smi") and shutil.which("nvcc") and \
        subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.DEVNULL).returncode == 0
    out = os.path.join(a.work, "out")
    if gpu:
        wl = os.path.join(a.work, "cuda_workload")
        print("[demo] NVIDIA GPU found: building a CUDA workload with 1 GiB of patterned GPU memory")
        subprocess.run(["nvcc", "-O2", "-o", wl, os.path.join(REPO, "tests/gpu/cuda_workload.cu")], check=True)
        argv = [wl, "--gib", "1", "--out", out]
    else:
        print("[demo] no NVIDIA GPU here: the workload is an ordinary process (the plugin must stay out of its way)")
        argv = ["sh", "-c", f'i=0; while :; do i=$((i+1)); echo "counter $i" >> {out}.$$; sleep 0.05; done']
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    outf = f"{out}.{p.pid}"
    end = time.time() + 120
    while last(outf, "counter") is None and time.time() < end:
        time.sleep(0.1)
    time.sleep(1)
    img = os.path.join(a.work, "img")
    os.makedirs(img)
    print(f"[demo] workload pid {p.pid} is at counter {last(outf, 'counter')}; dumping it")
    t = time.time()
    r = subprocess.run([a.criu, "dump", "-t", str(p.pid), "-D", img, "-L", a.libdir, "-v4", "-o", "dump.log"])
    if r.returncode != 0:
        sys.exit(f"[demo] criu dump failed; see {img}/dump.log")
    at_dump = last(outf, "counter")
    size = sum(os.path.getsize(os.path.join(img, f)) for f in os.listdir(img))
    print(f"[demo] dumped in {time.time() - t:.2f} s, images {size / 1e6:.1f} MB, counter was {at_dump}")
    for l in open(os.path.join(img, "dump.log"), errors="replace"):
        if "gpu_plugin:" in l:
            print("   " + l.rstrip())
    reap_until_gone(p.pid)
    print(f"[demo] pid {p.pid} is gone; restoring")
    t = time.time()
    r = subprocess.run([a.criu, "restore", "-D", img, "-L", a.libdir, "-d", "-v4", "-o", "restore.log"])
    if r.returncode != 0:
        sys.exit(f"[demo] criu restore failed; see {img}/restore.log")
    print(f"[demo] restored in {time.time() - t:.2f} s")
    for l in open(os.path.join(img, "restore.log"), errors="replace"):
        if "gpu_plugin:" in l:
            print("   " + l.rstrip())
    time.sleep(1.5)
    after = last(outf, "counter")
    ok = after is not None and int(after) > int(at_dump)
    if gpu:
        os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2)
        v = [l for l in open(outf).read().splitlines() if l.startswith("verify")]
        print(f"[demo] GPU memory after restore: {v[-1] if v else 'no answer'}")
        ok = ok and bool(v) and v[-1].startswith("verify ok")
    os.kill(p.pid, signal.SIGKILL)
    reap_until_gone(p.pid)
    print(f"[demo] counter after restore: {after} (was {at_dump} at dump): "
          + ("it continued where it was. OK" if ok else "FAILED"))
    shutil.rmtree(a.work, ignore_errors=True) if ok else None
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
