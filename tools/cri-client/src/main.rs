//! `cri-client`: the CRI calls the kubelet makes, one per command, for scripts (the GPU
//! machine's CRI case in `scripts/gpu-check.sh`) and for trying things by hand.
//!
//! ```text
//! cri-client --socket S run-pod --name P --log-dir D [--cgroup-parent C]       # prints the pod id
//! cri-client --socket S pull --pod-name P --log-dir D IMAGE
//! cri-client --socket S create POD --pod-name P --log-dir D --name N --image I \
//!            [--env K=V]... [--mount HOST:CTR]... [--device HOST:CTR]... [--cdi NAME]... -- ARGS...
//! cri-client --socket S start|stop|rm|status ID
//! cri-client --socket S checkpoint ID ARCHIVE [--timeout SECS]
//! cri-client --socket S stop-pod|rm-pod POD
//! ```
//! A container created with `--image` naming a checkpoint archive is restored by `start`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use cri_client::{Cri, v1};

#[derive(Parser)]
#[command(about = "The kubelet's CRI calls, one per command")]
struct Cli {
    /// The runtime's CRI socket.
    #[arg(long)]
    socket: PathBuf,
    /// Deadline of each call, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

/// What identifies a pod's configuration (a CreateContainer repeats it).
#[derive(clap::Args)]
struct Pod {
    /// The pod's name (also its uid).
    #[arg(long)]
    pod_name: String,
    /// Where the runtime writes the pod's container logs.
    #[arg(long)]
    log_dir: PathBuf,
    /// The pod's cgroup (cgroupfs path).
    #[arg(long, default_value = "")]
    cgroup_parent: String,
}

impl Pod {
    fn config(&self) -> v1::PodSandboxConfig {
        cri_client::host_network_pod(
            &self.pod_name,
            &self.pod_name,
            &self.log_dir,
            &self.cgroup_parent,
        )
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Version of the runtime.
    Version,
    /// RunPodSandbox of a host-network pod; prints its id.
    RunPod {
        #[command(flatten)]
        pod: Pod,
    },
    /// PullImage.
    Pull {
        #[command(flatten)]
        pod: Pod,
        image: String,
    },
    /// CreateContainer; prints its id.
    Create {
        pod_id: String,
        #[command(flatten)]
        pod: Pod,
        #[arg(long)]
        name: String,
        /// An image, or a checkpoint archive to restore.
        #[arg(long)]
        image: String,
        #[arg(long = "env")]
        envs: Vec<String>,
        /// HOST:CONTAINER bind mount.
        #[arg(long = "mount")]
        mounts: Vec<String>,
        /// HOST:CONTAINER device node.
        #[arg(long = "device")]
        devices: Vec<String>,
        /// A CDI device name (vendor.com/class=name).
        #[arg(long = "cdi")]
        cdi: Vec<String>,
        /// The command and its arguments.
        #[arg(last = true)]
        args: Vec<String>,
    },
    Start {
        id: String,
    },
    Stop {
        id: String,
    },
    Rm {
        id: String,
    },
    /// ContainerStatus: `STATE PID`.
    Status {
        id: String,
    },
    /// CheckpointContainer to ARCHIVE.
    Checkpoint {
        id: String,
        archive: PathBuf,
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    StopPod {
        pod_id: String,
    },
    RmPod {
        pod_id: String,
    },
}

fn split_pair(s: &str, what: &str) -> Result<(String, String), String> {
    s.split_once([':', '='])
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .ok_or_else(|| format!("{what} {s:?} is not A:B"))
}

fn run(cli: Cli) -> Result<(), String> {
    let cri =
        Cri::connect(&cli.socket, Duration::from_secs(cli.timeout)).map_err(|e| e.to_string())?;
    let e = |e: cri_client::Error| e.to_string();
    match cli.cmd {
        Cmd::Version => {
            let v = cri.version().map_err(e)?;
            println!(
                "{} {} (CRI {})",
                v.runtime_name, v.runtime_version, v.runtime_api_version
            );
        }
        Cmd::RunPod { pod } => println!("{}", cri.run_pod_sandbox(&pod.config()).map_err(e)?),
        Cmd::Pull { pod, image } => {
            println!("{}", cri.pull_image(&image, &pod.config()).map_err(e)?)
        }
        Cmd::Create {
            pod_id,
            pod,
            name,
            image,
            envs,
            mounts,
            devices,
            cdi,
            args,
        } => {
            let mut config = v1::ContainerConfig {
                metadata: Some(v1::ContainerMetadata {
                    name: name.clone(),
                    attempt: 0,
                }),
                image: Some(cri_client::image_spec(&image)),
                log_path: format!("{name}.log"),
                linux: Some(cri_client::pod_container_linux()),
                args,
                ..Default::default()
            };
            for kv in envs {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| format!("--env {kv:?} is not K=V"))?;
                config.envs.push(cri_client::env(k, v));
            }
            for m in mounts {
                let (host, ctr) = split_pair(&m, "--mount")?;
                config.mounts.push(v1::Mount {
                    host_path: host,
                    container_path: ctr,
                    ..Default::default()
                });
            }
            for d in devices {
                let (host, ctr) = split_pair(&d, "--device")?;
                config.devices.push(v1::Device {
                    host_path: host,
                    container_path: ctr,
                    permissions: "rwm".to_string(),
                });
            }
            for name in cdi {
                config.cdi_devices.push(v1::CdiDevice { name });
            }
            println!(
                "{}",
                cri.create_container(&pod_id, &config, &pod.config())
                    .map_err(e)?
            );
        }
        Cmd::Start { id } => cri.start_container(&id).map_err(e)?,
        Cmd::Stop { id } => cri
            .stop_container(&id, Duration::from_secs(10))
            .map_err(e)?,
        Cmd::Rm { id } => cri.remove_container(&id).map_err(e)?,
        Cmd::Status { id } => {
            let s = cri.container_status(&id).map_err(e)?;
            let state = s
                .status
                .as_ref()
                .and_then(|s| v1::ContainerState::try_from(s.state).ok())
                .map_or("UNKNOWN", |s| s.as_str_name());
            let pid = cri_client::status_pid(&s).unwrap_or(0);
            println!("{state} {pid}");
        }
        Cmd::Checkpoint {
            id,
            archive,
            timeout,
        } => cri
            .checkpoint_container(&id, &archive, Duration::from_secs(timeout))
            .map_err(e)?,
        Cmd::StopPod { pod_id } => cri.stop_pod_sandbox(&pod_id).map_err(e)?,
        Cmd::RmPod { pod_id } => cri.remove_pod_sandbox(&pod_id).map_err(e)?,
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("cri-client: {msg}");
            ExitCode::FAILURE
        }
    }
}
