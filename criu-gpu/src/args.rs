//! The command line: `criu-gpu [OPTIONS] COMMAND [ARGS]`. clap reads the words; every option
//! is global, so that options may come before or after the command as they always could, and
//! which option applies to which command, the messages and the help pages (`help`) stay this
//! tool's own.

use std::path::PathBuf;
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{ArgAction, Parser, ValueEnum};

use crate::pods;

/// What to act on: a process tree, a cgroup or a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A pid and its descendants.
    Pid(i32),
    /// Every process of a cgroup and its sub-cgroups (v1 or v2 path).
    Cgroup(PathBuf),
    /// Every process of a Kubernetes pod of this node, found through the kubelet's
    /// podLogsDir `logs` and the pod's cgroup.
    Pod {
        namespace: String,
        name: String,
        logs: PathBuf,
    },
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

/// Why a `--timeout` value is refused.
#[derive(Debug, thiserror::Error)]
pub enum BadTimeout {
    /// Not a number.
    #[error("--timeout {0:?} is not a number of seconds (e.g. 10, 2.5, 500ms)")]
    NotANumber(String),
    /// Zero, negative or beyond what the driver takes.
    #[error(
        "--timeout {0:?} must be more than 0 and at most 49 days (the driver takes milliseconds in 32 bits)"
    )]
    OutOfRange(String),
}

/// Parses a lock timeout: seconds (`10`, `2.5`) or with a unit (`500ms`, `10s`).
pub fn parse_timeout(text: &str) -> Result<Duration, BadTimeout> {
    let (num, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        (text, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| BadTimeout::NotANumber(text.to_string()))?;
    let secs = v * scale;
    if !secs.is_finite() || secs <= 0.0 || secs > f64::from(u32::MAX) / 1000.0 {
        return Err(BadTimeout::OutOfRange(text.to_string()));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_pid(cmd: &str, text: &str) -> Result<i32, Usage> {
    match text.parse::<i32>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(usage(
            Some(cmd),
            format!(
                "{text:?} is not a process id; give a pid, --cgroup PATH or --pod NAMESPACE/NAME"
            ),
        )),
    }
}

/// `--pod NAMESPACE/NAME`, each a Kubernetes name.
fn parse_pod(cmd: &str, text: &str, logs: Option<PathBuf>) -> Result<Target, Usage> {
    let Some((namespace, name)) = text.split_once('/') else {
        return Err(usage(
            Some(cmd),
            format!("--pod {text:?} is not NAMESPACE/NAME (e.g. --pod default/train)"),
        ));
    };
    // A namespace is a DNS label (no dots, 63 bytes at most), a pod name a DNS subdomain.
    let namespace_ok =
        !namespace.contains('.') && namespace.len() <= 63 && pods::is_dns1123_subdomain(namespace);
    for (what, s, ok, rule) in [
        (
            "namespace",
            namespace,
            namespace_ok,
            "no dots, at most 63 characters",
        ),
        (
            "pod name",
            name,
            pods::is_dns1123_subdomain(name),
            "'.' between labels, at most 253 characters",
        ),
    ] {
        if !ok {
            return Err(usage(
                Some(cmd),
                format!(
                    "--pod {text:?}: {what} {s:?} is no Kubernetes name (lowercase letters, digits and '-', starting and ending with a letter or digit; {rule})"
                ),
            ));
        }
    }
    Ok(Target::Pod {
        namespace: namespace.to_string(),
        name: name.to_string(),
        logs: logs.unwrap_or_else(|| PathBuf::from(pods::DEFAULT_POD_LOGS)),
    })
}

/// The words as clap reads them: `[OPTIONS] [COMMAND] [WORDS]...`, options anywhere; [`parse`]
/// makes an [`Args`] of them.
#[derive(Parser, Debug)]
#[command(
    name = "criu-gpu",
    disable_help_flag = true,
    disable_version_flag = true,
    args_override_self = true
)]
struct Line {
    #[arg(value_enum)]
    command: Option<Word>,
    /// The command's words (a pid, a path, a command name): how many and what they must be
    /// depends on the command and the options, so [`parse`] checks them.
    #[arg(allow_negative_numbers = true)]
    words: Vec<String>,
    #[arg(long)]
    json: bool,
    #[arg(short, long, action = ArgAction::Count)]
    verbose: u8,
    #[arg(long)]
    serial: bool,
    #[arg(short, long)]
    help: bool,
    #[arg(short = 'V', long)]
    version: bool,
    #[arg(short, long)]
    timeout: Option<String>,
    #[arg(long)]
    device_map: Option<String>,
    #[arg(long)]
    cgroup: Option<PathBuf>,
    #[arg(long)]
    pod: Option<String>,
    #[arg(long)]
    pod_logs: Option<PathBuf>,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Word {
    Suspend,
    Resume,
    Status,
    Inspect,
    Check,
    Help,
    #[value(hide = true)]
    Version,
}

/// clap's refusal in this tool's words.
fn refusal(e: &clap::Error, command: Option<&str>) -> Usage {
    let context = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    // The argument as typed (`--timeout`), without clap's `<VALUE>`.
    let arg = context(ContextKind::InvalidArg);
    let arg = arg.split_whitespace().next().unwrap_or_default();
    let value = context(ContextKind::InvalidValue);
    let message = match e.kind() {
        ErrorKind::InvalidValue if arg == "[COMMAND]" => {
            return usage(
                None,
                format!(
                    "unknown command {value:?}; the commands are {}",
                    COMMANDS.join(", ")
                ),
            );
        }
        ErrorKind::UnknownArgument => format!("unknown option {arg}"),
        ErrorKind::InvalidValue | ErrorKind::NoEquals if value.is_empty() => {
            format!("{arg} needs a value")
        }
        _ => {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            first.strip_prefix("error: ").unwrap_or(first).to_string()
        }
    };
    usage(command, message)
}

/// Parses `argv` without the program name.
pub fn parse<I: IntoIterator<Item = String>>(argv: I) -> Result<Args, Usage> {
    let argv: Vec<String> = argv.into_iter().collect();
    let named = argv
        .iter()
        .find(|a| COMMANDS.contains(&a.as_str()))
        .map(String::as_str);
    let line =
        Line::try_parse_from(std::iter::once("criu-gpu").chain(argv.iter().map(String::as_str)))
            .map_err(|e| refusal(&e, named))?;
    let Line {
        command: word,
        words: rest,
        json,
        verbose,
        serial,
        help,
        version,
        timeout,
        device_map,
        cgroup,
        pod,
        pod_logs,
    } = line;
    let args = |command| Args {
        command,
        json,
        verbose,
        serial,
    };
    if version {
        return Ok(args(Command::Version));
    }
    let Some(word) = word else {
        return Ok(args(Command::Help(None)));
    };
    let name = word
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default();
    let c = name.as_str();
    if help {
        return Ok(args(Command::Help(Some(name))));
    }
    let target = |rest: &[String]| -> Result<Target, Usage> {
        if pod_logs.is_some() && pod.is_none() {
            return Err(usage(
                Some(c),
                "--pod-logs DIR applies only with --pod NAMESPACE/NAME",
            ));
        }
        let both =
            |a: &str, b: &str| Err(usage(Some(c), format!("give either {a} or {b}, not both")));
        match (&cgroup, &pod, rest) {
            (Some(_), Some(_), _) => both("--cgroup PATH", "--pod NAMESPACE/NAME"),
            (Some(_), None, [_, ..]) => both("a pid", "--cgroup PATH"),
            (None, Some(_), [_, ..]) => both("a pid", "--pod NAMESPACE/NAME"),
            (Some(cg), None, []) => Ok(Target::Cgroup(cg.clone())),
            (None, Some(p), []) => parse_pod(c, p, pod_logs.clone()),
            (None, None, [pid]) => Ok(Target::Pid(parse_pid(c, pid)?)),
            (None, None, []) => Err(usage(
                Some(c),
                format!("{c} needs a TARGET: a pid, --cgroup PATH or --pod NAMESPACE/NAME"),
            )),
            (None, None, _) => Err(usage(
                Some(c),
                "one pid at a time (its descendants are included); use --cgroup or --pod for a group",
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
    let command = match word {
        Word::Suspend => {
            refuse("--device-map", device_map.is_some())?;
            let timeout = match &timeout {
                Some(t) => parse_timeout(t).map_err(|e| usage(Some(c), e.to_string()))?,
                None => Duration::from_secs(10),
            };
            Command::Suspend {
                target: target(&rest)?,
                timeout,
            }
        }
        Word::Resume => {
            refuse("--timeout", timeout.is_some())?;
            Command::Resume {
                target: target(&rest)?,
                device_map,
            }
        }
        Word::Status => {
            refuse("--timeout", timeout.is_some())?;
            refuse("--device-map", device_map.is_some())?;
            Command::Status {
                target: target(&rest)?,
            }
        }
        Word::Inspect => {
            refuse("--timeout", timeout.is_some())?;
            refuse("--device-map", device_map.is_some())?;
            refuse("--cgroup", cgroup.is_some())?;
            refuse("--pod", pod.is_some())?;
            refuse("--pod-logs", pod_logs.is_some())?;
            Command::Inspect { path: path(&rest)? }
        }
        Word::Check => {
            refuse("--timeout", timeout.is_some())?;
            refuse("--cgroup", cgroup.is_some())?;
            refuse("--pod", pod.is_some())?;
            refuse("--pod-logs", pod_logs.is_some())?;
            Command::Check {
                path: path(&rest)?,
                device_map,
            }
        }
        Word::Help => match rest.as_slice() {
            [] => Command::Help(None),
            [w] => Command::Help(Some(w.clone())),
            _ => return Err(usage(None, "help takes one command name")),
        },
        Word::Version => Command::Version,
    };
    Ok(args(command))
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
        assert_eq!(
            p("status --pod kube-system/coredns-5d78c9869d-abcde")
                .unwrap()
                .command,
            Command::Status {
                target: Target::Pod {
                    namespace: "kube-system".into(),
                    name: "coredns-5d78c9869d-abcde".into(),
                    logs: "/var/log/pods".into()
                }
            }
        );
        assert_eq!(
            p("resume --pod-logs /srv/pods --pod=ml/train.v2")
                .unwrap()
                .command,
            Command::Resume {
                target: Target::Pod {
                    namespace: "ml".into(),
                    name: "train.v2".into(),
                    logs: "/srv/pods".into()
                },
                device_map: None
            }
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
            ("suspend --pod train", "not NAMESPACE/NAME"),
            (
                "suspend --pod default/",
                "pod name \"\" is no Kubernetes name",
            ),
            (
                "suspend --pod /train",
                "namespace \"\" is no Kubernetes name",
            ),
            ("suspend --pod Default/train", "namespace \"Default\""),
            ("suspend --pod default/my_pod", "pod name \"my_pod\""),
            ("suspend --pod default/a/b", "pod name \"a/b\""),
            ("suspend --pod default/-x", "is no Kubernetes name"),
            ("suspend --pod", "needs a value"),
            (
                "suspend 1 --pod default/train",
                "a pid or --pod NAMESPACE/NAME, not both",
            ),
            (
                "status --cgroup x --pod default/train",
                "--cgroup PATH or --pod",
            ),
            ("suspend 1 --pod-logs /x", "applies only with --pod"),
            ("resume --cgroup x --pod-logs /x", "applies only with --pod"),
            (
                "inspect ./img --pod default/train",
                "--pod does not apply to inspect",
            ),
            (
                "check ./img --pod-logs /x",
                "--pod-logs does not apply to check",
            ),
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
