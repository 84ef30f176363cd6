//! Which CRIU loaded us, found out before CRIU checks the descriptor.
//!
//! CRIU refuses a plugin whose `max_hooks` exceeds its own hook count, and that refusal fails
//! every dump and restore. `RESTORE_EXT_FILE` also changed arity after CRIU 4.2. No exported
//! function marks either change, but every host keeps the legacy hook names it knows
//! (`cr_plugin_pause_devices`, ...) as strings in its read-only data, so scanning the main
//! program's mapped, non-writable segments tells the hook set exactly. The scan reads memory, not
//! `/proc/self/exe`, so it also works when `criu` runs through an explicit dynamic loader.

use crate::abi::{HOOK_SLOTS, HookId, HostVersion, PluginDesc, RawHook};
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

/// What the plugin needs to know about its host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Host {
    /// The release family.
    pub version: HostVersion,
    /// The host's `CR_PLUGIN_HOOK__MAX`.
    pub hook_count: u32,
    /// Whether `RESTORE_EXT_FILE` takes `bool *retry_needed`.
    pub restore_ext_file_retry: bool,
}

impl Host {
    /// The host description for a release family.
    pub const fn for_version(version: HostVersion) -> Host {
        let hook_count = match version {
            HostVersion::Unknown | HostVersion::V3_17 => 10,
            HostVersion::Pre317 => 7,
            HostVersion::V4_0 => 12,
            HostVersion::V4_2 => 13,
            HostVersion::Dev => 15,
            HostVersion::V4_3 => 17,
        };
        Host {
            version,
            hook_count,
            restore_ext_file_retry: matches!(version, HostVersion::Dev | HostVersion::V4_3),
        }
    }

    /// Whether the host calls `hook` at all.
    pub fn has_hook(&self, hook: HookId) -> bool {
        (hook.index() as u32) < self.hook_count
    }

    /// Whether this is a CRIU at all.
    pub fn is_criu(&self) -> bool {
        self.version != HostVersion::Unknown
    }
}

/// Classifies a host from its read-only data: the newest legacy hook name present decides.
pub fn detect_from_rodata(rodata: &[&[u8]]) -> Host {
    let has = |hook: HookId| {
        let mut needle = hook.legacy_symbol().as_bytes().to_vec();
        needle.push(0);
        rodata.iter().any(|seg| contains_cstr(seg, &needle))
    };
    // 4.3 added UPDATE_INETSK with a legacy name, and DUMP_FINISH without one.
    let version = if has(HookId::UpdateInetsk) {
        HostVersion::V4_3
    } else if has(HookId::RestoreInit) || has(HookId::DumpDevicesLate) {
        HostVersion::Dev
    } else if has(HookId::PostForking) {
        HostVersion::V4_2
    } else if has(HookId::PauseDevices) {
        HostVersion::V4_0
    } else if has(HookId::ResumeDevicesLate) {
        HostVersion::V3_17
    } else if has(HookId::DumpExtLink) {
        HostVersion::Pre317
    } else {
        HostVersion::Unknown
    };
    Host::for_version(version)
}

/// Finds `needle` (which ends in NUL) where it is a whole identifier: at the segment start or
/// after a byte that cannot be part of a C identifier (normally the previous string's NUL; the
/// linker may tail-merge a name into a longer message), so `xcr_plugin_...` does not count.
fn contains_cstr(hay: &[u8], needle: &[u8]) -> bool {
    let mut from = 0;
    while from + needle.len() <= hay.len() {
        let rest = &hay[from..];
        // SAFETY: both pointers and lengths describe live slices; memmem only reads them.
        let hit = unsafe {
            libc::memmem(
                rest.as_ptr().cast(),
                rest.len(),
                needle.as_ptr().cast(),
                needle.len(),
            )
        };
        if hit.is_null() {
            return false;
        }
        let at = from + (hit as usize - rest.as_ptr() as usize);
        if at == 0 || !(hay[at - 1].is_ascii_alphanumeric() || hay[at - 1] == b'_') {
            return true;
        }
        from = at + 1;
    }
    false
}

/// The main program's readable, non-writable loaded segments.
fn main_program_rodata() -> Vec<&'static [u8]> {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: `data` is the `&mut Vec` passed to dl_iterate_phdr below, alive for the call.
        let out = unsafe { &mut *data.cast::<Vec<&'static [u8]>>() };
        // SAFETY: glibc passes a valid dl_phdr_info for the duration of the callback.
        let info = unsafe { &*info };
        for i in 0..info.dlpi_phnum as usize {
            // SAFETY: dlpi_phdr points at dlpi_phnum program headers of a loaded object.
            let ph = unsafe { &*info.dlpi_phdr.add(i) };
            let readable = ph.p_flags & libc::PF_R != 0;
            let writable = ph.p_flags & libc::PF_W != 0;
            if ph.p_type == libc::PT_LOAD && readable && !writable && ph.p_filesz > 0 {
                let start = info.dlpi_addr.wrapping_add(ph.p_vaddr) as *const u8;
                // SAFETY: a PT_LOAD segment of a loaded object is mapped readable for its file
                // size for as long as the object stays loaded, and the main program never unloads.
                out.push(unsafe { std::slice::from_raw_parts(start, ph.p_filesz as usize) });
            }
        }
        // The first object reported is the main program: stop there.
        1
    }
    let mut segments: Vec<&'static [u8]> = Vec::new();
    // SAFETY: the callback matches dl_iterate_phdr's contract and only touches `segments`.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut segments).cast()) };
    segments
}

static HOST: OnceLock<Host> = OnceLock::new();

/// The host this process is, detected once.
pub fn current() -> Host {
    *HOST.get_or_init(|| detect_from_rodata(&main_program_rodata()))
}

/// Fits a descriptor to the host: lowers `max_hooks` to the host's hook count (when it is
/// CRIU) and installs the `RESTORE_EXT_FILE` variant with the host's arity.
///
/// # Safety
/// `desc` must point to the plugin's exported descriptor, and nothing may read it concurrently
/// (call it from the library constructor, before `dlopen` returns to CRIU).
pub unsafe fn adapt_descriptor(desc: *mut PluginDesc, restore_ext_file_retry_variant: RawHook) {
    let host = current();
    // SAFETY: the caller guarantees exclusive access to a valid descriptor.
    let desc = unsafe { &mut *desc };
    if host.is_criu() {
        desc.max_hooks = host.hook_count.min(HOOK_SLOTS as u32);
    }
    if host.restore_ext_file_retry && desc.hooks[HookId::RestoreExtFile.index()].is_some() {
        desc.hooks[HookId::RestoreExtFile.index()] = restore_ext_file_retry_variant;
    }
}

/// The shared object this crate was linked into, as the loader names it (the plugin's file),
/// or `None` outside a shared object the loader knows.
pub fn plugin_file() -> Option<std::path::PathBuf> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr fills `info` for an address inside the object holding this function.
    let found = unsafe { libc::dladdr(plugin_file as *const c_void, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader, valid while the
    // object is loaded.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(std::path::PathBuf::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name.to_bytes()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rodata_with(names: &[&str]) -> Vec<u8> {
        let mut v = b"\0some other string\0".to_vec();
        for n in names {
            v.extend_from_slice(n.as_bytes());
            v.push(0);
        }
        v
    }

    fn names_up_to(last: HookId) -> Vec<&'static str> {
        HookId::ALL[..=last.index()]
            .iter()
            .map(|h| h.legacy_symbol())
            .collect()
    }

    #[test]
    fn each_release_family_is_told_apart() {
        let cases = [
            (HookId::DumpExtLink, HostVersion::Pre317, 7, false),
            (HookId::ResumeDevicesLate, HostVersion::V3_17, 10, false),
            (HookId::CheckpointDevices, HostVersion::V4_0, 12, false),
            (HookId::PostForking, HostVersion::V4_2, 13, false),
            (HookId::DumpDevicesLate, HostVersion::Dev, 15, true),
        ];
        for (last, version, count, retry) in cases {
            let data = rodata_with(&names_up_to(last));
            let host = detect_from_rodata(&[&data]);
            assert_eq!(host.version, version, "{last:?}");
            assert_eq!(host.hook_count, count);
            assert_eq!(host.restore_ext_file_retry, retry);
        }
    }

    // Test data is built at run time: NUL-terminated hook names as literals would sit in this
    // test binary's own read-only data and make it look like a CRIU.
    fn cstr(s: &str) -> Vec<u8> {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        v
    }

    #[test]
    fn criu_4_3_is_told_apart_from_criu_dev() {
        let mut data = rodata_with(&names_up_to(HookId::DumpDevicesLate));
        data.extend(cstr("cr_plugin_update_inetsk"));
        let host = detect_from_rodata(&[&data]);
        assert_eq!(host.version, HostVersion::V4_3);
        assert_eq!(host.hook_count, 17);
        assert!(host.restore_ext_file_retry);
        assert_eq!(host.version.to_string(), "CRIU 4.3");
    }

    #[test]
    fn a_name_inside_a_longer_identifier_does_not_count() {
        let pause = HookId::PauseDevices.legacy_symbol();
        let mut data = cstr(&format!("x{pause}"));
        data.extend(cstr(&format!("{pause}_x")));
        data.extend(cstr(&format!("_{pause}")));
        assert_eq!(detect_from_rodata(&[&data]).version, HostVersion::Unknown);
        let merged = cstr(&format!("Failed in {pause}"));
        assert_eq!(detect_from_rodata(&[&merged]).version, HostVersion::V4_0);
    }

    #[test]
    fn names_spread_over_segments_are_found() {
        let a = cstr(HookId::DumpExtLink.legacy_symbol());
        let mut b = vec![0];
        b.extend(cstr(HookId::PostForking.legacy_symbol()));
        assert_eq!(detect_from_rodata(&[&a, &b]).version, HostVersion::V4_2);
    }

    #[test]
    fn a_plain_program_is_not_criu() {
        let host = current();
        assert_eq!(host.version, HostVersion::Unknown);
        assert!(!host.is_criu());
    }

    #[test]
    fn hooks_beyond_the_host_are_absent() {
        let host = Host::for_version(HostVersion::V4_0);
        assert!(host.has_hook(HookId::CheckpointDevices));
        assert!(!host.has_hook(HookId::PostForking));
    }

    #[test]
    fn each_hook_is_called_from_the_release_the_table_names() {
        let families = [
            HostVersion::Pre317,
            HostVersion::V3_17,
            HostVersion::V4_0,
            HostVersion::V4_2,
            HostVersion::Dev,
            HostVersion::V4_3,
        ];
        for h in HookId::ALL {
            for v in families {
                assert_eq!(
                    Host::for_version(v).has_hook(h),
                    v >= h.since(),
                    "{h:?} in {v:?}"
                );
            }
        }
    }
}
