//! The descriptor's layout, checked against the C declaration in `include/criu_plugin_abi.h`
//! compiled by the system C compiler.

use criu_plugin::abi::{HOOK_SLOTS, PluginDesc};
use std::mem::{offset_of, size_of};
use std::process::Command;

#[test]
fn descriptor_matches_the_c_declaration() {
    let dir = std::env::temp_dir().join(format!("criu-plugin-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("probe.c");
    let bin = dir.join("probe");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include <stddef.h>
#include "criu_plugin_abi.h"
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(struct gpu_plugin_desc),
        offsetof(struct gpu_plugin_desc, name), offsetof(struct gpu_plugin_desc, init),
        offsetof(struct gpu_plugin_desc, exit), offsetof(struct gpu_plugin_desc, version),
        offsetof(struct gpu_plugin_desc, max_hooks), offsetof(struct gpu_plugin_desc, hooks),
        HOOK_SLOTS);
    return 0;
}
"#,
    )
    .unwrap();
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/../include");
    let st = Command::new("cc")
        .args(["-I", include, "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("a C compiler (cc) is needed for the layout test");
    assert!(st.success(), "compiling the layout probe failed");
    let out = Command::new(&bin).output().unwrap();
    let c: Vec<usize> = String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    let rust = vec![
        size_of::<PluginDesc>(),
        offset_of!(PluginDesc, name),
        offset_of!(PluginDesc, init),
        offset_of!(PluginDesc, exit),
        offset_of!(PluginDesc, version),
        offset_of!(PluginDesc, max_hooks),
        offset_of!(PluginDesc, hooks),
        HOOK_SLOTS,
    ];
    assert_eq!(c, rust);
    // The offsets CRIU itself relies on (x86-64 and aarch64).
    assert_eq!(&rust[1..7], &[0, 8, 16, 24, 28, 32]);
    let _ = std::fs::remove_dir_all(&dir);
}
