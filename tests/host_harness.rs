//! The built plugin, loaded exactly as CRIU loads it, by every CRIU release family.
//!
//! `tests/host/criu_host.c` plays CRIU: it is compiled here once per family with the hook count,
//! the `RESTORE_EXT_FILE` arity, the exported CRIU symbols and the legacy hook-name strings of
//! that family, linked with `-rdynamic` as `criu` is. It `dlopen`s the cdylib with `RTLD_LAZY`,
//! verifies the descriptor as `verify_plugin` does, calls `init`, the hooks of the stage (for a
//! process that is not a GPU process) and `exit`, unloads it, and writes everything, including
//! each `print_on_level` call, to a report file this test reads (`host/report.rs`).
//! `plain_dlopen.c` is a program that is not CRIU; `fake_plugin.c` is a stand-in plugin proving
//! that the emulated host refuses what CRIU refuses.
//!
//! The plugin is the release cdylib the package ships, which must be newer than the tree's
//! sources (see [`plugin_path`]; `cargo build --release -p criu-gpu-plugin --lib`). Without a C
//! compiler (`cc`) the tests say so and pass; without binutils the export test does.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criu_gpu_core::GpuPlugin;
use criu_gpu_test_support::{REPO, build_dir, cc, plugin_path};
use criu_plugin::{HookId, Plugin};

#[path = "host/report.rs"]
mod report;

use report::*;

const PKG_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `-ENOTSUP`: "not mine, ask the next plugin".
const NOT_MINE: i32 = -95;
/// What a descriptor must say (`CRIU_PLUGIN_VERSION`).
const DESC_VERSION: &str = "0x200";
/// The version CRIU frees on unload (`CRIU_PLUGIN_VERSION_OLD`).
const DESC_VERSION_OLD: &str = "0x100";
/// A hung plugin must fail the test, not hang it.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// Hook slots the plugin registers (`GpuPlugin::HOOKS`), in slot order.
fn registered_slots() -> Vec<u32> {
    let mut slots: Vec<u32> = <GpuPlugin as Plugin>::HOOKS
        .iter()
        .map(|h| h.index() as u32)
        .collect();
    slots.sort_unstable();
    slots
}

/// CRIU's legacy hook names a family's binary holds, in slot order: those of its first
/// `hooks` slots, except `DUMP_FINISH`'s, which no CRIU has.
fn legacy_names(fam: &Family) -> Vec<&'static str> {
    HookId::ALL
        .iter()
        .filter(|h| fam.knows(h.index() as u32) && **h != HookId::DumpFinish)
        .map(|h| h.legacy_symbol())
        .collect()
}

/// CRIU symbols the plugin may use; none of them may be a link-time dependency.
const CRIU_SYMBOLS: &[&str] = &[
    "print_on_level",
    "log_get_loglevel",
    "criu_get_image_dir",
    "alarm_timeouted",
    "opts",
    "dont_use_freeze_cgroup",
    "set_compel_interrupt_only_mode",
    "add_inventory_plugin",
    "check_and_remove_inventory_plugin",
    "criu_plugin_get_options",
];

/// One CRIU release as the plugin ABI sees it.
#[derive(Clone, Copy, Debug)]
struct Family {
    release: &'static str,
    /// `CR_PLUGIN_HOOK__MAX`.
    hooks: u32,
    /// `RESTORE_EXT_FILE(int id, bool *retry_needed)`.
    retry: bool,
    /// Exports `dont_use_freeze_cgroup` (4.0 only).
    v40_freeze: bool,
    /// Exports `set_compel_interrupt_only_mode` and the inventory plugin list (4.1+).
    v41_api: bool,
    /// Exports `criu_plugin_get_options` (4.3+).
    options: bool,
    /// The `HostVersion` the plugin should log.
    detected: &'static str,
}

const fn family(
    release: &'static str,
    hooks: u32,
    retry: bool,
    v40_freeze: bool,
    v41_api: bool,
    detected: &'static str,
) -> Family {
    Family {
        release,
        hooks,
        retry,
        v40_freeze,
        v41_api,
        options: hooks >= 17,
        detected,
    }
}

const V3_16: Family = family("3.16", 7, false, false, false, "CRIU before 3.17");
const V3_17: Family = family("3.17", 10, false, false, false, "CRIU 3.17-3.19");
const V3_18: Family = family("3.18", 10, false, false, false, "CRIU 3.17-3.19");
const V3_19: Family = family("3.19", 10, false, false, false, "CRIU 3.17-3.19");
const V4_0: Family = family("4.0", 12, false, true, false, "CRIU 4.0-4.1");
const V4_1: Family = family("4.1", 12, false, false, true, "CRIU 4.0-4.1");
const V4_2: Family = family("4.2", 13, false, false, true, "CRIU 4.2");
const DEV: Family = family("criu-dev", 15, true, false, true, "criu-dev");
const V4_3: Family = family("4.3", 17, true, false, true, "CRIU 4.3");

const FAMILIES: &[Family] = &[V3_16, V3_17, V3_18, V3_19, V4_0, V4_1, V4_2, DEV, V4_3];
const INVENTORY_FAMILIES: &[Family] = &[V4_1, V4_2, DEV, V4_3];

impl Family {
    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHOST_HOOKS={}", self.hooks),
            format!("-DHOST_RETRY={}", u8::from(self.retry)),
            format!("-DHOST_V40_FREEZE={}", u8::from(self.v40_freeze)),
            format!("-DHOST_V41_API={}", u8::from(self.v41_api)),
            format!("-DHOST_OPTIONS={}", u8::from(self.options)),
        ]
    }

    /// Families with the same ABI share one build (3.17, 3.18 and 3.19).
    fn binary_name(&self) -> String {
        format!(
            "criu_host_h{}_r{}_f{}_i{}_o{}",
            self.hooks,
            u8::from(self.retry),
            u8::from(self.v40_freeze),
            u8::from(self.v41_api),
            u8::from(self.options)
        )
    }

    fn knows(&self, slot: u32) -> bool {
        slot < self.hooks
    }
}

// ---- locating and building --------------------------------------------------------------

fn tool_works(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn have_cc() -> bool {
    static CC: OnceLock<bool> = OnceLock::new();
    let ok = *CC.get_or_init(|| tool_works("cc"));
    if !ok {
        eprintln!("SKIPPED: no working `cc` on PATH, the emulated CRIU hosts cannot be built");
    }
    ok
}

/// This process's scratch directory (also the image directory and cwd of the hosts).
fn work_dir() -> &'static Path {
    build_dir()
}

/// Compiles `source` (under tests/host) into the scratch directory once per process.
fn build(name: &str, source: &str, extra: &[String]) -> PathBuf {
    let src = Path::new(REPO).join("tests/host").join(source);
    let include = Path::new(REPO).join("include");
    let mut args: Vec<String> = ["-std=gnu11", "-g", "-Wextra", "-I"]
        .map(String::from)
        .to_vec();
    args.push(include.display().to_string());
    args.extend_from_slice(extra);
    args.push(src.display().to_string());
    args.push("-ldl".into());
    cc(name, &args)
}

fn host_binary(fam: &Family) -> PathBuf {
    host_binary_linked(fam, "", &[])
}

/// A host built with extra link flags; `tag` names the variant.
fn host_binary_linked(fam: &Family, tag: &str, link: &[&str]) -> PathBuf {
    let mut flags = fam.defines();
    flags.push("-rdynamic".into());
    flags.extend(link.iter().map(|f| f.to_string()));
    build(
        &format!("{}{tag}", fam.binary_name()),
        "criu_host.c",
        &flags,
    )
}

fn plain_binary() -> PathBuf {
    build("plain_dlopen", "plain_dlopen.c", &[])
}

fn fake_plugin(version: u32, max_hooks: u32) -> PathBuf {
    build(
        &format!("fake_plugin_v{version:x}_h{max_hooks}.so"),
        "fake_plugin.c",
        &[
            "-shared".into(),
            "-fPIC".into(),
            format!("-DFAKE_VERSION={version:#x}"),
            format!("-DFAKE_MAX_HOOKS={max_hooks}"),
        ],
    )
}

// ---- running ------------------------------------------------------------------------------

/// One run of a host program.
struct Run {
    what: String,
    status: i32,
    report: Vec<String>,
    stdout: String,
    stderr: String,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{} (exit status {})", self.what, self.status)?;
        for l in self.report.iter().filter(|l| !l.starts_with("legacy ")) {
            writeln!(f, "  | {l}")?;
        }
        writeln!(f, "  stdout: {:?}", self.stdout)?;
        write!(f, "  stderr: {:?}", self.stderr)
    }
}

#[derive(Default)]
struct RunOpts<'a> {
    loglevel: Option<u32>,
    inventory: Option<&'a str>,
    /// `--plugin-option` values (4.3 hosts).
    plugin_options: Vec<&'a str>,
    env: Vec<(&'a str, String)>,
    /// Start the program through this dynamic loader (`ld.so PROGRAM ...`).
    loader: Option<PathBuf>,
}

fn unique(stem: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    work_dir().join(format!("{stem}-{}", N.fetch_add(1, Ordering::Relaxed)))
}

/// Runs `program args` with a clean environment (no `CRIU_GPU_*` overrides from the caller, a
/// settings file that does not exist), stdout and stderr captured, under a time limit.
fn execute(what: String, program: &Path, args: &[String], opts: &RunOpts<'_>) -> Run {
    let report = unique("report");
    let stdout_path = unique("stdout");
    let stderr_path = unique("stderr");
    let mut cmd = match &opts.loader {
        Some(ld) => {
            let mut c = Command::new(ld);
            c.arg(program);
            c
        }
        None => Command::new(program),
    };
    cmd.current_dir(work_dir())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env(
            "CRIU_GPU_PLUGIN_CONFIG",
            work_dir().join("no-such-gpu-plugin.conf"),
        )
        .env("HOST_LOGLEVEL", opts.loglevel.unwrap_or(4).to_string())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).expect("stdout file"))
        .stderr(std::fs::File::create(&stderr_path).expect("stderr file"));
    if let Some(p) = std::env::var_os("LD_LIBRARY_PATH") {
        cmd.env("LD_LIBRARY_PATH", p);
    }
    for (k, v) in &opts.env {
        cmd.env(k, v);
    }
    let is_host = program
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("criu_host"));
    if is_host {
        cmd.arg("--out").arg(&report);
        if let Some(inv) = opts.inventory {
            cmd.args(["--inventory", inv]);
        }
        for o in &opts.plugin_options {
            cmd.args(["--plugin-option", o]);
        }
    }
    cmd.args(args);
    let mut child = cmd.spawn().expect("start host program");
    let deadline = Instant::now() + RUN_TIMEOUT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait host program") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {RUN_TIMEOUT:?}; the plugin hangs");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let read = |p: &Path| {
        let s = std::fs::read_to_string(p).unwrap_or_default();
        let _ = std::fs::remove_file(p);
        s
    };
    let report_text = read(&report);
    Run {
        status: status.code().unwrap_or_else(|| {
            use std::os::unix::process::ExitStatusExt;
            128 + status.signal().unwrap_or(0)
        }),
        report: report_text.lines().map(str::to_string).collect(),
        stdout: read(&stdout_path),
        stderr: read(&stderr_path),
        what,
    }
}

fn run_host(fam: &Family, stages: &str, opts: &RunOpts<'_>) -> Run {
    run_host_with(fam, &plugin_path(), stages, opts)
}

fn run_host_with(fam: &Family, plugin: &Path, stages: &str, opts: &RunOpts<'_>) -> Run {
    run_binary(fam, &host_binary(fam), plugin, stages, opts)
}

fn run_binary(fam: &Family, binary: &Path, plugin: &Path, stages: &str, opts: &RunOpts<'_>) -> Run {
    let what = format!(
        "CRIU {} host {}, stages {stages}, loglevel {}, inventory {:?}, loader {:?}",
        fam.release,
        binary.display(),
        opts.loglevel.unwrap_or(4),
        opts.inventory,
        opts.loader,
    );
    execute(
        what,
        binary,
        &[plugin.display().to_string(), stages.to_string()],
        opts,
    )
}

// ---- the tests ------------------------------------------------------------------------------

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
