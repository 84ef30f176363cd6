//! AMD processes in `resume`: GPU queues a dump left paused (a CRIU killed in the middle of an
//! AMD dump, whose guardian could not restart them) are restarted through each process's own
//! KFD file, as the dump's guardian does.

use std::time::Instant;

use criu_gpu_core::amdgpu::guardian::{Restart, restart_queues_of};

use crate::report::{Outcome, Report, Skipped};

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_default()
}

/// Restarts the paused GPU queues of the processes of `pids` that hold `/dev/kfd`: `None`
/// when none does, else what was done (a process whose queues ran is skipped; one whose
/// queues stay paused failed).
pub fn resume(pids: &[i32]) -> Option<Report> {
    let t = Instant::now();
    let done = restart_queues_of(pids);
    if done.is_empty() {
        return None;
    }
    let mut report = Report::new("resume", Vec::new());
    for (pid, r) in done {
        match r {
            Restart::Restarted(_) => {
                log::warn!("pid {pid}: its AMD GPU queues were paused; they run again");
                report.processes.push(Outcome {
                    pid,
                    comm: comm(pid),
                    before: "queues paused".to_string(),
                    after: "running".to_string(),
                    rss_before: 0,
                    bytes: None,
                    took: t.elapsed(),
                });
            }
            Restart::WasRunning => report.skipped.push(Skipped {
                pid,
                comm: comm(pid),
                why: "its AMD GPU queues run".to_string(),
            }),
            Restart::Failed(e) => report.fail(std::iter::once((
                pid,
                format!("its AMD GPU queues stay paused: {e}"),
            ))),
        }
    }
    report.wall = t.elapsed();
    Some(report)
}
