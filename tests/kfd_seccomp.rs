//! Real processes and real CRIU against a simulated KFD reached through real system calls:
//! a supervisor (`tests/kfd_supervisor/`) answers, through seccomp user notification, the
//! `/dev/kfd` and render-node calls of a workload and of CRIU from the KFD simulator. See
//! `docs/kfd-seccomp.md`.
//!
//! Needs root, seccomp user notification with fd installation (Linux 5.14), and a character
//! device with minor 0 to stand in for `/dev/kfd` (`/dev/cpu/0/cpuid`): without one the
//! tests say SKIPPED and pass.

#![cfg(target_arch = "x86_64")]

mod common;
mod kfd_supervisor;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{CriuRun, E2e, MANIFEST_DIR, cc, wait_until};
use criu_gpu_plugin::amdgpu::sim::{ProcessSpec, SimGpu, SimKfd};
use kfd_supervisor::answer::apertures_of;
use kfd_supervisor::{DevNs, Inside, Model, Role, Supervisor, kfd_stand_in};

fn topology() -> PathBuf {
    Path::new(MANIFEST_DIR).join("tests/fixtures/kfd-topology/1gpu")
}

fn workload() -> PathBuf {
    cc(
        "kfd-workload",
        &[format!("{MANIFEST_DIR}/tests/kfd_supervisor/workload.c")],
    )
}

/// A supervisor over a simulated machine of the 1-GPU topology whose workloads get a few
/// BOs of every kind; `None` (after saying so) where this machine has no stand-in device.
fn supervisor(test: &str) -> Option<(Supervisor, SimGpu, u64)> {
    let Some((dev, rdev)) = kfd_stand_in() else {
        eprintln!("SKIPPED {test}: no character device with minor 0 to stand in for /dev/kfd");
        return None;
    };
    let sim = SimKfd::from_sysfs(&topology()).expect("simulated machine");
    let gpu = sim.gpus()[0].clone();
    let spec = ProcessSpec::new(0, &[gpu.gpu_id]).with_mixed_bos(8, 256 << 10);
    let sup = Supervisor::start(Model::new(sim, spec, dev)).expect("supervisor");
    Some((sup, gpu, rdev))
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

#[test]
fn a_workload_gets_its_kfd_answers_from_the_simulator() {
    let Some(e) = E2e::start("kfd-seccomp-workload") else {
        return;
    };
    let Some((sup, gpu, _)) = supervisor("a_workload_gets_its_kfd_answers_from_the_simulator")
    else {
        return;
    };
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

/// The release plugin (no simulator in it): `$KFD_SECCOMP_PLUGIN`, else
/// `target/release/libcriu_gpu_plugin.so`, which must be newer than every source file of the
/// plugin (`scripts/test.sh` builds it first). A missing or stale one fails the test, unless
/// `GPU_PLUGIN_SKIP_E2E=1`, as every end-to-end test does.
fn release_plugin(test: &str) -> Option<PathBuf> {
    let p = std::env::var_os("KFD_SECCOMP_PLUGIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(MANIFEST_DIR).join("target/release/libcriu_gpu_plugin.so"));
    let skip = std::env::var_os("GPU_PLUGIN_SKIP_E2E").is_some_and(|v| v == "1");
    if !p.is_file() {
        if skip {
            eprintln!("SKIPPED {test}: GPU_PLUGIN_SKIP_E2E=1");
            return None;
        }
        panic!(
            "no {}: run `cargo build --release --lib` first (or set GPU_PLUGIN_SKIP_E2E=1)",
            p.display()
        );
    }
    if std::env::var_os("KFD_SECCOMP_PLUGIN").is_none() {
        let built = std::fs::metadata(&p)
            .and_then(|m| m.modified())
            .expect("plugin mtime");
        let newest = ["src", "criu-plugin/src", "kfd-sys/src"]
            .iter()
            .filter_map(|d| newest_mtime(&Path::new(MANIFEST_DIR).join(d)))
            .max();
        assert!(
            newest.is_none_or(|n| n <= built),
            "{} is older than the plugin's sources: run `cargo build --release --lib`",
            p.display()
        );
    }
    let bytes = std::fs::read(&p).expect("plugin");
    assert!(
        !common::bytes_contain(&bytes, b"KFD simulator with"),
        "{} is built with the kfd-sim feature; the release plugin is wanted",
        p.display()
    );
    Some(p)
}

/// The newest modification time of the files under `dir`.
fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let Ok(m) = e.metadata() else { continue };
        let t = if m.is_dir() {
            newest_mtime(&e.path())
        } else {
            m.modified().ok()
        };
        newest = newest.max(t);
    }
    newest
}

/// Runs CRIU with `args` under `sup`'s filter in `ns`, logging to `images/<log>`.
fn criu(
    e: &E2e,
    sup: &Supervisor,
    ns: &DevNs,
    args: &[&str],
    images: &Path,
    log: &str,
    libdir: &Path,
) -> CriuRun {
    let out = e.dir().join(format!("{log}.stdout"));
    let mut cmd = e.command(&e.criu);
    cmd.args(args)
        .arg("-D")
        .arg(images)
        .args(["-o", log, "-v4", "-L"])
        .arg(libdir)
        .env("CRIU_GPU_AMDGPU_TOPOLOGY", topology())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::options().append(true).open(&out).unwrap());
    sup.filter(
        &mut cmd,
        Role::Criu,
        Some(Inside {
            ns,
            cwd: e.dir(),
            output: None,
        }),
    );
    let what = format!("criu {} -D {}", args.join(" "), images.display());
    let started = Instant::now();
    let mut child = cmd.spawn().expect("start criu");
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for criu") {
            break st;
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what}: still running after 120 s; supervisor: {:#?}",
                sup.log()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let run = CriuRun {
        what,
        code: status.code(),
        log: read(&images.join(log)),
        output: read(&out),
        took: started.elapsed(),
    };
    eprintln!("{}: exit {:?} in {:?}", run.what, run.code, run.took);
    run
}

fn errors_of(run: &CriuRun) -> String {
    run.log
        .lines()
        .filter(|l| l.contains("Error") || l.contains("amdgpu") || l.contains("gpu_plugin"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn criu_dumps_and_restores_a_kfd_workload_with_the_release_plugin() {
    let test = "criu_dumps_and_restores_a_kfd_workload_with_the_release_plugin";
    let Some(e) = E2e::start("kfd-seccomp-criu") else {
        return;
    };
    let Some(plugin) = release_plugin(test) else {
        return;
    };
    let Some((sup, gpu, rdev)) = supervisor(test) else {
        return;
    };
    let libdir = e.dir().join("criu-lib");
    std::fs::create_dir_all(&libdir).unwrap();
    std::fs::copy(&plugin, libdir.join("gpu_plugin.so")).unwrap();
    let ns = DevNs::new(rdev, &[gpu.render_minor]).expect("mount namespace");

    let out = e.dir().join("workload.out");
    let mut cmd = e.command(&workload());
    cmd.arg(format!("{:#x}", gpu.gpu_id))
        .arg(format!("/dev/dri/renderD{}", gpu.render_minor));
    sup.filter_one_thread(
        &mut cmd,
        Some(Inside {
            ns: &ns,
            cwd: e.dir(),
            output: Some(&out),
        }),
    )
    .expect("filter program");
    let pid = e.spawn_session(cmd);
    wait_until("the workload to be ready", || {
        read(&out).contains("ready") || read(&out).contains(": ")
    });
    assert!(read(&out).ends_with("ready\n"), "workload: {}", read(&out));

    // No thread is left with a filter: a CRIU under seccomp cannot suspend a tracee's.
    let status = read(Path::new(&format!("/proc/{pid}/status")));
    assert!(status.contains("Seccomp:\t0\n"), "{status}");
    let images = e.images("dump");
    let dump = criu(
        &e,
        &sup,
        &ns,
        &["dump", "-t", &pid.to_string()],
        &images,
        "dump.log",
        &libdir,
    );
    assert!(
        dump.ok(),
        "{}: {}\n{}\nsupervisor: {:#?}",
        dump.what,
        dump.output,
        errors_of(&dump),
        sup.log()
    );
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
    let log = sup.log();
    for call in ["CRIU_OP", "AMDGPU_CS"] {
        assert!(
            log.iter()
                .any(|l| l.contains(&format!("ioctl {call} ")) && l.ends_with("-> 0")),
            "no {call}: {log:#?}"
        );
    }
    let dumped = sup
        .with_model(|m| m.sim.process(pid as u32))
        .expect("dumped process");
    assert!(!dumped.paused, "the dump restarted the queues: {dumped:?}");

    // The restore runs on a fresh machine of the same topology (see docs/kfd-seccomp.md).
    let Some((sup2, _, _)) = supervisor(test) else {
        return;
    };
    let restore = criu(
        &e,
        &sup2,
        &ns,
        &["restore", "-d"],
        &images,
        "restore.log",
        &libdir,
    );
    assert!(
        restore.ok(),
        "{}: {}\n{}\nsupervisor: {:#?}",
        restore.what,
        restore.output,
        errors_of(&restore),
        sup2.log()
    );
    e.adopt(pid, pid);
    let restored = sup2
        .with_model(|m| m.sim.process(pid as u32))
        .expect("restored process");
    assert!(
        restored.restored && restored.resumed == 1 && !restored.paused,
        "{restored:?}"
    );
    let sim1 = sup.with_model(|m| m.sim.clone());
    let differ = sup2
        .with_model(|m| m.sim.compare_contents(pid as u32, &sim1, pid as u32))
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
    let log = sup2.log();
    for call in ["CRIU_OP", "AMDGPU_CS"] {
        assert!(
            log.iter()
                .any(|l| l.contains(&format!("ioctl {call} ")) && l.ends_with("-> 0")),
            "no {call} at restore: {log:#?}"
        );
    }
    e.kill_and_reap(&[pid]);
}
