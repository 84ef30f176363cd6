//! `gpu-plugin-cuda.img`: what the NVIDIA side knows about a checkpoint, read before anything is
//! restored so that a restore that cannot fit stops early with a clear reason.
//!
//! The GPU memory itself is not here: the driver's checkpoint moves it into each process's own
//! memory, which CRIU writes into its ordinary page images.
//!
//! # Format
//!
//! UTF-8 text, one record per `\n`-terminated line, [`MAX_BYTES`] at most:
//!
//! ```text
//! +-------------------------------------------------------------+
//! | header    gpu-plugin-cuda <major>.<minor>                   |
//! +-------------------------------------------------------------+
//! | records   driver <cuDriverGetVersion> <kernel release or -> |
//! |           gpu <GPU-uuid> <memory bytes> <bus> <model...>    |  one per GPU of the machine
//! |           process <pid> <restore tid> <state> <host bytes>  |  one per CUDA process
//! +-------------------------------------------------------------+
//! | trailer   crc32 <8 lowercase hex digits>                    |  from 1.1 on
//! +-------------------------------------------------------------+
//! ```
//!
//! - `pid` is the process's pid in its own pid namespace, `state` is how the dump found it
//!   (`running`, `locked` or `checkpointed`), `host bytes` what its checkpoint moved into its
//!   memory. `model` is the rest of its line.
//! - The trailer is the CRC-32 (IEEE 802.3, zlib's) of every byte before it, header included.
//!   It is the last line.
//! - A reader reads an image whose major is its own and whose minor is not newer than its own;
//!   it refuses anything else, naming both versions. A new minor adds to the format: readers of
//!   the older minors refuse it rather than misread it, and it still reads them. A new major
//!   changes what records mean.
//! - Unknown record kinds are refused: a record this reader does not understand might be one that
//!   decides whether the restore can work.
//! - Decoding is bounded: the whole file is at most [`MAX_BYTES`], at most [`MAX_GPU_RECORDS`]
//!   and [`MAX_PROCESS_RECORDS`] records are taken, and error messages quote at most 80
//!   characters of a line.
//!
//! | version | header                                  | what changed                          |
//! |---------|-----------------------------------------|---------------------------------------|
//! | 1.0     | `gpu-plugin-cuda 1` (`1.0` also read)   | the first, no checksum                |
//! | 1.1     | `gpu-plugin-cuda 1.1`                   | the `crc32` trailer; written now      |

use std::fmt::Write as _;

use cuda_ckpt_sys::GpuUuid;

use super::gpus::Gpu;

/// File name inside CRIU's image directory.
pub const FILE_NAME: &str = "gpu-plugin-cuda.img";
/// Largest file accepted (a few records per GPU and process; 1 MiB is far beyond any tree).
pub const MAX_BYTES: u64 = 1 << 20;
/// Most `gpu` records taken (a machine has a few dozen GPUs at most).
pub const MAX_GPU_RECORDS: usize = 1024;
/// Most `process` records taken (far more CUDA processes than GPUs could hold contexts for).
pub const MAX_PROCESS_RECORDS: usize = 1 << 15;
const MAGIC: &str = "gpu-plugin-cuda";
const CHECKSUM: &str = "crc32";

/// A version of the format: `major.minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FormatVersion {
    /// Changes when records change meaning: a reader reads only its own major.
    pub major: u32,
    /// Changes when something is added: a reader reads its own minor and older ones.
    pub minor: u32,
}

impl FormatVersion {
    /// What this plugin writes, and the newest it reads.
    pub const CURRENT: FormatVersion = FormatVersion { major: 1, minor: 1 };
    /// The first version: written `gpu-plugin-cuda 1`, no checksum.
    pub const V1_0: FormatVersion = FormatVersion { major: 1, minor: 0 };

    /// Whether an image of this version carries the checksum trailer.
    fn has_checksum(self) -> bool {
        self >= FormatVersion { major: 1, minor: 1 }
    }

    /// Whether a reader of [`FormatVersion::CURRENT`] reads it.
    pub fn readable(self) -> bool {
        self.major == Self::CURRENT.major && self.minor <= Self::CURRENT.minor
    }

    /// `1` (1.0 is written as it was first), `1.1`, or `M.N`.
    fn parse(s: &str) -> Option<FormatVersion> {
        let number = |n: &str| {
            // No sign, no spaces, no leading zeros: one spelling per version.
            let plain = !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
                && (n == "0" || !n.starts_with('0'));
            plain.then(|| n.parse::<u32>().ok()).flatten()
        };
        match s.split_once('.') {
            None => Some(FormatVersion {
                major: number(s)?,
                minor: 0,
            }),
            Some((major, minor)) => Some(FormatVersion {
                major: number(major)?,
                minor: number(minor)?,
            }),
        }
    }
}

impl std::fmt::Display for FormatVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Why an image's metadata cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// More than [`MAX_BYTES`].
    #[error("{FILE_NAME} is larger than {MAX_BYTES} bytes")]
    TooLarge,
    /// Not UTF-8.
    #[error("{FILE_NAME} is not text")]
    NotText,
    /// The first line is not ours.
    #[error("{FILE_NAME} does not start with `{MAGIC}`")]
    NoMagic,
    /// The first line is ours but its version cannot be read (shown as written, shortened).
    #[error(
        "{FILE_NAME} has format {found:?} (first line {first_line:?}); this plugin reads versions {major}.0 to {current}, written \"{MAGIC} <major>.<minor>\"",
        major = FormatVersion::CURRENT.major,
        current = FormatVersion::CURRENT
    )]
    BadHeader {
        /// The version as written.
        found: String,
        /// The whole first line.
        first_line: String,
    },
    /// Another major, or a newer minor.
    #[error(
        "{FILE_NAME} has format {found:?} ({version}), which this plugin does not read: it reads versions {major}.0 to {current}{why}",
        major = FormatVersion::CURRENT.major,
        current = FormatVersion::CURRENT,
        why = if version.major == FormatVersion::CURRENT.major {
            " (the image was written by a newer plugin)"
        } else {
            ""
        }
    )]
    Unsupported {
        /// The version as written.
        found: String,
        /// The version read from it.
        version: FormatVersion,
    },
    /// A version with a checksum whose last line is not one.
    #[error(
        "{FILE_NAME} (format {version}) does not end with its `{CHECKSUM}` line: truncated? (last line {last_line:?})"
    )]
    NoChecksum {
        /// The image's version.
        version: FormatVersion,
        /// Its last line, shortened.
        last_line: String,
    },
    /// The contents do not sum to the recorded checksum.
    #[error(
        "{FILE_NAME} is damaged or was edited: its {CHECKSUM} is {recorded:08x}, its contents sum to {computed:08x}"
    )]
    ChecksumMismatch {
        /// What the trailer records.
        recorded: u32,
        /// What the bytes before it sum to.
        computed: u32,
    },
    /// A record this reader refuses.
    #[error("{FILE_NAME} line {line}: {what}: {text:?}")]
    BadRecord {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        what: &'static str,
        /// The line, shortened.
        text: String,
    },
    /// More records of a kind than any machine has.
    #[error("{FILE_NAME} has more than {limit} {kind} records")]
    TooManyRecords {
        /// `gpu` or `process`.
        kind: &'static str,
        /// The bound.
        limit: usize,
    },
    /// No `driver` record.
    #[error("{FILE_NAME} has no driver record")]
    NoDriver,
}

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

/// The records of a checksummed `text` (everything before its trailer), once the trailer is
/// found and matches.
fn checked_records(text: &str, version: FormatVersion) -> Result<&str, MetadataError> {
    let unterminated = text.strip_suffix('\n').unwrap_or(text);
    let Some(end) = unterminated.rfind('\n') else {
        return Err(MetadataError::NoChecksum {
            version,
            last_line: short(unterminated),
        });
    };
    let (records, last) = (&text[..=end], &unterminated[end + 1..]);
    let recorded = last
        .strip_prefix(CHECKSUM)
        .and_then(|l| l.strip_prefix(' '))
        .filter(|h| h.len() == 8 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| MetadataError::NoChecksum {
            version,
            last_line: short(last),
        })?;
    let computed = crc32fast::hash(records.as_bytes());
    if recorded != computed {
        return Err(MetadataError::ChecksumMismatch { recorded, computed });
    }
    Ok(records)
}

impl CudaMetadata {
    /// The file's text, in [`FormatVersion::CURRENT`].
    pub fn encode(&self) -> String {
        let mut s = format!("{MAGIC} {}\n", FormatVersion::CURRENT);
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
        let sum = crc32fast::hash(s.as_bytes());
        let _ = writeln!(s, "{CHECKSUM} {sum:08x}");
        s
    }

    /// Parses the file as read, refusing anything unexpected.
    pub fn decode_bytes(bytes: &[u8]) -> Result<CudaMetadata, MetadataError> {
        if bytes.len() as u64 > MAX_BYTES {
            return Err(MetadataError::TooLarge);
        }
        CudaMetadata::decode(std::str::from_utf8(bytes).map_err(|_| MetadataError::NotText)?)
    }

    /// Parses the file's text, refusing anything unexpected.
    pub fn decode(text: &str) -> Result<CudaMetadata, MetadataError> {
        Ok(CudaMetadata::decode_versioned(text)?.0)
    }

    /// Parses the file's text; also says which version of the format it was.
    pub fn decode_versioned(text: &str) -> Result<(CudaMetadata, FormatVersion), MetadataError> {
        if text.len() as u64 > MAX_BYTES {
            return Err(MetadataError::TooLarge);
        }
        let first = text.lines().next().unwrap_or("");
        let Some(written) = first.strip_prefix(MAGIC) else {
            return Err(MetadataError::NoMagic);
        };
        let version = written
            .strip_prefix(' ')
            .and_then(FormatVersion::parse)
            .ok_or_else(|| MetadataError::BadHeader {
                // As written, so that a stray space or character shows.
                found: short(written.trim()),
                first_line: short(first),
            })?;
        if !version.readable() {
            return Err(MetadataError::Unsupported {
                found: short(written.trim()),
                version,
            });
        }
        let records = if version.has_checksum() {
            checked_records(text, version)?
        } else {
            text
        };
        let mut md = CudaMetadata {
            driver_version: 0,
            driver_release: None,
            gpus: Vec::new(),
            processes: Vec::new(),
        };
        let mut seen_driver = false;
        for (n, line) in records.lines().enumerate().skip(1) {
            let bad = |what: &'static str| MetadataError::BadRecord {
                line: n + 1,
                what,
                text: short(line),
            };
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
                    if md.gpus.len() == MAX_GPU_RECORDS {
                        return Err(MetadataError::TooManyRecords {
                            kind: "gpu",
                            limit: MAX_GPU_RECORDS,
                        });
                    }
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
                    if md.processes.len() == MAX_PROCESS_RECORDS {
                        return Err(MetadataError::TooManyRecords {
                            kind: "process",
                            limit: MAX_PROCESS_RECORDS,
                        });
                    }
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
            return Err(MetadataError::NoDriver);
        }
        Ok((md, version))
    }
}

#[cfg(test)]
mod tests;
