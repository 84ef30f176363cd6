//! Unit tests of the NVIDIA backend's own logic (no driver needed).

use super::batch::run_each;
use super::error::{Failure, FailureKind, HookFailure, Report, driver_failure};
use super::nvml;
use super::preflight::total_bytes;
use super::restore::list_pids;
use criu_plugin::HookError;
use cuda_ckpt_sys::DriverError;

#[test]
fn sizes_from_images_do_not_wrap() {
    assert_eq!(total_bytes([u64::MAX, 1].into_iter()), u64::MAX);
    assert_eq!(total_bytes([1 << 30, 1 << 30].into_iter()), 2 << 30);
    assert!(nvml::check_free_memory(total_bytes([u64::MAX, 1].into_iter()), 80 << 30, 1).is_err());
}

#[test]
fn long_pid_lists_are_cut() {
    assert_eq!(list_pids(&[1, 2, 3]), "1, 2, 3");
    let many: Vec<i32> = (1..=10).collect();
    assert_eq!(list_pids(&many), "1, 2, 3, 4, 5, 6, 7, 8, and 2 more");
}

#[test]
fn failures_keep_their_errno() {
    assert_eq!(
        Failure::new(FailureKind::Process, libc::EBUSY, "busy").report(),
        HookError::Errno(libc::EBUSY)
    );
    let e = DriverError::InvalidArgument("bad".into());
    let f = driver_failure(7, &e);
    assert_eq!(f.kind, FailureKind::Driver);
    assert_eq!(HookError::from(f).errno(), libc::EINVAL);
    assert_eq!(HookError::from(HookFailure::NotMine), HookError::NotMine);
}

#[test]
fn a_panicking_step_is_that_pid_s_failure() {
    for parallel in [false, true] {
        let r = run_each(&[1, 2, 3], parallel, |pid| {
            if pid == 2 {
                panic!("step failed");
            }
            Ok::<(), DriverError>(())
        });
        let pids: Vec<i32> = r.iter().map(|(p, _, _)| *p).collect();
        assert_eq!(pids, [1, 2, 3]);
        assert!(r[0].1.is_ok() && r[1].1.is_err() && r[2].1.is_ok());
    }
}

#[test]
fn bad_settings_are_kept_for_the_runs_that_need_cuda() {
    use super::settings::CudaSettings;
    let cfg = crate::config::Config::parse(
        "cuda.parallel = maybe\ncuda.lock-timeout-ms = soon\ncuda.backend = cuda-checkpoint\n",
    );
    let s = CudaSettings::from_config(&cfg);
    assert!(s.parallel);
    assert_eq!(s.problems.len(), 3, "{:?}", s.problems);
    assert!(s.problems[2].contains("cuda.backend = cuda-checkpoint (line 3 of the settings)"));
    assert!(s.check("the image holds 1 CUDA process(es)").is_err());
    for good in ["auto", "driver-api"] {
        let s = CudaSettings::from_config(&crate::config::Config::parse(&format!(
            "cuda.backend = {good}\n"
        )));
        assert!(s.problems.is_empty() && s.check("x").is_ok());
    }
}
