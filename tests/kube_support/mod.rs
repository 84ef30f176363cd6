//! A Kubernetes cluster that a test starts and stops: etcd and kube-apiserver
//! ([`control_plane`], certificates made by the test in [`pki`]), and nodes ([`node`]), each a
//! kubelet with its own containerd, CRIU and the plugin. Pods are made with `kubectl`
//! ([`pods`]), never by calling a node's CRI, and checkpointed through the kubelet's API.
//!
//! Kubernetes, etcd and the newer runtimes are built from their Go modules by
//! `scripts/build-upstream.sh` into `<repo>/.upstream/<component>/bin/`
//! (`CRIU_GPU_TEST_UPSTREAM` names another directory of that layout).

pub mod amd_scenarios;
pub mod bad_images;
pub mod control_plane;
pub mod crio_scenarios;
pub mod gpu_scenarios;
pub mod hot_swap;
pub mod network;
pub mod node;
pub mod pki;
pub mod pods;
pub mod runtimes;
pub mod scenarios;

use std::path::{Path, PathBuf};

use crate::common;

/// Program `bin` of upstream component `component` (`kubernetes-1.37`, `etcd-3.7`, ...).
pub fn upstream(component: &str, bin: &str) -> PathBuf {
    let base = std::env::var_os("CRIU_GPU_TEST_UPSTREAM")
        .map_or_else(|| Path::new(common::REPO).join(".upstream"), PathBuf::from);
    let p = base.join(component).join("bin").join(bin);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/build-upstream.sh {component} (scripts/test.sh does), set \
         CRIU_GPU_TEST_UPSTREAM, or set GPU_PLUGIN_SKIP_E2E=1 to skip the end-to-end tests",
        p.display()
    );
    p
}
