"""The container image of container_check.py: a rootfs with the workload, its libraries and the
driver's, the device nodes, and the OCI spec."""

import glob
import json
import os
import re
import shutil
import stat

from container_proc import Failure, log, output, run

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

NVIDIA_LIB_PREFIXES = ("libcuda.so", "libcudadebugger.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so",
                       "libnvidia-gpucomp.so")
LDD_LIB_DIRS = []


def ldd_paths(path, strict=True):
    """The files the loader maps for path (its interpreter included), as ldd resolves them, with
    the driver's directory searched too (it is on LD_LIBRARY_PATH in the container). A missing
    library fails when strict, else it is reported and left out."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(LDD_LIB_DIRS + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    rc, out = output(["ldd", path], env=env)
    if rc != 0 and "not a dynamic executable" in out:
        return []
    if "not found" in out:
        if strict:
            raise Failure(f"ldd {path}: a library is missing\n{out}")
        log(f"# warning: ldd {path}: " + "; ".join(l.strip() for l in out.splitlines() if "not found" in l))
    paths = []
    for line in out.splitlines():
        m = re.search(r"=>\s+(/\S+)", line) or re.match(r"\s*(/\S+)\s+\(0x", line)
        if m:
            paths.append(m.group(1))
    return paths


def copy_in(rootfs, src, dst=None):
    """Copies src's content to rootfs/dst (default: the same path), directories made real."""
    dst = os.path.join(rootfs, (dst or src).lstrip("/"))
    if os.path.lexists(dst):
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(os.path.realpath(src), dst)
    return dst


def copy_with_libs(rootfs, src, dst=None):
    copy_in(rootfs, src, dst)
    for lib in ldd_paths(src):
        copy_in(rootfs, lib)


def build_rootfs(ctx):
    # Programs run from it: not on a noexec mount (some machines mount /dev/shm so).
    base = ctx.work
    if os.statvfs(base).f_flag & os.ST_NOEXEC:
        base = next((d for d in ("/var/tmp", "/tmp", REPO) if not os.statvfs(d).f_flag & os.ST_NOEXEC), None)
        if base is None:
            raise Failure(f"{ctx.work} is mounted noexec and no other place for the rootfs is found")
        base = os.path.join(base, "gpuck-containers")
    rootfs = os.path.join(base, "rootfs")
    shutil.rmtree(rootfs, ignore_errors=True)
    for d in ("bin", "dev", "proc", "sys", "tmp", "out", "etc"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    os.chmod(os.path.join(rootfs, "tmp"), 0o1777)
    bb = os.path.join(rootfs, "bin", "busybox")
    shutil.copy2(ctx.busybox, bb)
    rc, applets = output([ctx.busybox, "--list"])
    if rc != 0:
        raise Failure(f"{ctx.busybox} --list failed: {applets}")
    for a in applets.split():
        if a != "busybox" and not os.path.lexists(os.path.join(rootfs, "bin", a)):
            os.symlink("busybox", os.path.join(rootfs, "bin", a))
    with open(os.path.join(rootfs, "etc", "passwd"), "w") as f:
        f.write("root:x:0:0:root:/:/bin/sh\n")
    with open(os.path.join(rootfs, "etc", "group"), "w") as f:
        f.write("root:x:0:\n")
    if ctx.fake:
        # Next to each other: the workload finds the stand-in through its DT_RPATH $ORIGIN.
        copy_with_libs(rootfs, ctx.workload, "/fake/workload")
        copy_with_libs(rootfs, ctx.fake_libcuda, "/fake/libcuda.so.1")
    else:
        libdir = ctx.nvidia_lib_dir
        LDD_LIB_DIRS[:] = [libdir]
        copy_with_libs(rootfs, ctx.workload, "/cuda_workload")
        names = sorted(n for n in os.listdir(libdir) if n.startswith(NVIDIA_LIB_PREFIXES))
        if not any(n == "libcuda.so.1" for n in names):
            raise Failure(f"no libcuda.so.1 in {libdir}")
        for n in names:
            src = os.path.join(libdir, n)
            dst = os.path.join(rootfs, libdir.lstrip("/"), n)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.islink(src) and "/" not in os.readlink(src):
                if os.path.lexists(dst):  # copied as a library of the workload
                    os.unlink(dst)
                os.symlink(os.readlink(src), dst)
            else:
                copy_in(rootfs, src, os.path.join(libdir, n))
            # Only what the workload itself loads must resolve; the other driver libraries are
            # there in case libcuda opens them (the PTX JIT compiler, for one).
            for lib in ldd_paths(os.path.realpath(src), strict=n.startswith("libcuda.so")):
                copy_in(rootfs, lib)
    size = sum(os.lstat(os.path.join(r, f)).st_size for r, _, fs in os.walk(rootfs) for f in fs)
    log(f"# rootfs {rootfs}: {size / 2**20:.0f} MiB")
    return rootfs


def device_nodes(ctx):
    """(path in the container, host node) of the device nodes the container gets."""
    if ctx.fake:
        return [("/dev/nvidia-fake0", "/dev/zero")]
    nodes = ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    missing = [n for n in nodes if not os.path.exists(n)]
    if missing:
        raise Failure(f"device nodes missing on this machine: {missing}")
    nodes += sorted(n for n in glob.glob("/dev/nvidia[0-9]*") if n not in nodes)
    nodes += sorted(glob.glob("/dev/nvidia-caps/*"))
    return [(n, n) for n in nodes]


def make_spec(ctx, bundle, rootfs, args, criu_conf, hostname):
    os.makedirs(bundle, exist_ok=True)
    spec_path = os.path.join(bundle, "config.json")
    if os.path.exists(spec_path):
        os.unlink(spec_path)
    # runc's own default spec, adjusted: the starting point every runc user has.
    run([ctx.runc, "spec", "--bundle", bundle], 30, what="runc spec")
    with open(spec_path) as f:
        spec = json.load(f)
    spec["root"] = {"path": rootfs, "readonly": False}
    spec["hostname"] = hostname
    proc = spec["process"]
    proc["terminal"] = False
    proc["args"] = args
    env = ["PATH=/bin", "HOME=/"]
    if ctx.fake:
        # The stand-in's "device memory" files: not in the container's 64 MiB /dev/shm.
        env.append("FAKE_CUDA_DEVICE_DIR=/tmp/fake-cuda")
    else:
        env.append(f"LD_LIBRARY_PATH={ctx.nvidia_lib_dir}")
    proc["env"] = env
    proc["cwd"] = "/"
    linux = spec["linux"]
    # No network namespace: CRIU would need iptables to lock it, and the GPU machine has none.
    linux["namespaces"] = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    devices, allow = [], [{"allow": False, "access": "rwm"}]
    for path, node in device_nodes(ctx):
        st = os.stat(node)
        if not stat.S_ISCHR(st.st_mode):
            raise Failure(f"{node} is not a character device")
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        devices.append({"path": path, "type": "c", "major": major, "minor": minor,
                        "fileMode": stat.S_IMODE(st.st_mode), "uid": 0, "gid": 0})
        allow.append({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})
    linux["devices"] = devices
    linux.setdefault("resources", {})["devices"] = allow
    spec["annotations"] = {"org.criu.config": criu_conf}
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    return spec
