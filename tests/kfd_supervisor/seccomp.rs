//! Seccomp user notification: the filter that sends a process's KFD-related system calls to
//! the supervisor, and the supervisor's side of a notification (receive, answer, install an
//! fd, read and write the caller's memory, tell which open file a caller's fd is).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

// Request numbers of the listener's ioctls (`_IOWR('!', 0, struct seccomp_notif)` and so on).
const NOTIF_RECV: libc::c_ulong = 0xC050_2100;
const NOTIF_SEND: libc::c_ulong = 0xC018_2101;
const NOTIF_ADDFD: libc::c_ulong = 0x4018_2103;
const USER_NOTIF_FLAG_CONTINUE: u32 = 1;
const ADDFD_FLAG_SEND: u32 = 2;
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
const KCMP_FILE: libc::c_int = 0;

/// ioctl types the supervisor answers: amdkfd (`'K'`) and DRM (`'d'`).
const IOCTL_TYPES: [u32; 2] = [
    (kfd_sys::AMDKFD_IOCTL_BASE as u32) << 8,
    (kfd_sys::DRM_IOCTL_BASE as u32) << 8,
];

fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jeq(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

/// The filter: `open`, `openat`, and `ioctl` with a KFD or DRM request go to the listener;
/// everything else runs. Device mappings are not caught: files that must be mapped are
/// handed out as memfds, which map without help.
pub fn filter_program() -> Vec<libc::sock_filter> {
    let ld = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let ret = (libc::BPF_RET | libc::BPF_K) as u16;
    let and = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;
    vec![
        // 0: arch
        stmt(ld, 4),
        jeq(AUDIT_ARCH_X86_64, 0, 8),
        // 2: nr
        stmt(ld, 0),
        jeq(libc::SYS_openat as u32, 7, 0),
        jeq(libc::SYS_open as u32, 6, 0),
        jeq(libc::SYS_ioctl as u32, 0, 4),
        // 6: low word of the request (args[1])
        stmt(ld, 24),
        stmt(and, 0xff00),
        jeq(IOCTL_TYPES[0], 2, 0),
        jeq(IOCTL_TYPES[1], 1, 0),
        // 10: allow
        stmt(ret, libc::SECCOMP_RET_ALLOW),
        // 11: notify
        stmt(ret, libc::SECCOMP_RET_USER_NOTIF),
    ]
}

/// Installs `prog` on the calling thread (and what it forks or execs) and sends the listener
/// with the tag byte `role` over the datagram socket `ctl`. Only raw system calls: it runs
/// between fork and exec.
///
/// # Safety
///
/// `ctl` must be an open unix datagram socket; `prog` must be a valid classic BPF program.
pub unsafe fn install_and_send(prog: &[libc::sock_filter], ctl: RawFd, role: u8) -> io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut _,
    };
    // SAFETY: a valid program; the kernel copies it.
    let listener = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &fprog as *const libc::sock_fprog,
        )
    };
    if listener < 0 {
        return Err(io::Error::last_os_error());
    }
    let listener = listener as RawFd;
    let mut tag = [role];
    let mut iov = libc::iovec {
        iov_base: tag.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for one fd's control message.
    let mut cbuf = [0u64; 4];
    // SAFETY: msghdr is plain data.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as usize;
    // SAFETY: the control buffer is large enough for one header and one fd.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
        libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(listener);
    }
    // SAFETY: `msg` points at live buffers.
    let rc = unsafe { libc::sendmsg(ctl, &msg, 0) };
    let e = io::Error::last_os_error();
    // SAFETY: the listener was created above; the supervisor has its own copy now.
    unsafe { libc::close(listener) };
    if rc < 0 { Err(e) } else { Ok(()) }
}

/// Receives one listener and its tag from `ctl`.
pub fn recv_listener(ctl: BorrowedFd<'_>) -> io::Result<(u8, OwnedFd)> {
    let mut tag = [0u8];
    let mut iov = libc::iovec {
        iov_base: tag.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; 4];
    // SAFETY: msghdr is plain data.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: `msg` points at live buffers.
    let n = unsafe { libc::recvmsg(ctl.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled the control buffer it was given.
    let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if c.is_null() {
        return Err(io::Error::other("listener message without an fd"));
    }
    // SAFETY: a SCM_RIGHTS message carries at least one fd, now ours.
    let fd = unsafe { libc::CMSG_DATA(c).cast::<RawFd>().read_unaligned() };
    // SAFETY: received with the message; nobody else owns it.
    Ok((tag[0], unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// One pending system call.
pub struct Notif {
    pub id: u64,
    pub pid: u32,
    pub nr: i64,
    pub args: [u64; 6],
}

/// What becomes of a notification.
pub enum Answer {
    /// The kernel runs the call as if nothing had stopped it.
    Continue,
    /// Returns this value.
    Value(i64),
    /// Fails with this errno.
    Errno(i32),
    /// Already answered (an fd installed with the answer).
    Done,
}

pub fn recv(listener: BorrowedFd<'_>) -> io::Result<Notif> {
    // SAFETY: plain data; RECV wants it zeroed.
    let mut n: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: the listener's RECV writes one `seccomp_notif`.
    if unsafe { libc::ioctl(listener.as_raw_fd(), NOTIF_RECV as _, &mut n) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Notif {
        id: n.id,
        pid: n.pid,
        nr: i64::from(n.data.nr),
        args: n.data.args,
    })
}

pub fn respond(listener: BorrowedFd<'_>, id: u64, a: &Answer) -> io::Result<()> {
    let (val, error, flags) = match *a {
        Answer::Continue => (0, 0, USER_NOTIF_FLAG_CONTINUE),
        Answer::Value(v) => (v, 0, 0),
        Answer::Errno(e) => (0, -e, 0),
        Answer::Done => return Ok(()),
    };
    let resp = libc::seccomp_notif_resp {
        id,
        val,
        error,
        flags,
    };
    // SAFETY: SEND reads one `seccomp_notif_resp`.
    if unsafe { libc::ioctl(listener.as_raw_fd(), NOTIF_SEND as _, &resp) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Installs a copy of `src` in the caller of notification `id`; with `send`, the call
/// returns the new fd (and is answered).
pub fn addfd(
    listener: BorrowedFd<'_>,
    id: u64,
    src: BorrowedFd<'_>,
    cloexec: bool,
    send: bool,
) -> io::Result<i32> {
    let a = libc::seccomp_notif_addfd {
        id,
        flags: if send { ADDFD_FLAG_SEND } else { 0 },
        srcfd: src.as_raw_fd() as u32,
        newfd: 0,
        newfd_flags: if cloexec { libc::O_CLOEXEC as u32 } else { 0 },
    };
    // SAFETY: ADDFD reads one `seccomp_notif_addfd`.
    let rc = unsafe { libc::ioctl(listener.as_raw_fd(), NOTIF_ADDFD as _, &a) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Reads `buf.len()` bytes at `addr` of process `pid`.
pub fn read_mem(pid: u32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut _,
        iov_len: buf.len(),
    };
    // SAFETY: `local` is our buffer; the remote range is checked by the kernel.
    let n = unsafe { libc::process_vm_readv(pid as i32, &local, 1, &remote, 1, 0) };
    transferred(n, buf.len())
}

/// The result of a `process_vm_*` call that moved `n` of `len` bytes: a short transfer (a
/// range that ends in unmapped memory) is `EFAULT`.
fn transferred(n: isize, len: usize) -> io::Result<()> {
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != len {
        return Err(io::Error::from_raw_os_error(libc::EFAULT));
    }
    Ok(())
}

/// Writes `buf` at `addr` of process `pid`.
pub fn write_mem(pid: u32, addr: u64, buf: &[u8]) -> io::Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: buf.as_ptr() as *mut _,
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut _,
        iov_len: buf.len(),
    };
    // SAFETY: `local` is our buffer, only read; the remote range is checked by the kernel.
    let n = unsafe { libc::process_vm_writev(pid as i32, &local, 1, &remote, 1, 0) };
    transferred(n, buf.len())
}

/// Reads a `T` (plain data) at `addr` of `pid`.
pub fn read_obj<T: Copy>(pid: u32, addr: u64) -> io::Result<T> {
    let mut v = std::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: the slice covers exactly `v`'s bytes.
    let b = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), size_of::<T>()) };
    read_mem(pid, addr, b)?;
    // SAFETY: every `T` used here is plain data, valid for any bytes.
    Ok(unsafe { v.assume_init() })
}

/// Writes a `T` (plain data) at `addr` of `pid`.
pub fn write_obj<T: Copy>(pid: u32, addr: u64, v: &T) -> io::Result<()> {
    // SAFETY: the slice covers exactly `v`'s bytes, which are initialised plain data.
    let b = unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) };
    write_mem(pid, addr, b)
}

/// Reads a NUL-terminated path at `addr` of `pid` (at most 4 KiB).
pub fn read_path(pid: u32, addr: u64) -> io::Result<String> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 256];
    while out.len() < 4096 {
        // A chunk may cross into an unmapped page: fall back to single bytes there.
        let got = match read_mem(pid, addr + out.len() as u64, &mut chunk) {
            Ok(()) => &chunk[..],
            Err(_) => {
                read_mem(pid, addr + out.len() as u64, &mut chunk[..1])?;
                &chunk[..1]
            }
        };
        if let Some(end) = got.iter().position(|&b| b == 0) {
            out.extend_from_slice(&got[..end]);
            return Ok(String::from_utf8_lossy(&out).into_owned());
        }
        out.extend_from_slice(got);
    }
    Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG))
}

/// Whether fd `fd` of process `pid` is the open file `own` of this process.
pub fn same_file(pid: u32, fd: i32, own: BorrowedFd<'_>) -> bool {
    // SAFETY: kcmp compares kernel objects and touches no memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid as libc::pid_t,
            std::process::id() as libc::pid_t,
            KCMP_FILE,
            fd as libc::c_ulong,
            own.as_raw_fd() as libc::c_ulong,
        )
    };
    rc == 0
}

/// A copy, in this process, of fd `fd` of process `pid`.
pub fn take_fd(pid: u32, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes plain integers.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just opened, owned here.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd takes plain integers and returns a new fd.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
}

/// The tracer of `pid` (`TracerPid` of its status), `None` when untraced or gone.
pub fn tracer_of(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:")?.trim().parse().ok())
        .filter(|&t| t != 0)
}

/// The thread-group id of thread `tid` (what the kernel's KFD calls the process).
pub fn tgid_of(tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok()))
        })
        .unwrap_or(tid)
}
