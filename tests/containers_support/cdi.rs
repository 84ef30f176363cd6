//! NVIDIA GPUs as a GPU node hands them to containers: the NVIDIA Container Toolkit describes
//! them in a CDI spec (`nvidia.com/gpu=<index>` or `=<UUID>`), and the engine (containerd 2.x
//! for CRI CDI device names, or a test itself here) turns the requested devices' edits into the
//! container's OCI spec: device nodes (`linux.devices` and their device cgroup rules), the
//! driver's libraries bind-mounted from the host, `createContainer` hooks, environment.
//!
//! This machine has no GPU, so the host side is stand-ins under the test's directory: device
//! nodes made with mknod(2) (`nvidia<N>` as NVIDIA's 195:<N>, `nvidiactl`, `nvidia-modeset`,
//! `nvidia-uvm`(-tools) on a free dynamic major, as the real uvm module gets one), a
//! `/proc/driver/nvidia/gpus` listing with each GPU's `Device Minor`, and a stand-in
//! `nvidia-cdi-hook` that logs its arguments. The stand-in CUDA driver
//! (`tests/fixtures/fake-cuda/gpu_nodes.c`) opens those nodes inside the container the way the
//! real one does, so the container's `/dev` and device cgroup decide which GPUs it has.
//!
//! [`NvidiaCdi::write_spec`] writes the spec where an engine reads CDI specs (`/etc/cdi`,
//! `/var/run/cdi`); [`NvidiaCdi::oci_edits`] is the edits a CDI-aware engine applies for a set of
//! device names, for tests that drive runc directly.

use std::path::{Path, PathBuf};

use super::FakeCuda;
use super::oci::json_str;

/// The GPUs the stand-in driver says a container's workload (its `/out` at `out`) has, as
/// `(uuid, minor)`: those whose node it could open.
pub fn workload_gpus(out: &Path) -> Vec<(String, u32)> {
    std::fs::read_to_string(out.join(format!("dev/gpus.{}", super::INIT_PID)))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (u, m) = l.split_once(' ')?;
            Some((u.to_string(), m.parse().ok()?))
        })
        .collect()
}

/// Major number of NVIDIA's GPU device nodes.
pub const NVIDIA_MAJOR: u32 = 195;

/// One stand-in GPU: its index (`nvidia.com/gpu=<index>`, device minor), UUID, model, bus.
#[derive(Clone, Debug)]
pub struct StandInGpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub bus: String,
}

/// The stand-in GPUs of a test, their host files and the CDI spec for them.
pub struct NvidiaCdi {
    /// The host's device nodes (the plugin's `cuda.nvidia-dev`).
    pub dev_dir: PathBuf,
    /// The host's `/proc/driver/nvidia/gpus` (the plugin's `cuda.nvidia-proc`).
    pub proc_dir: PathBuf,
    pub gpus: Vec<StandInGpu>,
    /// The stand-in `nvidia-cdi-hook` and the file it logs its calls to.
    pub hook: PathBuf,
    pub hook_log: PathBuf,
    /// Driver libraries: host path, path in the container.
    pub libraries: Vec<(PathBuf, String)>,
}

/// A character major that no driver of this machine has (the uvm module's is dynamic).
fn free_char_major() -> u32 {
    let text = std::fs::read_to_string("/proc/devices").expect("/proc/devices");
    let chars = text
        .split("Block devices:")
        .next()
        .unwrap_or_default()
        .to_string();
    let used: Vec<u32> = chars
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    (384..512)
        .rev()
        .find(|m| !used.contains(m))
        .expect("a free character major")
}

fn mknod(path: &Path, major: u32, minor: u32) {
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.to_str().expect("UTF-8 path")).expect("no NUL");
    // SAFETY: `c` is a NUL-terminated path; mknod(2) creates a node there and touches nothing else.
    let r = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major, minor),
        )
    };
    assert_eq!(
        r,
        0,
        "mknod {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: as above; chmod(2) of the node just made (mknod applies the umask).
    unsafe { libc::chmod(c.as_ptr(), 0o666) };
}

/// `(major, minor)` of a device node.
pub fn rdev_of(path: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .rdev();
    (libc::major(rdev), libc::minor(rdev))
}

impl NvidiaCdi {
    /// Stand-ins under `dir` for GPUs `gpus` (UUID, model; index = position), the driver's
    /// `libraries` (host path, path in the container).
    pub fn new(dir: &Path, gpus: &[(String, String)], libraries: Vec<(PathBuf, String)>) -> Self {
        let dev_dir = dir.join("dev");
        let proc_dir = dir.join("proc-driver-nvidia-gpus");
        std::fs::create_dir_all(&dev_dir).expect("stand-in /dev");
        let gpus: Vec<StandInGpu> = gpus
            .iter()
            .enumerate()
            .map(|(i, (uuid, model))| StandInGpu {
                index: i as u32,
                uuid: uuid.clone(),
                model: model.clone(),
                bus: format!("0000:00:{:02x}.0", 6 + i),
            })
            .collect();
        for g in &gpus {
            mknod(
                &dev_dir.join(format!("nvidia{}", g.index)),
                NVIDIA_MAJOR,
                g.index,
            );
            let info = proc_dir.join(&g.bus);
            std::fs::create_dir_all(&info).expect("GPU listing");
            std::fs::write(
                info.join("information"),
                format!(
                    "Model: \t\t {}\nIRQ:   \t\t 42\nGPU UUID: \t {}\nVideo BIOS: \t \
                     96.00.00.00.00\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t \
                     0xfffffffffffff\nBus Location: \t {}\nDevice Minor: \t {}\nGPU Excluded:\t No\n",
                    g.model, g.uuid, g.bus, g.index
                ),
            )
            .expect("GPU information");
        }
        mknod(&dev_dir.join("nvidiactl"), NVIDIA_MAJOR, 255);
        mknod(&dev_dir.join("nvidia-modeset"), NVIDIA_MAJOR, 254);
        let uvm = free_char_major();
        mknod(&dev_dir.join("nvidia-uvm"), uvm, 0);
        mknod(&dev_dir.join("nvidia-uvm-tools"), uvm, 1);
        let hook = dir.join("nvidia-cdi-hook");
        let hook_log = dir.join("nvidia-cdi-hook.log");
        std::fs::write(
            &hook,
            format!(
                "#!/bin/sh\n# Stand-in for the NVIDIA Container Toolkit's hook: logs its call.\n\
                 echo \"$*\" >> '{}'\n",
                hook_log.display()
            ),
        )
        .expect("hook");
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).expect("hook");
        }
        NvidiaCdi {
            dev_dir,
            proc_dir,
            gpus,
            hook,
            hook_log,
            libraries,
        }
    }

    /// The plugin's settings for a host of these GPUs (`gpu-plugin.conf` at `path`): the
    /// stand-in driver and NVML of `f`, the GPU listing and the host's device nodes.
    pub fn write_plugin_settings(&self, f: &FakeCuda, path: &Path) {
        std::fs::write(
            path,
            format!(
                "libcuda = {}\nnvml = {}\ncuda.nvidia-proc = {}\ncuda.nvidia-dev = {}\n",
                f.libcuda.display(),
                f.nvml.display(),
                self.proc_dir.display(),
                self.dev_dir.display()
            ),
        )
        .expect("settings");
    }

    /// The environment of the stand-in CUDA workload on these GPUs in a container: the
    /// stand-in driver models them all, and finds their nodes in the container's `/dev`.
    pub fn workload_env(&self) -> [String; 2] {
        [
            format!("FAKE_CUDA_GPUS={}", self.gpus.len()),
            "FAKE_CUDA_NODE_DIR=/dev".into(),
        ]
    }

    /// Takes the `Device Minor` lines out of the GPU listing (as in a listing the plugin cannot
    /// tie to device nodes): every GPU then counts as reachable.
    pub fn hide_minors(&self) {
        for g in &self.gpus {
            let p = self.proc_dir.join(&g.bus).join("information");
            let text = std::fs::read_to_string(&p).expect("GPU information");
            let kept: Vec<&str> = text
                .lines()
                .filter(|l| !l.starts_with("Device Minor"))
                .collect();
            std::fs::write(&p, kept.join("\n") + "\n").expect("GPU information");
        }
    }

    fn node(&self, name: &str) -> String {
        format!(
            r#"{{"path": {}, "hostPath": {}}}"#,
            json_str(&format!("/dev/{name}")),
            json_str(self.dev_dir.join(name).to_str().expect("UTF-8 path"))
        )
    }

    /// The CDI spec as the NVIDIA Container Toolkit writes one (`nvidia-ctk cdi generate`):
    /// kind `nvidia.com/gpu`, one device per GPU under its index and under its UUID, and the
    /// edits every GPU needs (control nodes, libraries, hooks) at the spec's level.
    pub fn spec_json(&self) -> String {
        self.spec_json_of(&self.gpus)
    }

    /// [`NvidiaCdi::spec_json`] for a host that has `gpus` (some of these GPUs) only.
    pub fn spec_json_of(&self, gpus: &[StandInGpu]) -> String {
        let mut devices = Vec::new();
        for g in gpus {
            for name in [g.index.to_string(), g.uuid.clone()] {
                devices.push(format!(
                    r#"    {{"name": {}, "containerEdits": {{"deviceNodes": [{}]}}}}"#,
                    json_str(&name),
                    self.node(&format!("nvidia{}", g.index))
                ));
            }
        }
        let nodes: Vec<String> = [
            "nvidia-modeset",
            "nvidia-uvm",
            "nvidia-uvm-tools",
            "nvidiactl",
        ]
        .iter()
        .map(|n| self.node(n))
        .collect();
        let mounts: Vec<String> = self
            .libraries
            .iter()
            .map(|(host, inside)| {
                format!(
                    r#"{{"hostPath": {}, "containerPath": {}, "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}}"#,
                    json_str(host.to_str().expect("UTF-8 path")),
                    json_str(inside)
                )
            })
            .collect();
        let hooks: Vec<String> = self
            .hook_args()
            .iter()
            .map(|args| {
                let all: Vec<String> = args.iter().map(|a| json_str(a)).collect();
                format!(
                    r#"{{"hookName": "createContainer", "path": {}, "args": [{}], "env": ["NVIDIA_CTK_DEBUG=false"]}}"#,
                    json_str(self.hook.to_str().expect("UTF-8 path")),
                    all.join(", ")
                )
            })
            .collect();
        format!(
            r#"{{
  "cdiVersion": "0.5.0",
  "kind": "nvidia.com/gpu",
  "devices": [
{}
  ],
  "containerEdits": {{
    "env": ["NVIDIA_VISIBLE_DEVICES=void"],
    "deviceNodes": [{}],
    "mounts": [{}],
    "hooks": [{}]
  }}
}}
"#,
            devices.join(",\n"),
            nodes.join(", "),
            mounts.join(", "),
            hooks.join(", ")
        )
    }

    /// The arguments of the toolkit's `createContainer` hooks (the program's name first).
    fn hook_args(&self) -> Vec<Vec<String>> {
        let mut hooks = Vec::new();
        let lib_dir = self
            .libraries
            .first()
            .and_then(|(_, inside)| Some(Path::new(inside).parent()?.to_str()?.to_string()));
        if let Some(d) = lib_dir {
            hooks.push(vec![
                "create-symlinks".into(),
                "--link".into(),
                format!("libcuda.so.1::{d}/libcuda.so"),
            ]);
            hooks.push(vec!["update-ldcache".into(), "--folder".into(), d]);
        }
        hooks.push(vec!["disable-device-node-modification".into()]);
        for h in &mut hooks {
            h.insert(0, "nvidia-cdi-hook".into());
        }
        hooks
    }

    /// Writes [`NvidiaCdi::spec_json`] as `dir/nvidia.json` (for `/etc/cdi` or `/var/run/cdi`).
    pub fn write_spec(&self, dir: &Path) -> PathBuf {
        self.write_spec_of(dir, &self.gpus)
    }

    /// Writes [`NvidiaCdi::spec_json_of`] `gpus` as `dir/nvidia.json`.
    pub fn write_spec_of(&self, dir: &Path, gpus: &[StandInGpu]) -> PathBuf {
        std::fs::create_dir_all(dir).expect("CDI directory");
        let p = dir.join("nvidia.json");
        std::fs::write(&p, self.spec_json_of(gpus)).expect("CDI spec");
        p
    }

    /// The OCI edits CDI injection gives for `nvidia.com/gpu=<name>` of each of `names` (index
    /// or UUID): the spec's common edits once, then each device's; each device node with the
    /// type, numbers and mode of its host node and the `rwm` cgroup rule.
    pub fn oci_edits(&self, names: &[&str]) -> OciEdits {
        let mut e = OciEdits::no_devices();
        if names.is_empty() {
            return e;
        }
        e.env.push("NVIDIA_VISIBLE_DEVICES=void".into());
        let mut node_names: Vec<String> = [
            "nvidia-modeset",
            "nvidia-uvm",
            "nvidia-uvm-tools",
            "nvidiactl",
        ]
        .map(String::from)
        .to_vec();
        for n in names {
            let g = self
                .gpus
                .iter()
                .find(|g| g.index.to_string() == *n || g.uuid == *n)
                .unwrap_or_else(|| panic!("no CDI device nvidia.com/gpu={n}"));
            node_names.push(format!("nvidia{}", g.index));
        }
        for n in node_names {
            let (major, minor) = rdev_of(&self.dev_dir.join(&n));
            e.devices.push(DeviceNode {
                path: format!("/dev/{n}"),
                major,
                minor,
                mode: 0o666,
            });
        }
        for (host, inside) in &self.libraries {
            e.mounts.push((host.clone(), inside.clone()));
        }
        for args in self.hook_args() {
            e.hooks.push((self.hook.clone(), args));
        }
        e
    }
}

/// One device node of a container (`linux.devices`, allowed `rwm` in its device cgroup).
#[derive(Clone, Debug)]
pub struct DeviceNode {
    pub path: String,
    pub major: u32,
    pub minor: u32,
    pub mode: u32,
}

/// What a container's OCI spec gets beyond the harness's own (`oci::config_json`).
#[derive(Clone, Debug, Default)]
pub struct OciEdits {
    /// More `process.env` entries.
    pub env: Vec<String>,
    pub devices: Vec<DeviceNode>,
    /// Read-only bind mounts: host path, path in the container.
    pub mounts: Vec<(PathBuf, String)>,
    /// `createContainer` hooks: program, arguments (its name first).
    pub hooks: Vec<(PathBuf, Vec<String>)>,
    /// The device cgroup denies what is not allowed (as every engine's default spec does).
    pub restrict_devices: bool,
}

impl OciEdits {
    /// A container given no device: its device cgroup allows only the runtime's defaults.
    pub fn no_devices() -> OciEdits {
        OciEdits {
            restrict_devices: true,
            ..OciEdits::default()
        }
    }

    /// Entries of `mounts`, each starting with a comma.
    pub fn mounts_json(&self) -> String {
        self.mounts
            .iter()
            .map(|(host, inside)| {
                format!(
                    r#",
    {{"destination": {}, "type": "bind", "source": {}, "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}}"#,
                    json_str(inside),
                    json_str(host.to_str().expect("UTF-8 path"))
                )
            })
            .collect()
    }

    /// Members of `linux` (`devices`, `resources`), each starting with a comma.
    pub fn linux_json(&self) -> String {
        if !self.restrict_devices {
            return String::new();
        }
        let devices: Vec<String> = self
            .devices
            .iter()
            .map(|d| {
                format!(
                    r#"{{"path": {}, "type": "c", "major": {}, "minor": {}, "fileMode": {}, "uid": 0, "gid": 0}}"#,
                    json_str(&d.path),
                    d.major,
                    d.minor,
                    d.mode
                )
            })
            .collect();
        let mut rules = vec![r#"{"allow": false, "access": "rwm"}"#.to_string()];
        rules.extend(self.devices.iter().map(|d| {
            format!(
                r#"{{"allow": true, "type": "c", "major": {}, "minor": {}, "access": "rwm"}}"#,
                d.major, d.minor
            )
        }));
        format!(
            r#",
    "devices": [{}],
    "resources": {{"devices": [{}]}}"#,
            devices.join(", "),
            rules.join(", ")
        )
    }

    /// The spec's top-level `hooks` member, starting with a comma (empty when none).
    pub fn hooks_json(&self) -> String {
        if self.hooks.is_empty() {
            return String::new();
        }
        let hooks: Vec<String> = self
            .hooks
            .iter()
            .map(|(path, args)| {
                let args: Vec<String> = args.iter().map(|a| json_str(a)).collect();
                format!(
                    r#"{{"path": {}, "args": [{}], "env": ["NVIDIA_CTK_DEBUG=false"]}}"#,
                    json_str(path.to_str().expect("UTF-8 path")),
                    args.join(", ")
                )
            })
            .collect();
        format!(
            r#",
  "hooks": {{"createContainer": [{}]}}"#,
            hooks.join(", ")
        )
    }
}

/// The plugin's refusal, in CRIU's log of `restore`, of a restore whose container can reach no
/// GPU: it names the checkpoint's GPU `uuid`, says none is reachable because of the device
/// cgroup, and came before CRIU forked any task.
pub fn assert_refused_without_gpu(restore: &crate::common::CriuRun, uuid: &str) {
    let refusal = restore
        .lines_with("gpu_plugin")
        .into_iter()
        .find(|l| l.contains("cannot restore"))
        .unwrap_or_else(|| panic!("no refusal of the plugin: {restore:?}"))
        .to_string();
    for needle in [
        uuid,
        "has no counterpart",
        "GPUs reachable here: none",
        "refused by the device cgroup",
    ] {
        assert!(refusal.contains(needle), "{needle:?} not in {refusal}");
    }
    assert!(
        !restore.has("Forking task"),
        "CRIU forked tasks before the refusal: {restore:?}"
    );
}
