//! What CRIU's side and the guardian say to each other over their `SOCK_SEQPACKET` pair.
//!
//! One message per packet, [`LEN`] bytes, little-endian:
//!
//! ```text
//! [version u8 = 1][kind u8][pad u16][action u32][pid i32][pad u32][start u64]
//! ```
//!
//! with at most one descriptor attached (`SCM_RIGHTS`). A packet of another length, version or
//! kind is dropped whole: the guardian never acts on what it cannot read.

use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags};

/// The format's version byte.
const VERSION: u8 = 1;
/// Bytes in one message.
pub const LEN: usize = 24;

/// One message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// Look after `pid` (which started at `start`) with the duty's `action`; the attached
    /// descriptor, if any, is kept while the process is watched.
    Watch { pid: i32, start: u64, action: u32 },
    /// The plugin has undone its work on `pid` itself.
    Forget { pid: i32 },
    /// The run ended well: nothing to undo.
    Release,
    /// From the process that started the guardian, to CRIU: the guardian is `pid` (its pidfd
    /// attached).
    Started { pid: i32 },
    /// CRIU has the guardian: from now on it acts should CRIU end. A guardian whose CRIU never
    /// got this far (its start failed) ends without doing anything.
    Armed,
    /// From the guardian, to CRIU: it holds none of CRIU's sockets and pipes any more (see
    /// `run::keep_only`). CRIU goes on only then: a guardian stopped before it let go of them
    /// would keep CRIU's end of a task's parasite socket open after CRIU's death, and the task
    /// waiting in CRIU's parasite code for good.
    Ready,
}

impl Message {
    fn kind(&self) -> u8 {
        match self {
            Message::Watch { .. } => 1,
            Message::Forget { .. } => 2,
            Message::Release => 3,
            Message::Started { .. } => 4,
            Message::Armed => 5,
            Message::Ready => 6,
        }
    }

    /// The message's bytes.
    pub fn encode(&self) -> [u8; LEN] {
        let (action, pid, start) = match *self {
            Message::Watch { pid, start, action } => (action, pid, start),
            Message::Forget { pid } | Message::Started { pid } => (0, pid, 0),
            Message::Release | Message::Armed | Message::Ready => (0, 0, 0),
        };
        let mut m = [0u8; LEN];
        m[0] = VERSION;
        m[1] = self.kind();
        m[4..8].copy_from_slice(&action.to_le_bytes());
        m[8..12].copy_from_slice(&pid.to_le_bytes());
        m[16..24].copy_from_slice(&start.to_le_bytes());
        m
    }

    /// The message in `m`, `None` for another version or an unknown kind.
    pub fn decode(m: &[u8; LEN]) -> Option<Message> {
        if m[0] != VERSION {
            return None;
        }
        let word = |at: usize| u32::from_le_bytes([m[at], m[at + 1], m[at + 2], m[at + 3]]);
        let action = word(4);
        let pid = word(8) as i32;
        let mut start = [0u8; 8];
        start.copy_from_slice(&m[16..24]);
        let start = u64::from_le_bytes(start);
        match m[1] {
            1 => Some(Message::Watch { pid, start, action }),
            2 => Some(Message::Forget { pid }),
            3 => Some(Message::Release),
            4 => Some(Message::Started { pid }),
            5 => Some(Message::Armed),
            6 => Some(Message::Ready),
            _ => None,
        }
    }
}

/// Sends `msg` (with `fd` attached, if given). Never blocks: a guardian that stopped reading
/// (stopped by `SIGSTOP`, say) must not stop CRIU too.
pub fn send(sock: RawFd, msg: Message, fd: Option<RawFd>) -> io::Result<()> {
    let bytes = msg.encode();
    let iov = [IoSlice::new(&bytes)];
    let fds = fd.map(|fd| [fd]);
    let cmsgs: Vec<ControlMessage<'_>> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
    loop {
        match nix::sys::socket::sendmsg::<()>(sock, &iov, &cmsgs, flags, None) {
            Ok(LEN) => return Ok(()),
            Ok(_) => return Err(io::Error::other("short message")),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// What one receive gave.
#[derive(Debug)]
pub enum Received {
    /// A message, with the descriptor that came with it.
    Message(Message, Option<OwnedFd>),
    /// A packet that is no message of this format: dropped.
    Unreadable,
    /// Every sender has closed its end.
    Eof,
    /// Nothing waiting.
    Empty,
}

/// Receives one packet without waiting.
pub fn recv(sock: RawFd) -> io::Result<Received> {
    let mut bytes = [0u8; LEN];
    // Room for a few descriptors: one is kept, any other is closed.
    let mut control = nix::cmsg_space!([RawFd; 4]);
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC;
    let (n, truncated, raw) = loop {
        let mut iov = [IoSliceMut::new(&mut bytes)];
        match nix::sys::socket::recvmsg::<()>(sock, &mut iov, Some(&mut control), flags) {
            Ok(r) => {
                let mut raw: Vec<RawFd> = Vec::new();
                for c in r.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(mut got) = c {
                        raw.append(&mut got);
                    }
                }
                break (r.bytes, r.flags.contains(MsgFlags::MSG_TRUNC), raw);
            }
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => return Ok(Received::Empty),
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = raw.into_iter().map(|raw| {
        // SAFETY: the kernel installed each received descriptor in this process for us.
        unsafe { OwnedFd::from_raw_fd(raw) }
    });
    // The first is kept; the others close as they drop.
    let fd = fds.next();
    drop(fds);
    if n == 0 {
        return Ok(Received::Eof);
    }
    if n != LEN || truncated {
        return Ok(Received::Unreadable);
    }
    Ok(match Message::decode(&bytes) {
        Some(m) => Received::Message(m, fd),
        None => Received::Unreadable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for m in [
            Message::Watch {
                pid: 1234,
                start: 99_999_999_999,
                action: 7,
            },
            Message::Forget { pid: 5 },
            Message::Release,
            Message::Started { pid: 77 },
            Message::Armed,
            Message::Ready,
        ] {
            assert_eq!(Message::decode(&m.encode()), Some(m));
        }
    }

    #[test]
    fn other_versions_and_kinds_are_dropped() {
        let mut m = Message::Release.encode();
        m[0] = 2;
        assert_eq!(Message::decode(&m), None);
        let mut m = Message::Release.encode();
        m[1] = 99;
        assert_eq!(Message::decode(&m), None);
    }
}
