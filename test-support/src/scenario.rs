//! Tests of the stand-in CUDA driver written as what they check: one GPU, a tree, a dump, a
//! restore, what the driver was asked and whether every process runs with its GPU.
//!
//! ```ignore
//! let Some(s) = OneGpu::start("cuda-tree") else { return };
//! let w = s.workload(&TREE_OF_3);
//! let dump = s.dumped(&w);
//! s.calls("dump.calls").assert_transitions(&w.pids, &["lock=0", "checkpoint=0"]);
//! let restore = s.restore("restore.log", &s.env("restore.calls"));
//! restore.assert_ok();
//! w.assert_all_running("after the restore");
//! ```

use std::collections::BTreeMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use crate::CriuRun;
use crate::fake_cuda::{Fake, FakeGpu, Workload, lib, one_gpu};

/// [`Workload`] arguments of a root and two children, each with 16 MiB of device memory in two
/// 8 MiB chunks and one worker thread.
pub const TREE_OF_3: [&str; 8] = [
    "--mib",
    "16",
    "--chunk-mib",
    "8",
    "--children",
    "2",
    "--threads",
    "1",
];

/// The bus address the one GPU is listed at.
pub const ONE_GPU_BUS: &str = "0000:00:06.0";

/// A test with one stand-in GPU listed to the plugin, the plugin's `--libdir` and an image
/// directory. Everything of [`Fake`] is reachable through it.
pub struct OneGpu {
    pub f: Fake,
    /// The fake driver's first GPU.
    pub gpu: FakeGpu,
    /// A `/proc/driver/nvidia/gpus`-like directory (`nv`) listing `gpu` at [`ONE_GPU_BUS`].
    pub nv: PathBuf,
    /// The plugin's library directory, for CRIU's `-L`.
    pub lib: String,
    /// The image directory `img` of the work directory.
    pub images: PathBuf,
}

impl Deref for OneGpu {
    type Target = Fake;

    fn deref(&self) -> &Fake {
        &self.f
    }
}

impl OneGpu {
    /// Test `test` on one GPU; `None` where the end-to-end tests cannot run.
    pub fn start(test: &str) -> Option<OneGpu> {
        let f = Fake::start(test)?;
        let gpu = f.gpus(1, 0).swap_remove(0);
        let nv = one_gpu(&f, "nv", ONE_GPU_BUS, &gpu.model, &gpu);
        let images = f.e.images("img");
        Some(OneGpu {
            f,
            gpu,
            nv,
            lib: lib(),
            images,
        })
    }

    /// CRIU's environment on this GPU list, the driver's calls logged to `calls`.
    pub fn env(&self, calls: &str) -> Vec<(&'static str, String)> {
        self.f.env(&self.nv, calls)
    }

    /// [`OneGpu::env`] and `extra` after it.
    pub fn env_with(
        &self,
        calls: &str,
        extra: &[(&'static str, &str)],
    ) -> Vec<(&'static str, String)> {
        let mut env = self.env(calls);
        env.extend(extra.iter().map(|&(k, v)| (k, v.to_string())));
        env
    }

    /// A workload tree `w` started with `args`, every process counting on its GPU.
    pub fn workload(&self, args: &[&str]) -> Workload {
        Workload::start(&self.f, "w", args)
    }

    /// `criu dump -t ROOT EXTRA... -L LIB -v4` into the image directory, logged to `dump.log`.
    pub fn dump(
        &self,
        root: impl std::fmt::Display,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> CriuRun {
        self.dump_into(&self.images, root, extra, env)
    }

    /// [`OneGpu::dump`] into another image directory.
    pub fn dump_into(
        &self,
        images: &Path,
        root: impl std::fmt::Display,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> CriuRun {
        self.dump_logged(images, "dump.log", root, extra, env)
    }

    /// [`OneGpu::dump_into`] with CRIU's log in `log`.
    pub fn dump_logged(
        &self,
        images: &Path,
        log: &str,
        root: impl std::fmt::Display,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> CriuRun {
        let root = root.to_string();
        let args: Vec<&str> = ["dump", "-t", &root]
            .into_iter()
            .chain(extra.iter().copied())
            .chain(["-L", &self.lib, "-v4"])
            .collect();
        self.f.criu(&args, images, log, env)
    }

    /// `w` dumped with the driver's calls in `dump.calls`: the dump succeeded and CRIU's kill
    /// of the tree is complete (its pids are free for the restore).
    pub fn dumped(&self, w: &Workload) -> CriuRun {
        let dump = self.dump(w.root(), &[], &self.env("dump.calls"));
        dump.assert_ok();
        self.f.e.reap(&w.pids);
        dump
    }

    /// `criu restore -d -L LIB -v4` from the image directory, logged to `log`.
    pub fn restore(&self, log: &str, env: &[(&str, String)]) -> CriuRun {
        self.f.criu(
            &["restore", "-d", "-L", &self.lib, "-v4"],
            &self.images,
            log,
            env,
        )
    }

    /// The device files of each process of `w`, by pid.
    pub fn device_memory(&self, w: &Workload) -> BTreeMap<i32, Vec<String>> {
        w.pids
            .iter()
            .map(|&p| (p, self.f.device_files(p)))
            .collect()
    }

    /// Each process holds the device files it held when `files` was taken ([`OneGpu::device_memory`]).
    pub fn assert_device_memory(&self, files: &BTreeMap<i32, Vec<String>>, what: &str) {
        for (p, v) in files {
            assert_eq!(&self.f.device_files(*p), v, "pid {p}: {what}");
        }
    }
}

/// [`Workload`] arguments of a root and one child, each with 8 MiB of device memory in two
/// 4 MiB chunks and one worker thread.
pub const ROOT_AND_CHILD: [&str; 8] = [
    "--mib",
    "8",
    "--chunk-mib",
    "4",
    "--children",
    "1",
    "--threads",
    "1",
];

/// A [`ROOT_AND_CHILD`] tree on one stand-in GPU, dumped (and so ended) by CRIU, its images
/// kept for restores.
pub struct Dumped {
    pub f: OneGpu,
    pub w: Workload,
    /// Device files each process holds.
    pub files: usize,
    pub lib: String,
    pub env: Vec<(&'static str, String)>,
    pub images: PathBuf,
}

impl Dumped {
    /// The tree of test `test`, in a pid namespace of its own when `in_pid_ns`; `None` where
    /// the end-to-end tests cannot run.
    pub fn new(test: &str, in_pid_ns: bool) -> Option<Dumped> {
        let f = OneGpu::start(test)?;
        let (w, extra) = if in_pid_ns {
            let (w, unshare) = Workload::start_in_pid_ns(&f, "w", &ROOT_AND_CHILD);
            (w, vec![unshare])
        } else {
            (f.workload(&ROOT_AND_CHILD), Vec::new())
        };
        let files = f.device_files(w.own_pid(w.root())).len();
        let lib = f.lib.clone();
        let env = f.env("calls");
        let images = f.images.clone();
        f.dump(w.root(), &[], &env).assert_ok();
        f.e.reap(&[w.pids.as_slice(), &extra].concat());
        Some(Dumped {
            f,
            w,
            files,
            lib,
            env,
            images,
        })
    }
}
