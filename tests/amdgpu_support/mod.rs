//! Shared helpers of the AMD integration tests: temporary directories, topology fixtures,
//! a backend on the KFD simulator, and CRIU's hook sequences for dump and restore.

#![allow(dead_code)]

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use criu_gpu_core::amdgpu::AmdgpuBackend;
use criu_gpu_core::amdgpu::LocalFdStore;
use criu_gpu_core::amdgpu::device::AllocFlags;
use criu_gpu_core::amdgpu::device::KfdDevice;
use criu_gpu_core::amdgpu::guardian::QueueGuardFactory;
use criu_gpu_core::amdgpu::image::{ImageDir, KfdCheckpoint, ReadLimits, open_image_dir};
use criu_gpu_core::amdgpu::{BackendOptions, CopyObserver, CopyRecord};
use criu_gpu_core::backend::{GpuBackend, HookHandler, InitContext};
use criu_gpu_core::config::Config;
use criu_plugin::{HookError, Host, HostVersion, InventoryListing, Stage};
use kfd_sim::{CopyLog, Faults, ProcessSpec, SimKfd};

pub const MANIFEST_DIR: &str = env!("CARGO_MANIFEST_DIR");

/// A directory removed on drop: the one every test of the workspace uses.
pub use criu_gpu_test_support::TempDir;

/// A topology fixture of `tests/fixtures/kfd-topology`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(MANIFEST_DIR)
        .join("tests/fixtures/kfd-topology")
        .join(name)
}

/// Topology fixture `name` and a simulator of it.
pub fn fixture_sim(name: &str) -> (PathBuf, SimKfd) {
    let topo = fixture(name);
    let sim = SimKfd::from_sysfs(&topo).unwrap();
    (topo, sim)
}

/// Faults with the one `set` makes, as `sim.update_faults` takes them.
pub fn faults(set: impl FnOnce(&mut Faults)) -> Faults {
    let mut f = Faults::default();
    set(&mut f);
    f
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
        }
    }
}

/// An edit of a copied fixture.
pub enum Edit {
    /// New `gpu_id` of node N.
    GpuId(u32, u32),
    /// New value of property `key` of node N.
    Prop(u32, &'static str, u64),
}

/// A copy of fixture `name` with `edits` applied, in a temporary directory.
pub fn edited_fixture(name: &str, edits: &[Edit]) -> TempDir {
    let dir = TempDir::new("topo");
    copy_tree(&fixture(name), dir.path());
    for e in edits {
        match *e {
            Edit::GpuId(node, id) => {
                std::fs::write(
                    dir.path().join(format!("nodes/{node}/gpu_id")),
                    format!("{id}\n"),
                )
                .unwrap();
            }
            Edit::Prop(node, key, value) => {
                let p = dir.path().join(format!("nodes/{node}/properties"));
                let text = std::fs::read_to_string(&p).unwrap();
                let mut found = false;
                let out: Vec<String> = text
                    .lines()
                    .map(|l| {
                        if l.split_whitespace().next() == Some(key) {
                            found = true;
                            format!("{key} {value}")
                        } else {
                            l.to_string()
                        }
                    })
                    .collect();
                assert!(found, "no property {key} in {}", p.display());
                std::fs::write(&p, out.join("\n") + "\n").unwrap();
            }
        }
    }
    dir
}

/// Two topologies from the `2gpu` fixture whose GPUs differ (device ids): the checkpoint
/// machine's, and a restore machine that has them the other way round and with other gpu ids,
/// so that each GPU's state must go to the other node.
pub fn swapped_gpu_topologies() -> (TempDir, TempDir) {
    let ckpt = edited_fixture(
        "2gpu",
        &[
            Edit::Prop(1, "device_id", 29711),
            Edit::Prop(2, "device_id", 29600),
        ],
    );
    let rest = edited_fixture(
        "2gpu",
        &[
            Edit::Prop(1, "device_id", 29600),
            Edit::Prop(2, "device_id", 29711),
            Edit::GpuId(1, 0x1111),
            Edit::GpuId(2, 0x2222),
        ],
    );
    (ckpt, rest)
}

/// Settings text with the topology root and extra lines.
/// Parallel restore is on unless `extra` turns it off: most tests exercise the hand-over.
pub fn config(topology: &Path, extra: &str) -> Config {
    Config::parse(&format!(
        "amdgpu.topology = {}\namdgpu.parallel-restore = true\n{extra}",
        topology.display()
    ))
}

/// A backend on `sim`, writing images into `images`.
pub fn backend(sim: &SimKfd, images: &Path) -> AmdgpuBackend {
    backend_with(sim, images, None)
}

/// A backend on `sim` with an image quota.
pub fn backend_with(sim: &SimKfd, images: &Path, quota: Option<u64>) -> AmdgpuBackend {
    backend_observed(sim, images, quota, None)
}

/// A backend on `sim` with an image quota, telling `copies` of its BO content copies.
fn backend_observed(
    sim: &SimKfd,
    images: &Path,
    quota: Option<u64>,
    copies: Option<Arc<CopyLog>>,
) -> AmdgpuBackend {
    backend_guarded(sim, images, quota, copies, None)
}

/// A backend on `sim` whose dumps report their paused processes to `guard`.
pub fn backend_guarded(
    sim: &SimKfd,
    images: &Path,
    quota: Option<u64>,
    copies: Option<Arc<CopyLog>>,
    guard: Option<QueueGuardFactory>,
) -> AmdgpuBackend {
    init_log();
    let s = sim.clone();
    AmdgpuBackend::with_device_factory(
        Box::new(move || Ok(Arc::new(s.clone()) as Arc<dyn KfdDevice>)),
        BackendOptions {
            images_dir: Some(images.to_path_buf()),
            image_quota: quota,
            use_process_env: false,
            fdstore: Some(Arc::new(LocalFdStore::default())),
            copy_observer: copies.map(|c| c as Arc<dyn CopyObserver>),
            queue_guard: guard,
            restore_guardian: false,
        },
    )
}

pub fn ctx<'a>(cfg: &'a Config, host: HostVersion, listing: InventoryListing) -> InitContext<'a> {
    InitContext {
        host: Host::for_version(host),
        config: cfg,
        listing,
    }
}

/// Runs `b`'s init for `stage` as a CRIU `host` with `listing` would, which must take it on.
pub fn init_ok(
    b: &mut AmdgpuBackend,
    cfg: &Config,
    host: HostVersion,
    listing: InventoryListing,
    stage: Stage,
) {
    assert_eq!(b.init(&ctx(cfg, host, listing), stage), Ok(true));
}

/// A backend on `sim` writing or reading `images`, after an init that took it on.
pub fn started_backend(
    sim: &SimKfd,
    images: &Path,
    cfg: &Config,
    host: HostVersion,
    listing: InventoryListing,
    stage: Stage,
) -> AmdgpuBackend {
    let mut b = backend(sim, images);
    init_ok(&mut b, cfg, host, listing, stage);
    b
}

/// RESTORE_EXT_FILE of KFD file `id`, which must succeed; the fd it gives CRIU is closed.
pub fn restore_file(b: &mut AmdgpuBackend, id: u32) {
    let fd = b.restore_ext_file(id, None).unwrap();
    // SAFETY: a new fd from the hook, ours to close.
    drop(unsafe { OwnedFd::from_raw_fd(fd) });
}

/// The address of the `nth` BO with contents (VRAM or GTT) of process `pid`.
pub fn content_addr(sim: &SimKfd, pid: u32, nth: usize) -> u64 {
    sim.process(pid)
        .unwrap()
        .bos
        .iter()
        .filter(|b| AllocFlags::of(b.2).intersects(AllocFlags::WITH_CONTENTS))
        .nth(nth)
        .unwrap()
        .0
}

/// The process the failure tests dump: on both GPUs of `2gpu`, 40 BOs of mixed kinds up to
/// 2 MiB.
pub fn failure_spec(pid: u32) -> ProcessSpec {
    ProcessSpec::new(pid, &[53109, 1266]).with_mixed_bos(40, 2 << 20)
}

/// The KFD image of file `id` in `images`.
pub fn read_kfd(images: &Path, id: u32) -> KfdCheckpoint {
    let dir = open_image_dir(images).unwrap();
    ImageDir::new(dir.as_fd())
        .read_kfd(id, &ReadLimits::default())
        .unwrap()
}

/// Replaces the KFD image of file `id` in `images` with `k`.
pub fn write_kfd(images: &Path, id: u32, k: &KfdCheckpoint) {
    let dir = open_image_dir(images).unwrap();
    ImageDir::new(dir.as_fd()).write_kfd(id, k).unwrap();
}

/// A dumped process: its pid, CRIU file ids and the CPU mappings CRIU recorded.
pub struct Dumped {
    pub pid: u32,
    pub kfd_id: u32,
    pub render_ids: Vec<(u32, u32)>,
    pub vmas: Vec<kfd_sim::SimVma>,
}

/// A process of the simulator with its KFD fd and the render fds it opened.
pub struct Proc {
    pub pid: u32,
    pub kfd: OwnedFd,
    pub render: Vec<(u32, OwnedFd)>,
}

/// Spawns `spec` in `sim`, with one render-node fd per GPU it uses (as ROCm opens them).
pub fn spawn(sim: &SimKfd, spec: &ProcessSpec) -> Proc {
    let kfd = sim.spawn(spec).unwrap();
    let mut render = Vec::new();
    for &(_, actual) in &spec.gpus {
        let minor = sim
            .gpus()
            .iter()
            .find(|g| g.gpu_id == actual)
            .unwrap()
            .render_minor;
        render.push((minor, sim.open_render_node(minor).unwrap()));
    }
    Proc {
        pid: spec.pid,
        kfd,
        render,
    }
}

/// The simulator on topology `2gpu`, and process `pid` on both its GPUs with `bos` BOs of
/// mixed kinds up to `max_size` bytes: (topology, simulator, process).
pub fn two_gpu_process(pid: u32, bos: usize, max_size: u64) -> (PathBuf, SimKfd, Proc) {
    fixture_process("2gpu", pid, &[53109, 1266], bos, max_size)
}

/// The simulator on topology fixture `name`, and process `pid` on `gpus` with `bos` BOs of
/// mixed kinds up to `max_size` bytes: (topology, simulator, process).
pub fn fixture_process(
    name: &str,
    pid: u32,
    gpus: &[u32],
    bos: usize,
    max_size: u64,
) -> (PathBuf, SimKfd, Proc) {
    let (topo, sim) = fixture_sim(name);
    let p = spawn(
        &sim,
        &ProcessSpec::new(pid, gpus).with_mixed_bos(bos, max_size),
    );
    (topo, sim, p)
}

fn vma_stat(sim: &SimKfd, path: &str) -> libc::stat {
    match path.strip_prefix("/dev/dri/renderD") {
        Some(m) => sim.render_stat(m.parse().unwrap()),
        None => sim.kfd_stat(),
    }
}

/// CRIU's part of a dump for the processes `procs` (files numbered from `first_id`):
/// HANDLE_DEVICE_VMA for each device mapping, DUMP_EXT_FILE for the KFD fd and the render
/// fds. Stops at the first failing hook and returns its error.
pub fn dump_files(
    b: &mut AmdgpuBackend,
    sim: &SimKfd,
    procs: &[&Proc],
    first_id: u32,
) -> Result<Vec<Dumped>, HookError> {
    let mut id = first_id;
    let mut out = Vec::new();
    for p in procs {
        // CRIU seizes each task it dumps; amdkfd takes its CRIU operations for that.
        sim.seize(p.pid);
        let vmas = sim.cpu_vmas(p.pid);
        for v in &vmas {
            b.handle_device_vma(-1, &vma_stat(sim, &v.path))?;
        }
        let kfd_id = id;
        id += 1;
        b.dump_ext_file(p.kfd.as_raw_fd(), kfd_id)?;
        let mut render_ids = Vec::new();
        for (minor, fd) in &p.render {
            b.dump_ext_file(fd.as_raw_fd(), id)?;
            render_ids.push((id, *minor));
            id += 1;
        }
        out.push(Dumped {
            pid: p.pid,
            kfd_id,
            render_ids,
            vmas,
        });
    }
    Ok(out)
}

/// A backend initialised for a dump on a criu-dev host.
pub fn dump_backend(sim: &SimKfd, images: &Path, cfg: &Config) -> AmdgpuBackend {
    started_backend(
        sim,
        images,
        cfg,
        HostVersion::Dev,
        InventoryListing::NoList,
        Stage::Dump,
    )
}

/// A dump on a criu-dev host that a file of `procs` makes fail: init, the files up to the
/// failing one, exit with the failure. Returns the hook's error.
pub fn refused_dump(sim: &SimKfd, procs: &[&Proc], images: &Path, cfg: &Config) -> HookError {
    let mut b = dump_backend(sim, images, cfg);
    let Err(e) = dump_files(&mut b, sim, procs, 1) else {
        panic!("the dump should fail");
    };
    b.exit(Stage::Dump, -1);
    e
}

/// A whole dump on a criu-dev host: init, the files, DUMP_DEVICES_LATE, exit.
pub fn dump(sim: &SimKfd, procs: &[&Proc], images: &Path, cfg: &Config) -> Vec<Dumped> {
    let mut b = dump_backend(sim, images, cfg);
    let d = dump_files(&mut b, sim, procs, 10).expect("dump");
    b.dump_devices_late(procs[0].pid as i32)
        .expect("DUMP_DEVICES_LATE");
    b.exit(Stage::Dump, 0);
    d
}

/// A dump of `procs` on `sim` (topology `topo`, default settings) into a new image folder:
/// the folder and the dumped processes.
pub fn dump_new(topo: &Path, sim: &SimKfd, procs: &[&Proc], tag: &str) -> (TempDir, Vec<Dumped>) {
    let images = TempDir::new(tag);
    let dumped = dump(sim, procs, images.path(), &config(topo, ""));
    (images, dumped)
}

/// `dumped` restored from `images` into a fresh simulator of `topo` with default settings, in
/// CRIU's order, each process checked against the `original` one; returns the new simulator.
pub fn restore_fresh(original: &SimKfd, topo: &Path, dumped: &[Dumped], images: &Path) -> SimKfd {
    let sim = SimKfd::from_sysfs(topo).unwrap();
    restore(&sim, dumped, images, &config(topo, ""), false);
    for d in dumped {
        assert_same_process(original, &sim, d.pid);
    }
    sim
}

/// Restores the dumped processes `dumped` into `sim` through the restore hooks of a
/// criu-dev host (in CRIU's order: RESTORE_INIT, the files of each task, their mappings,
/// POST_FORKING, RESUME_DEVICES_LATE per task, exit). Checks every remapped mapping with
/// the simulator. Returns the backend's fds handed to CRIU, closed.
pub fn restore(
    sim: &SimKfd,
    dumped: &[Dumped],
    images: &Path,
    cfg: &Config,
    render_first: bool,
) -> Vec<CopyRecord> {
    restore_with(sim, dumped, images, cfg, render_first, || {})
}

/// [`restore`], calling `after_init` once the plugin's `init` returned (in CRIU's main
/// process, before any task is forked).
pub fn restore_with(
    sim: &SimKfd,
    dumped: &[Dumped],
    images: &Path,
    cfg: &Config,
    render_first: bool,
    after_init: impl FnOnce(),
) -> Vec<CopyRecord> {
    let copies = Arc::new(CopyLog::default());
    let mut b = backend_observed(sim, images, None, Some(copies.clone()));
    assert_eq!(
        b.init(
            &ctx(cfg, HostVersion::Dev, InventoryListing::Listed),
            Stage::Restore
        ),
        Ok(true)
    );
    after_init();
    b.restore_init().expect("RESTORE_INIT");
    for d in dumped {
        sim.set_current_task(d.pid);
        let mut ids: Vec<u32> = d.render_ids.iter().map(|r| r.0).collect();
        if render_first {
            ids.push(d.kfd_id);
        } else {
            ids.insert(0, d.kfd_id);
        }
        let mut fds = Vec::new();
        for id in ids {
            let mut retry = false;
            let fd = b
                .restore_ext_file(id, Some(&mut retry))
                .unwrap_or_else(|e| panic!("RESTORE_EXT_FILE {id}: {e:?}"));
            assert!(!retry);
            // SAFETY: the hook returned a new fd that CRIU would own.
            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        for v in &d.vmas {
            let path = std::ffi::CString::new(v.path.clone()).unwrap();
            let u = b
                .update_vma_map(&path, v.addr, v.pgoff)
                .unwrap_or_else(|e| panic!("UPDATE_VMA_MAP {v:?}: {e:?}"));
            // SAFETY: CRIU owns the returned fd and closes it after mapping.
            let plugin_fd = u.plugin_fd.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
            sim.check_vma(
                d.pid,
                &v.path,
                v.addr,
                u.new_pgoff,
                plugin_fd.as_ref().map(|f| f.as_fd()),
            )
            .unwrap_or_else(|e| panic!("mapping {v:?}: {e}"));
        }
        drop(fds);
    }
    match b.post_forking() {
        Ok(()) | Err(HookError::NotMine) => {}
        Err(e) => panic!("POST_FORKING: {e:?}"),
    }
    for d in dumped {
        b.resume_devices_late(d.pid as i32)
            .expect("RESUME_DEVICES_LATE");
    }
    b.exit(Stage::Restore, 0);
    copies.take()
}

/// Checks that process `pid` of `restored` is `pid` of `original`, resumed: same BOs
/// (addresses, sizes, kinds, user gpu ids), same queues, events and SVM ranges, contents
/// byte for byte.
pub fn assert_same_process(original: &SimKfd, restored: &SimKfd, pid: u32) {
    let a = original.process(pid).expect("original process");
    let b = restored.process(pid).expect("restored process");
    assert!(b.restored && !b.paused && !b.awaiting_resume, "{b:?}");
    assert_eq!(b.resumed, 1);
    let key = |v: &Vec<(u64, u64, u32, u32, u64)>| -> Vec<(u64, u64, u32, u32)> {
        v.iter().map(|&(a, s, f, g, _)| (a, s, f, g)).collect()
    };
    assert_eq!(key(&a.bos), key(&b.bos));
    assert_eq!(a.queues, b.queues);
    assert_eq!(a.events, b.events);
    assert_eq!(a.svm, b.svm);
    assert_eq!(a.xnack, b.xnack);
    let user_a: Vec<u32> = a.gpus.iter().map(|g| g.0).collect();
    let mut user_b: Vec<u32> = b.gpus.iter().map(|g| g.0).collect();
    user_b.sort_unstable();
    let mut ua = user_a.clone();
    ua.sort_unstable();
    assert_eq!(ua, user_b);
    let differ = original.compare_contents(pid, restored, pid).unwrap();
    assert!(
        differ.is_empty(),
        "BOs with different contents: {differ:x?}"
    );
}

/// Nothing of `sim` left open in this process: no dma-buf fds, no render or KFD fds beyond
/// `keep_render`/`keep_kfd` (the test's own), no GEM handle of the SDMA copy engine.
pub fn assert_no_leaks(sim: &SimKfd, keep_render: usize, keep_kfd: usize) {
    assert_eq!(sim.gem_objects(), 0, "SDMA engine GEM objects leaked");
    assert_eq!(sim.open_fds("dmabuf"), 0, "dma-buf fds leaked");
    assert_eq!(sim.open_fds("render"), keep_render, "render fds leaked");
    assert_eq!(sim.open_fds("kfd"), keep_kfd, "KFD fds leaked");
}

struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        eprintln!("{:5} {}", r.level(), r.args());
    }
    fn flush(&self) {}
}

/// Logs to stderr when `AMDGPU_TEST_LOG` is set (run the tests with `--nocapture`).
pub fn init_log() {
    static L: StderrLog = StderrLog;
    if std::env::var_os("AMDGPU_TEST_LOG").is_some() && log::set_logger(&L).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
}
