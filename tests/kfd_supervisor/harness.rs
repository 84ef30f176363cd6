//! What the CRIU tests of `tests/kfd_seccomp.rs` share: the release plugin, a simulated
//! machine behind a supervisor, the workload started on it, and CRIU run under the filter.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kfd_sim::{ProcessSpec, ProcessView, SimGpu, SimKfd};

use super::{DevNs, Inside, Model, Role, Supervisor, kfd_stand_in};
use crate::common::{self, CriuRun, E2e, REPO, cc, wait_until};

/// A topology fixture of `tests/fixtures/kfd-topology`.
pub fn topology(name: &str) -> PathBuf {
    Path::new(REPO)
        .join("tests/fixtures/kfd-topology")
        .join(name)
}

pub fn workload() -> PathBuf {
    cc(
        "kfd-workload",
        &[format!("{REPO}/tests/kfd_supervisor/workload.c")],
    )
}

pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// A simulated machine of a topology, behind its supervisor.
pub struct Machine {
    pub sup: Supervisor,
    pub gpus: Vec<SimGpu>,
    /// The topology's sysfs tree (what the plugin is told to read).
    pub topology: PathBuf,
    /// The device number of the `/dev/kfd` stand-in.
    pub rdev: u64,
}

impl Machine {
    /// A machine of the topology at `topology` whose workloads get every GPU and
    /// `4 + 4 * GPUs` BOs of every kind spread over them; `None` (after saying so) where this
    /// machine has no stand-in device.
    pub fn start(test: &str, topology: &Path) -> Option<Machine> {
        let Some((dev, rdev)) = kfd_stand_in() else {
            eprintln!("SKIPPED {test}: no character device with minor 0 to stand in for /dev/kfd");
            return None;
        };
        let sim = SimKfd::from_sysfs(topology).expect("simulated machine");
        let gpus = sim.gpus().to_vec();
        let ids: Vec<u32> = gpus.iter().map(|g| g.gpu_id).collect();
        let bos = if ids.len() == 1 { 8 } else { 4 + 4 * ids.len() };
        let spec = ProcessSpec::new(0, &ids).with_mixed_bos(bos, 256 << 10);
        let sup = Supervisor::start(Model::new(sim, spec, dev)).expect("supervisor");
        Some(Machine {
            sup,
            gpus,
            topology: topology.to_path_buf(),
            rdev,
        })
    }

    pub fn sim(&self) -> SimKfd {
        self.sup.with_model(|m| m.sim.clone())
    }

    /// The simulator's view of process `pid`.
    pub fn process(&self, pid: i32) -> Option<ProcessView> {
        self.sup.with_model(|m| m.sim.process(pid as u32))
    }

    /// The render minors of its GPUs.
    pub fn minors(&self) -> Vec<u32> {
        self.gpus.iter().map(|g| g.render_minor).collect()
    }

    /// Whether the supervisor answered `call` (successfully) to `pid` after the first
    /// `from` lines of its log.
    pub fn answered(&self, pid: i32, call: &str, from: usize) -> bool {
        self.sup.log()[from..]
            .iter()
            .any(|l| l.starts_with(&format!("pid {pid}: ioctl {call} ")) && l.ends_with("-> 0"))
    }
}

/// The release plugin (no simulator in it): `$KFD_SECCOMP_PLUGIN`, else the one every
/// end-to-end suite loads ([`common::plugin_path`]). A missing one fails the test, unless
/// `GPU_PLUGIN_SKIP_E2E=1`, as every end-to-end test does.
pub fn release_plugin(test: &str) -> Option<PathBuf> {
    let p = match std::env::var_os("KFD_SECCOMP_PLUGIN") {
        Some(p) => PathBuf::from(p),
        None if std::env::var_os("GPU_PLUGIN_SKIP_E2E").is_some_and(|v| v == "1") => {
            eprintln!("SKIPPED {test}: GPU_PLUGIN_SKIP_E2E=1");
            return None;
        }
        None => common::plugin_path(),
    };
    let bytes = std::fs::read(&p).expect("plugin");
    assert!(
        !common::bytes_contain(&bytes, b"KFD simulator with"),
        "{} holds the KFD simulator; the release plugin is wanted",
        p.display()
    );
    Some(p)
}

/// A CRIU test's set-up: the test context, the plugin directory and the namespace.
pub struct Bench {
    pub e: E2e,
    pub libdir: PathBuf,
    pub ns: DevNs,
}

impl Bench {
    /// The set-up for a test of machines with the render minors `minors`; `None` (after
    /// saying why) where the test cannot run here.
    pub fn start(test: &str, minors: &[u32]) -> Option<Bench> {
        let e = E2e::start(test)?;
        let plugin = release_plugin(test)?;
        let Some((_, rdev)) = kfd_stand_in() else {
            eprintln!("SKIPPED {test}: no character device with minor 0 to stand in for /dev/kfd");
            return None;
        };
        let libdir = e.dir().join("criu-lib");
        std::fs::create_dir_all(&libdir).unwrap();
        std::fs::copy(&plugin, libdir.join("gpu_plugin.so")).unwrap();
        let ns = DevNs::new(rdev, minors).expect("mount namespace");
        Some(Bench { e, libdir, ns })
    }

    /// Starts the workload on every GPU of `m`, its set-up answered by `m`, writing to
    /// `out`; waits until it is ready and checks that no thread is left with a filter.
    pub fn workload(&self, m: &Machine, out: &Path) -> i32 {
        self.workload_in(m, out, None)
    }

    /// [`Bench::workload`], in a mount namespace of its own where `own_ns` is given (see
    /// [`Inside`]).
    pub fn workload_in(&self, m: &Machine, out: &Path, own_ns: Option<&[PathBuf]>) -> i32 {
        let mut cmd = self.e.command(&workload());
        for g in &m.gpus {
            cmd.arg(format!("{:#x}", g.gpu_id))
                .arg(format!("/dev/dri/renderD{}", g.render_minor));
        }
        m.sup
            .filter_one_thread(
                &mut cmd,
                Some(Inside {
                    ns: &self.ns,
                    cwd: self.e.dir(),
                    output: Some(out),
                    own_ns,
                }),
            )
            .expect("filter program");
        let pid = self.e.spawn_session(cmd);
        wait_until("the workload to be ready", || {
            read(out).contains("ready") || read(out).contains(": ")
        });
        assert!(read(out).ends_with("ready\n"), "workload: {}", read(out));
        // No thread is left with a filter: a CRIU under seccomp cannot suspend a tracee's.
        let status = read(Path::new(&format!("/proc/{pid}/status")));
        assert!(status.contains("Seccomp:\t0\n"), "{status}");
        pid
    }

    /// Runs CRIU with `args` and `env` under `m`'s filter, telling the plugin `m`'s
    /// topology, logging to `images/<log>`.
    pub fn criu(
        &self,
        m: &Machine,
        args: &[&str],
        images: &Path,
        log: &str,
        env: &[(&str, &str)],
    ) -> CriuRun {
        let e = &self.e;
        let out = e.dir().join(format!("{log}.stdout"));
        let mut cmd = e.command(&e.criu);
        cmd.args(args)
            .arg("-D")
            .arg(images)
            .args(["-o", log, "-v4", "-L"])
            .arg(&self.libdir)
            .env("CRIU_GPU_AMDGPU_TOPOLOGY", &m.topology)
            .envs(env.iter().copied())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::options().append(true).open(&out).unwrap());
        m.sup.filter(
            &mut cmd,
            Role::Criu,
            Some(Inside {
                ns: &self.ns,
                cwd: e.dir(),
                output: None,
                own_ns: None,
            }),
        );
        let what = format!("criu {} -D {}", args.join(" "), images.display());
        let started = Instant::now();
        let mut child = cmd.spawn().expect("start criu");
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait for criu") {
                break st;
            }
            if started.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                let _ = child.wait();
                let log = read(&images.join(log));
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!(
                    "{what}: still running after 120 s; CRIU's last words:\n{}\nsupervisor: {:#?}",
                    tail.join("\n"),
                    m.sup.log()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let run = CriuRun {
            what,
            code: status.code(),
            log: read(&images.join(log)),
            output: read(&out),
            took: started.elapsed(),
        };
        eprintln!("{}: exit {:?} in {:?}", run.what, run.code, run.took);
        run
    }
}

/// The lines of a CRIU log worth showing when it failed.
pub fn errors_of(run: &CriuRun) -> String {
    run.log
        .lines()
        .filter(|l| l.contains("Error") || l.contains("amdgpu") || l.contains("gpu_plugin"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Asserts that `run` succeeded, showing what went wrong otherwise.
pub fn assert_ran(run: &CriuRun, m: &Machine) {
    assert!(
        run.ok(),
        "{}: {}\n{}\nsupervisor: {:#?}",
        run.what,
        run.output,
        errors_of(run),
        m.sup.log()
    );
}

/// Sends the workload `pid` SIGUSR2 for the `n`th time: a thread of it installs a fresh
/// filter and asks the KFD version; checks the answer it prints and that `m` gave it.
pub fn assert_answers_again(m: &Machine, pid: i32, out: &Path, n: u32) {
    let from = m.sup.log().len();
    assert!(common::signal(pid, libc::SIGUSR2));
    let line = format!("again {n}: ");
    wait_until(format!("the workload's {line}"), || {
        read(out).contains(&line)
    });
    assert!(
        read(out).ends_with(&format!("again {n}: GET_VERSION ok 1.14\n")),
        "{}",
        read(out)
    );
    assert!(
        m.answered(pid, "GET_VERSION", from),
        "GET_VERSION not answered: {:#?}",
        m.sup.log()
    );
}
