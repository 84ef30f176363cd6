//! GPU UUIDs in the form `nvidia-smi` and `cuda-checkpoint --device-map` use:
//! `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (lower-case hex of the 16 raw `CUuuid` bytes).

use std::fmt;
use std::str::FromStr;

use crate::ffi::{CUcheckpointGpuPair, CUuuid};

/// A GPU UUID (the 16 bytes `cuDeviceGetUuid` returns).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct GpuUuid(pub [u8; 16]);

/// Lengths of the five hyphen-separated hex groups.
const GROUPS: [usize; 5] = [8, 4, 4, 4, 12];

impl GpuUuid {
    /// The raw bytes.
    pub const fn bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl From<CUuuid> for GpuUuid {
    fn from(value: CUuuid) -> Self {
        Self(value.bytes)
    }
}

impl From<GpuUuid> for CUuuid {
    fn from(value: GpuUuid) -> Self {
        CUuuid { bytes: value.0 }
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU")?;
        let mut bytes = self.0.iter();
        for group in GROUPS {
            f.write_str("-")?;
            for _ in 0..group / 2 {
                // GROUPS sums to 32 hex digits = 16 bytes, so the iterator never runs dry.
                if let Some(b) = bytes.next() {
                    write!(f, "{b:02x}")?;
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Why a string is not a GPU UUID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseUuidError(pub String);

impl fmt::Display for ParseUuidError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not a GPU UUID (want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx): {:?}",
            self.0
        )
    }
}

impl std::error::Error for ParseUuidError {}

impl FromStr for GpuUuid {
    type Err = ParseUuidError;

    /// Accepts `GPU-` followed by the 8-4-4-4-12 hex groups, in either case. The `GPU-` prefix may be
    /// left out (a bare UUID as some tools print it).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseUuidError(s.to_owned());
        let body = s.trim();
        let body = body
            .strip_prefix("GPU-")
            .or_else(|| body.strip_prefix("gpu-"))
            .unwrap_or(body);
        let mut out = [0u8; 16];
        let mut n = 0;
        let mut groups = body.split('-');
        for want in GROUPS {
            let group = groups.next().ok_or_else(err)?;
            if group.len() != want || !group.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(err());
            }
            for pair in group.as_bytes().chunks(2) {
                let text = std::str::from_utf8(pair).map_err(|_| err())?;
                out[n] = u8::from_str_radix(text, 16).map_err(|_| err())?;
                n += 1;
            }
        }
        if groups.next().is_some() {
            return Err(err());
        }
        Ok(Self(out))
    }
}

/// One entry of a restore-time GPU map: what ran on `old` is restored onto `new`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct GpuPair {
    /// The GPU the process was checkpointed on.
    pub old: GpuUuid,
    /// The GPU to restore it onto.
    pub new: GpuUuid,
}

impl From<GpuPair> for CUcheckpointGpuPair {
    fn from(value: GpuPair) -> Self {
        CUcheckpointGpuPair {
            oldUuid: value.old.into(),
            newUuid: value.new.into(),
        }
    }
}

impl fmt::Display for GpuPair {
    /// `old=new`, the syntax of `cuda-checkpoint --device-map`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.old, self.new)
    }
}

impl FromStr for GpuPair {
    type Err = ParseUuidError;

    /// Parses `old=new`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (old, new) = s
            .split_once('=')
            .ok_or_else(|| ParseUuidError(s.to_owned()))?;
        Ok(Self {
            old: old.parse()?,
            new: new.parse()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "GPU-0123abcd-ef01-2345-6789-abcdef012345";

    #[test]
    fn round_trip() {
        let uuid: GpuUuid = TEXT.parse().unwrap();
        assert_eq!(uuid.0[0], 0x01);
        assert_eq!(uuid.0[15], 0x45);
        assert_eq!(uuid.to_string(), TEXT);
        assert_eq!(
            "gpu-0123ABCD-EF01-2345-6789-ABCDEF012345"
                .parse::<GpuUuid>()
                .unwrap(),
            uuid
        );
        assert_eq!(
            "0123abcd-ef01-2345-6789-abcdef012345"
                .parse::<GpuUuid>()
                .unwrap(),
            uuid
        );
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "GPU-",
            "GPU-0123abcd-ef01-2345-6789-abcdef01234",
            "GPU-0123abcd-ef01-2345-6789-abcdef0123456",
            "GPU-0123abcd-ef01-2345-6789-abcdef01234g",
            "GPU-0123abcdef01-2345-6789-abcdef012345",
            "GPU-0123abcd-ef01-2345-6789-abcdef012345-00",
            "MIG-0123abcd-ef01-2345-6789-abcdef012345",
            "GPU-+123abcd-ef01-2345-6789-abcdef012345",
        ] {
            assert!(bad.parse::<GpuUuid>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn pair_syntax() {
        let pair: GpuPair = format!("{TEXT}={TEXT}").parse().unwrap();
        assert_eq!(pair.old, pair.new);
        assert_eq!(pair.to_string(), format!("{TEXT}={TEXT}"));
        let raw: CUcheckpointGpuPair = pair.into();
        assert_eq!(raw.oldUuid.bytes, pair.old.0);
    }
}
