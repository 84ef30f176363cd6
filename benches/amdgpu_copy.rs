//! Throughput of the AMD backend's BO content pipeline on the KFD simulator, next to this
//! machine's plain memory-to-file and file-to-memory bandwidth, measured in the same run on
//! the same filesystem.
//!
//! ```text
//! cargo bench --bench amdgpu_copy
//! ```
//!
//! A simulated process with 64 VRAM BOs of 32 MiB (2 GiB) on two GPUs is dumped through the
//! backend's `DUMP_EXT_FILE` (PROCESS_INFO, CHECKPOINT, BO copy into the two pages files,
//! image) and restored through `RESTORE_EXT_FILE` (copy in the task) with 1, 2, 4 and 8
//! copy threads. The baselines write the same 2 GiB from memory to one file in the same
//! directory with a plain loop of `write`s from one thread, and read it back the same way;
//! each is the best of 1, 4 and 8 MiB calls. Every run starts after `sync()` with the
//! previous files deleted and with memory warmed (see `warm_memory`); `fsync` is not part of
//! any measurement (CRIU does not fsync images). Each figure is the median of
//! `AMDGPU_BENCH_REPS` runs (default 3).
//!
//! Environment: `AMDGPU_BENCH_MIB` (total size, default 2048), `AMDGPU_BENCH_CHUNK` and
//! `AMDGPU_BENCH_STAGING` (`amdgpu.chunk-size`, `amdgpu.max-buffer-size`), `AMDGPU_BENCH_DIR`
//! (directory, default the target directory's tmp); `AMDGPU_BENCH_PROFILE=dump|restore` runs
//! only that, five times with `AMDGPU_BENCH_THREADS` threads (default 4), printing where the
//! copy spends its time (for `perf record`).
//!
//! The output ends with a markdown table for `docs/performance.md`.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criu_gpu_core::amdgpu::device::{AllocFlags, KfdDevice};
use criu_gpu_core::amdgpu::{AmdgpuBackend, BackendOptions, CopyObserver};
use criu_gpu_core::backend::{GpuBackend, HookHandler, InitContext};
use criu_gpu_core::config::Config;
use criu_plugin::{Host, HostVersion, InventoryListing, Stage};
use kfd_sim::{BoSpec, CopyLog, ProcessSpec, SimKfd};

const BOS: usize = 64;
const PID: u32 = 4000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn gib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / d.as_secs_f64()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn median_sample(v: &[Sample]) -> Sample {
    Sample {
        hook: median(v.iter().map(|s| s.hook).collect()),
        copy: median(v.iter().map(|s| s.copy).collect()),
    }
}

fn sync() {
    // SAFETY: sync has no arguments and no failure mode.
    unsafe { libc::sync() };
}

/// Touches and frees `bytes` of memory right before a measurement. On a VM whose host
/// discards the guest's free pages (free page reporting), the first touch of such a page
/// costs far more than the copy being measured (a plain 2 GiB write runs at 0.6 GB/s when
/// its page cache lands on such pages, at 3 GB/s right after): warming makes every
/// measurement start from the same, recently used memory.
fn warm_memory(bytes: usize) {
    // SAFETY: a private anonymous mapping, touched and unmapped here only.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let p = p.cast::<u8>();
        for off in (0..bytes).step_by(4096) {
            p.add(off).write_volatile(1);
        }
        libc::munmap(p.cast(), bytes);
    }
}

fn clear_dir(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let _ = std::fs::remove_file(e.unwrap().path());
    }
    sync();
}

fn backend(sim: &SimKfd, images: &Path, copies: &Arc<CopyLog>) -> AmdgpuBackend {
    let s = sim.clone();
    AmdgpuBackend::with_device_factory(
        Box::new(move || Ok(Arc::new(s.clone()) as Arc<dyn KfdDevice>)),
        BackendOptions {
            images_dir: Some(images.to_path_buf()),
            copy_observer: Some(copies.clone() as Arc<dyn CopyObserver>),
            ..Default::default()
        },
    )
}

fn config(topo: &Path, threads: usize) -> Config {
    let mut extra = String::new();
    if let Ok(c) = std::env::var("AMDGPU_BENCH_CHUNK") {
        extra.push_str(&format!("amdgpu.chunk-size = {c}\n"));
    }
    if let Ok(c) = std::env::var("AMDGPU_BENCH_STAGING") {
        extra.push_str(&format!("amdgpu.max-buffer-size = {c}\n"));
    }
    Config::parse(&format!(
        "amdgpu.topology = {}\namdgpu.copy-threads = {threads}\namdgpu.parallel-restore = false\n{extra}",
        topo.display()
    ))
}

fn ctx(cfg: &Config, listing: InventoryListing) -> InitContext<'_> {
    InitContext {
        host: Host::for_version(HostVersion::Dev),
        config: cfg,
        listing,
    }
}

/// Time a hook took and time its BO copy pipeline took.
#[derive(Clone, Copy)]
struct Sample {
    hook: Duration,
    copy: Duration,
}

fn copy_time(copies: &CopyLog) -> Duration {
    let copies = copies.take();
    if std::env::var_os("AMDGPU_BENCH_PROFILE").is_some() {
        for c in &copies {
            eprintln!(
                "  copy {:.3} s, fill busy {:.3} s, drain busy {:.3} s, {} threads, {} MiB staging",
                c.stats.elapsed.as_secs_f64(),
                c.stats.fill_busy.as_secs_f64(),
                c.stats.drain_busy.as_secs_f64(),
                c.stats.threads,
                c.stats.staging_bytes >> 20
            );
        }
    }
    copies.iter().map(|c| c.stats.elapsed).sum()
}

/// One dump of the process; returns the time `DUMP_EXT_FILE` took.
fn dump_once(sim: &SimKfd, kfd: &OwnedFd, images: &Path, cfg: &Config) -> Sample {
    let copies = Arc::new(CopyLog::default());
    let mut b = backend(sim, images, &copies);
    assert!(
        b.init(&ctx(cfg, InventoryListing::NoList), Stage::Dump)
            .unwrap()
    );
    let t = Instant::now();
    b.dump_ext_file(kfd.as_raw_fd(), 1).expect("dump");
    let took = t.elapsed();
    b.dump_devices_late(PID as i32).unwrap();
    b.exit(Stage::Dump, 0);
    Sample {
        hook: took,
        copy: copy_time(&copies),
    }
}

/// One restore into a fresh simulated machine; returns the time `RESTORE_EXT_FILE` took.
fn restore_once(topo: &Path, images: &Path, cfg: &Config, check: Option<&SimKfd>) -> Sample {
    let sim = SimKfd::from_sysfs(topo).unwrap();
    sim.set_current_task(PID);
    let copies = Arc::new(CopyLog::default());
    let mut b = backend(&sim, images, &copies);
    assert!(
        b.init(&ctx(cfg, InventoryListing::Listed), Stage::Restore)
            .unwrap()
    );
    let t = Instant::now();
    let fd = b.restore_ext_file(1, None).expect("restore");
    let took = t.elapsed();
    // SAFETY: a new fd from the hook, ours to close.
    drop(unsafe { OwnedFd::from_raw_fd(fd) });
    b.resume_devices_late(PID as i32).unwrap();
    b.exit(Stage::Restore, 0);
    if let Some(orig) = check {
        assert!(orig.compare_contents(PID, &sim, PID).unwrap().is_empty());
    }
    Sample {
        hook: took,
        copy: copy_time(&copies),
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument would be the next one.
    let total_mib = env_u64("AMDGPU_BENCH_MIB", 2048);
    let reps = env_u64("AMDGPU_BENCH_REPS", 3).max(1) as usize;
    let bo_size = (total_mib << 20) / BOS as u64;
    let bo_size = bo_size / 4096 * 4096;
    let total = bo_size * BOS as u64;
    let root = std::env::var_os("AMDGPU_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")))
        .join(format!("amdgpu-bench-{}", std::process::id()));
    let images = root.join("images");
    std::fs::create_dir_all(&images).unwrap();
    let topo = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kfd-topology/2gpu");

    eprintln!(
        "amdgpu_copy: {BOS} BOs of {} MiB ({} MiB) on 2 simulated GPUs, {reps} run(s) each, in {}",
        bo_size >> 20,
        total >> 20,
        root.display()
    );
    let sim = SimKfd::from_sysfs(&topo).unwrap();
    let mut spec = ProcessSpec::new(PID, &[53109, 1266]);
    spec.bos = (0..BOS)
        .map(|i| BoSpec {
            gpu: i % 2,
            size: bo_size,
            flags: (AllocFlags::VRAM | AllocFlags::WRITABLE).bits(),
        })
        .collect();
    let kfd = sim.spawn(&spec).unwrap();
    // The bench plays CRIU, which traces the task it dumps.
    sim.seize(PID);

    // Baselines: the same bytes from memory to one file and back, 8 MiB per call.
    let mut mem = vec![0u8; total as usize];
    for (i, c) in mem.chunks_mut(4096).enumerate() {
        c.fill(i as u8);
    }
    let plain = root.join("plain.img");
    let warm = total as usize + (512 << 20);
    // The baseline is the best of three call sizes, so that it is not handicapped by one.
    let baseline = |mem: &mut Vec<u8>| -> (Duration, Duration) {
        let (mut w, mut r) = (Duration::MAX, Duration::MAX);
        for chunk in [1 << 20, 4 << 20, 8 << 20] {
            let _ = std::fs::remove_file(&plain);
            sync();
            warm_memory(warm);
            let t = Instant::now();
            let mut f = std::fs::File::create(&plain).unwrap();
            for c in mem.chunks(chunk) {
                f.write_all(c).unwrap();
            }
            drop(f);
            w = w.min(t.elapsed());
            sync();
            warm_memory(warm);
            let t = Instant::now();
            let mut f = std::fs::File::open(&plain).unwrap();
            for c in mem.chunks_mut(chunk) {
                f.read_exact(c).unwrap();
            }
            r = r.min(t.elapsed());
        }
        let _ = std::fs::remove_file(&plain);
        (w, r)
    };
    let threads_list = [1usize, 2, 4, 8];
    // `AMDGPU_BENCH_PROFILE=dump|restore`: only that, five times with 4 threads (for perf).
    if let Ok(what) = std::env::var("AMDGPU_BENCH_PROFILE") {
        let cfg = config(&topo, env_u64("AMDGPU_BENCH_THREADS", 4) as usize);
        clear_dir(&images);
        dump_once(&sim, &kfd, &images, &cfg);
        for _ in 0..5 {
            let s = if what == "dump" {
                clear_dir(&images);
                dump_once(&sim, &kfd, &images, &cfg)
            } else {
                restore_once(&topo, &images, &cfg, None)
            };
            eprintln!("{what}: {:.2} GiB/s", gib_s(total, s.hook));
        }
        let _ = std::fs::remove_dir_all(&root);
        return;
    }
    // Warm-up, not measured: on a VM the first touch of guest memory (page cache included)
    // is far slower than any later use.
    baseline(&mut mem);
    {
        let cfg = config(&topo, 4);
        clear_dir(&images);
        dump_once(&sim, &kfd, &images, &cfg);
        restore_once(&topo, &images, &cfg, Some(&sim));
    }
    let mut w = Vec::new();
    let mut r = Vec::new();
    let mut d = vec![Vec::new(); threads_list.len()];
    let mut rs = vec![Vec::new(); threads_list.len()];
    // Rounds interleave the baselines with the pipeline runs, so that machine noise hits
    // both alike.
    for _ in 0..reps {
        let (bw, br) = baseline(&mut mem);
        w.push(bw);
        r.push(br);
        for (k, &threads) in threads_list.iter().enumerate() {
            let cfg = config(&topo, threads);
            clear_dir(&images);
            warm_memory(warm);
            d[k].push(dump_once(&sim, &kfd, &images, &cfg));
            sync();
            warm_memory(warm);
            rs[k].push(restore_once(&topo, &images, &cfg, None));
        }
    }
    drop(mem);
    let best = |v: &[Duration]| v.iter().copied().min().expect("at least one run");
    let (write, read) = (median(w.clone()), median(r.clone()));
    let (write_best, read_best) = (best(&w), best(&r));
    eprintln!(
        "plain write {:.2} GiB/s (best {:.2}), plain read {:.2} GiB/s (best {:.2})",
        gib_s(total, write),
        gib_s(total, write_best),
        gib_s(total, read),
        gib_s(total, read_best)
    );
    struct Row {
        threads: usize,
        dump: Sample,
        dump_best: Duration,
        restore: Sample,
        restore_best: Duration,
    }
    let mut rows = Vec::new();
    for (k, &threads) in threads_list.iter().enumerate() {
        let (dd, rr) = (median_sample(&d[k]), median_sample(&rs[k]));
        let db: Vec<Duration> = d[k].iter().map(|s| s.hook).collect();
        let rb: Vec<Duration> = rs[k].iter().map(|s| s.hook).collect();
        eprintln!(
            "{threads} thread(s): dump {:.2} GiB/s (copy alone {:.2}), restore {:.2} GiB/s (copy alone {:.2})",
            gib_s(total, dd.hook),
            gib_s(total, dd.copy),
            gib_s(total, rr.hook),
            gib_s(total, rr.copy)
        );
        rows.push(Row {
            threads,
            dump: dd,
            dump_best: best(&db),
            restore: rr,
            restore_best: best(&rb),
        });
    }
    clear_dir(&images);
    let _ = std::fs::remove_dir_all(&root);

    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let pct = |base: Duration, t: Duration| 100.0 * base.as_secs_f64() / t.as_secs_f64();
    println!();
    println!(
        "BO contents through the AMD backend on the KFD simulator: {BOS} BOs × {} MiB = {} MiB on 2 GPUs, {cpus} CPU(s), \
         {reps} runs each: median (best). Dump and restore are the whole DUMP_EXT_FILE / RESTORE_EXT_FILE hooks \
         (the BO copy is over 99 % of them); ratios against the plain loops of the same runs, median to median (best to best).",
        bo_size >> 20,
        total >> 20
    );
    println!();
    println!(
        "| copy threads | dump GiB/s | dump ÷ plain write | restore GiB/s | restore ÷ plain write | restore ÷ plain read |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    println!(
        "| plain write, memory → file, 1 thread | {:.2} ({:.2}) | 100 % | | | |",
        gib_s(total, write),
        gib_s(total, write_best)
    );
    println!(
        "| plain read, file → memory, 1 thread | | | {:.2} ({:.2}) | | 100 % |",
        gib_s(total, read),
        gib_s(total, read_best)
    );
    for row in rows {
        println!(
            "| {} | {:.2} ({:.2}) | {:.0} % ({:.0} %) | {:.2} ({:.2}) | {:.0} % ({:.0} %) | {:.0} % ({:.0} %) |",
            row.threads,
            gib_s(total, row.dump.hook),
            gib_s(total, row.dump_best),
            pct(write, row.dump.hook),
            pct(write_best, row.dump_best),
            gib_s(total, row.restore.hook),
            gib_s(total, row.restore_best),
            pct(write, row.restore.hook),
            pct(write_best, row.restore_best),
            pct(read, row.restore.hook),
            pct(read_best, row.restore_best),
        );
    }
}
