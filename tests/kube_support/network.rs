//! Each node's own network namespace, as each machine of a cluster has its own network: held
//! by a sleeping process of the test's, joined to the host by a veth pair (`10.231.N.2` in the
//! node, `10.231.N.1` on the host, the node's default route through it). The host's side is the
//! cluster's network: the API server and the registry listen there, so node N reaches them at
//! `10.231.N.1` or at any other host address of the cluster (`10.231.1.1`, say, from every
//! node). The namespace, its interfaces and addresses go away with its last process.

use std::path::{Path, PathBuf};

use crate::common::{self, E2e};
use crate::containers_support::run_tool;

/// One node's network namespace.
pub struct NodeNet {
    holder: i32,
    /// The veth's end on the host.
    host_if: String,
    /// The node's address.
    pub ip: String,
    /// The host's address on the node's link.
    pub gateway: String,
}

/// The host's address on node `index`'s link (1-based).
pub fn gateway_of(index: u8) -> String {
    format!("10.231.{index}.1")
}

impl NodeNet {
    /// The network namespace of node number `index` (1-based) named `name`.
    pub fn new(e: &E2e, index: u8, name: &str) -> NodeNet {
        let gateway = gateway_of(index);
        let taken = ip_output(
            e,
            &["-4", "-o", "addr", "show", "to", &format!("{gateway}/32")],
        );
        assert!(
            taken.trim().is_empty(),
            "{gateway} is already an address of this host ({}): another run's node network, or \
             one left behind (`ip link del` that interface)",
            taken.trim()
        );
        // Killed with the test (its parent-death signal) if the test is killed.
        let mut cmd = e.command(Path::new("setpriv"));
        cmd.args([
            "--pdeathsig",
            "KILL",
            "--",
            "unshare",
            "--net",
            "--",
            "sleep",
            "1000000",
        ]);
        let holder = e.spawn_session(cmd);
        let ns = format!("/proc/{holder}/ns/net");
        common::wait_until(format!("node {name}'s network namespace"), || {
            std::fs::read_link(&ns).ok() != std::fs::read_link("/proc/self/ns/net").ok()
        });
        // Short (at most 15 bytes) and unique on the host: this process, a count, the node.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 100;
        let host_if = format!("k{}{n}{name}", std::process::id() % 100_000);
        let net = NodeNet {
            holder,
            host_if: host_if.clone(),
            ip: format!("10.231.{index}.2"),
            gateway,
        };
        let host = |args: &[&str]| ip(e, None, args);
        host(&[
            "link",
            "add",
            &host_if,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &holder.to_string(),
        ]);
        host(&[
            "addr",
            "add",
            &format!("{}/24", net.gateway),
            "dev",
            &host_if,
        ]);
        host(&["link", "set", &host_if, "up"]);
        let inside = |args: &[&str]| ip(e, Some(&net.path()), args);
        inside(&["link", "set", "lo", "up"]);
        inside(&["addr", "add", &format!("{}/24", net.ip), "dev", "eth0"]);
        inside(&["link", "set", "eth0", "up"]);
        inside(&["route", "add", "default", "via", &net.gateway]);
        net
    }

    /// The namespace's file (for `nsenter --net=`).
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.holder))
    }
}

impl Drop for NodeNet {
    fn drop(&mut self) {
        // Gone with the namespace anyway; at once here, while a thread may still hold it.
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.host_if])
            .stderr(std::process::Stdio::null())
            .status();
        common::signal(self.holder, libc::SIGKILL);
        let _ = common::reap_until_gone(&[self.holder], common::WAIT);
    }
}

/// What `ip ARGS` on the host prints.
fn ip_output(e: &E2e, args: &[&str]) -> String {
    let mut cmd = e.command(Path::new("ip"));
    cmd.args(args);
    let r = run_tool(e.dir(), cmd, &format!("ip {}", args.join(" ")));
    r.assert_ok();
    r.stdout
}

/// `ip ARGS` on the host, or in network namespace `ns`; panics unless it succeeds.
fn ip(e: &E2e, ns: Option<&Path>, args: &[&str]) {
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = e.command(Path::new("nsenter"));
            c.arg(format!("--net={}", ns.display())).arg("--").arg("ip");
            c
        }
        None => e.command(Path::new("ip")),
    };
    cmd.args(args);
    run_tool(e.dir(), cmd, &format!("ip {}", args.join(" "))).assert_ok();
}

/// A TCP port of the host's loopback seen on 127.0.0.1 inside node networks, as a registry on a
/// node's own loopback would be: per node, a thread of the test in the node's network namespace
/// (`setns` on that thread only) accepts on `127.0.0.1:PORT` there, and a thread in the host's
/// joins each connection to the host's `127.0.0.1:PORT`, so the registry listens on the
/// host's loopback only. containerd treats a registry on 127.0.0.1 as local and speaks plain
/// HTTP to it with its own resolver too (the restore's pull of a checkpoint's base image uses
/// that one, not the CRI's `hosts.toml`).
pub struct LoopbackForward {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl LoopbackForward {
    /// Forwards `127.0.0.1:port` of `net` to the host's `127.0.0.1:port`.
    pub fn new(net: &NodeNet, port: u16) -> LoopbackForward {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let ns = std::fs::File::open(net.path()).expect("the node's network namespace");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (conn_tx, conn_rx) = std::sync::mpsc::channel::<std::net::TcpStream>();
        let flag = stop.clone();
        let listener = std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns with a namespace file this thread opened; it changes this thread's
            // network namespace only (the test's other threads keep theirs).
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            let listener = (rc == 0)
                .then(|| std::net::TcpListener::bind(("127.0.0.1", port)).ok())
                .flatten();
            let ok = listener
                .as_ref()
                .is_some_and(|l| l.set_nonblocking(true).is_ok());
            let _ = ready_tx.send(ok);
            let Some(listener) = listener.filter(|_| ok) else {
                return;
            };
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((inbound, _)) => {
                        let _ = inbound.set_nonblocking(false);
                        if conn_tx.send(inbound).is_err() {
                            return;
                        }
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            }
        });
        let flag = stop.clone();
        // In the host's network namespace: its sockets reach the host's loopback.
        let connector = std::thread::spawn(move || {
            let mut pumps = Vec::new();
            let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            while !flag.load(Ordering::Relaxed) {
                let tick = std::time::Duration::from_millis(100);
                let Ok(inbound) = conn_rx.recv_timeout(tick) else {
                    continue;
                };
                let within = std::time::Duration::from_secs(5);
                if let Ok(outbound) = std::net::TcpStream::connect_timeout(&to, within) {
                    pumps.extend(splice(inbound, outbound, &flag));
                }
            }
            for p in pumps {
                let _ = p.join();
            }
        });
        assert_eq!(
            ready_rx.recv().ok(),
            Some(true),
            "cannot listen on 127.0.0.1:{port} in the node's network namespace"
        );
        LoopbackForward {
            stop,
            threads: vec![listener, connector],
        }
    }
}

impl Drop for LoopbackForward {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Two threads copying between `a` and `b` until either side ends or `stop` is set.
fn splice(
    a: std::net::TcpStream,
    b: std::net::TcpStream,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    let pump = |from: std::net::TcpStream, to: std::net::TcpStream| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut from, mut to) = (from, to);
            let _ = from.set_read_timeout(Some(std::time::Duration::from_millis(200)));
            let _ = to.set_write_timeout(Some(std::time::Duration::from_secs(5)));
            let mut buf = [0u8; 64 * 1024];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match from.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => break,
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Write);
        })
    };
    match (a.try_clone(), b.try_clone()) {
        (Ok(a2), Ok(b2)) => vec![pump(a, b), pump(b2, a2)],
        _ => Vec::new(),
    }
}
