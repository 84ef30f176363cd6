//! Reading the report `criu_host.c` writes: one cycle per load of the plugin, its hook calls and
//! its `print_on_level` lines; and the checks every clean run of `host_harness.rs` must pass.

use std::collections::BTreeSet;

use super::{
    DESC_VERSION, DESC_VERSION_OLD, Family, NOT_MINE, PKG_VERSION, Run, legacy_names,
    registered_slots,
};

// ---- reading a report ---------------------------------------------------------------------

/// The report lines of one load/init/hooks/exit/unload cycle.
pub(crate) struct Cycle<'a> {
    pub(crate) stage: &'a str,
    pub(crate) lines: &'a [String],
}

/// One hook call.
#[derive(Debug)]
pub(crate) struct HookCall<'a> {
    pub(crate) name: &'a str,
    pub(crate) rc: i32,
    pub(crate) detail: Vec<(&'a str, &'a str)>,
}

impl HookCall<'_> {
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.detail.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }
}

impl Run {
    pub(crate) fn cycles(&self) -> Vec<Cycle<'_>> {
        let starts: Vec<usize> = self
            .report
            .iter()
            .enumerate()
            .filter(|(_, l)| l.starts_with("load "))
            .map(|(i, _)| i)
            .collect();
        starts
            .iter()
            .enumerate()
            .map(|(n, &s)| {
                let end = starts.get(n + 1).copied().unwrap_or(self.report.len());
                let stage = self.report[s]
                    .split_once("stage=")
                    .map(|(_, st)| st)
                    .unwrap_or("");
                Cycle {
                    stage,
                    lines: &self.report[s + 1..end],
                }
            })
            .collect()
    }

    pub(crate) fn has(&self, line: &str) -> bool {
        self.report.iter().any(|l| l == line)
    }
}

impl<'a> Cycle<'a> {
    pub(crate) fn has(&self, line: &str) -> bool {
        self.lines.iter().any(|l| l == line)
    }

    pub(crate) fn starting(&self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.lines
            .iter()
            .filter_map(move |l| l.strip_prefix(prefix))
    }

    pub(crate) fn hooks(&self) -> Vec<HookCall<'a>> {
        self.starting("hook ")
            .filter_map(|rest| {
                let mut words = rest.split(' ');
                let name = words.next()?;
                let mut rc = None;
                let mut detail = Vec::new();
                for w in words {
                    match w.split_once('=') {
                        Some(("rc", v)) => rc = v.parse().ok(),
                        Some((k, v)) => detail.push((k, v)),
                        None => detail.push((w, "")),
                    }
                }
                Some(HookCall {
                    name,
                    rc: rc?,
                    detail,
                })
            })
            .collect()
    }

    /// Every `print_on_level` call: (kind, level, text); kind is `LOG`, `LOG-NO-NEWLINE`...
    pub(crate) fn logs(&self) -> Vec<(&'a str, u32, &'a str)> {
        self.lines
            .iter()
            .filter(|l| l.starts_with("LOG"))
            .filter_map(|l| {
                let (kind, rest) = l.split_once(' ')?;
                let (lvl, text) = rest.split_once(' ').unwrap_or((rest, ""));
                Some((kind, lvl.parse().ok()?, text))
            })
            .collect()
    }
}

pub(crate) fn stage_name(stage: &str) -> &'static str {
    match stage {
        "dump" => "Dump",
        "pre-dump" => "PreDump",
        "restore" => "Restore",
        other => panic!("unknown stage {other}"),
    }
}

pub(crate) fn stage_number(stage: &str) -> u32 {
    match stage {
        "dump" => 0,
        "pre-dump" => 1,
        "restore" => 2,
        other => panic!("unknown stage {other}"),
    }
}

/// The hooks CRIU of `fam` calls in `stage` (the plugin registers every one of them).
pub(crate) fn expected_hooks(fam: &Family, stage: &str) -> BTreeSet<&'static str> {
    let candidates: &[(u32, &str)] = match stage {
        "dump" => &[
            (10, "PAUSE_DEVICES"),
            (11, "CHECKPOINT_DEVICES"),
            (7, "HANDLE_DEVICE_VMA"),
            (2, "DUMP_EXT_FILE"),
            (14, "DUMP_DEVICES_LATE"),
            (16, "DUMP_FINISH"),
        ],
        // 4.0 checkpoints inside collect_pstree, which pre-dump runs too.
        "pre-dump" if fam.v40_freeze => &[
            (10, "PAUSE_DEVICES"),
            (11, "CHECKPOINT_DEVICES"),
            (7, "HANDLE_DEVICE_VMA"),
        ],
        "pre-dump" => &[(10, "PAUSE_DEVICES"), (7, "HANDLE_DEVICE_VMA")],
        "restore" => &[
            (13, "RESTORE_INIT"),
            (12, "POST_FORKING"),
            (3, "RESTORE_EXT_FILE"),
            (8, "UPDATE_VMA_MAP"),
            (9, "RESUME_DEVICES_LATE"),
        ],
        other => panic!("unknown stage {other}"),
    };
    candidates
        .iter()
        .filter(|(slot, _)| fam.knows(*slot))
        .map(|(_, name)| *name)
        .collect()
}

// ---- the checks every clean run must pass -------------------------------------------------

/// Things true of every run by a CRIU host: nothing on stdout (CRIU's stdout may be a user's
/// terminal or `--stream` output), nothing on stderr but the one line of a restore that failed
/// at the plugin's `init` (`criu_plugin::log::to_stderr`), and the host built as the family
/// says.
pub(crate) fn check_host_run(fam: &Family, run: &Run) {
    assert!(run.stdout.is_empty(), "plugin wrote to stdout: {run:?}");
    let init_failed = run.report.iter().any(|l| l.starts_with("init rc=-"));
    let restore = run.report.iter().any(|l| l.contains("stage=restore"));
    for line in run.stderr.lines() {
        assert!(
            init_failed && restore && line.starts_with("gpu_plugin: restore failed: "),
            "plugin wrote to stderr: {run:?}"
        );
    }
    let legacy: Vec<&str> = run
        .report
        .iter()
        .filter_map(|l| l.strip_prefix("legacy "))
        .collect();
    assert_eq!(legacy, legacy_names(fam), "{run:?}");
    for l in &run.report {
        assert!(
            !l.starts_with("LOG-REENTERED"),
            "print_on_level entered concurrently: {run:?}"
        );
    }
}

/// A successful cycle for a process that is not a GPU process.
pub(crate) fn check_clean_cycle(fam: &Family, loglevel: u32, cycle: &Cycle<'_>, run: &Run) {
    let stage = cycle.stage;
    let ctx = format!("{stage} cycle of {run:?}");

    // The descriptor, as adapted in the constructor before dlopen returned.
    let slots: Vec<String> = registered_slots()
        .iter()
        .filter(|s| fam.knows(**s))
        .map(u32::to_string)
        .collect();
    let desc = format!(
        "desc name=gpu_plugin version={DESC_VERSION} max_hooks={} slots={}",
        fam.hooks,
        slots.join(",")
    );
    assert!(cycle.has(&desc), "expected `{desc}` in {ctx}");
    assert!(
        !cycle
            .starting("desc ")
            .any(|d| d.contains(&format!("version={DESC_VERSION_OLD} "))),
        "{ctx}"
    );
    assert!(cycle.has("init rc=0"), "{ctx}");

    // Every hook CRIU calls answers "not mine", in the host's arity.
    let calls = cycle.hooks();
    let called: BTreeSet<&str> = calls.iter().map(|c| c.name).collect();
    assert_eq!(called, expected_hooks(fam, stage), "{ctx}");
    for c in &calls {
        assert_eq!(c.rc, NOT_MINE, "{} must be -ENOTSUP: {ctx}", c.name);
        match c.name {
            "RESTORE_EXT_FILE" if fam.retry => {
                assert_eq!(c.get("retry"), Some("0"), "retry flag not written: {ctx}")
            }
            // 0xAA untouched: the plugin took the one-argument variant.
            "RESTORE_EXT_FILE" => assert_eq!(c.get("canary"), Some("170"), "{ctx}"),
            "UPDATE_VMA_MAP" => {
                assert_eq!(c.get("plugin_fd"), Some("-1"), "{ctx}");
                assert_eq!(c.get("new_pgoff"), Some("0x1234"), "{ctx}");
            }
            _ => {}
        }
    }
    assert!(
        !cycle.lines.iter().any(|l| l.contains("unregistered")),
        "{ctx}"
    );
    if called.contains("RESTORE_EXT_FILE") {
        assert!(cycle.has("task exited status=0"), "{ctx}");
    }

    // exit: dump and restore only, with CRIU's success.
    let exit = format!("exit stage={} ret=0", stage_number(stage));
    if stage == "pre-dump" {
        assert_eq!(cycle.starting("exit ").count(), 0, "{ctx}");
    } else {
        assert!(cycle.has(&exit) && cycle.has("exit returned"), "{ctx}");
    }
    assert!(cycle.has("result ok"), "{ctx}");

    // Inventory: nothing added for a non-GPU dump; only our names claimed on restore.
    if fam.v41_api {
        assert_eq!(cycle.starting("inventory-add ").count(), 0, "{ctx}");
        if stage == "dump" {
            assert!(cycle.has("inventory-written []"), "{ctx}");
        }
        // The plugin first claims a name no image lists, to learn whether the image has a list.
        for claim in cycle.starting("inventory-claim ") {
            let probe = claim
                .trim_start_matches('\u{1}')
                .starts_with("criu-plugin-crate list probe ");
            assert!(
                claim.starts_with("cuda_plugin ") || claim.starts_with("amdgpu_plugin ") || probe,
                "claimed a name that is not ours: {claim}: {ctx}"
            );
        }
    } else {
        assert_eq!(cycle.starting("inventory-").count(), 0, "{ctx}");
    }

    // Logging: CRIU's levels, never LOG_MSG (stdout), every message ends in a newline,
    // nothing above the host's level, no error for a process that is simply not ours.
    let logs = cycle.logs();
    for (kind, lvl, text) in &logs {
        assert_eq!(*kind, "LOG", "message without newline `{text}`: {ctx}");
        assert!(*lvl >= 1, "LOG_MSG goes to CRIU's stdout: `{text}`: {ctx}");
        assert!(
            *lvl <= loglevel.max(1),
            "level {lvl} above host level: {ctx}"
        );
        assert_ne!(*lvl, 1, "error in a clean run: `{text}`: {ctx}");
        assert!(text.starts_with("gpu_plugin: "), "prefix missing: {ctx}");
    }
    let banner = format!(
        "gpu_plugin: gpu_plugin {PKG_VERSION} in {} (hooks {}, RESTORE_EXT_FILE retry {}), stage {}",
        fam.detected,
        fam.hooks,
        fam.retry,
        stage_name(stage)
    );
    let banners: Vec<_> = logs.iter().filter(|(_, _, t)| *t == banner).collect();
    if loglevel >= 3 {
        assert_eq!(banners.len(), 1, "expected INFO `{banner}`: {ctx}");
        assert_eq!(banners[0].1, 3, "banner must be INFO: {ctx}");
    } else {
        assert!(banners.is_empty(), "{ctx}");
    }
}

pub(crate) fn check_clean_run(fam: &Family, loglevel: u32, stages: &str, run: &Run) {
    check_host_run(fam, run);
    assert_eq!(run.status, 0, "{run:?}");
    let cycles = run.cycles();
    let wanted: Vec<&str> = stages.split(',').collect();
    assert_eq!(
        cycles.iter().map(|c| c.stage).collect::<Vec<_>>(),
        wanted,
        "{run:?}"
    );
    for c in &cycles {
        check_clean_cycle(fam, loglevel, c, run);
    }
}
