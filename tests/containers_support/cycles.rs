//! The checkpoint-and-restore cycles both container test files run, whatever the runtime's
//! release: an OCI runtime's checkpoint (the container goes) and restore, its `--leave-running`
//! checkpoint and a restore of that image, and Podman's export, removal and import.
//!
//! `step` is called after every step that runs CRIU, with the step's name: a test that watches
//! for damage outside the container (a runtime that signals every process it can) checks there.

use std::path::Path;

use super::engines::Podman;
use super::oci::OciRuntime;
use super::{
    Output, Workload, assert_plugin_dumped, assert_plugin_restored, run_tool, tool_path,
    transitions, wait_gone,
};
use crate::common::E2e;

/// Device files of a running CUDA workload: its 4 KiB counter and its 8 MiB of memory.
pub fn device_memory(out: &Output) -> Vec<String> {
    let files = out.device_files();
    assert_eq!(files.len(), 2, "counter + one chunk: {files:?}");
    files
}

/// Container `name` of `rt`: checkpoint (the container goes), restore, the workload goes on
/// where it was, on CUDA with its device memory recreated and checked (the fake driver's calls
/// logged to `calls`).
pub fn oci_checkpoint_restore(
    e: &E2e,
    rt: &OciRuntime,
    workload: Workload,
    annotations: &[(String, String)],
    name: &str,
    calls: &Path,
    step: &dyn Fn(&str),
) {
    let c = rt.start(name, workload, annotations, None);
    let pid = c.pid();
    let files = workload.is_cuda().then(|| device_memory(&c.out));
    let images = e.images(&format!("{name}-img"));

    let dump = c.checkpoint(&images, &e.dir().join(format!("{name}-dump")), false);
    step("checkpoint");
    assert_plugin_dumped(e, &dump, workload, pid);
    c.assert_gone(pid);
    if workload.is_cuda() {
        assert!(
            c.out.device_files().is_empty(),
            "the checkpoint left device memory: {:?}",
            c.out.device_files()
        );
        assert_eq!(
            transitions(calls, pid),
            ["lock=0", "checkpoint=0"],
            "driver calls of the dump"
        );
    }
    let mark = c.out.mark();

    let restore = c.restore(&images, &e.dir().join(format!("{name}-restore")));
    step("restore");
    assert_plugin_restored(e, &restore, workload);
    let restored = c.pid();
    c.out.assert_continues(mark);
    if let Some(files) = files {
        assert_eq!(c.out.device_files(), files, "device memory not recreated");
        assert_eq!(
            transitions(calls, restored),
            ["restore=0", "unlock=0"],
            "driver calls of the restore"
        );
        c.out.verify(restored);
    }
    c.remove();
    step("removal of the restored container");
}

/// `--leave-running`: the container runs on with its GPU; then it is removed and the image
/// restores, the workload going on from a count it had while it was dumped.
pub fn oci_leave_running_restore(
    e: &E2e,
    rt: &OciRuntime,
    workload: Workload,
    annotations: &[(String, String)],
    calls: &Path,
    step: &dyn Fn(&str),
) {
    let c = rt.start("c", workload, annotations, None);
    let pid = c.pid();
    let files = workload.is_cuda().then(|| device_memory(&c.out));
    let images = e.images("img");

    let low = c.out.mark();
    let dump = c.checkpoint(&images, &e.dir().join("dump"), true);
    let high = c.out.mark();
    step("checkpoint --leave-running");
    assert_plugin_dumped(e, &dump, workload, pid);
    assert_eq!(c.pid(), pid, "the container after --leave-running");
    c.out.assert_given_back(files.as_ref(), calls, pid);

    c.remove();
    let killed = c.out.mark();
    let restore = c.restore(&images, &e.dir().join("restore"));
    step("restore");
    assert_plugin_restored(e, &restore, workload);
    c.out.assert_resumes_between(low, high, killed);
    if let Some(files) = files {
        assert_eq!(c.out.device_files(), files, "device memory not recreated");
        c.out.verify(c.pid());
    }
    c.remove();
    step("removal of the restored container");
}

/// `checkpointctl show` and `inspect --ps-tree` (of program `checkpointctl`) read the exported
/// archive: the container `name`, runc, Podman, `process` as the container's pid 1.
pub fn assert_checkpointctl_reads(
    e: &E2e,
    checkpointctl: &Path,
    archive: &Path,
    name: &str,
    process: &str,
) {
    let run = |args: &[&str]| {
        let mut cmd = e.command(checkpointctl);
        cmd.args(args)
            .arg(archive)
            .env("PATH", tool_path(e))
            .env("TMPDIR", e.dir());
        let r = run_tool(e.dir(), cmd, &format!("checkpointctl {}", args.join(" ")));
        r.assert_ok();
        r.stdout
    };
    let show = run(&["show"]);
    for want in [name, "runc", "Podman"] {
        assert!(show.contains(want), "checkpointctl show: no {want}: {show}");
    }
    let tree = run(&["inspect", "--ps-tree"]);
    assert!(
        tree.contains(&format!("[1]  {process}")),
        "checkpointctl inspect --ps-tree: no {process} as pid 1: {tree}"
    );
}

/// Podman's `container checkpoint --export`, `checkpointctl` reading the archive, `rm`,
/// `container restore --import`: the workload goes on where it was, on CUDA with its device
/// memory recreated and checked.
pub fn podman_export_import(e: &E2e, pm: &Podman, workload: Workload, checkpointctl: &Path) {
    pm.import_image();
    let c = pm.start("c", workload);
    let pid = c.pid();
    let files = workload.is_cuda().then(|| device_memory(&c.out));
    let archive = e.dir().join("checkpoint.tar.gz");

    let dump = c.checkpoint_export(&archive);
    assert_plugin_dumped(e, &dump, workload, pid);
    wait_gone(pid, "the checkpointed container's init");
    if workload.is_cuda() {
        assert!(
            c.out.device_files().is_empty(),
            "the checkpoint left device memory"
        );
    }
    let process = if workload.is_cuda() { "workload" } else { "sh" };
    assert_checkpointctl_reads(e, checkpointctl, &archive, &c.name, process);
    c.rm();
    assert!(!c.exists(), "container {} after podman rm", c.name);
    let mark = c.out.mark();

    let restore = c.restore_import(&archive);
    assert_plugin_restored(e, &restore, workload);
    let restored = c.pid();
    c.out.assert_continues(mark);
    if let Some(files) = files {
        assert_eq!(c.out.device_files(), files, "device memory not recreated");
        c.out.verify(restored);
    }
}
