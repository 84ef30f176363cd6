//! Random input never panics the decoders or the file readers.

use super::*;
use crate::amdgpu::image::wire;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn decode_all(payload: &[u8]) {
    let _ = decode_payload::<KfdCheckpoint>(payload, "fuzz");
    let _ = decode_payload::<RenderNodeImage>(payload, "fuzz");
    let _ = decode_payload::<DmabufImage>(payload, "fuzz");
    let _ = decode_framed::<KfdCheckpoint>(payload, "fuzz", &limits());
    for rules in [
        &wire::CRIU_KFD,
        &wire::CRIU_RENDER_NODE,
        &wire::CRIU_DMABUF_NODE,
    ] {
        let _ = wire::check_required(payload, rules);
    }
}

#[test]
fn decoders_never_panic_on_random_bytes() {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for _ in 0..5000 {
        let len = rng.below(200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        decode_all(&bytes);
    }
}

#[test]
fn decoders_never_panic_on_mutated_images() {
    let mut rng = XorShift(0x0123_4567_89ab_cdef);
    let seeds = [
        encode_payload(&sample_kfd(), "x").unwrap(),
        encode_payload(&sample_render_node(), "x").unwrap(),
        hand_sample_kfd(false),
    ];
    for _ in 0..3000 {
        let mut bytes = seeds[rng.below(seeds.len())].clone();
        match rng.below(3) {
            0 => {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(bytes.len());
                    bytes[i] ^= 1 << rng.below(8);
                }
            }
            1 => bytes.truncate(rng.below(bytes.len())),
            _ => {
                let i = rng.below(bytes.len());
                bytes.insert(i, rng.next() as u8);
            }
        }
        decode_all(&bytes);
    }
}

#[test]
fn random_files_never_panic_the_file_readers() {
    let t = TempDir::new();
    let mut rng = XorShift(0xfeed_face_cafe_beef);
    let layout = gpu_a_layout();
    for i in 0..200u32 {
        let len = rng.below(64);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if rng.below(2) == 0 && bytes.len() >= HEADER_LEN {
            // Plausible header.
            let n = (bytes.len() - HEADER_LEN + rng.below(3)).saturating_sub(1);
            bytes[..HEADER_LEN].copy_from_slice(&n.to_ne_bytes());
        }
        t.put(&kfd_file_name(i), &bytes);
        let _ = t.dir().read_kfd(i, &limits());
        let _ = t
            .dir()
            .read_message::<RenderNodeImage>(&kfd_file_name(i), &limits());
        t.put(&kfd_pages_file_name(i, GPU_A), &bytes);
        let _ = t.dir().open_kfd_pages(i, GPU_A, layout.clone());
    }
}
