//! The command line: `criu-gpu [OPTIONS] COMMAND [ARGS]`, parsed by hand (a few commands and
//! options; no parser crate is needed). Options may come before or after the command.

use std::path::PathBuf;
use std::time::Duration;

/// What to act on: a process tree or a cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A pid and its descendants.
    Pid(i32),
    /// Every process of a cgroup and its sub-cgroups (v1 or v2 path).
    Cgroup(PathBuf),
}

/// One command with its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Lock and checkpoint every CUDA process of the target.
    Suspend { target: Target, timeout: Duration },
    /// Restore and unlock them.
    Resume {
        target: Target,
        device_map: Option<String>,
    },
    /// Show each process's CUDA state.
    Status { target: Target },
    /// Show the GPU state an image holds.
    Inspect { path: PathBuf },
    /// Would the image restore here?
    Check {
        path: PathBuf,
        device_map: Option<String>,
    },
    /// Help, for one command or all.
    Help(Option<String>),
    /// The version.
    Version,
}

/// The whole command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Args {
    pub command: Command,
    /// Machine-readable output on stdout.
    pub json: bool,
    /// `-v`: the library's INFO lines; `-vv`: DEBUG.
    pub verbose: u8,
    /// One process after another instead of all at once.
    pub serial: bool,
}

/// A usage error: what is wrong and which help page says more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub message: String,
    pub command: Option<String>,
}

fn usage(command: Option<&str>, message: impl Into<String>) -> Usage {
    Usage {
        message: message.into(),
        command: command.map(str::to_string),
    }
}

/// The commands, for help and for "did you mean".
pub const COMMANDS: [&str; 6] = ["suspend", "resume", "status", "inspect", "check", "help"];

/// Parses a lock timeout: seconds (`10`, `2.5`) or with a unit (`500ms`, `10s`).
pub fn parse_timeout(text: &str) -> Result<Duration, String> {
    let (num, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        (text, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| {
        format!("--timeout {text:?} is not a number of seconds (e.g. 10, 2.5, 500ms)")
    })?;
    let secs = v * scale;
    if !secs.is_finite() || secs <= 0.0 || secs > f64::from(u32::MAX) / 1000.0 {
        return Err(format!(
            "--timeout {text:?} must be more than 0 and at most 49 days (the driver takes milliseconds in 32 bits)"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_pid(cmd: &str, text: &str) -> Result<i32, Usage> {
    match text.parse::<i32>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(usage(
            Some(cmd),
            format!("{text:?} is not a process id; give a pid or --cgroup PATH"),
        )),
    }
}

/// Parses `argv` without the program name.
pub fn parse<I: IntoIterator<Item = String>>(argv: I) -> Result<Args, Usage> {
    let mut json = false;
    let mut verbose = 0u8;
    let mut serial = false;
    let mut timeout: Option<String> = None;
    let mut device_map: Option<String> = None;
    let mut cgroup: Option<PathBuf> = None;
    let mut help = false;
    let mut words: Vec<String> = Vec::new();
    let mut it = argv.into_iter();
    let value = |it: &mut dyn Iterator<Item = String>, name: &str| {
        it.next()
            .ok_or_else(|| usage(None, format!("{name} needs a value")))
    };
    while let Some(a) = it.next() {
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let take = |it: &mut dyn Iterator<Item = String>| match inline.clone() {
            Some(v) => Ok(v),
            None => value(it, &name),
        };
        match name.as_str() {
            "--json" => json = true,
            "-v" | "--verbose" => verbose = verbose.saturating_add(1),
            "-vv" => verbose = verbose.saturating_add(2),
            "--serial" => serial = true,
            "-h" | "--help" => help = true,
            "-V" | "--version" => words.insert(0, "version".into()),
            "--timeout" | "-t" => timeout = Some(take(&mut it)?),
            "--device-map" => device_map = Some(take(&mut it)?),
            "--cgroup" => cgroup = Some(PathBuf::from(take(&mut it)?)),
            "--" => words.extend(it.by_ref()),
            s if s.starts_with('-') && s.len() > 1 && s.parse::<i64>().is_err() => {
                return Err(usage(
                    words.first().map(String::as_str),
                    format!("unknown option {s}"),
                ));
            }
            _ => words.push(a),
        }
    }
    let mut words = words.into_iter();
    let Some(cmd) = words.next() else {
        return Ok(Args {
            command: Command::Help(None),
            json,
            verbose,
            serial,
        });
    };
    let rest: Vec<String> = words.collect();
    if help {
        return Ok(Args {
            command: Command::Help(Some(cmd)),
            json,
            verbose,
            serial,
        });
    }
    let c = cmd.as_str();
    let target = |rest: &[String]| -> Result<Target, Usage> {
        match (&cgroup, rest) {
            (Some(cg), []) => Ok(Target::Cgroup(cg.clone())),
            (Some(_), [_, ..]) => Err(usage(
                Some(c),
                "give either a pid or --cgroup PATH, not both",
            )),
            (None, [pid]) => Ok(Target::Pid(parse_pid(c, pid)?)),
            (None, []) => Err(usage(
                Some(c),
                format!("{c} needs a TARGET: a pid or --cgroup PATH"),
            )),
            (None, _) => Err(usage(
                Some(c),
                "one pid at a time (its descendants are included); use --cgroup for a group",
            )),
        }
    };
    let path = |rest: &[String]| -> Result<PathBuf, Usage> {
        match rest {
            [p] => Ok(PathBuf::from(p)),
            [] => Err(usage(
                Some(c),
                format!("{c} needs a PATH: an image directory or a checkpoint archive"),
            )),
            _ => Err(usage(Some(c), format!("{c} takes one PATH"))),
        }
    };
    let refuse = |what: &str, given: bool| -> Result<(), Usage> {
        if given {
            Err(usage(Some(c), format!("{what} does not apply to {c}")))
        } else {
            Ok(())
        }
    };
    let command = match c {
        "suspend" => {
            refuse("--device-map", device_map.is_some())?;
            let timeout = match &timeout {
                Some(t) => parse_timeout(t).map_err(|e| usage(Some(c), e))?,
                None => Duration::from_secs(10),
            };
            Command::Suspend {
                target: target(&rest)?,
                timeout,
            }
        }
        "resume" => {
            refuse("--timeout", timeout.is_some())?;
            Command::Resume {
                target: target(&rest)?,
                device_map,
            }
        }
        "status" => {
            refuse("--timeout", timeout.is_some())?;
            refuse("--device-map", device_map.is_some())?;
            Command::Status {
                target: target(&rest)?,
            }
        }
        "inspect" => {
            refuse("--timeout", timeout.is_some())?;
            refuse("--device-map", device_map.is_some())?;
            refuse("--cgroup", cgroup.is_some())?;
            Command::Inspect { path: path(&rest)? }
        }
        "check" => {
            refuse("--timeout", timeout.is_some())?;
            refuse("--cgroup", cgroup.is_some())?;
            Command::Check {
                path: path(&rest)?,
                device_map,
            }
        }
        "help" => match rest.as_slice() {
            [] => Command::Help(None),
            [w] => Command::Help(Some(w.clone())),
            _ => return Err(usage(None, "help takes one command name")),
        },
        "version" => Command::Version,
        other => {
            return Err(usage(
                None,
                format!(
                    "unknown command {other:?}; the commands are {}",
                    COMMANDS.join(", ")
                ),
            ));
        }
    };
    Ok(Args {
        command,
        json,
        verbose,
        serial,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Args, Usage> {
        parse(s.split_whitespace().map(str::to_string))
    }

    #[test]
    fn commands_and_options() {
        let a = p("suspend 42 --timeout 2.5 --json").unwrap();
        assert!(a.json);
        assert_eq!(
            a.command,
            Command::Suspend {
                target: Target::Pid(42),
                timeout: Duration::from_millis(2500)
            }
        );
        let a = p("--cgroup=/sys/fs/cgroup/pids/x resume --device-map A=B").unwrap();
        assert_eq!(
            a.command,
            Command::Resume {
                target: Target::Cgroup("/sys/fs/cgroup/pids/x".into()),
                device_map: Some("A=B".into())
            }
        );
        assert_eq!(
            p("check --help").unwrap().command,
            Command::Help(Some("check".into()))
        );
        assert_eq!(p("").unwrap().command, Command::Help(None));
        assert_eq!(p("--version").unwrap().command, Command::Version);
    }

    #[test]
    fn mistakes_say_what_to_do() {
        for (line, want) in [
            ("suspend", "needs a TARGET"),
            ("suspend abc", "not a process id"),
            ("suspend 1 --cgroup x", "not both"),
            ("inspect", "needs a PATH"),
            ("status 1 --timeout 3", "does not apply"),
            ("frobnicate", "unknown command"),
            ("suspend 1 --bogus", "unknown option"),
            ("suspend 1 --timeout 0", "more than 0"),
            ("suspend 1 --timeout", "needs a value"),
        ] {
            let e = p(line).unwrap_err();
            assert!(e.message.contains(want), "{line}: {e:?}");
        }
    }

    #[test]
    fn timeouts() {
        assert_eq!(parse_timeout("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_timeout("10s").unwrap(), Duration::from_secs(10));
        assert!(parse_timeout("-1").is_err());
        assert!(parse_timeout("nan").is_err());
    }
}
