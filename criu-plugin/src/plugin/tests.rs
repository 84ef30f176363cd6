//! Unit tests of the generated hook surface: descriptors, trampolines, chaining and errno.

use super::*;
use crate::error::Failure;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The tests that run hooks, one at a time: each swaps the process's panic hook.
pub(super) fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Probe {
    calls: Mutex<Vec<String>>,
    panics: AtomicUsize,
    backends: Mutex<Vec<Backend>>,
}

static PROBE: Probe = Probe {
    calls: Mutex::new(Vec::new()),
    panics: AtomicUsize::new(0),
    backends: Mutex::new(Vec::new()),
};
static LOGGER: CriuLogger = CriuLogger::new("probe");

impl Plugin for Probe {
    const NAME: &'static CStr = c"probe";
    const LOG_PREFIX: &'static str = "probe";
    const HOOKS: &'static [HookId] = &[
        HookId::PauseDevices,
        HookId::RestoreExtFile,
        HookId::UpdateVmaMap,
    ];
    type Handler = Backend;
    fn instance() -> &'static Self {
        &PROBE
    }
    fn each_handler(&self, visit: &mut dyn FnMut(&mut Backend) -> bool) {
        for b in self.backends.lock().unwrap().iter_mut() {
            if !visit(b) {
                break;
            }
        }
    }
    fn logger() -> &'static CriuLogger {
        &LOGGER
    }
    fn init(&self, _stage: Stage) -> HookResult {
        Ok(())
    }
    fn exit(&self, stage: Option<Stage>, ret: i32) {
        self.calls
            .lock()
            .unwrap()
            .push(format!("exit {stage:?} {ret}"));
    }
    fn pause_devices(&self, pid: i32) -> HookResult {
        match pid {
            1 => Ok(()),
            2 => Err(HookError::logged(libc::ETIMEDOUT)),
            3 => {
                self.panics.fetch_add(1, Ordering::SeqCst);
                panic!("pid 3 is cursed")
            }
            4 => Err(HookError::logged(0)),
            _ => Err(HookError::NotMine),
        }
    }
    fn restore_ext_file(&self, id: u32, retry: Option<&mut bool>) -> HookResult<RawFd> {
        if let Some(r) = retry {
            *r = id == 9;
        }
        Ok(id as RawFd + 100)
    }
    fn update_vma_map(&self, _p: &CStr, _a: u64, old: u64) -> HookResult<VmaUpdate> {
        Ok(VmaUpdate {
            new_pgoff: old + 1,
            plugin_fd: None,
        })
    }
}

#[test]
fn descriptor_fills_only_listed_hooks() {
    let d = descriptor::<Probe>();
    assert_eq!(d.version, crate::abi::CRIU_PLUGIN_VERSION);
    assert_eq!(d.max_hooks as usize, HOOK_SLOTS);
    for h in HookId::ALL {
        assert_eq!(
            d.hooks[h.index()].is_some(),
            Probe::HOOKS.contains(&h),
            "{h:?}"
        );
    }
    assert!(d.init.is_some() && d.exit.is_some());
}

#[test]
fn errors_become_negative_errno_and_panics_are_contained() {
    let _serial = serial();
    // SAFETY: calling the trampolines directly as CRIU would.
    unsafe {
        assert_eq!(trampolines::pause_devices::<Probe>(1), 0);
        assert_eq!(trampolines::pause_devices::<Probe>(2), -libc::ETIMEDOUT);
        assert_eq!(trampolines::pause_devices::<Probe>(7), -libc::ENOTSUP);
        assert_eq!(trampolines::pause_devices::<Probe>(4), -libc::EIO);
        assert_eq!(trampolines::pause_devices::<Probe>(3), -libc::EIO);
    }
    assert_eq!(PROBE.panics.load(Ordering::SeqCst), 1);
}

#[test]
fn retry_flag_is_always_written() {
    let _serial = serial();
    let mut flag = true;
    // SAFETY: `flag` outlives the call.
    let fd = unsafe { trampolines::restore_ext_file_retry::<Probe>(5, &mut flag) };
    assert_eq!((fd, flag), (105, false));
    // SAFETY: as above.
    let fd = unsafe { trampolines::restore_ext_file_retry::<Probe>(9, &mut flag) };
    assert_eq!((fd, flag), (109, true));
    // SAFETY: the 1-argument variant takes only the id.
    assert_eq!(unsafe { trampolines::restore_ext_file::<Probe>(1) }, 101);
}

#[test]
fn update_vma_map_returns_one_and_writes_outputs() {
    let _serial = serial();
    let (mut pg, mut fd) = (0u64, 7);
    // SAFETY: outputs point to locals; the path is a valid C string.
    let rc = unsafe {
        trampolines::update_vma_map::<Probe>(c"/dev/kfd".as_ptr(), 0, 41, &mut pg, &mut fd)
    };
    assert_eq!((rc, pg, fd), (1, 42, -1));
}

#[test]
fn exit_is_forwarded_with_stage() {
    let _serial = serial();
    // SAFETY: calling the exit trampoline as CRIU would.
    unsafe { trampolines::exit::<Probe>(0, -1) };
    // SAFETY: as above; an unknown stage is forwarded as `None`, so that the plugin can
    // still end the run it is in.
    unsafe { trampolines::exit::<Probe>(9, 0) };
    let calls = PROBE.calls.lock().unwrap();
    assert_eq!(calls.iter().filter(|c| c.starts_with("exit")).count(), 2);
    assert!(calls.contains(&"exit Some(Dump) -1".to_string()));
    assert!(calls.contains(&"exit None 0".to_string()));
}

#[test]
fn a_failure_is_the_errno_crius_gets() {
    use crate::error::FailureKind;
    let f: HookError = Failure::new(FailureKind::Driver, libc::ETIMEDOUT, "slow").into();
    assert_eq!(f, HookError::logged(libc::ETIMEDOUT));
    assert_eq!(f.errno(), libc::ETIMEDOUT);
    assert_ne!(f, HookError::NotMine);
    let zero: HookError = Failure::new(FailureKind::Internal, 0, "no errno").into();
    assert_eq!(zero.to_return(), -libc::EIO);
}

#[test]
fn hook_error_mapping() {
    assert_eq!(HookError::NotMine.to_return(), -95);
    assert_eq!(HookError::logged(libc::ENOTSUP).to_return(), -libc::EIO);
    assert_eq!(HookError::logged(-3).to_return(), -libc::EIO);
    let io = std::io::Error::from_raw_os_error(libc::ENOENT);
    assert_eq!(HookError::from(io), HookError::logged(libc::ENOENT));
}

/// A backend of [`Probe`]: answers for one pid, says "not mine" for the others, and
/// counts what it was asked.
struct Backend {
    pid: i32,
    asked: usize,
    finish: HookResult,
}

impl HookHandler for Backend {
    fn checkpoint_devices(&mut self, pid: i32) -> HookResult {
        self.asked += 1;
        if pid == self.pid {
            Ok(())
        } else {
            Err(HookError::NotMine)
        }
    }
    fn restore_ext_mount(
        &mut self,
        id: u32,
        _mountpoint: &CStr,
        _old_root: &CStr,
        is_file: Option<&mut bool>,
    ) -> HookResult {
        if let Some(f) = is_file {
            *f = !*f;
        }
        if id as i32 == self.pid {
            Ok(())
        } else {
            Err(HookError::NotMine)
        }
    }
    fn dump_finish(&mut self, _ret: i32) -> HookResult {
        self.asked += 1;
        self.finish.clone()
    }
}

#[test]
fn hooks_not_implemented_go_to_the_handlers_as_the_table_says() {
    let _serial = serial();
    let backend = |pid, finish| Backend {
        pid,
        asked: 0,
        finish,
    };
    *PROBE.backends.lock().unwrap() = vec![
        backend(1, Err(HookError::NotMine)),
        backend(2, Err(HookError::logged(libc::EPERM))),
        backend(3, Ok(())),
    ];
    let asked = || {
        let b = PROBE.backends.lock().unwrap();
        b.iter().map(|b| b.asked).collect::<Vec<_>>()
    };
    // SAFETY: calling the trampolines directly as CRIU would.
    unsafe {
        // First rule: the owner answers, the ones after it are not asked.
        assert_eq!(trampolines::checkpoint_devices::<Probe>(2), 0);
        assert_eq!(asked(), [1, 1, 0]);
        assert_eq!(trampolines::checkpoint_devices::<Probe>(9), -libc::ENOTSUP);
        assert_eq!(asked(), [2, 2, 1]);
        // All rule: everyone is asked; the first failure is the answer.
        assert_eq!(trampolines::dump_finish::<Probe>(0), -libc::EPERM);
        assert_eq!(asked(), [3, 3, 2]);
    }
    // Every handler asked gets the output to write, in turn: two flips, then three.
    let mount = |id, is_file: &mut c_int| {
        let (mp, root) = (c"/m".as_ptr().cast_mut(), c"/".as_ptr().cast_mut());
        // SAFETY: the strings are valid and `is_file` outlives the call.
        unsafe { trampolines::restore_ext_mount::<Probe>(id, mp, root, is_file) }
    };
    let mut is_file = 0;
    assert_eq!((mount(2, &mut is_file), is_file), (0, 0));
    assert_eq!((mount(3, &mut is_file), is_file), (0, 1));
}
