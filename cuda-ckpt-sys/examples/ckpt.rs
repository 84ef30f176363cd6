//! A small `cuda-checkpoint`-like command over [`cuda_ckpt_sys::Driver`], for poking at a driver
//! (real or fake) by hand.
//!
//! ```text
//! ckpt [--lib PATH] [--init] COMMAND
//!   version | devices | errors
//!   tid PID | state PID | lock PID [TIMEOUT_MS] | checkpoint PID | unlock PID
//!   restore PID [GPU-old=GPU-new ...]
//!   lock-dirty PID      lock with a non-zero reserved field (what does the driver say?)
//! ```
//! Prints one line per command; exits 1 on a driver error.

use std::process::ExitCode;
use std::time::Instant;

use cuda_ckpt_sys::ffi::CUcheckpointLockArgs;
use cuda_ckpt_sys::{CUresult, Driver, DriverError, GpuPair};

fn pid_arg(args: &[String], i: usize) -> Result<i32, String> {
    args.get(i)
        .ok_or("missing PID")?
        .parse()
        .map_err(|e| format!("bad PID: {e}"))
}

fn run(args: &[String]) -> Result<String, String> {
    let mut i = 0;
    let mut lib = None;
    let mut init = false;
    while let Some(a) = args.get(i) {
        match a.as_str() {
            "--lib" => {
                lib = Some(args.get(i + 1).ok_or("--lib needs a path")?.clone());
                i += 2;
            }
            "--init" => {
                init = true;
                i += 1;
            }
            _ => break,
        }
    }
    let driver = match &lib {
        Some(path) => Driver::open(path),
        None => Driver::open_default(),
    }
    .map_err(|e| e.to_string())?;
    if init {
        driver.init().map_err(|e| e.to_string())?;
    }
    let cmd = args.get(i).map(String::as_str).unwrap_or("version");
    let de = |e: DriverError| e.to_string();
    let t0 = Instant::now();
    let out = match cmd {
        "version" => {
            let v = driver.driver_version().map_err(de)?;
            format!(
                "driver {v} ({}), checkpoint API: {}",
                cuda_ckpt_sys::format_version(v),
                match driver.check_checkpoint_support() {
                    Ok(_) => "yes".to_owned(),
                    Err(e) => e.to_string(),
                }
            )
        }
        "devices" => driver
            .devices()
            .map_err(de)?
            .iter()
            .map(|d| {
                format!(
                    "{} {} {} {} MiB",
                    d.ordinal,
                    d.uuid,
                    d.name,
                    d.total_mem >> 20
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
        "errors" => CUresult::KNOWN
            .iter()
            .map(|(code, ours)| {
                format!(
                    "{} {} name={:?} text={:?}",
                    code.0,
                    ours,
                    driver.error_name(*code),
                    driver.error_string(*code)
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
        "tid" => driver
            .restore_thread_id(pid_arg(args, i + 1)?)
            .map_err(de)?
            .to_string(),
        "state" => driver
            .process_state(pid_arg(args, i + 1)?)
            .map_err(de)?
            .to_string(),
        "lock" => {
            let timeout = match args.get(i + 2) {
                Some(t) => t.parse().map_err(|e| format!("bad timeout: {e}"))?,
                None => 0,
            };
            driver.lock(pid_arg(args, i + 1)?, timeout).map_err(de)?;
            "locked".to_owned()
        }
        "checkpoint" => {
            driver.checkpoint(pid_arg(args, i + 1)?).map_err(de)?;
            "checkpointed".to_owned()
        }
        "restore" => {
            let pairs = args[i + 2..]
                .iter()
                .map(|p| p.parse::<GpuPair>().map_err(|e| e.to_string()))
                .collect::<Result<Vec<_>, _>>()?;
            driver.restore(pid_arg(args, i + 1)?, &pairs).map_err(de)?;
            "restored".to_owned()
        }
        "unlock" => {
            driver.unlock(pid_arg(args, i + 1)?).map_err(de)?;
            "unlocked".to_owned()
        }
        "lock-dirty" => {
            let pid = pid_arg(args, i + 1)?;
            let f = cuda_ckpt_sys::loader::load(lib.as_deref().unwrap_or("libcuda.so.1"))
                .map_err(de)?
                .lock
                .ok_or("no cuCheckpointProcessLock")?;
            let mut a = CUcheckpointLockArgs::with_timeout(1000);
            a.reserved0 = 1;
            // SAFETY: `f` is cuCheckpointProcessLock and `a` a live 64-byte struct.
            let rc = unsafe { f(pid, &mut a) };
            format!("lock with reserved0=1: {rc}")
        }
        other => return Err(format!("unknown command {other:?}")),
    };
    Ok(format!(
        "{out}  [{:.3} ms]",
        t0.elapsed().as_secs_f64() * 1e3
    ))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
