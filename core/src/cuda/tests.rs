//! Unit tests of the NVIDIA backend's own logic (no driver needed).

use super::batch::run_each;
use super::error::{CallError, Failure, FailureKind, Report, call_failure};
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
        HookError::logged(libc::EBUSY)
    );
    let e = DriverError::InvalidArgument("bad".into());
    let f = call_failure(7, &e.clone().into());
    assert_eq!(f.kind, FailureKind::Driver);
    assert_eq!(HookError::from(f.clone()).errno(), libc::EINVAL);
    // The driver's error stays the cause, for callers that look into it.
    let cause = std::error::Error::source(&f).expect("a cause");
    assert_eq!(
        cause.downcast_ref::<CallError>(),
        Some(&CallError::Driver(e))
    );
    // The plugin's own failures are not the driver's, nor EINVAL.
    let helper = call_failure(7, &CallError::Helper("the helper was killed".into()));
    assert_eq!(
        (helper.kind, helper.errno.get()),
        (FailureKind::Helper, libc::EIO)
    );
    assert_eq!(helper.message, "cuda: pid 7: the helper was killed");
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
        // A panic, told as one: never as the driver's "invalid argument".
        let e = r[1].1.clone().unwrap_err();
        assert_eq!(e.kind(), FailureKind::Panic);
        assert_eq!(e.errno(), libc::EIO);
        assert_eq!(
            e.to_string(),
            "internal error while handling pid 2: step failed"
        );
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

#[test]
fn a_gpu_listing_that_is_no_directory_is_named_so() {
    use super::settings::CudaSettings;
    let mut cfg = crate::config::Config::parse("cuda.nvidia-proc = /dev/zero\n");
    let s = CudaSettings::from_config(&cfg);
    assert_eq!(
        s.nvidia_proc_problem().as_deref(),
        Some("cuda.nvidia-proc = /dev/zero (line 1 of the settings) is not a directory")
    );
    cfg.set("cuda.nvidia-proc", "/nonexistent/gpus");
    let s = CudaSettings::from_config(&cfg);
    assert!(s.nvidia_proc_problem().unwrap().ends_with("is missing"));
    cfg.set("cuda.nvidia-proc", "/");
    assert_eq!(CudaSettings::from_config(&cfg).nvidia_proc_problem(), None);
}

#[test]
fn a_dump_that_cannot_use_the_driver_says_why_naming_the_key() {
    use super::dump::DumpRun;
    use super::settings::CudaSettings;
    let why = |text: &str| match DumpRun::start(CudaSettings::from_config(
        &crate::config::Config::parse(text),
    )) {
        Err(why) => why.to_string(),
        Ok(_) => panic!("{text}: the NVIDIA side would run"),
    };
    let e = why("cuda.nvidia-proc = /dev/zero\n");
    assert!(
        e.contains("cuda.nvidia-proc = /dev/zero") && e.contains("not a directory"),
        "{e}"
    );
    let e = why("cuda.nvidia-proc = /\nlibcuda = /nonexistent/libcuda.so.1\n");
    assert!(
        e.contains("libcuda = /nonexistent/libcuda.so.1 (line 2 of the settings)"),
        "{e}"
    );
    let e = why("cuda.nvidia-proc = /\nlibcuda = lib/libcuda.so.1\n");
    assert!(
        e.contains("libcuda = lib/libcuda.so.1") && e.contains("relative path"),
        "{e}"
    );
    let e = why("cuda.nvidia-proc = /\nlibcuda = libc.so.6\n");
    assert!(
        e.contains("libcuda = libc.so.6 (line 2") && e.contains("does not export"),
        "{e}"
    );
    let mut cfg = crate::config::Config::default();
    cfg.unreadable = Some("cannot read /etc/criu/gpu-plugin.conf: it is not UTF-8 text".into());
    let s = CudaSettings::from_config(&cfg);
    assert!(s.check("x").unwrap_err().message.contains("not UTF-8"));
    let Err(e) = DumpRun::start(s).map_err(|e| e.to_string()) else {
        panic!("ran on unread settings");
    };
    assert!(
        e.contains("settings file cannot be read") && e.contains("gpu-plugin.conf"),
        "{e}"
    );
}

#[test]
fn only_a_process_that_holds_an_nvidia_device_is_refused() {
    let me = std::process::id() as i32;
    assert_eq!(
        super::refuse_nvidia_user(me, "why"),
        Err(HookError::NotMine)
    );
    assert_eq!(
        super::refuse_nvidia_user(-1, "why"),
        Err(HookError::NotMine)
    );
}
