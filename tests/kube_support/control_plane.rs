//! The control plane a test starts: etcd on 127.0.0.1 and kube-apiserver on the host's
//! addresses (127.0.0.1 for the test, the cluster network's for the nodes), both built from
//! their Go modules (`scripts/build-upstream.sh`), and `kubectl` as the cluster's
//! administrator. No scheduler and no controller manager: pods name their node
//! (`spec.nodeName`), and the test makes the `default` service account itself (the controller
//! manager's job) and the `kube-root-ca.crt` configmap, so that every pod gets its projected
//! service-account token and CA as on a real cluster.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::network::gateway_of;
use super::pki::{KeyPair, Pki};
use super::upstream;
use crate::common::{self, E2e};
use crate::containers_support::{ToolRun, run_tool_for};

/// The most nodes a cluster has (the API server's certificate names each one's gateway).
pub const MAX_NODES: u8 = 4;

/// How long the API server may take to be ready (on 2 busy cores: 20 to 60 s).
const APISERVER_READY: Duration = Duration::from_secs(180);

/// How long one look at the cluster (a `GET`) may take.
const LOOK: Duration = Duration::from_secs(30);

/// The text of the field at JSON pointer `pointer` (`/status/phase`) of `object`: a string as
/// it is, a number or other value in JSON, "" when the field is absent (as `kubectl get -o
/// jsonpath` prints).
pub fn field(object: Option<&serde_json::Value>, pointer: &str) -> String {
    match object.and_then(|o| o.pointer(pointer)) {
        None | Some(serde_json::Value::Null) => String::new(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    }
}

/// etcd, kube-apiserver, and the administrator's kubeconfig.
pub struct ControlPlane<'e> {
    e: &'e E2e,
    pub pki: Pki,
    /// `https://127.0.0.1:PORT`.
    pub server: String,
    /// The API server's port.
    pub port: u16,
    pub admin_kubeconfig: PathBuf,
    dir: PathBuf,
    pids: Vec<i32>,
}

/// A port nobody uses now (taken by the daemon a moment later).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A kubeconfig for `server` with client certificate `user` named `name`.
pub fn write_kubeconfig(path: &Path, server: &str, ca: &Path, user: &KeyPair, name: &str) {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {server}\n    \
             certificate-authority: {ca}\nusers:\n- name: {name}\n  user:\n    \
             client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: e2e\n  context:\n    \
             cluster: e2e\n    user: {name}\ncurrent-context: e2e\n",
            ca = ca.display(),
            cert = user.cert.display(),
            key = user.key.display(),
        ),
    )
    .expect("kubeconfig");
}

impl<'e> ControlPlane<'e> {
    /// Starts etcd and the API server (state in `<test dir>/control-plane`), waits until the
    /// API server is ready and makes the `default` service account.
    pub fn start(e: &'e E2e) -> ControlPlane<'e> {
        let dir = e.dir().join("control-plane");
        std::fs::create_dir_all(&dir).expect("control-plane directory");
        let gateways: Vec<String> = (1..=MAX_NODES).map(gateway_of).collect();
        let pki = Pki::new(e, &gateways.iter().map(String::as_str).collect::<Vec<_>>());
        let (client, peer, secure) = (free_port(), free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client}");
        let mut etcd = e.command(&upstream("etcd-3.7", "etcd"));
        etcd.arg("--name=e2e")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=e2e=http://127.0.0.1:{peer}"))
            .arg("--log-level=warn")
            .arg("--quota-backend-bytes=1073741824");
        log_to(&mut etcd, &dir.join("etcd.log"));
        let etcd_pid = e.spawn_session(etcd);

        let mut api = e.command(&upstream("kubernetes-1.37", "kube-apiserver"));
        api.arg(format!("--etcd-servers={etcd_url}"))
            // Every address of the host: 127.0.0.1 for the test, the cluster network's for
            // the nodes; only clients with a certificate of the test's CA get in.
            .arg("--bind-address=0.0.0.0")
            .arg("--anonymous-auth=false")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={secure}"))
            .arg(format!(
                "--cert-dir={}",
                dir.join("apiserver-certs").display()
            ))
            .arg(format!("--tls-cert-file={}", pki.apiserver.cert.display()))
            .arg(format!(
                "--tls-private-key-file={}",
                pki.apiserver.key.display()
            ))
            .arg(format!("--client-ca-file={}", pki.ca.cert.display()))
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!(
                "--service-account-key-file={}",
                pki.service_accounts.cert.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                pki.service_accounts.key.display()
            ))
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            // `kubectl logs` goes through the API server to the kubelet: by the node's address
            // (node names resolve nowhere here), the kubelet's serving certificate checked
            // against the cluster's CA, as the administrator.
            .arg("--kubelet-preferred-address-types=InternalIP")
            .arg(format!(
                "--kubelet-certificate-authority={}",
                pki.ca.cert.display()
            ))
            .arg(format!(
                "--kubelet-client-certificate={}",
                pki.admin.cert.display()
            ))
            .arg(format!("--kubelet-client-key={}", pki.admin.key.display()))
            .arg("--authorization-mode=Node,RBAC")
            .arg("--enable-admission-plugins=NodeRestriction")
            .arg("--allow-privileged=true")
            // The `kubernetes` service's endpoints would be this loopback address, which the
            // API server refuses to publish; nothing here needs them.
            .arg("--endpoint-reconciler-type=none")
            .arg("--profiling=false")
            .arg("--v=1");
        log_to(&mut api, &dir.join("kube-apiserver.log"));
        let api_pid = e.spawn_session(api);

        let server = format!("https://127.0.0.1:{secure}");
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(
            &admin_kubeconfig,
            &server,
            &pki.ca.cert,
            &pki.admin,
            "admin",
        );
        let cp = ControlPlane {
            e,
            pki,
            server,
            port: secure,
            admin_kubeconfig,
            dir,
            pids: vec![api_pid, etcd_pid],
        };
        let t0 = Instant::now();
        loop {
            let r = cp.curl_as_admin("GET", &format!("{}/readyz", cp.server), "API server", LOOK);
            if r == (200, "ok".to_string()) {
                break;
            }
            for (pid, log) in [(etcd_pid, "etcd.log"), (api_pid, "kube-apiserver.log")] {
                assert!(
                    common::exists(pid),
                    "{log}: the daemon ended while starting:\n{}",
                    cp.log_tail(log)
                );
            }
            assert!(
                t0.elapsed() < APISERVER_READY,
                "the API server is not ready after {APISERVER_READY:?}: {r:?}\n{}",
                cp.log_tail("kube-apiserver.log")
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        eprintln!("control plane ready in {:?}", t0.elapsed());
        // What the controller manager would make: the namespace's service account, and the
        // cluster's CA as the configmap every pod's projected API access volume reads.
        let ca = std::fs::read_to_string(&cp.pki.ca.cert).expect("the cluster's CA");
        cp.apply(
            "cluster-defaults",
            &format!(
                "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: default\n  \
                 namespace: default\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  \
                 name: kube-root-ca.crt\n  namespace: default\ndata:\n  ca.crt: {}\n",
                serde_json::Value::String(ca)
            ),
        );
        cp
    }

    /// `curl` of `url` (a server of the cluster's, `what` in the log) as the cluster's
    /// administrator: the HTTP status and the body; status 0 and curl's words when nothing
    /// answered. The tests read the cluster with curl and write it with `kubectl`, as a user
    /// does: in a busy guest under TCG one `kubectl` took 10 to 25 s, one curl 1 to 4 s.
    pub fn curl_as_admin(
        &self,
        method: &str,
        url: &str,
        what: &str,
        limit: Duration,
    ) -> (u16, String) {
        let mut cmd = self.e.command(Path::new("curl"));
        cmd.args(["-sS", "-X", method, "-w", "\n%{http_code}"])
            .arg("--cacert")
            .arg(&self.pki.ca.cert)
            .arg("--cert")
            .arg(&self.pki.admin.cert)
            .arg("--key")
            .arg(&self.pki.admin.key)
            .arg(url);
        let r: ToolRun = run_tool_for(
            self.e.dir(),
            cmd,
            &format!("curl -X {method} {what} {url}"),
            limit,
        );
        let out = r.stdout.trim_end();
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", out));
        match code.trim().parse() {
            Ok(code) if code > 0 => (code, body.to_string()),
            _ => (0, format!("{body}{}", r.stderr)),
        }
    }

    /// The API server's object at `path` (`/api/v1/...`); `None` when there is none or no
    /// answer.
    pub fn get_object(&self, path: &str) -> Option<serde_json::Value> {
        let url = format!("{}{path}", self.server);
        match self.curl_as_admin("GET", &url, "API server", LOOK) {
            (200, body) => serde_json::from_str(&body).ok(),
            _ => None,
        }
    }

    /// `kubectl` as the administrator; panics unless it succeeds.
    pub fn kubectl(&self, args: &[&str]) -> ToolRun {
        let r = self.kubectl_quiet(args);
        assert!(r.ok(), "{r:?}");
        r
    }

    /// `kubectl` as the administrator, whatever it answers.
    pub fn kubectl_quiet(&self, args: &[&str]) -> ToolRun {
        let mut cmd = self.e.command(&upstream("kubernetes-1.37", "kubectl"));
        cmd.arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .arg("--request-timeout=30s")
            .args(args);
        run_tool_for(
            self.e.dir(),
            cmd,
            &format!("kubectl {}", args.join(" ")),
            Duration::from_secs(45),
        )
    }

    /// `kubectl apply` of the manifest `yaml`.
    pub fn apply(&self, name: &str, yaml: &str) {
        let file = self.dir.join(format!("{name}.yaml"));
        std::fs::write(&file, yaml).expect("manifest");
        self.kubectl(&["apply", "-f", file.to_str().expect("UTF-8 path")]);
    }

    /// The last lines of the control plane's log `name`.
    pub fn log_tail(&self, name: &str) -> String {
        tail(&self.dir.join(name), 30)
    }
}

impl Drop for ControlPlane<'_> {
    fn drop(&mut self) {
        // The API server before etcd, as a node's shutdown does.
        for &pid in &self.pids {
            stop(pid);
        }
    }
}

/// Ends daemon `pid` of the test: SIGTERM, and SIGKILL if it is still there after 10 s.
pub fn stop(pid: i32) {
    common::signal(pid, libc::SIGTERM);
    if !common::reap_until_gone(&[pid], Duration::from_secs(10)) {
        common::signal(pid, libc::SIGKILL);
        let _ = common::reap_until_gone(&[pid], common::WAIT);
    }
}

/// `cmd`'s stdout and stderr to `log`.
pub fn log_to(cmd: &mut std::process::Command, log: &Path) {
    let f = std::fs::File::create(log).expect("log file");
    cmd.stdout(f.try_clone().expect("log file")).stderr(f);
}

/// The last `n` lines of file `path`.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "--- {} (last {n} lines)\n{}",
        path.display(),
        lines[lines.len().saturating_sub(n)..].join("\n")
    )
}
