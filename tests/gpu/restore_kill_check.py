#!/usr/bin/env python3
"""CRIU SIGKILLed in the middle of restores of a CUDA tree, on a machine with an NVIDIA GPU.

For this plugin and, with --c-libdir, CRIU's C cuda plugin with NVIDIA's cuda-checkpoint (its
results are counted, not judged):

--restores N  a tree of 4 CUDA processes (--mib MiB each) is dumped once and one whole restore
              (criu restore -d) is timed; then N restores are each SIGKILLed at a random moment
              of that length. After each: the outcome (below), whatever is left killed, then a
              restore from the same images that must succeed and verify.
--late        the targeted moment: CRIU SIGKILLed as soon as its log says "Run late stage hook
              from criu master for external devices": the tasks have left CRIU's restorer and
              RESUME_DEVICES_LATE, which gives them their GPU state, starts next. A tree of
              --late-children + 1 processes of --late-mib MiB; per mode of --modes, a whole
              restore (the control), then --late-trials killed ones:
                plain          criu restore -d
                sibling        criu restore -d --restore-sibling (as runc restores: the root
                               becomes this script's child, not CRIU's)
                pidns          the tree runs as pid 1.. of a pid namespace of its own (dumped so)
                pidns-sibling  both (runc's case; not in the default list)

This script is a child subreaper and reaps every orphan at once, so a killed task frees its pid
at once. After CRIU ends, each process of the tree has --settle-s seconds to become one of:

    running   counting again, its GPU memory verified bit for bit
    gone      no process holds its pid (pid namespace modes: nothing left in the namespace)
    stuck     alive without its GPU state: not counting, or its memory check fails (its /proc
              state, blocked signals and `cuda-checkpoint --get-state` are recorded)

A trial's outcome: running (all running), ended (all gone), partial (some gone, the others
running), left (any stuck: a failure for this plugin). Other processes of the killed run still
there after the wait (CRIU's forks, the plugin's helpers) are reported as strays and killed.

Prints one JSON line per trial, a table, and "N passed, M failed" (this plugin's trials and
controls); exits non-zero when any of them failed.

    python3 tests/gpu/restore_kill_check.py --criu CRIU --libdir DIR [--c-libdir DIR --c-path DIR]
        [--restores 20] [--late] [--late-trials 3] [--modes plain,sibling,pidns]
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
import gpu_check as g  # noqa: E402
import kill_check as kc  # noqa: E402

LATE_LINE = b"Run late stage hook from criu master for external devices"
WALL = 0x40000000  # __WALL: children whose exit signal is not SIGCHLD too
MODES = ("plain", "sibling", "pidns", "pidns-sibling")


class Reaper:
    """Reaps every child of this process at once (orphans of killed runs are its children);
    keeps the exit codes of the pids watched."""

    def __init__(self):
        self.codes = {}

    def watch(self, pid):
        self.codes[pid] = None

    def __call__(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | WALL)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.codes:
                self.codes[pid] = os.waitstatus_to_exitcode(status)


reap = Reaper()


def children_of(pid):
    out = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def descendants(pid=None):
    """Live descendants of `pid` (default: this script)."""
    seen, todo = [], children_of(pid or os.getpid())
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += children_of(p)
    return [p for p in seen if kc.alive(p)]


def status_field(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def pidns(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


class Tree:
    """A dumped tree: its output prefix and its pids as the images hold them (its output files
    are named by these). In a pid namespace of its own, its host pids differ at each restore."""

    def __init__(self, prefix, pids, own_ns):
        self.prefix, self.pids, self.own_ns = prefix, pids, own_ns

    def holders(self):
        """{host pid: image pid} of the live processes holding the tree's pids."""
        if not self.own_ns:
            return {p: p for p in self.pids if kc.alive(p)}
        mine, out = pidns(os.getpid()), {}
        for p in descendants():
            ns, nspid = pidns(p), status_field(p, "NSpid").split()
            if ns not in (mine, None) and nspid:
                out[p] = int(nspid[-1])
        return out

    def marks(self):
        """How many counter lines each process has written: a restored process counts on from
        its dumped value, below what an earlier restore of it reached, so lines are counted."""
        return {n: sum(l.startswith("counter ") for l in g.lines(self.prefix, n)) for n in self.pids}

    def counting(self, held, marks):
        """The host pids of `held` that wrote counter lines since `marks`."""
        now = self.marks()
        return {p for p, n in held.items() if now.get(n, 0) > marks.get(n, 0)}


def end_all(tree, timeout=30):
    """SIGKILLs the tree's holders and every other descendant of this script; waits until they
    are reaped (a zombie still holds its pid, and CRIU then cannot restore it)."""
    end = time.time() + timeout
    while True:
        reap()
        live = set(tree.holders()) | set(descendants())
        zombies = [] if tree.own_ns else [p for p in tree.pids if os.path.exists(f"/proc/{p}")]
        if not live and not zombies:
            return
        if time.time() > end:
            raise RuntimeError(f"processes {sorted(live | set(zombies))} did not go away")
        for p in live:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def start_in_pidns(ctx, name, argv, nproc):
    """The workload as pid 1 of a new pid namespace (its own session); returns prefix, the host
    pid of its root, {host pid: pid in the namespace}."""
    prefix = os.path.join(ctx.work, name, "out")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    err = os.path.join(ctx.logs, f"{name}.stderr")
    # unshare's own stderr is elsewhere: CRIU checks the size of the files a task holds open.
    subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", 'exec 2>>"$0" setsid "$@"', err] + argv + [prefix],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=open(os.path.join(ctx.logs, f"{name}.unshare.stderr"), "wb"), start_new_session=True)
    end = time.time() + 60
    while time.time() < end:
        inner = {p: int(status_field(p, "NSpid").split()[-1]) for p in descendants()
                 if len(status_field(p, "NSpid").split()) > 1}
        want = [1] + [int(l.split()[1]) for l in g.lines(prefix, 1) if l.startswith("child ")]
        if len(want) == nproc and sorted(inner.values()) == sorted(want):
            root = [p for p, n in inner.items() if n == 1][0]
            return prefix, root, inner
        time.sleep(0.05)
    raise RuntimeError("the workload did not start in its pid namespace")


def dump_tree(ctx, name, wl, mib, children, own_ns, libdir, env):
    """Starts the workload, dumps it whole (which ends it); returns its Tree, images and dump time."""
    argv = [wl, "--mib", str(mib), "--children", str(children), "--out"]
    if own_ns:
        prefix, root, names = start_in_pidns(ctx, name, argv, children + 1)
        host = list(names)
        g.wait_ready(prefix, list(names.values()))
        tree = Tree(prefix, sorted(names.values()), True)
    else:
        prefix, root, host = g.start_workload(ctx, name, argv, children + 1, "counter")
        g.wait_ready(prefix, host)
        tree = Tree(prefix, host, False)
    time.sleep(0.5)
    img = os.path.join(ctx.work, f"{name}-img")
    shutil.rmtree(img, ignore_errors=True)
    os.makedirs(img)
    _, took = ctx.sh([ctx.criu, "dump", "-t", str(root), "-D", img, "-L", libdir, "-v4", "-o", "dump.log"],
                     log=f"{name}.dump.out", env=env)
    shutil.copy(os.path.join(img, "dump.log"), os.path.join(ctx.logs, f"{name}.dump.log"))
    end_all(tree)
    return tree, img, took


def restore(ctx, libdir, env, img, log, sibling=False, kill_after=None, kill_at_late=False):
    """criu restore -d from `img`, SIGKILLed `kill_after` seconds in, or as soon as its log has
    LATE_LINE. Returns the run's facts and the time CRIU ended."""
    argv = [ctx.criu, "restore", "-D", img, "-L", libdir, "-d", "-v4", "-o", log]
    if sibling:
        argv.append("--restore-sibling")
    if os.path.exists(log):
        os.unlink(log)
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(log + ".stderr", "wb"), env=env)
    reap.watch(p.pid)
    t0, killed, f, tail = time.time(), None, None, b""
    while reap.codes[p.pid] is None:
        if killed is None and kill_after is not None and time.time() - t0 >= kill_after:
            killed = time.time() - t0
        elif killed is None and kill_at_late:
            if f is None and os.path.exists(log):
                f = open(log, "rb")
            if f is not None:
                tail = tail[-len(LATE_LINE):] + f.read()
                if LATE_LINE in tail:
                    killed = time.time() - t0
        if killed is not None and (kill_after is not None or kill_at_late):
            os.kill(p.pid, signal.SIGKILL)  # not reaped yet, so still CRIU
            kill_after, kill_at_late = None, False
        time.sleep(0.0005)
        reap()
    ended = time.time()
    p.returncode = reap.codes.pop(p.pid)
    if f is not None:
        f.close()
    try:
        with open(log, "rb") as lf:
            text = lf.read()
    except FileNotFoundError:  # killed before it opened its log
        text = b""
    last = text.rstrip().rsplit(b"\n", 1)[-1].decode(errors="replace")
    return {"criu_exit": p.returncode, "took_s": round(ended - t0, 3),
            "killed_after_s": None if killed is None else round(killed, 3),
            "late_line": LATE_LINE in text, "log_last": last[:200]}, ended


def stuck_state(p, cuda_tool):
    """What can be seen of a process alive without its GPU state."""
    st = {"pid": p}
    try:
        with open(f"/proc/{p}/stat") as f:
            st["state"] = f.read().rsplit(") ", 1)[1][0]
        st["exe"] = os.path.basename(os.readlink(f"/proc/{p}/exe"))
    except (OSError, IndexError):
        pass
    st["sigblk"] = status_field(p, "SigBlk")
    if cuda_tool:
        try:
            r = subprocess.run([cuda_tool, "--get-state", "--pid", str(p)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=10, text=True)
            st["cuda"] = r.stdout.strip()[:80]
        except subprocess.TimeoutExpired:
            st["cuda"] = "cuda-checkpoint timed out"
    return st


def settle(tree, marks, ended, args, cuda_tool):
    """After CRIU ended: waits (until `ended` + --settle-s) until each holder of the tree's pids is
    gone or counting again, then verifies those counting; classifies the trial and records the
    strays, then ends everything."""
    deadline = ended + args.settle_s
    while True:
        reap()
        held = tree.holders()
        counting = tree.counting(held, marks)
        if len(counting) == len(held) or time.time() >= deadline:
            break
        time.sleep(0.02)
    res = {"settled_s": round(time.time() - ended, 2)}
    verified = g.verify(tree.prefix, sorted(counting), names=held, timeout=30) if counting else {}
    procs, stuck = {}, []
    for p, n in held.items():
        if p in verified and verified[p][0] and verified[p][1]:
            procs[n] = "running"
        else:
            procs[n] = "stuck"
            stuck.append(dict(stuck_state(p, cuda_tool), image_pid=n,
                              verify=verified[p][2] if p in verified else "not counting"))
    for n in tree.pids:
        procs.setdefault(n, "gone")
    kinds = set(procs.values())
    res["outcome"] = ("left" if "stuck" in kinds else "ended" if kinds == {"gone"}
                      else "running" if kinds == {"running"} else "partial")
    res["processes"] = {str(n): procs[n] for n in tree.pids}
    if stuck:
        res["stuck"] = stuck
    # What else of the killed run is still there, after a moment for the plugin's own to end.
    end = time.time() + 2
    while True:
        reap()
        strays = [p for p in descendants() if p not in held]
        if not strays or time.time() > end:
            break
        time.sleep(0.05)
    res["strays"] = [{"pid": p, "comm": status_field(p, "Name"), "state": status_field(p, "State")[:1]}
                     for p in strays]
    end_all(tree)
    return res


def whole_restore(ctx, tree, libdir, env, img, log, args, sibling=False):
    """A restore that must succeed, the tree counting on with its memory verified; then ended."""
    end_all(tree)
    marks = tree.marks()
    r, ended = restore(ctx, libdir, env, img, log, sibling=sibling)
    ok = r["criu_exit"] == 0
    if ok:
        held = tree.holders()
        while len(tree.counting(held, marks)) < len(held) and time.time() < ended + args.back_s:
            time.sleep(0.02)
        ok = sorted(held.values()) == sorted(tree.pids) and len(tree.counting(held, marks)) == len(held)
        if ok:
            v = g.verify(tree.prefix, list(held), names=held, timeout=60)
            ok = all(o and moved for o, moved, _ in v.values())
            r["verify"] = sorted({d for _, _, d in v.values()})[:2]
    end_all(tree)
    return r, ok


class Run:
    """One plugin's trials: JSON lines out, counts kept."""

    def __init__(self, ctx, name, libdir, env, args):
        self.ctx, self.name, self.libdir, self.env, self.args = ctx, name, libdir, env, args
        self.rows = []
        self.cuda_tool = shutil.which("cuda-checkpoint", path=os.path.abspath(args.c_path) if args.c_path else None)

    def emit(self, row):
        row = {"plugin": self.name, **row}
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def log(self, what):
        return os.path.join(os.path.abspath(self.ctx.logs), f"{self.name}.{what}.restore.log")

    def trial(self, part, i, fn):
        """Runs one trial; an exception is a failed trial, and everything it left is ended."""
        try:
            self.emit({"part": part, "trial": i, **fn()})
        except Exception as e:  # one broken trial must not hide the others
            self.emit({"part": part, "trial": i, "ok": False, "error": str(e)[-500:]})
            try:
                end_all(Tree("", [], False))
            except RuntimeError as e2:
                print(json.dumps({"plugin": self.name, "cleanup_error": str(e2)}), flush=True)

    def random_kills(self, wl, rng):
        a = self.args
        tree, img, dump_s = dump_tree(self.ctx, f"{self.name}-rk", wl, a.mib, 3, False, self.libdir, self.env)
        whole, ok = whole_restore(self.ctx, tree, self.libdir, self.env, img, self.log("rk-whole"), a)
        self.emit({"part": "restores", "trial": "whole", "dump_s": round(dump_s, 2), **whole, "ok": ok})
        span = whole["took_s"]

        def one(i):
            after = rng.uniform(0, span)
            marks = tree.marks()
            r, ended = restore(self.ctx, self.libdir, self.env, img, self.log(f"rk{i}"), kill_after=after)
            res = settle(tree, marks, ended, a, self.cuda_tool)
            nxt, nxt_ok = whole_restore(self.ctx, tree, self.libdir, self.env, img, self.log(f"rk{i}-next"), a)
            return {**r, **res, "next_restore": {k: nxt[k] for k in ("criu_exit", "took_s")},
                    "next_verified": nxt_ok, "ok": res["outcome"] != "left" and nxt_ok}

        for i in range(a.restores):
            self.trial("restores", i, lambda: one(i))

    def late_kills(self, wl):
        a = self.args
        modes = a.modes.split(",")
        for own_ns in (False, True):
            mine = [m for m in modes if m.startswith("pidns") == own_ns]
            if not mine:
                continue
            tag = "ns" if own_ns else "host"
            tree, img, dump_s = dump_tree(self.ctx, f"{self.name}-late-{tag}", wl, a.late_mib, a.late_children,
                                          own_ns, self.libdir, self.env)
            for mode in mine:
                sibling = mode.endswith("sibling")
                whole, ok = whole_restore(self.ctx, tree, self.libdir, self.env, img,
                                          self.log(f"late-{mode}-whole"), a, sibling=sibling)
                self.emit({"part": "late", "mode": mode, "trial": "whole", "dump_s": round(dump_s, 2),
                           **whole, "ok": ok})

                def one(i, mode=mode, sibling=sibling):
                    marks = tree.marks()
                    r, ended = restore(self.ctx, self.libdir, self.env, img, self.log(f"late-{mode}{i}"),
                                       sibling=sibling, kill_at_late=True)
                    res = settle(tree, marks, ended, a, self.cuda_tool)
                    # A kill that missed the moment (CRIU failed or finished first) is no trial.
                    hit = r["late_line"] and r["killed_after_s"] is not None and r["criu_exit"] == -signal.SIGKILL
                    return {"mode": mode, **r, "hit": hit, **res, "ok": res["outcome"] != "left" and hit}

                for i in range(a.late_trials):
                    self.trial("late", i, lambda: one(i))


def table(rows):
    out = ["| plugin | part | mode | trials | running | ended | partial | left | strays | "
           "next restore failed | whole restore | CRIU killed after s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["plugin"], r["part"], r.get("mode", "plain")), []).append(r)
    for (plugin, part, mode), rs in groups.items():
        trials = [r for r in rs if r["trial"] != "whole"]
        whole = [r for r in rs if r["trial"] == "whole"]
        count = lambda o: sum(r.get("outcome") == o for r in trials)  # noqa: E731
        kills = [r["killed_after_s"] for r in trials if r.get("killed_after_s") is not None]
        out.append(f"| {plugin} | {part} | {mode} | {len(trials)} | {count('running')} | {count('ended')} "
                   f"| {count('partial')} | {count('left')} | {sum(len(r.get('strays', [])) for r in trials)} "
                   f"| {sum(r.get('next_verified') is False for r in trials) if part == 'restores' else '-'} "
                   f"| {'ok' if whole and all(r['ok'] for r in whole) else 'FAILED'} "
                   f"{whole[0].get('took_s') if whole else ''} s "
                   f"| {min(kills) if kills else '-'} to {max(kills) if kills else '-'} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    kc.common_args(ap, "/dev/shm/gpu-restore-kill", "/tmp/gpu-restore-kill-logs")
    ap.add_argument("--restores", type=int, default=20, help="random restore kills per plugin (0: none)")
    ap.add_argument("--mib", type=int, default=512, help="MiB per process of the random kills' tree of 4")
    ap.add_argument("--late", action="store_true", help="the targeted late kills too")
    ap.add_argument("--late-trials", type=int, default=3)
    ap.add_argument("--late-mib", type=int, default=1024)
    ap.add_argument("--late-children", type=int, default=1)
    ap.add_argument("--modes", default="plain,sibling,pidns", help=f"late kill modes, of {','.join(MODES)}")
    ap.add_argument("--plugins", default="this,c", help="which of this,c to run (c needs --c-libdir)")
    ap.add_argument("--settle-s", type=float, default=10.0,
                    help="after CRIU's end, how long a process may take to be gone or counting again")
    ap.add_argument("--back-s", type=float, default=10.0, help="a whole restore: how long until counting")
    args = ap.parse_args()
    if any(m not in MODES for m in args.modes.split(",")):
        ap.error(f"--modes: each of {', '.join(MODES)}")
    ctx, wl, plugins = kc.setup(args)
    seed = args.seed if args.seed is not None else int(time.time())
    print(json.dumps({"seed": seed, "restores": args.restores, "late": args.late, "modes": args.modes}), flush=True)
    rows = []
    for name, libdir, env in plugins:
        if name not in args.plugins.split(","):
            continue
        run = Run(ctx, name, libdir, env, args)
        t = time.time()
        if args.restores:
            run.random_kills(wl, random.Random(seed))
        if args.late:
            run.late_kills(wl)
        print(json.dumps({"plugin": name, "elapsed_s": round(time.time() - t, 1)}), flush=True)
        rows += run.rows
    with open(os.path.join(ctx.logs, "restore-kill-results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table(rows))
    ours = [r for r in rows if r["plugin"] == "this"]
    failed = sum(not r["ok"] for r in ours)
    print(f"{len(ours) - failed} passed, {failed} failed")
    return 1 if failed or not ours else 0


if __name__ == "__main__":
    sys.exit(main())
