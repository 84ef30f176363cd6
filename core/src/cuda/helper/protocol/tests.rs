//! The reply encoding: every reply reads back; cut, oversized, unknown and other-version input is refused.

use super::*;

fn cuda(call: DriverCall) -> DriverError {
    DriverError::Cuda(CudaError {
        call: call.name(),
        pid: Some(42),
        code: CUresult::NOT_PERMITTED,
        name: Some("CUDA_ERROR_NOT_PERMITTED".into()),
        text: Some("operation not permitted".into()),
    })
}

/// One reply of every kind, each value of every kind in it.
fn samples() -> Vec<Reply> {
    let states = [
        ProcessState::Running,
        ProcessState::Locked,
        ProcessState::Checkpointed,
        ProcessState::Failed,
        ProcessState::Checkpointing,
        ProcessState::Restoring,
        ProcessState::Unknown(77),
    ];
    vec![
        Reply::Memory(Ok(vec![(
            GpuUuid([3; 16]),
            GpuMemory {
                total: 80 << 30,
                free: 1 << 30,
            },
        )])),
        Reply::Memory(Err(NvmlFailed("libnvidia-ml.so.1 cannot be loaded".into()))),
        Reply::StateAndLock {
            state: Ok(ProcessState::Running),
            lock: Some(Err(CallError::Helper("not told".into()))),
            in_driver: Duration::from_micros(1234),
        },
        Reply::StateAndLock {
            state: Err(cuda(DriverCall::GetState)),
            lock: None,
            in_driver: Duration::ZERO,
        },
        Reply::UnlockIfLocked(Ok(true)),
        Reply::UnlockIfLocked(Err(DriverError::InvalidArgument("pid".into()))),
        Reply::States(
            states
                .iter()
                .enumerate()
                .map(|(i, s)| (i as i32, Some(Ok(*s))))
                .chain([(8, None), (9, Some(Err(cuda(DriverCall::GetState))))])
                .collect(),
        ),
        Reply::Steps(Err(cuda(DriverCall::Init))),
        Reply::Steps(Ok(vec![
            (1, Ok(()), Duration::from_millis(3)),
            (2, Err(cuda(DriverCall::Restore).into()), Duration::ZERO),
            (
                3,
                Err(CallError::Panic {
                    pid: 3,
                    message: "boom".into(),
                }),
                Duration::ZERO,
            ),
            (4, Err(CallError::Process("ended".into())), Duration::ZERO),
            (
                5,
                Err(CallError::System {
                    message: "ptrace".into(),
                    errno: libc::ESRCH,
                }),
                Duration::ZERO,
            ),
        ])),
    ]
}

#[test]
fn every_reply_reads_back_as_written() {
    for reply in samples() {
        assert_eq!(decode(&encode(&reply)), Ok(reply));
    }
}

#[test]
fn a_driver_error_of_no_known_call_travels_as_its_message() {
    let e = DriverError::MissingSymbol("cuCheckpointProcessLock");
    let reply = Reply::UnlockIfLocked(Err(e.clone()));
    assert_eq!(
        decode(&encode(&reply)),
        Ok(Reply::UnlockIfLocked(Err(DriverError::InvalidArgument(
            e.to_string()
        ))))
    );
}

#[test]
fn a_reply_cut_anywhere_is_refused() {
    for reply in samples() {
        let bytes = encode(&reply);
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "{reply:?} cut at {n}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), Err(Malformed::Trailing(1)));
    }
}

#[test]
fn another_version_is_refused() {
    let mut bytes = encode(&Reply::UnlockIfLocked(Ok(false)));
    bytes[0] = VERSION + 1;
    assert_eq!(decode(&bytes), Err(Malformed::Version(VERSION + 1)));
    assert_eq!(decode(&[]), Err(Malformed::Truncated));
}

#[test]
fn oversized_lengths_are_refused_before_anything_is_allocated() {
    // A States reply claiming more processes than allowed.
    let mut bytes = vec![VERSION, 3];
    (MAX_ITEMS as u64 + 1).put(&mut bytes);
    assert_eq!(
        decode(&bytes),
        Err(Malformed::TooLong {
            len: MAX_ITEMS as u64 + 1,
            max: MAX_ITEMS
        })
    );
    // A message longer than allowed (a Memory error), and one claiming u64::MAX bytes.
    for len in [MAX_TEXT as u64 + 1, u64::MAX] {
        let mut bytes = vec![VERSION, 0, 1];
        len.put(&mut bytes);
        assert_eq!(
            decode(&bytes),
            Err(Malformed::TooLong { len, max: MAX_TEXT })
        );
    }
    // As many processes as allowed, but no bytes for them.
    let mut bytes = vec![VERSION, 3];
    (MAX_ITEMS as u64).put(&mut bytes);
    assert_eq!(decode(&bytes), Err(Malformed::Truncated));
}

#[test]
fn unknown_tags_are_refused() {
    assert_eq!(
        decode(&[VERSION, 9]),
        Err(Malformed::Tag {
            what: "reply",
            tag: 9
        })
    );
    // UnlockIfLocked(Err(driver error of call number 200)).
    assert_eq!(
        decode(&[VERSION, 2, 1, 0, 200]),
        Err(Malformed::Tag {
            what: "driver call",
            tag: 200
        })
    );
    // UnlockIfLocked(Ok(bool 7)).
    assert_eq!(
        decode(&[VERSION, 2, 0, 7]),
        Err(Malformed::Tag {
            what: "bool",
            tag: 7
        })
    );
}

#[test]
fn long_messages_are_cut_not_refused() {
    let reply = Reply::Memory(Err(NvmlFailed("x".repeat(MAX_TEXT * 2))));
    let Ok(Reply::Memory(Err(NvmlFailed(m)))) = decode(&encode(&reply)) else {
        panic!("not read back");
    };
    assert_eq!(m.len(), MAX_TEXT);
}
