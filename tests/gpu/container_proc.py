"""What container_check.py runs its steps with: commands under a time limit, their output and
logs, and the processes of a container seen from the host (alive, gone, their pids in its pid
namespace)."""

import json
import os
import subprocess
import time

import gpu_check


class Failure(Exception):
    """A step failed; the message says which and carries the log tail."""


def log(msg):
    print(msg, flush=True)


def tail(path, n=60):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"({path}: {e})"


def run(argv, timeout, log_path=None, env=None, check=True, what=None):
    """Runs argv with stdin on /dev/null and its output into log_path (a file, never a pipe: a
    process that keeps the descriptor would make a pipe never end)."""
    log_path = log_path or os.devnull
    t = time.time()
    with open(log_path, "ab") as out:
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, timeout=timeout)
        except FileNotFoundError as e:
            raise Failure(f"{what or argv[0]}: {e}")
        except subprocess.TimeoutExpired:
            raise Failure(f"{what or argv[0]}: no answer after {timeout} s\n{tail(log_path, 30)}")
    dt = time.time() - t
    if check and p.returncode != 0:
        raise Failure(f"{what or ' '.join(argv[:4])} failed (exit {p.returncode})\n{tail(log_path, 30)}")
    return p.returncode, dt


def output(argv, timeout=60, env=None):
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=env, timeout=timeout, text=True, errors="replace")
    except FileNotFoundError as e:
        return 127, str(e)
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: no answer after {timeout} s"
    return p.returncode, p.stdout


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Processes of a container, seen from the host
# ---------------------------------------------------------------------------------------------

def proc_status(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(l.rstrip("\n").split(":\t", 1) for l in f if ":\t" in l)
    except OSError:
        return None


def alive(pid):
    """A zombie counts as gone: it runs nothing and holds no GPU memory."""
    st = proc_status(pid)
    return st is not None and not st.get("State", "").startswith(("Z", "X"))


def wait_gone(pids, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        gpu_check.reap()
        if not any(alive(p) for p in pids):
            return
        time.sleep(0.05)
    raise Failure(f"processes {[p for p in pids if alive(p)]} still there after {timeout} s")


def ns_members(init_pid, comm=None):
    """{pid in the container: host pid} of the processes in init_pid's pid namespace."""
    try:
        ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return {}
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{d}/ns/pid") != ns:
                continue
            if comm and open(f"/proc/{d}/comm").read().strip() != comm:
                continue
        except OSError:
            continue
        st = proc_status(d)
        if st and "NSpid" in st and alive(int(d)):
            out[int(st["NSpid"].split()[-1])] = int(d)
    return out
