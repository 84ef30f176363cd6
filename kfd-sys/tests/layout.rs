//! Checks the Rust definitions against the real C headers.
//!
//! Each test writes a small C program that prints `sizeof`, `_Alignof` and
//! `offsetof` of every exposed structure, the value of every exposed constant
//! and every ioctl request number as the C preprocessor computes it, compiles
//! it with the system C compiler (`$CC`, default `cc`) against
//! `/usr/include/linux/kfd_ioctl.h` (linux-libc-dev) and
//! `/usr/include/libdrm/{drm,amdgpu_drm}.h` (libdrm-dev), runs it and compares
//! every line with `size_of` / `align_of` / `offset_of!` / the constant on the
//! Rust side. Any difference, or any value missing from the probe's output,
//! fails the test.
//!
//! When the headers or the compiler are missing the tests fail with a message
//! saying what to install, unless `KFD_SYS_SKIP_C_PROBE` is set, in which case
//! they are skipped with a note on stderr.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use kfd_sys::*;

const KFD_HEADER: &str = "/usr/include/linux/kfd_ioctl.h";
const DEFAULT_LIBDRM_INCLUDE: &str = "/usr/include/libdrm";

/// One value known on both sides: `key` names it, `rust` is what this crate
/// says and `c_expr` is the C expression the probe prints for it.
struct Check {
    key: String,
    rust: u64,
    c_expr: String,
}

#[derive(Default)]
struct Checks(Vec<Check>);

impl Checks {
    fn add(&mut self, key: impl Into<String>, rust: u64, c_expr: impl Into<String>) {
        self.0.push(Check {
            key: key.into(),
            rust,
            c_expr: c_expr.into(),
        });
    }
}

/// C spelling of a bindgen field name (`in_` → `in`, `type_` → `type`).
fn c_field(rust: &str) -> &str {
    rust.strip_suffix('_').unwrap_or(rust)
}

/// Size, alignment and the offset of each listed field of a struct/union.
macro_rules! layout {
    ($checks:expr, $kw:literal $t:ident { $($f:ident),* $(,)? }) => {{
        let name = stringify!($t);
        $checks.add(
            format!("sizeof {name}"),
            size_of::<$t>() as u64,
            format!("sizeof({} {name})", $kw),
        );
        $checks.add(
            format!("alignof {name}"),
            align_of::<$t>() as u64,
            format!("_Alignof({} {name})", $kw),
        );
        $(
            $checks.add(
                format!("offsetof {name}.{}", stringify!($f)),
                offset_of!($t, $f) as u64,
                format!("offsetof({} {name}, {})", $kw, c_field(stringify!($f))),
            );
        )*
    }};
}

/// C unsigned type as wide as a Rust constant. The C value is converted to
/// it before printing, as it is when stored in a field: `(1 << 31)` is a
/// negative `int` in C but `0x8000_0000` in a `__u32`.
fn c_uint_of_size(size: usize) -> &'static str {
    match size {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        8 => "unsigned long long",
        _ => panic!("unexpected constant size {size}"),
    }
}

/// Constants and ioctl numbers, compared by name.
macro_rules! consts {
    ($checks:expr, $($c:ident),* $(,)?) => {{
        $(
            $checks.add(
                stringify!($c),
                $c as u64,
                format!(
                    "({})({})",
                    c_uint_of_size(std::mem::size_of_val(&$c)),
                    stringify!($c)
                ),
            );
        )*
    }};
}

fn kfd_checks() -> Checks {
    let mut c = Checks::default();
    layout!(c, "struct" kfd_ioctl_get_version_args { major_version, minor_version });
    layout!(c, "struct" kfd_ioctl_acquire_vm_args { drm_fd, gpu_id });
    layout!(c, "struct" kfd_ioctl_get_available_memory_args { available, gpu_id, pad });
    layout!(c, "struct" kfd_ioctl_set_xnack_mode_args { xnack_enabled });
    layout!(c, "struct" kfd_ioctl_criu_args {
        devices, bos, priv_data, priv_data_size, num_devices, num_bos, num_objects, pid, op,
    });
    layout!(c, "struct" kfd_criu_device_bucket { user_gpu_id, actual_gpu_id, drm_fd, pad });
    layout!(c, "struct" kfd_criu_bo_bucket {
        addr, size, offset, restored_offset, gpu_id, alloc_flags, dmabuf_fd, pad,
    });
    c.add(
        "sizeof enum kfd_criu_op",
        size_of::<kfd_criu_op>() as u64,
        "sizeof(enum kfd_criu_op)",
    );
    consts!(
        c,
        KFD_IOCTL_MAJOR_VERSION,
        KFD_IOCTL_MINOR_VERSION,
        KFD_INVALID_FD,
        AMDKFD_IOCTL_BASE,
        AMDKFD_COMMAND_START,
        AMDKFD_COMMAND_END,
        KFD_CRIU_OP_PROCESS_INFO,
        KFD_CRIU_OP_CHECKPOINT,
        KFD_CRIU_OP_UNPAUSE,
        KFD_CRIU_OP_RESTORE,
        KFD_CRIU_OP_RESUME,
        KFD_IOC_ALLOC_MEM_FLAGS_VRAM,
        KFD_IOC_ALLOC_MEM_FLAGS_GTT,
        KFD_IOC_ALLOC_MEM_FLAGS_USERPTR,
        KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL,
        KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP,
        KFD_IOC_ALLOC_MEM_FLAGS_WRITABLE,
        KFD_IOC_ALLOC_MEM_FLAGS_EXECUTABLE,
        KFD_IOC_ALLOC_MEM_FLAGS_PUBLIC,
        KFD_IOC_ALLOC_MEM_FLAGS_NO_SUBSTITUTE,
        KFD_IOC_ALLOC_MEM_FLAGS_AQL_QUEUE_MEM,
        KFD_IOC_ALLOC_MEM_FLAGS_COHERENT,
        KFD_IOC_ALLOC_MEM_FLAGS_UNCACHED,
        AMDKFD_IOC_GET_VERSION,
        AMDKFD_IOC_ACQUIRE_VM,
        AMDKFD_IOC_SET_XNACK_MODE,
        AMDKFD_IOC_CRIU_OP,
        AMDKFD_IOC_AVAILABLE_MEMORY,
    );
    c
}

fn drm_checks() -> Checks {
    let mut c = Checks::default();
    layout!(c, "struct" drm_version {
        version_major, version_minor, version_patchlevel, name_len, name, date_len, date,
        desc_len, desc,
    });
    layout!(c, "struct" drm_gem_close { handle, pad });
    layout!(c, "struct" drm_prime_handle { handle, flags, fd });
    layout!(c, "struct" drm_amdgpu_gem_create_in { bo_size, alignment, domains, domain_flags });
    layout!(c, "struct" drm_amdgpu_gem_create_out { handle, _pad });
    layout!(c, "union" drm_amdgpu_gem_create { in_, out });
    layout!(c, "struct" drm_amdgpu_gem_mmap_in { handle, _pad });
    layout!(c, "struct" drm_amdgpu_gem_mmap_out { addr_ptr });
    layout!(c, "union" drm_amdgpu_gem_mmap { in_, out });
    layout!(c, "struct" drm_amdgpu_gem_va {
        handle, _pad, operation, flags, va_address, offset_in_bo, map_size,
    });
    layout!(c, "struct" drm_amdgpu_gem_op { handle, op, value });
    layout!(c, "struct" drm_amdgpu_gem_userptr { addr, size, flags, handle });
    layout!(c, "struct" drm_amdgpu_ctx_in { op, flags, ctx_id, priority });
    layout!(c, "union" drm_amdgpu_ctx_out { alloc, state, pstate });
    layout!(c, "union" drm_amdgpu_ctx { in_, out });
    layout!(c, "struct" drm_amdgpu_bo_list_in {
        operation, list_handle, bo_number, bo_info_size, bo_info_ptr,
    });
    layout!(c, "struct" drm_amdgpu_bo_list_entry { bo_handle, bo_priority });
    layout!(c, "struct" drm_amdgpu_bo_list_out { list_handle, _pad });
    layout!(c, "union" drm_amdgpu_bo_list { in_, out });
    layout!(c, "struct" drm_amdgpu_cs_chunk { chunk_id, length_dw, chunk_data });
    layout!(c, "struct" drm_amdgpu_cs_in { ctx_id, bo_list_handle, num_chunks, flags, chunks });
    layout!(c, "struct" drm_amdgpu_cs_out { handle });
    layout!(c, "union" drm_amdgpu_cs { in_, out });
    layout!(c, "struct" drm_amdgpu_cs_chunk_ib {
        _pad, flags, va_start, ib_bytes, ip_type, ip_instance, ring,
    });
    layout!(c, "struct" drm_amdgpu_wait_cs_in { handle, timeout, ip_type, ip_instance, ring, ctx_id });
    layout!(c, "struct" drm_amdgpu_wait_cs_out { status });
    layout!(c, "union" drm_amdgpu_wait_cs { in_, out });
    layout!(c, "struct" drm_amdgpu_query_fw { fw_type, ip_instance, index, _pad });
    layout!(c, "struct" drm_amdgpu_info { return_pointer, return_size, query });
    // The anonymous union of `struct drm_amdgpu_info` (bindgen names it).
    for (rust, c_name) in [
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.mode_crtc),
            "mode_crtc",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.query_hw_ip),
            "query_hw_ip",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.query_hw_ip.type_),
            "query_hw_ip.type",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.query_hw_ip.ip_instance),
            "query_hw_ip.ip_instance",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.read_mmr_reg),
            "read_mmr_reg",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.query_fw),
            "query_fw",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.vbios_info),
            "vbios_info",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.sensor_info),
            "sensor_info",
        ),
        (
            offset_of!(drm_amdgpu_info, __bindgen_anon_1.video_cap),
            "video_cap",
        ),
    ] {
        c.add(
            format!("offsetof drm_amdgpu_info.{c_name}"),
            rust as u64,
            format!("offsetof(struct drm_amdgpu_info, {c_name})"),
        );
    }
    layout!(c, "struct" drm_amdgpu_info_device {
        device_id, chip_rev, external_rev, pci_rev, family, num_shader_engines,
        num_shader_arrays_per_engine, gpu_counter_freq, max_engine_clock, max_memory_clock,
        cu_active_number, cu_ao_mask, cu_bitmap, enabled_rb_pipes_mask, num_rb_pipes,
        num_hw_gfx_contexts, _pad, ids_flags, virtual_address_offset, virtual_address_max,
        virtual_address_alignment, pte_fragment_size, gart_page_size, ce_ram_size, vram_type,
        vram_bit_width, vce_harvest_config, gc_double_offchip_lds_buf, prim_buf_gpu_addr,
        pos_buf_gpu_addr, cntl_sb_buf_gpu_addr, param_buf_gpu_addr, prim_buf_size,
        pos_buf_size, cntl_sb_buf_size, param_buf_size, wave_front_size,
        num_shader_visible_vgprs, num_cu_per_sh, num_tcc_blocks, gs_vgt_table_depth,
        gs_prim_buffer_depth, max_gs_waves_per_vgt, _pad1, cu_ao_bitmap, high_va_offset,
        high_va_max, pa_sc_tile_steering_override, tcc_disabled_mask,
    });
    consts!(
        c,
        DRM_IOCTL_BASE,
        DRM_COMMAND_BASE,
        DRM_COMMAND_END,
        DRM_CLOEXEC,
        DRM_RDWR,
        DRM_AMDGPU_GEM_CREATE,
        DRM_AMDGPU_GEM_MMAP,
        DRM_AMDGPU_CTX,
        DRM_AMDGPU_BO_LIST,
        DRM_AMDGPU_CS,
        DRM_AMDGPU_INFO,
        DRM_AMDGPU_GEM_VA,
        DRM_AMDGPU_WAIT_CS,
        DRM_AMDGPU_GEM_OP,
        DRM_AMDGPU_GEM_USERPTR,
        AMDGPU_GEM_DOMAIN_CPU,
        AMDGPU_GEM_DOMAIN_GTT,
        AMDGPU_GEM_DOMAIN_VRAM,
        AMDGPU_GEM_DOMAIN_MASK,
        AMDGPU_GEM_CREATE_CPU_ACCESS_REQUIRED,
        AMDGPU_GEM_CREATE_NO_CPU_ACCESS,
        AMDGPU_GEM_CREATE_CPU_GTT_USWC,
        AMDGPU_GEM_CREATE_VRAM_CLEARED,
        AMDGPU_GEM_CREATE_VM_ALWAYS_VALID,
        AMDGPU_GEM_CREATE_EXPLICIT_SYNC,
        AMDGPU_GEM_OP_GET_GEM_CREATE_INFO,
        AMDGPU_GEM_OP_SET_PLACEMENT,
        AMDGPU_GEM_USERPTR_READONLY,
        AMDGPU_GEM_USERPTR_ANONONLY,
        AMDGPU_GEM_USERPTR_VALIDATE,
        AMDGPU_GEM_USERPTR_REGISTER,
        AMDGPU_VA_OP_MAP,
        AMDGPU_VA_OP_UNMAP,
        AMDGPU_VA_OP_CLEAR,
        AMDGPU_VA_OP_REPLACE,
        AMDGPU_VM_DELAY_UPDATE,
        AMDGPU_VM_PAGE_READABLE,
        AMDGPU_VM_PAGE_WRITEABLE,
        AMDGPU_VM_PAGE_EXECUTABLE,
        AMDGPU_VM_PAGE_PRT,
        AMDGPU_CTX_OP_ALLOC_CTX,
        AMDGPU_CTX_OP_FREE_CTX,
        AMDGPU_BO_LIST_OP_CREATE,
        AMDGPU_BO_LIST_OP_DESTROY,
        AMDGPU_BO_LIST_OP_UPDATE,
        AMDGPU_CHUNK_ID_IB,
        AMDGPU_CHUNK_ID_FENCE,
        AMDGPU_CHUNK_ID_BO_HANDLES,
        AMDGPU_HW_IP_GFX,
        AMDGPU_HW_IP_COMPUTE,
        AMDGPU_HW_IP_DMA,
        AMDGPU_INFO_DEV_INFO,
        AMDGPU_FAMILY_AI,
        AMDGPU_FAMILY_NV,
        DRM_IOCTL_VERSION,
        DRM_IOCTL_GEM_CLOSE,
        DRM_IOCTL_PRIME_HANDLE_TO_FD,
        DRM_IOCTL_PRIME_FD_TO_HANDLE,
        DRM_IOCTL_AMDGPU_GEM_CREATE,
        DRM_IOCTL_AMDGPU_GEM_MMAP,
        DRM_IOCTL_AMDGPU_CTX,
        DRM_IOCTL_AMDGPU_BO_LIST,
        DRM_IOCTL_AMDGPU_CS,
        DRM_IOCTL_AMDGPU_INFO,
        DRM_IOCTL_AMDGPU_GEM_VA,
        DRM_IOCTL_AMDGPU_WAIT_CS,
        DRM_IOCTL_AMDGPU_GEM_OP,
        DRM_IOCTL_AMDGPU_GEM_USERPTR,
    );
    c
}

fn skip_requested() -> bool {
    std::env::var_os("KFD_SYS_SKIP_C_PROBE").is_some_and(|v| !v.is_empty())
}

/// Fails the test, or skips it when `KFD_SYS_SKIP_C_PROBE` is set.
fn unavailable(test: &str, why: &str) {
    if skip_requested() {
        eprintln!("{test}: SKIPPED (KFD_SYS_SKIP_C_PROBE is set): {why}");
        return;
    }
    panic!(
        "{test}: cannot run the C layout probe: {why}.\n\
         Install the headers and a C compiler (Debian: apt-get install gcc \
         linux-libc-dev libdrm-dev), or set KFD_SYS_SKIP_C_PROBE=1 to skip."
    );
}

fn libdrm_include() -> PathBuf {
    std::env::var_os("KFD_SYS_LIBDRM_INCLUDE")
        .map_or_else(|| PathBuf::from(DEFAULT_LIBDRM_INCLUDE), PathBuf::from)
}

fn has_libdrm_headers() -> bool {
    let dir = libdrm_include();
    dir.join("drm.h").is_file() && dir.join("amdgpu_drm.h").is_file()
}

/// Scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kfd-sys-layout-{tag}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).expect("create scratch directory");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Makes `<drm/...>` resolvable: a `drm` link to libdrm's headers, or (KFD
/// probe only, when libdrm-dev is absent) a stand-in `drm/drm.h` providing
/// the `__u32`-style types, which is all `kfd_ioctl.h` takes from it.
fn prepare_include_dir(scratch: &Path) -> PathBuf {
    let inc = scratch.join("inc");
    std::fs::create_dir_all(&inc).expect("create include directory");
    if has_libdrm_headers() {
        std::os::unix::fs::symlink(libdrm_include(), inc.join("drm")).expect("link drm/");
    } else {
        std::fs::create_dir_all(inc.join("drm")).expect("create drm/");
        std::fs::write(
            inc.join("drm/drm.h"),
            "/* kfd-sys layout probe stand-in */\n#include <linux/types.h>\n",
        )
        .expect("write drm/drm.h stand-in");
    }
    inc
}

/// Compiles and runs the probe; returns its `key=value` lines, or `None`
/// (after reporting) when the compiler is unavailable.
fn run_probe(test: &str, includes: &[&str], checks: &Checks) -> Option<BTreeMap<String, u64>> {
    let scratch = TempDir::new(test);
    let inc = prepare_include_dir(&scratch.0);

    let mut src = String::from("#include <stdio.h>\n#include <stddef.h>\n#include <fcntl.h>\n");
    for h in includes {
        writeln!(src, "#include <{h}>").unwrap();
    }
    src.push_str(
        "#define P(k, e) printf(\"%s=%llu\\n\", k, (unsigned long long)(e))\nint main(void)\n{\n",
    );
    for c in &checks.0 {
        writeln!(src, "\tP(\"{}\", {});", c.key, c.c_expr).unwrap();
    }
    src.push_str("\treturn 0;\n}\n");

    let c_file = scratch.0.join("probe.c");
    let exe = scratch.0.join("probe");
    std::fs::write(&c_file, &src).expect("write probe.c");

    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let out = match Command::new(&cc)
        .arg("-std=gnu11")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(&inc)
        .arg("-o")
        .arg(&exe)
        .arg(&c_file)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            unavailable(test, &format!("cannot run C compiler `{cc}`: {e}"));
            return None;
        }
    };
    assert!(
        out.status.success(),
        "{test}: the C probe did not compile with `{cc}`:\n{}\n--- probe.c ---\n{src}",
        String::from_utf8_lossy(&out.stderr)
    );

    let run = Command::new(&exe).output().expect("run the C probe");
    assert!(
        run.status.success(),
        "{test}: the C probe failed: {:?}",
        run.status
    );
    let stdout = String::from_utf8(run.stdout).expect("probe output is UTF-8");
    let values = stdout
        .lines()
        .map(|line| {
            let (k, v) = line.rsplit_once('=').expect("key=value line");
            (k.to_owned(), v.parse::<u64>().expect("decimal value"))
        })
        .collect();
    Some(values)
}

fn compare(test: &str, checks: &Checks, c_values: &BTreeMap<String, u64>) {
    let mut bad = Vec::new();
    for check in &checks.0 {
        match c_values.get(&check.key) {
            Some(&c) if c == check.rust => {}
            Some(&c) => bad.push(format!(
                "  {}: Rust {} (0x{:X}) but C {} (0x{:X})",
                check.key, check.rust, check.rust, c, c
            )),
            None => bad.push(format!("  {}: missing from the probe output", check.key)),
        }
    }
    assert!(
        bad.is_empty(),
        "{test}: {} of {} values differ from the C headers:\n{}",
        bad.len(),
        checks.0.len(),
        bad.join("\n")
    );
    eprintln!("{test}: {} values match the C headers", checks.0.len());
}

#[test]
fn kfd_layout_matches_c_headers() {
    const TEST: &str = "kfd_layout_matches_c_headers";
    if skip_requested() {
        unavailable(TEST, "requested");
        return;
    }
    if !Path::new(KFD_HEADER).is_file() {
        unavailable(TEST, &format!("{KFD_HEADER} not found (linux-libc-dev)"));
        return;
    }
    let checks = kfd_checks();
    if let Some(values) = run_probe("kfd", &["linux/kfd_ioctl.h"], &checks) {
        compare(TEST, &checks, &values);
    }
}

#[test]
fn drm_layout_matches_c_headers() {
    const TEST: &str = "drm_layout_matches_c_headers";
    if skip_requested() {
        unavailable(TEST, "requested");
        return;
    }
    if !has_libdrm_headers() {
        unavailable(
            TEST,
            &format!(
                "drm.h / amdgpu_drm.h not found in {} (libdrm-dev; override with \
                 KFD_SYS_LIBDRM_INCLUDE)",
                libdrm_include().display()
            ),
        );
        return;
    }
    let checks = drm_checks();
    if let Some(values) = run_probe("drm", &["drm/drm.h", "drm/amdgpu_drm.h"], &checks) {
        compare(TEST, &checks, &values);
    }
}

/// The probe really can fail: a deliberately wrong value is reported.
#[test]
fn compare_reports_differences() {
    let mut checks = Checks::default();
    checks.add("sizeof kfd_ioctl_criu_args", 56, "unused");
    checks.add("missing", 1, "unused");
    let mut c_values = BTreeMap::new();
    c_values.insert("sizeof kfd_ioctl_criu_args".to_owned(), 64);
    let err = std::panic::catch_unwind(|| compare("self-test", &checks, &c_values))
        .expect_err("a difference must fail");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("Rust 56 (0x38) but C 64 (0x40)"), "{msg}");
    assert!(
        msg.contains("missing: missing from the probe output"),
        "{msg}"
    );
}

/// Sizes the CRIU image format depends on, independent of the probe.
#[test]
fn criu_sizes() {
    assert_eq!(size_of::<kfd_ioctl_criu_args>(), 56);
    assert_eq!(size_of::<kfd_criu_device_bucket>(), 16);
    assert_eq!(size_of::<kfd_criu_bo_bucket>(), 48);
    assert_eq!(AMDKFD_IOC_GET_VERSION, 0x8008_4B01);
    assert_eq!(AMDKFD_IOC_CRIU_OP, 0xC038_4B22);
}
