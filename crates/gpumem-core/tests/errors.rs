//! Bad input gets a typed error with a clear message and loses nothing: zero and absurd sizes,
//! foreign pointers, double frees, and malformed, truncated or foreign trace files.

use gpumem_core::backend::sim::{SimBackend, SimConfig};
use gpumem_core::testing::{bundled_trace, TestRng};
use gpumem_core::trace::{self, Kind};
use gpumem_core::{AllocError, Allocator, Config, PolicyKind, TraceError};
use std::io::{Read, Write};

fn allocator(policy: PolicyKind) -> Allocator {
    let (sim, _) = SimBackend::new(SimConfig::default());
    Allocator::new(
        Box::new(sim),
        Config::parse(&format!("policy:{}", policy.name())).unwrap(),
    )
    .unwrap()
}

#[test]
fn sizes_zero_and_absurd_are_refused_with_reasons() {
    for p in PolicyKind::ALL {
        let a = allocator(p);
        match a.allocate(0, 0) {
            Err(AllocError::InvalidSize { size: 0, reason }) => assert!(reason.contains("zero")),
            other => panic!("{p:?}: size 0 gave {other:?}"),
        }
        match a.allocate(1 << 50, 0) {
            Err(e @ AllocError::InvalidSize { .. }) => {
                assert!(
                    e.to_string().contains("larger than the whole device"),
                    "{e}"
                )
            }
            other => panic!("{p:?}: 1 PiB gave {other:?}"),
        }
        // Nothing was lost: the allocator still works and holds nothing for the failures.
        let ok = a.allocate(4096, 0).unwrap();
        a.free(ok.ptr).unwrap();
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
        assert_eq!(
            a.memory_stats().num_ooms,
            1,
            "an impossible size counts as an OOM"
        );
    }
}

#[test]
fn foreign_pointers_and_double_frees_are_reported_not_trusted() {
    for p in PolicyKind::ALL {
        let a = allocator(p);
        let x = a.allocate(3 << 20, 0).unwrap();
        let y = a.allocate(3 << 20, 0).unwrap();
        // A pointer gpumem never handed out, and one inside a live block.
        for bad in [0xdead_beef_u64, x.ptr + 512] {
            match a.free(bad) {
                Err(e @ AllocError::UnknownPointer { .. }) => {
                    assert!(e
                        .to_string()
                        .contains("not allocated by this gpumem allocator"))
                }
                other => panic!("{p:?}: free({bad:#x}) gave {other:?}"),
            }
            assert!(
                matches!(
                    a.record_stream(bad, 7),
                    Err(AllocError::UnknownPointer { ptr }) if ptr == bad
                ),
                "{p:?}: record_stream({bad:#x})"
            );
        }
        a.free(x.ptr).unwrap();
        match a.free(x.ptr) {
            Err(AllocError::DoubleFree { ptr }) | Err(AllocError::UnknownPointer { ptr }) => {
                assert_eq!(ptr, x.ptr)
            }
            other => panic!("{p:?}: double free gave {other:?}"),
        }
        // The other block is untouched and still freeable; the statistics stayed exact.
        assert_eq!(a.memory_stats().allocation.all.current, 1);
        a.free_allocation(&y).unwrap();
        assert!(
            a.free_allocation(&y).is_err(),
            "{p:?}: second free of an Allocation"
        );
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
        a.check().unwrap();
    }
}

#[test]
fn double_free_is_named_as_such() {
    let a = allocator(PolicyKind::Native);
    let x = a.allocate(1 << 20, 0).unwrap();
    let _keep = a.allocate(1 << 20, 0).unwrap();
    a.free(x.ptr).unwrap();
    let e = a.free(x.ptr).unwrap_err();
    assert!(matches!(e, AllocError::DoubleFree { .. }), "{e:?}");
    assert!(e.to_string().contains("double free"));
}

#[test]
fn a_never_handed_out_pointer_at_a_free_block_is_refused_and_the_message_allows_for_it() {
    // The free rest of a split segment starts at an address gpumem never handed out; without a
    // record of past frees it reads as a double free, so the message names both causes.
    let a = allocator(PolicyKind::Native);
    let x = a.allocate(1 << 20, 0).unwrap();
    let rest = x.ptr + (1 << 20);
    let e = a.free(rest).unwrap_err();
    assert!(
        matches!(e, AllocError::DoubleFree { ptr } if ptr == rest),
        "{e:?}"
    );
    assert!(e.to_string().contains("never handed out"), "{e}");
    // Nothing was lost: the real block frees and the pool is consistent.
    a.free(x.ptr).unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
    a.check().unwrap();
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut w = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    w.write_all(bytes).unwrap();
    w.finish().unwrap()
}

fn read(bytes: Vec<u8>) -> Result<trace::Trace, TraceError> {
    trace::read(Box::new(std::io::Cursor::new(bytes)), "test", 0, None)
}

fn bundled_pickle() -> Vec<u8> {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(
        std::fs::File::open(bundled_trace("validation/mlp.pickle.gz")).unwrap(),
    )
    .read_to_end(&mut raw)
    .unwrap();
    raw
}

#[test]
fn truncated_snapshots_are_errors_not_panics() {
    let raw = bundled_pickle();
    let whole = read(raw.clone()).unwrap();
    // The untruncated file, loaded from disk by the same reader (the gzip path, as users load
    // it): the decompressed bytes read whole give every one of its events, no more, no fewer.
    // (mlp.pickle.gz holds 1467 trace entries: 483 alloc, 480 free_requested, 480
    // free_completed, 24 segment_alloc.)
    let expected = trace::load(&bundled_trace("validation/mlp.pickle.gz"), 0, None)
        .unwrap()
        .events
        .len();
    assert_eq!(whole.events.len(), expected);
    assert_eq!(read(gz(&raw)).unwrap().events.len(), expected);
    for cut in [
        1,
        2,
        10,
        raw.len() / 3,
        raw.len() / 2,
        raw.len() - 2,
        raw.len() - 1,
    ] {
        for bytes in [raw[..cut].to_vec(), gz(&raw[..cut])] {
            match read(bytes) {
                Err(TraceError::Truncated(m)) => assert!(m.contains("ends"), "{m}"),
                Err(TraceError::Malformed { .. }) | Err(TraceError::UnknownFormat(_)) => {}
                Ok(t) => panic!(
                    "cut at {cut}: read {} events from a truncated file",
                    t.events.len()
                ),
                Err(e) => panic!("cut at {cut}: unexpected error {e}"),
            }
        }
    }
}

#[test]
fn corrupted_snapshots_are_errors_not_panics() {
    let raw = bundled_pickle();
    // Flip bytes here and there: every outcome must be an error or a trace, never a panic.
    let mut rng = TestRng::new(0x1234_5678);
    for _ in 0..300 {
        let mut bad = raw.clone();
        for _ in 0..4 {
            // Low bits pick the byte, high bits the flip.
            let x = rng.next_u64();
            let i = (x as usize) % bad.len();
            bad[i] ^= (x >> 32) as u8 | 1;
        }
        let _ = read(bad);
    }
    // A damaged gzip stream is named.
    let mut z = gz(&raw);
    let n = z.len();
    z[n / 2] ^= 0xff;
    z[n / 2 + 1] ^= 0xff;
    match read(z) {
        Err(e @ TraceError::Malformed { .. }) => {
            assert!(e.to_string().contains("gzip stream is damaged"), "{e}")
        }
        other => panic!(
            "damaged gzip stream gave {:?}",
            other.map(|t| t.events.len())
        ),
    }
}

#[test]
fn foreign_files_are_named() {
    for bytes in [
        b"hello world\n".to_vec(),
        vec![0u8; 64],
        gz(b"{\"json\": true}"),
    ] {
        match read(bytes) {
            Err(e @ TraceError::UnknownFormat(_)) => {
                assert!(e.to_string().contains("not a PyTorch snapshot"), "{e}")
            }
            other => panic!("gave {other:?}"),
        }
    }
    let e = trace::load(std::path::Path::new("/no/such/trace.pickle.gz"), 0, None).unwrap_err();
    assert!(
        matches!(e, TraceError::Io { .. }) && e.to_string().contains("/no/such/trace.pickle.gz")
    );
}

/// Frees by pointer with the stream PyTorch passes: the block's own stream, another stream
/// (found by the fallback search), a second free of the same pointer (a double free) and a
/// pointer nobody handed out. Nothing is lost on the errors.
#[test]
fn free_on_a_stream_finds_the_block_or_says_why_not() {
    for p in PolicyKind::ALL {
        let a = allocator(p);
        let (s1, s2) = (0x100, 0x200);
        let x = a.allocate(3 << 20, s1).unwrap();
        let y = a.allocate(5000, s2).unwrap();
        let z = a.allocate(1 << 20, s1).unwrap();
        a.free_on(x.ptr, s1).unwrap();
        // Allocated on s2, freed naming s1 (and a stream never seen): found anyway.
        a.free_on(y.ptr, s1).unwrap();
        match a.free_on(x.ptr, s1) {
            Err(AllocError::DoubleFree { ptr }) => assert_eq!(ptr, x.ptr, "{p:?}"),
            other => panic!("{p:?}: second free gave {other:?}"),
        }
        assert!(matches!(
            a.free_on(0xdead_beef, 0x300),
            Err(AllocError::UnknownPointer { ptr: 0xdead_beef })
        ));
        // The reserved handle (-1) is named as such, not as a full stream table.
        match a.allocate(4096, u64::MAX) {
            Err(e @ AllocError::ReservedStream { stream: u64::MAX }) => {
                assert!(e.to_string().contains("-1 is not a stream"), "{e}")
            }
            other => panic!("{p:?}: stream -1 gave {other:?}"),
        }
        // z is still live and accounted; freeing it by pointer on its stream works.
        let st = a.memory_stats();
        assert_eq!(st.allocated_bytes.all.current as u64, z.size, "{p:?}");
        a.free_on(z.ptr, s1).unwrap();
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0, "{p:?}");
    }
}

#[test]
fn a_free_whose_event_fails_leaves_the_block_live_and_can_be_retried() {
    for p in PolicyKind::ALL {
        // Recording an event on a stream fails, as on a stream destroyed while a block used
        // on it was still live.
        let (backend, faults, _) = gpumem_core::testing::FaultySim::new(SimConfig::default());
        let a = Allocator::new(
            Box::new(backend),
            Config::parse(&format!("policy:{}", p.name())).unwrap(),
        )
        .unwrap();
        let x = a.allocate(3 << 20, 0).unwrap();
        a.record_stream(x.ptr, 9).unwrap();
        a.record_stream(x.ptr, 7).unwrap();
        faults.refuse_events_on(7);
        let before = a.memory_stats();
        let e = a.free(x.ptr).unwrap_err();
        assert!(
            e.to_string().contains("invalid resource handle"),
            "{p:?}: {e}"
        );
        // Nothing changed: still allocated, and its uses are still known.
        let after = a.memory_stats();
        assert_eq!(
            after.allocated_bytes.all.current, before.allocated_bytes.all.current,
            "{p:?}"
        );
        assert_eq!(after.active.all.current, 1, "{p:?}");
        // Once the stream can record again, the same free goes through and the block waits
        // for both streams' events (here completing at once) before it is reused.
        faults.disarm();
        a.free(x.ptr).unwrap();
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0, "{p:?}");
        a.synchronize_events().unwrap();
        assert_eq!(a.memory_stats().active.all.current, 0, "{p:?}");
        // A second free is a double free, not a success.
        assert!(a.free(x.ptr).is_err(), "{p:?}");
    }
}

/// Pickles crafted to break the reader (found by fuzzing `gpumem replay`): each must give an
/// error or a trace, quickly and in little memory, never a panic.
#[test]
fn crafted_pickles_are_errors_not_panics_or_blowups() {
    // A trace entry whose memo reference names the slot its own dict takes, and one whose
    // reference is overwritten by a string memoized inside the same entry (the reader's fast
    // path for entries indexed out of bounds / hit an "unreachable" branch).
    for bytes in [
        &b"\x80\x04]\x94\x8c\x06actionq\x010}\x94(h\x01\x8c\x05alloc\x94uaN0N0N0N0N0N0N0N0."[..],
        &b"\x80\x04]\x94\x8c\x06actionq\x020}\x94(\x8c\x03foo\x94K\x01h\x02\x8c\x05alloc\x94uaN0N0N0N0N0N0N0N0."[..],
    ] {
        let e = read(bytes.to_vec()).unwrap_err();
        assert!(e.to_string().contains("no allocation history"), "{e}");
    }
    // A 9-byte pickle putting a value at memo index 2^31 - 1 (asked for 8 GiB).
    let e = read(b"\x80\x02Nr\xff\xff\xff\x7f.".to_vec()).unwrap_err();
    assert!(
        e.to_string().contains("memo index 2147483647 far beyond"),
        "{e}"
    );
    // DUP then APPEND, 40 times: a list that would double each time if DUP copied it.
    let mut dup = b"\x80\x04]".to_vec();
    for _ in 0..40 {
        dup.extend_from_slice(b"2a");
    }
    dup.push(b'.');
    let t0 = std::time::Instant::now();
    assert!(read(dup).is_err());
    // 400,000 APPENDs with the stack kept deep (each APPEND once scanned the whole stack).
    let mut deep = b"\x80\x04".to_vec();
    deep.extend(std::iter::repeat_n(b'N', 200_000));
    deep.extend_from_slice(b"]");
    for _ in 0..400_000 {
        deep.extend_from_slice(b"Na");
    }
    deep.push(b'.');
    assert!(read(gz(&deep)).is_err());
    // Lists nested 100,000 deep (200 KB): dropping them once overflowed the stack.
    let mut nested = b"\x80\x04".to_vec();
    nested.extend(std::iter::repeat_n(b']', 100_000));
    nested.extend(std::iter::repeat_n(b'a', 99_999));
    nested.push(b'.');
    let e = read(nested).unwrap_err();
    assert!(e.to_string().contains("no allocation history"), "{e}");
    // Memo puts, each 65,536 past the last (5 bytes apiece): the memo grew without bound.
    let mut chain = b"\x80\x04N".to_vec();
    for k in 1..4_000u32 {
        chain.push(b'r');
        chain.extend_from_slice(&(k << 16).to_le_bytes());
    }
    chain.push(b'.');
    let e = read(chain).unwrap_err();
    assert!(e.to_string().contains("memo index 65536 far beyond"), "{e}");
    // Four million EMPTY_LISTs, gzipped to a few KB: the stack is refused at a million.
    let mut bomb = b"\x80\x04".to_vec();
    bomb.extend(std::iter::repeat_n(b']', 4 << 20));
    let e = read(gz(&bomb)).unwrap_err();
    assert!(e.to_string().contains("pickle stack holds over"), "{e}");
    // A LONG4 announcing 4 GiB, and a string of 1 GiB: refused or read past, never held.
    let e = read(b"\x80\x04\x8b\xff\xff\xff\xffabc".to_vec()).unwrap_err();
    assert!(e.to_string().contains("inside LONG"), "{e}");
    let e = read(b"\x80\x04X\x00\x00\x00\x40abc".to_vec()).unwrap_err();
    assert!(e.to_string().contains("string of 1073741824 bytes"), "{e}");
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn text_logs_with_absurd_lines_are_errors() {
    // One header line of 4 MiB: refused at 1 MiB, without splitting it into columns.
    let long = format!("Thread,Time,Action,{}\n", ",".repeat(4 << 20));
    let e = read(long.into_bytes()).unwrap_err();
    assert!(
        e.to_string().contains("a line longer than 1048576 bytes"),
        "{e}"
    );
    // A time far beyond any clock is a bad time, not an overflow.
    let log = "Thread,Time,Action,Pointer,Size,Stream\n1,1e300:0:0,allocate,0x10,16,0\n";
    let e = read(log.as_bytes().to_vec()).unwrap_err();
    assert!(e.to_string().contains("bad time"), "{e}");
}

/// A trace event on stream 0 at time 0.
fn ev(kind: Kind, addr: u64, size: u64) -> trace::Event {
    trace::Event {
        kind,
        stream: 0,
        addr,
        size,
        time_us: 0,
    }
}

#[test]
fn what_a_replay_leaves_out_is_said() {
    let t = trace::Trace {
        events: vec![
            ev(Kind::Alloc, 0x1000, 512),
            ev(Kind::Alloc, 0x2000, 0),
            ev(Kind::FreeRequested, 0x9000, 512),
            ev(Kind::FreeRequested, 0x1000, 512),
            ev(Kind::FreeCompleted, 0x1000, 512),
        ],
        meta: trace::TraceMeta {
            skipped_entries: 3,
            ..Default::default()
        },
    };
    let w = t.warnings();
    assert_eq!(w.len(), 3, "{w:?}");
    assert_eq!(
        w[0],
        "3 entries have an action gpumem does not replay (such as oom or snapshot) or none; \
         they were left out"
    );
    assert!(w[1].starts_with("1 allocations of 0 bytes"), "{w:?}");
    assert!(w[2].starts_with("1 frees of addresses"), "{w:?}");
    // A bundled trace recorded by PyTorch has nothing to say.
    let clean = trace::load(&bundled_trace("validation/mlp.pickle.gz"), 0, None).unwrap();
    assert!(clean.warnings().is_empty(), "{:?}", clean.warnings());
    // One with nothing to replay says so (a snapshot taken without the history recorded).
    let empty = trace::Trace {
        events: vec![ev(Kind::Alloc, 0x2000, 0)],
        meta: Default::default(),
    };
    let w = empty.warnings();
    assert!(
        w[0].starts_with("the trace holds no allocation to replay"),
        "{w:?}"
    );
}

#[test]
fn traces_that_no_allocator_records_are_inconsistent_and_zero_bytes_are_not_blocks() {
    let t = |events| trace::Trace {
        events,
        meta: Default::default(),
    };
    // A zero-byte allocation (left out of the replay) and then a real one at its address.
    let ok = t(vec![
        ev(Kind::Alloc, 0x1000, 0),
        ev(Kind::Alloc, 0x1000, 512),
        ev(Kind::FreeRequested, 0x1000, 512),
        ev(Kind::FreeCompleted, 0x1000, 512),
    ]);
    trace::validate(&ok).unwrap();
    // The free of one block requested twice: named at the second request, where a replay once
    // freed the block twice and blamed the simulator's pointer.
    let twice = t(vec![
        ev(Kind::Alloc, 0x1000, 512),
        ev(Kind::FreeRequested, 0x1000, 512),
        ev(Kind::FreeRequested, 0x1000, 512),
        ev(Kind::FreeCompleted, 0x1000, 512),
    ]);
    let e = trace::validate(&twice).unwrap_err().to_string();
    assert!(
        e.contains("event 2") && e.contains("requested twice"),
        "{e}"
    );
    // Requested, completed, allocated again and requested again: one request per block.
    let again = t(vec![
        ev(Kind::Alloc, 0x1000, 512),
        ev(Kind::FreeRequested, 0x1000, 512),
        ev(Kind::FreeCompleted, 0x1000, 512),
        ev(Kind::Alloc, 0x1000, 256),
        ev(Kind::FreeRequested, 0x1000, 256),
    ]);
    trace::validate(&again).unwrap();
}

#[test]
fn a_prealloc_beyond_the_cap_is_refused() {
    for p in [PolicyKind::Caching, PolicyKind::Stitched] {
        let (sim, _) = SimBackend::new(SimConfig::default());
        let conf = format!("policy:{},prealloc:0.5,cap:1GiB", p.name());
        let e = Allocator::new(Box::new(sim), Config::parse(&conf).unwrap())
            .err()
            .expect("refused");
        assert!(
            e.to_string()
                .contains("more than the cap of 1073741824 bytes"),
            "{e}"
        );
        // Within the cap it is taken at once.
        let (sim, _) = SimBackend::new(SimConfig::default());
        let conf = format!("policy:{},prealloc:512MiB,cap:1GiB", p.name());
        let a = Allocator::new(Box::new(sim), Config::parse(&conf).unwrap()).unwrap();
        assert_eq!(a.memory_stats().reserved_bytes.all.current, 512 << 20);
    }
}

#[test]
fn a_cap_under_one_page_is_refused_at_creation() {
    // It would refuse every allocation: `fraction:1e-300` (0 bytes of an H200) and `cap:2`
    // (two bytes) were accepted, then every request ran out of memory.
    for (conf, needle) in [
        ("fraction:1e-300", "a fraction of 1e-300"),
        ("cap:2", "a cap of 2 bytes"),
        ("cap:1MiB", "a cap of 1048576 bytes"),
    ] {
        for p in PolicyKind::ALL {
            let (sim, _) = SimBackend::new(SimConfig::default());
            let text = format!("policy:{},{conf}", p.name());
            let e = Allocator::new(Box::new(sim), Config::parse(&text).unwrap())
                .err()
                .unwrap_or_else(|| panic!("{text}: accepted"))
                .to_string();
            assert!(
                e.contains(needle) && e.contains("less than one"),
                "{text}: {e}"
            );
        }
    }
    // One page is enough to serve.
    let (sim, _) = SimBackend::new(SimConfig::default());
    let a = Allocator::new(
        Box::new(sim),
        Config::parse("policy:caching,cap:2MiB").unwrap(),
    )
    .unwrap();
    let x = a.allocate(4096, 0).unwrap();
    a.free(x.ptr).unwrap();
}
