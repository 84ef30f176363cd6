use std::ffi::OsString;

use super::*;

/// This machine's cache flags (the tests that build caches need the value the lookup takes).
fn flags() -> i32 {
    CACHE_FLAGS.unwrap_or(3)
}

/// A directory of its own under the temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("library-search-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    /// `dir/name`, a copy of this test program: an ELF object for this machine.
    fn elf(&self, dir: &str, name: &str) -> PathBuf {
        let d = self.0.join(dir);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(name);
        std::fs::copy(std::env::current_exe().unwrap(), &p).unwrap();
        p
    }

    fn file(&self, dir: &str, name: &str, bytes: &[u8]) -> PathBuf {
        let d = self.0.join(dir);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Entry<'a> {
    flags: i32,
    key: &'a str,
    value: &'a str,
    hwcap: u64,
}

fn entry<'a>(key: &'a str, value: &'a str) -> Entry<'a> {
    Entry {
        flags: flags(),
        key,
        value,
        hwcap: 0,
    }
}

/// A new-format cache table: header, entries, then the strings (offsets from the header).
fn new_table(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut strings = Vec::new();
    let mut offsets = Vec::new();
    let strings_at = NEW_HEADER + entries.len() * NEW_ENTRY;
    for e in entries {
        let key = strings_at + strings.len();
        strings.extend_from_slice(e.key.as_bytes());
        strings.push(0);
        let value = strings_at + strings.len();
        strings.extend_from_slice(e.value.as_bytes());
        strings.push(0);
        offsets.push((key as u32, value as u32));
    }
    let mut out = NEW_MAGIC.to_vec();
    out.extend_from_slice(&(entries.len() as u32).to_ne_bytes());
    out.extend_from_slice(&(strings.len() as u32).to_ne_bytes());
    out.push(NEW_ORDER);
    out.extend_from_slice(&[0; 3 + 4 + 12]);
    assert_eq!(out.len(), NEW_HEADER);
    for (e, (key, value)) in entries.iter().zip(offsets) {
        out.extend_from_slice(&e.flags.to_ne_bytes());
        out.extend_from_slice(&key.to_ne_bytes());
        out.extend_from_slice(&value.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.extend_from_slice(&e.hwcap.to_ne_bytes());
    }
    out.extend_from_slice(&strings);
    out
}

/// An old-format cache (strings from the end of the entries), followed by `then` at the next
/// multiple of 8 when given, the way `ldconfig` of glibc 2.2 to 2.31 wrote both formats.
fn old_cache(entries: &[Entry<'_>], then: Option<&[u8]>) -> Vec<u8> {
    let end = OLD_HEADER + entries.len() * OLD_ENTRY;
    let gap = then.map_or(0, |t| end.next_multiple_of(8) - end + t.len());
    let mut strings = Vec::new();
    let mut out = OLD_MAGIC.to_vec();
    out.push(0);
    out.extend_from_slice(&(entries.len() as u32).to_ne_bytes());
    for e in entries {
        let key = gap + strings.len();
        strings.extend_from_slice(e.key.as_bytes());
        strings.push(0);
        let value = gap + strings.len();
        strings.extend_from_slice(e.value.as_bytes());
        strings.push(0);
        out.extend_from_slice(&e.flags.to_ne_bytes());
        out.extend_from_slice(&(key as u32).to_ne_bytes());
        out.extend_from_slice(&(value as u32).to_ne_bytes());
    }
    if let Some(t) = then {
        out.resize(end.next_multiple_of(8), 0);
        out.extend_from_slice(t);
    }
    out.extend_from_slice(&strings);
    out
}

fn paths(v: &[&str]) -> Vec<PathBuf> {
    v.iter().map(PathBuf::from).collect()
}

#[test]
fn empty_and_relative_library_path_entries_are_skipped() {
    let value = OsString::from("lib::/opt/a;rel/dir;/opt/b:");
    let (dirs, skipped) = absolute_entries(Some(&value));
    assert_eq!(dirs, paths(&["/opt/a", "/opt/b"]));
    assert_eq!(skipped, ["\"lib\"", "\"\"", "\"rel/dir\"", "\"\""]);
    assert_eq!(
        absolute_entries(Some(OsStr::new(""))).0,
        Vec::<PathBuf>::new()
    );
    assert_eq!(absolute_entries(None), (vec![], vec![]));
}

#[test]
fn a_library_behind_a_relative_entry_is_never_found() {
    let t = TempDir::new("relative");
    let planted = t.elf("planted", "libplanted.so.1");
    // The planted directory as a path relative to the working directory: the loader would
    // find the library through it.
    let cwd = std::env::current_dir().unwrap();
    let up = "../".repeat(cwd.components().count());
    let below_root = planted.parent().unwrap().strip_prefix("/").unwrap();
    let rel = format!("{up}{}", below_root.display());
    assert!(Path::new(&rel).join("libplanted.so.1").is_file(), "{rel}");
    let value = OsString::from(format!("{rel}::"));
    let search = Search {
        library_path: Some(&value),
        secure: false,
        cache: &t.0.join("no-cache"),
        system_dirs: &[],
    };
    let e = search.find("libplanted.so.1").unwrap_err();
    let text = e.to_string();
    assert!(text.contains(&format!("\"{rel}\"")), "{text}");
    assert!(
        text.contains("working directory is never searched"),
        "{text}"
    );
}

#[test]
fn absolute_entries_are_searched_in_order_and_foreign_files_passed_over() {
    let t = TempDir::new("order");
    t.file("a", "libx.so.1", b"not an ELF file at all");
    // An ELF header of this word size and byte order for machine 3 (i386).
    let mut foreign = [0u8; 20];
    foreign[..4].copy_from_slice(b"\x7fELF");
    foreign[4] = ELF_CLASS;
    foreign[5] = ELF_DATA;
    foreign[18..].copy_from_slice(&3u16.to_ne_bytes());
    t.file("b", "libx.so.1", &foreign);
    std::fs::create_dir_all(t.0.join("c/libx.so.1")).unwrap();
    let want = t.elf("d", "libx.so.1");
    t.elf("e", "libx.so.1");
    let dirs = ["a", "b", "c", "d", "e"].map(|d| t.0.join(d).display().to_string());
    let value = OsString::from(format!(":{}:", dirs.join(":")));
    let search = Search {
        library_path: Some(&value),
        secure: false,
        cache: &t.0.join("no-cache"),
        system_dirs: &[],
    };
    assert_eq!(search.find("libx.so.1"), Ok(want));
    // In secure-execution mode the variable is not read at all.
    let secure = Search {
        secure: true,
        ..search
    };
    let text = secure.find("libx.so.1").unwrap_err().to_string();
    assert!(
        text.contains("LD_LIBRARY_PATH (ignored in secure-execution mode)"),
        "{text}"
    );

    // Without d and e: not found, each file passed over named with its reason.
    let value = OsString::from(dirs[..3].join(":"));
    let search = Search {
        library_path: Some(&value),
        ..search
    };
    let text = search.find("libx.so.1").unwrap_err().to_string();
    for (dir, why) in [
        ("a", "not an ELF object"),
        ("b", "an ELF object for machine 3"),
        ("c", "not a regular file"),
    ] {
        if dir == "b" && ELF_MACHINE.is_none() {
            continue;
        }
        let p = t.0.join(dir).join("libx.so.1");
        assert!(
            text.contains(&format!("{} ({why}", p.display())),
            "{why}: {text}"
        );
    }
}

#[test]
fn names_that_are_not_bare_are_refused() {
    let search = Search {
        library_path: None,
        secure: false,
        cache: Path::new(LOADER_CACHE),
        system_dirs: SYSTEM_DIRS,
    };
    for bad in [
        "",
        "/lib/libc.so.6",
        "x/libc.so.6",
        ".",
        "..",
        "libc.so.6\0",
    ] {
        let e = search.find(bad).unwrap_err();
        assert!(e.to_string().contains("not a bare library name"), "{bad:?}");
    }
}

#[test]
fn this_machines_cache_and_system_directories_give_libc() {
    // As the plugin searches, from the real environment.
    let p = find("libc.so.6").expect("libc.so.6 through the real search");
    assert!(p.is_absolute() && p.is_file(), "{p:?}");

    if CACHE_FLAGS.is_some() && Path::new(LOADER_CACHE).is_file() {
        let only_cache = Search {
            library_path: None,
            secure: false,
            cache: Path::new(LOADER_CACHE),
            system_dirs: &[],
        };
        let p = only_cache
            .find("libc.so.6")
            .expect("libc.so.6 in the cache");
        assert!(p.is_absolute() && p.is_file(), "{p:?}");
    }
    let only_system = Search {
        library_path: None,
        secure: false,
        cache: Path::new("/nonexistent/ld.so.cache"),
        system_dirs: SYSTEM_DIRS,
    };
    let p = only_system
        .find("libc.so.6")
        .expect("libc.so.6 in the system directories");
    assert!(p.is_absolute() && p.is_file(), "{p:?}");

    let e = only_system.find("libnot-a-library-here.so.9").unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("libnot-a-library-here.so.9 not found in LD_LIBRARY_PATH (unset); the loader cache /nonexistent/ld.so.cache (absent); the system directories ["), "{text}");
    assert!(text.contains(&SYSTEM_DIRS.join(", ")), "{text}");
}

#[test]
fn the_new_format_gives_entries_of_this_abi_without_hwcap_variants() {
    let other_abi = Entry {
        flags: 3 ^ 0x0f00,
        ..entry("libx.so.1", "/other-abi/libx.so.1")
    };
    let variant = Entry {
        hwcap: (1 << 62) | 1,
        ..entry("libx.so.1", "/variant/libx.so.1")
    };
    let isa_level = Entry {
        hwcap: 2 << 32,
        ..entry("libx.so.1", "/isa/libx.so.1")
    };
    let cache = new_table(&[
        entry("liba.so.1", "/a/liba.so.1"),
        other_abi,
        variant,
        entry("libx.so.1", "/lib/libx.so.1"),
        isa_level,
        entry("libx.so.10", "/lib/libx.so.10"),
    ]);
    assert_eq!(
        lookup(&cache, b"libx.so.1", flags()),
        Ok(paths(&["/lib/libx.so.1", "/isa/libx.so.1"]))
    );
    assert_eq!(lookup(&cache, b"libx.so", flags()), Ok(vec![]));
    assert_eq!(lookup(&cache, b"libnone.so", flags()), Ok(vec![]));
}

#[test]
fn the_old_format_and_old_followed_by_new_are_read() {
    let old = [entry("libx.so.1", "/old/libx.so.1")];
    assert_eq!(
        lookup(&old_cache(&old, None), b"libx.so.1", flags()),
        Ok(paths(&["/old/libx.so.1"]))
    );
    // Both: the new table is the one read.
    let new = new_table(&[entry("libx.so.1", "/new/libx.so.1")]);
    let both = old_cache(&old, Some(&new));
    assert_eq!(
        lookup(&both, b"libx.so.1", flags()),
        Ok(paths(&["/new/libx.so.1"]))
    );
}

#[test]
fn hostile_caches_are_refused() {
    let good = new_table(&[entry("libx.so.1", "/lib/libx.so.1")]);
    let patch = |at: usize, bytes: &[u8]| {
        let mut c = good.clone();
        c[at..at + bytes.len()].copy_from_slice(bytes);
        c
    };
    let entry0 = NEW_HEADER;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("magic", patch(0, b"x"), "not a loader cache"),
        (
            "count",
            patch(20, &u32::MAX.to_ne_bytes()),
            "run past the end",
        ),
        ("order", patch(28, &[NEW_ORDER ^ 1]), "another byte order"),
        (
            "value offset",
            patch(entry0 + 8, &u32::MAX.to_ne_bytes()),
            "past the end",
        ),
        (
            "relative value",
            patch(good.len() - 15, b"l"),
            "not absolute",
        ),
        (
            "unterminated",
            patch(good.len() - 1, b"x"),
            "not terminated",
        ),
        (
            "old count",
            {
                let mut c = old_cache(&[entry("libx.so.1", "/x")], None);
                c[12..16].copy_from_slice(&u32::MAX.to_ne_bytes());
                c
            },
            "run past the end",
        ),
    ];
    for (what, cache, want) in cases {
        let e = lookup(&cache, b"libx.so.1", flags()).unwrap_err();
        assert!(e.to_string().contains(want), "{what}: {e}");
    }
    // A key offset out of bounds matches nothing.
    let far_key = patch(entry0 + 4, &u32::MAX.to_ne_bytes());
    assert_eq!(lookup(&far_key, b"libx.so.1", flags()), Ok(vec![]));
    // A path without its NUL in the first 4096 bytes.
    let mut long = good.clone();
    long.truncate(long.len() - 15);
    long.extend(std::iter::repeat_n(b'a', MAX_PATH + 10));
    long.push(0);
    assert!(
        lookup(&long, b"libx.so.1", flags())
            .unwrap_err()
            .to_string()
            .contains("not terminated")
    );
}

#[test]
fn every_truncation_and_many_corruptions_end_without_a_panic() {
    let new = new_table(&[
        entry("liba.so.1", "/a/liba.so.1"),
        entry("libx.so.1", "/lib/libx.so.1"),
    ]);
    let both = old_cache(&[entry("libx.so.1", "/old/libx.so.1")], Some(&new));
    for cache in [&new, &both] {
        for len in 0..cache.len() {
            let _ = lookup(&cache[..len], b"libx.so.1", flags());
        }
        // Deterministic byte corruptions (xorshift).
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let mut c = cache.clone();
            for _ in 0..4 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let at = (seed % c.len() as u64) as usize;
                c[at] = (seed >> 32) as u8;
            }
            if let Ok(found) = lookup(&c, b"libx.so.1", flags()) {
                assert!(found.iter().all(|p| p.is_absolute()), "{found:?}");
            }
        }
    }
}

#[test]
fn a_cache_too_large_or_not_a_file_is_not_read_and_the_search_goes_on() {
    let t = TempDir::new("cache");
    let lib = t.elf("sys", "libx.so.1");
    let sys = t.0.join("sys").display().to_string();
    let system_dirs = [sys.as_str()];

    let large = t.0.join("large.cache");
    let f = File::create(&large).unwrap();
    f.set_len(MAX_CACHE_BYTES + 1).unwrap();
    let fifo = t.0.join("fifo.cache");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let dir = t.0.join("sys");
    for (cache, why) in [
        (&large, "more than"),
        (&fifo, "not a regular file"),
        (&dir, "not a regular file"),
    ] {
        let search = Search {
            library_path: None,
            secure: false,
            cache,
            system_dirs: &system_dirs,
        };
        assert_eq!(search.find("libx.so.1"), Ok(lib.clone()));
        let text = search.find("liby.so.1").unwrap_err().to_string();
        let at = text
            .find(&format!("{} (not read: ", cache.display()))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(text[at..].contains(why), "{text}");
    }

    // A readable cache that names the library: its path wins over the system directories.
    let cached = t.elf("cached", "libx.so.1");
    let file = t.file(
        "",
        "ld.so.cache",
        &new_table(&[entry("libx.so.1", cached.to_str().unwrap())]),
    );
    let search = Search {
        library_path: None,
        secure: false,
        cache: &file,
        system_dirs: &system_dirs,
    };
    assert_eq!(search.find("libx.so.1"), Ok(cached));
}
