//! Gives the crate the workspace root as `CRIU_GPU_WORKSPACE`: the tests' fixtures, the
//! project's private CRIU and `Cargo.lock` are found from there, not from this crate's folder.

fn main() {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = std::path::Path::new(&manifest)
        .parent()
        .expect("test-support lives in the workspace root");
    println!("cargo:rustc-env=CRIU_GPU_WORKSPACE={}", root.display());
    println!("cargo:rerun-if-changed=build.rs");
}
