//! The shared harness is the `criu-gpu-test-support` crate (`test-support/`); this module only
//! names it for `tests/kfd_module.rs`, whose support code reaches it as `common`.

pub use criu_gpu_test_support::release_plugin;
