//! How the stand-in CUDA driver of `tests/fixtures/fake-cuda` is built, for every test crate
//! that needs it (the plugin's tests and `criu-gpu`'s).

use std::path::PathBuf;

use crate::{build_dir, cc, fixture};

/// The stand-in CUDA driver (`tests/fixtures/fake-cuda`), the stand-in NVML, and the programs
/// linked against the driver.
pub struct FakeCudaBuild {
    /// `libcuda.so.1`.
    pub libcuda: PathBuf,
    /// `libnvidia-ml.so.1`: its `nvmlInit_v2` starts a thread that never ends, as NVIDIA's
    /// does, so whatever loads it into CRIU's process makes it multi-threaded.
    pub nvml: PathBuf,
    /// The CUDA workload.
    pub workload: PathBuf,
    /// Lists the fake's GPUs.
    pub gpu_list: PathBuf,
}

/// Builds (or finds, once built) the stand-in CUDA driver, NVML and their programs in the
/// build directory.
pub fn fake_cuda_build() -> FakeCudaBuild {
    let build_dir = build_dir();
    let shared = |srcs: &[&str], name: &str| {
        let mut args: Vec<String> = vec!["-shared".into(), "-fPIC".into()];
        args.extend(srcs.iter().map(|s| fixture(s)));
        args.push("-lpthread".into());
        cc(name, &args)
    };
    let libcuda = shared(
        &[
            "fake-cuda/fake_libcuda.c",
            "fake-cuda/fake_cuda_runtime.c",
            "fake-cuda/fake_cuda_controller.c",
            "fake-cuda/gpu_nodes.c",
        ],
        "libcuda.so.1",
    );
    let nvml = shared(&["fake-cuda/fake_nvml.c"], "libnvidia-ml.so.1");
    // Linked against the fake only, found next to the binary ($ORIGIN, DT_RPATH) before any
    // real libcuda.
    let linked = |src: &str, name: &str| {
        cc(
            name,
            &[
                fixture(src),
                format!("-L{}", build_dir.display()),
                "-l:libcuda.so.1".into(),
                "-Wl,-rpath,$ORIGIN".into(),
                "-Wl,--disable-new-dtags".into(),
                "-lpthread".into(),
            ],
        )
    };
    FakeCudaBuild {
        libcuda,
        nvml,
        workload: linked("fake-cuda/workload.c", "workload"),
        gpu_list: linked("e2e/gpu_list.c", "gpu_list"),
    }
}
