//! Real processes and real CRIU against a simulated KFD reached through real system calls:
//! a supervisor (`tests/kfd_supervisor/`) answers, through seccomp user notification, the
//! `/dev/kfd` and render-node calls of a workload and of CRIU from the KFD simulator. See
//! `docs/kfd-seccomp.md`.
//!
//! Needs root, seccomp user notification with fd installation (Linux 5.14), and a character
//! device with minor 0 to stand in for `/dev/kfd` (`/dev/cpu/0/cpuid`): without one the
//! tests say SKIPPED and pass.

#![cfg(target_arch = "x86_64")]

#[path = "amdgpu_support/mod.rs"]
mod amdgpu_support;
use criu_gpu_test_support as common;
mod kfd_supervisor;

use std::path::Path;

use amdgpu_support::swapped_gpu_topologies;
use common::{CriuRun, E2e, wait_until};
use criu_gpu_core::amdgpu::device::AllocFlags;
use kfd_sim::{Fault, Faults};
use kfd_supervisor::Role;
use kfd_supervisor::answer::apertures_of;
use kfd_supervisor::harness::{
    Bench, Machine, assert_answers_again, assert_ran, errors_of, read, topology, workload,
};

#[test]
fn a_workload_gets_its_kfd_answers_from_the_simulator() {
    let Some(e) = E2e::start("kfd-seccomp-workload") else {
        return;
    };
    let Some(m) = Machine::start(
        "a_workload_gets_its_kfd_answers_from_the_simulator",
        &topology("1gpu"),
    ) else {
        return;
    };
    let (sup, gpu) = (&m.sup, m.gpus[0].clone());
    let out = e.dir().join("workload.out");
    let mut cmd = e.command(&workload());
    cmd.arg(format!("{:#x}", gpu.gpu_id))
        .arg(format!("/dev/dri/renderD{}", gpu.render_minor))
        .stdout(std::fs::File::create(&out).unwrap());
    sup.filter(&mut cmd, Role::Workload, None);
    let pid = e.spawn_session(cmd);
    wait_until("the workload to be ready", || {
        read(&out).contains("ready") || read(&out).contains(": ")
    });
    let text = read(&out);
    let a = apertures_of(gpu.gpu_id);
    let expected = [
        "version 1.14".to_string(),
        format!("acquired vm of gpu {:#x}", gpu.gpu_id),
        format!(
            "aperture gpu {:#x} lds {:#x} scratch {:#x} gpuvm {:#x}-{:#x}",
            gpu.gpu_id, a.lds_base, a.scratch_base, a.gpuvm_base, a.gpuvm_limit
        ),
        "ready".to_string(),
    ];
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        expected,
        "workload output:\n{text}\nsupervisor:\n{:#?}",
        sup.log()
    );
    let log = sup.log();
    for call in ["GET_VERSION", "ACQUIRE_VM", "GET_PROCESS_APERTURES_NEW"] {
        assert!(
            log.iter().any(|l| l.starts_with(&format!("pid {pid}: ioctl {call} ")) && l.ends_with("-> 0")),
            "{call} not answered: {log:#?}"
        );
    }
    // The workload's KFD process exists in the simulator, with the BOs of the spec.
    let view = sup
        .with_model(|m| m.sim.process(pid as u32))
        .expect("simulated process");
    assert_eq!(view.gpus, vec![(gpu.gpu_id, gpu.gpu_id)]);
    assert_eq!(view.bos.len(), 8 + 2, "8 BOs plus doorbell and MMIO pages");
    e.kill_and_reap(&[pid]);
}

/// A dump and a restore of the workload: what every such test checks.
struct RoundTrip {
    bench: Bench,
    pid: i32,
    dumped: Machine,
    restored: Machine,
    restore: CriuRun,
}

/// Dumps the workload on a machine of topology `dump_topology` and restores it on a fresh
/// machine of `restore_topology`, CRIU's restore run with `restore_env`; checks the images,
/// that the dump restarted the queues, that the restore recreated and resumed the process
/// with the same BO contents, and that the restored process runs and gets KFD answers.
fn round_trip(
    test: &str,
    dump_topology: &Path,
    restore_topology: &Path,
    restore_env: &[(&str, &str)],
) -> Option<RoundTrip> {
    round_trip_in(test, dump_topology, restore_topology, restore_env, false)
}

/// The mount namespace `/proc/PID/ns/mnt` names (its inode number).
fn mount_ns_of(pid: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/mnt"))
        .expect("mount namespace")
        .ino()
}

/// [`round_trip`]; with `own_ns`, the workload runs in a mount namespace of its own (a copy
/// of CRIU's) in which an empty tmpfs covers the image directory, CRIU dumps that namespace
/// and restores the workload in a new one (on a bind mount of `/`), so that the plugin's
/// restore hooks in the restored task reach their images only through CRIU's fd.
fn round_trip_in(
    test: &str,
    dump_topology: &Path,
    restore_topology: &Path,
    restore_env: &[(&str, &str)],
    own_ns: bool,
) -> Option<RoundTrip> {
    let dumped = Machine::start(test, dump_topology)?;
    let bench = Bench::start(test, &dumped.minors())?;
    let e = &bench.e;
    let out = e.dir().join("workload.out");
    // It must exist before the workload starts for the workload's tmpfs to cover it.
    let images = e.images("dump");
    let hidden = [images.clone()];
    let pid = bench.workload_in(&dumped, &out, own_ns.then_some(&hidden[..]));
    if own_ns {
        assert_ne!(
            mount_ns_of(&pid.to_string()),
            bench.ns.ino(),
            "the workload shares CRIU's mount namespace"
        );
    }
    let dump = bench.criu(
        &dumped,
        &["dump", "-t", &pid.to_string()],
        &images,
        "dump.log",
        &[],
    );
    assert_ran(&dump, &dumped);
    e.reap(&[pid]);
    let names: Vec<String> = std::fs::read_dir(&images)
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("amdgpu-kfd-")),
        "no KFD image in {names:?}"
    );
    assert!(
        names.iter().any(|n| n.starts_with("amdgpu-pages-")),
        "no pages image in {names:?}"
    );
    assert_eq!(
        names.iter().any(|n| n.starts_with("mountpoints-")),
        own_ns,
        "mount namespace images in {names:?}"
    );
    let log = dumped.sup.log();
    for call in ["CRIU_OP", "AMDGPU_CS"] {
        assert!(
            log.iter()
                .any(|l| l.contains(&format!("ioctl {call} ")) && l.ends_with("-> 0")),
            "no {call}: {log:#?}"
        );
    }
    let d = dumped.process(pid).expect("dumped process");
    assert!(!d.paused, "the dump restarted the queues: {d:?}");

    // The restore runs on a fresh machine (see docs/kfd-seccomp.md).
    let restored = Machine::start(test, restore_topology)?;
    let root = e.dir().join("root");
    let mut args = vec!["restore", "-d"];
    if own_ns {
        std::fs::create_dir(&root).unwrap();
        bench.ns.bind_root(&root).expect("bind mount of /");
        args.extend(["--root", root.to_str().unwrap()]);
    }
    let restore = bench.criu(&restored, &args, &images, "restore.log", restore_env);
    assert_ran(&restore, &restored);
    e.adopt(pid, pid);
    if own_ns {
        assert_restored_in_a_new_mount_namespace(&bench, &restored, pid, &images);
    }
    let r = restored.process(pid).expect("restored process");
    assert!(r.restored && r.resumed == 1 && !r.paused, "{r:?}");
    let differ = restored
        .sim()
        .compare_contents(pid as u32, &dumped.sim(), pid as u32)
        .expect("compare contents");
    assert!(
        differ.is_empty(),
        "BOs whose contents differ after the restore: {differ:x?}"
    );
    // The restored process runs.
    assert!(common::signal(pid, libc::SIGUSR1));
    wait_until("the restored workload to answer", || {
        read(&out).contains("alive 1")
    });
    // Its KFD call is answered by the restore's supervisor, through the filter the restored
    // task inherited from CRIU.
    assert!(
        read(&out).ends_with("ready\nalive 1: GET_VERSION ok 1.14\n"),
        "{}",
        read(&out)
    );
    let log = restored.sup.log();
    for call in ["CRIU_OP", "AMDGPU_CS"] {
        assert!(
            log.iter()
                .any(|l| l.contains(&format!("ioctl {call} ")) && l.ends_with("-> 0")),
            "no {call} at restore: {log:#?}"
        );
    }
    Some(RoundTrip {
        bench,
        pid,
        dumped,
        restored,
        restore,
    })
}

/// Asserts that the restored `pid` is in a mount namespace other than CRIU's and the test's,
/// in which the image directory `images` is the workload's empty tmpfs, and that its restore
/// (the plugin's hooks in the restored task) opened the render nodes there.
fn assert_restored_in_a_new_mount_namespace(bench: &Bench, m: &Machine, pid: i32, images: &Path) {
    let ns = mount_ns_of(&pid.to_string());
    assert_ne!(ns, bench.ns.ino(), "restored in CRIU's mount namespace");
    assert_ne!(
        ns,
        mount_ns_of("self"),
        "restored in the test's mount namespace"
    );
    let inside = Path::new(&format!("/proc/{pid}/root")).join(images.strip_prefix("/").unwrap());
    let seen: Vec<_> = std::fs::read_dir(&inside)
        .expect("the image directory seen from the restored task")
        .map(|d| d.unwrap().file_name())
        .collect();
    assert!(seen.is_empty(), "the restored task sees images: {seen:?}");
    let log = m.sup.log();
    for minor in m.minors() {
        let open = format!("pid {pid}: open /dev/dri/renderD{minor} -> fd ");
        assert!(
            log.iter().any(|l| l.starts_with(&open)),
            "no `{open}`: {log:#?}"
        );
    }
}

#[test]
fn the_image_directory_reached_from_a_new_mount_namespace() {
    let t = topology("1gpu");
    let Some(trip) = round_trip_in(
        "the_image_directory_reached_from_a_new_mount_namespace",
        &t,
        &t,
        &[],
        true,
    ) else {
        return;
    };
    trip.bench.e.kill_and_reap(&[trip.pid]);
}

#[test]
fn criu_dumps_and_restores_a_kfd_workload_with_the_release_plugin() {
    let t = topology("1gpu");
    let Some(trip) = round_trip(
        "criu_dumps_and_restores_a_kfd_workload_with_the_release_plugin",
        &t,
        &t,
        &[],
    ) else {
        return;
    };
    trip.bench.e.kill_and_reap(&[trip.pid]);
}

/// Asserts that the simulator sees `pid`'s queues running: not evicted, every eviction
/// of the dump undone.
fn assert_queues_running(m: &Machine, pid: i32) {
    let v = m.process(pid).expect("simulated process");
    assert!(!v.paused && v.evictions == 0, "queues left evicted: {v:?}");
}

#[test]
fn criu_dump_leave_running_keeps_the_workload_and_its_queues_running() {
    let test = "criu_dump_leave_running_keeps_the_workload_and_its_queues_running";
    let Some(m) = Machine::start(test, &topology("1gpu")) else {
        return;
    };
    let Some(bench) = Bench::start(test, &m.minors()) else {
        return;
    };
    let e = &bench.e;
    let out = e.dir().join("workload.out");
    let pid = bench.workload(&m, &out);
    let images = e.images("dump");
    let dump = bench.criu(
        &m,
        &["dump", "--leave-running", "-t", &pid.to_string()],
        &images,
        "dump.log",
        &[],
    );
    assert_ran(&dump, &m);
    assert!(
        m.sup.log().iter().any(|l| l.contains("ioctl CRIU_OP ")),
        "the plugin did not checkpoint: {:#?}",
        m.sup.log()
    );
    assert_eq!(
        common::state_of(pid).map(|s| s != 'Z'),
        Some(true),
        "workload gone"
    );
    assert_queues_running(&m, pid);
    // Its main thread runs (the KFD file's stand-in answers nothing itself), and a thread
    // with a fresh filter gets its KFD call answered by the simulator that holds its process.
    assert!(common::signal(pid, libc::SIGUSR1));
    wait_until("the workload to run on", || read(&out).contains("alive 1"));
    assert_answers_again(&m, pid, &out, 1);
    assert!(
        m.process(pid)
            .is_some_and(|v| !v.restored && v.resumed == 0)
    );
    // The images it left restore (once the original is gone) with the same contents.
    e.kill_and_reap(&[pid]);
    let Some(m2) = Machine::start(test, &topology("1gpu")) else {
        return;
    };
    let restore = bench.criu(&m2, &["restore", "-d"], &images, "restore.log", &[]);
    assert_ran(&restore, &m2);
    e.adopt(pid, pid);
    let r = m2.process(pid).expect("restored process");
    assert!(r.restored && r.resumed == 1 && !r.paused, "{r:?}");
    let differ = m2
        .sim()
        .compare_contents(pid as u32, &m.sim(), pid as u32)
        .expect("compare contents");
    assert!(differ.is_empty(), "BOs that differ: {differ:x?}");
    // Restored as it was at the dump: no signal seen yet.
    assert!(common::signal(pid, libc::SIGUSR1));
    wait_until("the restored workload to answer", || {
        read(&out).matches("alive 1").count() == 2
    });
    assert!(
        read(&out).ends_with("alive 1: GET_VERSION ok 1.14\n"),
        "{}",
        read(&out)
    );
    e.kill_and_reap(&[pid]);
}

#[test]
fn a_failed_dump_leaves_the_queues_running() {
    let test = "a_failed_dump_leaves_the_queues_running";
    let Some(m) = Machine::start(test, &topology("1gpu")) else {
        return;
    };
    let Some(bench) = Bench::start(test, &m.minors()) else {
        return;
    };
    let e = &bench.e;
    let out = e.dir().join("workload.out");
    let pid = bench.workload(&m, &out);
    let first_vram = m
        .process(pid)
        .and_then(|v| {
            v.bos
                .iter()
                .find(|b| AllocFlags::of(b.2).intersects(AllocFlags::VRAM))
                .map(|b| b.0)
        })
        .expect("a VRAM BO");
    let faults = [
        (
            "CHECKPOINT fails",
            "KFD CHECKPOINT failed: Input/output error",
            Faults {
                checkpoint: Some(Fault::once(libc::EIO)),
                ..Faults::default()
            },
        ),
        (
            "a BO's copy fails",
            "SDMA copy on renderD128 failed: Input/output error",
            Faults {
                download_at: Some((first_vram, libc::EIO)),
                ..Faults::default()
            },
        ),
    ];
    for (n, (what, why, faults)) in faults.into_iter().enumerate() {
        m.sim().set_faults(faults);
        let images = e.images(&format!("failed-{n}"));
        let dump = bench.criu(
            &m,
            &["dump", "-t", &pid.to_string()],
            &images,
            "dump.log",
            &[],
        );
        assert!(
            !dump.ok(),
            "{what}: the dump succeeded: {}",
            errors_of(&dump)
        );
        for said in [why, "GPU queues restarted after the failed checkpoint"] {
            assert!(
                dump.log.contains(said),
                "{what}: no `{said}` in the dump log:\n{}",
                errors_of(&dump)
            );
        }
        m.sim().set_faults(Faults::default());
        // The workload runs on, its queues restarted, its next KFD call answered.
        assert_eq!(
            common::state_of(pid).map(|s| s != 'Z'),
            Some(true),
            "{what}: workload gone:\n{}",
            errors_of(&dump)
        );
        assert_queues_running(&m, pid);
        assert_answers_again(&m, pid, &out, n as u32 + 1);
    }
    // Nothing was left locked or half-done: the next dump succeeds.
    let images = e.images("dump");
    let dump = bench.criu(
        &m,
        &["dump", "-t", &pid.to_string()],
        &images,
        "dump.log",
        &[],
    );
    assert_ran(&dump, &m);
    e.reap(&[pid]);
    assert!(!m.process(pid).expect("dumped process").paused);
}

/// Asserts that the dumped process had BOs with contents on every GPU of `m`.
fn assert_bos_on_every_gpu(m: &Machine, pid: i32) {
    let v = m.process(pid).expect("dumped process");
    for g in &m.gpus {
        assert!(
            v.bos.iter().any(|b| b.3 == g.gpu_id
                && AllocFlags::of(b.2).intersects(AllocFlags::VRAM | AllocFlags::GTT)),
            "no BO with contents on GPU {:#x}: {v:?}",
            g.gpu_id
        );
    }
}

#[test]
fn two_gpus_dump_and_restore_with_their_contents() {
    let t = topology("2gpu");
    let Some(trip) = round_trip("two_gpus_dump_and_restore_with_their_contents", &t, &t, &[])
    else {
        return;
    };
    assert_bos_on_every_gpu(&trip.dumped, trip.pid);
    let mut gpus = trip.restored.process(trip.pid).unwrap().gpus;
    gpus.sort_unstable();
    assert_eq!(gpus, vec![(1266, 1266), (53109, 53109)]);
    trip.bench.e.kill_and_reap(&[trip.pid]);
}

#[test]
fn two_gpus_restore_onto_the_gpus_swapped() {
    // As `two_gpus_restore_swapped` of the in-process tests: the two GPUs differ (device
    // ids), and the restore machine has them the other way round and with other gpu ids.
    let (ckpt, rest) = swapped_gpu_topologies();
    let Some(trip) = round_trip(
        "two_gpus_restore_onto_the_gpus_swapped",
        ckpt.path(),
        rest.path(),
        &[],
    ) else {
        return;
    };
    assert_bos_on_every_gpu(&trip.dumped, trip.pid);
    let mut gpus = trip.restored.process(trip.pid).unwrap().gpus;
    gpus.sort_unstable();
    // 53109 was node 1 (device 29711), now node 2 (id 0x2222); 1266 the other way round.
    assert_eq!(gpus, vec![(1266, 0x1111), (53109, 0x2222)]);
    for mapping in [
        "GPU 0xcf75 (renderD128) -> 0x2222 (renderD129)",
        "GPU 0x04f2 (renderD129) -> 0x1111 (renderD128)",
    ] {
        assert!(
            trip.restore.log.contains(mapping),
            "no `{mapping}` in the restore log:\n{}",
            errors_of(&trip.restore)
        );
    }
    trip.bench.e.kill_and_reap(&[trip.pid]);
    drop((ckpt, rest));
}

#[test]
fn parallel_restore_hands_the_copies_to_criu() {
    let test = "parallel_restore_hands_the_copies_to_criu";
    {
        // Only to learn CRIU's release: the hand-over needs CRIU 4.2's POST_FORKING.
        let Some(e) = E2e::start(test) else {
            return;
        };
        if e.criu_release().is_none_or(|r| r < (4, 2)) {
            eprintln!(
                "SKIPPED {test}: CRIU {:?} is older than 4.2 (run with CRIU_BIN=.criu-4.2.1/bin/criu)",
                e.criu_release()
            );
            return;
        }
    }
    let t = topology("2gpu");
    let Some(trip) = round_trip(
        test,
        &t,
        &t,
        &[("CRIU_GPU_AMDGPU_PARALLEL_RESTORE", "true")],
    ) else {
        return;
    };
    assert!(
        trip.restore
            .log
            .contains("of BO contents handed to CRIU's main process"),
        "no hand-over in the restore log:\n{}",
        errors_of(&trip.restore)
    );
    trip.bench.e.kill_and_reap(&[trip.pid]);
}
