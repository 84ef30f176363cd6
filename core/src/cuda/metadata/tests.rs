//! The image's round trip, its versions, and hostile or damaged input.

use super::*;

fn sample() -> CudaMetadata {
    CudaMetadata {
        driver_version: 13000,
        driver_release: Some("580.159.04".into()),
        gpus: vec![Gpu {
            uuid: GpuUuid([0xab; 16]),
            model: "NVIDIA H100 80GB HBM3".into(),
            bus: "0000:00:06.0".into(),
            memory: 85_899_345_920,
            minor: None,
        }],
        processes: vec![ProcessRecord {
            pid: 1234,
            restore_tid: 1240,
            found: FoundState::Running,
            host_bytes: 1 << 33,
        }],
    }
}

/// `records` (header included) with the checksum trailer of version 1.1.
fn sealed(records: &str) -> String {
    format!(
        "{records}crc32 {:08x}\n",
        crc32fast::hash(records.as_bytes())
    )
}

#[test]
fn a_header_with_a_stray_space_is_shown_as_written() {
    let e = CudaMetadata::decode("gpu-plugin-cuda 1 \n").unwrap_err();
    assert!(matches!(e, MetadataError::BadHeader { .. }), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("(first line \"gpu-plugin-cuda 1 \")"), "{e}");
}

#[test]
fn round_trip() {
    let md = sample();
    let text = md.encode();
    assert!(
        text.starts_with("gpu-plugin-cuda 1.1\ndriver 13000 580.159.04\ngpu GPU-abab"),
        "{text}"
    );
    let (records, trailer) = text.trim_end().rsplit_once('\n').unwrap();
    assert_eq!(
        trailer,
        format!(
            "crc32 {:08x}",
            crc32fast::hash(format!("{records}\n").as_bytes())
        )
    );
    assert_eq!(
        CudaMetadata::decode_versioned(&text).unwrap(),
        (md, FormatVersion::CURRENT)
    );
}

/// What the plugin wrote before the format had a minor version and a checksum.
#[test]
fn an_image_of_format_1_0_is_still_read() {
    let old = include_str!("../testdata/gpu-plugin-cuda-1.0.img");
    assert!(old.starts_with("gpu-plugin-cuda 1\n") && !old.contains("crc32"));
    let (md, version) = CudaMetadata::decode_versioned(old).unwrap();
    assert_eq!(version, FormatVersion::V1_0);
    assert_eq!(version.to_string(), "1.0");
    assert_eq!(md.driver_version, 13000);
    assert_eq!(md.driver_release.as_deref(), Some("580.159.04"));
    let gpus: Vec<String> = md.gpus.iter().map(|g| g.uuid.to_string()).collect();
    assert_eq!(
        gpus,
        [
            "GPU-b585ed72-f703-359b-5d2c-7c490dad1115",
            "GPU-53f5f911-9265-6b0a-9031-cbb5cd45a092"
        ]
    );
    assert!(md.gpus.iter().all(|g| g.model == "NVIDIA H200"));
    let processes: Vec<(i32, i32, FoundState, u64)> = md
        .processes
        .iter()
        .map(|p| (p.pid, p.restore_tid, p.found, p.host_bytes))
        .collect();
    assert_eq!(
        processes,
        [
            (1, 7, FoundState::Running, 1 << 30),
            (2, 9, FoundState::Locked, 0),
            (15, 16, FoundState::Checkpointed, 8 << 20),
        ]
    );
    // Written again, it is the current format with the same records.
    let again = md.encode();
    assert!(again.starts_with("gpu-plugin-cuda 1.1\n"));
    assert_eq!(CudaMetadata::decode(&again).unwrap(), md);
    assert_eq!(
        again
            .strip_prefix("gpu-plugin-cuda 1.1\n")
            .unwrap()
            .rsplit_once("crc32")
            .unwrap()
            .0,
        old.strip_prefix("gpu-plugin-cuda 1\n").unwrap()
    );
}

#[test]
fn versions_are_read_by_major_and_minor() {
    let records = "driver 1 -\n";
    let read = |header: &str| {
        let body = format!("gpu-plugin-cuda {header}\n{records}");
        CudaMetadata::decode_versioned(&sealed(&body))
            .or_else(|_| CudaMetadata::decode_versioned(&body))
            .map(|(_, v)| v)
    };
    assert_eq!(read("1"), Ok(FormatVersion::V1_0));
    assert_eq!(read("1.0"), Ok(FormatVersion::V1_0));
    assert_eq!(read("1.1"), Ok(FormatVersion::CURRENT));
    for (header, want) in [
        ("1.2", "newer plugin"),
        ("2", "format \"2\""),
        ("2.0", "reads versions 1.0 to 1.1"),
        ("0.9", "does not read"),
        ("1.01", "has format \"1.01\""),
        ("+1", "has format \"+1\""),
        ("1.", "has format \"1.\""),
        ("", "has format \"\""),
        ("99999999999", "has format"),
    ] {
        let e = read(header).unwrap_err();
        assert!(e.to_string().contains(want), "{header:?}: {e}");
    }
    assert!(!read("0.9").unwrap_err().to_string().contains("newer"));
}

#[test]
fn a_damaged_or_truncated_image_is_refused_by_its_checksum() {
    let good = sample().encode();
    assert!(CudaMetadata::decode(&good).is_ok());
    // Any one byte changed in the records.
    for at in "gpu-plugin-cuda 1.1\n".len()..good.rfind("crc32").unwrap() - 1 {
        let mut bad = good.clone().into_bytes();
        bad[at] = if bad[at] == b'1' { b'2' } else { b'1' };
        let Ok(bad) = String::from_utf8(bad) else {
            continue;
        };
        assert!(CudaMetadata::decode(&bad).is_err(), "byte {at}: {bad}");
    }
    // A process record edited into one that still parses.
    let edited = good.replace("process 1234 1240 running", "process 1234 1240 locked");
    assert!(
        matches!(
            CudaMetadata::decode(&edited),
            Err(MetadataError::ChecksumMismatch { .. })
        ),
        "{edited}"
    );
    let cut = &good[..good.rfind("crc32").unwrap()];
    let e = CudaMetadata::decode(cut).unwrap_err();
    assert!(matches!(e, MetadataError::NoChecksum { .. }), "{e:?}");
    assert!(e.to_string().contains("truncated?"), "{e}");
    for bad_trailer in [
        "crc32 ABCDEF12",
        "crc32 1234567",
        "crc32 +1234567",
        "crc32  12345678",
    ] {
        let text = format!("{cut}{bad_trailer}\n");
        assert!(
            matches!(
                CudaMetadata::decode(&text),
                Err(MetadataError::NoChecksum { .. })
            ),
            "{text}"
        );
    }
    let after = format!("{good}process 5 6 running 0\n");
    assert!(matches!(
        CudaMetadata::decode(&after),
        Err(MetadataError::NoChecksum { .. })
    ));
    assert!(matches!(
        CudaMetadata::decode("gpu-plugin-cuda 1.1\n"),
        Err(MetadataError::NoChecksum { .. })
    ));
    // Without its last newline it is still whole.
    assert!(CudaMetadata::decode(good.trim_end()).is_ok());
}

#[test]
fn hostile_input_is_refused_clearly() {
    let good = sample().encode();
    let cases = [
        ("", "does not start"),
        ("gpu-plugin-cuda 2\n", "format \"2\""),
        ("gpu-plugin-cuda 1\n", "no driver record"),
        ("gpu-plugin-cuda 1\ndriver x -\n", "bad driver version"),
        ("gpu-plugin-cuda 1\ndriver 1 -\nwat\n", "unknown record"),
        (
            "gpu-plugin-cuda 1\ndriver 1 -\ncrc32 00000000\n",
            "unknown record",
        ),
        (
            "gpu-plugin-cuda 1\ndriver 1 -\ngpu GPU-1 2 b m\n",
            "bad GPU UUID",
        ),
        (
            "gpu-plugin-cuda 1\ndriver 1 -\nprocess -5 1 running 0\n",
            "bad pid",
        ),
        (
            "gpu-plugin-cuda 1\ndriver 1 -\nprocess 5 99999999999 running 0\n",
            "bad pid",
        ),
        (
            "gpu-plugin-cuda 1\ndriver 1 -\nprocess 5 6 frozen 0\n",
            "bad process state",
        ),
    ];
    for (text, want) in cases {
        let err = CudaMetadata::decode(text).unwrap_err().to_string();
        assert!(err.contains(want), "{text:?}: {err}");
        if let Some(records) = text.strip_prefix("gpu-plugin-cuda 1\n") {
            // The same refusal in the current format.
            let sealed = sealed(&format!("gpu-plugin-cuda 1.1\n{records}"));
            let err = CudaMetadata::decode(&sealed).unwrap_err().to_string();
            assert!(err.contains(want), "{sealed:?}: {err}");
        }
    }
    let e = CudaMetadata::decode("gpu-plugin-cuda 1\ndriver 1 -\nwat\n").unwrap_err();
    assert_eq!(
        e,
        MetadataError::BadRecord {
            line: 3,
            what: "unknown record",
            text: "wat".into()
        }
    );
    let long = format!("gpu-plugin-cuda 1\ndriver 1 -\n{}\n", "x".repeat(10_000));
    assert!(CudaMetadata::decode(&long).unwrap_err().to_string().len() < 300);
    let huge = good.repeat((MAX_BYTES as usize / good.len()) + 2);
    assert_eq!(CudaMetadata::decode(&huge), Err(MetadataError::TooLarge));
    assert_eq!(
        CudaMetadata::decode_bytes(huge.as_bytes()),
        Err(MetadataError::TooLarge)
    );
    assert_eq!(
        CudaMetadata::decode_bytes(b"gpu-plugin-cuda 1\ndriver 1 \xff\n"),
        Err(MetadataError::NotText)
    );
}

#[test]
fn records_are_bounded() {
    let gpu = "gpu GPU-b585ed72-f703-359b-5d2c-7c490dad1115 1 b m\n";
    let mut text = String::from("gpu-plugin-cuda 1\ndriver 1 -\n");
    text.push_str(&gpu.repeat(MAX_GPU_RECORDS));
    assert_eq!(
        CudaMetadata::decode(&text).unwrap().gpus.len(),
        MAX_GPU_RECORDS
    );
    text.push_str(gpu);
    let e = CudaMetadata::decode(&text).unwrap_err();
    assert_eq!(
        e,
        MetadataError::TooManyRecords {
            kind: "gpu",
            limit: MAX_GPU_RECORDS
        }
    );
    let mut text = String::from("gpu-plugin-cuda 1\ndriver 1 -\n");
    text.push_str(&"process 1 1 running 0\n".repeat(MAX_PROCESS_RECORDS + 1));
    assert!(text.len() as u64 <= MAX_BYTES);
    assert!(matches!(
        CudaMetadata::decode(&text),
        Err(MetadataError::TooManyRecords {
            kind: "process",
            ..
        })
    ));
}
