//! CRIU's hooks, each declared once, and how a hook is chained through a plugin's handlers.
//!
//! `for_each_hook!` (crate-private) is the table: per hook its slot, the name CRIU's sources and logs use,
//! the legacy symbol name CRIU looks up, the first CRIU that calls it, how a plugin chains it
//! through its handlers ([`ChainRule`]), the [`crate::Phase`] its failures belong to, the safe
//! Rust signature, and the C signature with the
//! glue between the two. Everything else is generated from it: [`crate::HookId`] (abi.rs), the
//! hook methods of [`crate::Plugin`] and [`crate::HookHandler`], the `extern "C"` trampolines
//! and the descriptor's slots (plugin.rs).
//!
//! The glue of each row is a closure given `call`, the plugin's method with its Rust
//! arguments: it checks and converts CRIU's arguments, and turns the result into CRIU's return
//! value with `ret`, writing any output CRIU passes a pointer for.

use crate::error::{HookError, HookResult};

/// The hook table; `for_each_hook!(m)` expands to `m! { {row} {row} ... }`.
macro_rules! for_each_hook {
    ($m:ident) => {
        $m! {
            {
                /// `DUMP_UNIX_SK(fd, id)`: a unix socket CRIU cannot dump itself.
                DumpUnixSk = 0, "DUMP_UNIX_SK", "cr_plugin_dump_unix_sk", since Pre317, First, Dump,
                fn dump_unix_sk(fd: RawFd, id: u32) -> (),
                extern (fd: c_int, id: c_int) |call| ret(call(fd, id_u32(id)), |()| 0)
            }
            {
                /// `RESTORE_UNIX_SK(id)`: the restored socket's fd.
                RestoreUnixSk = 1, "RESTORE_UNIX_SK", "cr_plugin_restore_unix_sk", since Pre317, First, Restore,
                fn restore_unix_sk(id: u32) -> RawFd,
                extern (id: c_int) |call| ret(call(id_u32(id)), |fd| fd)
            }
            {
                /// `DUMP_EXT_FILE(fd, id)`: a file CRIU does not know (a device file).
                DumpExtFile = 2, "DUMP_EXT_FILE", "cr_plugin_dump_file", since Pre317, First, Dump,
                fn dump_ext_file(fd: RawFd, id: u32) -> (),
                extern (fd: c_int, id: c_int) |call| ret(call(fd, id_u32(id)), |()| 0)
            }
            {
                /// `RESTORE_EXT_FILE(id[, retry_needed])`: the restored fd. `(int id)` up to 4.2;
                /// `(int id, bool *retry_needed)` from 4.3 (and criu-dev before it), where `retry`
                /// is `Some`: setting it asks CRIU to call again later. The C glue here is the
                /// 4.2 one; plugin.rs adds the other.
                RestoreExtFile = 3, "RESTORE_EXT_FILE", "cr_plugin_restore_file", since Pre317, First, Restore,
                fn restore_ext_file(id: u32, retry: Option<&mut bool>) -> RawFd,
                extern (id: c_int) |call| ret(call(id_u32(id), None), |fd| fd)
            }
            {
                /// `DUMP_EXT_MOUNT(mountpoint, id)`.
                DumpExtMount = 4, "DUMP_EXT_MOUNT", "cr_plugin_dump_ext_mount", since Pre317, First, Dump,
                fn dump_ext_mount(mountpoint: &CStr, id: u32) -> (),
                extern (mp: *mut c_char, id: c_int) |call| {
                    if mp.is_null() {
                        return -libc::EINVAL;
                    }
                    // SAFETY: CRIU passes a NUL-terminated mount point valid for the call.
                    let mp = unsafe { CStr::from_ptr(mp) };
                    ret(call(mp, id_u32(id)), |()| 0)
                }
            }
            {
                /// `RESTORE_EXT_MOUNT(id, mountpoint, old_root, is_file)`.
                RestoreExtMount = 5, "RESTORE_EXT_MOUNT", "cr_plugin_restore_ext_mount", since Pre317, First, Restore,
                fn restore_ext_mount(id: u32, mountpoint: &CStr, old_root: &CStr, is_file: Option<&mut bool>) -> (),
                extern (id: c_int, mp: *mut c_char, old_root: *mut c_char, is_file: *mut c_int) |call| {
                    if mp.is_null() || old_root.is_null() {
                        return -libc::EINVAL;
                    }
                    // SAFETY: CRIU passes NUL-terminated strings valid for the call.
                    let (mp, old_root) = unsafe { (CStr::from_ptr(mp), CStr::from_ptr(old_root)) };
                    let mut file = false;
                    let want_file = !is_file.is_null();
                    let r = call(id_u32(id), mp, old_root, want_file.then_some(&mut file));
                    if want_file {
                        // SAFETY: non-null `is_file` points to an int CRIU reads after the call.
                        unsafe { is_file.write(c_int::from(file)) };
                    }
                    ret(r, |()| 0)
                }
            }
            {
                /// `DUMP_EXT_LINK(index, type, kind)`; runs in a forked child of CRIU.
                DumpExtLink = 6, "DUMP_EXT_LINK", "cr_plugin_dump_ext_link", since Pre317, First, Dump,
                fn dump_ext_link(index: i32, link_type: i32, kind: &CStr) -> (),
                extern (index: c_int, link_type: c_int, kind: *mut c_char) |call| {
                    if kind.is_null() {
                        return -libc::EINVAL;
                    }
                    // SAFETY: CRIU passes a NUL-terminated link kind valid for the call.
                    let kind = unsafe { CStr::from_ptr(kind) };
                    ret(call(index, link_type, kind), |()| 0)
                }
            }
            {
                /// `HANDLE_DEVICE_VMA(fd, stat)`: claim a device mapping so CRIU records it without
                /// contents.
                HandleDeviceVma = 7, "HANDLE_DEVICE_VMA", "cr_plugin_handle_device_vma", since V3_17, First, Dump,
                fn handle_device_vma(fd: RawFd, st: &libc::stat) -> (),
                extern (fd: c_int, st: *const libc::stat) |call| {
                    if st.is_null() {
                        return -libc::EINVAL;
                    }
                    // SAFETY: CRIU passes the stat of the mapping's file, valid for the call.
                    let st = unsafe { &*st };
                    ret(call(fd, st), |()| 0)
                }
            }
            {
                /// `UPDATE_VMA_MAP(path, addr, old_pgoff, new_pgoff, plugin_fd)`: a restored
                /// device mapping's new offset (and an fd to map); returns 1 to CRIU when the
                /// offset was replaced, as CRIU expects.
                UpdateVmaMap = 8, "UPDATE_VMA_MAP", "cr_plugin_update_vma_map", since V3_17, First, Restore,
                fn update_vma_map(path: &CStr, addr: u64, old_pgoff: u64) -> VmaUpdate,
                extern (path: *const c_char, addr: u64, old_pgoff: u64, new_pgoff: *mut u64, plugin_fd: *mut c_int) |call| {
                    if path.is_null() || new_pgoff.is_null() {
                        return -libc::EINVAL;
                    }
                    // SAFETY: CRIU passes a NUL-terminated path valid for the call.
                    let path = unsafe { CStr::from_ptr(path) };
                    ret(call(path, addr, old_pgoff), |u: VmaUpdate| {
                        // SAFETY: CRIU passes pointers to its own locals for both outputs.
                        unsafe {
                            new_pgoff.write(u.new_pgoff);
                            if !plugin_fd.is_null() {
                                plugin_fd.write(u.plugin_fd.unwrap_or(-1));
                            }
                        }
                        1
                    })
                }
            }
            {
                /// `RESUME_DEVICES_LATE(pid)`: give a restored task its devices back before it
                /// runs; the root first, and what a failure does depends on the release
                /// ([`crate::criu_internals::RESUME_DEVICES_LATE_FAILURE`]).
                ResumeDevicesLate = 9, "RESUME_DEVICES_LATE", "cr_plugin_resume_devices_late", since V3_17, First, Restore,
                fn resume_devices_late(pid: i32) -> (),
                extern (pid: c_int) |call| ret(call(pid), |()| 0)
            }
            {
                /// `PAUSE_DEVICES(pid)`: before the task is seized (also in pre-dump).
                PauseDevices = 10, "PAUSE_DEVICES", "cr_plugin_pause_devices", since V4_0, First, Dump,
                fn pause_devices(pid: i32) -> (),
                extern (pid: c_int) |call| ret(call(pid), |()| 0)
            }
            {
                /// `CHECKPOINT_DEVICES(pid)`: every task seized.
                CheckpointDevices = 11, "CHECKPOINT_DEVICES", "cr_plugin_checkpoint_devices", since V4_0, First, Dump,
                fn checkpoint_devices(pid: i32) -> (),
                extern (pid: c_int) |call| ret(call(pid), |()| 0)
            }
            {
                /// `POST_FORKING()`: the restored root task has forked.
                PostForking = 12, "POST_FORKING", "cr_plugin_post_forking", since V4_2, First, Restore,
                fn post_forking() -> (),
                extern () |call| ret(call(), |()| 0)
            }
            {
                /// `RESTORE_INIT()`: before anything is forked on restore.
                RestoreInit = 13, "RESTORE_INIT", "cr_plugin_restore_init", since Dev, First, Restore,
                fn restore_init() -> (),
                extern () |call| ret(call(), |()| 0)
            }
            {
                /// `DUMP_DEVICES_LATE(id)`: after every task's memory is dumped.
                DumpDevicesLate = 14, "DUMP_DEVICES_LATE", "cr_plugin_dump_devices_late", since Dev, First, Dump,
                fn dump_devices_late(id: i32) -> (),
                extern (id: c_int) |call| ret(call(id), |()| 0)
            }
            {
                /// `UPDATE_INETSK(family, state, src_ip, dst_ip)`: rewrite a restored inet
                /// socket's addresses in place; the pointers are CRIU's, passed on as they are.
                UpdateInetsk = 15, "UPDATE_INETSK", "cr_plugin_update_inetsk", since V4_3, First, Restore,
                fn update_inetsk(family: u32, state: u32, src_ip: *mut u32, dst_ip: *mut u32) -> (),
                extern (family: u32, state: u32, src_ip: *mut u32, dst_ip: *mut u32) |call| {
                    ret(call(family, state, src_ip, dst_ip), |()| 0)
                }
            }
            {
                /// `DUMP_FINISH(ret)`: before the dumped tasks are released; `ret` non-zero when
                /// they will be resumed because the dump failed (a failing post-dump script
                /// included). Every handler runs; it may come twice: after a handler failed, CRIU
                /// resumes the tasks and calls it again with that error. CRIU 4.3 has no legacy
                /// name for it; this one is in no CRIU.
                DumpFinish = 16, "DUMP_FINISH", "cr_plugin_dump_finish", since V4_3, All, Dump,
                fn dump_finish(ret: i32) -> (),
                extern (rc: c_int) |call| ret(call(rc), |()| 0)
            }
        }
    };
}
pub(crate) use for_each_hook;

/// How a plugin forwards a hook it does not implement itself to its handlers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainRule {
    /// As CRIU chains plugins: the first handler that does not answer [`HookError::NotMine`]
    /// owns the call, and later ones are not asked.
    First,
    /// Every handler is asked (each puts back its own work): the first failure is the
    /// answer, else success when any handler took part, else "not mine".
    All,
}

/// The answer of a chain of handlers, built one handler's answer at a time.
#[derive(Debug)]
pub struct Chain<T> {
    rule: ChainRule,
    answer: HookResult<T>,
}

impl<T> Chain<T> {
    /// A chain no handler has answered yet: "not mine".
    pub fn new(rule: ChainRule) -> Chain<T> {
        Chain {
            rule,
            answer: Err(HookError::NotMine),
        }
    }

    /// Takes a handler's answer; returns whether the next handler is to be asked.
    pub fn offer(&mut self, r: HookResult<T>) -> bool {
        match self.rule {
            ChainRule::First => match r {
                Err(HookError::NotMine) => true,
                owned => {
                    self.answer = owned;
                    false
                }
            },
            ChainRule::All => {
                match (r, &self.answer) {
                    (Err(HookError::NotMine), _) => {}
                    (Err(e), Ok(_) | Err(HookError::NotMine)) => self.answer = Err(e),
                    (Ok(v), Err(HookError::NotMine)) => self.answer = Ok(v),
                    _ => {}
                }
                true
            }
        }
    }

    /// The chain's answer.
    pub fn answer(self) -> HookResult<T> {
        self.answer
    }
}

/// An argument a chain hands to every handler in turn: a copy, or a shorter reborrow of a
/// `&mut` output.
pub trait Reborrow {
    /// What one handler gets.
    type Again<'b>
    where
        Self: 'b;
    /// The argument for the next handler.
    fn again(&mut self) -> Self::Again<'_>;
}

macro_rules! reborrow_by_copy {
    ($($t:ty),*) => {$(
        impl Reborrow for $t {
            type Again<'b> = $t;
            fn again(&mut self) -> $t {
                *self
            }
        }
    )*};
}
reborrow_by_copy!(i32, u32, u64, *mut u32);

impl<'a, T: ?Sized> Reborrow for &'a T {
    type Again<'b>
        = &'a T
    where
        Self: 'b;
    fn again(&mut self) -> &'a T {
        self
    }
}

impl<T> Reborrow for Option<&mut T> {
    type Again<'b>
        = Option<&'b mut T>
    where
        Self: 'b;
    fn again(&mut self) -> Option<&mut T> {
        self.as_deref_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T>(rule: ChainRule, answers: Vec<HookResult<T>>) -> (HookResult<T>, usize) {
        let mut chain = Chain::new(rule);
        let mut asked = 0;
        for a in answers {
            asked += 1;
            if !chain.offer(a) {
                break;
            }
        }
        (chain.answer(), asked)
    }

    #[test]
    fn first_rule_stops_at_the_owner() {
        let e = || Err(HookError::logged(libc::EIO));
        assert_eq!(
            run::<()>(ChainRule::First, vec![]),
            (Err(HookError::NotMine), 0)
        );
        assert_eq!(
            run(ChainRule::First, vec![Err(HookError::NotMine), Ok(7), e()]),
            (Ok(7), 2)
        );
        assert_eq!(run(ChainRule::First, vec![e(), Ok(1)]), (e(), 1));
    }

    #[test]
    fn all_rule_asks_everyone_and_keeps_the_first_failure() {
        let e = |n| Err(HookError::logged(n));
        let not_mine = || Err(HookError::NotMine);
        assert_eq!(
            run(ChainRule::All, vec![not_mine(), not_mine()]),
            (not_mine(), 2)
        );
        assert_eq!(run(ChainRule::All, vec![not_mine(), Ok(())]), (Ok(()), 2));
        assert_eq!(
            run(ChainRule::All, vec![Ok(()), e(libc::EIO), e(libc::EPERM)]),
            (e(libc::EIO), 3)
        );
        assert_eq!(
            run(ChainRule::All, vec![e(libc::EPERM), Ok(())]),
            (e(libc::EPERM), 2)
        );
    }

    #[test]
    fn a_mut_output_is_lent_to_each_handler_in_turn() {
        let mut flag = false;
        let mut arg = Some(&mut flag);
        for _ in 0..2 {
            if let Some(f) = arg.again() {
                *f = !*f;
            }
        }
        assert!(!flag);
    }
}
