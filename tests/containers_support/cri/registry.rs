//! The registry the CRI nodes pull their images from, and the two images the tests push to it.

use super::*;

/// The sandbox image's process: waits, and ends on SIGTERM.
const PAUSE: &str =
    r#","Entrypoint":["/bin/sh","-c","trap 'exit 0' TERM INT; while :; do sleep 1; done"]"#;

/// The registry program: `$CRIU_GPU_TEST_REGISTRY`, else `<repo>/.registry/bin/registry`.
fn registry_program() -> PathBuf {
    let p = std::env::var_os("CRIU_GPU_TEST_REGISTRY").map_or_else(
        || Path::new(common::REPO).join(".registry/bin/registry"),
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "{} is missing: run scripts/install-registry.sh (scripts/setup.sh does), set \
         CRIU_GPU_TEST_REGISTRY, or set GPU_PLUGIN_SKIP_E2E=1 to skip the end-to-end tests",
        p.display()
    );
    p
}

/// A container image registry of the test's (on 127.0.0.1 unless said), its storage in the
/// test's directory.
pub struct Registry {
    pid: i32,
    /// `127.0.0.1:PORT`.
    pub host: String,
}

impl Registry {
    pub fn start(e: &E2e) -> Registry {
        Registry::start_at(e, "127.0.0.1", "127.0.0.1")
    }

    /// A registry listening on `listen` (an address of the host, or `0.0.0.0`), its images named
    /// after `host_ip` (where its clients reach it).
    pub fn start_at(e: &E2e, listen: &str, host_ip: &str) -> Registry {
        let dir = e.dir().join("registry");
        std::fs::create_dir_all(dir.join("storage")).expect("registry directory");
        // A port nobody uses now; the registry takes it a moment later.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let host = format!("{host_ip}:{port}");
        let addr = format!("{listen}:{port}");
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  \
                 delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
                dir.join("storage").display()
            ),
        )
        .expect("registry config");
        let mut cmd = e.command(&registry_program());
        cmd.arg("serve").arg(&config);
        let log = std::fs::File::create(dir.join("registry.log")).expect("registry log");
        cmd.stdout(log.try_clone().expect("log")).stderr(log);
        let pid = e.spawn_session(cmd);
        let r = Registry { pid, host };
        let deadline = Instant::now() + common::WAIT;
        while r.get("/v2/").is_none() {
            assert!(
                Instant::now() < deadline && common::exists(pid),
                "the registry did not come up: {}",
                std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    /// The status line and body of `GET path`, if the registry answers.
    pub fn get(&self, path: &str) -> Option<String> {
        let mut s = TcpStream::connect(&self.host).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.0\r\nHost: {}\r\nAccept: application/vnd.oci.image.index.v1+json, \
             application/vnd.oci.image.manifest.v1+json\r\n\r\n",
            self.host
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.starts_with("HTTP/").then_some(out)
    }

    /// `hosts.toml` of a containerd registry configuration directory for this registry
    /// (plain HTTP).
    pub fn write_hosts_toml(&self, certs_d: &Path) {
        let d = certs_d.join(&self.host);
        std::fs::create_dir_all(&d).expect("certs.d");
        std::fs::write(
            d.join("hosts.toml"),
            format!(
                "server = \"http://{h}\"\n[host.\"http://{h}\"]\n  capabilities = [\"pull\", \
                 \"resolve\", \"push\"]\n  skip_verify = true\n",
                h = self.host
            ),
        )
        .expect("hosts.toml");
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        common::signal(self.pid, libc::SIGKILL);
        let _ = common::reap_until_gone(&[self.pid], common::WAIT);
    }
}

/// The names of the images the CRI tests pull from the registry.
pub struct Images {
    /// The root file system with the workloads.
    pub workload: String,
    /// The pod sandbox image.
    pub pause: String,
}

impl Images {
    /// The images' names in `registry`.
    pub fn of(registry: &Registry) -> Images {
        Images {
            workload: format!("{}/criu-gpu-e2e/workload:1", registry.host),
            pause: format!("{}/criu-gpu-e2e/pause:1", registry.host),
        }
    }
}

/// Builds the test's two `images` and pushes them to their registry through `cd` (any
/// containerd; its `ctr`, plain HTTP).
pub fn push_images(e: &E2e, cd: &Containerd<'_>, images: &Images) {
    for (stem, name, config) in [
        ("workload-image", &images.workload, ""),
        ("pause-image", &images.pause, PAUSE),
    ] {
        let archive = oci_archive_of(e, stem, name, config);
        cd.ctr(&["image", "import", archive.to_str().expect("UTF-8 path")])
            .assert_ok();
        cd.ctr(&["image", "push", "--plain-http", name]).assert_ok();
    }
}
