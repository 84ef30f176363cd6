//! Fault injection: the failures a test can make the simulated kernel return, per
//! operation, and how they fire.

use std::io;

use super::{SimKfd, err};

/// A one-shot or repeated injected failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The errno returned.
    pub errno: i32,
    /// How many more times it fires (`u32::MAX`: always).
    pub times: u32,
}

impl Fault {
    /// Fails every time with `errno`.
    pub fn always(errno: i32) -> Fault {
        Fault {
            errno,
            times: u32::MAX,
        }
    }

    /// Fails once with `errno`.
    pub fn once(errno: i32) -> Fault {
        Fault { errno, times: 1 }
    }
}

/// Fails with the fault in `slot`, if any, using up one of its times.
pub(super) fn fire(slot: &mut Option<Fault>) -> io::Result<()> {
    if let Some(f) = slot {
        if f.times != u32::MAX {
            f.times -= 1;
        }
        let errno = f.errno;
        if f.times == 0 {
            *slot = None;
        }
        return Err(err(errno));
    }
    Ok(())
}

/// Failures to inject.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// PROCESS_INFO fails (queues stay running, as in the kernel).
    pub process_info: Option<Fault>,
    /// CHECKPOINT fails before doing anything.
    pub checkpoint: Option<Fault>,
    /// CHECKPOINT fails after exporting this many dma-bufs (it closes them, as the kernel).
    pub checkpoint_after_dmabufs: Option<(usize, i32)>,
    /// UNPAUSE fails (queues stay evicted).
    pub unpause: Option<Fault>,
    /// RESTORE fails before doing anything.
    pub restore: Option<Fault>,
    /// RESUME fails.
    pub resume: Option<Fault>,
    /// SDMA work that reads the BO at this (process) GPU address fails: its fence carries
    /// this errno (a device error, not a page fault).
    pub download_at: Option<(u64, i32)>,
    /// SDMA work that writes the BO at this (process) GPU address fails the same way.
    pub upload_at: Option<(u64, i32)>,
    /// The command submission ioctl fails.
    pub sdma_submit: Option<Fault>,
    /// Submitted SDMA work never completes (its fence wait times out).
    pub sdma_hang: bool,
    /// Registering user memory (userptr) fails.
    pub userptr: Option<Fault>,
    /// The kernel lacks `GEM_LIST_HANDLES` (before Linux 6.18).
    pub no_gem_list: bool,
    /// Opening this render minor fails with this errno.
    pub open_render: Option<(u32, i32)>,
}

impl SimKfd {
    /// Sets the failures to inject.
    pub fn set_faults(&self, faults: Faults) {
        self.state().faults = faults;
    }

    /// Changes the failures to inject.
    pub fn update_faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.state().faults);
    }
}
