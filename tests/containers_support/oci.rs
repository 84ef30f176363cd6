//! runc and crun driven directly: an OCI bundle per container on the shared root file system,
//! state under the test's directory (`--root`), every command through the test's
//! [`PrivateMounts`]. Containers get their own mount, pid and IPC namespaces and none for the
//! network: the stand-in CUDA driver talks over abstract unix sockets, which are per network
//! namespace, and CRIU needs no network lock (no iptables) then.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::cdi::OciEdits;
use super::{
    Cgroup, Output, PrivateMounts, ToolRun, Workload, criu_run, describe, private_tool, reap_now,
    rootfs, run_cleanup, run_tool, run_tool_detached, system_tool, wait_gone,
};
use crate::common::{CriuRun, E2e, wait_until};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Oci {
    Runc,
    Crun,
}

/// A JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_list(items: &[String]) -> String {
    let v: Vec<String> = items.iter().map(|s| json_str(s)).collect();
    format!("[{}]", v.join(", "))
}

/// The bundle's `config.json`: `workload` on the shared root file system (read-only), stdio
/// from the runtime (/dev/null: CRIU cannot dump a host file as a container's stdio), the host
/// directory `out` at `/out`, cgroup `cgroup`, `annotations`, and `edits` (devices, mounts,
/// hooks, environment: `cdi.rs`).
pub fn config_json(
    workload: Workload,
    out: &Path,
    cgroup: &str,
    annotations: &[(String, String)],
    edits: &OciEdits,
) -> String {
    let ann: Vec<String> = annotations
        .iter()
        .map(|(k, v)| format!("{}: {}", json_str(k), json_str(v)))
        .collect();
    let caps = json_list(&["CAP_KILL".to_string()]);
    format!(
        r#"{{
  "ociVersion": "1.0.2",
  "process": {{
    "terminal": false,
    "user": {{"uid": 0, "gid": 0}},
    "args": {args},
    "env": {env},
    "cwd": "/",
    "capabilities": {{"bounding": {caps}, "effective": {caps}, "permitted": {caps}}},
    "rlimits": [{{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}}],
    "noNewPrivileges": true
  }},
  "root": {{"path": {root}, "readonly": true}},
  "mounts": [
    {{"destination": "/proc", "type": "proc", "source": "proc"}},
    {{"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
      "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}},
    {{"destination": "/dev/pts", "type": "devpts", "source": "devpts",
      "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}},
    {{"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
      "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}},
    {{"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
      "options": ["nosuid", "noexec", "nodev"]}},
    {{"destination": "/out", "type": "bind", "source": {out}, "options": ["rbind", "rw"]}}{mounts}
  ],
  "annotations": {{{ann}}},
  "linux": {{
    "cgroupsPath": {cgroup},
    "namespaces": [{{"type": "pid"}}, {{"type": "ipc"}}, {{"type": "mount"}}],
    "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list"],
    "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]{linux}
  }}{hooks}
}}
"#,
        args = json_list(&workload.args()),
        env = json_list(&[workload.env(), edits.env.clone()].concat()),
        mounts = edits.mounts_json(),
        linux = edits.linux_json(),
        hooks = edits.hooks_json(),
        root = json_str(rootfs().to_str().expect("UTF-8 path")),
        out = json_str(out.to_str().expect("UTF-8 path")),
        cgroup = json_str(cgroup),
        ann = ann.join(", "),
    )
}

/// One OCI runtime program as a test uses it.
pub struct OciRuntime<'e> {
    pub e: &'e E2e,
    pub kind: Oci,
    bin: PathBuf,
    /// `--root`: the runtime's container state.
    state: PathBuf,
    mounts: PrivateMounts,
    env: Vec<(String, OsString)>,
    unset: Vec<String>,
    /// Every command refuses to run outside a pid namespace of the test's own
    /// ([`OciRuntime::only_in_own_pid_namespace`]).
    own_pid_namespace: bool,
}

impl<'e> OciRuntime<'e> {
    /// `kind` (Debian 12's runc, or crun from `.runtimes`) with `mounts` around every command.
    pub fn new(e: &'e E2e, kind: Oci, mounts: PrivateMounts) -> OciRuntime<'e> {
        let bin = match kind {
            Oci::Runc => system_tool("runc"),
            Oci::Crun => private_tool("crun"),
        };
        OciRuntime::with_program(e, kind, bin, mounts)
    }

    /// Program `bin`, a runtime of `kind`, with `mounts` around every command.
    pub fn with_program(
        e: &'e E2e,
        kind: Oci,
        bin: PathBuf,
        mut mounts: PrivateMounts,
    ) -> OciRuntime<'e> {
        if kind == Oci::Crun {
            // On a hybrid host (v1 controllers, plus a v2 hierarchy that still offers one, e.g.
            // hugetlb) crun (1.21, 1.28) stops with "cgroups in hybrid mode not supported, drop
            // all controllers from cgroupv2": an empty controllers file over the v2 one, in the
            // private namespace only.
            let ctl = Path::new("/sys/fs/cgroup/unified/cgroup.controllers");
            if ctl.exists() {
                let empty = e.dir().join("empty-cgroup.controllers");
                std::fs::write(&empty, "").expect("empty file");
                mounts = mounts.bind(empty, ctl);
            }
        }
        let state = e.dir().join(format!("{kind:?}-state").to_lowercase());
        std::fs::create_dir_all(&state).expect("runtime state directory");
        OciRuntime {
            e,
            kind,
            bin,
            state,
            mounts,
            env: Vec::new(),
            unset: Vec::new(),
            own_pid_namespace: false,
        }
    }

    /// Every command of this runtime panics unless the test runs as the init of a pid
    /// namespace of its own ([`super::pidns`]): for a runtime whose restore signals every
    /// process it can (crun 1.28, `docs/crun-restore-kills.md`), so that at worst the test's
    /// own namespace goes, never the machine.
    pub fn only_in_own_pid_namespace(mut self) -> Self {
        self.own_pid_namespace = true;
        self
    }

    /// The first line of `PROGRAM --version` (for the test's log).
    pub fn version(&self) -> String {
        super::version_line(&self.bin)
    }

    /// An environment variable for every command (and so for CRIU, which runc and crun start
    /// with their own environment).
    pub fn env(mut self, k: &str, v: impl Into<OsString>) -> Self {
        self.env.push((k.to_string(), v.into()));
        self
    }

    /// Leaves `k` out of every command's environment.
    pub fn unset(mut self, k: &str) -> Self {
        self.unset.push(k.to_string());
        self
    }

    fn command(&self, args: &[&str]) -> (std::process::Command, String) {
        assert!(
            !self.own_pid_namespace || super::pidns::in_own_pid_namespace(),
            "refusing to run {} {args:?} outside a pid namespace of the test's own: its restore \
             signals every process it can (docs/crun-restore-kills.md)",
            self.bin.display()
        );
        // A pid namespace would not hold that restore back from removing every empty cgroup
        // of the machine: no crun at all on such a host.
        if self.kind == Oci::Crun
            && let Some(why) = super::pidns::crun_restore_kills_here()
        {
            panic!(
                "refusing to run crun on this host: {why}, and crun's restore would then kill \
                 every process it can see and remove every empty cgroup \
                 (docs/crun-restore-kills.md)"
            );
        }
        let mut argv: Vec<OsString> = vec![self.bin.clone().into(), "--root".into()];
        argv.push(self.state.clone().into());
        argv.extend(args.iter().map(OsString::from));
        let what = describe(&argv);
        let mut cmd = self.mounts.command(self.e, self.e.dir(), &argv);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        for k in &self.unset {
            cmd.env_remove(k);
        }
        (cmd, what)
    }

    pub fn run(&self, args: &[&str]) -> ToolRun {
        let (cmd, what) = self.command(args);
        run_tool(self.e.dir(), cmd, &what)
    }

    fn cleanup(&self, args: &[&str]) -> ToolRun {
        let (cmd, what) = self.command(args);
        run_cleanup(self.e.dir(), cmd, &what)
    }

    /// A command whose stdio the container gets, with the runtime's messages in `log`.
    fn detached_command(&self, log: &Path, args: &[&str]) -> (std::process::Command, String) {
        let mut all = vec!["--log", log.to_str().expect("UTF-8 path")];
        all.extend_from_slice(args);
        self.command(&all)
    }

    /// Runs a [`OciRuntime::detached_command`]: stdio on /dev/null, `log` as its stderr.
    fn run_detached(&self, log: &Path, (cmd, what): (std::process::Command, String)) -> ToolRun {
        let mut run = run_tool_detached(self.e.dir(), cmd, &what);
        run.stderr = std::fs::read_to_string(log).unwrap_or_default();
        run
    }

    /// Starts `workload` in container `name`, with `annotations`; `peer`, when given, becomes
    /// the container process's fd 3 (`--preserve-fds 1`).
    pub fn start(
        &'e self,
        name: &str,
        workload: Workload,
        annotations: &[(String, String)],
        peer: Option<OwnedFd>,
    ) -> OciContainer<'e> {
        self.start_with(name, workload, annotations, &OciEdits::default(), peer)
    }

    /// [`OciRuntime::start`] with `edits` in the container's spec.
    pub fn start_with(
        &'e self,
        name: &str,
        workload: Workload,
        annotations: &[(String, String)],
        edits: &OciEdits,
        peer: Option<OwnedFd>,
    ) -> OciContainer<'e> {
        let bundle = self.e.dir().join(format!("bundle-{name}"));
        std::fs::create_dir_all(&bundle).expect("bundle directory");
        let out = Output::new(self.e.dir().join(format!("out-{name}")), workload);
        let cgroup = Cgroup::new();
        std::fs::write(
            bundle.join("config.json"),
            config_json(workload, &out.dir, &cgroup.path, annotations, edits),
        )
        .expect("config.json");
        let id = format!("criu-gpu-e2e-{}-{name}", crate::common::owner_tag());
        let log = self.e.dir().join(format!("{name}-runtime.log"));
        let b = bundle.to_str().expect("UTF-8 path").to_string();
        let mut args = vec!["run", "-d", "--bundle", &b];
        if peer.is_some() {
            args.extend(["--preserve-fds", "1"]);
        }
        args.push(&id);
        let (mut cmd, what) = self.detached_command(&log, &args);
        if let Some(fd) = &peer {
            let raw = fd.as_raw_fd();
            use std::os::unix::process::CommandExt;
            // SAFETY: the closure runs in the forked child before exec and only calls dup2(2)
            // and fcntl(2), which are async-signal-safe; `raw` stays open in the parent until
            // the spawn is done.
            unsafe {
                cmd.pre_exec(move || {
                    // dup2 onto itself would keep the close-on-exec flag std sets on sockets.
                    let r = if raw == 3 {
                        libc::fcntl(3, libc::F_SETFD, 0)
                    } else {
                        libc::dup2(raw, 3)
                    };
                    if r < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let c = OciContainer {
            rt: self,
            id,
            bundle,
            out,
            annotations: annotations.to_vec(),
            _cgroup: cgroup,
            log,
        };
        let run = self.run_detached(&c.log, (cmd, what));
        drop(peer);
        assert!(run.ok(), "{run:?}");
        c.out.wait_ready();
        c
    }
}

/// A container of an [`OciRuntime`]; killed and deleted on drop.
pub struct OciContainer<'e> {
    rt: &'e OciRuntime<'e>,
    pub id: String,
    pub bundle: PathBuf,
    pub out: Output,
    annotations: Vec<(String, String)>,
    /// Removed after the container (fields drop after `drop`).
    _cgroup: Cgroup,
    log: PathBuf,
}

impl OciContainer<'_> {
    /// (status, host pid of its init) from the runtime's `state`, `None` when it has no such
    /// container.
    pub fn state(&self) -> Option<(String, i32)> {
        let run = self.rt.run(&["state", &self.id]);
        if !run.ok() {
            return None;
        }
        let field = |k: &str| -> Option<String> {
            let rest = run.stdout.split(&format!("\"{k}\":")).nth(1)?;
            Some(
                rest.trim_start()
                    .split([',', '\n', '}'])
                    .next()?
                    .trim()
                    .trim_matches('"')
                    .to_string(),
            )
        };
        Some((field("status")?, field("pid")?.parse().ok()?))
    }

    /// The host pid of the running container's init.
    pub fn pid(&self) -> i32 {
        match self.state() {
            Some((status, pid)) if status == "running" => pid,
            s => panic!("container {} is not running: {s:?}", self.id),
        }
    }

    /// `checkpoint --image-path images --work-path work [--leave-running]`: CRIU's dump.log
    /// lands in `work`.
    pub fn checkpoint(&self, images: &Path, work: &Path, leave_running: bool) -> CriuRun {
        std::fs::create_dir_all(images).expect("image directory");
        std::fs::create_dir_all(work).expect("work directory");
        let (i, w) = (images.to_str().unwrap(), work.to_str().unwrap());
        let mut args = vec!["checkpoint", "--image-path", i, "--work-path", w];
        if leave_running {
            args.push("--leave-running");
        }
        args.push(&self.id);
        let run = self.rt.run(&args);
        criu_run(&run, &work.join("dump.log"))
    }

    /// Rewrites the bundle's spec with `edits` instead (the container restored next is given
    /// other devices, as a new pod would be).
    pub fn respec(&self, edits: &OciEdits) {
        std::fs::write(
            self.bundle.join("config.json"),
            config_json(
                self.out.workload,
                &self.out.dir,
                &self._cgroup.path,
                &self.annotations,
                edits,
            ),
        )
        .expect("config.json");
    }

    /// `restore -d` from `images`, CRIU's restore.log in `work`.
    pub fn restore(&self, images: &Path, work: &Path) -> CriuRun {
        std::fs::create_dir_all(work).expect("work directory");
        let (i, w, b) = (
            images.to_str().unwrap(),
            work.to_str().unwrap(),
            self.bundle.to_str().unwrap(),
        );
        let cmd = self.rt.detached_command(
            &self.log,
            &[
                "restore",
                "-d",
                "--image-path",
                i,
                "--work-path",
                w,
                "--bundle",
                b,
                &self.id,
            ],
        );
        let run = self.rt.run_detached(&self.log, cmd);
        criu_run(&run, &work.join("restore.log"))
    }

    /// After a checkpoint that stopped it: the runtime has no such container any more and its
    /// init (`pid`) is gone.
    pub fn assert_gone(&self, pid: i32) {
        wait_gone(pid, "the checkpointed container's init");
        assert_eq!(
            self.state(),
            None,
            "{:?} still knows container {} after the checkpoint",
            self.rt.kind,
            self.id
        );
    }

    /// Kills the container and deletes it from the runtime.
    pub fn remove(&self) {
        let pid = self.state().map(|(_, p)| p);
        self.rt.run(&["kill", &self.id, "KILL"]);
        if let Some(p) = pid.filter(|&p| p > 0) {
            wait_gone(p, "the killed container's init");
        }
        self.rt.run(&["delete", "-f", &self.id]);
        wait_until(format!("container {} deleted", self.id), || {
            reap_now();
            self.state().is_none()
        });
    }
}

impl Drop for OciContainer<'_> {
    fn drop(&mut self) {
        if let Some((_, pid)) = self.state() {
            self.rt.cleanup(&["kill", &self.id, "KILL"]);
            if pid > 0 {
                crate::common::signal(pid, libc::SIGKILL);
                let _ = crate::common::reap_until_gone(&[pid], crate::common::WAIT);
            }
            self.rt.cleanup(&["delete", "-f", &self.id]);
        }
        reap_now();
    }
}
