//! The emulated CRIU hosts of `host_harness.rs`: the CRIU release families as the plugin ABI
//! sees them, building `criu_host.c` (and the other host programs) for each, and running them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criu_gpu_core::GpuPlugin;
use criu_gpu_test_support::{REPO, build_dir, cc, plugin_path};
use criu_plugin::{HookId, Plugin};

pub(crate) const PKG_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `-ENOTSUP`: "not mine, ask the next plugin".
pub(crate) const NOT_MINE: i32 = -95;
/// What a descriptor must say (`CRIU_PLUGIN_VERSION`).
pub(crate) const DESC_VERSION: &str = "0x200";
/// The version CRIU frees on unload (`CRIU_PLUGIN_VERSION_OLD`).
pub(crate) const DESC_VERSION_OLD: &str = "0x100";
/// A hung plugin must fail the test, not hang it.
pub(crate) const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// Hook slots the plugin registers (`GpuPlugin::HOOKS`), in slot order.
pub(crate) fn registered_slots() -> Vec<u32> {
    let mut slots: Vec<u32> = <GpuPlugin as Plugin>::HOOKS
        .iter()
        .map(|h| h.index() as u32)
        .collect();
    slots.sort_unstable();
    slots
}

/// CRIU's legacy hook names a family's binary holds, in slot order: those of its first
/// `hooks` slots, except `DUMP_FINISH`'s, which no CRIU has.
pub(crate) fn legacy_names(fam: &Family) -> Vec<&'static str> {
    HookId::ALL
        .iter()
        .filter(|h| fam.knows(h.index() as u32) && **h != HookId::DumpFinish)
        .map(|h| h.legacy_symbol())
        .collect()
}

/// CRIU symbols the plugin may use; none of them may be a link-time dependency.
pub(crate) const CRIU_SYMBOLS: &[&str] = &[
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
pub(crate) struct Family {
    pub(crate) release: &'static str,
    /// `CR_PLUGIN_HOOK__MAX`.
    pub(crate) hooks: u32,
    /// `RESTORE_EXT_FILE(int id, bool *retry_needed)`.
    pub(crate) retry: bool,
    /// Exports `dont_use_freeze_cgroup` (4.0 only).
    pub(crate) v40_freeze: bool,
    /// Exports `set_compel_interrupt_only_mode` and the inventory plugin list (4.1+).
    pub(crate) v41_api: bool,
    /// Exports `criu_plugin_get_options` (4.3+).
    pub(crate) options: bool,
    /// The `HostVersion` the plugin should log.
    pub(crate) detected: &'static str,
}

pub(crate) const fn family(
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

pub(crate) const V3_16: Family = family("3.16", 7, false, false, false, "CRIU before 3.17");
pub(crate) const V3_17: Family = family("3.17", 10, false, false, false, "CRIU 3.17-3.19");
pub(crate) const V3_18: Family = family("3.18", 10, false, false, false, "CRIU 3.17-3.19");
pub(crate) const V3_19: Family = family("3.19", 10, false, false, false, "CRIU 3.17-3.19");
pub(crate) const V4_0: Family = family("4.0", 12, false, true, false, "CRIU 4.0-4.1");
pub(crate) const V4_1: Family = family("4.1", 12, false, false, true, "CRIU 4.0-4.1");
pub(crate) const V4_2: Family = family("4.2", 13, false, false, true, "CRIU 4.2");
pub(crate) const DEV: Family = family("criu-dev", 15, true, false, true, "criu-dev");
pub(crate) const V4_3: Family = family("4.3", 17, true, false, true, "CRIU 4.3");

pub(crate) const FAMILIES: &[Family] = &[V3_16, V3_17, V3_18, V3_19, V4_0, V4_1, V4_2, DEV, V4_3];
pub(crate) const INVENTORY_FAMILIES: &[Family] = &[V4_1, V4_2, DEV, V4_3];

impl Family {
    pub(crate) fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHOST_HOOKS={}", self.hooks),
            format!("-DHOST_RETRY={}", u8::from(self.retry)),
            format!("-DHOST_V40_FREEZE={}", u8::from(self.v40_freeze)),
            format!("-DHOST_V41_API={}", u8::from(self.v41_api)),
            format!("-DHOST_OPTIONS={}", u8::from(self.options)),
        ]
    }

    /// Families with the same ABI share one build (3.17, 3.18 and 3.19).
    pub(crate) fn binary_name(&self) -> String {
        format!(
            "criu_host_h{}_r{}_f{}_i{}_o{}",
            self.hooks,
            u8::from(self.retry),
            u8::from(self.v40_freeze),
            u8::from(self.v41_api),
            u8::from(self.options)
        )
    }

    pub(crate) fn knows(&self, slot: u32) -> bool {
        slot < self.hooks
    }
}

// ---- locating and building --------------------------------------------------------------

pub(crate) fn tool_works(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub(crate) fn have_cc() -> bool {
    static CC: OnceLock<bool> = OnceLock::new();
    let ok = *CC.get_or_init(|| tool_works("cc"));
    if !ok {
        eprintln!("SKIPPED: no working `cc` on PATH, the emulated CRIU hosts cannot be built");
    }
    ok
}

/// This process's scratch directory (also the image directory and cwd of the hosts).
pub(crate) fn work_dir() -> &'static Path {
    build_dir()
}

/// Compiles `source` (under tests/host) into the scratch directory once per process.
pub(crate) fn build(name: &str, source: &str, extra: &[String]) -> PathBuf {
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

pub(crate) fn host_binary(fam: &Family) -> PathBuf {
    host_binary_linked(fam, "", &[])
}

/// A host built with extra link flags; `tag` names the variant.
pub(crate) fn host_binary_linked(fam: &Family, tag: &str, link: &[&str]) -> PathBuf {
    let mut flags = fam.defines();
    flags.push("-rdynamic".into());
    flags.extend(link.iter().map(|f| f.to_string()));
    build(
        &format!("{}{tag}", fam.binary_name()),
        "criu_host.c",
        &flags,
    )
}

pub(crate) fn plain_binary() -> PathBuf {
    build("plain_dlopen", "plain_dlopen.c", &[])
}

pub(crate) fn fake_plugin(version: u32, max_hooks: u32) -> PathBuf {
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
pub(crate) struct Run {
    pub(crate) what: String,
    pub(crate) status: i32,
    pub(crate) report: Vec<String>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
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
pub(crate) struct RunOpts<'a> {
    pub(crate) loglevel: Option<u32>,
    pub(crate) inventory: Option<&'a str>,
    /// `--plugin-option` values (4.3 hosts).
    pub(crate) plugin_options: Vec<&'a str>,
    pub(crate) env: Vec<(&'a str, String)>,
    /// Start the program through this dynamic loader (`ld.so PROGRAM ...`).
    pub(crate) loader: Option<PathBuf>,
}

pub(crate) fn unique(stem: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    work_dir().join(format!("{stem}-{}", N.fetch_add(1, Ordering::Relaxed)))
}

/// Runs `program args` with a clean environment (no `CRIU_GPU_*` overrides from the caller, a
/// settings file that does not exist), stdout and stderr captured, under a time limit.
pub(crate) fn execute(what: String, program: &Path, args: &[String], opts: &RunOpts<'_>) -> Run {
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

pub(crate) fn run_host(fam: &Family, stages: &str, opts: &RunOpts<'_>) -> Run {
    run_host_with(fam, &plugin_path(), stages, opts)
}

pub(crate) fn run_host_with(fam: &Family, plugin: &Path, stages: &str, opts: &RunOpts<'_>) -> Run {
    run_binary(fam, &host_binary(fam), plugin, stages, opts)
}

pub(crate) fn run_binary(
    fam: &Family,
    binary: &Path,
    plugin: &Path,
    stages: &str,
    opts: &RunOpts<'_>,
) -> Run {
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
