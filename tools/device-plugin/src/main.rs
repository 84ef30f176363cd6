//! A stand-in Kubernetes device plugin: what a GPU vendor's device plugin does for the kubelet,
//! for nodes whose GPUs are stand-ins (the end-to-end tests' CUDA driver, the KFD simulator).
//!
//! It serves the kubelet's device plugin API (`v1beta1`) on `<dir>/<endpoint>`, registers
//! resource `--resource` with the kubelet at `<dir>/kubelet.sock`, lists every `--device` as
//! healthy, and answers `Allocate` with what each allocated device is given as: CDI device
//! names (as NVIDIA's plugin with `--device-list-strategy=cdi-cri`), device nodes (as AMD's
//! plugin hands out `/dev/kfd` and a render node), or container annotations (NVIDIA's
//! `cdi-annotations` strategy). It prints one line per call, so a test can tell what the
//! kubelet asked.
//!
//! ```text
//! stand-in-device-plugin --dir /var/lib/kubelet/device-plugins --resource nvidia.com/gpu \
//!     --device 'gpu0=cdi:nvidia.com/gpu=GPU-…' \
//!     --device 'gpu1=dev:/dev/kfd,dev:/dev/dri/renderD129:/dev/dri/renderD128'
//! ```
//!
//! A device is `ID=ITEM[,ITEM…]`, an item `cdi:NAME`, `dev:HOST[:CONTAINER]` or
//! `annotation:KEY=VALUE`. It runs until killed; a kubelet that restarts wipes the directory,
//! and the plugin then ends (a test starts it again), as NVIDIA's would restart.

mod v1beta1 {
    #![allow(clippy::all, missing_docs)]
    include!("v1beta1.rs");
}

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use clap::Parser;
use hyper_util::rt::TokioIo;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::{Endpoint, Server};
use tonic::{Request, Response, Status};
use v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use v1beta1::registration_client::RegistrationClient;
use v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse, Device,
    DevicePluginOptions, DeviceSpec, Empty, ListAndWatchResponse, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    RegisterRequest,
};

/// The API version the kubelet is asked for.
const VERSION: &str = "v1beta1";

#[derive(Parser, Debug)]
#[command(about = "A stand-in Kubernetes device plugin for stand-in GPUs")]
struct Args {
    /// The kubelet's device plugin directory (where `kubelet.sock` is).
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    dir: PathBuf,
    /// The extended resource, e.g. `nvidia.com/gpu`.
    #[arg(long)]
    resource: String,
    /// This plugin's socket in `--dir` (default: the resource's name with `/` as `-`).
    #[arg(long)]
    endpoint: Option<String>,
    /// A device: `ID=ITEM[,ITEM…]`, each item `cdi:NAME`, `dev:HOST[:CONTAINER]` or
    /// `annotation:KEY=VALUE`.
    #[arg(long = "device", required = true)]
    devices: Vec<String>,
}

/// What a container allocated a device is given.
#[derive(Clone, Debug, Default, PartialEq)]
struct Grant {
    cdi: Vec<String>,
    nodes: Vec<(String, String)>,
    annotations: Vec<(String, String)>,
}

/// `ID=ITEM[,ITEM…]` as the device's id and its grant.
fn parse_device(s: &str) -> Result<(String, Grant), String> {
    let (id, items) = s
        .split_once('=')
        .ok_or_else(|| format!("device `{s}`: no `=` after its id"))?;
    if id.is_empty() {
        return Err(format!("device `{s}`: empty id"));
    }
    let mut g = Grant::default();
    for item in items.split(',') {
        match item.split_once(':') {
            Some(("cdi", name)) if name.contains('=') => g.cdi.push(name.to_string()),
            Some(("dev", path)) => {
                let (host, ctr) = path.split_once(':').unwrap_or((path, path));
                if !host.starts_with('/') || !ctr.starts_with('/') {
                    return Err(format!("device `{id}`: `{item}` needs absolute paths"));
                }
                g.nodes.push((host.to_string(), ctr.to_string()));
            }
            Some(("annotation", kv)) => {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| format!("device `{id}`: `{item}` needs KEY=VALUE"))?;
                g.annotations.push((k.to_string(), v.to_string()));
            }
            _ => {
                return Err(format!(
                    "device `{id}`: `{item}` is not cdi:VENDOR/CLASS=NAME, dev:PATH or annotation:KEY=VALUE"
                ));
            }
        }
    }
    Ok((id.to_string(), g))
}

/// The answer for one container that was allocated devices `ids`.
fn container_response(
    devices: &HashMap<String, Grant>,
    ids: &[String],
) -> Result<ContainerAllocateResponse, Status> {
    let mut r = ContainerAllocateResponse::default();
    for id in ids {
        let g = devices
            .get(id)
            .ok_or_else(|| Status::not_found(format!("no device {id}")))?;
        r.cdi_devices
            .extend(g.cdi.iter().map(|name| CdiDevice { name: name.clone() }));
        r.devices
            .extend(g.nodes.iter().map(|(host, ctr)| DeviceSpec {
                container_path: ctr.clone(),
                host_path: host.clone(),
                permissions: "rw".into(),
            }));
        r.annotations.extend(g.annotations.iter().cloned());
    }
    Ok(r)
}

struct Plugin {
    devices: HashMap<String, Grant>,
    /// In the order given.
    ids: Vec<String>,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let list = ListAndWatchResponse {
            devices: self
                .ids
                .iter()
                .map(|id| Device {
                    id: id.clone(),
                    health: "Healthy".into(),
                    topology: None,
                })
                .collect(),
        };
        println!("ListAndWatch: {:?}", self.ids);
        // The list once; the stream stays open (the kubelet reads a closed one as the plugin
        // gone).
        let stream = tokio_stream::once(Ok(list)).chain(tokio_stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Ok(Response::new(PreferredAllocationResponse::default()))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut answer = AllocateResponse::default();
        for c in req.into_inner().container_requests {
            let r = container_response(&self.devices, &c.devices_ids)?;
            println!("Allocate {:?}: {r:?}", c.devices_ids);
            answer.container_responses.push(r);
        }
        Ok(Response::new(answer))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse::default()))
    }
}

/// Registers `resource` served at `endpoint` (a file name in `dir`) with the kubelet.
async fn register(dir: &Path, endpoint: &str, resource: &str) -> Result<(), String> {
    let sock = dir.join("kubelet.sock");
    let channel = Endpoint::from_static("http://kubelet.invalid")
        .connect_timeout(Duration::from_secs(10))
        .connect_with_connector(tower::service_fn(move |_| {
            let sock = sock.clone();
            async move {
                tokio::net::UnixStream::connect(sock)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
        .map_err(|e| format!("cannot reach the kubelet at {}: {e}", dir.display()))?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: VERSION.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: Some(DevicePluginOptions::default()),
        })
        .await
        .map_err(|e| format!("the kubelet refused the registration: {e}"))?;
    Ok(())
}

async fn serve(args: Args) -> Result<(), String> {
    let mut devices = HashMap::new();
    let mut ids = Vec::new();
    for d in &args.devices {
        let (id, g) = parse_device(d)?;
        if devices.insert(id.clone(), g).is_some() {
            return Err(format!("device {id} given twice"));
        }
        ids.push(id);
    }
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| format!("{}.sock", args.resource.replace('/', "-")));
    let path = args.dir.join(&endpoint);
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)
        .map_err(|e| format!("cannot listen at {}: {e}", path.display()))?;
    let server = Server::builder()
        .add_service(DevicePluginServer::new(Plugin { devices, ids }))
        .serve_with_incoming(UnixListenerStream::new(listener));
    let server = tokio::spawn(server);
    register(&args.dir, &endpoint, &args.resource).await?;
    println!(
        "registered {} at {} with the kubelet",
        args.resource,
        path.display()
    );
    // Until the kubelet removes the socket (it wipes the directory when it starts again).
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if !path.exists() {
            return Err(format!("{} was removed", path.display()));
        }
        if server.is_finished() {
            return Err("the server ended".into());
        }
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("stand-in-device-plugin: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stand-in-device-plugin: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        let (id, g) = parse_device("gpu0=cdi:nvidia.com/gpu=GPU-1,annotation:a.b/c=d").unwrap();
        assert_eq!(id, "gpu0");
        assert_eq!(g.cdi, ["nvidia.com/gpu=GPU-1"]);
        assert_eq!(g.annotations, [("a.b/c".to_string(), "d".to_string())]);
        let (_, g) =
            parse_device("x=dev:/dev/kfd,dev:/dev/dri/renderD129:/dev/dri/renderD128").unwrap();
        assert_eq!(
            g.nodes,
            [
                ("/dev/kfd".to_string(), "/dev/kfd".to_string()),
                (
                    "/dev/dri/renderD129".to_string(),
                    "/dev/dri/renderD128".to_string()
                )
            ]
        );
        for bad in [
            "gpu0",
            "=cdi:a/b=c",
            "g=cdi:nocdi",
            "g=dev:rel",
            "g=annotation:k",
            "g=x:y",
        ] {
            assert!(parse_device(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn allocate_answers_each_device() {
        let devices = HashMap::from([
            parse_device("a=cdi:v.com/gpu=1").unwrap(),
            parse_device("b=dev:/dev/x").unwrap(),
        ]);
        let r = container_response(&devices, &["a".into(), "b".into()]).unwrap();
        assert_eq!(r.cdi_devices[0].name, "v.com/gpu=1");
        assert_eq!(r.devices[0].host_path, "/dev/x");
        assert!(container_response(&devices, &["c".into()]).is_err());
    }
}
