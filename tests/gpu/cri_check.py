#!/usr/bin/env python3
"""The Kubernetes checkpoint path on a machine with an NVIDIA GPU: containerd 2.1's CRI with
runc 1.4, CRIU and this plugin, driven by tools/cri-client exactly as the kubelet calls it.

    python3 tests/gpu/cri_check.py --criu .criu-4.3/bin/criu --plugin libcriu_gpu_plugin.so \\
        --containerd-bin DIR --runc RUNC --registry REGISTRY --cri-client CRI_CLIENT \\
        --busybox BUSYBOX [--out results.json] [--cases cuda1g,torch]

Runs in a private mount namespace of its own (it re-executes itself under `unshare -m`), where
the plugin is bind-mounted into /usr/lib/criu, CRIU's default plugin directory: no CRIU option
names it, as on a node where the distribution installed it. containerd, its registry (on
127.0.0.1, plain HTTP), runc's and containerd's state all live under --work.

Each case: a pod, a container on the GPU (the NVIDIA device nodes as the device plugin gives
them, the host's /usr/bin and library directories bind-mounted as the NVIDIA Container Toolkit
mounts the driver's libraries, here with Python and PyTorch too), then
  1. CheckpointContainer (the container keeps running; its memory verified after),
  2. the container removed, a new pod, CreateContainer from the archive, StartContainer: the
     workload goes on (counter or training step beyond the checkpoint's, not restarted) and its
     device memory verifies bit for bit (SIGUSR1 -> "verify ok"),
  3. `runc checkpoint --leave-running` of the same restored container: the cost of the dump
     alone, beside the CRI's (which adds containerd's pause, the archive and the rootfs diff).
Prints one JSON line per case and writes --out; exits non-zero when a case failed.
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PR_SET_CHILD_SUBREAPER = 36


def log(msg):
    print(msg, flush=True)


def run(argv, timeout=300, check=True, env=None):
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))}: exit {p.returncode}\n{p.stdout[-3000:]}")
    return p.stdout.strip()


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def lines(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def last_count(path):
    vals = [int(l.split()[1]) for l in lines(path) if l.split()[:1] in (["counter"], ["step"])]
    return vals[-1] if vals else -1


def wait_for(what, cond, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        reap()
        if cond():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def verify(path, host_pid, timeout=120):
    """SIGUSR1 to the workload; its next verdict must be 'verify ok' and it must go on."""
    n = len([l for l in lines(path) if l.startswith("verify")])
    c0 = last_count(path)
    os.kill(host_pid, signal.SIGUSR1)
    wait_for("a verify verdict", lambda: len([l for l in lines(path) if l.startswith("verify")]) > n, timeout)
    verdict = [l for l in lines(path) if l.startswith("verify")][n]
    wait_for("the workload to go on", lambda: last_count(path) > c0, 60)
    errors = [l for l in lines(path) if "error" in l.lower() or "FAIL" in l]
    return verdict.startswith("verify ok") and not errors, verdict if not errors else errors[0]


# ---- images ---------------------------------------------------------------------------------

def blob(d, data):
    h = hashlib.sha256(data).hexdigest()
    with open(os.path.join(d, "blobs", "sha256", h), "wb") as f:
        f.write(data)
    return h, len(data)


def oci_archive(work, rootfs, name, entrypoint=None):
    """An OCI layout archive of rootfs (one uncompressed layer) named `name`."""
    d = os.path.join(work, "oci-" + hashlib.sha256(name.encode()).hexdigest()[:8])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "blobs", "sha256"))
    layer = os.path.join(work, "layer.tar")
    with tarfile.open(layer, "w") as t:
        t.add(rootfs, arcname=".")
    with open(layer, "rb") as f:
        ld, ls = blob(d, f.read())
    config = {"Env": ["PATH=/bin:/usr/bin:/usr/local/bin"]}
    if entrypoint:
        config["Entrypoint"] = entrypoint
    return layout_archive(d, (ld, ls), config, name)


def layout_archive(d, layer, config, name, annotations=None):
    """The OCI layout `d` (its one layer's blob, `layer` = (digest, size), already in it) made
    an image `name` with image configuration `config` and manifest `annotations`, archived
    as `d`.tar: the archive's path."""
    ld, ls = layer
    cd, cs = blob(d, json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                                 "rootfs": {"type": "layers", "diff_ids": ["sha256:" + ld]}}).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + cd, "size": cs},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:" + ld, "size": ls}],
    }
    if annotations:
        manifest["annotations"] = annotations
    md, ms = blob(d, json.dumps(manifest).encode())
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + md, "size": ms,
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": "latest"}}]}, f)
    with open(os.path.join(d, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion":"1.0.0"}')
    archive = d + ".tar"
    with tarfile.open(archive, "w") as t:
        for n in ("oci-layout", "index.json", "blobs"):
            t.add(os.path.join(d, n), arcname=n)
    return archive


def build_rootfs(work, busybox):
    """Static busybox; /usr comes from the host (a mount); /lib and /lib64 point into it."""
    r = os.path.join(work, "rootfs")
    shutil.rmtree(r, ignore_errors=True)
    for d in ("bin", "dev", "proc", "sys", "tmp", "out", "etc", "usr", "repo"):
        os.makedirs(os.path.join(r, d))
    os.chmod(os.path.join(r, "tmp"), 0o1777)
    shutil.copy2(busybox, os.path.join(r, "bin", "busybox"))
    for a in ("sh", "sleep", "cat", "echo"):
        os.symlink("busybox", os.path.join(r, "bin", a))
    for l, t in (("lib", "usr/lib"), ("lib64", "usr/lib64")):
        os.symlink(t, os.path.join(r, l))
    with open(os.path.join(r, "etc", "passwd"), "w") as f:
        f.write("root:x:0:0:root:/:/bin/sh\n")
    return r


# ---- the node -------------------------------------------------------------------------------

def bind(src, dst):
    """Directory `src` (made if missing) bind-mounted on `dst` (made if missing)."""
    os.makedirs(src, exist_ok=True)
    os.makedirs(dst, exist_ok=True)
    run(["mount", "--bind", src, dst])


def node_namespace(a, flag):
    """This script again in a private mount namespace of its own (`flag` in the environment
    says it is there), a child subreaper, with a fresh `a.work` and the plugin `a.plugin`
    bind-mounted into /usr/lib/criu, CRIU's default plugin directory, in that namespace only;
    `a.criu` first on PATH as `criu`. Returns the work directory."""
    if os.environ.get(flag) != "1":
        os.environ[flag] = "1"
        os.execvp("unshare", ["unshare", "-m", "--propagation", "private", sys.executable, *sys.argv])
    import ctypes
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    w = a.work
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(os.path.join(w, "bin"))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    lib = os.path.join(w, "usr-lib-criu")
    os.makedirs(lib)
    shutil.copy2(a.plugin, os.path.join(lib, "gpu_plugin.so"))
    bind(lib, "/usr/lib/criu")
    os.symlink(a.criu, os.path.join(w, "bin", "criu"))
    os.environ["PATH"] = os.path.join(w, "bin") + ":" + os.environ["PATH"]
    return w


def start_registry(registry, w, addr, logs):
    """The registry (program `registry`) on `addr`, its storage in `w`/reg, and containerd's
    hosts.toml for it in `w`/certs.d (plain HTTP); returns its process."""
    with open(os.path.join(w, "registry.yml"), "w") as f:
        f.write(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {w}/reg\n"
                f"http:\n  addr: {addr}\n")
    p = subprocess.Popen([registry, "serve", os.path.join(w, "registry.yml")],
                         stdout=open(os.path.join(logs, "registry.log"), "w"), stderr=subprocess.STDOUT)
    hd = os.path.join(w, "certs.d", addr)
    os.makedirs(hd, exist_ok=True)
    with open(os.path.join(hd, "hosts.toml"), "w") as f:
        f.write(f'server = "http://{addr}"\n[host."http://{addr}"]\n'
                '  capabilities = ["pull", "resolve", "push"]\n  skip_verify = true\n')
    return p


def stop_procs(procs, grace):
    """Ends `procs` last started first: SIGTERM, SIGKILL after `grace` seconds."""
    for p in reversed(procs):
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()


def write_containerd_config(path, w, sock, pause, runc, runc_root, runtime_extra="", runc_extra=""):
    """containerd's configuration: its state under `w`, the CRI with `pause` as the sandbox
    image, registries from `w`/certs.d, runc `runc` with its state in `runc_root`;
    `runtime_extra` are more lines of the CRI runtime table, `runc_extra` of runc's options."""
    cri = "io.containerd.cri.v1"
    with open(path, "w") as f:
        f.write(f'''version = 3
root = "{w}/root"
state = "{w}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{w}/opt"
[plugins."{cri}.images"]
  snapshotter = "overlayfs"
  [plugins."{cri}.images".pinned_images]
    sandbox = "{pause}"
  [plugins."{cri}.images".registry]
    config_path = "{w}/certs.d"
[plugins."{cri}.runtime"]
  restrict_oom_score_adj = true{runtime_extra}
  [plugins."{cri}.runtime".cni]
    conf_dir = "{w}/cni"
    bin_dirs = ["{w}/cni"]
  [plugins."{cri}.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."{cri}.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."{cri}.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{runc_root}"
        SystemdCgroup = false{runc_extra}
''')


class Node:
    def __init__(self, a, work):
        self.a, self.work = a, work
        self.sock = os.path.join(work, "containerd.sock")
        self.runc_root = os.path.join(work, "runc")
        self.procs = []

    def start(self):
        a, w = self.a, self.work
        for d in ("root", "state", "opt", "cni", "cdi", "runc", "reg", "certs.d"):
            os.makedirs(os.path.join(w, d), exist_ok=True)
        port = 5000 + os.getpid() % 1000
        self.registry = f"127.0.0.1:{port}"
        logs = os.path.dirname(a.out)
        self.procs.append(start_registry(a.registry, w, self.registry, logs))
        self.pause = f"{self.registry}/gpu-check/pause:1"
        self.image = f"{self.registry}/gpu-check/cuda:1"
        write_containerd_config(os.path.join(w, "config.toml"), w, self.sock, self.pause, a.runc, self.runc_root)
        env = dict(os.environ)
        env["PATH"] = f"{a.containerd_bin}:{w}/bin:" + env["PATH"]
        self.procs.append(subprocess.Popen([os.path.join(a.containerd_bin, "containerd"), "--config",
                                            os.path.join(w, "config.toml")], env=env,
                                           stdout=open(os.path.join(logs, "containerd.log"), "w"), stderr=subprocess.STDOUT))
        wait_for("containerd's CRI", lambda: subprocess.run(
            [a.cri_client, "--socket", self.sock, "version"], capture_output=True).returncode == 0, 60)
        log("# " + self.cri("version"))

    def ctr(self, *args):
        return run([os.path.join(self.a.containerd_bin, "ctr"), "--address", self.sock, "--namespace",
                    "gpu-check", *args])

    def cri(self, *args, timeout=900):
        return run([self.a.cri_client, "--socket", self.sock, "--timeout", str(timeout), *args], timeout + 30)

    def push(self, archive, name):
        self.ctr("image", "import", archive)
        self.ctr("image", "push", "--plain-http", name)

    def pod(self, name):
        logs = os.path.join(self.work, "logs", name)
        os.makedirs(logs, exist_ok=True)
        spec = ["--pod-name", name, "--log-dir", logs, "--cgroup-parent", f"/gpu-check-cri/{name}"]
        return self.cri("run-pod", *spec), spec

    def stop(self):
        stop_procs(self.procs, 10)


def container_pid(node, cid):
    state, pid = node.cri("status", cid).split()
    if state != "CONTAINER_RUNNING":
        raise RuntimeError(f"container {cid} is {state}")
    return int(pid)


def run_case(node, a, name, argv, out_dir, mounts, devices, envs):
    res = {"case": name}
    out = os.path.join(out_dir, "w.1")
    pod, spec = node.pod(f"{name}-a")
    node.cri("pull", *spec, node.image)
    common = [*spec, "--name", name, *envs]
    for m in mounts:
        common += ["--mount", m]
    for d in devices:
        common += ["--device", f"{d}:{d}"]
    log(f"# {name}: create and start")
    cid = node.cri("create", pod, *common, "--image", node.image, "--", *argv)
    node.cri("start", cid)
    ctr_log = os.path.join(node.work, "logs", f"{name}-a", f"{name}.log")

    def ready():
        if any(l.startswith("ready") for l in lines(out)):
            return True
        state = node.cri("status", cid).split()[0]
        if state != "CONTAINER_RUNNING":
            raise RuntimeError(f"{name} is {state}: {lines(ctr_log)[-20:]} {lines(out)[-5:]}")
        return False
    wait_for(f"{name} ready", ready, 240)
    log(f"# {name}: ready")
    wait_for(f"{name} counting", lambda: last_count(out) >= 5, 60)
    pid = container_pid(node, cid)

    archive = os.path.join(node.work, f"{name}.tar")
    log(f"# {name}: CheckpointContainer")
    start_count = last_count(out)
    t = time.time()
    node.cri("checkpoint", cid, archive, "--timeout", "600")
    res["cri_checkpoint_s"] = round(time.time() - t, 2)
    res["archive_mib"] = round(os.path.getsize(archive) / 2**20, 1)
    with tarfile.open(archive) as tf:
        names = tf.getnames()
    res["gpu_image_in_archive"] = any(n.endswith("checkpoint/gpu-plugin-cuda.img") for n in names)
    res["running_after_checkpoint"] = container_pid(node, cid) == pid
    ok, res["verify_after_checkpoint"] = verify(out, pid)
    before = last_count(out)

    log(f"# {name}: checkpointed in {res['cri_checkpoint_s']} s, {res['verify_after_checkpoint']}")
    # The container removed, a new pod restores it from the archive.
    node.cri("stop", cid)
    wait_for("the checkpointed container gone", lambda: not os.path.exists(f"/proc/{pid}"), 60)
    node.cri("rm", cid)
    mark = len(lines(out))
    pod_b, spec_b = node.pod(f"{name}-b")
    common_b = [*spec_b, "--name", name] + common[len(spec) + 2:]
    t = time.time()
    # containerd makes the new container's spec before it reads the archive: it wants the
    # command again (the kubelet sends the pod's container spec as it was).
    rid = node.cri("create", pod_b, *common_b, "--image", archive, "--", *argv)
    node.cri("start", rid)
    res["cri_restore_s"] = round(time.time() - t, 2)
    rpid = container_pid(node, rid)
    log(f"# {name}: restored in {res['cri_restore_s']} s")
    wait_for("the restored workload counting", lambda: last_count(out) > before, 120)
    new = lines(out)[mark:]
    first = next((int(l.split()[1]) for l in new if l.split()[:1] in (["counter"], ["step"])), -1)
    res["restarted"] = any(l.startswith("ready") for l in new)
    # The dump catches the workload between the call and its answer.
    res["count_at_checkpoint_call"], res["first_count_after_restore"] = start_count, first
    res["count_after_checkpoint"] = before
    ok2, res["verify_after_restore"] = verify(out, rpid)

    log(f"# {name}: {res['verify_after_restore']}; runc checkpoint")
    # The dump alone, by runc, of the restored container.
    img = os.path.join(node.work, f"{name}-runc-img")
    os.makedirs(img, exist_ok=True)
    t = time.time()
    run([a.runc, "--root", os.path.join(node.runc_root, "k8s.io"), "checkpoint", "--leave-running",
         "--image-path", img, "--work-path", img, rid], 600)
    res["runc_checkpoint_s"] = round(time.time() - t, 2)
    ok3, res["verify_after_runc_checkpoint"] = verify(out, rpid)
    res["ok"] = bool(ok and ok2 and ok3 and res["gpu_image_in_archive"] and res["running_after_checkpoint"]
                     and not res["restarted"] and start_count < first <= before + 1)
    for p in (pod, pod_b):
        node.cri("stop-pod", p)
        node.cri("rm-pod", p)
    shutil.rmtree(img, ignore_errors=True)
    os.unlink(archive)
    return res


def main():
    ap = argparse.ArgumentParser()
    for o in ("--criu", "--plugin", "--containerd-bin", "--runc", "--registry", "--cri-client", "--busybox"):
        ap.add_argument(o, required=True)
    ap.add_argument("--work", default="/var/tmp/gpu-cri")
    ap.add_argument("--out", default="/tmp/gpu-cri/results.json")
    ap.add_argument("--cases", default="cuda1g,torch")
    a = ap.parse_args()
    for o in ("criu", "plugin", "containerd_bin", "runc", "registry", "cri_client", "busybox"):
        setattr(a, o, os.path.abspath(getattr(a, o)))
    w = node_namespace(a, "GPU_CRI_IN_NS")
    log("# " + run([a.criu, "--version"]).splitlines()[0] + "; " + run([a.runc, "--version"]).splitlines()[0])

    node = Node(a, w)
    results = []
    try:
        node.start()
        rootfs = build_rootfs(w, a.busybox)
        node.push(oci_archive(w, rootfs, node.image), node.image)
        node.push(oci_archive(w, rootfs, node.pause, ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]),
                  node.pause)
        workload = os.path.join(w, "cuda_workload")
        run(["nvcc", "-O2", "-o", workload, os.path.join(HERE, "cuda_workload.cu")], 600)
        devices = [d for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
                   if os.path.exists(d)]
        import importlib.util
        torch_dir = None
        if importlib.util.find_spec("torch"):
            torch_dir = os.path.dirname(os.path.dirname(importlib.util.find_spec("torch").origin))
        for case in a.cases.split(","):
            out_dir = os.path.join(w, "out", case)
            os.makedirs(out_dir)
            # The host's programs and libraries (the driver's among them), directory by
            # directory: a mount of /usr itself would take the plugin's bind mount on
            # /usr/lib/criu along into the container, which CRIU cannot dump.
            usr = ["/usr/bin", "/usr/lib64", "/usr/lib/x86_64-linux-gnu"] + sorted(glob.glob("/usr/lib/python3*"))
            # The driver's library wherever this machine keeps it (/usr/local/nvidia, say).
            libdirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
            cuda = next((l.split("=>")[1].strip() for l in run(["ldconfig", "-p"]).splitlines()
                         if "libcuda.so.1 " in l and "=>" in l), None)
            if cuda:
                libdirs += [os.path.dirname(cuda), os.path.dirname(os.path.realpath(cuda))]
            libdirs = [d for d in dict.fromkeys(libdirs) if os.path.isdir(d)]
            usr += [d for d in libdirs if not any(d == u or d.startswith(u + "/") for u in usr)]
            mounts = [f"{d}:{d}" for d in usr if os.path.isdir(d)] + [f"{out_dir}:/out", f"{HERE}:/repo"]
            envs = ["--env", "LD_LIBRARY_PATH=" + ":".join(libdirs)]
            if case == "cuda1g":
                shutil.copy2(workload, os.path.join(out_dir, "cuda_workload"))
                argv = ["/out/cuda_workload", "--gib", "1", "--out", "/out/w"]
            else:
                # The Python that has torch (a virtual environment, say), at the same path.
                if not sys.prefix.startswith("/usr"):
                    mounts.append(f"{sys.prefix}:{sys.prefix}")
                if torch_dir and not torch_dir.startswith(("/usr/", sys.prefix)):
                    mounts.append(f"{torch_dir}:{torch_dir}")
                argv = [sys.executable, "/repo/train.py", "--out", "/out/w"]
            try:
                r = run_case(node, a, case, argv, out_dir, mounts, devices, envs)
            except Exception as e:  # noqa: BLE001 (reported as the case's failure)
                r = {"case": case, "ok": False, "error": str(e)[-2000:]}
            log(json.dumps(r))
            results.append(r)
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        node.stop()
        for r, _, fs in os.walk(os.path.join(w, "logs")):
            for n in fs:
                shutil.copy2(os.path.join(r, n), os.path.dirname(a.out))
    failed = [r["case"] for r in results if not r.get("ok")]
    log(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
