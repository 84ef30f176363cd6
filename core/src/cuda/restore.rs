//! Restore: `init` reads the metadata and refuses early what cannot work (older driver, GPUs
//! missing, unreachable or of another model, too little free GPU memory) and plans the GPU map
//! onto the GPUs this restore can reach; `RESUME_DEVICES_LATE` gives the restored tasks' `/dev`
//! the nodes of those GPUs, then restores and unlocks every process of the restored tree at
//! once.
//!
//! Under runc, CRIU restores in the restored container's new cgroup: the GPUs whose nodes its
//! device cgroup lets this process open are the container's ([`super::devnodes`]). So a
//! checkpoint of a container on GPU 0 restored into one given GPU 1 goes to GPU 1, and one
//! given no GPU is refused at `init`, before any task exists.
//!
//! Processes are matched by their pid in their own pid namespace, which a container keeps
//! across a restore while the host pid changes. A process that cannot get its GPU state back
//! ends the restored tree: before 4.3, CRIU ignores what `RESUME_DEVICES_LATE` returns
//! ([`criu_plugin::criu_internals::RESUME_DEVICES_LATE_FAILURE`]).

use std::collections::BTreeMap;
use std::io;

use crate::restore_guardian::Watch;
use criu_plugin::{HookError, HookResult, InventoryListing};
use cuda_ckpt_sys::{Driver, GpuPair};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use super::error::{Cause, Failure, FailureKind};
use super::gpus::Gpu;
use super::metadata::{self, CudaMetadata, ProcessRecord};
use super::settings::CudaSettings;
use super::{devnodes, driver, gpus, image, preflight, procfs};

pub(super) mod settle;

use crate::restore_guardian::RestoreGuardian;

/// One restore's state, from `init` to `exit`.
pub struct RestoreRun {
    driver: Driver,
    parallel: bool,
    /// What the image's metadata says; `None` for an image without it (made by CRIU's C
    /// plugin), whose processes are then restored one at a time.
    image: Option<ImageRestore>,
    /// Kills the tasks CRIU forked should CRIU end before they have their GPU state back.
    guardian: Option<RestoreGuardian>,
    /// The first task `RESUME_DEVICES_LATE` came for: the root (CRIU calls it for the root
    /// first: [`criu_plugin::criu_internals::RESUME_DEVICES_LATE_ROOT_FIRST`]).
    root: Option<i32>,
}

/// A restore planned from the image's metadata.
struct ImageRestore {
    metadata: CudaMetadata,
    gpu_map: Vec<GpuPair>,
    /// The GPUs here the restore goes to, one per checkpointed GPU.
    targets: Vec<Gpu>,
    /// Where this CRIU finds their device nodes (`cuda.nvidia-dev`).
    dev_dir: std::path::PathBuf,
    /// Answers by host pid (already logged), once the tree has been restored.
    results: Option<BTreeMap<i32, HookResult>>,
}

impl RestoreRun {
    /// Prepares a restore: `None` when the image does not need the NVIDIA side; a failure
    /// when it does but cannot be restored here.
    pub fn start(
        settings: &CudaSettings,
        listing: InventoryListing,
    ) -> HookResult<Option<RestoreRun>> {
        // The image's process tree, read once for the checks and the guardian; not for an
        // image the plugin is not listed in, which is restored without a guardian: its tasks
        // are CRIU's business, unless one turns out to be checkpointed (see `unlisted`).
        let tree = (listing != InventoryListing::NotListed)
            .then(|| image::image_dir().map(criu_plugin::pstree::read_pids))
            .flatten();
        let Some(mut run) = Self::plan(settings, listing, tree.as_ref())? else {
            return Ok(None);
        };
        if listing != InventoryListing::NotListed {
            let image_pids = tree.and_then(Result::ok).unwrap_or_default();
            run.guardian =
                RestoreGuardian::spawn("cuda", &image_pids, super::guardian::ClaimTasks::default)
                    .map_err(|e| Failure::new(FailureKind::System, libc::EAGAIN, e))?;
        }
        Ok(Some(run))
    }

    /// The restore the image asks for, before any guardian; `tree` is the image's
    /// `pstree.img` as read (`None` without an image directory: `--stream`).
    fn plan(
        settings: &CudaSettings,
        listing: InventoryListing,
        tree: Option<&io::Result<Vec<u32>>>,
    ) -> HookResult<Option<RestoreRun>> {
        // An image that does not need the plugin is none of its business: whatever file of
        // our name lies in it (stale, misplaced, hostile) is not even opened.
        if listing == InventoryListing::NotListed {
            return Ok(unlisted(settings));
        }
        let run = |driver, image| RestoreRun {
            driver,
            parallel: settings.parallel,
            image,
            guardian: None,
            root: None,
        };
        let Some(md) = image::read_metadata()? else {
            // No metadata: an image from CRIU's C plugin, or one without CUDA processes.
            return match listing {
                InventoryListing::NotListed => Ok(None),
                // Old images list nothing: CUDA may or may not be in there.
                InventoryListing::NoList => Ok(settings
                    .nvidia_proc
                    .is_dir()
                    .then(|| driver::load(settings).ok())
                    .flatten()
                    .map(|(d, _)| run(d, None))),
                InventoryListing::Listed => {
                    let (d, _) = require_driver(
                        settings,
                        "the image needs cuda_plugin (it holds CUDA processes)",
                    )?;
                    Ok(Some(run(d, None)))
                }
            };
        };
        if md.processes.is_empty() {
            if listing == InventoryListing::Listed {
                // Our dump records every CUDA process it checkpointed: restoring on would
                // leave them checkpointed for good behind a successful restore.
                return Err(Failure::new(
                    FailureKind::Image,
                    libc::EINVAL,
                    format!(
                        "the image needs cuda_plugin but {} records no CUDA process (truncated or edited?); its CUDA processes could not be given their GPU state back",
                        metadata::FILE_NAME
                    ),
                ).into());
            }
            return Ok(None);
        }
        check_tree(&md, tree)?;
        let (d, version) = require_driver(
            settings,
            &format!("the image holds {} CUDA process(es)", md.processes.len()),
        )?;
        if let Some(r) = preflight::check_driver(&md, version) {
            return Err(Failure::new(r.kind, r.errno, r.message).into());
        }
        let (gpu_map, targets) = plan_gpus(settings, &md, version)?;
        Ok(Some(run(
            d,
            Some(ImageRestore {
                metadata: md,
                gpu_map,
                targets,
                dev_dir: settings.nvidia_dev.clone(),
                results: None,
            }),
        )))
    }

    /// `POST_FORKING` (CRIU 4.2 and later): the root task exists; the guardian is told of it
    /// from here, whatever its own looking has found so far. Never answers for the hook.
    pub fn post_forking(&mut self) -> HookResult {
        if let Some(g) = &self.guardian {
            g.announce_roots();
        }
        Err(HookError::NotMine)
    }

    /// `RESUME_DEVICES_LATE`: CRIU calls it for the root task first, and the whole tree is
    /// restored then; each process then gets its own answer.
    pub fn resume(&mut self, pid: i32) -> HookResult {
        let first = self.root.is_none();
        let root = *self.root.get_or_insert(pid);
        // Before any GPU work: should CRIU end while the tree is restored (the tasks have left
        // CRIU's restore code and run once CRIU lets go), the guardian ends the tree.
        if first && let Some(g) = &self.guardian {
            g.watch_root(pid, Watch::EndTree);
        }
        let answer = self.answer(pid, root);
        // The tree has its GPU state back: the guardian leaves it running from now on.
        // Released at `exit` alone, which a CRIU that waits for its tree calls when the tree
        // ends.
        let tree_ok = self
            .image
            .as_ref()
            .and_then(|i| i.results.as_ref())
            .is_none_or(|r| r.values().all(Result::is_ok));
        if first
            && tree_ok
            && let Some(g) = &self.guardian
        {
            g.watch_root(pid, Watch::Settled);
        }
        answer
    }

    fn answer(&mut self, pid: i32, root: i32) -> HookResult {
        let Some(image) = &mut self.image else {
            return resume_one(&self.driver, pid, root);
        };
        let results = match &image.results {
            Some(r) => r,
            None => image
                .results
                .insert(image.restore_tree(&self.driver, self.parallel, pid)),
        };
        results
            .get(&pid)
            .cloned()
            .unwrap_or(Err(HookError::NotMine))
    }

    /// `exit`: a restore that succeeded releases the guardian; one that failed leaves it to
    /// end what CRIU leaves behind once CRIU has ended.
    pub fn finish(mut self, ret: i32) {
        if ret == 0 {
            self.release_guardian();
        }
    }

    fn release_guardian(&mut self) {
        if let Some(g) = self.guardian.take() {
            g.release();
        }
    }
}

impl ImageRestore {
    /// Restores every process of the restored tree rooted at `root` (host pid) at once: the
    /// driver is asked about every task, recorded or not ([`settle`]).
    fn restore_tree(
        &self,
        driver: &Driver,
        parallel: bool,
        root: i32,
    ) -> BTreeMap<i32, HookResult> {
        // Host pid of each recorded process: match by the pid in its own namespace.
        let mut by_ns: BTreeMap<i32, &ProcessRecord> =
            self.metadata.processes.iter().map(|p| (p.pid, p)).collect();
        let tree = procfs::tree(root);
        let tasks: Vec<settle::Task> = tree
            .iter()
            .map(|&pid| {
                let ns = procfs::ns_pid(pid).unwrap_or(pid);
                settle::Task {
                    pid,
                    record: by_ns.remove(&ns).map(|r| r.found),
                }
            })
            .collect();
        let unmatched: Vec<i32> = by_ns.keys().copied().collect();
        if !unmatched.is_empty() {
            log::error!(
                "cuda: process(es) {} of the image are not in the restored tree; their GPU state is not restored",
                list_pids(&unmatched)
            );
        }
        if let Err(e) = self.provide_nodes(&tree) {
            // The driver would fail each restore with no word of why: fail them here, saying it.
            let recorded: Vec<i32> = tasks
                .iter()
                .filter(|t| t.record.is_some())
                .map(|t| t.pid)
                .collect();
            let f = e.failure("cuda: the restored tasks cannot reach their GPUs: ");
            log::error!("{}", f.message);
            end_restored(&tree, &recorded);
            return recorded
                .into_iter()
                .map(|p| (p, Err(HookError::from(f.clone()))))
                .collect();
        }
        let results = settle::settle(driver, &tasks, &self.gpu_map, parallel);
        let failed: Vec<i32> = results
            .iter()
            .filter(|(_, r)| r.is_err())
            .map(|(p, _)| *p)
            .collect();
        if !failed.is_empty() || !unmatched.is_empty() {
            let why = if failed.is_empty() {
                &unmatched
            } else {
                &failed
            };
            end_restored(&procfs::tree(root), why);
        }
        results
    }
}

impl ImageRestore {
    /// Gives every mount namespace of the restored tree (other than this CRIU's) the device
    /// nodes of the GPUs the restore goes to: a container's `/dev` comes back from the
    /// checkpoint, with the checkpointed GPU's node and not the one its new spec gave.
    fn provide_nodes(&self, tree: &[i32]) -> Result<(), devnodes::NodeError> {
        let targets: Vec<&Gpu> = self.targets.iter().collect();
        if targets.iter().all(|g| g.minor.is_none()) {
            return Ok(());
        }
        let mut done = std::collections::BTreeSet::new();
        for &pid in tree {
            if devnodes::other_mount_ns(pid) != Some(true) {
                continue;
            }
            let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
                continue;
            };
            if !done.insert(ns) {
                continue;
            }
            for made in devnodes::provide(pid, &targets, &self.dev_dir)? {
                log::info!(
                    "cuda: made {made} in the /dev of restored pid {pid}: it came back from the checkpoint without it"
                );
            }
        }
        Ok(())
    }
}

/// Restore of an image without our metadata (CRIU's C plugin made it, or the inventory does
/// not list `cuda_plugin`): one process at a time, as the driver finds it ([`settle`]).
fn resume_one(driver: &Driver, pid: i32, root: i32) -> HookResult {
    let task = settle::Task { pid, record: None };
    match settle::settle(driver, &[task], &[], false).remove(&pid) {
        None => Err(HookError::NotMine),
        Some(Ok(())) => Ok(()),
        // A CUDA process that cannot get its GPU state back must not run on frozen behind a
        // successful restore (the failure is logged already). The whole tree goes: CRIU lets
        // the tasks asked about before this one run while it detaches, before it finds this
        // one gone and kills the rest.
        Some(Err(e)) => {
            end_restored(&procfs::tree(root), &[pid]);
            Err(e)
        }
    }
}

/// A restore of an image whose inventory does not list `cuda_plugin`: its metadata is never
/// read, but where this machine has the driver every restored task is still asked about
/// ([`resume_one`]), so that one left checkpointed (an edited inventory, or a process someone
/// else had checkpointed before a dump without the plugin) does not run on frozen behind a
/// successful restore. Without a driver no restored task can be a checkpointed CUDA process.
fn unlisted(settings: &CudaSettings) -> Option<RestoreRun> {
    if !settings.nvidia_proc.is_dir() {
        return None;
    }
    let (driver, _) = driver::load(settings).ok()?;
    Some(RestoreRun {
        driver,
        parallel: settings.parallel,
        image: None,
        guardian: None,
        root: None,
    })
}

/// Loads the driver for a restore that cannot do without it; `why` starts the error.
fn require_driver(settings: &CudaSettings, why: &str) -> HookResult<(Driver, i32)> {
    settings.check(why)?;
    if let Some(problem) = settings.nvidia_proc_problem() {
        return Err(Failure::new(
            FailureKind::Machine,
            libc::ENODEV,
            format!("{why} but this machine has no NVIDIA driver ({problem})"),
        )
        .into());
    }
    driver::load(settings).map_err(|e| e.failure(format!("{why} but ")).into())
}

/// Checks the image's GPUs against those this restore can reach (model, count, free memory)
/// and plans the GPU map: empty when every GPU restores onto itself; with the GPUs it goes to.
fn plan_gpus(
    settings: &CudaSettings,
    md: &CudaMetadata,
    driver_version: i32,
) -> HookResult<(Vec<GpuPair>, Vec<Gpu>)> {
    let explicit = gpus::parse_device_map(&settings.device_map)
        .map_err(|e| e.failure("settings: cuda.device-map: "))?;
    let listing = gpus::read_listing(&settings.nvidia_proc, &settings.nvidia_dev)
        .map_err(|e| e.failure("cannot list this machine's GPUs: "))?;
    let mut local = listing.reachable.clone();
    let free = driver::fill_memory(&settings.nvml, &mut local);
    let checked = preflight::plan(md, driver_version, &local, free.as_ref(), &explicit);
    let gpu_map = checked.gpu_pairs();
    // The pairs are logged before the driver is found unable to use them.
    if checked.refusals.iter().all(|r| r.errno == libc::EOPNOTSUPP) {
        for p in &gpu_map {
            log::info!("cuda: GPU {} restores onto {}", p.old, p.new);
        }
    }
    if let Some(r) = checked.refusals.first() {
        let mut message = r.message.clone();
        if r.errno == libc::ENODEV {
            // Which GPUs the restore may use, and why the others not: in a container, those
            // its device cgroup refuses.
            message = format!("{message}. {}", listing.describe());
        }
        return Err(Failure::new(r.kind, r.errno, message).into());
    }
    log::info!(
        "cuda: {} CUDA process(es) to restore, checked against {} reachable GPU(s)",
        md.processes.len(),
        local.len()
    );
    let targets = checked
        .plan
        .iter()
        .flatten()
        .filter_map(|p| local.iter().find(|g| g.uuid == p.new).cloned())
        .collect();
    Ok((gpu_map, targets))
}

/// Refuses an image whose process tree (`pstree.img`, as read) cannot be restored here with
/// its GPU state: dumped on another CPU architecture (CRIU's own check comes only once it has
/// forked the root), or missing processes the metadata records (their GPU state would be
/// restored nowhere, and the tasks restored in their place would stay checkpointed).
/// Unreadable trees (`--stream`) are not checked.
fn check_tree(md: &CudaMetadata, tree: Option<&io::Result<Vec<u32>>>) -> HookResult {
    let (Some(dir), Some(tree)) = (image::image_dir(), tree) else {
        return Ok(());
    };
    let pids = match tree {
        Ok(p) => p,
        // A FIFO, device or link in its place is no image CRIU can restore from (and
        // `criu-gpu check` refuses the same).
        Err(e)
            if criu_plugin::files::is_not_regular(e) || e.raw_os_error() == Some(libc::ELOOP) =>
        {
            return Err(Failure::new(
                FailureKind::Image,
                libc::EINVAL,
                format!("the image's process tree cannot be read: {e}"),
            )
            .into());
        }
        Err(e) => {
            log::debug!("cuda: process tree not checked: {e}");
            return Ok(());
        }
    };
    if let Some(why) = criu_plugin::core_image::foreign_architecture(dir, pids) {
        return Err(Failure::new(FailureKind::Image, libc::EINVAL, why).into());
    }
    let missing = preflight::records_not_in_tree(md, pids);
    if missing.is_empty() {
        return Ok(());
    }
    Err(Failure::new(
        FailureKind::Image,
        libc::EINVAL,
        format!(
            "{} records CUDA process(es) {} that the image's process tree does not hold (a damaged or mismatched image); the restore would leave processes without their GPU state",
            metadata::FILE_NAME,
            list_pids(&missing)
        ),
    ).into())
}

/// Ends the restored processes `tree` after `failed` (some of them) could not get their GPU
/// state back. CRIU before 4.3 ignores what `RESUME_DEVICES_LATE` returns
/// ([`criu_plugin::criu_internals::RESUME_DEVICES_LATE_FAILURE`]), so the processes would
/// otherwise run on frozen behind "Restore finished successfully"; once they are gone, CRIU's
/// own detach from them fails and CRIU fails the restore (4.3 kills the tree itself too). The image is left as it is, for
/// another try.
pub(super) fn end_restored(tree: &[i32], failed: &[i32]) {
    log::error!(
        "cuda: the GPU state of pid(s) {} could not be restored: ending the {} restored process(es) so that the restore fails instead of leaving them frozen; the image is unchanged for another try",
        list_pids(failed),
        tree.len()
    );
    let threads: Vec<i32> = tree
        .iter()
        .flat_map(|&pid| procfs::threads(pid).into_iter().filter(move |&t| t != pid))
        .collect();
    for &pid in tree {
        // A task this restore created (CRIU still holds it under ptrace).
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    reap_traced_threads(&threads);
}

/// Longest wait for the killed tasks' threads in [`reap_traced_threads`].
const REAP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Reaps the threads (never a thread-group leader) of the killed tasks that this CRIU traces.
/// A traced thread that dies stays a zombie until its tracer waits for it. In a pid namespace
/// the init's last thread waits in the kernel for every other task of the namespace to be
/// gone, and CRIU before 4.3, which ignores the hook's answer and then fails to detach the
/// killed tasks, waits for the init with a plain waitpid(2) that never reaps those threads:
/// without this, CRIU and the restored init wait for each other for good.
fn reap_traced_threads(threads: &[i32]) {
    let mut left: Vec<i32> = threads.to_vec();
    let deadline = std::time::Instant::now() + REAP_WAIT;
    while !left.is_empty() {
        left.retain(|&tid| {
            // One thread id, without blocking; it reaps only a thread this process traces
            // (anything else answers ECHILD). Kept while it still runs.
            let flags = WaitPidFlag::WNOHANG | WaitPidFlag::__WALL;
            matches!(
                waitpid(Pid::from_raw(tid), Some(flags)),
                Ok(WaitStatus::StillAlive)
            )
        });
        if left.is_empty() || std::time::Instant::now() > deadline {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    if !left.is_empty() {
        log::warn!(
            "cuda: thread(s) {} of the ended tasks did not end within {} s",
            list_pids(&left),
            REAP_WAIT.as_secs()
        );
    }
}

/// Up to eight pids, then how many more: a hostile image must not make a huge message.
pub(super) fn list_pids(pids: &[i32]) -> String {
    let mut s: Vec<String> = pids.iter().take(8).map(|p| p.to_string()).collect();
    if pids.len() > 8 {
        s.push(format!("and {} more", pids.len() - 8));
    }
    s.join(", ")
}
