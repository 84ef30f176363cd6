//! A private mount namespace whose `/dev` is a tmpfs holding the few usual nodes plus
//! `/dev/kfd` (a character device the supervisor can open, so that `stat` and `fstat` agree)
//! and `/dev/dri/renderD<minor>` nodes. CRIU and the workload enter it before exec (a workload
//! in a copy of it of its own has its mount namespace dumped by CRIU).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// The namespace, kept alive by an fd of it.
pub struct DevNs {
    fd: OwnedFd,
}

struct Node {
    path: CString,
    mode: u32,
    rdev: u64,
}

fn c(s: &str) -> CString {
    CString::new(s).expect("no NUL in paths")
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// mount(2) of the file system `fs` (its source and its type) at `at` with `flags` and, where
/// given, `options`; no allocation, so it can run between fork and exec.
fn mount_fs(fs: &CStr, at: &CStr, flags: libc::c_ulong, options: Option<&CStr>) -> io::Result<()> {
    let data = options.map_or(std::ptr::null(), |o| o.as_ptr().cast());
    // SAFETY: every pointer is a NUL-terminated string that outlives the call, or null.
    check(unsafe { libc::mount(fs.as_ptr(), at.as_ptr(), fs.as_ptr(), flags, data) })
}

impl DevNs {
    /// Makes the namespace: `/dev/kfd` with device number `kfd_rdev`, a render node per
    /// minor in `render_minors`.
    pub fn new(kfd_rdev: u64, render_minors: &[u32]) -> io::Result<DevNs> {
        let chr = libc::S_IFCHR | 0o666;
        let mut nodes = vec![
            Node {
                path: c("/dev/null"),
                mode: chr,
                rdev: libc::makedev(1, 3),
            },
            Node {
                path: c("/dev/zero"),
                mode: chr,
                rdev: libc::makedev(1, 5),
            },
            Node {
                path: c("/dev/full"),
                mode: chr,
                rdev: libc::makedev(1, 7),
            },
            Node {
                path: c("/dev/random"),
                mode: chr,
                rdev: libc::makedev(1, 8),
            },
            Node {
                path: c("/dev/urandom"),
                mode: chr,
                rdev: libc::makedev(1, 9),
            },
            Node {
                path: c("/dev/tty"),
                mode: chr,
                rdev: libc::makedev(5, 0),
            },
            Node {
                path: c("/dev/kfd"),
                mode: chr,
                rdev: kfd_rdev,
            },
        ];
        for m in render_minors {
            nodes.push(Node {
                path: c(&format!("/dev/dri/renderD{m}")),
                mode: chr,
                rdev: libc::makedev(226, *m),
            });
        }
        let dirs = [c("/dev/dri"), c("/dev/shm"), c("/dev/pts")];
        let links = [
            (c("/proc/self/fd"), c("/dev/fd")),
            (c("/proc/self/fd/0"), c("/dev/stdin")),
            (c("/proc/self/fd/1"), c("/dev/stdout")),
            (c("/proc/self/fd/2"), c("/dev/stderr")),
        ];
        let (root, dev, shm, tmpfs, mode) =
            (c("/"), c("/dev"), c("/dev/shm"), c("tmpfs"), c("mode=755"));
        let (pts, devpts, pts_opts) = (c("/dev/pts"), c("devpts"), c("newinstance,ptmxmode=0666"));
        let mut cmd = Command::new("sleep");
        cmd.arg("600")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: the closure runs between fork and exec and makes only raw system calls on
        // strings prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                check(libc::unshare(libc::CLONE_NEWNS))?;
                check(libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ))?;
                mount_fs(&tmpfs, &dev, libc::MS_NOSUID, Some(&mode))?;
                for d in &dirs {
                    check(libc::mkdir(d.as_ptr(), 0o755))?;
                }
                mount_fs(&tmpfs, &shm, libc::MS_NOSUID | libc::MS_NODEV, None)?;
                mount_fs(
                    &devpts,
                    &pts,
                    libc::MS_NOSUID | libc::MS_NOEXEC,
                    Some(&pts_opts),
                )?;
                for n in &nodes {
                    check(libc::mknod(n.path.as_ptr(), n.mode, n.rdev))?;
                    check(libc::chmod(n.path.as_ptr(), 0o666))?;
                }
                for (target, link) in &links {
                    check(libc::symlink(target.as_ptr(), link.as_ptr()))?;
                }
                Ok(())
            });
        }
        // `spawn` returns once the child has exec'd, so the namespace is ready.
        let mut child = cmd.spawn()?;
        let ns = std::fs::File::open(format!("/proc/{}/ns/mnt", child.id()));
        let _ = child.kill();
        let _ = child.wait();
        Ok(DevNs { fd: ns?.into() })
    }

    /// The namespace's inode number (what `/proc/PID/ns/mnt` of a process in it names).
    pub fn ino(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::File::from(self.fd.try_clone().expect("dup"))
            .metadata()
            .expect("fstat")
            .ino()
    }

    /// Bind-mounts the root directory onto the directory `at` (absolute) in the namespace:
    /// the root CRIU needs (`--root`) to restore a mount namespace (which it then builds on
    /// that mount from its images).
    pub fn bind_root(&self, at: &std::path::Path) -> io::Result<()> {
        let (ns, root) = (self.raw(), c("/"));
        let at = CString::new(at.as_os_str().as_encoded_bytes()).expect("no NUL in paths");
        let mut cmd = Command::new("true");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: the closure runs between fork and exec and makes only raw system calls on
        // strings prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                check(libc::setns(ns, libc::CLONE_NEWNS))?;
                check(libc::mount(
                    root.as_ptr(),
                    at.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ))
            });
        }
        let st = cmd.status()?;
        if st.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("true in the namespace: {st}")))
        }
    }

    /// The namespace's fd, for `setns`.
    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
