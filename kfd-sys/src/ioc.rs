//! Encoding of Linux ioctl request numbers (`_IOC`, `_IO`, `_IOR`, `_IOW`,
//! `_IOWR` from `<asm-generic/ioctl.h>`).
//!
//! bindgen cannot expand function-like macros, so the request numbers of
//! [`crate::ioctls`] are computed here at compile time from the direction,
//! the type byte (`'K'` for KFD, `'d'` for DRM), the command number and the
//! size of the argument structure.
//!
//! A request number packs, from the least significant bit: `nr` (8 bits),
//! `type` (8 bits), `size` (14 bits on the generic layout, 13 on
//! powerpc/mips/sparc) and the direction (2 or 3 bits). "Read" and "write"
//! are seen from user space: `_IOR` means the kernel writes the argument
//! back, `_IOW` that it only reads it.

use core::mem::size_of;

/// Whether this architecture uses the generic `_IOC` layout (14 size bits, write 1, read 2);
/// powerpc, mips and sparc have their own.
pub const GENERIC_LAYOUT: bool = arch::SIZEBITS == 14;

#[cfg(not(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips32r6",
    target_arch = "mips64",
    target_arch = "mips64r6",
    target_arch = "sparc",
    target_arch = "sparc64"
)))]
mod arch {
    pub const SIZEBITS: u32 = 14;
    pub const NONE: u32 = 0;
    pub const WRITE: u32 = 1;
    pub const READ: u32 = 2;
}

#[cfg(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips32r6",
    target_arch = "mips64",
    target_arch = "mips64r6",
    target_arch = "sparc",
    target_arch = "sparc64"
))]
mod arch {
    pub const SIZEBITS: u32 = 13;
    pub const NONE: u32 = 1;
    pub const WRITE: u32 = 4;
    pub const READ: u32 = 2;
}

/// Width of the command-number field.
pub const IOC_NRBITS: u32 = 8;
/// Width of the type field.
pub const IOC_TYPEBITS: u32 = 8;
/// Width of the argument-size field (architecture dependent).
pub const IOC_SIZEBITS: u32 = arch::SIZEBITS;

/// Bit position of the command number.
pub const IOC_NRSHIFT: u32 = 0;
/// Bit position of the type byte.
pub const IOC_TYPESHIFT: u32 = IOC_NRSHIFT + IOC_NRBITS;
/// Bit position of the argument size.
pub const IOC_SIZESHIFT: u32 = IOC_TYPESHIFT + IOC_TYPEBITS;
/// Bit position of the direction.
pub const IOC_DIRSHIFT: u32 = IOC_SIZESHIFT + IOC_SIZEBITS;

/// Direction `_IOC_NONE`: no argument is copied.
pub const IOC_NONE: u32 = arch::NONE;
/// Direction `_IOC_WRITE`: user space writes, the kernel reads the argument.
pub const IOC_WRITE: u32 = arch::WRITE;
/// Direction `_IOC_READ`: the kernel writes the argument back to user space.
pub const IOC_READ: u32 = arch::READ;

/// `_IOC(dir, type, nr, size)`.
///
/// Fails to compile (when used in a `const`) or panics if `nr` or `size` do
/// not fit their fields.
#[must_use]
pub const fn ioc(dir: u32, ty: u8, nr: u32, size: usize) -> u32 {
    assert!(nr < (1 << IOC_NRBITS), "ioctl nr out of range");
    assert!(size < (1 << IOC_SIZEBITS), "ioctl argument too large");
    (dir << IOC_DIRSHIFT)
        | ((ty as u32) << IOC_TYPESHIFT)
        | (nr << IOC_NRSHIFT)
        | ((size as u32) << IOC_SIZESHIFT)
}

/// `_IO(type, nr)`: no argument.
#[must_use]
pub const fn io(ty: u8, nr: u32) -> u32 {
    ioc(IOC_NONE, ty, nr, 0)
}

/// `_IOR(type, nr, T)`: the kernel fills a `T`.
#[must_use]
pub const fn ior<T>(ty: u8, nr: u32) -> u32 {
    ioc(IOC_READ, ty, nr, size_of::<T>())
}

/// `_IOW(type, nr, T)`: the kernel reads a `T`.
#[must_use]
pub const fn iow<T>(ty: u8, nr: u32) -> u32 {
    ioc(IOC_WRITE, ty, nr, size_of::<T>())
}

/// `_IOWR(type, nr, T)`: the kernel reads a `T` and writes it back.
#[must_use]
pub const fn iowr<T>(ty: u8, nr: u32) -> u32 {
    ioc(IOC_READ | IOC_WRITE, ty, nr, size_of::<T>())
}

/// `_IOC_NR(req)`.
#[must_use]
pub const fn ioc_nr(req: u32) -> u32 {
    (req >> IOC_NRSHIFT) & ((1 << IOC_NRBITS) - 1)
}

/// `_IOC_TYPE(req)`.
#[must_use]
pub const fn ioc_type(req: u32) -> u8 {
    ((req >> IOC_TYPESHIFT) & ((1 << IOC_TYPEBITS) - 1)) as u8
}

/// `_IOC_SIZE(req)`.
#[must_use]
pub const fn ioc_size(req: u32) -> usize {
    ((req >> IOC_SIZESHIFT) & ((1 << IOC_SIZEBITS) - 1)) as usize
}

/// `_IOC_DIR(req)`.
#[must_use]
pub const fn ioc_dir(req: u32) -> u32 {
    req >> IOC_DIRSHIFT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let req = iowr::<[u64; 7]>(b'K', 0x22);
        assert_eq!(ioc_nr(req), 0x22);
        assert_eq!(ioc_type(req), b'K');
        assert_eq!(ioc_size(req), 56);
        assert_eq!(ioc_dir(req), IOC_READ | IOC_WRITE);
        assert_eq!(ioc_dir(io(b'd', 1)), IOC_NONE);
        assert_eq!(ioc_size(io(b'd', 1)), 0);
    }

    #[test]
    #[should_panic(expected = "ioctl argument too large")]
    fn oversized_argument_is_rejected() {
        let _ = ioc(IOC_READ, b'K', 1, 1 << IOC_SIZEBITS);
    }

    #[test]
    #[should_panic(expected = "ioctl nr out of range")]
    fn oversized_nr_is_rejected() {
        let _ = ioc(IOC_READ, b'K', 256, 0);
    }
}
