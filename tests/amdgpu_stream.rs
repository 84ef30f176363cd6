//! `criu dump --stream` with an AMD process: the backend refuses before touching the GPU,
//! instead of writing its images as files that the stream would leave out. A test binary of
//! its own: the streamer connection it opens is seen process-wide.

#[path = "amdgpu_support/mod.rs"]
mod support;

use std::os::unix::net::{UnixListener, UnixStream};

use criu_plugin::HookError;
use support::*;

#[test]
fn a_streamed_dump_is_refused_before_the_gpu_is_touched() {
    let (topo, sim, p) = two_gpu_process(300, 8, 1 << 20);
    let images = TempDir::new("stream");
    // CRIU's connection to criu-image-streamer, as `--stream` makes it.
    let sock = images.path().join(criu_plugin::stream::CAPTURE_SOCKET);
    let _streamer = UnixListener::bind(&sock).unwrap();
    let _criu = UnixStream::connect(&sock).unwrap();
    let cfg = config(&topo, "");
    let e = refused_dump(&sim, &[&p], images.path(), &cfg);
    assert_eq!(e, HookError::logged(libc::EOPNOTSUPP));
    let v = sim.process(300).unwrap();
    assert!(!v.paused && v.evictions == 0, "{v:?}");
    let written: Vec<_> = std::fs::read_dir(images.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with("amdgpu-"))
        .collect();
    assert!(written.is_empty(), "{written:?}");

    // Without the stream, the same dump goes through.
    drop((_criu, _streamer));
    let images2 = TempDir::new("nostream");
    dump(&sim, &[&p], images2.path(), &cfg);
}
