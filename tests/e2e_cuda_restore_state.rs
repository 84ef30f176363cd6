//! A restore never reports success while a process it restored stays locked or checkpointed,
//! whatever the image says: real CRIU, the plugin built from this tree, the stand-in CUDA driver
//! (see `tests/e2e_cuda_fake.rs` for the harness). Each image below is edited after a good dump:
//! a missing process record, a record saying `locked` or `checkpointed`, an inventory that does
//! not list `cuda_plugin` (also restored with the NVIDIA side disabled), a metadata file damaged
//! or of the older format 1.0, core images saying another CPU architecture. Each restore
//! ends with every process running with its GPU state, or fails with nothing left behind, and a
//! second restore from the mended images then works.
//!
//! CRIU comes from `$CRIU_BIN`; these tests need root and `cc` (or `GPU_PLUGIN_SKIP_E2E=1`).

use criu_gpu_test_support as common;

use std::path::Path;
use std::time::Duration;

use common::fake_cuda::*;
use common::scenario::*;
use common::{CriuRun, foreign_arch, reap_until_gone};

/// A dumped tree of a root and one child on one stand-in GPU, with its images.
struct Dumped {
    f: OneGpu,
    w: Workload,
    /// The metadata as the dump wrote it.
    md: String,
}

fn dump_tree(test: &str) -> Option<Dumped> {
    let f = OneGpu::start(test)?;
    let w = f.workload(&["--mib", "8", "--children", "1"]);
    f.dumped(&w);
    let md = std::fs::read_to_string(f.images.join("gpu-plugin-cuda.img")).expect("metadata");
    Some(Dumped { f, w, md })
}

impl Dumped {
    fn restore(&self, name: &str, extra_env: &[(&str, String)]) -> CriuRun {
        let mut env = self.f.env(&format!("{name}.calls"));
        env.extend(extra_env.iter().cloned());
        self.f.restore(&format!("{name}.log"), &env)
    }

    /// Writes `text` as the image's metadata, its checksum made anew.
    fn write_md(&self, text: &str) {
        std::fs::write(
            self.f.images.join("gpu-plugin-cuda.img"),
            resealed_metadata(text),
        )
        .expect("write metadata");
    }

    /// The metadata with `edit` applied to the record of `pid` (`None` drops it).
    fn md_with(&self, pid: i32, edit: impl Fn(&[&str]) -> Option<String>) -> String {
        self.md
            .lines()
            .filter_map(|l| {
                let fields: Vec<&str> = l.split(' ').collect();
                if fields.first() == Some(&"process") && fields.get(1) == Some(&&*pid.to_string()) {
                    edit(&fields).map(|l| l + "\n")
                } else {
                    Some(format!("{l}\n"))
                }
            })
            .collect()
    }

    /// Success with every process running with its GPU state: restored and unlocked.
    fn assert_running(&self, r: &CriuRun, name: &str) {
        r.assert_ok();
        let calls = self.f.calls(&format!("{name}.calls"));
        for &p in &self.w.pids {
            assert_eq!(
                calls.transitions(p),
                ["restore=0", "unlock=0"],
                "pid {p}: {calls:?}\n{r:?}"
            );
            assert!(
                !self.f.device_files(p).is_empty(),
                "pid {p}: no device files"
            );
        }
        self.w.assert_all_running(name);
    }

    /// Failure with no process left holding the image's pids.
    fn assert_failed_clean(&self, r: &CriuRun, why: &str) {
        r.assert_failed();
        assert!(!r.has("Restore finished successfully"), "{r:?}");
        assert!(r.has(why), "{why}: {r:?}");
        assert!(
            reap_until_gone(&self.w.pids, Duration::from_secs(10)),
            "processes left after the failed restore: {r:?}"
        );
    }
}

#[test]
fn a_process_without_a_record_is_given_its_gpu_state_or_the_restore_fails() {
    let Some(d) = dump_tree("cuda-no-record") else {
        return;
    };
    let child = d.w.pids[1];
    let marks = d.w.marks();
    d.write_md(&d.md_with(child, |_| None));

    // The driver cannot restore it: the restore fails, nothing is left.
    let fail = [("FAKE_CUDA_FAIL", format!("restore@{child}"))];
    let r = d.restore("r1", &fail);
    d.assert_failed_clean(
        &r,
        "so that the restore fails instead of leaving them frozen",
    );

    // The same images again: the child is given its GPU state back.
    let r = d.restore("r2", &[]);
    assert!(
        r.has(&format!(
            "cuda: pid {child}: checkpointed but the image records no GPU state for it"
        )),
        "{r:?}"
    );
    d.assert_running(&r, "r2");
    d.w.assert_continues(&marks);
}

#[test]
fn records_saying_locked_or_checkpointed_still_end_running() {
    let Some(d) = dump_tree("cuda-record-state") else {
        return;
    };
    let child = d.w.pids[1];
    for (i, state) in ["locked", "checkpointed"].into_iter().enumerate() {
        let name = format!("r-{state}");
        d.write_md(&d.md_with(child, |f| {
            let mut f = f.to_vec();
            f[3] = state;
            Some(f.join(" "))
        }));
        let r = d.restore(&name, &[]);
        assert!(
            r.has(&format!(
                "cuda: pid {child}: was {state} by another tool when dumped"
            )),
            "{r:?}"
        );
        d.assert_running(&r, &name);
        if i == 0 {
            // Another restore from the same images needs the pids free.
            d.f.e.kill_and_reap(&d.w.pids);
        }
    }
}

/// The metadata's checksum refuses an image edited behind the plugin's back before anything is
/// restored, and an image of format 1.0 (what the plugin wrote before the format had a minor
/// version and a checksum) still restores.
#[test]
fn a_damaged_metadata_file_is_refused_and_one_of_format_1_0_restores() {
    let Some(d) = dump_tree("cuda-md-format") else {
        return;
    };
    assert!(
        d.md.starts_with("gpu-plugin-cuda 1.1\n") && d.md.contains("\ncrc32 "),
        "{}",
        d.md
    );
    let marks = d.w.marks();
    let edited = d.md.replacen(" running ", " locked ", 1);
    assert_ne!(edited, d.md);
    std::fs::write(d.f.images.join("gpu-plugin-cuda.img"), edited).unwrap();
    let r = d.restore("r1", &[]);
    d.assert_failed_clean(&r, "gpu-plugin-cuda.img is damaged or was edited");
    assert_nothing_restored(&r, &d.w.pids);
    assert!(
        d.f.calls("r1.calls").0.is_empty(),
        "driver calls after a refused image"
    );

    let old = metadata_of_format_1_0(&d.md);
    std::fs::write(d.f.images.join("gpu-plugin-cuda.img"), &old).unwrap();
    let r = d.restore("r2", &[]);
    r.assert_no_plugin_errors();
    d.assert_running(&r, "r2");
    d.w.assert_continues(&marks);
}

/// An inventory that does not list `cuda_plugin` keeps the plugin away from its metadata (here
/// a file it would refuse), yet no restored process runs on checkpointed.
#[test]
fn an_inventory_without_cuda_plugin_never_leaves_a_process_checkpointed() {
    let Some(d) = dump_tree("cuda-unlisted") else {
        return;
    };
    let marks = d.w.marks();
    drop_inventory_plugin(&d.f.images.join("inventory.img"), b"cuda_plugin");
    d.write_md("not metadata\n");

    let fail = [("FAKE_CUDA_FAIL", format!("restore@{}", d.w.pids[1]))];
    let r = d.restore("r1", &fail);
    d.assert_failed_clean(
        &r,
        "so that the restore fails instead of leaving them frozen",
    );

    let r = d.restore("r2", &[]);
    assert!(!r.has("gpu-plugin-cuda.img"), "metadata read: {r:?}");
    for &p in &d.w.pids {
        assert!(
            r.has(&format!(
                "cuda: pid {p}: checkpointed but the image records no GPU state for it"
            )),
            "{r:?}"
        );
    }
    d.assert_running(&r, "r2");
    d.w.assert_continues(&marks);
}

/// The same inventory without `cuda_plugin`, restored with the NVIDIA side switched off
/// (`disable = cuda`): nothing gives the processes their GPU state back, so the restore fails
/// and ends them instead of reporting success with them checkpointed, the driver asked for
/// their state only; with the NVIDIA side on again the same images restore.
#[test]
fn a_restore_with_cuda_disabled_never_reports_success_with_processes_checkpointed() {
    let Some(d) = dump_tree("cuda-disabled") else {
        return;
    };
    let marks = d.w.marks();
    drop_inventory_plugin(&d.f.images.join("inventory.img"), b"cuda_plugin");

    let off = [("CRIU_GPU_DISABLE", "cuda".to_string())];
    let r = d.restore("r1", &off);
    d.assert_failed_clean(&r, "but the NVIDIA side is disabled (`disable = cuda`");
    for &p in &d.w.pids {
        assert!(
            r.has(&format!(
                "restored pid {p} is a CUDA process left checkpointed"
            )),
            "{r:?}"
        );
        assert!(
            d.f.calls("r1.calls").transitions(p).is_empty(),
            "pid {p}: the disabled side changed a process"
        );
    }

    let r = d.restore("r2", &[]);
    d.assert_running(&r, "r2");
    d.w.assert_continues(&marks);
}

/// Removes one name from `inventory.img`'s plugin list: CRIU's magic, the size of the one
/// `InventoryEntry`, which holds the list as a nested message (`plugins_entry`, one length
/// byte) of strings (tag, length byte, name). The list stays, one name shorter.
fn drop_inventory_plugin(path: &Path, name: &[u8]) {
    let mut img = std::fs::read(path).expect("inventory.img");
    let size = u32::from_le_bytes(img[4..8].try_into().unwrap()) as usize;
    assert_eq!(size, img.len() - 8, "one entry expected in inventory.img");
    let at = img
        .windows(name.len())
        .position(|w| w == name)
        .expect("the plugin in inventory.img");
    let cut = name.len() + 2;
    assert_eq!(img[at - 1] as usize, name.len(), "length byte");
    assert!(img[at - 3] as usize >= cut, "list length byte");
    img[at - 3] -= cut as u8;
    img.drain(at - 2..at + name.len());
    img[4..8].copy_from_slice(&((size - cut) as u32).to_le_bytes());
    std::fs::write(path, img).expect("write inventory.img");
}

/// A FIFO in place of `pstree.img` is refused by the plugin's `init`, before CRIU would block
/// opening it; with the file put back the same images restore. Only where CRIU calls the
/// plugins' `init` before it reads the tree itself (4.0 and 4.1): from 4.2 on CRIU opens
/// `pstree.img` first, and blocks on the FIFO before any plugin runs.
#[test]
fn a_fifo_process_tree_is_refused_before_anything_is_restored() {
    let Some(d) = dump_tree("cuda-fifo-pstree") else {
        return;
    };
    if !matches!(d.f.e.criu_release(), Some((4, 0 | 1))) {
        eprintln!(
            "SKIPPED: CRIU {:?} reads pstree.img before calling plugins",
            d.f.e.criu_release()
        );
        return;
    }
    let pstree = d.f.images.join("pstree.img");
    let saved = std::fs::read(&pstree).expect("pstree.img");
    std::fs::remove_file(&pstree).unwrap();
    common::mkfifo(&pstree);
    let r = d.restore("r1", &[]);
    d.assert_failed_clean(&r, "the image's process tree cannot be read");
    assert!(r.has("a FIFO"), "{r:?}");
    std::fs::remove_file(&pstree).unwrap();
    std::fs::write(&pstree, saved).unwrap();
    let r = d.restore("r2", &[]);
    d.assert_running(&r, "r2");
}

/// Core images saying arm64 (`common::foreign_arch`): the plugin refuses at its start, naming
/// both architectures, before CRIU forks a task (CRIU's own check comes only after it has);
/// the driver is not asked to restore. With the core images put back the same restore works.
#[test]
fn a_checkpoint_of_another_cpu_architecture_is_refused_before_any_task() {
    let Some(d) = dump_tree("cuda-other-arch") else {
        return;
    };
    let saved = foreign_arch::dumped_on(&d.f.images, foreign_arch::MARCH_AARCH64);
    let r = d.restore("r1", &[]);
    d.assert_failed_clean(&r, "the checkpoint was made on aarch64 (core-");
    assert!(r.has("and this machine is x86_64"), "{r:?}");
    assert!(
        !r.has("Forking task") && !r.has("Core march mismatch"),
        "CRIU went on to its own check: {r:?}"
    );
    let calls = d.f.calls("r1.calls");
    for &p in &d.w.pids {
        assert!(calls.transitions(p).is_empty(), "pid {p}: {calls:?}");
    }
    for (path, original) in saved {
        std::fs::write(path, original).expect("core image put back");
    }
    let r = d.restore("r2", &[]);
    d.assert_running(&r, "r2");
}
