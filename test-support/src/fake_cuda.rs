//! The stand-in CUDA driver harness: the fake `libcuda` and NVML of `tests/fixtures/fake-cuda`
//! built once, a device directory per test, fake GPUs listed the way
//! `/proc/driver/nvidia/gpus` lists them, the driver's call log, and workload processes that
//! keep "device memory" in files the fake deletes at checkpoint and recreates at restore.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{
    CriuRun, E2e, children_of, comm_of, exists, ns_pid_of, plugin_libdir, sid_of, signal, state_of,
    wait_until,
};

/// A test with the fake driver built and a device directory of its own.
pub struct Fake {
    pub e: E2e,
    /// `FAKE_CUDA_DEVICE_DIR` of the workloads.
    pub dev: PathBuf,
    pub libcuda: PathBuf,
    /// The stand-in NVML, whose `nvmlInit_v2` leaves a thread behind as NVIDIA's does.
    pub nvml: PathBuf,
    pub workload: PathBuf,
    pub gpu_list: PathBuf,
}

/// One of the fake driver's GPUs.
#[derive(Clone, Debug)]
pub struct FakeGpu {
    pub uuid: String,
    pub model: String,
}

impl Fake {
    pub fn start(test: &str) -> Option<Fake> {
        let mut e = E2e::start(test)?;
        let crate::FakeCudaBuild {
            libcuda,
            nvml,
            workload,
            gpu_list,
        } = crate::fake_cuda_build();
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            e.dir().to_path_buf()
        };
        let dev = e.extra_dir(&base, "dev");
        Some(Fake {
            e,
            dev,
            libcuda,
            nvml,
            workload,
            gpu_list,
        })
    }

    /// The fake's GPUs under `FAKE_CUDA_GPUS=count` and `FAKE_CUDA_GPU_UUID_SEED=seed`.
    pub fn gpus(&self, count: u32, seed: u64) -> Vec<FakeGpu> {
        let out = self
            .e
            .command(&self.gpu_list)
            .env("FAKE_CUDA_GPUS", count.to_string())
            .env("FAKE_CUDA_GPU_UUID_SEED", seed.to_string())
            .env("FAKE_CUDA_DEVICE_DIR", &self.dev)
            .stdout(std::process::Stdio::piped())
            .output()
            .expect("run gpu_list");
        assert!(out.status.success(), "gpu_list: {out:?}");
        let gpus: Vec<FakeGpu> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                let (uuid, model) = l.split_once(' ').expect("`<uuid> <name>`");
                FakeGpu {
                    uuid: uuid.to_string(),
                    model: model.to_string(),
                }
            })
            .collect();
        assert_eq!(gpus.len(), count as usize, "{gpus:?}");
        gpus
    }

    /// Writes a `/proc/driver/nvidia/gpus`-like directory `name` listing `gpus` as
    /// (bus, model, uuid).
    pub fn nvidia_proc(&self, name: &str, gpus: &[(&str, &str, &str)]) -> PathBuf {
        let dir = self.e.dir().join(name);
        for (bus, model, uuid) in gpus {
            let d = dir.join(bus);
            std::fs::create_dir_all(&d).expect("nv fixture");
            std::fs::write(
                d.join("information"),
                format!(
                    "Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nVideo BIOS: \t \
                     00.00.00.00.00\nBus Type: \t PCIe\nBus Location: \t {bus}\n"
                ),
            )
            .expect("nv fixture");
        }
        dir
    }

    /// A GPU list `name` of `a` at 0000:00:06.0 and `b` at 0000:00:07.0, both of the fake's
    /// model.
    pub fn two_gpus_listed(&self, name: &str, a: &FakeGpu, b: &FakeGpu) -> PathBuf {
        self.nvidia_proc(
            name,
            &[
                ("0000:00:06.0", "Fake GPU", &a.uuid),
                ("0000:00:07.0", "Fake GPU", &b.uuid),
            ],
        )
    }

    /// CRIU's environment: the plugin on the fake driver with GPU list `nv`, the fake's calls
    /// logged to `calls` (a file under the work directory).
    pub fn env(&self, nv: &Path, calls: &str) -> Vec<(&'static str, String)> {
        vec![
            ("CRIU_GPU_LIBCUDA", self.libcuda.display().to_string()),
            ("CRIU_GPU_CUDA_NVIDIA_PROC", nv.display().to_string()),
            ("CRIU_GPU_NVML", self.nvml.display().to_string()),
            (
                "FAKE_NVML_LOG",
                self.e.dir().join("nvml.log").display().to_string(),
            ),
            (
                "FAKE_CUDA_LOG",
                self.e.dir().join(calls).display().to_string(),
            ),
            // A hung target fails a call instead of the test.
            ("FAKE_CUDA_CALL_TIMEOUT_MS", "15000".into()),
        ]
    }

    /// The calls the fake logged to `calls`.
    pub fn calls(&self, calls: &str) -> Calls {
        let text = std::fs::read_to_string(self.e.dir().join(calls)).unwrap_or_default();
        Calls(
            text.lines()
                .filter_map(|l| {
                    let mut it = l.split_whitespace();
                    let op = it.next()?.to_string();
                    let pid = it.next()?.strip_prefix("pid=")?.parse().ok()?;
                    let rc = it.next()?.strip_prefix("result=")?.parse().ok()?;
                    Some((op, pid, rc))
                })
                .collect(),
        )
    }

    /// Device files of `pid` (`<pid>.<index>`), sorted.
    pub fn device_files(&self, pid: i32) -> Vec<String> {
        let prefix = format!("{pid}.");
        let mut v: Vec<String> = std::fs::read_dir(&self.dev)
            .map(|it| {
                it.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Removes what a SIGKILLed workload leaves in the device directory.
    pub fn clear_device_dir(&self) {
        if let Ok(it) = std::fs::read_dir(&self.dev) {
            for e in it.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    pub fn criu(&self, args: &[&str], images: &Path, log: &str, env: &[(&str, String)]) -> CriuRun {
        self.e.criu(args, images, log, env)
    }
}

/// The fake's call log: (operation, pid, CUresult).
pub struct Calls(pub Vec<(String, i32, i32)>);

impl Calls {
    /// The state-changing calls for `pid`, in order, as "op=rc".
    pub fn transitions(&self, pid: i32) -> Vec<String> {
        self.0
            .iter()
            .filter(|(op, p, _)| {
                *p == pid && matches!(op.as_str(), "lock" | "checkpoint" | "restore" | "unlock")
            })
            .map(|(op, _, rc)| format!("{op}={rc}"))
            .collect()
    }

    /// Each of `pids` made exactly the state-changing calls `expected` ("op=rc", in order).
    pub fn assert_transitions(&self, pids: &[i32], expected: &[&str]) {
        for &p in pids {
            assert_eq!(self.transitions(p), expected, "pid {p}: {self:?}");
        }
    }

    pub fn ops(&self) -> Vec<&str> {
        self.0.iter().map(|(op, _, _)| op.as_str()).collect()
    }
}

impl std::fmt::Debug for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (op, pid, rc) in &self.0 {
            writeln!(f, "{op} pid={pid} result={rc}")?;
        }
        Ok(())
    }
}

/// A running workload tree (`workload.c`): the root, then its children in fork order.
pub struct Workload {
    pub out: PathBuf,
    /// Host pids (what signals and the plugin use).
    pub pids: Vec<i32>,
    /// Each process's pid in its own pid namespace, in the order of `pids`: the suffix of its
    /// output file. The same as the host pid unless the tree runs in a pid namespace of its own.
    pub ns_pids: Vec<i32>,
}

impl Workload {
    pub fn start(f: &Fake, name: &str, args: &[&str]) -> Workload {
        let out = f.e.dir().join(name);
        let mut cmd = f.e.command(&f.workload);
        cmd.arg("--out")
            .arg(&out)
            .args(args)
            .env("FAKE_CUDA_DEVICE_DIR", &f.dev);
        let root = f.e.spawn_session_alone(cmd);
        let mut w = Workload {
            out,
            pids: vec![root],
            ns_pids: vec![root],
        };
        let children = w.children_announced(root);
        for &c in &children {
            f.e.adopt(root, c);
            w.pids.push(c);
            w.ns_pids.push(c);
        }
        for &c in &children {
            w.wait_line(c, "ready ");
        }
        for &p in &w.pids {
            w.wait_counting(p);
        }
        w
    }

    /// Starts the tree the way a container runs: `unshare -p -f -- setsid workload ...`, so that
    /// the workload is pid 1 of a new pid namespace and leads a session of its own there (CRIU
    /// dumps a pid namespace from its init only, and refuses a session leader outside it). Each
    /// process writes `<out>.<the pid it sees>`. Returns the tree and the host pid of `unshare`.
    ///
    /// Not `unshare --kill-child`: that gives the workload a parent-death signal, which CRIU
    /// restores, and the restored root then gets SIGKILL as soon as `criu restore -d` exits
    /// (CRIU warns: "Root task has pdeath_sig configured"). The namespace goes with its init,
    /// which the test kills ([`E2e::adopt`]) like every other tree.
    pub fn start_in_pid_ns(f: &Fake, name: &str, args: &[&str]) -> (Workload, i32) {
        let out = f.e.dir().join(name);
        let mut cmd = f.e.command(Path::new("unshare"));
        cmd.args(["-p", "-f", "--", "setsid"])
            .arg(&f.workload)
            .arg("--out")
            .arg(&out)
            .args(args)
            .env("FAKE_CUDA_DEVICE_DIR", &f.dev);
        let unshare = f.e.spawn_session_alone(cmd);
        let mut root = 0;
        // `comm` is "workload" once setsid(1) has exec'd it.
        wait_until(format!("the workload under unshare {unshare}"), || {
            root = children_of(unshare)
                .into_iter()
                .find(|&c| comm_of(c).as_deref() == Some("workload"))
                .unwrap_or(0);
            root != 0
        });
        // Its session is the whole namespace: killed at the end, whatever happens.
        f.e.adopt(root, root);
        assert_eq!(
            ns_pid_of(root),
            Some(1),
            "the workload ({root}) must be pid 1 of its pid namespace"
        );
        assert_eq!(
            sid_of(root),
            Some(root),
            "the workload ({root}) must lead a session of its own"
        );
        let mut w = Workload {
            out,
            pids: vec![root],
            ns_pids: vec![1],
        };
        let children = w.children_announced(root);
        for &c in &children {
            let mut host = 0;
            wait_until(
                format!("the host pid of pid {c} of namespace {root}"),
                || {
                    host = children_of(root)
                        .into_iter()
                        .find(|&p| ns_pid_of(p) == Some(c))
                        .unwrap_or(0);
                    host != 0
                },
            );
            f.e.adopt(root, host);
            w.pids.push(host);
            w.ns_pids.push(c);
        }
        for &p in &w.pids[1..] {
            w.wait_line(p, "ready ");
        }
        for &p in &w.pids {
            w.wait_counting(p);
        }
        (w, unshare)
    }

    /// The children `root` says it forked (as pids it sees), once it is ready.
    fn children_announced(&self, root: i32) -> Vec<i32> {
        self.wait_line(root, "ready ");
        self.lines(root)
            .iter()
            .filter_map(|l| l.strip_prefix("child ")?.parse().ok())
            .collect()
    }

    pub fn root(&self) -> i32 {
        self.pids[0]
    }

    /// The pid that process `pid` (a host pid of this tree) sees as its own.
    pub fn own_pid(&self, pid: i32) -> i32 {
        self.pids
            .iter()
            .position(|&p| p == pid)
            .map_or(pid, |i| self.ns_pids[i])
    }

    /// The tree was restored with new host pids (in the order of `pids`).
    pub fn moved_to(&mut self, pids: Vec<i32>) {
        assert_eq!(pids.len(), self.ns_pids.len(), "{pids:?}");
        self.pids = pids;
    }

    pub fn lines(&self, pid: i32) -> Vec<String> {
        let own = self.own_pid(pid);
        std::fs::read_to_string(format!("{}.{own}", self.out.display()))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    pub fn wait_line(&self, pid: i32, prefix: &str) {
        wait_until(format!("pid {pid}: a line `{prefix}...`"), || {
            self.lines(pid).iter().any(|l| l.starts_with(prefix))
        });
    }

    /// Counter values of `pid`, in order.
    pub fn counters(&self, pid: i32) -> Vec<u64> {
        self.lines(pid)
            .iter()
            .filter_map(|l| l.strip_prefix("counter ")?.parse().ok())
            .collect()
    }

    pub fn last_counter(&self, pid: i32) -> u64 {
        self.counters(pid).last().copied().unwrap_or(0)
    }

    /// The device counter of `pid` goes up (its GPU work runs).
    pub fn wait_counting(&self, pid: i32) {
        let c0 = self.last_counter(pid);
        wait_until(
            format!(
                "pid {pid}: counter moving beyond {c0} ({:?})",
                self.tail(pid)
            ),
            || self.last_counter(pid) >= c0 + 3,
        );
    }

    pub fn tail(&self, pid: i32) -> Vec<String> {
        let l = self.lines(pid);
        l[l.len().saturating_sub(6)..].to_vec()
    }

    /// SIGUSR1, then the new verdict must be "verify ok".
    pub fn verify(&self, pid: i32) {
        let verdicts = |w: &Workload| -> Vec<String> {
            w.lines(pid)
                .into_iter()
                .filter(|l| l.starts_with("verify"))
                .collect()
        };
        let before = verdicts(self).len();
        assert!(signal(pid, libc::SIGUSR1), "SIGUSR1 to {pid}");
        wait_until(format!("pid {pid}: a verify verdict"), || {
            verdicts(self).len() > before
        });
        assert_eq!(verdicts(self)[before], "verify ok", "pid {pid}");
    }

    /// Every process runs with its GPU: not stopped, counters move, memory intact, no CUDA
    /// error reported.
    pub fn assert_all_running(&self, what: &str) {
        for &pid in &self.pids {
            let st = state_of(pid);
            assert!(
                matches!(st, Some('R' | 'S')),
                "{what}: pid {pid} is not running: {st:?}"
            );
        }
        for &pid in &self.pids {
            self.wait_counting(pid);
            self.verify(pid);
            let errors: Vec<String> = self
                .lines(pid)
                .into_iter()
                .filter(|l| l.starts_with("cuda error"))
                .collect();
            assert!(errors.is_empty(), "{what}: pid {pid}: {errors:?}");
        }
    }

    /// Line counts of every process's output now, by the pid each process sees as its own
    /// (which a restore into a new pid namespace keeps).
    pub fn marks(&self) -> BTreeMap<i32, usize> {
        self.pids
            .iter()
            .map(|&p| (self.own_pid(p), self.lines(p).len()))
            .collect()
    }

    /// After a restore: each counter's first value after `marks` is the one after its last
    /// value before, and the whole sequence goes up by one per line.
    pub fn assert_continues(&self, marks: &BTreeMap<i32, usize>) {
        for &pid in &self.pids {
            let lines = self.lines(pid);
            let mark = marks[&self.own_pid(pid)];
            let before: Vec<u64> = lines[..mark]
                .iter()
                .filter_map(|l| l.strip_prefix("counter ")?.parse().ok())
                .collect();
            let after: Vec<u64> = lines[mark..]
                .iter()
                .filter_map(|l| l.strip_prefix("counter ")?.parse().ok())
                .collect();
            let last = *before.last().expect("counted before the dump");
            assert_eq!(
                after.first().copied(),
                Some(last + 1),
                "pid {pid}: last counter before the dump {last}, after the restore {:?}",
                &after[..after.len().min(5)]
            );
            let all = self.counters(pid);
            for w in all.windows(2) {
                assert_eq!(
                    w[1],
                    w[0] + 1,
                    "pid {pid}: counter jumps {} -> {}",
                    w[0],
                    w[1]
                );
            }
        }
    }
}

pub fn lib() -> String {
    plugin_libdir().display().to_string()
}

/// An `nv` directory listing fake GPU `g` at one bus address.
pub fn one_gpu(f: &Fake, name: &str, bus: &str, model: &str, g: &FakeGpu) -> PathBuf {
    f.nvidia_proc(name, &[(bus, model, &g.uuid)])
}

pub fn assert_nothing_restored(run: &CriuRun, pids: &[i32]) {
    assert!(
        !run.has("Forking task"),
        "CRIU forked tasks before failing: {run:?}"
    );
    for &p in pids {
        assert!(!exists(p), "pid {p} exists after the failed restore");
    }
}

/// `text`, an image's `gpu-plugin-cuda.img` that a test edited, with its `crc32` trailer made
/// anew (the format is documented in `src/cuda/metadata.rs`): the restore then reads the edited
/// records instead of refusing a damaged file. Written here from the documented format, not
/// with the plugin's own encoder, so that the two are checked against each other.
pub fn resealed_metadata(text: &str) -> String {
    let records: String = text
        .lines()
        .filter(|l| !l.starts_with("crc32 "))
        .map(|l| format!("{l}\n"))
        .collect();
    format!(
        "{records}crc32 {:08x}\n",
        crc32fast::hash(records.as_bytes())
    )
}

/// `text`, an image's `gpu-plugin-cuda.img` of the current format, as the plugin wrote it in
/// format 1.0: the header `gpu-plugin-cuda 1`, no checksum.
pub fn metadata_of_format_1_0(text: &str) -> String {
    let body = text
        .strip_prefix("gpu-plugin-cuda 1.1\n")
        .expect("format 1.1");
    let records: String = body
        .lines()
        .filter(|l| !l.starts_with("crc32 "))
        .map(|l| format!("{l}\n"))
        .collect();
    format!("gpu-plugin-cuda 1\n{records}")
}
