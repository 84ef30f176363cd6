//! The KFD behaviours the plugin relies on, and where each of the two models of KFD checks
//! it: this simulator (a test that calls it) and the stand-in kernel module of
//! `tests/kfd_module/` (the C code that implements it, and the guest test that exercises it
//! under real CRIU). The seccomp supervisor of `tests/kfd_supervisor/` has no KFD behaviour
//! of its own: it answers real system calls from this simulator.
//!
//! A change of KFD behaviour starts here: its row names the two places to change. The test
//! below fails when a row lacks its simulator test, or names a test or symbol its file does
//! not have.

/// A place in the sources: a file (from the workspace root) and a name in it (a test
/// function, or a C symbol).
pub type Place = (&'static str, &'static str);

/// One KFD behaviour the plugin relies on.
pub struct Behaviour {
    /// What KFD does, as the plugin depends on it.
    pub what: &'static str,
    /// The simulator test that checks it.
    pub sim_test: Place,
    /// The stand-in module's code that implements it; `None` where the kernel itself
    /// answers (procfs, ptrace) and the module has nothing of its own.
    pub module_code: Option<Place>,
    /// The guest test that exercises it under real CRIU, where one does.
    pub module_test: Option<Place>,
}

const CRIU_OPS: &str = "kfd-sim/tests/criu_ops.rs";
const SDMA: &str = "kfd-sim/tests/sdma.rs";
const AMDGPU_E2E: &str = "tests/amdgpu_e2e.rs";
const CRIU_C: &str = "tests/kfd_module/criu.c";
const KFD_C: &str = "tests/kfd_module/kfd.c";
const RENDER_C: &str = "tests/kfd_module/render.c";
const GUEST: &str = "tests/kfd_module.rs";
const GUEST_CHECKS: &str = "tests/kfd_module_support/mod.rs";
const GUEST_KILLS: &str = "tests/kfd_module_support/kills.rs";

/// Every KFD behaviour the plugin relies on.
pub const BEHAVIOURS: &[Behaviour] = &[
    Behaviour {
        what: "GET_VERSION answers on /dev/kfd files (ENOTTY elsewhere)",
        sim_test: (CRIU_OPS, "get_version_answers_on_kfd_files_only"),
        module_code: Some((KFD_C, "get_version")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "CRIU operations come from the process itself or its tracer (EBADF otherwise)",
        sim_test: (
            CRIU_OPS,
            "criu_operations_come_from_the_process_or_its_tracer",
        ),
        module_code: Some((KFD_C, "caller_may_criu")),
        module_test: Some((GUEST_KILLS, "criu_killed_in_the_middle_of_amd_dumps")),
    },
    Behaviour {
        what: "the holder of a KFD file CRIU took is found among the processes the caller \
               traces",
        sim_test: (
            CRIU_OPS,
            "the_holder_of_a_kfd_file_is_found_among_the_traced_processes",
        ),
        module_code: None,
        module_test: Some((GUEST_KILLS, "criu_killed_in_the_middle_of_amd_dumps")),
    },
    Behaviour {
        what: "PROCESS_INFO evicts the queues and reports the device, BO (doorbell and MMIO \
               pages included) and object counts, the private data size and the pid",
        sim_test: (
            CRIU_OPS,
            "process_info_evicts_the_queues_and_reports_the_counts",
        ),
        module_code: Some((CRIU_C, "criu_process_info")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "CHECKPOINT needs evicted queues and exactly the sizes PROCESS_INFO reported",
        sim_test: (
            CRIU_OPS,
            "checkpoint_needs_evicted_queues_and_exactly_the_reported_sizes",
        ),
        module_code: Some((CRIU_C, "criu_checkpoint")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "CHECKPOINT installs a dma-buf of each VRAM/GTT BO in the caller",
        sim_test: (
            CRIU_OPS,
            "checkpoint_exports_a_dmabuf_of_each_bo_with_contents_into_the_caller",
        ),
        module_code: Some((CRIU_C, "export_into_caller")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "a failed CHECKPOINT or RESTORE closes the dma-bufs it installed",
        sim_test: (
            CRIU_OPS,
            "a_failed_checkpoint_closes_the_dmabufs_it_installed",
        ),
        module_code: Some((CRIU_C, "close_installed")),
        module_test: None,
    },
    Behaviour {
        what: "UNPAUSE undoes one eviction, EINVAL when nothing is evicted",
        sim_test: (CRIU_OPS, "unpause_undoes_one_eviction_and_needs_one"),
        module_code: Some((CRIU_C, "KFD_CRIU_OP_UNPAUSE")),
        module_test: Some((GUEST_KILLS, "criu_killed_in_the_middle_of_amd_dumps")),
    },
    Behaviour {
        what: "RESTORE runs in the restored task, on a KFD process with no BOs yet",
        sim_test: (
            CRIU_OPS,
            "restore_needs_a_fresh_kfd_process_of_the_calling_task",
        ),
        module_code: Some((CRIU_C, "criu_restore")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "RESTORE needs an unbound render file of each GPU and binds it",
        sim_test: (
            CRIU_OPS,
            "restore_needs_an_unbound_render_file_of_each_gpu_and_binds_it",
        ),
        module_code: Some((CRIU_C, "standin_render_file")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "RESTORE reads the private data it is given, exactly",
        sim_test: (CRIU_OPS, "restore_consumes_the_private_data_exactly"),
        module_code: Some((CRIU_C, "r.pos != r.len")),
        module_test: None,
    },
    Behaviour {
        what: "RESTORE makes the BOs at their addresses with new mmap offsets and dma-bufs; \
               doorbell and MMIO offsets carry the gpu id of the GPU restored onto",
        sim_test: (
            CRIU_OPS,
            "restore_recreates_the_bos_with_new_offsets_and_device_pages_of_the_new_gpus",
        ),
        module_code: Some((KFD_C, "STANDIN_MMAP_GPU_ID(d->gpu->gpu_id)")),
        module_test: Some((GUEST_CHECKS, "check_restored")),
    },
    Behaviour {
        what: "RESTORE leaves the queues evicted; RESUME finds the process by pid (ESRCH) \
               and starts them",
        sim_test: (
            CRIU_OPS,
            "resume_finds_the_process_by_pid_and_starts_its_queues",
        ),
        module_code: Some((CRIU_C, "criu_resume")),
        module_test: Some((GUEST_CHECKS, "check_restored")),
    },
    Behaviour {
        what: "a process exports a BO as a dma-buf of its own (EXPORT_DMABUF), which follows \
               the BO across processes",
        sim_test: (
            AMDGPU_E2E,
            "dma_buf_fds_follow_their_bos_within_and_across_processes",
        ),
        module_code: Some((KFD_C, "export_dmabuf")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "SDMA COPY_LINEAR with the family's count encoding copies exact ranges",
        sim_test: (SDMA, "lanes_copy_exact_ranges_both_ways_on_every_family"),
        module_code: Some((RENDER_C, "run_ib")),
        module_test: Some((GUEST, "stand_in_kfd_module_under_real_criu")),
    },
    Behaviour {
        what: "an SDMA address outside the job's mappings is a page fault: the packet \
               undone, the job complete, the fault reported by GPUVM_FAULT",
        sim_test: (
            SDMA,
            "a_count_off_by_one_is_a_page_fault_the_engine_reports",
        ),
        module_code: Some((RENDER_C, "AMDGPU_INFO_GPUVM_FAULT")),
        module_test: None,
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The text of a file a row names.
    fn source(path: &str) -> &'static str {
        match path {
            CRIU_OPS => include_str!("../tests/criu_ops.rs"),
            SDMA => include_str!("../tests/sdma.rs"),
            AMDGPU_E2E => include_str!("../../tests/amdgpu_e2e.rs"),
            CRIU_C => include_str!("../../tests/kfd_module/criu.c"),
            KFD_C => include_str!("../../tests/kfd_module/kfd.c"),
            RENDER_C => include_str!("../../tests/kfd_module/render.c"),
            GUEST => include_str!("../../tests/kfd_module.rs"),
            GUEST_CHECKS => include_str!("../../tests/kfd_module_support/mod.rs"),
            GUEST_KILLS => include_str!("../../tests/kfd_module_support/kills.rs"),
            _ => panic!("{path}: not a file this test reads"),
        }
    }

    fn has_fn(path: &str, name: &str) -> bool {
        !name.is_empty() && source(path).contains(&format!("fn {name}("))
    }

    #[test]
    fn every_behaviour_has_its_simulator_test() {
        for b in BEHAVIOURS {
            let (file, name) = b.sim_test;
            assert!(has_fn(file, name), "{}: no test {name} in {file}", b.what);
            let at = source(file).find(&format!("fn {name}(")).unwrap();
            assert!(
                source(file)[..at].trim_end().ends_with("#[test]"),
                "{}: {name} in {file} is not a test",
                b.what
            );
        }
    }

    #[test]
    fn every_behaviour_names_the_module_code_and_guest_test_that_exist() {
        for b in BEHAVIOURS {
            if let Some((file, symbol)) = b.module_code {
                assert!(
                    !symbol.is_empty() && source(file).contains(symbol),
                    "{}: no {symbol} in {file}",
                    b.what
                );
            }
            if let Some((file, name)) = b.module_test {
                assert!(has_fn(file, name), "{}: no fn {name} in {file}", b.what);
            }
        }
    }

    #[test]
    fn every_criu_operation_test_of_the_simulator_has_its_row() {
        let text = source(CRIU_OPS);
        for test in text.split("#[test]\nfn ").skip(1) {
            let name = test.split('(').next().unwrap();
            assert!(
                BEHAVIOURS.iter().any(|b| b.sim_test == (CRIU_OPS, name)),
                "{name} of {CRIU_OPS} checks no behaviour of the list"
            );
        }
    }
}
