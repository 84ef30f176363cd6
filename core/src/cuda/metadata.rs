//! `gpu-plugin-cuda.img`: what the NVIDIA side knows about a checkpoint, read before anything is
//! restored so that a restore that cannot fit stops early with a clear reason.
//!
//! The GPU memory itself is not here: the driver's checkpoint moves it into each process's own
//! memory, which CRIU writes into its ordinary page images. This file is small, plain text, one
//! record per line, and read with a size bound:
//!
//! ```text
//! gpu-plugin-cuda 1
//! driver <cuDriverGetVersion> <kernel driver release or ->
//! gpu <GPU-uuid> <memory bytes> <bus> <model, rest of line>
//! process <pid in its own pid namespace> <restore tid at dump> <state found: running|locked|checkpointed> <host bytes moved>
//! ```
//!
//! Version 1 readers refuse other versions. Unknown record kinds are refused too: a record this
//! reader does not understand might be one that decides whether the restore can work.

use std::fmt::Write as _;

use cuda_ckpt_sys::GpuUuid;

use super::gpus::Gpu;

/// File name inside CRIU's image directory.
pub const FILE_NAME: &str = "gpu-plugin-cuda.img";
/// Largest file accepted (a few records per GPU and process; 1 MiB is far beyond any tree).
pub const MAX_BYTES: u64 = 1 << 20;
const MAGIC: &str = "gpu-plugin-cuda";
const VERSION: u32 = 1;

/// How the plugin found a process at dump; decides what restore gives back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FoundState {
    /// Running: restore then unlock.
    Running,
    /// Locked by someone else: restore, leave locked.
    Locked,
    /// Already checkpointed by someone else: leave checkpointed.
    Checkpointed,
}

impl FoundState {
    /// The word the image records (and the logs show).
    pub fn as_str(self) -> &'static str {
        match self {
            FoundState::Running => "running",
            FoundState::Locked => "locked",
            FoundState::Checkpointed => "checkpointed",
        }
    }

    fn parse(s: &str) -> Option<FoundState> {
        match s {
            "running" => Some(FoundState::Running),
            "locked" => Some(FoundState::Locked),
            "checkpointed" => Some(FoundState::Checkpointed),
            _ => None,
        }
    }
}

/// One checkpointed CUDA process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessRecord {
    /// Process id in the process's own pid namespace: CRIU restores that one, while the host
    /// pid of a container's process changes when it is restored into a new namespace.
    pub pid: i32,
    /// libcuda's restore thread at dump (informational: restore asks the driver again).
    pub restore_tid: i32,
    /// State at dump.
    pub found: FoundState,
    /// Bytes the checkpoint moved into the process's memory (its resident-set growth).
    pub host_bytes: u64,
}

/// The whole file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaMetadata {
    /// `cuDriverGetVersion` at dump (for example 13000).
    pub driver_version: i32,
    /// Kernel driver release, for example `580.159.04`, when known.
    pub driver_release: Option<String>,
    /// Every GPU of the checkpointing machine.
    pub gpus: Vec<Gpu>,
    /// Every checkpointed process.
    pub processes: Vec<ProcessRecord>,
}

/// At most 80 characters of `s`: a hostile file must not make a megabyte error message.
fn short(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

impl CudaMetadata {
    /// The file's text.
    pub fn encode(&self) -> String {
        let mut s = format!("{MAGIC} {VERSION}\n");
        let _ = writeln!(
            s,
            "driver {} {}",
            self.driver_version,
            self.driver_release.as_deref().unwrap_or("-")
        );
        for g in &self.gpus {
            let _ = writeln!(s, "gpu {} {} {} {}", g.uuid, g.memory, g.bus, g.model);
        }
        for p in &self.processes {
            let _ = writeln!(
                s,
                "process {} {} {} {}",
                p.pid,
                p.restore_tid,
                p.found.as_str(),
                p.host_bytes
            );
        }
        s
    }

    /// Parses the file's text, refusing anything unexpected.
    pub fn decode(text: &str) -> Result<CudaMetadata, String> {
        if text.len() as u64 > MAX_BYTES {
            return Err(format!("{FILE_NAME} is larger than {MAX_BYTES} bytes"));
        }
        let mut lines = text.lines().enumerate();
        match lines.next() {
            Some((_, l)) if l == format!("{MAGIC} {VERSION}") => {}
            Some((_, l)) if l.starts_with(MAGIC) => {
                // The header as written, so that a stray space or character shows.
                return Err(format!(
                    "{FILE_NAME} has format {:?} (first line {:?}); this plugin reads version {VERSION}, written exactly \"{MAGIC} {VERSION}\"",
                    short(l.trim_start_matches(MAGIC).trim()),
                    short(l)
                ));
            }
            _ => return Err(format!("{FILE_NAME} does not start with `{MAGIC}`")),
        }
        let mut md = CudaMetadata {
            driver_version: 0,
            driver_release: None,
            gpus: Vec::new(),
            processes: Vec::new(),
        };
        let mut seen_driver = false;
        for (n, line) in lines {
            let bad = |what: &str| format!("{FILE_NAME} line {}: {what}: {:?}", n + 1, short(line));
            let mut f = line.splitn(5, ' ');
            match f.next() {
                Some("driver") => {
                    md.driver_version = f
                        .next()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| bad("bad driver version"))?;
                    md.driver_release = f.next().filter(|r| *r != "-").map(str::to_string);
                    seen_driver = true;
                }
                Some("gpu") => {
                    let uuid: GpuUuid = f
                        .next()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| bad("bad GPU UUID"))?;
                    let memory = f
                        .next()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| bad("bad GPU memory size"))?;
                    let bus = f.next().ok_or_else(|| bad("no bus"))?.to_string();
                    let model = f.next().ok_or_else(|| bad("no model"))?.to_string();
                    md.gpus.push(Gpu {
                        uuid,
                        model,
                        bus,
                        memory,
                        minor: None,
                    });
                }
                Some("process") => {
                    let mut num = || f.next().and_then(|v| v.parse::<i64>().ok());
                    let pid = num().filter(|p| *p > 0 && *p <= i32::MAX as i64);
                    let tid = num().filter(|p| *p > 0 && *p <= i32::MAX as i64);
                    let (Some(pid), Some(tid)) = (pid, tid) else {
                        return Err(bad("bad pid or thread id"));
                    };
                    let found = f
                        .next()
                        .and_then(FoundState::parse)
                        .ok_or_else(|| bad("bad process state"))?;
                    let host_bytes = f
                        .next()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| bad("bad byte count"))?;
                    md.processes.push(ProcessRecord {
                        pid: pid as i32,
                        restore_tid: tid as i32,
                        found,
                        host_bytes,
                    });
                }
                _ => return Err(bad("unknown record")),
            }
        }
        if !seen_driver {
            return Err(format!("{FILE_NAME} has no driver record"));
        }
        Ok(md)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CudaMetadata {
        CudaMetadata {
            driver_version: 13000,
            driver_release: Some("580.159.04".into()),
            gpus: vec![Gpu {
                uuid: GpuUuid([0xab; 16]),
                model: "NVIDIA H100 80GB HBM3".into(),
                bus: "0000:00:06.0".into(),
                memory: 85_899_345_920,
                minor: None,
            }],
            processes: vec![ProcessRecord {
                pid: 1234,
                restore_tid: 1240,
                found: FoundState::Running,
                host_bytes: 1 << 33,
            }],
        }
    }

    #[test]
    fn a_header_with_a_stray_space_is_shown_as_written() {
        let e = CudaMetadata::decode("gpu-plugin-cuda 1 \n").unwrap_err();
        assert!(e.contains("(first line \"gpu-plugin-cuda 1 \")"), "{e}");
    }

    #[test]
    fn round_trip() {
        let md = sample();
        let text = md.encode();
        assert!(text.starts_with("gpu-plugin-cuda 1\ndriver 13000 580.159.04\ngpu GPU-abab"));
        assert_eq!(CudaMetadata::decode(&text).unwrap(), md);
    }

    #[test]
    fn hostile_input_is_refused_clearly() {
        let good = sample().encode();
        let cases = [
            ("", "does not start"),
            ("gpu-plugin-cuda 2\n", "format \"2\""),
            ("gpu-plugin-cuda 1\n", "no driver record"),
            ("gpu-plugin-cuda 1\ndriver x -\n", "bad driver version"),
            ("gpu-plugin-cuda 1\ndriver 1 -\nwat\n", "unknown record"),
            (
                "gpu-plugin-cuda 1\ndriver 1 -\ngpu GPU-1 2 b m\n",
                "bad GPU UUID",
            ),
            (
                "gpu-plugin-cuda 1\ndriver 1 -\nprocess -5 1 running 0\n",
                "bad pid",
            ),
            (
                "gpu-plugin-cuda 1\ndriver 1 -\nprocess 5 99999999999 running 0\n",
                "bad pid",
            ),
            (
                "gpu-plugin-cuda 1\ndriver 1 -\nprocess 5 6 frozen 0\n",
                "bad process state",
            ),
        ];
        for (text, want) in cases {
            let err = CudaMetadata::decode(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let huge = good.repeat((MAX_BYTES as usize / good.len()) + 2);
        assert!(CudaMetadata::decode(&huge).unwrap_err().contains("larger"));
    }
}
