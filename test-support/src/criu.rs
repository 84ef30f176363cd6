//! Real CRIU: where it is, which release, and one finished run with its log.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::REPO;

/// A CRIU run that takes longer hangs.
pub(crate) const CRIU_TIMEOUT: Duration = Duration::from_secs(120);

/// Messages CRIU logs as errors that are the machine's, not ours, and after which CRIU goes
/// on: the test machine's container does not let it raise `RLIMIT_NOFILE` beyond the hard
/// limit, and on kernels before 6.7 (Debian 12's 6.1) the first CRIU run after a boot probes
/// whether binfmt_misc mounts in a user namespace and logs the refusal as an error.
const ENVIRONMENT_ERRORS: &[&str] = &[
    "rlimit: Can't setup RLIMIT_NOFILE",
    "Unable to create the binfmt_misc file system",
];

pub fn skip_requested() -> bool {
    std::env::var_os("GPU_PLUGIN_SKIP_E2E").is_some_and(|v| v == "1")
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The CRIU binary, or a panic that says how to get one.
pub fn criu_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("CRIU_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "CRIU_BIN={} does not exist; unset it to use <repo>/.criu/bin/criu (made by \
             scripts/install-criu.sh)",
            p.display()
        );
        return p;
    }
    let private = Path::new(REPO).join(".criu/bin/criu");
    if private.is_file() {
        return private;
    }
    find_in_path("criu").unwrap_or_else(|| {
        panic!(
            "CRIU not found (no $CRIU_BIN, no {}, no `criu` on PATH): run scripts/install-criu.sh \
             to install it, or set GPU_PLUGIN_SKIP_E2E=1 to skip the end-to-end tests",
            private.display()
        )
    })
}

/// `criu --version`'s "Version: X.Y[.Z]" as (X, Y).
pub fn criu_version(criu: &Path) -> Option<(u32, u32)> {
    let out = Command::new(criu).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))?
        .trim();
    let mut parts = v.split(['.', '-']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// One finished CRIU run.
pub struct CriuRun {
    pub what: String,
    pub code: Option<i32>,
    pub log: String,
    pub output: String,
    pub took: Duration,
}

impl CriuRun {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// Error lines of the log, without the ones this machine adds to every run.
    pub fn errors(&self) -> Vec<&str> {
        self.log
            .lines()
            .filter(|l| l.contains(") Error (") || l.starts_with("Error ("))
            .filter(|l| !ENVIRONMENT_ERRORS.iter().any(|e| l.contains(e)))
            .collect()
    }

    pub fn first_error(&self) -> Option<&str> {
        self.errors().into_iter().next()
    }

    pub fn has(&self, needle: &str) -> bool {
        self.log.contains(needle)
    }

    /// Log lines containing `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<&str> {
        self.log.lines().filter(|l| l.contains(needle)).collect()
    }

    /// Panics with the log's story unless CRIU succeeded.
    pub fn assert_ok(&self) {
        assert!(self.ok(), "{self:?}");
    }

    pub fn assert_failed(&self) {
        assert!(
            self.code.is_some_and(|c| c != 0),
            "expected CRIU to fail: {self:?}"
        );
    }

    /// CRIU's first error is the plugin's lock timeout, and the run ended within `within`
    /// (CRIU's `--timeout` of 2 s bounded the lock, not the plugin's default of 10 s).
    pub fn assert_lock_timed_out(&self, within: Duration) {
        let first = self.first_error().unwrap_or_default();
        assert!(
            first.contains("gpu_plugin") && first.contains("did not finish within"),
            "the first error must be the plugin's lock timeout: {self:?}"
        );
        assert!(
            self.took < within,
            "the run took {:?}, more than {within:?}: {self:?}",
            self.took
        );
    }

    /// No error line mentions the plugin.
    pub fn assert_no_plugin_errors(&self) {
        let ours: Vec<&str> = self
            .errors()
            .into_iter()
            .filter(|l| l.contains("gpu_plugin"))
            .collect();
        assert!(ours.is_empty(), "plugin errors {ours:#?}: {self:?}");
    }
}

impl std::fmt::Debug for CriuRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: exit {:?} after {:?}",
            self.what, self.code, self.took
        )?;
        writeln!(f, "  output: {:?}", self.output)?;
        writeln!(f, "  error lines:")?;
        for l in self.errors() {
            writeln!(f, "    {l}")?;
        }
        writeln!(f, "  plugin lines:")?;
        for l in self
            .log
            .lines()
            .filter(|l| l.contains("gpu_plugin:"))
            .take(60)
        {
            writeln!(f, "    {l}")?;
        }
        writeln!(f, "  log tail:")?;
        let lines: Vec<&str> = self.log.lines().collect();
        for l in &lines[lines.len().saturating_sub(25)..] {
            writeln!(f, "    {l}")?;
        }
        Ok(())
    }
}

/// Whether `hay` contains `needle` (raw bytes of an image file).
pub fn bytes_contain(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// A CRIU action script in `dir` that fails the post-dump action (and no other).
pub fn failing_post_dump_script(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join("fail-post-dump.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] && exit 1\nexit 0\n",
    )
    .expect("write the action script");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
        .expect("make the action script executable");
    script
}
