//! docker (`dockerd --experimental`, for `docker checkpoint`) with all of its state under the
//! test's directory: data-root, exec-root, socket, configuration, the containerd it starts
//! itself; no bridge, no iptables (containers use the host's network). The daemon, and with it
//! its containerd, shims, runc and CRIU, runs in the test's [`PrivateMounts`].
//!
//! docker names no CRIU work directory and removes the one containerd gives runc: the test's
//! CRIU configuration file names CRIU's log file instead ([`Docker::criu_log_to`]).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::engines::IMAGE;
use super::{
    Cgroup, Output, PrivateMounts, ToolRun, Workload, describe, reap_now, rootfs_tar, run_cleanup,
    run_tool, tool_2026,
};
use crate::common::{self, E2e, TempDir, wait_until};

/// dockerd (`CRIU_GPU_TEST_DOCKERD2`) and its client (`CRIU_GPU_TEST_DOCKER2`), by default from
/// `<repo>/.runtimes-2026/bin`, where dockerd also finds containerd, its shim and runc.
#[derive(Clone, Debug)]
pub struct DockerBins {
    pub dockerd: PathBuf,
    pub docker: PathBuf,
}

impl DockerBins {
    pub fn v2026() -> DockerBins {
        DockerBins {
            dockerd: tool_2026("CRIU_GPU_TEST_DOCKERD2", "bin/dockerd"),
            docker: tool_2026("CRIU_GPU_TEST_DOCKER2", "bin/docker"),
        }
    }
}

/// A docker daemon of the test's own.
pub struct Docker<'e> {
    pub e: &'e E2e,
    /// The `unshare` whose exec became the daemon.
    daemon: i32,
    docker: PathBuf,
    sock: PathBuf,
    /// The client's configuration directory (`DOCKER_CONFIG`).
    client_config: PathBuf,
    /// The CRIU configuration file CRIU reads (`runc.conf` of the test's `/etc/criu`).
    criu_conf: PathBuf,
    criu_conf_base: String,
    log: PathBuf,
    pub cgroup: Cgroup,
    containers: std::cell::RefCell<Vec<String>>,
    /// Holds the socket and exec-root; removed after the daemon is gone.
    short: TempDir,
}

impl<'e> Docker<'e> {
    /// Starts dockerd with `etc_criu` (holding `runc.conf`) as its `/etc/criu`.
    pub fn start(e: &'e E2e, etc_criu: &Path, bins: DockerBins) -> Docker<'e> {
        let d = e.dir().join("docker");
        let [data, run, client] = ["data", "run-docker", "client"].map(|s| d.join(s));
        for p in [&data, &run, &client] {
            std::fs::create_dir_all(p).expect("docker directory");
        }
        // Unix socket paths have at most 107 bytes: socket and exec-root (containerd's sockets
        // live there) in a short directory of the test's under /tmp.
        let short = TempDir::new_in(Path::new("/tmp"), "dk");
        let sock = short.join("docker.sock");
        let exec_root = short.join("x");
        let config = d.join("daemon.json");
        std::fs::write(&config, "{}\n").expect("daemon.json");
        let cgroup = Cgroup::new();
        let bin_dir = bins
            .dockerd
            .parent()
            .expect("dockerd's directory")
            .to_path_buf();
        let mut argv: Vec<OsString> = vec![bins.dockerd.clone().into(), "--experimental".into()];
        let pidfile = d.join("docker.pid");
        for (k, v) in [
            ("--data-root", &data),
            ("--exec-root", &exec_root),
            ("--pidfile", &pidfile),
            ("--config-file", &config),
        ] {
            argv.push(format!("{k}={}", v.display()).into());
        }
        argv.push(format!("--host=unix://{}", sock.display()).into());
        argv.push(format!("--cgroup-parent={}", cgroup.path).into());
        for a in [
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            "--storage-driver=vfs",
            "--exec-opt=native.cgroupdriver=cgroupfs",
            "--userland-proxy=false",
        ] {
            argv.push(a.into());
        }
        // /run/docker holds its plugin and network sockets whatever the exec-root.
        let mounts = PrivateMounts::new()
            .bind(etc_criu, "/etc/criu")
            .bind(&run, "/run/docker");
        let mut cmd = mounts.command(e, e.dir(), &argv);
        let path = super::tool_path(e);
        let dirs = std::iter::once(bin_dir).chain(std::env::split_paths(&path));
        cmd.env("PATH", std::env::join_paths(dirs).expect("PATH"));
        cmd.env_remove("CRIU_GPU_PLUGIN_CONFIG");
        let log = d.join("dockerd.log");
        cmd.stdout(std::fs::File::create(&log).expect("dockerd log"));
        cmd.stderr(std::fs::File::create(&log).expect("dockerd log"));
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        let child = cmd.spawn().expect("start dockerd");
        let daemon = child.id() as i32;
        // Reaped through waitpid(-1), never by std.
        drop(child);
        let criu_conf = etc_criu.join("runc.conf");
        let criu_conf_base = std::fs::read_to_string(&criu_conf).expect("runc.conf");
        let dk = Docker {
            e,
            daemon,
            docker: bins.docker,
            sock,
            client_config: client,
            criu_conf,
            criu_conf_base,
            log,
            cgroup,
            containers: Default::default(),
            short,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !dk.docker(&["version"]).ok() {
            assert!(
                Instant::now() < deadline && common::exists(daemon),
                "dockerd did not come up: {}",
                std::fs::read_to_string(&dk.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        dk
    }

    pub fn docker(&self, args: &[&str]) -> ToolRun {
        self.exec(args, false)
    }

    fn exec(&self, args: &[&str], cleanup: bool) -> ToolRun {
        let mut argv: Vec<OsString> = vec![
            self.docker.clone().into(),
            "--host".into(),
            format!("unix://{}", self.sock.display()).into(),
        ];
        argv.extend(args.iter().map(OsString::from));
        let what = describe(&argv);
        let mut cmd = self.e.command(&self.docker);
        cmd.args(&argv[1..])
            .env("DOCKER_CONFIG", &self.client_config);
        if cleanup {
            run_cleanup(self.e.dir(), cmd, &what)
        } else {
            run_tool(self.e.dir(), cmd, &what)
        }
    }

    /// CRIU's next runs log to `log` (a `log-file` line in the CRIU configuration file, which
    /// overrides what runc asks for).
    pub fn criu_log_to(&self, log: &Path) {
        std::fs::write(
            &self.criu_conf,
            format!("{}log-file {}\n", self.criu_conf_base, log.display()),
        )
        .expect("runc.conf");
    }

    pub fn import_image(&self) {
        let tar = rootfs_tar(self.e).to_str().expect("UTF-8 path").to_string();
        self.docker(&["import", &tar, IMAGE]).assert_ok();
    }

    /// `docker run -d` of `workload` as container `name`: the host's network, the output
    /// directory at `/out`, rlimits within what the host allows.
    pub fn start_container(&'e self, name: &str, workload: Workload) -> DockerContainer<'e> {
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
        self.containers.borrow_mut().push(name.to_string());
        let c = DockerContainer {
            dk: self,
            name: name.to_string(),
            out,
        };
        self.docker(&args).assert_ok();
        c.out.wait_ready();
        c
    }
}

impl Drop for Docker<'_> {
    fn drop(&mut self) {
        for name in self.containers.borrow().iter() {
            self.exec(&["rm", "-f", name], true);
        }
        common::signal(self.daemon, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while common::exists(self.daemon) && Instant::now() < deadline {
            reap_now();
            std::thread::sleep(Duration::from_millis(20));
        }
        common::signal(self.daemon, libc::SIGKILL);
        // Its containerd and shims name the exec-root (the daemon stops them when it can).
        let root = self.short.path().to_string_lossy().into_owned();
        let mut left = vec![self.daemon];
        for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            if pid != self.daemon && String::from_utf8_lossy(&cmdline).contains(&root) {
                common::signal(pid, libc::SIGKILL);
                left.push(pid);
            }
        }
        let _ = common::reap_until_gone(&left, common::WAIT);
        // vfs layers and containerd's mounts under the data root are the daemon's; it is gone.
        let _ = std::fs::remove_dir_all(self.e.dir().join("docker/data"));
    }
}

pub struct DockerContainer<'e> {
    dk: &'e Docker<'e>,
    pub name: String,
    pub out: Output,
}

impl DockerContainer<'_> {
    /// The host pid of the running container's init; `None` when it does not run.
    pub fn pid(&self) -> Option<i32> {
        let run = self.dk.docker(&[
            "inspect",
            "--format",
            "{{.State.Running}} {{.State.Pid}}",
            &self.name,
        ]);
        let s = run.stdout.trim().to_string();
        let (running, pid) = s.split_once(' ')?;
        (running == "true").then(|| pid.parse().ok()).flatten()
    }

    pub fn running_pid(&self) -> i32 {
        self.pid()
            .unwrap_or_else(|| panic!("container {} is not running", self.name))
    }

    /// `docker checkpoint create NAME CHECKPOINT` (the container stops), CRIU's log in `log`.
    pub fn checkpoint(&self, checkpoint: &str, log: &Path) -> crate::common::CriuRun {
        self.dk.criu_log_to(log);
        let run = self
            .dk
            .docker(&["checkpoint", "create", &self.name, checkpoint]);
        super::criu_run(&run, log)
    }

    /// `docker start --checkpoint CHECKPOINT NAME`, CRIU's log in `log`. docker's containerd
    /// now and then reports "content ... already exists" when docker uploads the checkpoint to
    /// it (a race of docker with containerd, before CRIU runs): tried again then, after a
    /// pause, up to four times in all (a second try passed in most runs, not in every one).
    pub fn start_from(&self, checkpoint: &str, log: &Path) -> crate::common::CriuRun {
        self.dk.criu_log_to(log);
        let start = || {
            self.dk
                .docker(&["start", "--checkpoint", checkpoint, &self.name])
        };
        let mut run = start();
        for _ in 1..4 {
            if run.ok() || !run.stderr.contains("already exists") {
                break;
            }
            eprintln!(
                "docker start --checkpoint: {}; again in a second",
                run.stderr.trim()
            );
            std::thread::sleep(std::time::Duration::from_secs(1));
            run = start();
        }
        super::criu_run(&run, log)
    }

    /// Waits until docker sees the container stopped (after a checkpoint).
    pub fn wait_stopped(&self) {
        wait_until(format!("container {} stopped", self.name), || {
            reap_now();
            self.pid().is_none()
        });
    }
}
