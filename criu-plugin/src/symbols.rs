//! CRIU functions and data the plugin uses, resolved at run time.
//!
//! rustc links cdylibs with immediate binding, so one linked CRIU symbol that an older CRIU
//! lacks would make the plugin fail to load there. Everything here is looked up with
//! `dlsym(RTLD_DEFAULT, …)` instead: `criu` is linked with `-rdynamic` in every release, so its
//! globals are visible to plugins. A missing symbol is `None`, never an error at load time.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use crate::abi::PrintOnLevelFn;
use crate::criu_internals;

/// `opts.final_state` values (`COMPEL_TASK_*`, see [`crate::criu_internals::TASK_ALIVE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalState {
    /// `--leave-running` (`TASK_ALIVE` = 1): tasks run on after dump.
    Alive,
    /// The default (`TASK_DEAD` = 2): tasks are killed after a successful dump.
    Dead,
    /// `--leave-stopped` (`TASK_STOPPED` = 3).
    Stopped,
}

/// What the image's inventory says about a plugin name at restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InventoryListing {
    /// The image (or the host, before CRIU 4.1) keeps no plugin list: any plugin may be needed.
    NoList,
    /// The image lists the name; it is now claimed, so CRIU will not report it missing.
    Listed,
    /// The image keeps a list without this name: the plugin is not needed.
    NotListed,
}

/// A name no plugin records: claiming it tells whether the image has a list at all (without a
/// list every claim succeeds; with one, this one fails).
const PROBE_NAME: &CStr = c"\x01criu-plugin-crate list probe";

/// The CRIU symbols found in this process.
#[derive(Clone, Copy, Debug, Default)]
pub struct CriuSymbols {
    print_on_level: Option<PrintOnLevelFn>,
    log_get_loglevel: Option<unsafe extern "C" fn() -> c_uint>,
    criu_get_image_dir: Option<unsafe extern "C" fn() -> c_int>,
    add_inventory_plugin: Option<unsafe extern "C" fn(*const c_char) -> c_int>,
    check_and_remove_inventory_plugin: Option<unsafe extern "C" fn(*const c_char, usize) -> bool>,
    alarm_timeouted: Option<unsafe extern "C" fn() -> bool>,
    set_compel_interrupt_only_mode: Option<unsafe extern "C" fn()>,
    dont_use_freeze_cgroup: Option<unsafe extern "C" fn()>,
    fdstore_add: Option<unsafe extern "C" fn(c_int) -> c_int>,
    fdstore_get: Option<unsafe extern "C" fn(c_int) -> c_int>,
    find_unused_fd_pid: Option<unsafe extern "C" fn(libc::pid_t) -> c_int>,
    opts: Option<*const c_int>,
}

// SAFETY: the struct holds function pointers and a pointer to CRIU's global `opts`, which lives
// for the whole process; reading its first int from any thread is as safe as CRIU's own reads.
unsafe impl Send for CriuSymbols {}
// SAFETY: see `Send`; nothing here is mutated after resolution.
unsafe impl Sync for CriuSymbols {}

/// `dlsym(RTLD_DEFAULT, name)`: a symbol of CRIU (or of anything in the global scope), or
/// `None`.
pub fn lookup(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name has no preconditions.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

macro_rules! resolve_fn {
    ($name:literal) => {
        // SAFETY: a non-null symbol of this name in CRIU is the function with the signature
        // declared for the field (`criu/include/*.h`, unchanged across releases that have it).
        lookup($name).map(|p| unsafe { std::mem::transmute::<*mut c_void, _>(p) })
    };
}

impl CriuSymbols {
    /// Looks every symbol up in the process's global scope.
    pub fn resolve() -> CriuSymbols {
        CriuSymbols {
            print_on_level: resolve_fn!(c"print_on_level"),
            log_get_loglevel: resolve_fn!(c"log_get_loglevel"),
            criu_get_image_dir: resolve_fn!(c"criu_get_image_dir"),
            add_inventory_plugin: resolve_fn!(c"add_inventory_plugin"),
            check_and_remove_inventory_plugin: resolve_fn!(c"check_and_remove_inventory_plugin"),
            alarm_timeouted: resolve_fn!(c"alarm_timeouted"),
            set_compel_interrupt_only_mode: resolve_fn!(c"set_compel_interrupt_only_mode"),
            dont_use_freeze_cgroup: resolve_fn!(c"dont_use_freeze_cgroup"),
            fdstore_add: resolve_fn!(c"fdstore_add"),
            fdstore_get: resolve_fn!(c"fdstore_get"),
            find_unused_fd_pid: resolve_fn!(c"find_unused_fd_pid"),
            opts: lookup(c"opts").map(|p| p.cast_const().cast::<c_int>()),
        }
    }

    /// The symbols of this process, resolved once.
    pub fn get() -> &'static CriuSymbols {
        static SYMS: OnceLock<CriuSymbols> = OnceLock::new();
        SYMS.get_or_init(CriuSymbols::resolve)
    }

    /// `print_on_level`, if CRIU is the host.
    pub fn print_on_level(&self) -> Option<PrintOnLevelFn> {
        self.print_on_level
    }

    /// CRIU's current log level (`log_get_loglevel`).
    pub fn log_level(&self) -> Option<u32> {
        // SAFETY: `log_get_loglevel` takes no arguments and only reads a global.
        self.log_get_loglevel.map(|f| unsafe { f() })
    }

    /// The image directory as an fd owned by CRIU (`criu_get_image_dir`); do not close it.
    pub fn image_dir_fd(&self) -> Option<c_int> {
        // SAFETY: `criu_get_image_dir` takes no arguments and returns a service fd number.
        self.criu_get_image_dir
            .map(|f| unsafe { f() })
            .filter(|fd| *fd >= 0)
    }

    /// CRIU's image directory as a borrowed fd, when CRIU gives one.
    pub fn image_dir(&self) -> Option<std::os::fd::BorrowedFd<'static>> {
        let fd = self.image_dir_fd()?;
        // SAFETY: the fd is a CRIU service fd, open for the whole run in CRIU's process and
        // in every task it restores.
        Some(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
    }

    /// Whether the host keeps a list of plugins in its inventory image (CRIU 4.1 and later).
    pub fn has_inventory_plugins(&self) -> bool {
        self.add_inventory_plugin.is_some() && self.check_and_remove_inventory_plugin.is_some()
    }

    /// Records `name` in the inventory's plugin list at dump. `Ok(false)` where the host has
    /// no such list; an error where the host failed to add it.
    pub fn add_inventory_plugin(&self, name: &CStr) -> Result<bool, i32> {
        let Some(f) = self.add_inventory_plugin else {
            return Ok(false);
        };
        // SAFETY: CRIU copies the NUL-terminated name; it does not keep the pointer.
        match unsafe { f(name.as_ptr()) } {
            0 => Ok(true),
            e => Err(e),
        }
    }

    /// Claims `name` from the inventory's plugin list at restore. Returns whether the image
    /// needs this plugin: true for images that carry no list (CRIU before 4.1) and for hosts
    /// that do not know lists, true when listed (and then removed, so CRIU does not report it
    /// missing), false when the image lists other plugins only.
    pub fn claim_inventory_plugin(&self, name: &CStr) -> bool {
        let Some(f) = self.check_and_remove_inventory_plugin else {
            return true;
        };
        let len = name.to_bytes().len() + 1;
        // SAFETY: CRIU compares at most `len` bytes of the NUL-terminated name.
        unsafe { f(name.as_ptr(), len) }
    }

    /// Claims `name` and says whether the image lists it, lacks a list, or lists others only.
    /// Call it once per name, from `init(RESTORE)`: CRIU checks for unclaimed names right after.
    pub fn inventory_listing(&self, name: &CStr) -> InventoryListing {
        if self.check_and_remove_inventory_plugin.is_none()
            || self.claim_inventory_plugin(PROBE_NAME)
        {
            return InventoryListing::NoList;
        }
        if self.claim_inventory_plugin(name) {
            InventoryListing::Listed
        } else {
            InventoryListing::NotListed
        }
    }

    /// Whether CRIU's SIGALRM for `--timeout` has fired (`alarm_timeouted`).
    pub fn alarm_timed_out(&self) -> bool {
        // SAFETY: `alarm_timeouted` takes no arguments and reads a global flag.
        self.alarm_timeouted
            .map(|f| unsafe { f() })
            .unwrap_or(false)
    }

    /// Asks CRIU to stop tasks with ptrace interrupts even in freezer mode (4.0 and later), so
    /// tasks stay runnable while plugins act on them. Returns whether the host offers it.
    pub fn request_interrupt_only_mode(&self) -> bool {
        if let Some(f) = self
            .set_compel_interrupt_only_mode
            .or(self.dont_use_freeze_cgroup)
        {
            // SAFETY: both functions take no arguments and set a flag in seize.c.
            unsafe { f() };
            true
        } else {
            false
        }
    }

    /// Whether CRIU's fdstore (fds shared by every restore process) can be used.
    pub fn has_fdstore(&self) -> bool {
        self.fdstore_add.is_some() && self.fdstore_get.is_some()
    }

    /// Puts a copy of `fd` into CRIU's fdstore (restore only); returns its id.
    pub fn fdstore_add(&self, fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<i32> {
        use std::os::fd::AsRawFd;
        let f = self
            .fdstore_add
            .ok_or_else(|| std::io::Error::other("this CRIU has no fdstore"))?;
        // SAFETY: fdstore_add sends a copy of the live fd over CRIU's service socket.
        let id = unsafe { f(fd.as_raw_fd()) };
        if id < 0 {
            return Err(std::io::Error::other("CRIU's fdstore refused the fd"));
        }
        Ok(id)
    }

    /// A new fd for the file stored under `id` in CRIU's fdstore.
    pub fn fdstore_get(&self, id: i32) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let f = self
            .fdstore_get
            .ok_or_else(|| std::io::Error::other("this CRIU has no fdstore"))?;
        // SAFETY: fdstore_get returns a new fd the caller owns, or -1.
        let fd = unsafe { f(id) };
        if fd < 0 {
            return Err(std::io::Error::other(format!(
                "CRIU's fdstore has no fd {id}"
            )));
        }
        // SAFETY: `fd` is new and owned by nobody else.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// The lowest fd number above every fd CRIU restores into task `pid` (its pid in the image),
    /// so fds a plugin keeps there cannot collide with them (`find_unused_fd_pid`, 3.17+).
    pub fn unused_fd_of(&self, pid: i32) -> Option<i32> {
        let f = self.find_unused_fd_pid?;
        // SAFETY: `int find_unused_fd_pid(pid_t)` only reads CRIU's process tree.
        let fd = unsafe { f(pid) };
        (fd >= 0).then_some(fd)
    }

    /// `opts.final_state`, the first member of `struct cr_options`
    /// ([`criu_internals::final_state`]).
    pub fn final_state(&self) -> Option<FinalState> {
        let p = self.opts?;
        // SAFETY: `p` is the address of CRIU's exported `opts`.
        match unsafe { criu_internals::final_state(p) } {
            criu_internals::TASK_ALIVE => Some(FinalState::Alive),
            criu_internals::TASK_DEAD => Some(FinalState::Dead),
            criu_internals::TASK_STOPPED => Some(FinalState::Stopped),
            _ => None,
        }
    }
}

/// An itimerval that arms nothing.
const NO_TIMER: libc::itimerval = libc::itimerval {
    it_interval: libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    },
    it_value: libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    },
};

/// CRIU's alarm, suspended while a plugin does long, legitimate work under it (CRIU 4.0 calls
/// `CHECKPOINT_DEVICES` while its seize timeout runs: [`criu_internals::SEIZE_ALARM`]); what
/// was left is re-armed on drop.
pub struct AlarmSuspended(Option<libc::itimerval>);

impl AlarmSuspended {
    /// Suspends the alarm, if one is armed.
    pub fn new() -> AlarmSuspended {
        let mut old = NO_TIMER;
        // SAFETY: setitimer reads NO_TIMER and writes the previous timer into `old`.
        let rc = unsafe { libc::setitimer(libc::ITIMER_REAL, &NO_TIMER, &mut old) };
        let armed = rc == 0 && (old.it_value.tv_sec != 0 || old.it_value.tv_usec != 0);
        AlarmSuspended(armed.then_some(old))
    }
}

impl Default for AlarmSuspended {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AlarmSuspended {
    fn drop(&mut self) {
        if let Some(old) = self.0 {
            // SAFETY: re-arms the timer saved in `new`; the old-value pointer may be null.
            unsafe { libc::setitimer(libc::ITIMER_REAL, &old, std::ptr::null_mut()) };
        }
    }
}

/// Seconds and microseconds left on CRIU's `alarm(opts.timeout)`; `None` when no alarm is set.
///
/// Inside `PAUSE_DEVICES` this is the real time budget left of CRIU's `--timeout`, shared by
/// every task of the tree ([`criu_internals::SEIZE_ALARM`]).
pub fn alarm_remaining() -> Option<std::time::Duration> {
    let mut it = NO_TIMER;
    // SAFETY: getitimer writes one itimerval into the valid, writable `it`.
    if unsafe { libc::getitimer(libc::ITIMER_REAL, &mut it) } != 0 {
        return None;
    }
    let v = it.it_value;
    if v.tv_sec == 0 && v.tv_usec == 0 {
        return None;
    }
    Some(std::time::Duration::new(
        v.tv_sec.max(0) as u64,
        (v.tv_usec.clamp(0, 999_999) as u32) * 1000,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_criu_nothing_resolves_and_defaults_are_safe() {
        let s = CriuSymbols::resolve();
        assert!(s.print_on_level().is_none());
        assert!(s.image_dir_fd().is_none());
        assert!(!s.has_inventory_plugins());
        assert_eq!(s.add_inventory_plugin(c"cuda_plugin"), Ok(false));
        assert!(s.claim_inventory_plugin(c"cuda_plugin"));
        assert_eq!(
            s.inventory_listing(c"cuda_plugin"),
            InventoryListing::NoList
        );
        assert!(!s.alarm_timed_out());
        assert!(!s.request_interrupt_only_mode());
        assert_eq!(s.final_state(), None);
    }

    #[test]
    fn alarm_remaining_reads_the_real_timer() {
        assert_eq!(alarm_remaining(), None);
        // Cancelled right after.
        nix::unistd::alarm::set(30);
        let left = alarm_remaining().expect("alarm armed");
        {
            let _paused = AlarmSuspended::new();
            assert_eq!(alarm_remaining(), None);
        }
        let back = alarm_remaining().expect("alarm re-armed");
        nix::unistd::alarm::cancel();
        assert!(left.as_secs() >= 28 && left.as_secs() <= 30, "{left:?}");
        assert!(back.as_secs() >= 27 && back <= left, "{back:?}");
    }
}
