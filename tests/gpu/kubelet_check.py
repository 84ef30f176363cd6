#!/usr/bin/env python3
"""The Kubernetes path on a machine with an NVIDIA GPU, through a real kubelet: the kubelet 1.37
(standalone, static pods), containerd 2.3 with restore through CreateContainer opted in, runc
1.5, CRIU and this plugin; the GPU handed to the pod by NVIDIA's device plugin as a CDI device.

    python3 tests/gpu/kubelet_check.py --bundle DIR --criu .criu-4.3/bin/criu \\
        --plugin gpu_plugin.so --busybox BUSYBOX [--out results.json] [--cases cuda1g,torch]

DIR/bin holds kubelet, containerd, containerd-shim-runc-v2, ctr, runc, nvidia-ctk,
nvidia-device-plugin and registry (scripts/gpu-carry-kubelet.sh). Runs in a private mount
namespace of its own, where the plugin is bind-mounted into /usr/lib/criu (CRIU's default plugin
directory: nothing names it), and the places the kubelet, the device plugin and CDI use whatever
their flags say (/var/lib/kubelet, /var/run/cdi, /var/log/containers) are folders of --work.

The node: a registry on 127.0.0.1 with the images, containerd's CRI, the kubelet (no API server:
its pods are static, from manifest files; its API on 127.0.0.1:10250 anonymous, as the checkpoint
call is the point), `nvidia-ctk cdi generate` (its spec checked and listed) and the device plugin
(`--device-list-strategy=cdi-cri`: the kubelet passes the CRI the CDI device of the GPU it
allocated, and containerd applies the plugin's CDI spec, written by the same NVIDIA library).

Each case: a pod asking for `nvidia.com/gpu: 1` (cases `cuda1g`, `torch`; `counter` asks for no
GPU and needs no GPU machine: a rehearsal of the rest), then
  1. the kubelet's checkpoint API, `POST /checkpoint/default/<pod>/work`: the pod keeps running,
     its device memory verified after,
  2. the pod's manifest removed; the archive made an OCI checkpoint image (the archive as its
     one layer, the checkpoint annotation), imported into containerd; a new pod from the same
     manifest with only the image changed: it restores, goes on from the checkpoint (counter or
     training step, not restarted) and its device memory verifies bit for bit,
  3. `runc checkpoint --leave-running` of the restored container: the dump alone;
the plugin's own share of the checkpoint and the restore from CRIU's logs (dump.log in the
archive, containerd's restore.log). Where the device plugin's CDI spec mounts host paths that
are symlinks, the restores run with CRIU's mntns-compat-mode (see RESTORE_CRIU_CONF): CRIU's
default mount engine cannot restore such a bind mount. Prints one JSON line per case, writes --out, exits non-zero
when a case failed.
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.request

import cri_check as cc
import gpu_check

HERE = os.path.dirname(os.path.abspath(__file__))
NODE = "gpu-node"
CGROUP = "/gpu-kubelet-check"
# CRIU options for the restores only, ";" between lines of CRIU's configuration file (e.g.
# "mntns-compat-mode"), or "none". Unset: "mntns-compat-mode" where a CDI spec of the node
# mounts a host path that is a symlink (CRIU 4.3's mount engine cannot restore that bind mount:
# docs/kubernetes.md), none otherwise.
RESTORE_CRIU_CONF = os.environ.get("GPU_KUBELET_RESTORE_CRIU_CONF")
CHECKPOINT_ANNOTATIONS = ("io.kubernetes.cri-o.annotations.checkpoint.name", "org.criu.checkpoint.container.name")

log = cc.log
run = cc.run


def make_cgroup(path):
    """The kubelet's cgroup root in every hierarchy, on cgroup v2 with every controller enabled
    from the root down."""
    rel = path.strip("/")
    roots = [p for p in glob.glob("/sys/fs/cgroup/*") if os.path.isfile(os.path.join(p, "cgroup.procs"))]
    if os.path.isfile("/sys/fs/cgroup/cgroup.procs"):
        roots.append("/sys/fs/cgroup")
    for r in roots:
        os.makedirs(os.path.join(r, rel), exist_ok=True)
        try:
            controllers = open(os.path.join(r, "cgroup.controllers")).read().split()
        except FileNotFoundError:
            continue
        parts = rel.split("/")
        for i in range(len(parts)):
            level = os.path.join(r, *parts[:i])
            for c in controllers:
                try:
                    with open(os.path.join(level, "cgroup.subtree_control"), "w") as f:
                        f.write("+" + c)
                except OSError:
                    pass


def kill_cgroup(path):
    for r in glob.glob("/sys/fs/cgroup/*") + ["/sys/fs/cgroup"]:
        d = os.path.join(r, path.strip("/"))
        if not os.path.isdir(d):
            continue
        frozen = os.path.join(d, "cgroup.freeze")
        if os.path.exists(frozen):
            open(frozen, "w").write("0")
        for procs in glob.glob(os.path.join(d, "**", "cgroup.procs"), recursive=True):
            for pid in open(procs).read().split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass


class KubeletNode:
    def __init__(self, a, w):
        self.a, self.w = a, w
        self.bin = os.path.join(a.bundle, "bin")
        self.sock = os.path.join(w, "containerd.sock")
        self.runc_root = os.path.join(w, "runc")
        self.manifests = os.path.join(w, "manifests")
        self.logs = os.path.dirname(a.out)
        self.cdi_dirs = set()
        self.criu_work = os.path.join(w, "criu-work")
        self.restore_criu_conf = os.path.join(w, "criu-restore.conf")
        self.restore_criu_options = "" if RESTORE_CRIU_CONF in (None, "none") else RESTORE_CRIU_CONF
        os.makedirs(self.criu_work, exist_ok=True)
        self.procs = []
        self.port = 5000 + os.getpid() % 1000
        self.registry = f"127.0.0.1:{self.port}"
        self.pause = f"{self.registry}/gpu-check/pause:1"
        self.image = f"{self.registry}/gpu-check/base:1"

    def spawn(self, name, argv, env=None):
        p = subprocess.Popen(argv, env=env, stdout=open(os.path.join(self.logs, name + ".log"), "w"),
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def ctr(self, *args, ns="k8s.io"):
        return run([os.path.join(self.bin, "ctr"), "--address", self.sock, "--namespace", ns, *args], 600)

    def start(self, want_gpu):
        a, w = self.a, self.w
        for d in ("root", "state", "opt", "cni", "reg", "certs.d", "manifests", "kubelet", "pod-logs"):
            os.makedirs(os.path.join(w, d), exist_ok=True)
        # Where the kubelet, the device plugin and CDI write whatever their flags say.
        cc.bind(os.path.join(w, "var-lib-kubelet"), "/var/lib/kubelet")
        cc.bind(os.path.join(w, "cdi"), "/var/run/cdi")
        cc.bind(os.path.join(w, "var-log-containers"), "/var/log/containers")
        self.procs.append(cc.start_registry(os.path.join(self.bin, "registry"), w, self.registry, self.logs))
        cc.write_containerd_config(os.path.join(w, "config.toml"), w, self.sock, self.pause,
                                   f"{self.bin}/runc", self.runc_root,
                                   "\n  enable_cdi = true\n  cdi_spec_dirs = [\"/var/run/cdi\"]"
                                   "\n  enable_experimental_restore_via_create = true",
                                   # runc keeps CRIU's work folder (its restore.log) there:
                                   # containerd deletes a failed restore's own.
                                   f"\n        CriuWorkPath = \"{self.criu_work}\"")
        env = dict(os.environ)
        env["PATH"] = f"{self.bin}:" + env["PATH"]
        # CRIU reads it at its start where it exists: only during a restore (see run_case).
        env["CRIU_CONFIG_FILE"] = self.restore_criu_conf
        self.spawn("containerd", [os.path.join(self.bin, "containerd"), "--config", os.path.join(w, "config.toml")], env)
        cc.wait_for("containerd", lambda: subprocess.run(
            [os.path.join(self.bin, "ctr"), "--address", self.sock, "version"], capture_output=True).returncode == 0, 60)
        log("# " + run([os.path.join(self.bin, "containerd"), "--version"]) + "; "
            + run([os.path.join(self.bin, "runc"), "--version"]).splitlines()[0])
        # The images, pushed to the registry the kubelet pulls from.
        rootfs = cc.build_rootfs(w, a.busybox)
        for archive, name in ((cc.oci_archive(w, rootfs, self.image), self.image),
                              (cc.oci_archive(w, rootfs, self.pause, ["/bin/sh", "-c",
                               "trap 'exit 0' TERM; while :; do sleep 1; done"]), self.pause)):
            self.ctr("image", "import", archive, ns="gpu-check")
            self.ctr("image", "push", "--plain-http", name, ns="gpu-check")
        if want_gpu:
            # The toolkit's CDI spec of this machine's GPUs, and the devices nvidia-ctk reads in it.
            spec = os.path.join(w, "cdi", "nvidia.yaml")
            t = time.time()
            run([os.path.join(self.bin, "nvidia-ctk"), "cdi", "generate", "--output", spec,
                 f"--nvidia-cdi-hook-path={self.bin}/nvidia-ctk"])
            log(f"# nvidia-ctk cdi generate: {spec} in {time.time() - t:.1f} s; devices: "
                + " ".join(run([os.path.join(self.bin, "nvidia-ctk"), "cdi", "list", "--spec-dir", "/var/run/cdi"]).split()))
        make_cgroup(CGROUP)
        self.start_kubelet()
        if want_gpu:
            self.spawn("device-plugin", [os.path.join(self.bin, "nvidia-device-plugin"), "--device-list-strategy=cdi-cri",
                                          f"--nvidia-cdi-hook-path={self.bin}/nvidia-ctk", "--fail-on-init-error=true",
                                          # On the host, not in a container: the driver is at /.
                                          "--driver-root=/", "--driver-root-ctr-path=/"], env)
            # The kubelet records the devices it can allocate in its device manager's checkpoint.
            ckpt = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"

            def registered():
                try:
                    data = json.load(open(ckpt)).get("Data", {})
                except (OSError, ValueError):
                    return False
                return bool((data.get("RegisteredDevices") or {}).get("nvidia.com/gpu"))
            cc.wait_for("the kubelet to list the device plugin's GPUs", registered, 120)
            cc.wait_for("the device plugin's CDI spec", lambda: len(os.listdir("/var/run/cdi")) > 1, 60)
            for f in sorted(os.listdir("/var/run/cdi")):
                spec = open(os.path.join("/var/run/cdi", f)).read()
                if f.endswith(".json"):
                    edits = cdi_edits(spec)
                    # The folders the device plugin's spec mounts driver files into: a pod
                    # must not mount them itself (the spec's hooks make links there).
                    self.cdi_dirs |= {os.path.dirname(m["containerPath"]) for e in edits
                                      for m in e.get("mounts") or [] if m.get("containerPath")}
                    links = sorted({m["hostPath"] for e in edits for m in e.get("mounts") or []
                                    if os.path.islink(m.get("hostPath", ""))})
                    if links:
                        log(f"# CDI spec {f} mounts host paths that are symlinks: {' '.join(links)}")
                        if RESTORE_CRIU_CONF is None:
                            self.restore_criu_options = "mntns-compat-mode"
                log(f"# CDI spec {f}: {len(spec)} bytes, hooks: "
                    + " ".join(sorted(set(h for h in ("create-symlinks", "update-ldcache", "chmod", "enable-cuda-compat",
                                                      "disable-device-node-modification") if h in spec))))

    def start_kubelet(self):
        w = self.w
        resolv = "/etc/resolv.conf" if os.path.exists("/etc/resolv.conf") else '""'
        config = os.path.join(w, "kubelet.yaml")
        with open(config, "w") as f:
            f.write(f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: 10250
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
cgroupRoot: {CGROUP}
cgroupsPerQOS: true
enforceNodeAllocatable: []
failSwapOn: false
failCgroupV1: false
protectKernelDefaults: false
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://{self.sock}
podLogsDir: {w}/pod-logs
volumePluginDir: {w}/volume-plugins
staticPodPath: {self.manifests}
fileCheckFrequency: 1s
resolvConf: {resolv}
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
syncFrequency: 10s
runtimeRequestTimeout: 15m
shutdownGracePeriod: 0s
""")
        for attempt in range(3):
            p = self.spawn("kubelet", [os.path.join(self.bin, "kubelet"), f"--config={config}",
                                       f"--root-dir={w}/kubelet", f"--cert-dir={w}/kubelet-pki",
                                       f"--hostname-override={NODE}", "--v=2"])
            try:
                cc.wait_for("the kubelet's API", lambda: p.poll() is None and self.api_ok(), 60)
                return
            except RuntimeError:
                if p.poll() is None:
                    raise
                # As its service manager would: a kubelet can end on a start-up race.
                log(f"# the kubelet ended while starting (exit {p.returncode}), starting it again")
                shutil.copy2(os.path.join(self.logs, "kubelet.log"), os.path.join(self.logs, f"kubelet-ended-{attempt}.log"))
        raise RuntimeError("the kubelet ended while starting, three times")

    def kubelet_api(self, method, path, timeout=900):
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        req = urllib.request.Request(f"https://127.0.0.1:10250{path}", method=method)
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def api_ok(self):
        try:
            return self.kubelet_api("GET", "/healthz", 5)[0] == 200
        except OSError:
            return False

    def apply(self, manifest):
        """A static pod: the kubelet picks the file up."""
        name = manifest["metadata"]["name"]
        tmp = os.path.join(self.manifests, f".{name}.json")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
        os.rename(tmp, os.path.join(self.manifests, f"{name}.json"))

    def assert_manifest_taken(self, name):
        """Raises if the kubelet refused static pod `name`'s manifest (it says so in its log
        only, every second, and never makes the pod)."""
        try:
            with open(os.path.join(self.logs, "kubelet.log"), errors="replace") as f:
                refused = [l for l in f if "Could not process manifest file" in l and f"/{name}.json" in l]
        except OSError:
            return
        if refused:
            raise RuntimeError(f"the kubelet refused {name}'s manifest: {refused[-1].strip()}")

    def remove(self, name):
        os.unlink(os.path.join(self.manifests, f"{name}.json"))

    def container(self, pod):
        """The id and host pid of the pod's running container `work`, from the kubelet's API."""
        status, body = self.kubelet_api("GET", "/pods", 30)
        for p in json.loads(body).get("items") or []:
            if p["metadata"]["name"] != f"{pod}-{NODE}":
                continue
            for s in (p.get("status") or {}).get("containerStatuses") or []:
                if s["name"] == "work" and "running" in s.get("state", {}) and s.get("containerID"):
                    cid = s["containerID"].split("://", 1)[1]
                    for line in self.ctr("task", "ls").splitlines()[1:]:
                        f = line.split()
                        if f and f[0] == cid:
                            return cid, int(f[1])
        return None

    def state(self, pod):
        status, body = self.kubelet_api("GET", "/pods", 30)
        for p in json.loads(body).get("items") or []:
            if p["metadata"]["name"] == f"{pod}-{NODE}":
                return json.dumps([s.get("state") for s in (p.get("status") or {}).get("containerStatuses") or []])
        return "(no such pod)"

    def import_checkpoint_image(self, archive, name):
        """The kubelet's archive as an OCI checkpoint image: the archive as the one layer, the
        manifest annotated with the checkpointed container's name (as buildah makes it)."""
        d = os.path.join(self.w, "ckpt-image")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "blobs", "sha256"))
        tar = cc.layout_archive(d, blob_file(d, archive), {}, name,
                                {k: "work" for k in CHECKPOINT_ANNOTATIONS})
        run([os.path.join(self.bin, "ctr"), "--address", self.sock, "--namespace", "k8s.io",
             "image", "import", tar], 1800)
        shutil.rmtree(d)
        os.unlink(tar)

    def stop(self):
        for f in glob.glob(os.path.join(self.manifests, "*.json")):
            os.unlink(f)
        cc.stop_procs(self.procs, 15)
        kill_cgroup(CGROUP)
        # containerd's shims outlive it: ours go too.
        shim = os.path.join(self.bin, "containerd-shim-runc-v2")
        for exe in glob.glob("/proc/[0-9]*/exe"):
            try:
                if os.readlink(exe) == shim:
                    os.kill(int(exe.split("/")[2]), 9)
            except (OSError, ValueError):
                pass


def cdi_edits(text):
    """The container edits of JSON CDI spec `text` and of its devices."""
    spec = json.loads(text)
    return [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices") or []]


def manifest(name, image, argv, env, mounts, gpu, pull="IfNotPresent"):
    c = {"name": "work", "image": image, "imagePullPolicy": pull, "command": argv,
         "env": [{"name": k, "value": v} for k, v in env.items()],
         "volumeMounts": [{"name": f"v{i}", "mountPath": dst} for i, (_, dst) in enumerate(mounts)]}
    if gpu:
        c["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                     "containers": [c],
                     "volumes": [{"name": f"v{i}", "hostPath": {"path": src}} for i, (src, _) in enumerate(mounts)]}}


def blob_file(d, path):
    """File `path` as a blob of the OCI layout `d` (hashed in pieces, linked where it can be):
    its digest and size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 24), b""):
            h.update(piece)
    dst = os.path.join(d, "blobs", "sha256", h.hexdigest())
    try:
        os.link(path, dst)
    except OSError:
        shutil.copyfile(path, dst)
    return h.hexdigest(), os.path.getsize(path)


def archive_member(archive, name):
    with tarfile.open(archive) as t:
        try:
            return t.extractfile(name).read().decode(errors="replace")
        except KeyError:
            return ""


def share(fig, phase):
    """The plugin's own share of a phase: the pause (checkpoint) plus its phase wall time."""
    keys = [f"{phase}_wall_ms"] + (["lock_driver_ms"] if phase == "checkpoint" else [])
    vals = [fig.get(k) for k in keys]
    return {k: v for k, v in zip(keys, vals) if v not in (None, [])}


def run_case(node, a, name, argv, env, mounts, gpu, out):
    res = {"case": name}
    node.apply(manifest(name, node.image, argv, env, mounts, gpu))

    def running():
        node.assert_manifest_taken(name)
        c = node.container(name)
        if c is None and '"terminated"' in node.state(name):
            raise RuntimeError(f"{name} ended: {node.state(name)} {cc.lines(out)[-5:]}")
        return c is not None and any(l.startswith("ready") for l in cc.lines(out))
    cc.wait_for(f"{name} running", running, 300)
    cc.wait_for(f"{name} counting", lambda: cc.last_count(out) >= 5, 120)
    cid, pid = node.container(name)
    res["gpu_in_container"] = sorted(os.path.basename(d) for d in glob.glob(f"/proc/{pid}/root/dev/nvidia[0-9]*"))
    # The container's mounts as CRIU will find them (the restore rebuilds each).
    shutil.copy2(f"/proc/{pid}/mountinfo", os.path.join(node.logs, f"{name}-mountinfo.txt"))
    log(f"# {name}: running, pid {pid}, GPU devices {res['gpu_in_container']}")

    start_count = cc.last_count(out)
    t = time.time()
    status, body = node.kubelet_api("POST", f"/checkpoint/default/{name}-{NODE}/work?timeout=900")
    res["kubelet_checkpoint_s"] = round(time.time() - t, 2)
    if status != 200:
        raise RuntimeError(f"the kubelet's checkpoint answered {status}: {body[:2000]}")
    archive = json.loads(body)["items"][0]
    res["archive_mib"] = round(os.path.getsize(archive) / 2**20, 1)
    with tarfile.open(archive) as tf:
        res["gpu_image_in_archive"] = any(n.endswith("gpu-plugin-cuda.img") for n in tf.getnames())
    dump_log = archive_member(archive, "dump.log")
    with open(os.path.join(node.logs, f"{name}-spec.dump.json"), "w") as f:
        f.write(archive_member(archive, "spec.dump"))
    with open(os.path.join(node.logs, f"{name}-dump.log"), "w") as f:
        f.write(dump_log)
    res["plugin_checkpoint"] = share(gpu_check.plugin_figures(os.path.join(node.logs, f"{name}-dump.log")), "checkpoint")
    res["running_after_checkpoint"] = node.container(name) == (cid, pid)
    ok1, res["verify_after_checkpoint"] = cc.verify(out, pid)
    before = cc.last_count(out)
    log(f"# {name}: checkpointed in {res['kubelet_checkpoint_s']} s, {res['verify_after_checkpoint']}")

    node.remove(name)
    cc.wait_for("the checkpointed pod gone", lambda: not os.path.exists(f"/proc/{pid}"), 120)
    ref = f"{node.registry}/gpu-check/checkpoint-{name}:1"
    node.import_checkpoint_image(archive, ref)
    mark = len(cc.lines(out))
    res["restore_criu_options"] = node.restore_criu_options
    if node.restore_criu_options:
        # CRIU reads it at its start (CRIU_CONFIG_FILE in containerd's environment): written
        # for the restore only, as CRIU refuses a dump given mntns-compat-mode.
        with open(node.restore_criu_conf, "w") as f:
            f.write(node.restore_criu_options.replace(";", "\n") + "\n")
    t = time.time()
    node.apply(manifest(f"{name}-b", ref, argv, env, mounts, gpu, pull="Never"))

    def restored():
        node.assert_manifest_taken(f"{name}-b")
        c = node.container(f"{name}-b")
        state = node.state(f"{name}-b")
        if c is None and ('"terminated"' in state or "Error" in state):
            kept = os.path.join(node.criu_work, "restore.log")
            said = ""
            if os.path.exists(kept):
                shutil.copy2(kept, os.path.join(node.logs, f"{name}-restore.log"))
                said = "\n".join(l for l in open(kept, errors="replace").read().splitlines()
                                  if "Error" in l or "gpu_plugin" in l)
            raise RuntimeError(f"{name}-b did not restore: {state}\nCRIU's restore log:\n{said}")
        return c
    try:
        cc.wait_for(f"{name}-b running", restored, 600)
    finally:
        if node.restore_criu_options:
            os.unlink(node.restore_criu_conf)
    res["kubelet_restore_s"] = round(time.time() - t, 2)
    rid, rpid = node.container(f"{name}-b")
    logs = [p for p in [os.path.join(node.criu_work, "restore.log")] if os.path.exists(p)]
    if logs:
        shutil.copy2(logs[0], os.path.join(node.logs, f"{name}-restore.log"))
        res["plugin_restore"] = share(gpu_check.plugin_figures(logs[0]), "restore")
    log(f"# {name}: restored in {res['kubelet_restore_s']} s")
    cc.wait_for("the restored workload counting", lambda: cc.last_count(out) > before, 120)
    new = cc.lines(out)[mark:]
    first = next((int(l.split()[1]) for l in new if l.split()[:1] in (["counter"], ["step"])), -1)
    res["restarted"] = any(l.startswith("ready") for l in new)
    res["count_at_checkpoint_call"], res["first_count_after_restore"] = start_count, first
    res["count_after_checkpoint"] = before
    ok2, res["verify_after_restore"] = cc.verify(out, rpid)

    img = os.path.join(node.w, f"{name}-runc-img")
    os.makedirs(img, exist_ok=True)
    t = time.time()
    run([os.path.join(node.bin, "runc"), "--root", os.path.join(node.runc_root, "k8s.io"), "checkpoint",
         "--leave-running", "--image-path", img, "--work-path", img, rid], 900)
    res["runc_checkpoint_s"] = round(time.time() - t, 2)
    res["plugin_runc_checkpoint"] = share(gpu_check.plugin_figures(os.path.join(img, "dump.log")), "checkpoint")
    ok3, res["verify_after_runc_checkpoint"] = cc.verify(out, rpid)
    res["ok"] = bool(ok1 and ok2 and ok3 and res["running_after_checkpoint"] and not res["restarted"]
                     and start_count < first <= before + 1
                     and (not gpu or (res["gpu_image_in_archive"] and res["gpu_in_container"])))
    node.remove(f"{name}-b")
    cc.wait_for("the restored pod gone", lambda: not os.path.exists(f"/proc/{rpid}"), 120)
    shutil.rmtree(img, ignore_errors=True)
    os.unlink(archive)
    return res


COUNTER = ("echo ready > /out/w.1; trap 'echo verify ok shell >> /out/w.1' USR1; i=0; "
           "while :; do i=$((i+1)); echo counter $i >> /out/w.1; sleep 0.2; done")


def main():
    ap = argparse.ArgumentParser()
    for o in ("--bundle", "--criu", "--plugin", "--busybox"):
        ap.add_argument(o, required=True)
    ap.add_argument("--work", default="/var/tmp/gpu-kubelet")
    ap.add_argument("--out", default="/tmp/gpu-kubelet/results.json")
    ap.add_argument("--cases", default="cuda1g,torch")
    a = ap.parse_args()
    for o in ("bundle", "criu", "plugin", "busybox", "work", "out"):
        setattr(a, o, os.path.abspath(getattr(a, o)))
    w = cc.node_namespace(a, "GPU_KUBELET_IN_NS")
    log("# " + run([a.criu, "--version"]).splitlines()[0])
    cases = a.cases.split(",")
    node = KubeletNode(a, w)
    results = []
    try:
        node.start(any(c != "counter" for c in cases))
        workload = os.path.join(w, "cuda_workload")
        if "cuda1g" in cases:
            run(["nvcc", "-O2", "-o", workload, os.path.join(HERE, "cuda_workload.cu")], 600)
        for case in cases:
            out_dir = os.path.join(w, "out", case)
            os.makedirs(out_dir)
            out = os.path.join(out_dir, "w.1")
            mounts = [(out_dir, "/out")]
            env = {}
            if case == "counter":
                argv, gpu = ["/bin/sh", "-c", COUNTER], False
            else:
                gpu = True
                # The host's programs and libraries, as cri_check.py mounts them (the driver's
                # own come by CDI too).
                usr = ["/usr/bin", "/usr/lib64", "/usr/lib/x86_64-linux-gnu"] + sorted(glob.glob("/usr/lib/python3*"))
                # Each once: the kubelet refuses a pod that mounts a path twice (and a static
                # pod it refuses is only named in its log).
                libdirs = list(dict.fromkeys(
                    d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and os.path.isdir(d)))
                env_libdirs = libdirs
                # The driver's folders come by CDI, whose hooks write into them (links): a
                # mount of the host's folder there is read-only to them.
                libdirs = [d for d in libdirs if d not in node.cdi_dirs]
                usr += [d for d in libdirs if not any(d == u or d.startswith(u + "/") for u in usr)]
                mounts += [(d, d) for d in usr if os.path.isdir(d)] + [(HERE, "/repo")]
                if env_libdirs:
                    env["LD_LIBRARY_PATH"] = ":".join(env_libdirs)
                if case == "cuda1g":
                    shutil.copy2(workload, os.path.join(out_dir, "cuda_workload"))
                    argv = ["/out/cuda_workload", "--gib", "1", "--out", "/out/w"]
                else:
                    import importlib.util
                    spec = importlib.util.find_spec("torch")
                    torch_dir = os.path.dirname(os.path.dirname(spec.origin)) if spec else None
                    if not sys.prefix.startswith("/usr"):
                        mounts.append((sys.prefix, sys.prefix))
                    if torch_dir and not torch_dir.startswith(("/usr/", sys.prefix)):
                        mounts.append((torch_dir, torch_dir))
                    argv = [sys.executable, "/repo/train.py", "--out", "/out/w"]
            try:
                r = run_case(node, a, case, argv, env, mounts, gpu, out)
            except Exception as e:  # noqa: BLE001 (reported as the case's failure)
                import traceback
                r = {"case": case, "ok": False, "error": str(e)[-2000:], "where": traceback.format_exc()[-1500:]}
                for m in glob.glob(os.path.join(node.manifests, "*.json")):
                    os.unlink(m)
                time.sleep(5)
            log(json.dumps(r))
            results.append(r)
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        node.stop()
    failed = [r["case"] for r in results if not r.get("ok")]
    log(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
