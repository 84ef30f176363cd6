//! Who holds a claim: the record a claim file carries, and what a refused claim tells the
//! operator.
//!
//! The lock says only that *someone* holds the process; the record says who, so that a refusal
//! can name the holder and say what to do. Only the lock's holder writes the file; anyone may
//! read it, unlocked and bounded ([`MAX_RECORD`] bytes, [`MAX_HOLDERS`] lines). Format, text:
//!
//! ```text
//! criu-gpu-plugin claim 1
//! criu 4242 987654
//! guardian 4250 987701
//! ```
//!
//! The first line names the format; each further line is one holder: its role (`criu`: a CRIU
//! run of the plugin, `criu-gpu`: the operator's tool, `guardian`: the process that puts the
//! processes of a CRIU run back should CRIU end first), its pid (in the writer's pid namespace)
//! and its start time (clock ticks since boot, field 22 of `/proc/PID/stat`), which tells the
//! holder from a later process with its pid. The taker's line comes first; holders that get a
//! copy of the lock later (a dump's guardian) are added below. Lines that cannot be read are
//! skipped: a record is advice for a message, never a reason to act.

use std::fmt::Write as _;

use super::super::procfs;

/// The record's first line.
const MAGIC: &str = "criu-gpu-plugin claim 1";
/// The most of a record that is read.
pub const MAX_RECORD: usize = 1024;
/// The most holder lines a record keeps.
pub const MAX_HOLDERS: usize = 8;

/// What a holder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A CRIU run with this plugin (a dump; a restore's claims are its guardian's).
    Criu,
    /// `criu-gpu suspend` or `resume`.
    CriuGpu,
    /// The guardian of a CRIU run: it holds the claims it was given until it is done.
    Guardian,
}

impl Role {
    fn word(self) -> &'static str {
        match self {
            Role::Criu => "criu",
            Role::CriuGpu => "criu-gpu",
            Role::Guardian => "guardian",
        }
    }

    fn from_word(w: &str) -> Option<Role> {
        match w {
            "criu" => Some(Role::Criu),
            "criu-gpu" => Some(Role::CriuGpu),
            "guardian" => Some(Role::Guardian),
            _ => None,
        }
    }

    /// How a message names a holder of this role.
    fn shown(self) -> &'static str {
        match self {
            Role::Criu => "CRIU",
            Role::CriuGpu => "criu-gpu",
            Role::Guardian => "guardian",
        }
    }
}

/// One process that holds a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    pub role: Role,
    pub pid: i32,
    /// Start time, clock ticks since boot.
    pub start: u64,
}

impl Holder {
    /// This process, in `role`; `None` when its start time cannot be read.
    pub fn this(role: Role) -> Option<Holder> {
        let pid = std::process::id() as i32;
        Some(Holder {
            role,
            pid,
            start: procfs::start_time(pid)?,
        })
    }

    /// The guardian `pid`; `None` when it is gone already.
    pub fn guardian(pid: i32) -> Option<Holder> {
        Some(Holder {
            role: Role::Guardian,
            pid,
            start: procfs::start_time(pid)?,
        })
    }
}

/// The record of `holders`, as written into a claim file.
pub fn encode(holders: &[Holder]) -> String {
    let mut s = format!("{MAGIC}\n");
    for h in holders.iter().take(MAX_HOLDERS) {
        let _ = writeln!(s, "{} {} {}", h.role.word(), h.pid, h.start);
    }
    s
}

/// The holders a record names (none when it is not a record).
pub fn decode(bytes: &[u8]) -> Vec<Holder> {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_RECORD)]);
    let mut lines = text.lines();
    if lines.next() != Some(MAGIC) {
        return Vec::new();
    }
    lines
        .filter_map(|l| {
            let mut f = l.split(' ');
            let role = Role::from_word(f.next()?)?;
            let pid = f.next()?.parse().ok().filter(|&p: &i32| p > 0)?;
            let start = f.next()?.parse().ok()?;
            f.next().is_none().then_some(Holder { role, pid, start })
        })
        .take(MAX_HOLDERS)
        .collect()
}

/// Where a recorded holder is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Now {
    /// Running (or sleeping): it will be done by itself.
    Working,
    /// Stopped: `T` (a stop signal) or `t` (a debugger).
    Stopped(char),
    /// Gone (or its pid is another process's now).
    Gone,
}

fn now_of(h: &Holder) -> Now {
    if procfs::start_time(h.pid) != Some(h.start) {
        return Now::Gone;
    }
    match procfs::thread_state(h.pid, h.pid) {
        Some(c @ ('T' | 't')) => Now::Stopped(c),
        // A zombie has closed its descriptors, the lock's too.
        Some('Z' | 'X') | None => Now::Gone,
        Some(_) => Now::Working,
    }
}

/// A claim refused: who holds it, as far as its record and `/proc` tell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldBy {
    /// Each recorded holder and where it is now.
    pub holders: Vec<(Holder, Now)>,
}

impl HeldBy {
    /// The record `bytes` (perhaps empty) checked against `/proc`.
    pub fn from_record(bytes: &[u8]) -> HeldBy {
        HeldBy {
            holders: decode(bytes).iter().map(|h| (*h, now_of(h))).collect(),
        }
    }

    /// A recorded holder that is stopped, if any: it holds the process for good until it
    /// is continued or ended.
    pub fn stopped(&self) -> Option<(Holder, char)> {
        self.holders.iter().find_map(|(h, n)| match n {
            Now::Stopped(c) => Some((*h, *c)),
            _ => None,
        })
    }

    fn working(&self, role: Role) -> Option<Holder> {
        self.holders
            .iter()
            .find(|(h, n)| h.role == role && *n == Now::Working)
            .map(|(h, _)| *h)
    }

    fn recorded(&self, role: Role) -> Option<(Holder, Now)> {
        self.holders.iter().find(|(h, _)| h.role == role).copied()
    }

    /// What holds process `pid` and what the operator can do, as the rest of a sentence that
    /// starts with "pid PID ".
    pub fn describe(&self, pid: i32) -> String {
        let criu = self.recorded(Role::Criu);
        let of_criu = match criu {
            Some((c, Now::Gone)) => format!(" (of CRIU {}, which has ended)", c.pid),
            Some((c, _)) => format!(" (of CRIU {})", c.pid),
            None => String::new(),
        };
        if let Some((h, state)) = self.stopped() {
            let how = if state == 't' {
                "stopped by a debugger (let the debugger continue or detach it)"
            } else {
                "stopped"
            };
            let (whose, then) = match h.role {
                Role::Guardian => (
                    of_criu.clone(),
                    format!(
                        "`kill -CONT {}` lets it finish putting the process back; or end it (`kill -KILL {}`), which frees the process, and run `criu-gpu resume {pid}`",
                        h.pid, h.pid
                    ),
                ),
                Role::Criu => (
                    String::new(),
                    format!(
                        "`kill -CONT {}` lets the run finish; or end it (`kill -KILL {}`), and its guardian puts the process back",
                        h.pid, h.pid
                    ),
                ),
                Role::CriuGpu => (
                    String::new(),
                    format!(
                        "`kill -CONT {}` lets it finish; or end it (`kill -KILL {}`) and run `criu-gpu resume {pid}`",
                        h.pid, h.pid
                    ),
                ),
            };
            return format!(
                "is held by {} {}{whose}, which is {how}: it holds the process until it goes on. {then}",
                h.role.shown(),
                h.pid
            );
        }
        if let Some(c) = self.working(Role::Criu) {
            return format!(
                "is held by CRIU {} right now (a dump or restore of it is under way); it is left to that one: try again once it is done",
                c.pid
            );
        }
        if let Some(t) = self.working(Role::CriuGpu) {
            return format!(
                "is held by criu-gpu {} right now (a suspend or resume of it is under way); try again once it is done",
                t.pid
            );
        }
        if let Some(g) = self.working(Role::Guardian) {
            return match criu {
                Some((c, Now::Gone)) => format!(
                    "is being put back by guardian {} of a CRIU ({}) that ended; try again in a moment",
                    g.pid, c.pid
                ),
                _ => format!(
                    "is held by guardian {}{of_criu} right now; try again in a moment",
                    g.pid
                ),
            };
        }
        "is held by another CRIU or criu-gpu right now (a dump, a restore, a suspend or a resume of it is under way); try again once it is done".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_rubbish_is_no_record() {
        let hs = [
            Holder {
                role: Role::Criu,
                pid: 42,
                start: 7,
            },
            Holder {
                role: Role::Guardian,
                pid: 43,
                start: 9,
            },
        ];
        let text = encode(&hs);
        assert_eq!(text, "criu-gpu-plugin claim 1\ncriu 42 7\nguardian 43 9\n");
        assert_eq!(decode(text.as_bytes()), hs);
        assert!(decode(b"").is_empty());
        assert!(decode(b"criu 42 7\n").is_empty(), "no magic line");
        let odd = "criu-gpu-plugin claim 1\ncriu -1 7\nbad 1 2\ncriu 1 2 3\ncriu-gpu 5 6\n";
        assert_eq!(
            decode(odd.as_bytes()),
            [Holder {
                role: Role::CriuGpu,
                pid: 5,
                start: 6
            }]
        );
        let long = format!("{MAGIC}\n{}", "criu 1 1\n".repeat(10_000));
        assert_eq!(decode(long.as_bytes()).len(), MAX_HOLDERS);
    }

    fn held(hs: &[(Role, i32, Now)]) -> HeldBy {
        HeldBy {
            holders: hs
                .iter()
                .map(|&(role, pid, n)| {
                    (
                        Holder {
                            role,
                            pid,
                            start: 1,
                        },
                        n,
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn a_refusal_names_the_holder_and_what_to_do() {
        let stopped = held(&[
            (Role::Criu, 10, Now::Gone),
            (Role::Guardian, 11, Now::Stopped('T')),
        ])
        .describe(5);
        assert!(
            stopped.contains("guardian 11 (of CRIU 10, which has ended), which is stopped")
                && stopped.contains("`kill -CONT 11`")
                && stopped.contains("criu-gpu resume 5"),
            "{stopped}"
        );
        let rescuing = held(&[
            (Role::Criu, 10, Now::Gone),
            (Role::Guardian, 11, Now::Working),
        ])
        .describe(5);
        assert!(
            rescuing.contains("being put back by guardian 11 of a CRIU (10) that ended"),
            "{rescuing}"
        );
        let dumping = held(&[
            (Role::Criu, 10, Now::Working),
            (Role::Guardian, 11, Now::Working),
        ])
        .describe(5);
        assert!(dumping.contains("held by CRIU 10 right now"), "{dumping}");
        let tool = held(&[(Role::CriuGpu, 12, Now::Stopped('T'))]).describe(5);
        assert!(tool.contains("criu-gpu 12") && tool.contains("kill -CONT 12"));
        assert!(
            HeldBy::default()
                .describe(5)
                .contains("another CRIU or criu-gpu")
        );
    }

    #[test]
    fn a_live_stopped_process_is_seen_stopped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let me = Holder {
            role: Role::Guardian,
            pid,
            start: procfs::start_time(pid).unwrap(),
        };
        let by = || HeldBy::from_record(encode(&[me]).as_bytes());
        assert_eq!(by().holders[0].1, Now::Working);
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let t = std::time::Instant::now();
        while by().stopped().is_none() && t.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(by().stopped(), Some((me, 'T')));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(by().holders[0].1, Now::Gone);
    }
}
