//! The help pages: `criu-gpu --help`, `criu-gpu help CMD`, `criu-gpu CMD --help`.

const OVERVIEW: &str = "\
NAME
    criu-gpu - suspend and resume GPU processes in place; inspect and check GPU checkpoints

SYNOPSIS
    criu-gpu suspend TARGET [--timeout SECS] [--json]
    criu-gpu resume  TARGET [--device-map OLD=NEW,...] [--json]
    criu-gpu status  TARGET [--json]
    criu-gpu inspect PATH [--json]
    criu-gpu check   PATH [--device-map OLD=NEW,...] [--json]
    criu-gpu help [COMMAND]

    TARGET is a pid (the process and all its descendants), --cgroup PATH (every process
    of the cgroup and its sub-cgroups, v1 or v2) or --pod NAMESPACE/NAME (every process of
    a Kubernetes pod running on this node: its log directory NAMESPACE_NAME_UID in the
    kubelet's podLogsDir, /var/log/pods or --pod-logs DIR, gives the uid that names its
    cgroup under /sys/fs/cgroup; no API server is asked). PATH is a CRIU image directory or a
    checkpoint archive (tar, tar.gz, tar.zst; Podman's --export, CRI-O and kubelet archives).

DESCRIPTION
    criu-gpu is the operator's side of the CRIU GPU plugin, built on the plugin's own library:
    the same driver calls, batches, image readers and restore checks as the plugin inside CRIU.

    suspend   lock and checkpoint every CUDA process of TARGET at once: GPU memory moves into
              each process's host memory and the GPUs are freed; the processes stay alive.
    resume    restore and unlock them again (optionally onto other GPUs).
    status    each process's CUDA state, restore thread and GPUs.
    inspect   the GPU state an image or archive holds (NVIDIA metadata, AMD KFD images).
    check     whether an image would restore on this machine, with the GPU map it would use
              and every reason it would not.

OPTIONS
    --json          machine-readable output on stdout (progress stays on stderr)
    -v, --verbose   the plugin library's INFO log lines on stderr (-vv: DEBUG)
    --serial        one process after another instead of all at once
    -h, --help      this page, or a command's page after the command
    -V, --version   the version

SETTINGS
    The plugin's settings apply: /etc/criu/gpu-plugin.conf (or the file CRIU_GPU_PLUGIN_CONFIG
    names) and the CRIU_GPU_* environment variables, e.g. CRIU_GPU_LIBCUDA (the CUDA driver
    library), CRIU_GPU_NVML, CRIU_GPU_CUDA_NVIDIA_PROC, CRIU_GPU_CUDA_DEVICE_MAP,
    CRIU_GPU_AMDGPU_TOPOLOGY. See criu-gpu-plugin(7).

EXIT STATUS
    0  done (check: it would restore)
    1  failed, with every process put back as it was found (check: it would not restore;
       inspect: the image is damaged); the message says which pid and why
    2  usage error
    3  failed, and some processes could not be put back (or the driver found one neither
       done nor as it was): the message names them
    4  suspend/resume refused, nothing changed: another CRIU or criu-gpu is acting on one of
       the processes (each holds a claim in /run/criu-gpu-plugin/ while it works), or its
       tracer (a CRIU dump, a debugger) has it stopped; the message names the holder, and
       what to do when it is stopped

SEE ALSO
    criu-gpu help suspend, criu(8), criu-gpu-plugin(7), docs/criu-gpu.md
";

const SUSPEND: &str = "\
NAME
    criu-gpu suspend - move every CUDA process of TARGET off its GPUs, in place

SYNOPSIS
    criu-gpu suspend PID [--timeout SECS] [--serial] [--json]
    criu-gpu suspend --cgroup PATH [--timeout SECS] [--serial] [--json]
    criu-gpu suspend --pod NAMESPACE/NAME [--pod-logs DIR] [--timeout SECS] [--serial] [--json]

DESCRIPTION
    Finds every process of TARGET (the pid and its descendants, or every pid of the cgroup or
    of the pod's cgroup, and of their sub-cgroups), asks the CUDA driver which of them use
    CUDA, and then, all at once:
      1. locks each running CUDA process (its CUDA calls block, its GPU work drains), waiting
         at most --timeout (default 10 s; also 500ms, 2.5);
      2. checkpoints each locked process: its GPU memory is copied into its own host memory
         and its GPU resources are released.
    The processes keep running on the CPU; any CUDA call they make waits until `resume`.

    All or nothing: when one process fails, those already locked or checkpointed are put back
    (restored and unlocked) and the command fails naming the pid and the driver's answer.
    A stopped process (SIGSTOP, a debugger) or one in a frozen cgroup is refused before
    anything is changed. Processes not using CUDA are skipped and listed; processes already
    checkpointed are left so.

    Per process it prints the state before and after, the GPU bytes moved (the growth of its
    resident memory, as the plugin measures it) and the time in the driver; then totals,
    including the GPU memory freed as NVML reports it (unknown without NVML).

    Needs root (or the rights to the target processes) and an NVIDIA driver with the CUDA
    checkpoint API (570 or later).

EXAMPLES
    criu-gpu suspend 4242
    criu-gpu suspend --cgroup /sys/fs/cgroup/unified/training.slice --timeout 30 --json
    criu-gpu suspend --pod default/train
";

const RESUME: &str = "\
NAME
    criu-gpu resume - give every suspended CUDA process of TARGET its GPUs back, and every AMD
    process a dump left paused its GPU queues

SYNOPSIS
    criu-gpu resume PID [--device-map OLD=NEW,...] [--serial] [--json]
    criu-gpu resume --cgroup PATH [--device-map OLD=NEW,...] [--serial] [--json]
    criu-gpu resume --pod NAMESPACE/NAME [--pod-logs DIR] [--device-map OLD=NEW,...] [--serial]
                    [--json]

DESCRIPTION
    Restores every checkpointed CUDA process of TARGET (its GPU memory goes back to the GPUs)
    and unlocks it, all at once; a process that is only locked is unlocked. Running processes
    are skipped (listed), as are processes not using CUDA.

    --device-map restores onto other GPUs: OLD=NEW pairs of GPU UUIDs as `nvidia-smi -L`
    prints them (GPU-xxxxxxxx-...), separated by commas; it must cover every GPU the processes
    used. Needs driver 580 (CUDA 13.0) or later. Without it, the cuda.device-map setting
    applies; without that, each process returns to its own GPUs.

    All or nothing: when one process fails, those already resumed are suspended again (locked
    and checkpointed) and the command fails naming the pid and why.

    AMD processes of TARGET whose GPU queues a CRIU dump left paused (CRIU killed in the
    middle of the dump, and its guardian could not restart them) get them restarted first,
    through each process's own /dev/kfd file; those whose queues run are skipped. This needs
    no CUDA driver.

EXAMPLES
    criu-gpu resume 4242
    criu-gpu resume 4242 --device-map GPU-b585ed72-f703-359b-5d2c-7c490dad1115=GPU-53f5f911-9265-6b0a-9031-cbb5cd45a092
";

const STATUS: &str = "\
NAME
    criu-gpu status - show the CUDA state of each process of TARGET

SYNOPSIS
    criu-gpu status PID [--json]
    criu-gpu status --cgroup PATH [--json]
    criu-gpu status --pod NAMESPACE/NAME [--pod-logs DIR] [--json]

DESCRIPTION
    For each process: its CUDA state (running, locked, checkpointed, failed, or not CUDA),
    libcuda's restore thread, and the GPUs it holds open (/dev/nvidiaN among its files; unknown
    when it holds none, e.g. while checkpointed). Changes nothing. A stopped process is not
    asked (the driver would wait for it); the line says so.
";

const INSPECT: &str = "\
NAME
    criu-gpu inspect - show the GPU state a checkpoint holds

SYNOPSIS
    criu-gpu inspect PATH [--json]

DESCRIPTION
    PATH is a CRIU image directory or a checkpoint archive: tar, compressed with gzip or zstd
    (or xz) or not at all, with the images at its top or under checkpoint/ (Podman's
    `container checkpoint --export`, CRI-O and kubelet checkpoint archives). Compressed
    archives are unpacked in memory as they are read (nothing is written to disk).

    NVIDIA: the plugin's metadata (gpu-plugin-cuda.img): the driver, each GPU (UUID, model,
    memory, PCI address) and each CUDA process (pid in its namespace, state when dumped, GPU
    bytes). Images from CRIU's C cuda_plugin have no metadata; that is said.
    AMD: each amdgpu-kfd-ID.img (pid, GPUs with their properties, BOs by kind - VRAM, GTT,
    userptr, doorbell, MMIO - with sizes, the kernel's queue/event/SVM object count, the pages
    files and whether their sizes match) and each render-node image (GPU, BOs, sizes).

    Only the few files needed are read, each with a size bound; archive entries outside the
    image directory, with absolute paths or `..`, links and devices are ignored. A damaged
    image or archive gives an error naming the file and what is wrong (exit 1).
";

const CHECK: &str = "\
NAME
    criu-gpu check - would this checkpoint restore on this machine?

SYNOPSIS
    criu-gpu check PATH [--device-map OLD=NEW,...] [--json]

DESCRIPTION
    Runs the plugin's own restore preflight against this machine, without restoring anything.
    The CPU architecture the checkpoint was made on (a task's core image), which must be this
    machine's. NVIDIA: the driver's version against the image's, the image's GPUs against this
    machine's by UUID and model and memory (explicit --device-map pairs first, then the same
    UUID, then a free GPU of the same model), the free GPU memory the processes need (NVML),
    whether a GPU map needs driver 580, and that every CUDA process recorded is in the image's
    process tree.
    AMD: each KFD image's limits, this machine's KFD topology (/sys/class/kfd, GPUs without a
    render node left out) mapped from the image's (XGMI hives, the KFD_*_CHECK properties), and
    the pages files. A runtime's archive (containerd, CRI-O, Podman): each bind mount of the
    container's spec (spec.dump) whose host path is a symlink here, which CRIU's default mount
    engine cannot restore.

    Prints the GPU map it would use and every reason it would not restore.
    Exit 0: it would restore; 1: it would not (each reason is listed); 2: usage error.
    It does not check what CRIU itself checks (kernel, namespaces, files, pids).
";

/// A `help` for no command there is.
#[derive(Debug, thiserror::Error)]
#[error("no help for {0:?}: the commands are {commands}", commands = crate::args::COMMANDS.join(", "))]
pub struct NoSuchCommand(pub String);

/// The page for `command`, or the overview.
pub fn page(command: Option<&str>) -> Result<&'static str, NoSuchCommand> {
    Ok(match command {
        None => OVERVIEW,
        Some("suspend") => SUSPEND,
        Some("resume") => RESUME,
        Some("status") => STATUS,
        Some("inspect") => INSPECT,
        Some("check") => CHECK,
        Some("help") => OVERVIEW,
        Some(other) => return Err(NoSuchCommand(other.to_string())),
    })
}
