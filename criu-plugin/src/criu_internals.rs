//! What the plugin assumes of CRIU's internals: behaviour and data layout beyond the plugin ABI
//! (`criu-plugin.h`, which [`crate::abi`] and the hook table of [`crate::hooks`] describe, and
//! which releases call which hook, the table's `since`).
//!
//! Each item says what CRIU does, where in its source, and the releases it was checked
//! against, in one of two ways:
//!
//! - **source**: read in the release's source (`criu/...` at its git tag);
//! - **binary**: seen in the release's `criu` executable (exported symbols, message strings,
//!   or the machine code around them), for releases whose source was not at hand.
//!
//! A new CRIU release is supported once every item here has been checked against it. The
//! code that relies on an item names it here, so a change of CRIU's behaviour shows which
//! code it affects.

use std::ffi::c_int;

/// CRIU's global `opts` (`struct cr_options`, `criu/include/cr_options.h`) starts with
/// `int final_state`: what happens to the dumped tasks (`--leave-running`,
/// `--leave-stopped`, or killed after a successful dump). The plugin reads this int alone,
/// through the exported data symbol `opts`, and nothing else of the struct.
///
/// Checked against: 4.1.1, 4.2 (source); 4.2.1, 4.3 (binary: `opts` exported).
///
/// # Safety
///
/// `opts` must be the address of CRIU's exported `opts`.
pub unsafe fn final_state(opts: *const c_int) -> c_int {
    // SAFETY: the caller passes CRIU's `opts`, a global that lives for the whole process and
    // whose first member is an int (above); reading it from any thread is as safe as CRIU's
    // own reads.
    unsafe { opts.read_volatile() }
}

/// `opts.final_state` of `--leave-running` (`COMPEL_TASK_ALIVE`,
/// `compel/include/uapi/task-state.h`).
///
/// Checked against: 4.1.1, 4.2 (source).
pub const TASK_ALIVE: c_int = 1;
/// `opts.final_state` by default: the tasks are killed after a successful dump
/// (`COMPEL_TASK_DEAD`).
///
/// Checked against: 4.1.1, 4.2 (source).
pub const TASK_DEAD: c_int = 2;
/// `opts.final_state` of `--leave-stopped` (`COMPEL_TASK_STOPPED`).
///
/// Checked against: 4.1.1, 4.2 (source).
pub const TASK_STOPPED: c_int = 3;

/// The ptrace options CRIU gives the tasks it traces (`PTRACE_O_TRACESYSGOOD`, in
/// `criu/cr-restore.c` for restored tasks and `compel/src/lib/infect.c` for dumped ones), and
/// `PTRACE_O_SUSPEND_SECCOMP` with it for a task that has seccomp filters
/// (`compel/src/lib/ptrace.c`, `ptrace_suspend_seccomp`). A plugin that lets a tracee run
/// and stops it again puts these back.
///
/// Checked against: 4.1.1, 4.2 (source); 4.2.1 (binary: the restore's `TRACESYSGOOD` and
/// `ptrace_suspend_seccomp` messages); 4.3 (binary: `ptrace_suspend_seccomp`; the restore's
/// `TRACESYSGOOD` message is gone, so that half is not confirmed).
pub const fn tracee_ptrace_options(suspend_seccomp: bool) -> c_int {
    if suspend_seccomp {
        libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_SUSPEND_SECCOMP
    } else {
        libc::PTRACE_O_TRACESYSGOOD
    }
}

/// How CRIU starts its error and warning lines (`pr_err`, `pr_warn` in `criu/include/log.h`:
/// `Error (file:line): `, `Warn  (file:line): `, two spaces after `Warn`). Runtimes (runc,
/// Podman) take the first error line of CRIU's log as the failure's reason.
///
/// Checked against: 4.1.1, 4.2 (source); 4.2.1, 4.3 (binary: the format strings).
pub const LOG_ERROR_MARKER: &str = "Error (";
/// See [`LOG_ERROR_MARKER`].
pub const LOG_WARN_MARKER: &str = "Warn  (";

/// CRIU formats each log line into one static buffer of this size, after its timestamp and
/// pid prefix (`LOG_BUF_LEN` in `criu/log.c`), and writes what the text would have taken: a
/// longer line loses its newline.
///
/// Checked against: 4.1.1, 4.2 (source).
pub const LOG_BUF_LEN: usize = 8 * 1024;

/// An assumption about CRIU's behaviour, with no value of its own: the code that relies on
/// it links here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assumption {
    /// The CRIU releases it was checked against, with how (see the module docs).
    pub checked: &'static [&'static str],
}

/// During a restore CRIU's `SIGCHLD` handler (`sigchld_handler` in `criu/cr-restore.c`) reaps
/// with `waitpid(-1, WNOHANG)` and takes any child that exited or was killed for a restore
/// task that died: it aborts the restore. A plugin's child must send no exit signal (then
/// only a `__WALL` or `__WCLONE` wait sees it) and block the signals CRIU handles.
pub const RESTORE_SIGCHLD_ABORTS: Assumption = Assumption {
    checked: &[
        "4.1.1 (source)",
        "4.2 (source)",
        "4.2.1 (binary)",
        "4.3 (binary)",
    ],
};

/// A dump arms `alarm(opts.timeout)` while it seizes the tree (`collect_pstree` in
/// `criu/seize.c`): `PAUSE_DEVICES` runs under it, shares its time with every task, and
/// CRIU's `SIGALRM` handler sets the flag `alarm_timeouted()` reads. 4.0 also calls
/// `CHECKPOINT_DEVICES` under it; 4.1.1 and 4.2 cancel it (`alarm(0)`) before.
pub const SEIZE_ALARM: Assumption = Assumption {
    checked: &[
        "4.0 (source)",
        "4.1.1 (source)",
        "4.2 (source)",
        "4.2.1 (binary: alarm_timeouted)",
        "4.3 (binary: alarm_timeouted)",
    ],
};

/// With `--restore-sibling` (how runc restores) CRIU forks the root task with
/// `CLONE_PARENT`, so it is a child of CRIU's parent, and seizes it with `PTRACE_SEIZE` at
/// once (`restore_root_task` in `criu/cr-restore.c`, "Can't attach to init"), tracing it
/// until it lets the restored tree go.
pub const RESTORE_SIBLING_ROOT_SEIZED: Assumption = Assumption {
    checked: &[
        "4.1.1 (source)",
        "4.2 (source)",
        "4.2.1 (binary)",
        "4.3 (binary)",
    ],
};

/// Every task CRIU forks for a restore inherits CRIU's memory, and keeps it until CRIU's
/// restorer code unmaps everything but its own bootstrap and the premapped area
/// (`unmap_old_vmas` in `criu/pie/restorer.c`), just before the task becomes the restored
/// program again. A page CRIU's process maps before forking is so in every task still in
/// CRIU's code, and in no other process.
pub const RESTORER_UNMAPS_CRIU_MEMORY: Assumption = Assumption {
    checked: &[
        "4.1.1 (source)",
        "4.2 (source)",
        "4.2.1 (binary)",
        "4.3 (binary)",
    ],
};

/// Between `POST_FORKING` and the first `RESUME_DEVICES_LATE`, CRIU's main process enters
/// the restored tree's mount namespace (`setns(CLONE_NEWNS)` in `depopulate_roots_yard`,
/// `criu/mount.c`), which the kernel refuses to a process with more than one thread: no
/// thread of a plugin may run on in CRIU's process from one hook to the next.
/// (4.1.1 has no `POST_FORKING`.)
pub const MOUNT_NS_ENTERED_AFTER_POST_FORKING: Assumption = Assumption {
    checked: &["4.2 (source)"],
};

/// CRIU calls `RESUME_DEVICES_LATE` from its main process once per live task, in process
/// tree order (`for_each_pstree_item` in `restore_root_task`, `criu/cr-restore.c`): the
/// root task first, and only once every task has finished CRIU's restorer code and been
/// stopped under CRIU's ptrace (`catch_tasks`, `finalize_restore`).
pub const RESUME_DEVICES_LATE_ROOT_FIRST: Assumption = Assumption {
    checked: &[
        "4.1.1 (source)",
        "4.2 (source)",
        "4.3 (binary: the loop starts at root_item)",
    ],
};

/// What CRIU does when `RESUME_DEVICES_LATE` fails (neither 0 nor `-ENOTSUP`). 4.1.1 to
/// 4.2.1 log it at debug level ("restore late stage hook for external plugin failed") and
/// go on: the tasks run whatever the plugin answered, so a plugin that cannot give a task
/// its GPU state must end the tree itself. 4.3 logs "Device hook failed for pid" as an
/// error, stops calling the hook for later tasks, kills the restored tree and fails the
/// restore.
pub const RESUME_DEVICES_LATE_FAILURE: Assumption = Assumption {
    checked: &[
        "4.1.1 (source)",
        "4.2 (source)",
        "4.2.1 (binary: the debug message)",
        "4.3 (binary: the error, then \"Killing processes because of failure on restore\")",
    ],
};

/// The fd `DUMP_EXT_FILE` receives is CRIU's copy of the task's file, which CRIU closes as
/// soon as the hook returns (`dump_task_files_seized` in `criu/files.c`), and may reuse: a
/// plugin that needs the file later keeps a copy of its own.
pub const DUMP_EXT_FILE_FD_CLOSED_AFTER_HOOK: Assumption = Assumption {
    checked: &["4.1.1 (source)", "4.2 (source)"],
};

/// `criu_get_image_dir()` is CRIU's images directory service fd (`get_service_fd(IMG_FD_OFF)`
/// in `criu/plugin.c`), open for the whole run in CRIU's main process, and in every restored
/// task while CRIU restores its files: a plugin may borrow it for as long as a hook runs.
pub const IMAGE_DIR_SERVICE_FD: Assumption = Assumption {
    checked: &[
        "4.1.1 (source)",
        "4.2 (source)",
        "4.2.1 (binary: criu_get_image_dir)",
        "4.3 (binary: criu_get_image_dir)",
    ],
};

/// When `RESTORE_EXT_FILE` sets `retry_needed` (CRIU after 4.2), CRIU opens the task's
/// remaining files and calls the hook again only after the task made progress with another
/// file or another task sent it one; otherwise the task sleeps until such an event
/// (`open_fdinfos` and `wait_fds_event` in `criu/files.c`). A plugin that answers "retry"
/// twice for a file only another task can finish may leave the restore asleep for ever.
pub const RESTORE_EXT_FILE_RETRY_NEEDS_PROGRESS: Assumption = Assumption {
    checked: &[
        "criu-dev before 4.3 (source)",
        "4.3 (the kfd_module dma-buf restores)",
    ],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_state_reads_the_first_int() {
        let opts: [c_int; 3] = [TASK_STOPPED, 7, 8];
        // SAFETY: a live array of ints stands for CRIU's `opts`.
        assert_eq!(unsafe { final_state(opts.as_ptr()) }, TASK_STOPPED);
    }

    #[test]
    fn tracee_options_add_seccomp_suspension_only_when_asked() {
        assert_eq!(tracee_ptrace_options(false), libc::PTRACE_O_TRACESYSGOOD);
        assert_eq!(
            tracee_ptrace_options(true) & !libc::PTRACE_O_TRACESYSGOOD,
            libc::PTRACE_O_SUSPEND_SECCOMP
        );
    }
}
