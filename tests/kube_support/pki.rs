//! The cluster's certificates, made by the test with `openssl`: one CA, the API server's
//! serving certificate, the administrator's client certificate (group `system:masters`, what
//! `kubectl` and the checkpoint calls use), each node's kubelet client certificate
//! (`system:node:<name>`, group `system:nodes`, as the Node authorizer expects) and serving
//! certificate, and the service-account signing key. EC P-256 keys (fast to make); every
//! certificate is valid for a day.

use std::path::{Path, PathBuf};

use crate::common::E2e;
use crate::containers_support::run_tool;

/// A key and its certificate.
#[derive(Clone, Debug)]
pub struct KeyPair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The cluster's CA and the certificates of its control plane.
pub struct Pki {
    dir: PathBuf,
    pub ca: KeyPair,
    pub apiserver: KeyPair,
    pub admin: KeyPair,
    /// The service-account token signing key (`key`) and its public half (`cert`).
    pub service_accounts: KeyPair,
}

/// What a leaf certificate is for.
enum Use<'a> {
    Client,
    Server { ips: &'a [&'a str] },
}

impl Pki {
    /// Makes the CA and the control plane's certificates in `<test dir>/pki`; the API server's
    /// serves on 127.0.0.1 and each of `ips`.
    pub fn new(e: &E2e, ips: &[&str]) -> Pki {
        let dir = e.dir().join("pki");
        std::fs::create_dir_all(&dir).expect("pki directory");
        let ca = KeyPair {
            cert: dir.join("ca.crt"),
            key: dir.join("ca.key"),
        };
        openssl(
            e,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=criu-gpu-e2e-ca",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                "-keyout",
                path(&ca.key),
                "-out",
                path(&ca.cert),
            ],
        );
        let sa = KeyPair {
            cert: dir.join("sa.pub"),
            key: dir.join("sa.key"),
        };
        openssl(
            e,
            &[
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
                path(&sa.key),
            ],
        );
        openssl(
            e,
            &[
                "pkey",
                "-in",
                path(&sa.key),
                "-pubout",
                "-out",
                path(&sa.cert),
            ],
        );
        let mut pki = Pki {
            dir,
            ca,
            apiserver: KeyPair {
                cert: PathBuf::new(),
                key: PathBuf::new(),
            },
            admin: KeyPair {
                cert: PathBuf::new(),
                key: PathBuf::new(),
            },
            service_accounts: sa,
        };
        let mut server_ips = vec!["127.0.0.1"];
        server_ips.extend_from_slice(ips);
        pki.apiserver = pki.leaf(
            e,
            "apiserver",
            "/CN=kube-apiserver",
            Use::Server { ips: &server_ips },
        );
        pki.admin = pki.leaf(
            e,
            "admin",
            "/O=system:masters/CN=criu-gpu-e2e-admin",
            Use::Client,
        );
        pki
    }

    /// Node `name`'s kubelet: its client certificate (to the API server) and its serving
    /// certificate for `ip`.
    pub fn node(&self, e: &E2e, name: &str, ip: &str) -> (KeyPair, KeyPair) {
        let client = self.leaf(
            e,
            &format!("kubelet-{name}"),
            &format!("/O=system:nodes/CN=system:node:{name}"),
            Use::Client,
        );
        let serving = self.leaf(
            e,
            &format!("kubelet-{name}-serving"),
            &format!("/CN={name}"),
            Use::Server {
                ips: &["127.0.0.1", ip],
            },
        );
        (client, serving)
    }

    /// A key and a certificate signed by the CA, named `stem` in the pki directory.
    fn leaf(&self, e: &E2e, stem: &str, subject: &str, usage: Use<'_>) -> KeyPair {
        let pair = KeyPair {
            cert: self.dir.join(format!("{stem}.crt")),
            key: self.dir.join(format!("{stem}.key")),
        };
        let csr = self.dir.join(format!("{stem}.csr"));
        openssl(
            e,
            &[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-subj",
                subject,
                "-keyout",
                path(&pair.key),
                "-out",
                path(&csr),
            ],
        );
        let ext = self.dir.join(format!("{stem}.ext"));
        let text = match usage {
            Use::Client => "keyUsage=critical,digitalSignature,keyEncipherment\n\
                            extendedKeyUsage=clientAuth\n"
                .to_string(),
            Use::Server { ips } => {
                let mut sans: Vec<String> = ips.iter().map(|ip| format!("IP:{ip}")).collect();
                sans.push("DNS:localhost".into());
                format!(
                    "keyUsage=critical,digitalSignature,keyEncipherment\n\
                     extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={}\n",
                    sans.join(",")
                )
            }
        };
        std::fs::write(&ext, text).expect("certificate extensions");
        openssl(
            e,
            &[
                "x509",
                "-req",
                "-in",
                path(&csr),
                "-CA",
                path(&self.ca.cert),
                "-CAkey",
                path(&self.ca.key),
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                path(&ext),
                "-out",
                path(&pair.cert),
            ],
        );
        pair
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

fn openssl(e: &E2e, args: &[&str]) {
    let mut cmd = e.command(Path::new("openssl"));
    cmd.args(args);
    run_tool(e.dir(), cmd, &format!("openssl {}", args[0])).assert_ok();
}
