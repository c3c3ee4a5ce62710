//! Snapshots written by gpumem read back by gpumem's own reader, checked against the
//! allocator they came from and against the rules PyTorch's visualizer relies on; and the
//! summary of PyTorch's own snapshots.

use gpumem_core::backend::sim::{SimBackend, SimConfig};
use gpumem_core::policy::PolicyKind;
use gpumem_core::replay::{replay, ReplayOptions};
use gpumem_core::report::snapshot::{check_replayable, snapshot_pickle};
use gpumem_core::report::summary::snapshot_stats;
use gpumem_core::testing::{bundled_snapshots, bundled_trace, shared_trace};
use gpumem_core::trace::pickle::{load_snapshot, read_snapshot_bytes, BlockState};
use gpumem_core::trace::{self, Kind};
use gpumem_core::units::MIB;
use gpumem_core::{Allocator, Config};
use std::sync::{Arc, Mutex};

/// The anchors' own snapshots, checked too where the shared folder is present.
const SHARED: [&str; 4] = [
    "prefetch_mlp.pickle.gz",
    "resnet50_train.pickle.gz",
    "gpt2_train.pickle.gz",
    "gpt2_varlen.pickle.gz",
];

#[test]
fn pytorch_snapshots_summarise_and_replay_backwards() {
    // Every PyTorch snapshot bundled in traces/, then the shared anchors' where present
    // (llama_decode, 1.66 M entries, is left to `gpumem summary --check` in release builds:
    // it takes 20 s in a debug build).
    let bundled = bundled_snapshots();
    assert_eq!(bundled.len(), 8, "{bundled:?}");
    let shared = SHARED.iter().filter_map(|n| shared_trace(n));
    let mut seen = 0;
    for path in bundled.into_iter().chain(shared) {
        let name = path.display().to_string();
        seen += 1;
        let snap = load_snapshot(&path, 0, None).unwrap();
        check_replayable(&snap).unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = snapshot_stats(&snap);
        assert!(
            r.history_complete,
            "{name}: the recorded histories start empty"
        );
        // The peak reserved bytes walked back from the segments equal the peak of the
        // recorded segment events walked forward.
        let (mut cur, mut peak) = (0i64, 0i64);
        for e in &snap.trace.events {
            match e.kind {
                Kind::SegmentAlloc => cur += e.size as i64,
                Kind::SegmentFree => cur -= e.size as i64,
                _ => {}
            }
            peak = peak.max(cur);
        }
        assert_eq!(r.stats.reserved_bytes.all.peak, peak, "{name}");
        assert_eq!(r.stats.reserved_bytes.all.current, cur, "{name}");
        // Requested bytes peak = the trace's peak live bytes.
        assert_eq!(
            r.stats.requested_bytes.all.peak as u64,
            gpumem_core::replay::peak_live(&snap.trace),
            "{name}"
        );
        let s = &r.stats;
        assert_eq!(s.allocation.all.allocated, snap.trace.allocs() as i64);
        assert_eq!(
            s.allocation.all.current,
            s.allocation.small_pool.current + s.allocation.large_pool.current
        );
        // Each block holds at least what was asked of it, rounded to 512 bytes.
        assert!(
            s.allocated_bytes.all.peak >= s.requested_bytes.all.peak,
            "{name}"
        );
    }
    assert!(seen >= 8, "{seen} PyTorch snapshots checked");
    eprintln!("{seen} PyTorch snapshots checked");
}

/// Replays `name` under `policy` and returns (snapshot bytes, stats of the allocator).
fn replay_snapshot(t: &trace::Trace, policy: PolicyKind) -> (Vec<u8>, gpumem_core::MemoryStats) {
    type Taken = Option<(Vec<u8>, gpumem_core::MemoryStats)>;
    let out: Arc<Mutex<Taken>> = Default::default();
    let sink = out.clone();
    let mut opts = ReplayOptions {
        config: Config::parse(&format!("history:{}", 4 * t.events.len() + 1000)).unwrap(),
        ..ReplayOptions::default()
    };
    opts.at_end = Some(Arc::new(move |a: &Allocator| {
        let bytes = snapshot_pickle(a).unwrap();
        *sink.lock().unwrap() = Some((bytes, a.memory_stats()));
    }));
    replay(t, policy, &opts, None).unwrap();
    let r = out.lock().unwrap().take().unwrap();
    r
}

#[test]
fn replayed_snapshots_read_back_and_agree_with_the_allocator() {
    // A two-stream trace, so that blocks used on another stream are in the snapshots too.
    let t = trace::load(&bundled_trace("gpt_varlen.pickle.gz"), 0, None).unwrap();
    for policy in PolicyKind::ALL {
        let (bytes, stats) = replay_snapshot(&t, policy);
        let snap = read_snapshot_bytes(bytes, policy.name(), 0).unwrap();
        check_replayable(&snap).unwrap_or_else(|e| panic!("{}: {e}", policy.name()));
        assert_eq!(
            snap.trace.allocs(),
            t.allocs(),
            "{}: every allocation is in the history",
            policy.name()
        );
        let r = snapshot_stats(&snap);
        let s = &r.stats;
        // Current values from the written segments equal the allocator's own.
        assert_eq!(
            s.allocation.all.current,
            stats.allocation.all.current,
            "{}",
            policy.name()
        );
        assert_eq!(
            s.allocated_bytes.all.current,
            stats.allocated_bytes.all.current,
            "{}",
            policy.name()
        );
        assert_eq!(
            s.requested_bytes.all.current,
            stats.requested_bytes.all.current,
            "{}",
            policy.name()
        );
        assert_eq!(
            s.active.all.current,
            stats.active.all.current,
            "{}",
            policy.name()
        );
        // Peak requested = the trace's peak live bytes (same requests, same order).
        assert_eq!(
            s.requested_bytes.all.peak as u64,
            gpumem_core::replay::peak_live(&t),
            "{}",
            policy.name()
        );
        if !policy.uses_pages() {
            assert_eq!(
                s.reserved_bytes.all.current,
                stats.reserved_bytes.all.current,
                "{}",
                policy.name()
            );
            assert!(r.history_complete, "{}", policy.name());
            assert_eq!(
                s.reserved_bytes.all.peak,
                stats.reserved_bytes.all.peak,
                "{}",
                policy.name()
            );
        }
    }
}

#[test]
fn a_small_snapshot_has_every_field() {
    let (sim, ctl) = SimBackend::new(SimConfig {
        total_bytes: 64 * MIB,
        event_mode: gpumem_core::backend::sim::EventMode::Manual,
        ..SimConfig::default()
    });
    let a = Allocator::new(
        Box::new(sim),
        Config::parse("policy:native,history:100,leak_check:1,backtraces:1").unwrap(),
    )
    .unwrap();
    let x = a.allocate(3 * MIB, 0).unwrap();
    let y = a.allocate(1000, 0).unwrap();
    let z = a.allocate(5 * MIB, 0).unwrap();
    // z is used on stream 9, then freed: pending until its event completes.
    a.record_stream(z.ptr, 9).unwrap();
    a.free(z.ptr).unwrap();
    a.free(x.ptr).unwrap();
    let bytes = snapshot_pickle(&a).unwrap();
    let snap = read_snapshot_bytes(bytes, "small", 0).unwrap();
    check_replayable(&snap).unwrap();
    let free_x = &snap.trace.events[6];
    assert_eq!(free_x.kind, Kind::FreeRequested);
    assert_eq!(
        (free_x.addr, free_x.size),
        (x.ptr, 3 * MIB),
        "frees carry their sizes"
    );
    // One 20 MiB segment for x and z, one 2 MiB small segment for y.
    assert_eq!(snap.segments.len(), 2);
    let small = snap
        .segments
        .iter()
        .find(|s| s.total_size == 2 * MIB)
        .unwrap();
    let large = snap
        .segments
        .iter()
        .find(|s| s.total_size == 20 * MIB)
        .unwrap();
    assert_eq!(small.pool, gpumem_core::stats::Pool::Small);
    assert_eq!(small.blocks[0].address, y.ptr);
    assert_eq!(small.blocks[0].state, BlockState::ActiveAllocated);
    assert_eq!(small.blocks[0].requested_size, 1000);
    let zb = large.blocks.iter().find(|b| b.address == z.ptr).unwrap();
    assert_eq!(zb.state, BlockState::ActivePendingFree);
    assert_eq!(
        large.blocks.iter().map(|b| b.size).sum::<u64>(),
        large.total_size,
        "blocks tile the segment"
    );
    // One event is outstanding: the one recorded on stream 9 when z was freed.
    assert_eq!(ctl.pending(), 1);

    // 63 MiB cannot fit beside the small segment even once z's event has been waited for
    // and the large segment released.
    assert!(a.allocate(63 * MIB, 0).unwrap_err().is_oom());
    let snap = read_snapshot_bytes(snapshot_pickle(&a).unwrap(), "after oom", 0).unwrap();
    check_replayable(&snap).unwrap();
    let kinds: Vec<Kind> = snap.trace.events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            Kind::SegmentAlloc,
            Kind::Alloc,
            Kind::SegmentAlloc,
            Kind::Alloc,
            Kind::Alloc,
            Kind::FreeRequested,
            Kind::FreeRequested,
            Kind::FreeCompleted,
            Kind::FreeCompleted,
            Kind::SegmentFree,
            Kind::Oom,
        ],
        "{:?}",
        snap.trace.events
    );
    let oom = snap.trace.events[10];
    assert_eq!(oom.size, 63 * MIB);
    assert_eq!(snap.segments.len(), 1);
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    let snap = read_snapshot_bytes(snapshot_pickle(&a).unwrap(), "empty", 0).unwrap();
    check_replayable(&snap).unwrap();
    assert!(snap.segments.is_empty());
    assert_eq!(
        snap.trace
            .events
            .iter()
            .filter(|e| e.kind == Kind::SegmentFree)
            .count(),
        2
    );
}

#[test]
fn the_checker_finds_disagreements() {
    let (sim, _) = SimBackend::new(SimConfig::default());
    let a = Allocator::new(
        Box::new(sim),
        Config::parse("policy:caching,history:50").unwrap(),
    )
    .unwrap();
    let p = a.allocate(4 * MIB, 0).unwrap();
    a.free(p.ptr).unwrap();
    let _q = a.allocate(MIB, 0).unwrap();
    let good = read_snapshot_bytes(snapshot_pickle(&a).unwrap(), "good", 0).unwrap();
    check_replayable(&good).unwrap();
    // Without its segments, the history's blocks have nowhere to live.
    let mut bad = good.clone();
    bad.segments.clear();
    assert!(check_replayable(&bad).is_err());
    // A free without its block.
    let mut bad = good.clone();
    bad.trace.events.retain(|e| e.kind != Kind::Alloc);
    bad.trace.events.push(gpumem_core::trace::Event {
        kind: Kind::FreeRequested,
        stream: 0,
        addr: 0xdead_0000,
        size: 1,
        time_us: 0,
    });
    let e = check_replayable(&bad).unwrap_err();
    assert!(e.contains("no block"), "{e}");
}

/// Python's own pickle module reads gpumem's snapshots, and finds PyTorch's keys and types
/// (compared with a snapshot PyTorch wrote, bundled in traces/validation).
#[test]
fn python_reads_the_snapshot_with_torchs_keys_and_types() {
    let (sim, _) = SimBackend::new(SimConfig {
        total_bytes: 64 * MIB,
        ..SimConfig::default()
    });
    let a = Allocator::new(
        Box::new(sim),
        Config::parse("policy:stitched,history:1000,leak_check:1,backtraces:1").unwrap(),
    )
    .unwrap();
    let mut live = Vec::new();
    for i in 0..20u64 {
        live.push(a.allocate((i + 1) * 300_000, i % 2).unwrap());
    }
    for p in live.iter().step_by(3) {
        a.free_allocation(p).unwrap();
    }
    assert!(a.allocate(60 * MIB, 0).unwrap_err().is_oom());
    let dir = std::env::temp_dir().join(format!("gpumem-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("stitched.pickle");
    gpumem_core::report::snapshot::write_snapshot(&a, &file).unwrap();
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/check_snapshot.py");
    // A snapshot PyTorch itself wrote, for its keys and types.
    let reference = bundled_trace("validation/mlp.pickle.gz");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(&file)
        .arg("--reference")
        .arg(&reference)
        .output()
        .expect("python3 (which scripts/test.sh needs anyway) runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{text}");
    assert!(text.contains("ok   shape"), "{text}");
    assert!(text.contains("ok   keys"), "{text}");
    // The frames name this test.
    let raw = std::fs::read(&file).unwrap();
    let needle = b"python_reads_the_snapshot_with_torchs_keys_and_types";
    assert!(
        raw.windows(needle.len()).any(|w| w == needle),
        "frames missing"
    );
    if std::env::var_os("GPUMEM_KEEP_SNAPSHOT").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
