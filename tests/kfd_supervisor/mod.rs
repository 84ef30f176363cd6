//! A KFD reached through real system calls: a supervisor thread that receives, through
//! seccomp user notification, the `open`/`openat` and KFD/DRM `ioctl` calls of the processes it
//! starts (a workload, CRIU and everything CRIU forks), and answers them from the KFD
//! simulator (`SimKfd`) it holds. See `docs/kfd-seccomp.md` for the design and its limits.
//!
//! - [`seccomp`]: the filter and the notification primitives.
//! - [`answer`]: what each call is answered with.
//! - [`devns`]: the mount namespace with a fake `/dev`.
//! - [`harness`]: what the CRIU tests share (plugin, machines, workload, CRIU runs).

#![allow(dead_code)]

pub mod answer;
pub mod devns;
pub mod harness;
pub mod seccomp;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub use answer::{Model, Role};
pub use devns::DevNs;

/// A character device with minor 0 that this machine can open, whose major CRIU has no
/// handler for: the stand-in for `/dev/kfd` (its file operations never run: every ioctl on it
/// is answered by the supervisor).
pub fn kfd_stand_in() -> Option<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    ["/dev/cpu/0/cpuid", "/dev/vcs"].iter().find_map(|p| {
        let m = std::fs::metadata(p).ok()?;
        std::fs::File::open(p).ok()?;
        (libc::minor(m.rdev()) == 0).then(|| (p.to_string(), m.rdev()))
    })
}

/// Where a filtered process runs: in the namespace `ns`, in directory `cwd` (absolute), with
/// stdin on the namespace's `/dev/null` and stdout and stderr appended to `output`. With
/// `own_ns`, in a mount namespace of its own instead, a copy of `ns` made by `unshare` (so
/// CRIU dumps it and restores it as a new one) in which an empty tmpfs covers each directory
/// of `own_ns` (absolute).
pub struct Inside<'a> {
    pub ns: &'a DevNs,
    pub cwd: &'a std::path::Path,
    pub output: Option<&'a std::path::Path>,
    pub own_ns: Option<&'a [std::path::PathBuf]>,
}

/// The fd a workload gets the listener socket as ([`Supervisor::filter_one_thread`]).
pub const WORKLOAD_CTL_FD: i32 = 100;
/// The fd a workload gets the filter program as.
pub const WORKLOAD_PROG_FD: i32 = 101;

/// Makes `cmd` start inside `inside`.
fn enter(cmd: &mut Command, inside: Inside<'_>) {
    let cstr = |p: &std::path::Path| {
        CString::new(p.as_os_str().as_encoded_bytes()).expect("no NUL in paths")
    };
    let (ns, cwd, output) = (inside.ns.raw(), cstr(inside.cwd), inside.output.map(cstr));
    let own_ns: Option<Vec<CString>> = inside
        .own_ns
        .map(|hidden| hidden.iter().map(|p| cstr(p)).collect());
    let (null, tmpfs) = (
        CString::new("/dev/null").unwrap(),
        CString::new("tmpfs").unwrap(),
    );
    // SAFETY: the closure runs between fork and exec and makes only raw system calls.
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(io::Error::last_os_error());
            if libc::setns(ns, libc::CLONE_NEWNS) < 0 {
                return fail();
            }
            if let Some(hidden) = &own_ns {
                // A copy of `ns`, its mounts private as there.
                if libc::unshare(libc::CLONE_NEWNS) < 0 {
                    return fail();
                }
                for h in hidden {
                    let flags = libc::MS_NOSUID | libc::MS_NODEV;
                    let (t, none) = (tmpfs.as_ptr(), std::ptr::null());
                    if libc::mount(t, h.as_ptr(), t, flags, none) < 0 {
                        return fail();
                    }
                }
            }
            if libc::chdir(cwd.as_ptr()) < 0 {
                return fail();
            }
            // Files opened outside would be on mounts CRIU cannot find in here.
            if let Some(out) = &output {
                let i = libc::open(null.as_ptr(), libc::O_RDONLY);
                let o = libc::open(
                    out.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND,
                    0o644,
                );
                if i < 0
                    || o < 0
                    || libc::dup2(i, 0) < 0
                    || libc::dup2(o, 1) < 0
                    || libc::dup2(o, 2) < 0
                {
                    return fail();
                }
                libc::close(i);
                libc::close(o);
                // Nothing of the test process's may stay open for CRIU to dump (the fds of
                // `filter_one_thread` excepted).
                libc::syscall(libc::SYS_close_range, 3, WORKLOAD_CTL_FD - 1, 0);
                libc::syscall(libc::SYS_close_range, WORKLOAD_PROG_FD + 1, u32::MAX, 0);
            }
            Ok(())
        });
    }
}

/// The supervisor: a thread answering the notifications of every listener sent to it.
pub struct Supervisor {
    ctl_send: OwnedFd,
    addr: String,
    stop: OwnedFd,
    prog: Arc<Vec<libc::sock_filter>>,
    model: Arc<Mutex<Model>>,
    thread: Option<JoinHandle<()>>,
}

fn dgram_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket returns a new fd or -1.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just created, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The abstract Unix address `name` (a NUL, then the name).
fn abstract_addr(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: plain data; all zeroes is a valid (empty) address.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in a.sun_path[1..].iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    (a, len as libc::socklen_t)
}

/// The supervisor's listener socket, bound to the abstract address `name` (so that a
/// workload whose inherited fds are closed can reach it again), and a socket connected to it.
fn listener_sockets(name: &str) -> io::Result<(OwnedFd, OwnedFd)> {
    let (addr, len) = abstract_addr(name);
    let (send, recv) = (dgram_socket()?, dgram_socket()?);
    // SAFETY: `addr` is a valid address of `len` bytes.
    if unsafe { libc::bind(recv.as_raw_fd(), (&raw const addr).cast(), len) } < 0
        // SAFETY: the same address.
        || unsafe { libc::connect(send.as_raw_fd(), (&raw const addr).cast(), len) } < 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok((send, recv))
}

fn lock(m: &Mutex<Model>) -> std::sync::MutexGuard<'_, Model> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Supervisor {
    pub fn start(model: Model) -> io::Result<Supervisor> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let addr = format!(
            "kfd-supervisor-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let (ctl_send, ctl_recv) = listener_sockets(&addr)?;
        // SAFETY: eventfd returns a new fd or -1.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if stop < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just created, owned here.
        let stop = unsafe { OwnedFd::from_raw_fd(stop) };
        let model = Arc::new(Mutex::new(model));
        let (m, stop_copy) = (model.clone(), stop.try_clone()?);
        let thread = std::thread::Builder::new()
            .name("kfd-supervisor".into())
            .spawn(move || serve(&m, ctl_recv, stop_copy))?;
        Ok(Supervisor {
            ctl_send,
            addr,
            stop,
            prog: Arc::new(seccomp::filter_program()),
            model,
            thread: Some(thread),
        })
    }

    /// Makes `cmd` run under the filter, its calls answered here as those of a `role`
    /// process; inside `inside` when given.
    pub fn filter(&self, cmd: &mut Command, role: Role, inside: Option<Inside<'_>>) {
        if let Some(i) = inside {
            enter(cmd, i);
        }
        let ctl = self.ctl_send.as_raw_fd();
        let prog = self.prog.clone();
        let tag = match role {
            Role::Workload => b'W',
            Role::Criu => b'C',
        };
        // SAFETY: the closure runs between fork and exec and makes only raw system calls.
        unsafe { cmd.pre_exec(move || seccomp::install_and_send(&prog, ctl, tag)) };
    }

    /// Lets the workload `cmd` install the filter itself, on one thread: it gets the
    /// listener socket as fd [`WORKLOAD_CTL_FD`] and the filter program (an array of
    /// `struct sock_filter`) as the memfd [`WORKLOAD_PROG_FD`], and is told so by
    /// `KFD_SUPERVISOR_FDS`. A process whose threads have no filter left when CRIU dumps it
    /// can be dumped by a CRIU that runs under one (see `docs/kfd-seccomp.md`). It is told
    /// the supervisor's abstract address too (`KFD_SUPERVISOR_ADDR`), to send a listener of a
    /// later thread to.
    pub fn filter_one_thread(
        &self,
        cmd: &mut Command,
        inside: Option<Inside<'_>>,
    ) -> io::Result<()> {
        let name = CString::new("kfd-supervisor-filter").unwrap();
        // SAFETY: a valid name; returns a new fd or -1.
        let prog = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if prog < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: just created, owned here.
        let prog = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(prog) });
        // SAFETY: the program is plain data viewed as bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                self.prog.as_ptr().cast::<u8>(),
                std::mem::size_of_val(&self.prog[..]),
            )
        };
        std::io::Write::write_all(&mut &prog, bytes)?;
        let ctl = self.ctl_send.as_raw_fd();
        cmd.env(
            "KFD_SUPERVISOR_FDS",
            format!("{WORKLOAD_CTL_FD},{WORKLOAD_PROG_FD}"),
        )
        .env("KFD_SUPERVISOR_ADDR", &self.addr);
        // SAFETY: the closure runs between fork and exec and makes only raw system calls.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 leaves the copies open over exec.
                if libc::dup2(ctl, WORKLOAD_CTL_FD) < 0
                    || libc::dup2(prog.as_raw_fd(), WORKLOAD_PROG_FD) < 0
                {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        if let Some(i) = inside {
            enter(cmd, i);
        }
        Ok(())
    }

    /// The calls answered so far, one line each.
    pub fn log(&self) -> Vec<String> {
        lock(&self.model).log.clone()
    }

    /// Runs `f` on the model (the simulator), between notifications.
    pub fn with_model<R>(&self, f: impl FnOnce(&mut Model) -> R) -> R {
        f(&mut lock(&self.model))
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from `one` to the eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&raw const one).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn readable(fd: BorrowedFd<'_>) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

fn serve(model: &Mutex<Model>, ctl: OwnedFd, stop: OwnedFd) {
    let mut listeners: Vec<(OwnedFd, Role)> = Vec::new();
    loop {
        let mut fds = vec![readable(ctl.as_fd()), readable(stop.as_fd())];
        fds.extend(listeners.iter().map(|(l, _)| readable(l.as_fd())));
        // SAFETY: `fds` is a live array of pollfd.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) } < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        let mut gone = Vec::new();
        for (k, p) in fds[2..].iter().enumerate() {
            let (l, role) = (&listeners[k].0, listeners[k].1);
            if p.revents & libc::POLLIN != 0 {
                let Ok(n) = seccomp::recv(l.as_fd()) else {
                    continue;
                };
                let a = lock(model).handle(l.as_fd(), role, &n);
                // The caller may have been interrupted meanwhile (ENOENT): nothing to do.
                let _ = seccomp::respond(l.as_fd(), n.id, &a);
            } else if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                gone.push(k);
            }
        }
        for k in gone.into_iter().rev() {
            listeners.remove(k);
        }
        if fds[0].revents & libc::POLLIN != 0 {
            if let Ok((tag, l)) = seccomp::recv_listener(ctl.as_fd()) {
                listeners.push((
                    l,
                    if tag == b'W' {
                        Role::Workload
                    } else {
                        Role::Criu
                    },
                ));
            }
        }
    }
}
