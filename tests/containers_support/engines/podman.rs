//! Podman (with runc or another OCI runtime, and conmon), its state under the test's directory.

use super::*;

/// Which Podman, conmon and OCI runtime: Debian 12's (Podman 4.3 with its conmon and runc from
/// the system), or today's ([`PodmanBins::v2026`]).
#[derive(Clone, Debug)]
pub struct PodmanBins {
    pub podman: PathBuf,
    /// `--conmon`; Podman's own choice (the system's) otherwise.
    pub conmon: Option<PathBuf>,
    /// `--runtime`: a name Podman looks up, or a path.
    pub runtime: PathBuf,
    /// A prefix whose `etc/containers`, `usr/share/containers` (containers-common's
    /// configuration) and `usr/lib/podman` (netavark) the commands see in the system's places.
    pub prefix: Option<PathBuf>,
    /// The commands see a cgroup-v2-only system ([`PrivateMounts::cgroup2_only`]).
    pub cgroup2_only: bool,
}

impl PodmanBins {
    /// Debian 12's Podman 4.3 with runc 1.1.
    pub fn system() -> PodmanBins {
        PodmanBins {
            podman: system_tool("podman"),
            conmon: None,
            runtime: "runc".into(),
            prefix: None,
            cgroup2_only: false,
        }
    }

    /// Today's: Podman 5.8 (`CRIU_GPU_TEST_PODMAN2`) with conmon (`CRIU_GPU_TEST_CONMON2`) and
    /// the containers configuration and netavark of `<repo>/.runtimes-2026`, running `runtime`.
    pub fn v2026(runtime: PathBuf) -> PodmanBins {
        PodmanBins {
            podman: super::super::tool_2026("CRIU_GPU_TEST_PODMAN2", "bin/podman"),
            conmon: Some(super::super::tool_2026(
                "CRIU_GPU_TEST_CONMON2",
                "bin/conmon",
            )),
            runtime,
            prefix: Some(Path::new(crate::common::REPO).join(".runtimes-2026")),
            cgroup2_only: false,
        }
    }

    /// Podman 6.1 (`CRIU_GPU_TEST_PODMAN61`, default `<repo>/.runtimes-2026/podman-6.1/podman`)
    /// with what [`PodmanBins::v2026`] gives Podman 5.8, on a cgroup-v2-only system: Podman 6
    /// refuses cgroup v1.
    pub fn v6_1(runtime: PathBuf) -> PodmanBins {
        PodmanBins {
            podman: super::super::tool_2026("CRIU_GPU_TEST_PODMAN61", "podman-6.1/podman"),
            cgroup2_only: true,
            ..PodmanBins::v2026(runtime)
        }
    }

    /// The first line of `--version` of Podman, conmon and the runtime (for the test's log).
    pub fn versions(&self) -> String {
        let mut v = vec![super::super::version_line(&self.podman)];
        if let Some(c) = &self.conmon {
            v.push(super::super::version_line(c));
        }
        if self.runtime.is_absolute() {
            v.push(super::super::version_line(&self.runtime));
        }
        v.join("; ")
    }
}

/// Podman with runc, cgroupfs and file events (no systemd here), its storage (vfs), run and tmp
/// directories, runc's state and its image cache directory (`/var/lib/containers`, which
/// `--root` does not move) in the test's directory.
pub struct Podman<'e> {
    pub e: &'e E2e,
    bin: PathBuf,
    root: PathBuf,
    mounts: PrivateMounts,
    globals: Vec<OsString>,
    /// `CONTAINERS_CONF_OVERRIDE` of every command.
    conf_override: Option<PathBuf>,
    pub cgroup: Cgroup,
    /// Removed after the engine's clean-up.
    _runroot: TempDir,
}

impl<'e> Podman<'e> {
    /// Debian 12's Podman whose commands see `etc_criu` as `/etc/criu`.
    pub fn new(e: &'e E2e, etc_criu: &Path) -> Podman<'e> {
        Podman::with_bins(e, etc_criu, PodmanBins::system())
    }

    /// [`Podman::new`] of the Podman (conmon, runtime) `bins`.
    pub fn with_bins(e: &'e E2e, etc_criu: &Path, bins: PodmanBins) -> Podman<'e> {
        let d = e.dir().join("podman");
        let [root, tmp, runc, cache, networks] =
            ["root", "tmp", "runc", "var-lib-containers", "networks"].map(|s| d.join(s));
        // Podman refuses a run root longer than 50 characters (conmon's socket paths live
        // there): a short directory of the test's under /tmp.
        let short = TempDir::new_in(Path::new("/tmp"), "pm");
        let runroot = short.path().to_path_buf();
        for p in [&root, &runroot, &tmp, &runc, &cache, &networks] {
            std::fs::create_dir_all(p).expect("podman directory");
        }
        // runc's state is given with --runtime-flag, which the clean-up command conmon runs
        // when a container exits (`podman container cleanup`) does not get: the same directory
        // at runc's default place, for that one.
        let mut mounts = PrivateMounts::new()
            .cgroup2_only(bins.cgroup2_only)
            .bind(etc_criu, "/etc/criu")
            .bind(&cache, "/var/lib/containers")
            .bind(&runc, "/run/runc");
        if let Some(prefix) = &bins.prefix {
            for dir in ["etc/containers", "usr/share/containers", "usr/lib/podman"] {
                mounts = mounts.bind(prefix.join(dir), Path::new("/").join(dir));
            }
        }
        let mut globals: Vec<OsString> = Vec::new();
        for (k, v) in [
            ("--root", root.as_os_str()),
            ("--runroot", runroot.as_os_str()),
            ("--tmpdir", tmp.as_os_str()),
            // Else its CNI lock file lands in /etc/cni/net.d.
            ("--network-config-dir", networks.as_os_str()),
            ("--runtime", bins.runtime.as_os_str()),
        ] {
            globals.push(k.into());
            globals.push(v.to_owned());
        }
        if let Some(conmon) = &bins.conmon {
            globals.push("--conmon".into());
            globals.push(conmon.into());
        }
        for a in [
            "--storage-driver",
            "vfs",
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "file",
        ] {
            globals.push(a.into());
        }
        globals.push(format!("--runtime-flag=root={}", runc.display()).into());
        // The cgroup-v2-only view has no pids controller (the host binds it to v1), and
        // Podman's default limit of 2048 tasks makes runc write a pids.max that is not there.
        // `--pids-limit 0` still puts a limit of 0 in the spec (which runc writes as "max");
        // the configuration's 0 leaves it out.
        let conf_override = bins.cgroup2_only.then(|| {
            let f = d.join("containers-override.conf");
            std::fs::write(&f, "[containers]\npids_limit = 0\n").expect("containers.conf override");
            f
        });
        Podman {
            e,
            bin: bins.podman,
            root,
            mounts,
            globals,
            conf_override,
            cgroup: Cgroup::new(),
            _runroot: short,
        }
    }

    pub fn run(&self, args: &[&str]) -> ToolRun {
        self.exec(args, false)
    }

    fn exec(&self, args: &[&str], cleanup: bool) -> ToolRun {
        let mut argv: Vec<OsString> = vec![self.bin.clone().into()];
        argv.extend(self.globals.iter().cloned());
        argv.extend(args.iter().map(OsString::from));
        let what = describe(&argv);
        let mut cmd = self.mounts.command(self.e, self.e.dir(), &argv);
        // Podman's image copies use TMPDIR (default /var/tmp).
        cmd.env("TMPDIR", self.e.dir().join("podman/tmp"));
        if let Some(f) = &self.conf_override {
            cmd.env("CONTAINERS_CONF_OVERRIDE", f);
        }
        // The plugin reads /etc/criu/gpu-plugin.conf: Podman's environment may not reach CRIU.
        cmd.env_remove("CRIU_GPU_PLUGIN_CONFIG");
        if cleanup {
            run_cleanup(self.e.dir(), cmd, &what)
        } else {
            run_tool(self.e.dir(), cmd, &what)
        }
    }

    pub fn import_image(&self) {
        let tar = rootfs_tar(self.e).to_str().expect("UTF-8 path").to_string();
        self.run(&["import", &tar, IMAGE]).assert_ok();
    }

    /// `podman run -d` of `workload` as container `name`: the host's network (no network
    /// namespace), the output directory at `/out`, rlimits within what the host allows (runc
    /// fails to raise them to Podman's defaults on the test VMs).
    pub fn start(&'e self, name: &str, workload: Workload) -> PodmanContainer<'e> {
        let out = Output::new(self.e.dir().join(format!("out-{name}")), workload);
        let vol = format!("{}:/out", out.dir.display());
        let mut args: Vec<String> = [
            "run",
            "-d",
            "--name",
            name,
            "--network",
            "host",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=4096:4096",
            "--cgroup-parent",
            &self.cgroup.path,
            "-v",
            &vol,
        ]
        .map(String::from)
        .to_vec();
        for env in workload.env() {
            args.extend(["-e".to_string(), env]);
        }
        args.push(IMAGE.into());
        args.extend(workload.args());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let c = PodmanContainer {
            pm: self,
            name: name.to_string(),
            out,
        };
        self.run(&args).assert_ok();
        c.out.wait_ready();
        c
    }

    /// CRIU's log `name` (dump.log, restore.log) in the container directory of the engine's
    /// one container (runc runs CRIU with it as the work directory).
    fn criu_log(&self, name: &str) -> PathBuf {
        std::fs::read_dir(self.root.join("vfs-containers"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("userdata").join(name))
            .find(|p| p.is_file())
            .unwrap_or_else(|| self.root.join("no-such-log"))
    }
}

impl Drop for Podman<'_> {
    fn drop(&mut self) {
        self.exec(&["rm", "-a", "-f", "-t", "0"], true);
        self.exec(&["rmi", "-a", "-f"], true);
        reap_now();
    }
}

pub struct PodmanContainer<'e> {
    pm: &'e Podman<'e>,
    pub name: String,
    pub out: Output,
}

impl PodmanContainer<'_> {
    /// The host pid of the container's init.
    pub fn pid(&self) -> i32 {
        let run = self
            .pm
            .run(&["inspect", "--format", "{{.State.Pid}}", &self.name]);
        run.assert_ok();
        run.stdout
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{run:?}"))
    }

    pub fn exists(&self) -> bool {
        self.pm.run(&["container", "exists", &self.name]).ok()
    }

    /// `container checkpoint --export archive` (gzip, so that checkpointctl reads it).
    pub fn checkpoint_export(&self, archive: &Path) -> CriuRun {
        let a = archive.to_str().expect("UTF-8 path");
        let run = self.pm.run(&[
            "container",
            "checkpoint",
            "--keep",
            "--export",
            a,
            "--compress",
            "gzip",
            &self.name,
        ]);
        criu_run(&run, &self.pm.criu_log("dump.log"))
    }

    pub fn rm(&self) {
        self.pm
            .run(&["rm", "-f", "-t", "0", &self.name])
            .assert_ok();
        reap_now();
    }

    /// `container restore --import archive`.
    pub fn restore_import(&self, archive: &Path) -> CriuRun {
        let a = archive.to_str().expect("UTF-8 path");
        let run = self
            .pm
            .run(&["container", "restore", "--keep", "--import", a]);
        criu_run(&run, &self.pm.criu_log("restore.log"))
    }
}
