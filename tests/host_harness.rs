//! The built plugin, loaded exactly as CRIU loads it, by every CRIU release family.
//!
//! `tests/host/criu_host.c` plays CRIU: it is compiled here once per family with the hook count,
//! the `RESTORE_EXT_FILE` arity, the exported CRIU symbols and the legacy hook-name strings of
//! that family, linked with `-rdynamic` as `criu` is. It `dlopen`s the cdylib with `RTLD_LAZY`,
//! verifies the descriptor as `verify_plugin` does, calls `init`, the hooks of the stage (for a
//! process that is not a GPU process) and `exit`, unloads it, and writes everything, including
//! each `print_on_level` call, to a report file this test reads (`host/report.rs`). The families
//! and the building and running of the hosts are in `host/hosts.rs`.
//! `plain_dlopen.c` is a program that is not CRIU; `fake_plugin.c` is a stand-in plugin proving
//! that the emulated host refuses what CRIU refuses.
//!
//! The plugin is the release cdylib the package ships, which must be newer than the tree's
//! sources (see [`plugin_path`]; `cargo build --release -p criu-gpu-plugin --lib`). Without a C
//! compiler (`cc`) the tests say so and pass; without binutils the export test does.

use std::path::{Path, PathBuf};
use std::process::Command;

use criu_gpu_test_support::plugin_path;
use criu_plugin::HookId;

#[path = "host/hosts.rs"]
mod hosts;
#[path = "host/report.rs"]
mod report;

use hosts::*;
use report::*;

#[test]
fn every_family_loads_the_plugin_and_every_hook_says_not_mine() {
    if !have_cc() {
        return;
    }
    for fam in FAMILIES {
        for stage in ["dump", "pre-dump", "restore"] {
            let run = run_host(fam, stage, &RunOpts::default());
            check_clean_run(fam, 4, stage, &run);
        }
    }
}

/// `criu swrk` serves several requests in one process: the plugin is loaded, used and unloaded
/// again each time, and must start from a clean state every time.
/// CRIU 4.3 hands every plugin every `--plugin-option`: ours are read (and win over the
/// environment), the C cuda plugin's are understood, other plugins' are skipped, a misspelt
/// one of ours is warned about, and a bad value a run does not need fails nothing.
#[test]
fn plugin_options_of_a_4_3_host_are_read_and_named_in_the_log() {
    if !have_cc() {
        return;
    }
    let opts = RunOpts {
        plugin_options: vec![
            "gpu_plugin.cuda.lock-timeout-ms=5000",
            "cuda_plugin.device-map=GPU-aaaaaaaa-0000-0000-0000-000000000000=GPU-bbbbbbbb-0000-0000-0000-000000000000",
            "cuda_plugin.backend=driver-api",
            "amdgpu_plugin.some-option=1",
            "gpu_plugin.cuda.parallell=no",
            "gpu_plugin.amdgpu.copy-threads=many",
        ],
        env: vec![("CRIU_GPU_CUDA_LOCK_TIMEOUT_MS", "7000".to_string())],
        ..Default::default()
    };
    for stage in ["dump", "restore"] {
        let run = run_host(&V4_3, stage, &opts);
        // Not a clean run by `check_clean_run`'s measure: it has a warning.
        check_host_run(&V4_3, &run);
        assert_eq!(run.status, 0, "{run:?}");
        assert!(run.has("result ok"), "{run:?}");
        assert!(run.has("host criu_plugin_get_options argc=7"), "{run:?}");
        let cycles = run.cycles();
        let logs = cycles[0].logs();
        let line = |level: u32, part: &str| {
            logs.iter()
                .find(|(_, l, t)| *l == level && t.contains(part))
                .map(|(_, _, t)| *t)
                .unwrap_or_else(|| panic!("no level-{level} line with `{part}`: {run:?}"))
        };
        assert!(!logs.iter().any(|(_, l, _)| *l == 1), "no errors: {run:?}");
        let inforce = line(3, "gpu_plugin: settings in force: ");
        for part in [
            "cuda.lock-timeout-ms=5000 (plugin option gpu_plugin.cuda.lock-timeout-ms)",
            "cuda.device-map=GPU-aaaaaaaa-0000-0000-0000-000000000000=GPU-bbbbbbbb-0000-0000-0000-000000000000 (plugin option cuda_plugin.device-map)",
            "cuda.backend=driver-api (plugin option cuda_plugin.backend)",
        ] {
            assert!(inforce.contains(part), "`{part}` in `{inforce}`");
        }
        assert!(!inforce.contains("amdgpu_plugin"), "{inforce}");
        line(
            2,
            "gpu_plugin: settings: unknown plugin option gpu_plugin.cuda.parallell, ignored",
        );
    }
    // Hosts before 4.3 have no options: nothing is asked for.
    let run = run_host(&V4_2, "dump", &RunOpts::default());
    assert!(
        !run.report
            .iter()
            .any(|l| l.contains("criu_plugin_get_options"))
    );
}

#[test]
fn swrk_loads_the_plugin_again_and_again() {
    if !have_cc() {
        return;
    }
    let stages = "dump,restore,pre-dump,dump,restore,restore";
    for fam in FAMILIES {
        let run = run_host(fam, stages, &RunOpts::default());
        check_clean_run(fam, 4, stages, &run);
        assert_eq!(
            run.report
                .iter()
                .filter(|l| l.starts_with("unloaded "))
                .count(),
            6,
            "{run:?}"
        );
    }
}

#[test]
fn log_lines_follow_the_host_level() {
    if !have_cc() {
        return;
    }
    for fam in [V3_17, V4_1, DEV] {
        for loglevel in 0..=4 {
            let opts = RunOpts {
                loglevel: Some(loglevel),
                ..Default::default()
            };
            let run = run_host(&fam, "dump,restore", &opts);
            check_clean_run(&fam, loglevel, "dump,restore", &run);
            if loglevel < 3 {
                // Default CRIU verbosity (2): a clean run adds nothing to CRIU's log.
                assert!(!run.report.iter().any(|l| l.starts_with("LOG")), "{run:?}");
            }
        }
    }
}

/// The plugin recognises its host from the host's memory, not from how `criu` was linked or
/// started: position dependent, without a separate code segment (older linkers put read-only
/// data into the executable segment), stripped, or run through the dynamic loader explicitly.
#[test]
fn detection_does_not_depend_on_how_criu_was_linked_or_started() {
    if !have_cc() {
        return;
    }
    let variants: [(&str, &[&str]); 3] = [
        ("_nopie", &["-no-pie"]),
        ("_noseparate", &["-Wl,-z,noseparate-code"]),
        ("_stripped", &["-s"]),
    ];
    let stages = "dump,restore";
    for fam in [V3_16, V3_17, V4_0, V4_2, DEV] {
        for (tag, link) in variants {
            let bin = host_binary_linked(&fam, tag, link);
            let run = run_binary(&fam, &bin, &plugin_path(), stages, &RunOpts::default());
            check_clean_run(&fam, 4, stages, &run);
        }
        let bin = host_binary(&fam);
        let Some(loader) = elf_interpreter(&bin) else {
            panic!("{} has no PT_INTERP", bin.display());
        };
        let opts = RunOpts {
            loader: Some(loader),
            ..Default::default()
        };
        let run = run_binary(&fam, &bin, &plugin_path(), stages, &opts);
        check_clean_run(&fam, 4, stages, &run);
    }
}

/// The image names a plugin that is not ours: we must not claim it, and CRIU reports it.
#[test]
fn an_image_needing_another_plugin_is_left_to_criu() {
    if !have_cc() {
        return;
    }
    for fam in INVENTORY_FAMILIES {
        let opts = RunOpts {
            inventory: Some("some_other_plugin"),
            ..Default::default()
        };
        let run = run_host(fam, "restore", &opts);
        check_host_run(fam, &run);
        assert_eq!(run.status, 1, "{run:?}");
        assert!(
            run.has("Missing required plugin: some_other_plugin"),
            "{run:?}"
        );
        assert!(run.has("init rc=0"), "{run:?}");
        assert!(run.has("exit stage=2 ret=-1"), "{run:?}");
        let cycles = run.cycles();
        let claims: Vec<&str> = cycles[0].starting("inventory-claim ").collect();
        assert!(!claims.is_empty(), "the plugin never looked: {run:?}");
        for c in claims {
            let probe = c
                .trim_start_matches('\u{1}')
                .starts_with("criu-plugin-crate list probe ");
            assert!(
                c.ends_with("-> false")
                    && (c.starts_with("cuda_plugin ") || c.starts_with("amdgpu_plugin ") || probe),
                "{c}: {run:?}"
            );
        }
        // The first error CRIU shows users must be CRIU's, not a side remark of ours.
        assert!(
            !cycles[0].logs().iter().any(|(_, lvl, _)| *lvl <= 1),
            "{run:?}"
        );
    }
}

/// Images from CRIU before 4.1 carry no list (every claim succeeds); images from 4.1+ of a
/// process without GPUs carry an empty one. Both restore.
#[test]
fn images_without_gpu_plugins_restore() {
    if !have_cc() {
        return;
    }
    for fam in INVENTORY_FAMILIES {
        let run = run_host(fam, "restore", &RunOpts::default());
        check_clean_run(fam, 4, "restore", &run);
        let claims: Vec<&str> = run.cycles()[0].starting("inventory-claim ").collect();
        assert!(
            claims.iter().all(|c| c.ends_with("-> true (no list)")),
            "{run:?}"
        );

        let empty = RunOpts {
            inventory: Some(""),
            ..Default::default()
        };
        let run = run_host(fam, "restore", &empty);
        check_clean_run(fam, 4, "restore", &run);
        let claims: Vec<&str> = run.cycles()[0].starting("inventory-claim ").collect();
        assert!(claims.iter().all(|c| c.ends_with("-> false")), "{run:?}");
    }
}

/// An image that needs CUDA, restored where no NVIDIA driver is loaded, must fail at `init`
/// with an error that says so: that first error is what runc and Podman show the user.
/// Claiming the inventory entry and sitting out would let CRIU go on and fail later with an
/// unrelated message (or restore a process whose GPU state is gone).
// The CUDA backend (src/cuda/) is still a placeholder whose `init` answers Ok(false), so the
// plugin claims `cuda_plugin` and restores silently; it is being written in parallel. Note that
// `images_without_gpu_plugins_restore` must keep passing alongside: an image without a plugin
// list (before 4.1) must still restore here, so the backend has to tell "listed" from "no list".
#[test]
fn a_cuda_image_without_an_nvidia_driver_fails_init_clearly() {
    if !have_cc() {
        return;
    }
    let no_driver = work_dir().join("no-nvidia-driver-here");
    for fam in INVENTORY_FAMILIES {
        let opts = RunOpts {
            inventory: Some("cuda_plugin"),
            // The documented setting for the driver's /proc directory, pointed at nothing,
            // so the test means the same on machines that have an NVIDIA GPU.
            env: vec![("CRIU_GPU_CUDA_NVIDIA_PROC", no_driver.display().to_string())],
            ..Default::default()
        };
        let run = run_host(fam, "restore", &opts);
        check_host_run(fam, &run);
        assert_eq!(run.status, 1, "{run:?}");
        assert!(run.has("Failed in init(2)"), "{run:?}");
        // The reason on stderr too (a pipe here), where a runtime's container log or the
        // user's terminal shows it.
        assert!(
            run.stderr
                .starts_with("gpu_plugin: restore failed: the image needs cuda_plugin"),
            "{run:?}"
        );
        assert!(
            !run.report.iter().any(|l| l.starts_with("exit ")),
            "CRIU never calls exit after a failed init: {run:?}"
        );
        let cycles = run.cycles();
        let logs = cycles[0].logs();
        let first_error = logs
            .iter()
            .find(|(_, lvl, _)| *lvl == 1)
            .unwrap_or_else(|| panic!("no ERROR line: {run:?}"));
        let text = first_error.2.to_ascii_lowercase();
        assert!(
            text.starts_with("error (") && text.contains("gpu_plugin:"),
            "CRIU's error format: {run:?}"
        );
        assert!(
            text.contains("cuda") && (text.contains("nvidia") || text.contains("driver")),
            "the error must say the image needs CUDA and no NVIDIA driver is present: {run:?}"
        );
    }
}

/// The emulated host refuses what CRIU refuses, so its acceptance of our plugin means
/// something: a version-0x100 descriptor (CRIU would free() it), a version above 0x200, and a
/// hook count above the host's.
#[test]
fn the_emulated_host_refuses_what_criu_refuses() {
    if !have_cc() {
        return;
    }
    let cases = [
        (0x100, 7, DEV, "result fail version 0x100"),
        (0x300, 7, DEV, "Corrupted plugin"),
        (0x200, 15, V4_2, "Corrupted plugin"),
        (0x200, 13, V4_0, "Corrupted plugin"),
        (0x200, 10, V3_16, "Corrupted plugin"),
    ];
    for (version, hooks, fam, why) in cases {
        let run = run_host_with(
            &fam,
            &fake_plugin(version, hooks),
            "dump",
            &RunOpts::default(),
        );
        assert_eq!(run.status, 1, "{run:?}");
        assert!(
            run.report.iter().any(|l| l.starts_with(why)),
            "expected `{why}`: {run:?}"
        );
        assert!(!run.has("init rc=0"), "{run:?}");
    }
    // The control: a fitting descriptor is accepted.
    let run = run_host_with(&V4_2, &fake_plugin(0x200, 13), "dump", &RunOpts::default());
    assert_eq!(run.status, 0, "{run:?}");
    assert!(run.has("result ok"), "{run:?}");
}

/// Each emulated host holds exactly its family's hook names and CRIU symbols, and the plain
/// program none of them: otherwise the other tests would prove nothing.
#[test]
fn the_emulated_hosts_are_what_they_claim() {
    if !have_cc() {
        return;
    }
    for fam in FAMILIES {
        let bin = std::fs::read(host_binary(fam)).expect("read host binary");
        for h in HookId::ALL {
            let name = h.legacy_symbol();
            assert_eq!(
                contains_cstr(&bin, name),
                fam.knows(h.index() as u32) && h != HookId::DumpFinish,
                "{name} in the {} host",
                fam.release
            );
        }
        if let Some(exported) = defined_dynamic_symbols(&host_binary(fam)) {
            let has = |s: &str| exported.iter().any(|e| e == s);
            for s in [
                "print_on_level",
                "log_get_loglevel",
                "criu_get_image_dir",
                "alarm_timeouted",
                "opts",
            ] {
                assert!(has(s), "{s} in the {} host", fam.release);
            }
            assert_eq!(has("dont_use_freeze_cgroup"), fam.v40_freeze, "{fam:?}");
            for s in [
                "set_compel_interrupt_only_mode",
                "add_inventory_plugin",
                "check_and_remove_inventory_plugin",
            ] {
                assert_eq!(has(s), fam.v41_api, "{s} in the {} host", fam.release);
            }
            assert_eq!(has("criu_plugin_get_options"), fam.options, "{fam:?}");
        }
    }
    let plain = std::fs::read(plain_binary()).expect("read plain binary");
    for h in HookId::ALL {
        let name = h.legacy_symbol();
        assert!(!contains_cstr(&plain, name), "{name} in the plain program");
    }
    if let Some(exported) = defined_dynamic_symbols(&plain_binary()) {
        for s in CRIU_SYMBOLS {
            assert!(!exported.iter().any(|e| e == s), "{s} in the plain program");
        }
    }
}

/// A program that is not CRIU (no exported CRIU symbols, no hook names, `RTLD_NOW`) can load
/// the plugin, call it and unload it: the plugin sees an unknown host and stays harmless.
#[test]
fn a_program_that_is_not_criu_can_load_it() {
    if !have_cc() {
        return;
    }
    let run = execute(
        "plain dlopen".into(),
        &plain_binary(),
        &[plugin_path().display().to_string()],
        &RunOpts::default(),
    );
    assert_eq!(run.status, 0, "{run:?}");
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(
        lines,
        [
            // A host that is not CRIU gets the descriptor as built: every slot this crate knows.
            &format!(
                "desc version={DESC_VERSION} max_hooks={}",
                criu_plugin::abi::HOOK_SLOTS
            ) as &str,
            "init rc=0",
            &format!("hook PAUSE_DEVICES rc={NOT_MINE}"),
            &format!("hook DUMP_EXT_FILE rc={NOT_MINE}"),
            "exit",
            "done",
        ],
        "{run:?}"
    );
    assert!(run.stderr.is_empty(), "{run:?}");
}

/// The cdylib exports `CR_PLUGIN_DESC` and nothing else (executable symbols would interpose
/// on same-named plugin symbols, and the reverse), links no CRIU symbol, and has a soname.
#[test]
fn the_cdylib_exports_only_the_descriptor_and_has_a_soname() {
    let so = plugin_path();
    if !tool_works("nm") || !tool_works("readelf") {
        eprintln!("SKIPPED: binutils (nm, readelf) missing");
        return;
    }
    let defined = defined_dynamic_symbols(&so).expect("nm -D --defined-only");
    assert_eq!(
        defined,
        ["CR_PLUGIN_DESC"],
        "exported symbols of {}",
        so.display()
    );

    let undefined = Command::new("nm")
        .args(["-D", "--undefined-only"])
        .arg(&so)
        .output()
        .expect("nm -D --undefined-only");
    let undefined = String::from_utf8_lossy(&undefined.stdout);
    for line in undefined.lines() {
        let sym = line.split_whitespace().last().unwrap_or("");
        let sym = sym.split('@').next().unwrap_or(sym);
        assert!(
            !CRIU_SYMBOLS.contains(&sym),
            "{sym} is linked, so the plugin would fail to load where CRIU lacks it"
        );
    }

    let dynamic = Command::new("readelf")
        .arg("-d")
        .arg(&so)
        .output()
        .expect("readelf -d");
    let dynamic = String::from_utf8_lossy(&dynamic.stdout);
    let soname = dynamic
        .lines()
        .find(|l| l.contains("(SONAME)"))
        .unwrap_or_else(|| panic!("no SONAME in {}:\n{dynamic}", so.display()));
    assert!(soname.contains("[libcriu_gpu_plugin.so]"), "{soname}");
}

// ---- helpers ------------------------------------------------------------------------------

/// Defined dynamic symbols of an ELF file, or None without `nm`.
fn defined_dynamic_symbols(path: &Path) -> Option<Vec<String>> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(path)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().last())
            .map(|s| s.split('@').next().unwrap_or(s).to_string())
            .collect(),
    )
}

/// The dynamic loader named in an ELF64 executable's `PT_INTERP` header.
fn elf_interpreter(path: &Path) -> Option<PathBuf> {
    let elf = std::fs::read(path).ok()?;
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    // ELF64, little endian: what every target this plugin supports uses.
    if elf.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        const PT_INTERP: u32 = 3;
        if u32_at(ph)? == PT_INTERP {
            let off = usize::try_from(u64_at(ph + 8)?).ok()?;
            let len = usize::try_from(u64_at(ph + 32)?).ok()?;
            let raw = elf.get(off..off + len)?;
            let name = raw.split(|b| *b == 0).next()?;
            return Some(PathBuf::from(String::from_utf8_lossy(name).into_owned()));
        }
    }
    None
}

/// Whether `hay` holds `name` as a whole NUL-terminated string (what the plugin looks for).
fn contains_cstr(hay: &[u8], name: &str) -> bool {
    let mut needle = name.as_bytes().to_vec();
    needle.push(0);
    hay.windows(needle.len()).enumerate().any(|(at, w)| {
        w == needle.as_slice()
            && (at == 0 || !(hay[at - 1].is_ascii_alphanumeric() || hay[at - 1] == b'_'))
    })
}
