//! What a helper process answers ([`Reply`]) and its one encoding: a version byte, then the
//! reply, every length bounded. The helper is a copy of the parent, so requests need no
//! encoding; a reply crosses a pipe from a process that may have crashed, been killed half-way
//! or run other code, so a garbled one is an error, never a panic or an unbounded allocation.

use std::time::Duration;

use cuda_ckpt_sys::{CUprocessState, CUresult, CudaError, DriverError, GpuUuid, ProcessState};

use super::super::error::CallError;
use super::super::nvml::GpuMemory;
use super::super::step::{DriverCall, Timed};

/// The encoding's version, the first byte of every reply.
pub const VERSION: u8 = 1;
/// The most GPUs or processes one reply may describe.
pub const MAX_ITEMS: usize = 1 << 16;
/// The longest message one reply may carry.
pub const MAX_TEXT: usize = 4096;
/// The largest reply accepted from a helper.
pub const MAX_REPLY: usize = 1 << 20;

/// A process's state, the driver's error, or `None` when it did not answer in time.
pub type StateAnswer = Option<Result<ProcessState, DriverError>>;

/// What a helper process answers, one variant per request ([`super::Op`]).
#[derive(Debug, PartialEq)]
pub enum Reply {
    /// NVML's memory figures by GPU, or why NVML could not answer.
    Memory(Result<Vec<(GpuUuid, GpuMemory)>, NvmlFailed>),
    /// A process's state and, when it ran, the lock's result; the time spent in the driver.
    StateAndLock {
        /// The state before anything was done.
        state: Result<ProcessState, DriverError>,
        /// The lock's result, when one was asked for.
        lock: Option<Result<(), CallError>>,
        /// Time in the driver.
        in_driver: Duration,
    },
    /// Whether a locked process was unlocked (`false`: it was not locked).
    UnlockIfLocked(Result<bool, DriverError>),
    /// Each process's state, in the order asked.
    States(Vec<(i32, StateAnswer)>),
    /// Each process's step result, or why the helper could not start (`cuInit` failed).
    Steps(Result<Vec<Timed>, DriverError>),
}

/// Why NVML could not answer in the helper, as it said.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NvmlFailed(pub String);

impl Wire for NvmlFailed {
    fn put(&self, out: &mut Vec<u8>) {
        self.0.put(out);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(NvmlFailed(String::get(r)?))
    }
}

/// Why a reply cannot be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// Encoded by another version of the plugin.
    #[error("protocol version {0}, not {VERSION}")]
    Version(u8),
    /// It ends in the middle of a value.
    #[error("cut short")]
    Truncated,
    /// A count or length over its bound.
    #[error("a length of {len}, more than {max}")]
    TooLong {
        /// What it said.
        len: u64,
        /// The bound.
        max: usize,
    },
    /// A tag no value has.
    #[error("an unknown {what} tag {tag}")]
    Tag {
        /// What was being read.
        what: &'static str,
        /// The tag.
        tag: u8,
    },
    /// Bytes left after the reply.
    #[error("{0} byte(s) after the reply")]
    Trailing(usize),
    /// The answer to another request.
    #[error("an answer to another request")]
    Unexpected,
}

/// Encodes `reply`, version first.
pub fn encode(reply: &Reply) -> Vec<u8> {
    let mut out = vec![VERSION];
    reply.put(&mut out);
    out
}

/// Decodes a whole reply.
pub fn decode(bytes: &[u8]) -> Result<Reply, Malformed> {
    let mut r = Reader(bytes);
    match r.u8()? {
        VERSION => {}
        v => return Err(Malformed::Version(v)),
    }
    let reply = Reply::get(&mut r)?;
    match r.0.len() {
        0 => Ok(reply),
        n => Err(Malformed::Trailing(n)),
    }
}

/// The unread rest of a reply.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn len(&mut self, max: usize) -> Result<usize, Malformed> {
        let len = u64::get(self)?;
        if len > max as u64 {
            return Err(Malformed::TooLong { len, max });
        }
        Ok(len as usize)
    }
    fn tag(&mut self, what: &'static str, tags: u8) -> Result<u8, Malformed> {
        match self.u8()? {
            tag if tag < tags => Ok(tag),
            tag => Err(Malformed::Tag { what, tag }),
        }
    }
}

/// A value with an encoding.
trait Wire: Sized {
    fn put(&self, out: &mut Vec<u8>);
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed>;
}

macro_rules! wire_int {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            fn put(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
                Ok(<$t>::from_le_bytes(r.array()?))
            }
        }
    )*};
}
wire_int!(u8, i32, u32, u64);

impl Wire for bool {
    fn put(&self, out: &mut Vec<u8>) {
        u8::from(*self).put(out);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(r.tag("bool", 2)? == 1)
    }
}

impl Wire for String {
    /// At most [`MAX_TEXT`] bytes of it (a message cut there still reads).
    fn put(&self, out: &mut Vec<u8>) {
        let b = &self.as_bytes()[..self.len().min(MAX_TEXT)];
        (b.len() as u64).put(out);
        out.extend_from_slice(b);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        let n = r.len(MAX_TEXT)?;
        Ok(String::from_utf8_lossy(r.take(n)?).into_owned())
    }
}

impl Wire for Duration {
    fn put(&self, out: &mut Vec<u8>) {
        (self.as_nanos().min(u128::from(u64::MAX)) as u64).put(out);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(Duration::from_nanos(u64::get(r)?))
    }
}

impl Wire for ProcessState {
    fn put(&self, out: &mut Vec<u8>) {
        CUprocessState::from(*self).0.put(out);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(CUprocessState(u32::get(r)?).into())
    }
}

impl Wire for GpuUuid {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(GpuUuid(r.array()?))
    }
}

impl Wire for GpuMemory {
    fn put(&self, out: &mut Vec<u8>) {
        self.total.put(out);
        self.free.put(out);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(GpuMemory {
            total: u64::get(r)?,
            free: u64::get(r)?,
        })
    }
}

impl<T: Wire> Wire for Option<T> {
    fn put(&self, out: &mut Vec<u8>) {
        self.is_some().put(out);
        if let Some(v) = self {
            v.put(out);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(match bool::get(r)? {
            true => Some(T::get(r)?),
            false => None,
        })
    }
}

impl<T: Wire, E: Wire> Wire for Result<T, E> {
    fn put(&self, out: &mut Vec<u8>) {
        self.is_err().put(out);
        match self {
            Ok(v) => v.put(out),
            Err(e) => e.put(out),
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(match bool::get(r)? {
            false => Ok(T::get(r)?),
            true => Err(E::get(r)?),
        })
    }
}

impl Wire for () {
    fn put(&self, _: &mut Vec<u8>) {}
    fn get(_: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(())
    }
}

impl<T: Wire> Wire for Vec<T> {
    /// At most [`MAX_ITEMS`] of them.
    fn put(&self, out: &mut Vec<u8>) {
        (self.len().min(MAX_ITEMS) as u64).put(out);
        for v in self.iter().take(MAX_ITEMS) {
            v.put(out);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        let n = r.len(MAX_ITEMS)?;
        // Every item takes a byte at least: no more room than the reply could fill.
        let mut v = Vec::with_capacity(n.min(r.0.len()));
        for _ in 0..n {
            v.push(T::get(r)?);
        }
        Ok(v)
    }
}

impl<A: Wire, B: Wire> Wire for (A, B) {
    fn put(&self, out: &mut Vec<u8>) {
        self.0.put(out);
        self.1.put(out);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok((A::get(r)?, B::get(r)?))
    }
}

impl<A: Wire, B: Wire, C: Wire> Wire for (A, B, C) {
    fn put(&self, out: &mut Vec<u8>) {
        self.0.put(out);
        self.1.put(out);
        self.2.put(out);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok((A::get(r)?, B::get(r)?, C::get(r)?))
    }
}

impl Wire for DriverError {
    /// The driver's answer to a call it knows as is; anything else as its message.
    fn put(&self, out: &mut Vec<u8>) {
        let known = match self {
            DriverError::Cuda(e) => DriverCall::of(e).map(|call| (e, call)),
            _ => None,
        };
        match (known, self) {
            (Some((e, call)), _) => {
                0u8.put(out);
                let n = DriverCall::ALL.iter().position(|c| *c == call).unwrap_or(0);
                (n as u8).put(out);
                e.pid.put(out);
                e.code.0.put(out);
                e.name.put(out);
                e.text.put(out);
            }
            (None, DriverError::InvalidArgument(m)) => {
                1u8.put(out);
                m.put(out);
            }
            (None, other) => {
                1u8.put(out);
                other.to_string().put(out);
            }
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(match r.tag("driver error", 2)? {
            0 => {
                let n = r.u8()?;
                let call = DriverCall::ALL.get(usize::from(n)).ok_or(Malformed::Tag {
                    what: "driver call",
                    tag: n,
                })?;
                DriverError::Cuda(CudaError {
                    call: call.name(),
                    pid: Option::get(r)?,
                    code: CUresult(i32::get(r)?),
                    name: Option::get(r)?,
                    text: Option::get(r)?,
                })
            }
            _ => DriverError::InvalidArgument(String::get(r)?),
        })
    }
}

impl Wire for CallError {
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            CallError::Driver(e) => {
                0u8.put(out);
                e.put(out);
            }
            CallError::Panic { pid, message } => {
                1u8.put(out);
                pid.put(out);
                message.put(out);
            }
            CallError::Helper(m) => {
                2u8.put(out);
                m.put(out);
            }
            CallError::Process(m) => {
                3u8.put(out);
                m.put(out);
            }
            CallError::System { message, errno } => {
                4u8.put(out);
                errno.put(out);
                message.put(out);
            }
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(match r.tag("call error", 5)? {
            0 => CallError::Driver(DriverError::get(r)?),
            1 => CallError::Panic {
                pid: i32::get(r)?,
                message: String::get(r)?,
            },
            2 => CallError::Helper(String::get(r)?),
            3 => CallError::Process(String::get(r)?),
            _ => CallError::System {
                errno: i32::get(r)?,
                message: String::get(r)?,
            },
        })
    }
}

impl Wire for Reply {
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Memory(m) => {
                0u8.put(out);
                m.put(out);
            }
            Reply::StateAndLock {
                state,
                lock,
                in_driver,
            } => {
                1u8.put(out);
                state.put(out);
                lock.put(out);
                in_driver.put(out);
            }
            Reply::UnlockIfLocked(r) => {
                2u8.put(out);
                r.put(out);
            }
            Reply::States(v) => {
                3u8.put(out);
                v.put(out);
            }
            Reply::Steps(v) => {
                4u8.put(out);
                v.put(out);
            }
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, Malformed> {
        Ok(match r.tag("reply", 5)? {
            0 => Reply::Memory(Wire::get(r)?),
            1 => Reply::StateAndLock {
                state: Wire::get(r)?,
                lock: Wire::get(r)?,
                in_driver: Wire::get(r)?,
            },
            2 => Reply::UnlockIfLocked(Wire::get(r)?),
            3 => Reply::States(Wire::get(r)?),
            _ => Reply::Steps(Wire::get(r)?),
        })
    }
}

#[cfg(test)]
mod tests;
