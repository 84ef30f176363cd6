//! `criu-gpu suspend` and `resume` racing a real CRIU dump of the same tree, with the plugin
//! (stand-in CUDA driver): whoever comes second is refused (the per-process claim), a dump that
//! succeeds records every CUDA process with its GPU state, and the tree always ends running with
//! its GPU memory.

mod support;

use std::process::Command;
use std::time::Duration;

use support::T;

#[test]
fn criu_gpu_racing_a_dump_never_loses_a_process() {
    let t = T::start("race");
    let (mut dumped, mut suspended) = (0, 0);
    for (round, delay_ms) in [0u64, 2, 5, 10, 20, 40, 80].into_iter().enumerate() {
        let w = t.workload(&format!("w{round}"), 1, 8);
        let root = w.root().to_string();
        let images = t.dir.join(format!("img{round}"));
        std::fs::create_dir_all(&images).unwrap();
        let mut cmd = Command::new(criu_gpu_test_support::criu_binary());
        cmd.args(["dump", "--leave-running", "-t", &root, "-L"])
            .arg(criu_gpu_test_support::plugin_libdir())
            .arg("-D")
            .arg(&images)
            .args(["-o", "dump.log", "-v4"]);
        for (k, v) in t.env() {
            cmd.env(k, v);
        }
        let dump = std::thread::spawn(move || cmd.output().expect("run criu (set CRIU_BIN)"));
        std::thread::sleep(Duration::from_millis(delay_ms));
        let s = t.tool(&["suspend", &root], &[]);
        let out = dump.join().unwrap();
        let log = std::fs::read_to_string(images.join("dump.log")).unwrap_or_default();
        let what = format!(
            "round {round} ({delay_ms} ms): suspend {:?}, dump {:?}",
            s.code, out.status
        );
        if out.status.success() {
            dumped += 1;
            let md =
                std::fs::read_to_string(images.join("gpu-plugin-cuda.img")).unwrap_or_default();
            let records = md.lines().filter(|l| l.starts_with("process ")).count();
            assert_eq!(
                records,
                w.pids.len(),
                "{what}: the dump recorded {records} CUDA process(es)\n{log}"
            );
        }
        if s.code == Some(0) {
            suspended += 1;
            for &p in &w.pids {
                assert_eq!(
                    t.device_files(p),
                    0,
                    "{what}: pid {p} says suspended but holds GPU memory"
                );
            }
        } else {
            assert!(
                s.code == Some(4) || s.stderr.contains("held"),
                "{what}: criu-gpu failed for another reason than the dump's claim: {s:?}"
            );
        }
        // Whatever happened, a resume brings the tree back and says so truthfully.
        let r = t.tool(&["resume", &root], &[]);
        assert_eq!(r.code, Some(0), "{what}: resume: {r:?}");
        w.assert_running();
    }
    eprintln!("criu-gpu racing a dump: {dumped} dumps, {suspended} suspends went through");
}
