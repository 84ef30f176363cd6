//! What the tests check of a CRI checkpoint and restore: the archive, the restored container
//! resuming with its GPU state, and the checkpoint as an OCI image.

use super::*;

/// The stand-in CUDA driver's log of its calls (`FAKE_CUDA_LOG` of the node's CRIU).
pub fn calls(e: &E2e) -> PathBuf {
    e.dir().join("cuda-calls")
}

/// The kubelet's default checkpoint timeout is 4 hours; a test's dump takes seconds.
pub const CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(60);

/// `criu-gpu` of this workspace, built when the test run did not build it.
pub fn criu_gpu() -> PathBuf {
    workspace_bin("criu-gpu", "criu-gpu")
}

/// Program `name` of this workspace's package `package`, built when the test run did not
/// build it.
pub fn workspace_bin(package: &str, name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let bin = profile_dir.join(name);
    if !bin.is_file() {
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "--locked", "-p", package, "--bin", name]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let ok = cmd.status().is_ok_and(|s| s.success());
        assert!(ok && bin.is_file(), "cannot build {name}: {cmd:?}");
    }
    bin
}

/// The archive of a CRI checkpoint, read as an operator would: the plugin's image and log
/// lines are in it, and `checkpointctl show` (which names node `n`'s engine) and `criu-gpu
/// inspect` read it.
pub fn assert_archive<D: CriDaemon>(
    n: &CriNode<'_, D>,
    archive: &Path,
    workload: Workload,
    pid: i32,
) {
    assert_archive_of(n.e, D::ENGINE, archive, workload, pid);
}

/// [`assert_archive`] of an archive written by runtime `engine` (as `checkpointctl show`
/// names it).
pub fn assert_archive_of(e: &E2e, engine: &str, archive: &Path, workload: Workload, pid: i32) {
    let members = archive_members(e, archive);
    for want in [
        "dump.log",
        "config.dump",
        "spec.dump",
        "checkpoint/inventory.img",
    ] {
        assert!(
            members.iter().any(|m| m == want),
            "no {want} in the archive: {members:?}"
        );
    }
    let gpu_image = members
        .iter()
        .any(|m| m == "checkpoint/gpu-plugin-cuda.img");
    assert_eq!(
        gpu_image,
        workload.is_cuda(),
        "checkpoint/gpu-plugin-cuda.img in the archive: {members:?}"
    );
    let dump = CriuRun {
        what: "CheckpointContainer".into(),
        code: Some(0),
        log: archive_member(e, archive, "dump.log"),
        output: String::new(),
        took: Duration::ZERO,
    };
    assert_plugin_dumped(e, &dump, workload, pid);

    let mut cmd = e.command(&private_tool("checkpointctl"));
    cmd.arg("show")
        .arg(archive)
        .env("PATH", tool_path(e))
        .env("TMPDIR", e.dir());
    let show = run_tool(e.dir(), cmd, "checkpointctl show");
    show.assert_ok();
    assert!(
        show.stdout.contains(engine),
        "checkpointctl show: no engine {engine}: {show:?}"
    );

    let mut cmd = e.command(&criu_gpu());
    cmd.arg("inspect").arg(archive);
    let inspect = run_tool(e.dir(), cmd, "criu-gpu inspect");
    inspect.assert_ok();
    let want = if workload.is_cuda() {
        "1 CUDA process(es)"
    } else if workload.is_kfd() {
        "2 GPU(s)"
    } else {
        "no GPU state: CRIU restores this checkpoint without the GPU plugin"
    };
    assert!(
        inspect.stdout.contains(want),
        "criu-gpu inspect: no `{want}`: {inspect:?}"
    );
    // The runtime's spec in the archive: read, and none of its bind mounts refused.
    let mut cmd = e.command(&criu_gpu());
    cmd.arg("check").arg(archive);
    let check = run_tool(e.dir(), cmd, "criu-gpu check");
    assert!(
        !check.stdout.contains("is a symlink here") && !check.stdout.contains("spec.dump is not"),
        "criu-gpu check: {check:?}"
    );
}

/// The checkpointed container removed, a new one created from `archive` in `pod` and started:
/// it must resume where the checkpoint (taken between output marks `low` and `high`) left it,
/// with its device memory for CUDA (`files`). Returns the restored container.
pub fn restore_from<'e, D: CriDaemon>(
    n: &'e CriNode<'e, D>,
    pod: &(String, v1::PodSandboxConfig),
    name: &str,
    image: &str,
    old: &CriContainer<'_, D>,
    marks: (usize, usize),
    files: Option<&Vec<String>>,
) -> CriContainer<'e, D> {
    restore_from_with(n, pod, name, image, old, marks, files, &|_| {}).0
}

/// [`restore_from`] with the new container's configuration changed by `edit`; also returns
/// CRIU's log of the restore.
#[allow(clippy::too_many_arguments)]
pub fn restore_from_with<'e, D: CriDaemon>(
    n: &'e CriNode<'e, D>,
    pod: &(String, v1::PodSandboxConfig),
    name: &str,
    image: &str,
    old: &CriContainer<'_, D>,
    (low, high): (usize, usize),
    files: Option<&Vec<String>>,
    edit: &dyn Fn(&mut v1::ContainerConfig),
) -> (CriContainer<'e, D>, CriuRun) {
    old.remove();
    let killed = old.out.mark();
    let out = Output::new(old.out.dir.clone(), old.out.workload);
    let id = n
        .create_from_checkpoint_with(pod, name, image, &out, edit)
        .unwrap_or_else(|err| panic!("CreateContainer from {image}: {err}\n{}", n.log_tail()));
    n.start_restored(&id)
        .unwrap_or_else(|err| panic!("StartContainer (restore): {err}\n{}", n.log_tail()));
    let c = CriContainer { node: n, id, out };
    let pid = c.running_pid();
    // CRIU's log of the restore, in the container's work directory.
    let log = n.restore_log(&c.id);
    let restore = CriuRun {
        what: "StartContainer (restore)".into(),
        code: Some(0),
        log: std::fs::read_to_string(&log)
            .unwrap_or_else(|err| panic!("CRIU's restore log {}: {err}", log.display())),
        output: String::new(),
        took: Duration::ZERO,
    };
    assert_plugin_restored(n.e, &restore, c.out.workload);
    c.out.assert_resumes_between(low, high, killed);
    if let Some(files) = files {
        c.out.assert_gpu_restored(files, &calls(n.e), pid);
    }
    (c, restore)
}

/// The member names of tar archive `archive` (through `tar -t`).
pub fn archive_members(e: &E2e, archive: &Path) -> Vec<String> {
    let mut cmd = e.command(Path::new("tar"));
    cmd.arg("-tf").arg(archive);
    let run = super::super::run_tool(e.dir(), cmd, "tar -t");
    run.assert_ok();
    run.stdout
        .lines()
        .map(|l| l.trim_start_matches("./").to_string())
        .collect()
}

/// Member `name` of tar archive `archive`, as text.
pub fn archive_member(e: &E2e, archive: &Path, name: &str) -> String {
    let mut cmd = e.command(Path::new("tar"));
    cmd.arg("-xOf").arg(archive).arg(name);
    let run = super::super::run_tool(e.dir(), cmd, "tar -xO");
    run.assert_ok();
    run.stdout
}

/// Waits until `pid` is gone and reaped.
pub fn wait_pid_gone(pid: i32) {
    wait_until(format!("pid {pid} gone"), || {
        reap_now();
        !common::exists(pid)
    });
}

/// The annotation by which containerd 2.x (and CRI-O, under its own name) recognises a
/// checkpoint image: the name of the checkpointed container.
pub const CHECKPOINT_ANNOTATIONS: [&str; 2] = [
    "org.criu.checkpoint.container.name",
    "io.kubernetes.cri-o.annotations.checkpoint.name",
];

/// Turns the CRI checkpoint `archive` of container `container` into an OCI image and pushes
/// it to `registry` as `<registry>/criu-gpu-e2e/checkpoint-<container>:1`, the way the
/// Kubernetes documentation does it with buildah (`from scratch`, `add` the archive, the
/// checkpoint annotation, `commit`, `push`). buildah is `CRIU_GPU_TEST_BUILDAH2`, else
/// `<repo>/.runtimes-2026/bin/buildah`; its storage (vfs) is in the test's directory.
pub fn push_checkpoint_image(
    e: &E2e,
    archive: &Path,
    container: &str,
    registry: &Registry,
) -> String {
    push_checkpoint_image_for(e, archive, container, registry, None)
}

/// [`push_checkpoint_image`], the image's configuration naming CPU architecture `arch` (as
/// GOARCH spells it: `arm64`) if given, else this machine's (buildah's default): the
/// platform a node's pull matches against its own.
pub fn push_checkpoint_image_for(
    e: &E2e,
    archive: &Path,
    container: &str,
    registry: &Registry,
    arch: Option<&str>,
) -> String {
    let buildah = super::super::tool_2026("CRIU_GPU_TEST_BUILDAH2", "bin/buildah");
    let d = e.dir().join("buildah");
    let [root, runroot, varlib] = ["root", "run", "var-lib-containers"].map(|s| d.join(s));
    for p in [&root, &runroot, &varlib] {
        std::fs::create_dir_all(p).expect("buildah directory");
    }
    let policy = d.join("policy.json");
    std::fs::write(
        &policy,
        r#"{"default":[{"type":"insecureAcceptAnything"}]}"#,
    )
    .expect("policy.json");
    // buildah looks for netavark even when it runs nothing: the prefix's.
    let prefix = buildah
        .parent()
        .and_then(Path::parent)
        .expect("<prefix>/bin/buildah");
    let conf = d.join("containers.conf");
    std::fs::write(
        &conf,
        format!(
            "[engine]\nhelper_binaries_dir = [\"{}\"]\n[network]\nnetwork_backend = \"netavark\"\n",
            prefix.join("usr/lib/podman").display()
        ),
    )
    .expect("containers.conf");
    let mounts = super::super::PrivateMounts::new().bind(&varlib, "/var/lib/containers");
    let reference = format!("{}/criu-gpu-e2e/checkpoint-{container}:1", registry.host);
    let run = |args: &[&str]| -> String {
        let mut argv: Vec<OsString> = vec![
            buildah.clone().into(),
            "--root".into(),
            root.clone().into(),
            "--runroot".into(),
            runroot.clone().into(),
            "--storage-driver".into(),
            "vfs".into(),
        ];
        argv.extend(args.iter().map(OsString::from));
        let what = super::super::describe(&argv);
        let mut cmd = mounts.command(e, e.dir(), &argv);
        cmd.env("TMPDIR", e.dir()).env("CONTAINERS_CONF", &conf);
        let r = super::super::run_tool(e.dir(), cmd, &what);
        r.assert_ok();
        r.stdout.trim().to_string()
    };
    let policy = policy.to_str().expect("UTF-8 path");
    let ctr = run(&["from", "--signature-policy", policy, "scratch"]);
    run(&["add", &ctr, archive.to_str().expect("UTF-8 path"), "/"]);
    let mut config = vec!["config".to_string()];
    for a in CHECKPOINT_ANNOTATIONS {
        config.push(format!("--annotation={a}={container}"));
    }
    if let Some(arch) = arch {
        config.push(format!("--arch={arch}"));
    }
    config.push(ctr.clone());
    run(&config.iter().map(String::as_str).collect::<Vec<_>>());
    let image = format!("localhost/criu-gpu-e2e-checkpoint-{container}:1");
    run(&["commit", "--signature-policy", policy, &ctr, &image]);
    run(&[
        "push",
        "--signature-policy",
        policy,
        "--tls-verify=false",
        &image,
        &format!("docker://{reference}"),
    ]);
    reference
}

/// The freezer state of `pid`'s cgroup (cgroup v1 `freezer.state`, v2 `cgroup.freeze`).
pub fn freezer_state(pid: i32) -> String {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let v1 = cg
        .lines()
        .find_map(|l| l.split_once(":freezer:").map(|x| x.1.to_string()));
    let path = match v1 {
        Some(p) => format!("/sys/fs/cgroup/freezer{p}/freezer.state"),
        None => {
            let p = cg
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .unwrap_or("/");
            format!("/sys/fs/cgroup{p}/cgroup.freeze")
        }
    };
    match std::fs::read_to_string(&path).map(|s| s.trim().to_string()) {
        Ok(s) if s == "1" => "FROZEN".into(),
        Ok(s) if s == "0" => "THAWED".into(),
        Ok(s) => s,
        Err(err) => format!("{path}: {err}"),
    }
}
