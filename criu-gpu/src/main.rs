//! `criu-gpu`: the operator's tool for GPU processes and GPU checkpoints, on the CRIU GPU
//! plugin's library. `main` parses the command line, runs one command and turns its result
//! into output and an exit status (0 done, 1 failed, 2 usage, 3 failed and not all put back).

mod amd;
mod archive;
mod args;
mod check;
mod help;
mod images;
mod inspect;
mod mounts;
mod pods;
mod report;
mod suspend;
mod targets;

use std::io::Write as _;

use args::{Args, Command, Usage};

/// A command that failed: what happened and what to do, for stderr; exit status 1 (4 when
/// another CRIU or criu-gpu holds a process).
#[derive(Debug)]
pub struct Failed {
    pub message: String,
    pub code: i32,
}

impl Failed {
    pub fn new(message: impl Into<String>) -> Failed {
        Failed {
            message: message.into(),
            code: 1,
        }
    }

    /// Refused, nothing changed, because another CRIU or criu-gpu holds a target.
    pub fn busy(message: impl Into<String>) -> Failed {
        Failed {
            message: message.into(),
            code: 4,
        }
    }
}

impl From<String> for Failed {
    fn from(message: String) -> Failed {
        Failed::new(message)
    }
}

/// A typed error of a module fails the command with its message (exit status 1).
macro_rules! failed_from {
    ($($error:ty),*) => {$(
        impl From<$error> for Failed {
            fn from(e: $error) -> Failed {
                Failed::new(e.to_string())
            }
        }
    )*};
}
failed_from!(
    help::NoSuchCommand,
    targets::TargetError,
    images::OpenError,
    criu_gpu_core::session::OpenError
);

/// A progress line on stderr.
pub fn progress(line: &str) {
    eprintln!("criu-gpu: {line}");
}

/// The library's log lines on stderr: warnings always, INFO with `-v`, DEBUG with `-vv`.
struct StderrLog(log::LevelFilter);

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= self.0
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!(
                "criu-gpu: {}: {}",
                r.level().as_str().to_lowercase(),
                r.args()
            );
        }
    }
    fn flush(&self) {}
}

fn init_log(verbose: u8) {
    let level = match verbose {
        0 => log::LevelFilter::Warn,
        1 => log::LevelFilter::Info,
        _ => log::LevelFilter::Debug,
    };
    if log::set_boxed_logger(Box::new(StderrLog(level))).is_ok() {
        log::set_max_level(level);
    }
}

/// Writes `text` to stdout; a closed pipe (`| head`) is not an error worth a panic.
fn out(text: &str) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(text.as_bytes());
    let _ = o.flush();
}

fn run(a: &Args) -> Result<i32, Failed> {
    match &a.command {
        Command::Help(cmd) => {
            out(help::page(cmd.as_deref())?);
            Ok(0)
        }
        Command::Version => {
            out(&format!("criu-gpu {}\n", env!("CARGO_PKG_VERSION")));
            Ok(0)
        }
        Command::Suspend { target, timeout } => {
            let pids = targets::resolve(target)?;
            let s = criu_gpu_core::session::Session::open(a.serial)?;
            let r = suspend::suspend(&s, &pids, *timeout)?;
            Ok(emit_report(a, &r))
        }
        Command::Resume { target, device_map } => {
            let pids = targets::resolve(target)?;
            // AMD first: it needs no CUDA driver, which a machine with AMD GPUs may lack.
            let amd = amd::resume(&pids);
            if let Some(r) = &amd
                && !r.failed.is_empty()
            {
                return Ok(emit_report(a, r));
            }
            let s = match (criu_gpu_core::session::Session::open(a.serial), amd) {
                (Ok(s), _) => s,
                (Err(why), Some(r)) => {
                    log::info!("no CUDA processes resumed: {why}");
                    return Ok(emit_report(a, &r));
                }
                (Err(why), None) => return Err(why.into()),
            };
            let r = suspend::resume(&s, &pids, device_map.as_deref())?;
            Ok(emit_report(a, &r))
        }
        Command::Status { target } => {
            let pids = targets::resolve(target)?;
            let s = criu_gpu_core::session::Session::open(a.serial)?;
            let (text, j) = suspend::status(&s, &pids);
            out(&if a.json { format!("{j}\n") } else { text });
            Ok(0)
        }
        Command::Inspect { path } => {
            let set = images::open(path)?;
            let contents = inspect::read(&set);
            let (text, j, sound) = inspect::show(&set, &contents);
            out(&if a.json { format!("{j}\n") } else { text });
            Ok(if sound { 0 } else { 1 })
        }
        Command::Check { path, device_map } => {
            let set = images::open(path)?;
            let contents = inspect::read(&set);
            let cfg = criu_gpu_core::session::load_config()?;
            let v = check::check(&contents, &cfg, device_map.as_deref());
            out(&if a.json {
                format!("{}\n", v.json(&set.source))
            } else {
                v.text(&set.source)
            });
            Ok(if v.ok() { 0 } else { 1 })
        }
    }
}

fn emit_report(a: &Args, r: &report::Report) -> i32 {
    let (text, err) = r.text();
    if a.json {
        out(&format!("{}\n", r.json()));
    } else {
        out(&text);
    }
    eprint!("{err}");
    r.exit_code()
}

fn main() {
    let code = match args::parse(std::env::args().skip(1)) {
        Err(Usage { message, command }) => {
            eprintln!(
                "criu-gpu: {message}\ncriu-gpu: see `criu-gpu help{}`",
                command.map(|c| format!(" {c}")).unwrap_or_default()
            );
            2
        }
        Ok(a) => {
            init_log(a.verbose);
            match run(&a) {
                Ok(code) => code,
                Err(f) => {
                    eprintln!("criu-gpu: {}", f.message);
                    f.code
                }
            }
        }
    };
    std::process::exit(code);
}
