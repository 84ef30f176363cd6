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

use common::{E2e, MANIFEST_DIR, cc, wait_until};
use criu_gpu_plugin::amdgpu::sim::{ProcessSpec, SimGpu, SimKfd};
use kfd_supervisor::answer::apertures_of;
use kfd_supervisor::{Model, Role, Supervisor, kfd_stand_in};

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
    sup.filter(&mut cmd, Role::Workload, None, None);
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
