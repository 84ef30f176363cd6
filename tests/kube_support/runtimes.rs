//! The container runtimes a node can run: containerd 2.1 (Debian's) and the releases built
//! from their Go modules (2.3 and 2.4), and CRI-O 1.36 (built), each with runc 1.4 (Debian's)
//! or 1.5 (built); and a node's running engine ([`NodeEngine`]).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::upstream;
use crate::common::E2e;
use crate::containers_support::PrivateMounts;
use crate::containers_support::cri::gpu_node::runc_1_4;
use crate::containers_support::cri::{
    CriDaemon, Images, Registry, cri_config_with, push_images as push_with_ctr,
};
use crate::containers_support::crio::{self, CriO, crio_prefix};
use crate::containers_support::engines::{Containerd, ContainerdBins};

/// The CRI runtime a node runs.
#[derive(Clone, Debug)]
pub enum Engine {
    Containerd(ContainerdBins),
    /// CRI-O from `prefix` (see `containers_support::crio`) with `runc`.
    CriO {
        prefix: PathBuf,
        runc: PathBuf,
    },
}

/// A node's runtime: its engine and runc, the lines containerd's CRI runtime table adds, and
/// the kubelet's deadline for its calls to it.
#[derive(Clone, Debug)]
pub struct Runtime {
    pub engine: Engine,
    /// containerd's only.
    pub cri_runtime_options: String,
    /// The kubelet's `runtimeRequestTimeout` in seconds (its default: 120): the deadline of
    /// every CRI call, and of a checkpoint unless the API's `?timeout=` is longer.
    pub request_timeout_s: u64,
    /// Whether runc keeps CRIU's restore log in `<node>/criu-work` (its `CriuWorkPath`):
    /// containerd deletes a failed restore's work directory, CRIU's log with it (containerd's
    /// only: CRI-O's restore logs are kept by the test, see `containers_support::crio`).
    pub keep_criu_logs: bool,
}

/// Which runc a node's containerd runs.
#[derive(Clone, Copy, Debug)]
pub enum Runc {
    /// runc 1.4 (Debian's, `scripts/install-runtimes-2026.sh`).
    V1_4,
    /// runc 1.5 (`scripts/build-upstream.sh runc-1.5`).
    V1_5,
}

impl Runc {
    fn path(self) -> PathBuf {
        match self {
            Runc::V1_4 => runc_1_4(),
            Runc::V1_5 => upstream("runc-1.5", "runc"),
        }
    }
}

impl Runtime {
    /// This runtime, runc keeping CRIU's restore logs (see [`Runtime::keep_criu_logs`]).
    pub fn keeping_criu_logs(mut self) -> Runtime {
        self.keep_criu_logs = true;
        self
    }

    /// containerd 2.1.9 (Debian's): restores a checkpoint through CreateContainer.
    pub fn containerd_2_1(runc: Runc) -> Runtime {
        Runtime {
            engine: Engine::Containerd(ContainerdBins::v2026(runc.path())),
            cri_runtime_options: String::new(),
            request_timeout_s: 120,
            keep_criu_logs: false,
        }
    }

    /// containerd 2.3 built from its module; `restore_via_create` sets the CRI's
    /// `enable_experimental_restore_via_create` (off by default from 2.3.4).
    pub fn containerd_2_3(runc: Runc, restore_via_create: bool) -> Runtime {
        Runtime {
            engine: Engine::Containerd(upstream_containerd("containerd-2.3", runc)),
            cri_runtime_options: if restore_via_create {
                "enable_experimental_restore_via_create = true".into()
            } else {
                String::new()
            },
            request_timeout_s: 120,
            keep_criu_logs: false,
        }
    }

    /// containerd 2.4 built from its module: restore through CreateContainer is gone.
    pub fn containerd_2_4(runc: Runc) -> Runtime {
        Runtime {
            engine: Engine::Containerd(upstream_containerd("containerd-2.4", runc)),
            cri_runtime_options: String::new(),
            request_timeout_s: 120,
            keep_criu_logs: false,
        }
    }

    /// CRI-O 1.36 built from its module (`scripts/build-upstream.sh cri-o-1.36`); `None`, with
    /// a SKIPPED line for `test`, where it is not built.
    pub fn crio_1_36(runc: Runc, test: &str) -> Option<Runtime> {
        Some(Runtime {
            engine: Engine::CriO {
                prefix: crio_prefix(test)?,
                runc: runc.path(),
            },
            cri_runtime_options: String::new(),
            request_timeout_s: 120,
            keep_criu_logs: false,
        })
    }

    /// The engine, as `checkpointctl show` names it.
    pub fn engine_name(&self) -> &'static str {
        match self.engine {
            Engine::Containerd(_) => <Containerd as CriDaemon>::ENGINE,
            Engine::CriO { .. } => <CriO as CriDaemon>::ENGINE,
        }
    }
}

/// A node's running engine, in the node's mount (`mounts`) and network namespaces.
pub enum NodeEngine<'e> {
    Containerd(Containerd<'e>),
    CriO(CriO),
}

impl<'e> NodeEngine<'e> {
    /// Starts `runtime`'s engine for node `name` (its state in `<test dir>/<name>`), CRIU's
    /// and the plugin's environment `env`, images from `registry`; runc keeps CRIU's logs in
    /// `criu_work` if given (containerd's only).
    pub fn start(
        e: &'e E2e,
        name: &str,
        mounts: PrivateMounts,
        env: &[(&str, OsString)],
        runtime: &Runtime,
        registry: &Registry,
        criu_work: Option<&Path>,
    ) -> NodeEngine<'e> {
        let images = Images::of(registry);
        match &runtime.engine {
            Engine::Containerd(bins) => {
                let config = |d: &Path| {
                    let options = &runtime.cri_runtime_options;
                    cri_config_with(d, bins, registry, &images.pause, criu_work, options)
                };
                NodeEngine::Containerd(Containerd::start_node_mounted(
                    e,
                    name,
                    mounts,
                    env,
                    bins.clone(),
                    Some(&config),
                ))
            }
            Engine::CriO { prefix, runc } => {
                assert!(
                    criu_work.is_none(),
                    "CRI-O's restores go through conmon, which has no runc CriuWorkPath"
                );
                NodeEngine::CriO(CriO::start(
                    e, name, prefix, runc, mounts, env, registry, &images,
                ))
            }
        }
    }

    /// The daemon's pid: its mount namespace is the node's.
    pub fn pid(&self) -> i32 {
        match self {
            NodeEngine::Containerd(cd) => cd.pid(),
            NodeEngine::CriO(c) => c.pid(),
        }
    }

    /// The CRI's socket.
    pub fn socket(&self) -> &Path {
        match self {
            NodeEngine::Containerd(cd) => cd.cri_socket(),
            NodeEngine::CriO(c) => c.cri_socket(),
        }
    }

    /// The parent of the node's cgroups.
    pub fn cgroup_path(&self) -> &str {
        match self {
            NodeEngine::Containerd(cd) => cd.cgroup_path(),
            NodeEngine::CriO(c) => c.cgroup_path(),
        }
    }

    /// The daemon's log, in the node's directory.
    pub fn log_name(&self) -> &'static str {
        match self {
            NodeEngine::Containerd(_) => <Containerd as CriDaemon>::LOG,
            NodeEngine::CriO(_) => <CriO as CriDaemon>::LOG,
        }
    }

    /// Where CRIU's log of the restore of container `id` is kept (`node_dir`: the node's
    /// directory).
    pub fn restore_log(&self, node_dir: &Path, id: &str) -> PathBuf {
        match self {
            NodeEngine::Containerd(cd) => cd.restore_log(node_dir, id),
            NodeEngine::CriO(c) => c.restore_log(node_dir, id),
        }
    }

    /// The newest of the restore logs the test keeps of CRI-O's (`node_dir`: the node's
    /// directory); none of containerd's.
    pub fn newest_restore_log(&self, node_dir: &Path) -> Option<PathBuf> {
        match self {
            NodeEngine::Containerd(_) => None,
            NodeEngine::CriO(_) => crio::newest_kept_restore_log(node_dir),
        }
    }

    /// SIGKILL to the daemon (and containerd's shims), as when the machine is lost.
    pub fn kill_now(&self) {
        match self {
            NodeEngine::Containerd(cd) => cd.kill_now(),
            NodeEngine::CriO(c) => c.kill_now(),
        }
    }

    /// Pushes the test's `images` to their registry, as this engine's tools can.
    pub fn push_images(&self, e: &E2e, images: &Images) {
        match self {
            NodeEngine::Containerd(cd) => push_with_ctr(e, cd, images),
            NodeEngine::CriO(_) => crio::push_images(e, images),
        }
    }
}

fn upstream_containerd(component: &str, runc: Runc) -> ContainerdBins {
    let containerd = upstream(component, "containerd");
    ContainerdBins {
        ctr: upstream(component, "ctr"),
        runc: Some(runc.path()),
        // Where containerd finds its shim.
        bin_dir: containerd.parent().map(PathBuf::from),
        containerd,
        v2: true,
        cgroup2_only: false,
    }
}
