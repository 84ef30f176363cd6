//! Gives the plugin a soname, so packaging tools and `ldd` see a proper shared object.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcriu_gpu_plugin.so");
    println!("cargo:rerun-if-changed=build.rs");
}
