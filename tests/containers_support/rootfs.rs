//! The containers' root file system: busybox, the stand-in CUDA driver and the workload linked
//! against it, the stand-in KFD module's workload, built once per test process.

use super::*;
use crate::common::kfd_standin;

/// The stand-in CUDA driver, its NVML and the workload linked against it, built once.
pub struct FakeCuda {
    pub libcuda: PathBuf,
    pub nvml: PathBuf,
    pub workload: PathBuf,
    gpu_list: PathBuf,
}

pub fn fake_cuda() -> &'static FakeCuda {
    static F: OnceLock<FakeCuda> = OnceLock::new();
    F.get_or_init(|| {
        let b = fake_cuda_build();
        FakeCuda {
            libcuda: b.libcuda,
            nvml: b.nvml,
            workload: b.workload,
            gpu_list: b.gpu_list,
        }
    })
}

impl FakeCuda {
    /// (UUID, model) of each GPU of the fake under `FAKE_CUDA_GPUS=count`.
    pub fn gpus(&self, e: &E2e, count: u32) -> Vec<(String, String)> {
        let mut cmd = e.command(&self.gpu_list);
        cmd.env("FAKE_CUDA_DEVICE_DIR", e.dir().join("gpu-list-dev"))
            .env("FAKE_CUDA_GPUS", count.to_string());
        let run = run_tool(e.dir(), cmd, "gpu_list");
        run.assert_ok();
        let gpus: Vec<(String, String)> = run
            .stdout
            .lines()
            .filter_map(|l| {
                let (u, m) = l.split_once(' ')?;
                Some((u.to_string(), m.to_string()))
            })
            .collect();
        assert_eq!(gpus.len(), count as usize, "{}", run.stdout);
        gpus
    }

    /// (UUID, model) of the fake's one GPU.
    pub fn gpu(&self, e: &E2e) -> (String, String) {
        let mut cmd = e.command(&self.gpu_list);
        cmd.env("FAKE_CUDA_DEVICE_DIR", e.dir().join("gpu-list-dev"));
        let run = run_tool(e.dir(), cmd, "gpu_list");
        run.assert_ok();
        let line = run.stdout.lines().next().expect("one GPU").to_string();
        let (uuid, model) = line.split_once(' ').expect("`<uuid> <model>`");
        (uuid.to_string(), model.to_string())
    }
}

/// The libraries `ldd` says `bin` loads (the loader included), as absolute paths.
fn libraries_of(bin: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(bin).output().expect("run ldd");
    assert!(out.status.success(), "ldd {}: {out:?}", bin.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let p = match l.split_once("=>") {
                Some((_, rest)) => rest.trim().split(' ').next()?,
                None => l.split(' ').next()?,
            };
            p.starts_with('/').then(|| PathBuf::from(p))
        })
        .collect()
}

fn copy_into(root: &Path, from: &Path, to: &str) {
    let dst = root.join(to.trim_start_matches('/'));
    std::fs::create_dir_all(dst.parent().expect("parent")).expect("rootfs directory");
    std::fs::copy(from, &dst)
        .unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), dst.display()));
}

/// The containers' root file system, built once and shared (read-only in every container):
/// static busybox from its Debian package, the fake-CUDA workload with the fake driver and the
/// host libraries they load, and the mount points.
pub fn rootfs() -> &'static Path {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| {
        let root = build_dir().join("rootfs");
        let _ = std::fs::remove_dir_all(&root);
        copy_into(&root, &private_tool("busybox"), "/bin/busybox");
        for applet in ["sh", "echo", "cat", "sleep", "usleep", "true"] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))
                .expect("busybox link");
        }
        let f = fake_cuda();
        copy_into(&root, &f.workload, "/gpu/workload");
        copy_into(&root, &f.libcuda, "/gpu/libcuda.so.1");
        for bin in [&f.workload, &f.libcuda] {
            for lib in libraries_of(bin) {
                if lib.parent() != f.libcuda.parent() {
                    copy_into(&root, &lib, lib.to_str().expect("UTF-8 path"));
                }
            }
        }
        // The stand-in KFD module's workload, where the module is given: only pods there run
        // it (and the KFD and DRM headers it needs are not everywhere).
        if kfd_standin::module_ko().is_some() {
            let kfd = build_dir().join("kfd-workload");
            if let Err(e) = kfd_standin::build_workload(&kfd) {
                panic!("cannot build the stand-in KFD module's workload: {e}");
            }
            copy_into(&root, &kfd, "/kfd/workload");
            for lib in libraries_of(&kfd) {
                copy_into(&root, &lib, lib.to_str().expect("UTF-8 path"));
            }
        }
        for d in ["proc", "dev", "out", "tmp", "etc"] {
            std::fs::create_dir_all(root.join(d)).expect("mount point");
        }
        root
    })
}

/// `rootfs()` as an uncompressed tar (for `podman import`).
pub fn rootfs_tar(e: &E2e) -> &'static Path {
    static T: OnceLock<PathBuf> = OnceLock::new();
    T.get_or_init(|| {
        let tar = build_dir().join("rootfs.tar");
        let mut cmd = e.command(Path::new("tar"));
        cmd.arg("-C").arg(rootfs()).arg("-cf").arg(&tar).arg(".");
        run_tool(e.dir(), cmd, "tar rootfs").assert_ok();
        tar
    })
}
