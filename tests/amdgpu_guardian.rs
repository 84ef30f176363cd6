//! The AMD dump's guardian on the KFD simulator: what a dump tells it (each process before its
//! queues are paused, that it needs nothing once they run again, the release at the end) and
//! what it does when CRIU ends in the middle of the dump (CRIU killed: no further hook runs;
//! the guardian restarts the queues of every process it still watches).
//!
//! The guardian process itself (`criu_plugin::guardian`) is forked from CRIU and cannot be
//! forked from this multi-threaded test with the simulator's in-memory state: a guard here
//! hears what the guardian would, and the test runs the guardian's restart
//! (`guardian::restart_queues`) on what it heard. `tests/kfd_module.rs` kills real CRIU in
//! the middle of dumps with the real guardian.

#[path = "amdgpu_support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use criu_gpu_core::amdgpu::device::KfdHolder;
use criu_gpu_core::amdgpu::guardian::{self, QueueGuard, QueueGuardFactory, Restart};
use criu_gpu_core::backend::{GpuBackend, HookHandler};
use criu_plugin::{HookError, HostVersion, InventoryListing, Stage};
use kfd_sim::{Fault, ProcessSpec, SimKfd};
use support::*;

/// What a guard heard from a dump.
#[derive(Default)]
struct Heard {
    /// Watched processes, with whether their queues were paused already when the watch came.
    watched: Mutex<BTreeMap<i32, (KfdHolder, bool)>>,
    released: AtomicBool,
    dead: AtomicBool,
}

impl Heard {
    fn holders(&self) -> Vec<KfdHolder> {
        self.watched.lock().unwrap().values().map(|w| w.0).collect()
    }
}

struct Guard(Arc<Heard>, SimKfd);

impl QueueGuard for Guard {
    fn alive(&self) -> bool {
        !self.0.dead.load(Ordering::SeqCst)
    }

    fn watch(&self, holder: &KfdHolder) -> std::io::Result<()> {
        let paused = self.1.process(holder.pid as u32).unwrap().paused;
        self.0
            .watched
            .lock()
            .unwrap()
            .insert(holder.pid, (*holder, paused));
        Ok(())
    }

    fn forget(&self, pid: i32) -> std::io::Result<()> {
        self.0.watched.lock().unwrap().remove(&pid);
        Ok(())
    }

    fn release(self: Box<Self>) {
        self.0.released.store(true, Ordering::SeqCst);
    }
}

fn guard(sim: &SimKfd, heard: &Arc<Heard>) -> QueueGuardFactory {
    let (h, s) = (heard.clone(), sim.clone());
    Arc::new(move |_dev| {
        Ok(Some(
            Box::new(Guard(h.clone(), s.clone())) as Box<dyn QueueGuard>
        ))
    })
}

struct Run {
    sim: SimKfd,
    procs: Vec<Proc>,
    heard: Arc<Heard>,
    backend: criu_gpu_core::amdgpu::AmdgpuBackend,
    _images: TempDir,
}

/// A dump of `pids` on the simulator, initialised, with a guard that records what it hears.
fn run(pids: &[u32], factory: Option<QueueGuardFactory>) -> Run {
    let (topo, sim) = fixture_sim("2gpu");
    let procs: Vec<Proc> = pids
        .iter()
        .map(|&pid| {
            spawn(
                &sim,
                &ProcessSpec::new(pid, &[53109, 1266]).with_mixed_bos(8, 1 << 20),
            )
        })
        .collect();
    let images = TempDir::new("guardian");
    let heard = Arc::new(Heard::default());
    let factory = factory.unwrap_or_else(|| guard(&sim, &heard));
    let mut backend = backend_guarded(&sim, images.path(), None, None, Some(factory));
    let cfg = config(&topo, "");
    assert_eq!(
        backend.init(
            &ctx(&cfg, HostVersion::Dev, InventoryListing::NoList),
            Stage::Dump
        ),
        Ok(true)
    );
    Run {
        sim,
        procs,
        heard,
        backend,
        _images: images,
    }
}

fn fails(r: Result<Vec<Dumped>, HookError>) -> HookError {
    match r {
        Ok(_) => panic!("the dump should fail"),
        Err(e) => e,
    }
}

fn paused(sim: &SimKfd, pid: u32) -> bool {
    sim.process(pid).unwrap().paused
}

#[test]
fn criu_killed_after_the_pause_leaves_the_restart_to_the_guardian() {
    let mut r = run(&[301, 302], None);
    let procs: Vec<&Proc> = r.procs.iter().collect();
    dump_files(&mut r.backend, &r.sim, &procs, 1).unwrap();
    // CRIU is killed here: no DUMP_DEVICES_LATE, no exit. Its memory goes, and with it the
    // backend.
    drop(r.backend);
    assert!(paused(&r.sim, 301) && paused(&r.sim, 302));
    let watched = r.heard.watched.lock().unwrap().clone();
    assert_eq!(watched.keys().copied().collect::<Vec<_>>(), vec![301, 302]);
    for p in &r.procs {
        let (holder, paused_at_watch) = watched[&(p.pid as i32)];
        assert_eq!(holder.fd, p.kfd.as_raw_fd(), "the fd the process holds");
        assert!(
            !paused_at_watch,
            "pid {}: watched after its queues were paused",
            p.pid
        );
    }
    assert!(!r.heard.released.load(Ordering::SeqCst));

    // The guardian, once CRIU has ended.
    let left: Vec<_> = r.heard.holders().into_iter().map(|h| (h, None)).collect();
    let done = guardian::restart_queues(&r.sim, &left);
    assert!(
        done.iter().all(|(_, d)| matches!(d, Restart::Restarted(1))),
        "{done:?}"
    );
    for pid in [301, 302] {
        let v = r.sim.process(pid).unwrap();
        assert!(!v.paused && v.evictions == 0, "{v:?}");
    }
    // Asked again (a guardian that watched a process whose queues the dump restarted just
    // before CRIU ended): nothing to do.
    let again = guardian::restart_queues(&r.sim, &left);
    assert!(
        again.iter().all(|(_, d)| matches!(d, Restart::WasRunning)),
        "{again:?}"
    );
}

#[test]
fn a_dump_that_ends_well_releases_the_guardian_with_nothing_watched() {
    let mut r = run(&[311, 312], None);
    let procs: Vec<&Proc> = r.procs.iter().collect();
    dump_files(&mut r.backend, &r.sim, &procs, 1).unwrap();
    assert_eq!(r.heard.holders().len(), 2);
    r.backend.dump_devices_late(311).unwrap();
    // The queues run again: the guardian has nothing left to do, should CRIU still be killed
    // before its end.
    assert!(r.heard.holders().is_empty());
    assert!(!r.heard.released.load(Ordering::SeqCst));
    r.backend.exit(Stage::Dump, 0);
    assert!(r.heard.released.load(Ordering::SeqCst));
    assert!(!paused(&r.sim, 311) && !paused(&r.sim, 312));
}

#[test]
fn a_failed_pause_or_checkpoint_is_forgotten_once_the_queues_run() {
    // PROCESS_INFO fails: watched, then forgotten (nothing was paused).
    let mut r = run(&[321], None);
    r.sim
        .update_faults(|f| f.process_info = Some(Fault::once(libc::ENOMEM)));
    let procs: Vec<&Proc> = r.procs.iter().collect();
    let e = fails(dump_files(&mut r.backend, &r.sim, &procs, 1));
    assert_eq!(e, HookError::logged(libc::ENOMEM));
    assert!(r.heard.holders().is_empty());
    r.backend.exit(Stage::Dump, -1);
    assert!(r.heard.released.load(Ordering::SeqCst));

    // CHECKPOINT fails: the dump restarts the queues at once and forgets the process.
    let mut r = run(&[322], None);
    r.sim
        .update_faults(|f| f.checkpoint = Some(Fault::once(libc::EIO)));
    let procs: Vec<&Proc> = r.procs.iter().collect();
    fails(dump_files(&mut r.backend, &r.sim, &procs, 1));
    assert!(!paused(&r.sim, 322));
    assert!(r.heard.holders().is_empty());
    r.backend.exit(Stage::Dump, -1);
    assert!(r.heard.released.load(Ordering::SeqCst));
}

#[test]
fn queues_the_dump_cannot_restart_are_left_to_the_guardian() {
    let mut r = run(&[331, 332], None);
    let procs: Vec<&Proc> = r.procs.iter().collect();
    dump_files(&mut r.backend, &r.sim, &procs, 1).unwrap();
    r.sim
        .update_faults(|f| f.unpause = Some(Fault::always(libc::EBUSY)));
    r.backend.dump_devices_late(331).unwrap_err();
    r.backend.exit(Stage::Dump, -1);
    // Not released: it acts once CRIU has ended.
    assert!(!r.heard.released.load(Ordering::SeqCst));
    assert_eq!(r.heard.holders().len(), 2);

    // One UNPAUSE of the guardian's fails too: that process is reported, the other restarts.
    r.sim
        .update_faults(|f| f.unpause = Some(Fault::once(libc::EBUSY)));
    let left: Vec<_> = r.heard.holders().into_iter().map(|h| (h, None)).collect();
    let done = guardian::restart_queues(&r.sim, &left);
    let failed: Vec<i32> = done
        .iter()
        .filter(|(_, d)| matches!(d, Restart::Failed(e) if e.raw_os_error() == Some(libc::EBUSY)))
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(failed.len(), 1, "{done:?}");
    let other = if failed[0] == 331 { 332 } else { 331 };
    assert!(paused(&r.sim, failed[0] as u32) && !paused(&r.sim, other));
    assert_eq!(guardian::recovery_command(331), "criu-gpu resume 331");
}

#[test]
fn no_queue_is_paused_without_a_guardian() {
    // The guardian cannot start: the KFD file fails before PROCESS_INFO.
    let failing: QueueGuardFactory =
        Arc::new(|_dev| Err(std::io::Error::from_raw_os_error(libc::EAGAIN)));
    let mut r = run(&[341], Some(failing));
    let procs: Vec<&Proc> = r.procs.iter().collect();
    let e = fails(dump_files(&mut r.backend, &r.sim, &procs, 1));
    assert_eq!(e, HookError::logged(libc::EAGAIN));
    assert_eq!(r.sim.process(341).unwrap().evictions, 0);
    r.backend.exit(Stage::Dump, -1);

    // The guardian died after the first process: the second is not paused.
    let mut r = run(&[342, 343], None);
    dump_files(&mut r.backend, &r.sim, &[&r.procs[0]], 1).unwrap();
    r.heard.dead.store(true, Ordering::SeqCst);
    let e = fails(dump_files(&mut r.backend, &r.sim, &[&r.procs[1]], 10));
    assert_eq!(e, HookError::logged(libc::ESRCH));
    assert_eq!(r.sim.process(343).unwrap().evictions, 0);
    r.backend.exit(Stage::Dump, -1);
    assert!(!paused(&r.sim, 342));
}

#[test]
fn a_kernel_without_pidfds_dumps_unguarded() {
    let none: QueueGuardFactory = Arc::new(|_dev| Ok(None));
    let mut r = run(&[351], Some(none));
    let procs: Vec<&Proc> = r.procs.iter().collect();
    dump_files(&mut r.backend, &r.sim, &procs, 1).unwrap();
    r.backend.dump_devices_late(351).unwrap();
    r.backend.exit(Stage::Dump, 0);
    assert!(!paused(&r.sim, 351));
}
