//! Snapshots as PyTorch's memory visualizer reads them, for every policy and stream layout:
//! checked by `viz_check.py` (next to this file; Python's standard library only), which does
//! what the visualizer (MemoryViz.js: annotate_snapshot, simulate_memory, draw) and
//! `_memory_viz.segsum` do and fails where they would crash or misdraw; by gpumem's own
//! `check_replayable`; and the summary of a snapshot against the allocator's statistics. The
//! stream and pool tests failed before mappings carried the stream of their reservation (a
//! review of 2026-12-01); the pickle writer's edge cases are read back by Python's pickle.

use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use gpumem_core::report::snapshot::{check_replayable, snapshot_pickle};
use gpumem_core::trace::pickle::read_snapshot_bytes;
use gpumem_core::units::MIB;
use gpumem_core::{Allocator, Config};
use std::path::PathBuf;

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

fn alloc_with(conf: &str, cfg: SimConfig) -> (Allocator, SimControl) {
    let (sim, ctl) = SimBackend::new(cfg);
    (
        Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap(),
        ctl,
    )
}

fn sim_small() -> SimConfig {
    SimConfig {
        total_bytes: 1024 * MIB,
        ..SimConfig::default()
    }
}

/// Runs the viz emulation on the allocator's snapshot: Err(message) when the viz would fail.
fn viz(a: &Allocator, name: &str) -> Result<String, String> {
    let bytes = snapshot_pickle(a).unwrap();
    let dir = std::env::temp_dir().join(format!("gpumem-snapshot-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{name}.pickle"));
    std::fs::write(&file, &bytes).unwrap();
    let script: PathBuf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/viz_check.py");
    let out = std::process::Command::new(python())
        .arg(&script)
        .arg(&file)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{name}: {text}"))
    }
}

fn gpumem_check(a: &Allocator, name: &str) -> Result<(), String> {
    let snap =
        read_snapshot_bytes(snapshot_pickle(a).unwrap(), name, 0).map_err(|e| e.to_string())?;
    check_replayable(&snap)
}

// A mixed workload under each policy, checked by the visualizer's emulation.

fn workload(a: &Allocator, streams: u64) {
    let mut live = Vec::new();
    for i in 0..60u64 {
        let sz = match i % 5 {
            0 => 300_000,
            1 => 3 * MIB + 7,
            2 => 700,
            3 => 9 * MIB,
            _ => 1_500_000,
        };
        live.push(a.allocate(sz, i % streams).unwrap());
        if i % 3 == 2 {
            let p = live.remove(i as usize % live.len());
            a.free_allocation(&p).unwrap();
        }
    }
    for p in live.iter().step_by(2) {
        a.free_allocation(p).unwrap();
    }
}

#[test]
fn every_policy_snapshot_replays_in_the_visualizer() {
    let mut failures = Vec::new();
    for policy in ["native", "caching", "expandable", "stitched", "buddy"] {
        for streams in [1u64, 2, 3] {
            let name = format!("{policy}-{streams}");
            let (a, _) = alloc_with(&format!("policy:{policy},history:100000"), sim_small());
            workload(&a, streams);
            if let Err(e) = viz(&a, &name) {
                failures.push(e);
            }
            if let Err(e) = gpumem_check(&a, &name) {
                failures.push(format!("{name}: check_replayable: {e}"));
            }
            a.empty_cache().unwrap();
            if let Err(e) = viz(&a, &format!("{name}-emptied")) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Pending blocks (used on another stream, events not completed), then a wrapped history.
#[test]
fn pending_blocks_and_a_wrapped_history_replay() {
    let mut failures = Vec::new();
    for policy in ["native", "caching", "expandable", "stitched", "buddy"] {
        for hist in [100000usize, 7, 12, 30] {
            let name = format!("{policy}-pending-h{hist}");
            let (a, ctl) = alloc_with(
                &format!("policy:{policy},history:{hist}"),
                SimConfig {
                    total_bytes: 1024 * MIB,
                    event_mode: EventMode::Manual,
                    ..SimConfig::default()
                },
            );
            let x = a.allocate(3 * MIB, 0).unwrap();
            let y = a.allocate(1000, 0).unwrap();
            let z = a.allocate(5 * MIB, 1).unwrap();
            a.record_stream(x.ptr, 1).unwrap();
            a.free_allocation(&x).unwrap();
            a.free_allocation(&y).unwrap();
            let w = a.allocate(2 * MIB, 0).unwrap();
            if let Err(e) = viz(&a, &name) {
                failures.push(e);
            }
            if let Err(e) = gpumem_check(&a, &name) {
                failures.push(format!("{name}: check_replayable: {e}"));
            }
            ctl.complete_recorded();
            a.process_events().unwrap();
            a.free_allocation(&z).unwrap();
            a.free_allocation(&w).unwrap();
            a.empty_cache().unwrap();
            let _v = a.allocate(7 * MIB, 1).unwrap();
            if let Err(e) = viz(&a, &format!("{name}-2")) {
                failures.push(e);
            }
            if let Err(e) = gpumem_check(&a, &format!("{name}-2")) {
                failures.push(format!("{name}-2: check_replayable: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Stitched, two streams: stream 1 frees everything (its pages stay mapped).
#[test]
fn stitched_streams_with_idle_pages_replay() {
    let mut failures = Vec::new();
    for policy in ["stitched", "expandable"] {
        let name = format!("{policy}-idle");
        let (a, _) = alloc_with(&format!("policy:{policy},history:100000"), sim_small());
        let _p0 = a.allocate(6 * MIB, 0).unwrap();
        let p1 = a.allocate(6 * MIB, 1).unwrap();
        let p2 = a.allocate(3 * MIB, 1).unwrap();
        a.free_allocation(&p1).unwrap();
        a.free_allocation(&p2).unwrap();
        if let Err(e) = viz(&a, &name) {
            failures.push(e);
        }
        if let Err(e) = gpumem_check(&a, &name) {
            failures.push(format!("{name}: check_replayable: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// Mappings of ranges gone by snapshot time keep their stream (they got stream 0 when no
// allocation started inside them).

fn only_stream_one_then_emptied(policy: &str) -> Allocator {
    let (a, _) = alloc_with(&format!("policy:{policy},history:10000"), sim_small());
    // Stream 1 only: the 9 MiB block reaches from the first mapped range into the next ones,
    // where no allocation starts.
    let x = a.allocate(15 * MIB, 1).unwrap();
    let y = a.allocate(9 * MIB, 1).unwrap();
    a.free_allocation(&y).unwrap();
    a.free_allocation(&x).unwrap();
    a.empty_cache().unwrap();
    a
}

#[test]
fn mappings_keep_their_stream_after_empty_cache() {
    for policy in ["expandable", "stitched"] {
        let a = only_stream_one_then_emptied(policy);
        let snap = read_snapshot_bytes(snapshot_pickle(&a).unwrap(), policy, 0).unwrap();
        assert!(snap.segments.is_empty());
        let seg_streams: Vec<(gpumem_core::trace::Kind, u64, u64)> = snap
            .trace
            .events
            .iter()
            .filter(|e| {
                use gpumem_core::trace::Kind::*;
                matches!(
                    e.kind,
                    SegmentMap | SegmentUnmap | SegmentAlloc | SegmentFree
                )
            })
            .map(|e| (e.kind, e.addr, e.stream))
            .collect();
        // Every block was on stream 1, so every mapping was made for stream 1.
        assert!(
            seg_streams.iter().all(|s| s.2 == 1),
            "{policy}: segment entries attributed to another stream: {seg_streams:x?}"
        );
    }
}

#[test]
fn an_emptied_snapshot_replays_in_the_visualizer() {
    let mut failures = Vec::new();
    for policy in ["expandable", "stitched"] {
        let a = only_stream_one_then_emptied(policy);
        if let Err(e) = gpumem_check(&a, policy) {
            failures.push(format!("{policy}: check_replayable: {e}"));
        }
        if let Err(e) = viz(&a, &format!("d1-{policy}")) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// Stitched: the mapped pages of a stream whose blocks are all free are that stream's segment
// (they were reported as another stream's, the previous policy range by address).

#[test]
fn idle_pages_of_a_stream_keep_their_stream() {
    // Ranges per stream: this one thread allocates on two streams, which by default
    // (`range:auto`) puts them in one shared range, reported as its first stream's.
    let (a, _) = alloc_with("policy:stitched,range:stream,history:10000", sim_small());
    let _p0 = a.allocate(6 * MIB, 0).unwrap();
    let p1 = a.allocate(6 * MIB, 1).unwrap();
    a.free_allocation(&p1).unwrap();
    let snap = read_snapshot_bytes(snapshot_pickle(&a).unwrap(), "idle", 0).unwrap();
    // Stream 1's virtual range starts where its block was.
    let seg = snap
        .segments
        .iter()
        .find(|s| s.address <= p1.ptr && p1.ptr < s.address + s.total_size)
        .expect("stream 1's pages are still mapped");
    assert_eq!(
        seg.stream, 1,
        "segment {:#x} (stream 1's mapped, idle pages) reported as stream {}",
        seg.address, seg.stream
    );
}

// The summary of a snapshot: per-pool reserved figures against the allocator's (stitched's
// 2 MiB pages were counted in the small pool).

#[test]
fn a_snapshots_summary_pools_agree_with_the_allocator() {
    use gpumem_core::report::summary::snapshot_stats;
    let mut failures = Vec::new();
    for policy in ["expandable", "stitched", "native", "caching"] {
        for stream in [0u64, 1] {
            let (a, _) = alloc_with(&format!("policy:{policy},history:10000"), sim_small());
            let x = a.allocate(15 * MIB, stream).unwrap();
            let y = a.allocate(9 * MIB, stream).unwrap();
            a.free_allocation(&y).unwrap();
            a.free_allocation(&x).unwrap();
            a.empty_cache().unwrap();
            let st = a.memory_stats();
            let snap = read_snapshot_bytes(snapshot_pickle(&a).unwrap(), policy, 0).unwrap();
            let r = snapshot_stats(&snap);
            let mine = (
                r.stats.reserved_bytes.small_pool.allocated,
                r.stats.reserved_bytes.large_pool.allocated,
                r.stats.reserved_bytes.all.peak,
            );
            let theirs = (
                st.reserved_bytes.small_pool.allocated,
                st.reserved_bytes.large_pool.allocated,
                st.reserved_bytes.all.peak,
            );
            if mine != theirs {
                failures.push(format!(
                    "{policy} stream {stream}: snapshot summary reserved (small alloc, large alloc, peak) {mine:?} != allocator {theirs:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Pickle writer edge cases, read back by Python's pickle.
// ---------------------------------------------------------------------------------------

#[test]
fn pickle_writer_edge_cases_read_by_python() {
    use gpumem_core::report::pickle_writer::PickleWriter;
    let mut w = PickleWriter::new();
    w.begin_dict();
    w.key("big");
    w.begin_list();
    for v in [
        u64::MAX,
        1 << 63,
        (1 << 63) - 1,
        1 << 31,
        (1 << 31) - 1,
        0,
        255,
        256,
        65535,
        65536,
    ] {
        w.uint(v);
    }
    for v in [i64::MIN, i64::MAX, -1, -256, -(1 << 31), -(1 << 31) - 1] {
        w.int(v);
    }
    w.end();
    w.key("uni");
    w.begin_list();
    w.str("héllo wörld ✓ 𝄞");
    w.str("");
    w.str("héllo wörld ✓ 𝄞");
    w.end();
    w.key("many");
    w.begin_dict();
    for i in 0..2500u64 {
        w.key(&format!("k{i}"));
        w.begin_tuple();
        w.uint(i);
        w.str(&format!("k{}", i / 2));
        w.end();
    }
    w.end();
    w.key("nested");
    w.begin_list();
    for i in 0..3001u64 {
        w.begin_list();
        w.int(i as i64);
        w.end();
    }
    w.end();
    w.key("f");
    w.float(-1.5e300);
    w.end();
    let bytes = w.finish();
    let file = std::env::temp_dir().join(format!("gpumem-pw-{}.pickle", std::process::id()));
    std::fs::write(&file, bytes).unwrap();
    let script = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
exp_big = [2**64-1, 2**63, 2**63-1, 2**31, 2**31-1, 0, 255, 256, 65535, 65536, -2**63, 2**63-1, -1, -256, -2**31, -2**31-1]
assert d['big'] == exp_big, d['big']
assert d['uni'] == ['héllo wörld ✓ 𝄞', '', 'héllo wörld ✓ 𝄞'], d['uni']
assert len(d['many']) == 2500 and all(d['many'][f'k{i}'] == (i, f'k{i//2}') for i in range(2500))
assert d['nested'] == [[i] for i in range(3001)]
assert d['f'] == -1.5e300
print('ok')
"#;
    let out = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
