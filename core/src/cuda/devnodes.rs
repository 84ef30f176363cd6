//! The GPUs' device nodes (`/dev/nvidia<minor>`, NVIDIA's character devices `195:<minor>`): which
//! GPUs a process can reach, as this CRIU sees it and as a dumped or restored task sees it, and
//! the nodes a restored container's `/dev` lacks.
//!
//! The driver reaches a GPU only through its node, opened inside the CUDA process: its mount
//! namespace must show the node and its device cgroup must let it open it. Under runc and
//! containerd CRIU runs in the host's mount namespace, where every GPU's node exists; but for a
//! restore runc first places CRIU in the restored container's new cgroup, with the device rules
//! of the new spec (`criuApplyCgroups`). So at restore the kernel's answer to this process,
//! `access(2)` on the node, is the container's device cgroup's: it is checked without opening
//! the node, so the driver is never reached.
//!
//! What the restored tasks see of `/dev` is another matter: a container's `/dev` is a tmpfs
//! that CRIU restores from the checkpoint, so it holds the checkpointed GPU's node, not the one
//! the new spec gave. [`provide`] adds the nodes of the GPUs the restore goes to.

use std::ffi::CString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FchmodatFlags, Mode, SFlag};
use nix::unistd::AccessFlags;

use cuda_ckpt_sys::GpuUuid;

use super::error::{Cause, FailureKind};
use super::gpu::Gpu;

/// Major number of NVIDIA's GPU device nodes.
pub const NVIDIA_MAJOR: u32 = 195;

/// The node's file name, `nvidia<minor>`.
pub fn node_name(minor: u32) -> String {
    format!("nvidia{minor}")
}

fn nvidia_rdev(minor: u32) -> libc::dev_t {
    libc::makedev(NVIDIA_MAJOR, minor)
}

/// What a file is, in words, for messages.
fn describe(st: &libc::stat) -> String {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFCHR => format!(
            "character device {}:{}",
            libc::major(st.st_rdev),
            libc::minor(st.st_rdev)
        ),
        libc::S_IFBLK => "a block device".into(),
        libc::S_IFREG => "a regular file".into(),
        libc::S_IFDIR => "a directory".into(),
        libc::S_IFLNK => "a symbolic link".into(),
        _ => "a special file".into(),
    }
}

fn is_node_of(st: &libc::stat, minor: u32) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFCHR && st.st_rdev == nvidia_rdev(minor)
}

/// Why a GPU's device node cannot be reached or given to restored tasks.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A path or name with a NUL byte.
    #[error("{0} holds a NUL")]
    Nul(String),
    /// No node at `path`.
    #[error("{0} does not exist")]
    Missing(String),
    /// `stat` failed.
    #[error("{path} cannot be read: {source}")]
    Unreadable {
        /// The node (or `/dev/NAME` of a task).
        path: String,
        /// The system's reason.
        source: io::Error,
    },
    /// Something else than the GPU's node is there.
    #[error("{path} is {what}, not NVIDIA's device {NVIDIA_MAJOR}:{minor}")]
    NotTheNode {
        /// The node.
        path: String,
        /// What is there, in words.
        what: String,
        /// The GPU's minor.
        minor: u32,
    },
    /// The device cgroup refuses the node.
    #[error(
        "{0} is refused by the device cgroup this CRIU runs in (for a restore under runc: the restored container's)"
    )]
    Refused(String),
    /// `access` failed otherwise.
    #[error("{path} cannot be opened: {source}")]
    Unopenable {
        /// The node.
        path: String,
        /// The system's reason.
        source: io::Error,
    },
    /// A task's root cannot be opened.
    #[error("the root of pid {pid} cannot be opened: {source}")]
    Root {
        /// The task.
        pid: i32,
        /// The system's reason.
        source: io::Error,
    },
    /// A task's `/dev` cannot be opened.
    #[error("/dev of pid {pid} cannot be opened: {source}")]
    Dev {
        /// The task.
        pid: i32,
        /// The system's reason.
        source: io::Error,
    },
    /// A restored task's `/dev/NAME` is something else than the GPU's node.
    #[error(
        "/dev/{name} of the restored tasks is {what}, but GPU {uuid} ({bus}) is NVIDIA's device {NVIDIA_MAJOR}:{minor}: it is left as it is and the restore refused"
    )]
    Occupied {
        /// The node's name.
        name: String,
        /// What is there, in words.
        what: String,
        /// The GPU.
        uuid: GpuUuid,
        /// Its PCI address.
        bus: String,
        /// Its minor.
        minor: u32,
    },
    /// The node cannot be made in a restored task's `/dev`.
    #[error(
        "/dev/{name} (GPU {uuid}) is missing in the restored tasks' /dev and cannot be made there: {source}"
    )]
    Unmakeable {
        /// The node's name.
        name: String,
        /// The GPU.
        uuid: GpuUuid,
        /// The system's reason.
        source: io::Error,
    },
}

/// The restored tasks cannot reach a GPU the restore goes to.
impl Cause for NodeError {
    fn errno(&self) -> i32 {
        libc::ENODEV
    }
    fn kind(&self) -> FailureKind {
        FailureKind::Machine
    }
}

fn c_path(p: &Path) -> Result<CString, NodeError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| NodeError::Nul(p.display().to_string()))
}

/// Whether this process can reach GPU `minor` through its node in `dev_dir`: the node is
/// NVIDIA's device `minor` and the device cgroup lets this process read and write it (for a
/// restore under runc: the restored container's cgroup). `Err` says why not.
pub fn check_here(dev_dir: &Path, minor: u32) -> Result<(), NodeError> {
    let path = dev_dir.join(node_name(minor));
    let c = c_path(&path)?;
    let shown = || path.display().to_string();
    let st = match nix::sys::stat::stat(c.as_c_str()) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Err(NodeError::Missing(shown())),
        Err(e) => {
            return Err(NodeError::Unreadable {
                path: shown(),
                source: e.into(),
            });
        }
    };
    if !is_node_of(&st, minor) {
        return Err(NodeError::NotTheNode {
            path: shown(),
            what: describe(&st),
            minor,
        });
    }
    // access(2) asks the device cgroup (v1 rules or the v2 eBPF program) like open(2) would,
    // without reaching the driver.
    if let Err(e) = nix::unistd::access(c.as_c_str(), AccessFlags::R_OK | AccessFlags::W_OK) {
        return Err(match e {
            Errno::EPERM => NodeError::Refused(shown()),
            _ => NodeError::Unopenable {
                path: shown(),
                source: e.into(),
            },
        });
    }
    Ok(())
}

/// The mount namespace of `pid` (`None` for this process: `0`), by inode.
fn mount_ns(pid: i32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let p = if pid == 0 {
        "/proc/self/ns/mnt".to_string()
    } else {
        format!("/proc/{pid}/ns/mnt")
    };
    std::fs::metadata(p).ok().map(|m| m.ino())
}

/// Whether `pid` lives in a mount namespace other than this CRIU's (a container's): only then
/// does it see another `/dev`. `None` when it cannot be told.
pub fn other_mount_ns(pid: i32) -> Option<bool> {
    Some(mount_ns(pid)? != mount_ns(0)?)
}

/// A task's `/dev`, opened through its root without following a symbolic link of the
/// container's (an absolute one would resolve in this CRIU's root).
fn task_dev(pid: i32) -> Result<OwnedFd, NodeError> {
    let root = c_path(Path::new(&format!("/proc/{pid}/root")))?;
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let rfd =
        nix::fcntl::open(root.as_c_str(), flags, Mode::empty()).map_err(|e| NodeError::Root {
            pid,
            source: e.into(),
        })?;
    nix::fcntl::openat(&rfd, c"dev", flags | OFlag::O_NOFOLLOW, Mode::empty()).map_err(|e| {
        NodeError::Dev {
            pid,
            source: e.into(),
        }
    })
}

/// What `dev` (a task's `/dev`) holds under `name`: `None` when nothing.
fn stat_at(dev: &OwnedFd, name: &str) -> Result<Option<libc::stat>, NodeError> {
    let c = CString::new(name).map_err(|_| NodeError::Nul(name.to_string()))?;
    match nix::sys::stat::fstatat(dev, c.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(NodeError::Unreadable {
            path: format!("/dev/{name}"),
            source: e.into(),
        }),
    }
}

/// Of `gpus`, those whose node `pid` sees in its own `/dev` (`None`: its `/dev` cannot be
/// read). A GPU without a known minor is kept.
pub fn seen_by_task(pid: i32, gpus: &[Gpu]) -> Option<Vec<Gpu>> {
    let dev = task_dev(pid).ok()?;
    Some(
        gpus.iter()
            .filter(|g| {
                g.minor.is_none_or(
                    |m| matches!(stat_at(&dev, &node_name(m)), Ok(Some(st)) if is_node_of(&st, m)),
                )
            })
            .cloned()
            .collect(),
    )
}

/// Makes sure restored task `pid` (of another mount namespace than this CRIU) finds the node of
/// every GPU of `targets` in its `/dev`, creating those it lacks as the host's nodes in
/// `dev_dir` are (type, number, mode). Returns what it created, in words; `Err` names a node
/// that is there but is something else, or one that cannot be made.
pub fn provide(pid: i32, targets: &[&Gpu], dev_dir: &Path) -> Result<Vec<String>, NodeError> {
    let dev = task_dev(pid)?;
    let mut made = Vec::new();
    for g in targets {
        let Some(minor) = g.minor else {
            continue;
        };
        let name = node_name(minor);
        match stat_at(&dev, &name)? {
            Some(st) if is_node_of(&st, minor) => continue,
            Some(st) => {
                return Err(NodeError::Occupied {
                    name,
                    what: describe(&st),
                    uuid: g.uuid,
                    bus: g.bus.clone(),
                    minor,
                });
            }
            None => {}
        }
        let host = dev_dir.join(&name);
        let mode = std::fs::metadata(&host)
            .map(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.permissions().mode() & 0o777
            })
            .unwrap_or(0o666);
        let c = CString::new(name.as_str()).map_err(|_| NodeError::Nul(name.clone()))?;
        let perm = Mode::from_bits_truncate(mode as libc::mode_t);
        // mknodat creates a new node and never follows an existing name.
        if let Err(e) =
            nix::sys::stat::mknodat(&dev, c.as_c_str(), SFlag::S_IFCHR, perm, nvidia_rdev(minor))
        {
            return Err(NodeError::Unmakeable {
                name,
                uuid: g.uuid,
                source: e.into(),
            });
        }
        // mknod(2) applies the umask: the mode is set as the host's.
        let _ = nix::sys::stat::fchmodat(&dev, c.as_c_str(), perm, FchmodatFlags::FollowSymlink);
        made.push(format!(
            "/dev/{name} ({NVIDIA_MAJOR}:{minor}, GPU {}, mode {mode:o})",
            g.uuid
        ));
    }
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(minor: Option<u32>) -> Gpu {
        Gpu {
            uuid: GpuUuid([7; 16]),
            model: "M".into(),
            bus: "0000:00:06.0".into(),
            memory: 0,
            minor,
        }
    }

    #[test]
    fn nodes_are_checked_by_type_and_number() {
        let dir = std::env::temp_dir().join(format!("nv-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = check_here(&dir, 3).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
        std::fs::write(dir.join("nvidia3"), "").unwrap();
        let err = check_here(&dir, 3).unwrap_err().to_string();
        assert!(
            err.contains("a regular file, not NVIDIA's device 195:3"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn this_process_shares_its_own_mount_namespace() {
        assert_eq!(other_mount_ns(std::process::id() as i32), Some(false));
        assert_eq!(other_mount_ns(-1), None);
        // Its own /dev holds no stand-in node of minor 250 (nvidia-modeset is 254).
        let seen = seen_by_task(std::process::id() as i32, &[gpu(Some(250)), gpu(None)]);
        assert_eq!(seen.map(|v| v.len()), Some(1));
    }
}
