//! What `suspend` and `resume` did, per process and in total, as text or JSON.

use std::time::Duration;

use serde_json::{Value, json};

use criu_gpu_core::session::Probe;

/// One process the command acted on.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub pid: i32,
    pub comm: String,
    pub before: String,
    pub after: String,
    /// Resident memory when the command started (the plugin's measure of GPU bytes moved is
    /// its change).
    pub rss_before: u64,
    /// GPU bytes moved (host memory gained by a checkpoint, given back by a restore).
    pub bytes: Option<u64>,
    /// Time in the driver calls for it.
    pub took: Duration,
}

impl Outcome {
    pub fn new(p: &Probe, rss: u64) -> Outcome {
        Outcome {
            pid: p.pid,
            comm: p.comm.clone(),
            before: p.state_word(),
            after: p.state_word(),
            rss_before: rss,
            bytes: None,
            took: Duration::ZERO,
        }
    }
}

/// A process left alone, and why.
#[derive(Clone, Debug)]
pub struct Skipped {
    pub pid: i32,
    pub comm: String,
    pub why: String,
}

/// The whole result.
#[derive(Clone, Debug)]
pub struct Report {
    pub command: &'static str,
    pub processes: Vec<Outcome>,
    pub skipped: Vec<Skipped>,
    /// Which processes failed, and why.
    pub failed: Vec<(i32, String)>,
    pub rolled_back: bool,
    pub rollback_failures: Vec<String>,
    pub gpu_free_before: Option<u64>,
    pub gpu_free_after: Option<u64>,
    pub wall: Duration,
}

/// Bytes as MiB with one decimal.
pub fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

impl Report {
    pub fn new(command: &'static str, skipped: Vec<Skipped>) -> Report {
        Report {
            command,
            processes: Vec::new(),
            skipped,
            failed: Vec::new(),
            rolled_back: false,
            rollback_failures: Vec::new(),
            gpu_free_before: None,
            gpu_free_after: None,
            wall: Duration::ZERO,
        }
    }

    /// Records the failures that end the command.
    pub fn fail(&mut self, why: impl Iterator<Item = (i32, String)>) {
        self.failed.extend(why);
    }

    /// The state the command leaves each process in when it succeeds.
    fn goal(&self) -> &'static str {
        if self.command == "suspend" {
            "checkpointed"
        } else {
            "running"
        }
    }

    /// 0 done, 1 failed and everything put back, 3 failed and not everything put back (a
    /// rollback that failed, or a process the driver found neither done nor as it was).
    pub fn exit_code(&self) -> i32 {
        let astray = self
            .processes
            .iter()
            .any(|o| o.after != self.goal() && o.after != o.before);
        match (self.failed.is_empty(), self.rollback_failures.is_empty()) {
            (true, _) => 0,
            (false, true) if !astray => 1,
            (false, _) => 3,
        }
    }

    fn bytes_total(&self) -> u64 {
        self.processes.iter().filter_map(|o| o.bytes).sum()
    }

    /// GPU memory freed (negative: taken) according to NVML, when it answered both times.
    fn gpu_freed(&self) -> Option<i128> {
        Some(i128::from(self.gpu_free_after?) - i128::from(self.gpu_free_before?))
    }

    /// The text for stdout (what was done) and for stderr (what failed and what to do).
    pub fn text(&self) -> (String, String) {
        let mut out = String::new();
        if !self.processes.is_empty() {
            out.push_str(&format!(
                "{:<8} {:<16} {:<13} {:<13} {:>12} {:>10}\n",
                "PID", "COMMAND", "BEFORE", "AFTER", "GPU MEMORY", "TIME"
            ));
        }
        for o in &self.processes {
            out.push_str(&format!(
                "{:<8} {:<16} {:<13} {:<13} {:>12} {:>10}\n",
                o.pid,
                o.comm,
                o.before,
                o.after,
                o.bytes.map_or("-".into(), mib),
                ms(o.took)
            ));
        }
        for s in &self.skipped {
            out.push_str(&format!("skipped: pid {} ({}): {}\n", s.pid, s.comm, s.why));
        }
        // Only what the driver confirmed at the end (see `suspend::verify`).
        let done = self
            .processes
            .iter()
            .filter(|o| o.after == self.goal())
            .count();
        let done = if self.rolled_back { 0 } else { done };
        let verb = if self.command == "suspend" {
            "suspended"
        } else {
            "resumed"
        };
        out.push_str(&format!(
            "total: {done} process(es) {verb}, {} skipped, {} moved {}",
            self.skipped.len(),
            mib(self.bytes_total()),
            if self.command == "suspend" {
                "to host memory"
            } else {
                "back to the GPUs"
            }
        ));
        match self.gpu_freed() {
            _ if self.processes.is_empty() || !self.failed.is_empty() => {}
            Some(f) if f >= 0 => out.push_str(&format!(", GPU memory freed {}", mib(f as u64))),
            Some(f) => out.push_str(&format!(", GPU memory taken {}", mib((-f) as u64))),
            None => out.push_str(", GPU memory freed: unknown (no NVML)"),
        }
        out.push_str(&format!(", {}\n", ms(self.wall)));
        let mut err = String::new();
        for (pid, why) in &self.failed {
            err.push_str(&format!(
                "criu-gpu: {} failed: pid {pid}: {why}\n",
                self.command
            ));
        }
        if self.rolled_back {
            if self.rollback_failures.is_empty() {
                err.push_str(&format!(
                    "criu-gpu: every process was put back as it was found; fix the cause and run `criu-gpu {}` again\n",
                    self.command
                ));
            }
            for f in &self.rollback_failures {
                err.push_str(&format!("criu-gpu: rollback: {f}\n"));
            }
        }
        (out, err)
    }

    pub fn json(&self) -> Value {
        let procs: Vec<Value> = self
            .processes
            .iter()
            .map(|o| {
                json!({
                    "pid": o.pid,
                    "command": o.comm,
                    "before": o.before,
                    "after": o.after,
                    "gpu_bytes": o.bytes,
                    "time_ms": o.took.as_secs_f64() * 1000.0,
                })
            })
            .collect();
        let skipped: Vec<Value> = self
            .skipped
            .iter()
            .map(|s| json!({"pid": s.pid, "command": s.comm, "why": s.why}))
            .collect();
        let failed: Vec<Value> = self
            .failed
            .iter()
            .map(|(pid, why)| json!({"pid": pid, "why": why}))
            .collect();
        json!({
            "command": self.command,
            "ok": self.failed.is_empty(),
            "processes": procs,
            "skipped": skipped,
            "failed": failed,
            "rolled_back": self.rolled_back,
            "rollback_failures": self.rollback_failures,
            "gpu_bytes_total": self.bytes_total(),
            "gpu_memory_freed": self
                .gpu_freed()
                .map(|f| f.clamp(i64::MIN.into(), i64::MAX.into()) as i64),
            "time_ms": self.wall.as_secs_f64() * 1000.0,
        })
    }
}
