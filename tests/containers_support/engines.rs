//! Podman (with runc) and containerd (its runc shim, driven through `ctr`), each with all of
//! its state under the test's directory and every command (the containerd daemon, and with it
//! its shims) in the test's [`PrivateMounts`]. Podman is in `engines/podman.rs`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{
    Cgroup, Output, PrivateMounts, ToolRun, Workload, criu_run, describe, reap_now, rootfs_tar,
    run_cleanup, run_tool, system_tool,
};
use crate::common::{self, CriuRun, E2e, TempDir, wait_until};

mod podman;

pub use podman::*;

/// The image both engines run: the shared root file system.
pub const IMAGE: &str = "localhost/criu-gpu-e2e:latest";

// ---- containerd ---------------------------------------------------------------------------

/// An OCI image layout archive of the shared root file system (one uncompressed layer), for
/// `ctr image import`.
fn oci_archive(e: &E2e) -> PathBuf {
    oci_archive_of(e, "oci-image", IMAGE, "")
}

/// An OCI image layout archive `<test dir>/<stem>.tar` of the shared root file system, named
/// `name`; `config` is added to the image's runtime configuration (JSON members after `Env`,
/// e.g. `,"Entrypoint":[...]`).
pub fn oci_archive_of(e: &E2e, stem: &str, name: &str, config: &str) -> PathBuf {
    let dir = e.dir().join(stem);
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("OCI layout");
    let sha256 = |p: &Path| -> String {
        let mut cmd = e.command(Path::new("sha256sum"));
        cmd.arg(p);
        let run = run_tool(e.dir(), cmd, "sha256sum");
        run.assert_ok();
        run.stdout.split(' ').next().expect("digest").to_string()
    };
    // Moves file `p` into the blobs as its digest; returns (digest, size).
    let add_blob = |p: &Path| -> (String, u64) {
        let d = sha256(p);
        let size = std::fs::metadata(p).expect("blob").len();
        std::fs::rename(p, blobs.join(&d)).expect("blob");
        (d, size)
    };
    let layer = dir.join("layer.tar");
    std::fs::copy(rootfs_tar(e), &layer).expect("layer");
    let (ld, ls) = add_blob(&layer);
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["PATH=/bin"]{config}}},"rootfs":{{"type":"layers","diff_ids":["sha256:{ld}"]}}}}"#
        ),
    )
    .expect("image config");
    let (cd, cs) = add_blob(&cfg);
    let man = dir.join("manifest.json");
    std::fs::write(
        &man,
        format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:{cd}","size":{cs}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:{ld}","size":{ls}}}]}}"#
        ),
    )
    .expect("manifest");
    let (md, ms) = add_blob(&man);
    std::fs::write(
        dir.join("index.json"),
        format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:{md}","size":{ms},"annotations":{{"io.containerd.image.name":"{name}","org.opencontainers.image.ref.name":"latest"}}}}]}}"#
        ),
    )
    .expect("index");
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("oci-layout");
    let archive = e.dir().join(format!("{stem}.tar"));
    let mut cmd = e.command(Path::new("tar"));
    cmd.arg("-C")
        .arg(&dir)
        .arg("-cf")
        .arg(&archive)
        .args(["oci-layout", "index.json", "blobs"]);
    run_tool(e.dir(), cmd, "tar OCI image").assert_ok();
    archive
}

/// Which containerd and runc: Debian 12's (containerd 1.6, config version 2, the shim and runc
/// from the system's `PATH`), or today's ([`ContainerdBins::v2026`]: containerd 2.x, config
/// version 3, the shim found beside the daemon, runc named to `ctr run`).
#[derive(Clone, Debug)]
pub struct ContainerdBins {
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    /// `ctr run --runc-binary`; the shim's `PATH` otherwise.
    pub runc: Option<PathBuf>,
    /// First on the daemon's `PATH` (where containerd looks for `containerd-shim-runc-v2`).
    pub bin_dir: Option<PathBuf>,
    /// containerd 2.x: configuration `version = 3` and its plugin IDs.
    pub v2: bool,
    /// The daemon, and with it its shims, runc and CRIU, see a cgroup-v2-only system
    /// ([`PrivateMounts::cgroup2_only`]).
    pub cgroup2_only: bool,
}

impl ContainerdBins {
    /// Debian 12's containerd 1.6, ctr and runc 1.1.5.
    pub fn system() -> ContainerdBins {
        ContainerdBins {
            containerd: system_tool("containerd"),
            ctr: system_tool("ctr"),
            runc: None,
            bin_dir: None,
            v2: false,
            cgroup2_only: false,
        }
    }

    /// Today's: containerd 2.x (`CRIU_GPU_TEST_CONTAINERD2`, its shim beside it) and its ctr
    /// (`CRIU_GPU_TEST_CTR2`), by default from `<repo>/.runtimes-2026/bin`, with `runc`.
    pub fn v2026(runc: PathBuf) -> ContainerdBins {
        let containerd = super::tool_2026("CRIU_GPU_TEST_CONTAINERD2", "bin/containerd");
        let bin_dir = containerd.parent().map(Path::to_path_buf);
        ContainerdBins {
            ctr: super::tool_2026("CRIU_GPU_TEST_CTR2", "bin/ctr"),
            runc: Some(runc),
            bin_dir,
            containerd,
            v2: true,
            cgroup2_only: false,
        }
    }

    /// The first line of `PROGRAM --version` of containerd and runc (for the test's log).
    pub fn versions(&self) -> String {
        let runc = self.runc.clone().unwrap_or_else(|| system_tool("runc"));
        format!(
            "{}; {}",
            super::version_line(&self.containerd),
            super::version_line(&runc)
        )
    }
}

/// A containerd daemon of the test's own: root, state, socket and config in the test's
/// directory, the CRI plugin off, `/run/containerd` (its shims' sockets) private; its shims
/// run runc, which runs CRIU, in its mount namespace and with its environment.
pub struct Containerd<'e> {
    pub e: &'e E2e,
    /// The `unshare` whose exec became the daemon.
    daemon: i32,
    /// Also around every `ctr`: it makes the FIFOs of a task's stdio under /run/containerd.
    mounts: PrivateMounts,
    sock: PathBuf,
    runc_root: PathBuf,
    log: PathBuf,
    ctr: PathBuf,
    runc: Option<PathBuf>,
    pub cgroup: Cgroup,
    containers: std::cell::RefCell<Vec<String>>,
    /// Holds the socket; removed after the daemon is gone.
    _short: TempDir,
}

const CTR_NAMESPACE: &str = "criu-gpu-e2e";

impl<'e> Containerd<'e> {
    /// Starts the daemon with `etc_criu` as its `/etc/criu` and `env` added.
    pub fn start(e: &'e E2e, etc_criu: &Path, env: &[(&str, OsString)]) -> Containerd<'e> {
        Containerd::start_with(e, etc_criu, env, ContainerdBins::system())
    }

    /// [`Containerd::start`] of the containerd (and runc) `bins`.
    pub fn start_with(
        e: &'e E2e,
        etc_criu: &Path,
        env: &[(&str, OsString)],
        bins: ContainerdBins,
    ) -> Containerd<'e> {
        Containerd::start_node(e, "containerd", etc_criu, env, bins, None)
    }

    /// A daemon with its state in `<test dir>/<node>`; `cri` (containerd 2.x only) turns its
    /// CRI on: the TOML of the CRI's plugins, given the node's directory (see
    /// `containers_support::cri`).
    pub fn start_node(
        e: &'e E2e,
        node: &str,
        etc_criu: &Path,
        env: &[(&str, OsString)],
        bins: ContainerdBins,
        cri: Option<&dyn Fn(&Path) -> String>,
    ) -> Containerd<'e> {
        let mounts = PrivateMounts::new().bind(etc_criu, "/etc/criu");
        Containerd::start_node_mounted(e, node, mounts, env, bins, cri)
    }

    /// [`Containerd::start_node`] in a mount namespace with `mounts` (the node's `/etc/criu`
    /// among them) and the daemon's `/run/containerd`.
    pub fn start_node_mounted(
        e: &'e E2e,
        node: &str,
        mounts: PrivateMounts,
        env: &[(&str, OsString)],
        bins: ContainerdBins,
        cri: Option<&dyn Fn(&Path) -> String>,
    ) -> Containerd<'e> {
        let d = e.dir().join(node);
        let [root, state, run, opt, runc_root] =
            ["root", "state", "run", "opt", "runc"].map(|s| d.join(s));
        for p in [&root, &state, &run, &opt, &runc_root] {
            std::fs::create_dir_all(p).expect("containerd directory");
        }
        // A unix socket path has at most 107 bytes: the socket in a short directory of the
        // test's under /tmp, whatever the checkout's path.
        let short = TempDir::new_in(Path::new("/tmp"), "ctd");
        let sock = short.join("containerd.sock");
        let config = d.join("config.toml");
        std::fs::write(
            &config,
            format!(
                r#"version = {version}
root = "{root}"
state = "{state}"
disabled_plugins = [{cri_off}"io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = ""
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
{cri_on}"#,
                version = if bins.v2 { 3 } else { 2 },
                // containerd 2.x splits the CRI into more plugins.
                cri_off = match (cri.is_some(), bins.v2) {
                    (true, _) => "",
                    (false, true) => {
                        "\"io.containerd.grpc.v1.cri\", \"io.containerd.cri.v1.images\", \
                         \"io.containerd.cri.v1.runtime\",\n  \
                         \"io.containerd.podsandbox.controller.v1.podsandbox\", "
                    }
                    (false, false) => "\"io.containerd.grpc.v1.cri\", ",
                },
                cri_on = cri.map(|f| f(&d)).unwrap_or_default(),
                root = root.display(),
                state = state.display(),
                sock = sock.display(),
                opt = opt.display(),
            ),
        )
        .expect("containerd config");
        let mounts = mounts
            .cgroup2_only(bins.cgroup2_only)
            .bind(&run, "/run/containerd");
        let argv: Vec<OsString> = vec![
            bins.containerd.clone().into(),
            "--config".into(),
            config.into(),
        ];
        let mut cmd = mounts.command(e, e.dir(), &argv);
        if let Some(dir) = &bins.bin_dir {
            let path = super::tool_path(e);
            let dirs = std::iter::once(dir.clone()).chain(std::env::split_paths(&path));
            cmd.env("PATH", std::env::join_paths(dirs).expect("PATH"));
        }
        cmd.env_remove("CRIU_GPU_PLUGIN_CONFIG");
        // containerd's temporary folders in the node's: a restore from a checkpoint image
        // leaves its (empty) mount folder behind otherwise, in the host's /tmp.
        let tmp = d.join("tmp");
        std::fs::create_dir_all(&tmp).expect("containerd's TMPDIR");
        cmd.env("TMPDIR", tmp);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let log = d.join("containerd.log");
        cmd.stdout(std::fs::File::create(&log).expect("containerd log"));
        cmd.stderr(std::fs::File::create(&log).expect("containerd log"));
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        let child = cmd.spawn().expect("start containerd");
        let daemon = child.id() as i32;
        // Reaped through waitpid(-1), never by std.
        drop(child);
        let c = Containerd {
            e,
            daemon,
            mounts,
            sock,
            runc_root,
            log,
            ctr: bins.ctr,
            runc: bins.runc,
            cgroup: Cgroup::new(),
            containers: Default::default(),
            _short: short,
        };
        // containerd listens once every plugin is loaded, so a connect says it serves. Polled
        // with a connect, not `ctr`: under the guest's TCG one `ctr` takes up to 25 s to start.
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::os::unix::net::UnixStream::connect(&c.sock).is_err() {
            assert!(
                Instant::now() < deadline && common::exists(daemon),
                "containerd did not come up: {}",
                std::fs::read_to_string(&c.log).unwrap_or_default()
            );
            reap_now();
            std::thread::sleep(Duration::from_millis(100));
        }
        let version = c.ctr(&["version"]);
        assert!(
            version.ok(),
            "containerd does not answer: {}",
            std::fs::read_to_string(&c.log).unwrap_or_default()
        );
        c
    }

    /// The daemon's pid (its mount namespace is the node's).
    pub fn pid(&self) -> i32 {
        self.daemon
    }

    pub fn ctr(&self, args: &[&str]) -> ToolRun {
        self.exec(args, false)
    }

    /// The daemon's gRPC socket (its CRI's too).
    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// `ctr` in containerd namespace `ns` (the CRI's is `k8s.io`).
    #[allow(dead_code)] // Used by tests/e2e_cri.rs only.
    pub fn ctr_in(&self, ns: &str, args: &[&str]) -> ToolRun {
        self.exec_in(ns, args, false)
    }

    fn exec(&self, args: &[&str], cleanup: bool) -> ToolRun {
        self.exec_in(CTR_NAMESPACE, args, cleanup)
    }

    fn exec_in(&self, ns: &str, args: &[&str], cleanup: bool) -> ToolRun {
        let mut argv: Vec<OsString> = vec![
            self.ctr.clone().into(),
            "--address".into(),
            self.sock.clone().into(),
            "--namespace".into(),
            ns.into(),
        ];
        argv.extend(args.iter().map(OsString::from));
        let what = describe(&argv);
        let cmd = self.mounts.command(self.e, self.e.dir(), &argv);
        if cleanup {
            run_cleanup(self.e.dir(), cmd, &what)
        } else {
            run_tool(self.e.dir(), cmd, &what)
        }
    }

    pub fn import_image(&self) {
        let archive = oci_archive(self.e);
        self.ctr(&["image", "import", archive.to_str().expect("UTF-8 path")])
            .assert_ok();
    }

    /// `ctr run -d` of `workload` as container `name`: host network (no network namespace),
    /// stdio on /dev/null, the output directory at `/out`, runc's state under the test.
    pub fn start_container(&'e self, name: &str, workload: Workload) -> CtrContainer<'e> {
        let out = Output::new(self.e.dir().join(format!("out-{name}")), workload);
        let mount = format!(
            "type=bind,src={},dst=/out,options=rbind:rw",
            out.dir.display()
        );
        let cgroup = format!("{}/{name}", self.cgroup.path);
        let runc_root = self.runc_root.to_str().expect("UTF-8 path");
        let mut args: Vec<String> = [
            "run",
            "-d",
            "--null-io",
            "--net-host",
            "--cgroup",
            &cgroup,
            "--runc-root",
            runc_root,
            "--mount",
            &mount,
        ]
        .map(String::from)
        .to_vec();
        if let Some(runc) = &self.runc {
            args.extend(["--runc-binary".to_string(), runc.display().to_string()]);
        }
        for env in workload.env() {
            args.extend(["--env".to_string(), env]);
        }
        args.extend([IMAGE.to_string(), name.to_string()]);
        args.extend(workload.args());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.containers.borrow_mut().push(name.to_string());
        let c = CtrContainer {
            cd: self,
            name: name.to_string(),
            out,
        };
        self.ctr(&args).assert_ok();
        c.out.wait_ready();
        c
    }
}

impl Drop for Containerd<'_> {
    fn drop(&mut self) {
        for name in self.containers.borrow().iter() {
            self.exec(&["task", "kill", "-s", "KILL", name], true);
            self.exec(&["task", "delete", "-f", name], true);
            self.exec(&["container", "delete", name], true);
        }
        common::signal(self.daemon, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while common::exists(self.daemon) && Instant::now() < deadline {
            reap_now();
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill_now();
    }
}

impl Containerd<'_> {
    /// SIGKILL to the daemon and its shims (as when the machine is lost), reaped.
    pub fn kill_now(&self) {
        common::signal(self.daemon, libc::SIGKILL);
        // Shims outlive the daemon by design: each of ours names the daemon's socket.
        let sock = self.sock.to_string_lossy().into_owned();
        let mut shims = Vec::new();
        for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&sock) && pid != self.daemon {
                common::signal(pid, libc::SIGKILL);
                shims.push(pid);
            }
        }
        shims.push(self.daemon);
        let _ = common::reap_until_gone(&shims, common::WAIT);
    }
}

pub struct CtrContainer<'e> {
    cd: &'e Containerd<'e>,
    pub name: String,
    pub out: Output,
}

impl CtrContainer<'_> {
    /// The host pid of the running task, from `ctr task ls`.
    pub fn pid(&self) -> Option<i32> {
        let run = self.cd.ctr(&["task", "ls"]);
        run.stdout.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next()? == self.name).then_some(())?;
            let pid = it.next()?.parse().ok()?;
            (it.next()? == "RUNNING").then_some(pid)
        })
    }

    pub fn running_pid(&self) -> i32 {
        self.pid()
            .unwrap_or_else(|| panic!("task {} is not running", self.name))
    }

    /// `ctr task checkpoint --image-path images --work-path work`: a dump that leaves the task
    /// running, with CRIU's dump.log in `work`.
    pub fn task_checkpoint(&self, images: &Path, work: &Path) -> CriuRun {
        std::fs::create_dir_all(images).expect("image directory");
        std::fs::create_dir_all(work).expect("work directory");
        let run = self.cd.ctr(&[
            "task",
            "checkpoint",
            "--image-path",
            images.to_str().unwrap(),
            "--work-path",
            work.to_str().unwrap(),
            &self.name,
        ]);
        criu_run(&run, &work.join("dump.log"))
    }

    /// `ctr container checkpoint --task --rw` into image `reference` (the task keeps running).
    pub fn checkpoint(&self, reference: &str) -> ToolRun {
        self.cd.ctr(&[
            "container",
            "checkpoint",
            "--task",
            "--rw",
            &self.name,
            reference,
        ])
    }

    /// Kills and deletes the task and the container.
    pub fn remove(&self) {
        let pid = self.pid();
        self.cd
            .ctr(&["task", "kill", "-s", "KILL", &self.name])
            .assert_ok();
        if let Some(p) = pid {
            super::wait_gone(p, "the killed task");
        }
        wait_until(format!("task {} stopped", self.name), || {
            reap_now();
            self.cd.ctr(&["task", "delete", &self.name]).ok()
                || !self.cd.ctr(&["task", "ls"]).stdout.contains(&self.name)
        });
        self.cd
            .ctr(&["container", "delete", &self.name])
            .assert_ok();
    }

    /// `ctr container restore --live --rw` from image `reference`.
    pub fn restore(&self, reference: &str) -> ToolRun {
        self.cd.ctr(&[
            "container",
            "restore",
            "--live",
            "--rw",
            &self.name,
            reference,
        ])
    }

    pub fn exists(&self) -> bool {
        self.cd
            .ctr(&["container", "ls", "-q"])
            .stdout
            .lines()
            .any(|l| l.trim() == self.name)
    }

    /// The container's checkpoint image `reference` (the task keeps running), the container
    /// removed, then restored from it: the workload resumes where the checkpoint left it and,
    /// for a CUDA one (`files`: its device files), has its device memory back, verified, the
    /// driver's last calls for it (log `calls`) a restore and an unlock.
    pub fn checkpoint_remove_restore(
        &self,
        reference: &str,
        files: Option<Vec<String>>,
        calls: &Path,
    ) {
        let low = self.out.mark();
        self.checkpoint(reference).assert_ok();
        let high = self.out.mark();
        self.remove();
        assert!(!self.exists(), "container {} after its removal", self.name);
        let killed = self.out.mark();
        self.restore(reference).assert_ok();
        let restored = self.running_pid();
        self.out.assert_resumes_between(low, high, killed);
        if let Some(files) = files {
            self.out.assert_gpu_restored(&files, calls, restored);
        }
    }
}
