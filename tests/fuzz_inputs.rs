//! Structured mutations of every file the plugin reads, run for a bounded time in CI: the
//! settings file, `gpu-plugin-cuda.img`, CRIU's `pstree.img`, and the AMD images (KFD,
//! render-node and dma-buf messages, seeded from a real dump through the KFD simulator). Each
//! mutated input must be answered with a value or an error: no panic, no hang, and no single
//! allocation beyond a bound (a counting allocator watches every request).
//!
//! `GPU_PLUGIN_FUZZ_SECONDS` (default 3) is the time per target; the mutations are
//! deterministic for a given seed (`GPU_PLUGIN_FUZZ_SEED`, default 1), so a failure names the
//! seed and iteration that reproduce it.

#[path = "amdgpu_support/mod.rs"]
mod amdgpu_support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use amdgpu_support::{TempDir, config, dump, two_gpu_process};
use criu_gpu_core::amdgpu::image::{self, DmabufImage, KfdCheckpoint, ReadLimits, RenderNodeImage};
use criu_gpu_core::config::Config;
use criu_gpu_core::images::metadata::CudaMetadata;

thread_local! {
    /// The largest single allocation this thread made since the last reset (per thread: the
    /// targets run in parallel).
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|c| c.set(c.get().max(size)));
}

struct Counting;

// SAFETY: forwards every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: the caller's layout, passed on as is.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` above with this layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        // SAFETY: `p` came from this allocator with layout `l`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// No decoder may ask for more than this at once for inputs of a few KiB.
const MAX_ALLOCATION: usize = 64 << 20;

/// xorshift64*: small, deterministic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Bytes that matter to parsers: limits, signs, varint continuation, separators.
const INTERESTING: &[u8] = &[0, 1, 0x7f, 0x80, 0xff, b' ', b'\n', b'=', b'#', b'-', b'9'];

fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(8) {
            0 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => v.truncate(at),
            3 => {
                let n = rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, bytes);
            }
            4 if !v.is_empty() => {
                // Repeat a chunk: duplicated records, repeated lines.
                let start = rng.below(v.len());
                let end = (start + rng.below(64) + 1).min(v.len());
                let chunk = v[start..end].to_vec();
                for _ in 0..=rng.below(8) {
                    v.splice(at..at, chunk.iter().copied());
                }
            }
            5 if v.len() >= 4 => {
                // A length or count field set to an extreme value.
                let i = rng.below(v.len() - 3);
                let x = [0u32, 1, 0x7fff_ffff, 0xffff_ffff][rng.below(4)];
                v[i..i + 4].copy_from_slice(&x.to_le_bytes());
            }
            6 => {
                // A huge decimal number in text formats.
                v.splice(at..at, b"99999999999999999999".iter().copied());
            }
            _ if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v.remove(i);
            }
            _ => {}
        }
    }
    v
}

fn seconds() -> Duration {
    let s = std::env::var("GPU_PLUGIN_FUZZ_SECONDS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(s)
}

fn base_seed() -> u64 {
    std::env::var("GPU_PLUGIN_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// Feeds mutations of `seeds` to `target` for the configured time; every call must return in
/// well under a second and allocate at most [`MAX_ALLOCATION`] at once.
fn fuzz(name: &str, seeds: &[Vec<u8>], target: impl Fn(&[u8])) {
    let budget = seconds();
    let started = Instant::now();
    let mut rng = Rng(base_seed().wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut n = 0u64;
    while started.elapsed() < budget {
        let seed = &seeds[rng.below(seeds.len())];
        let input = mutate(seed, &mut rng);
        LARGEST.with(|c| c.set(0));
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(&input)));
        let took = t.elapsed();
        let largest = LARGEST.with(Cell::get);
        assert!(
            r.is_ok(),
            "{name}: panic on iteration {n} (seed {}), input {:?}",
            base_seed(),
            String::from_utf8_lossy(&input)
        );
        assert!(
            took < Duration::from_secs(1),
            "{name}: iteration {n} took {took:?}"
        );
        assert!(
            largest <= MAX_ALLOCATION.max(input.len() * 4),
            "{name}: iteration {n} allocated {largest} bytes at once for {} input bytes",
            input.len()
        );
        n += 1;
    }
    eprintln!("{name}: {n} inputs in {:?}", started.elapsed());
    assert!(n > 0);
}

#[test]
fn settings_files() {
    let seeds = vec![
        b"# comment\nlibcuda = /opt/x/libcuda.so.1\ncuda.parallel = no\ncuda.lock-timeout-ms = 5000\ncuda.device-map = GPU-b585ed72-f703-359b-5d2c-7c490dad1115=GPU-53f5f911-9265-6b0a-9031-cbb5cd45a092\n".to_vec(),
        b"amdgpu.copy-threads = 3\namdgpu.max-buffer-size = 0x10000000\namdgpu.chunk-size = 4M\namdgpu.parallel-restore = on\namdgpu.kfd-numa-check = no\ndisable = amdgpu\n".to_vec(),
    ];
    fuzz("settings", &seeds, |b| {
        let c = Config::parse(&String::from_utf8_lossy(b));
        assert!(c.warnings.len() <= 9);
        let _ = c.get_bool("cuda.parallel", true);
        let _ = c.get_u64("cuda.lock-timeout-ms", 1);
        let (_, errors) = criu_gpu_core::amdgpu::AmdgpuSettings::from_config_lenient(&c, &|_| None);
        let _ = errors;
    });
}

#[test]
fn cuda_metadata() {
    let mut seeds = vec![
        b"gpu-plugin-cuda 1\ndriver 13000 580.159.04\ngpu GPU-b585ed72-f703-359b-5d2c-7c490dad1115 85899345920 0000:00:06.0 NVIDIA H200\nprocess 1 7 running 1073741824\nprocess 2 9 locked 0\n".to_vec(),
        b"gpu-plugin-cuda 1\ndriver 12080 -\nprocess 100 101 checkpointed 5\n".to_vec(),
    ];
    // The current format (1.1, with its checksum) of the first.
    let current = CudaMetadata::decode(std::str::from_utf8(&seeds[0]).unwrap()).unwrap();
    seeds.push(current.encode().into_bytes());
    fuzz("gpu-plugin-cuda.img", &seeds, |b| {
        let _ = CudaMetadata::decode_bytes(b);
        let _ = CudaMetadata::decode(&String::from_utf8_lossy(b));
    });
}

#[test]
fn criu_process_trees() {
    let mut one = 0x5456_4319u32.to_le_bytes().to_vec();
    one.extend_from_slice(&0x5027_3030u32.to_le_bytes());
    for entry in [
        &[
            0x08u8, 0xac, 0x02, 0x10, 0x01, 0x18, 0xac, 0x02, 0x20, 0xac, 0x02, 0x28, 0xac, 0x02,
        ][..],
        &[
            0x08, 0x07, 0x10, 0xac, 0x02, 0x18, 0x07, 0x20, 0x07, 0x28, 0x07, 0x28, 0x08,
        ][..],
    ] {
        one.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        one.extend_from_slice(entry);
    }
    fuzz("pstree.img", &[one], |b| {
        let _ = criu_plugin::pstree::parse_pids(b);
    });
}

#[test]
fn amd_images() {
    let (topo, sim, p) = two_gpu_process(300, 6, 1 << 16);
    let images = TempDir::new("fuzz");
    let dumped = dump(&sim, &[&p], images.path(), &config(&topo, ""));
    let read = |name: String| std::fs::read(images.path().join(name)).unwrap();
    let kfd = read(image::kfd_file_name(dumped[0].kfd_id));
    let render = read(image::render_node_file_name(dumped[0].render_ids[0].0));
    let limits = ReadLimits::default();
    fuzz("amdgpu-kfd", &[kfd], |b| {
        let _ = image::decode_framed::<KfdCheckpoint>(b, "amdgpu-kfd-1.img", &limits);
    });
    fuzz("amdgpu-renderD", &[render], |b| {
        let _ = image::decode_framed::<RenderNodeImage>(b, "amdgpu-renderD-1.img", &limits);
        let _ = image::decode_framed::<DmabufImage>(b, "amdgpu-dmabuf_1.img", &limits);
    });
}
