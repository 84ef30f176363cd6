"""CRI smoke test of a CRI-O on a Unix socket, for scripts/build-crio.sh --smoke.

Usage: cri_smoke.py SOCKET PYAPI_DIR WORK_DIR

Version and Status; CheckpointContainer of a missing container (NOT_FOUND means
checkpointing is on); then, in host-network pods, a counter container from the image
localhost/crio-smoke-counter, checkpointed through CRI (CRI-O keeps it running) and restored into
a new pod from the archive, whose counter must go on from where it was, not from 0.
Everything it creates is removed at the end.
"""

import os
import sys
import time

import grpc

sys.path.insert(0, sys.argv[2])
import api_pb2 as cri  # noqa: E402
import api_pb2_grpc as cri_grpc  # noqa: E402

SOCKET, WORK = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[3])
IMAGE = "localhost/crio-smoke-counter:latest"
rt = cri_grpc.RuntimeServiceStub(grpc.insecure_channel("unix:" + SOCKET))


def say(msg):
    print(f"[build-crio] {msg}", flush=True)


def fail(msg):
    sys.exit(f"[build-crio] ERROR: {msg}")


v = rt.Version(cri.VersionRequest(), timeout=10)
say(f"Version: {v.runtime_name} {v.runtime_version}, CRI {v.runtime_api_version}")
st = rt.Status(cri.StatusRequest(), timeout=10)
say("Status: " + ", ".join(f"{c.type}={c.status}" for c in st.status.conditions))
try:
    rt.CheckpointContainer(cri.CheckpointContainerRequest(container_id="no-such-container", location="/nonexistent.tar"), timeout=10)
    fail("CheckpointContainer of a missing container succeeded")
except grpc.RpcError as e:
    if e.code() != grpc.StatusCode.NOT_FOUND:
        fail(f"checkpointing is not enabled: {e.code().name}: {e.details()}")
    say(f"CheckpointContainer enabled (a missing container gives {e.code().name})")

# Host network: no CNI plugin is configured. The pid namespace is the container's own.
NS = cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)


def run_pod(name):
    logs = os.path.join(WORK, "logs-" + name)
    os.makedirs(logs, exist_ok=True)
    cfg = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=name, namespace="default"),
        log_directory=logs,
        linux=cri.LinuxPodSandboxConfig(security_context=cri.LinuxSandboxSecurityContext(namespace_options=NS)),
    )
    return rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg), timeout=120).pod_sandbox_id, cfg, logs


def counter_values(log_dir):
    # CRI log lines: "TIME stdout F TEXT".
    out = []
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            out += [int(p[3]) for p in (line.split(" ", 3) for line in f) if len(p) == 4 and p[1] == "stdout" and p[3].strip().isdigit()]
    return out


hosts = os.path.join(WORK, "hosts")
with open(hosts, "w") as f:
    f.write("127.0.0.1 localhost\n")
# A checkpoint records the container's bind mounts; a restore must define them again.
mounts = [cri.Mount(container_path="/etc/hosts", host_path=hosts)]
try:
    pod, pod_cfg, logs = run_pod("crio-smoke-dump")
    ccfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="counter"),
        image=cri.ImageSpec(image=IMAGE, user_specified_image=IMAGE),
        log_path="counter.log",
        mounts=mounts,
        linux=cri.LinuxContainerConfig(security_context=cri.LinuxContainerSecurityContext(namespace_options=NS)),
    )
    ctr = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod, config=ccfg, sandbox_config=pod_cfg), timeout=120).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=ctr), timeout=60)
    time.sleep(3)
    archive = os.path.join(WORK, "checkpoint.tar")
    t = time.monotonic()
    rt.CheckpointContainer(cri.CheckpointContainerRequest(container_id=ctr, location=archive), timeout=300)
    dumped_at = max(counter_values(logs))
    say(f"CheckpointContainer: {os.path.getsize(archive)} bytes in {time.monotonic() - t:.1f} s, counter at {dumped_at}")
    state = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=ctr)).status.state
    if state != cri.CONTAINER_RUNNING:
        fail(f"the checkpointed container is {cri.ContainerState.Name(state)}, not running")
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=60)

    pod2, pod2_cfg, logs2 = run_pod("crio-smoke-restore")
    rcfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="counter"),
        image=cri.ImageSpec(image=archive, user_specified_image=archive),
        mounts=mounts,
        linux=cri.LinuxContainerConfig(security_context=cri.LinuxContainerSecurityContext(namespace_options=NS)),
    )
    t = time.monotonic()
    ctr2 = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod2, config=rcfg, sandbox_config=pod2_cfg), timeout=300).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=ctr2), timeout=300)
    took = time.monotonic() - t
    time.sleep(3)
    after = counter_values(logs2)
    # The restored log begins with the dumped container's lines; then the counter goes on.
    went_on = dumped_at in after and max(after) > dumped_at and 0 not in after[after.index(dumped_at) + 1 :]
    if not went_on:
        fail(f"the restored counter did not go on from {dumped_at}: {after[-5:]}")
    say(f"restore through CreateContainer from the archive: {took:.1f} s, counter went on from {dumped_at} to {max(after)}")
finally:
    for p in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items:
        rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=p.id), timeout=60)
        rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=p.id), timeout=60)
