//! The container runtimes a node can run: containerd 2.1 (Debian's) and the releases built
//! from their Go modules (2.3 and 2.4), each with runc 1.4 (Debian's) or 1.5 (built).

use std::path::PathBuf;

use super::upstream;
use crate::containers_support::cri::gpu_node::runc_1_4;
use crate::containers_support::engines::ContainerdBins;

/// A node's runtime: containerd and runc, the lines its CRI runtime table adds, and the
/// kubelet's deadline for its calls to it.
#[derive(Clone, Debug)]
pub struct Runtime {
    pub bins: ContainerdBins,
    pub cri_runtime_options: String,
    /// The kubelet's `runtimeRequestTimeout` in seconds (its default: 120): the deadline of
    /// every CRI call, and of a checkpoint unless the API's `?timeout=` is longer.
    pub request_timeout_s: u64,
    /// Whether runc keeps CRIU's restore log in `<node>/criu-work` (its `CriuWorkPath`):
    /// containerd deletes a failed restore's work directory, CRIU's log with it.
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
            bins: ContainerdBins::v2026(runc.path()),
            cri_runtime_options: String::new(),
            request_timeout_s: 120,
            keep_criu_logs: false,
        }
    }

    /// containerd 2.3 built from its module; `restore_via_create` sets the CRI's
    /// `enable_experimental_restore_via_create` (off by default from 2.3.4).
    pub fn containerd_2_3(runc: Runc, restore_via_create: bool) -> Runtime {
        Runtime {
            bins: upstream_containerd("containerd-2.3", runc),
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
            bins: upstream_containerd("containerd-2.4", runc),
            cri_runtime_options: String::new(),
            request_timeout_s: 120,
            keep_criu_logs: false,
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
