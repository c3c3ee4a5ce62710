//! What the allocator keeps true when things go wrong: driver calls that fail part-way through
//! a request or an `empty_cache` (injected by a backend that fails the N-th call of a kind),
//! frees naming the wrong block, preallocated pages in the statistics, random sequences of
//! every operation against the statistics' identities, and a trace that lost a free. Each of
//! the failure tests failed before its fix (a review of 2026-12-01).

use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use gpumem_core::backend::DriverCall;
use gpumem_core::report::leaks::leak_report;
use gpumem_core::testing::{Faults, FaultySim, TestRng};
use gpumem_core::{Allocator, Config, PolicyKind};

const MIB: u64 = 1 << 20;

fn faulty(conf: &str, total: u64, mode: EventMode) -> (Allocator, Faults, SimControl) {
    let (sim, faults, ctl) = FaultySim::new(SimConfig {
        total_bytes: total,
        event_mode: mode,
        ..SimConfig::default()
    });
    let a = Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap();
    (a, faults, ctl)
}

fn sim(conf: &str) -> Allocator {
    let (s, _) = SimBackend::new(SimConfig::default());
    Allocator::new(Box::new(s), Config::parse(conf).unwrap()).unwrap()
}

/// After everything is freed and the cache emptied, nothing may stay held.
fn assert_all_returned(a: &Allocator, what: &str) {
    a.empty_cache().unwrap();
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.all.current, 0, "{what}: allocated");
    assert_eq!(
        a.held_bytes(),
        0,
        "{what}: bytes still held after every block was freed and the cache emptied"
    );
    assert_eq!(st.reserved_bytes.all.current, 0, "{what}: reserved_bytes");
    a.check().unwrap();
}

// ---------------------------------------------------------------------------------------------
// 1. Stitched: a driver failure in the slow path of claiming pages loses the pages for good.
// ---------------------------------------------------------------------------------------------

#[test]
fn stitched_map_failure_mid_claim_returns_every_page() {
    let (a, faults, _) = faulty("policy:stitched", 1 << 30, EventMode::Immediate);
    // 4 MiB = 2 pages; the second cuMemMap fails.
    faults.arm(DriverCall::MemMap, 1, 1);
    assert!(a.allocate(4 * MIB, 0).is_err());
    faults.disarm();
    a.check().unwrap();
    let x = a.allocate(4 * MIB, 0).unwrap();
    a.free(x.ptr).unwrap();
    assert_all_returned(&a, "after a failed cuMemMap");
}

/// Guards the undo of the one-pass claim (2026-12-01, session 13), not a past bug: it fails
/// if the pages taken on the fast path are not put back on the idle list, or if the block's
/// page counts are not undone.
#[test]
fn stitched_failed_claim_gives_back_the_idle_pages_it_took() {
    let (a, faults, _) = faulty("policy:stitched", 1 << 30, EventMode::Immediate);
    // Two pages mapped and idle at the bottom of the stream's range.
    let x = a.allocate(4 * MIB, 0).unwrap();
    a.free(x.ptr).unwrap();
    let held = a.held_bytes();
    assert_eq!(held, 4 * MIB);
    // 8 MiB at the same address: its first two pages come back from the idle list on the fast
    // path, the other two need new pages, and mapping the second of those fails.
    faults.arm(DriverCall::MemMap, 1, 1);
    assert!(a.allocate(8 * MIB, 0).is_err());
    faults.disarm();
    a.check().unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
    // The two idle pages are idle again: the same request succeeds, reusing them, and after
    // a free and an empty_cache nothing stays held (a page lost from the idle list would).
    let y = a.allocate(8 * MIB, 0).unwrap();
    assert_eq!(y.ptr, x.ptr, "placed where the idle pages are mapped");
    a.free(y.ptr).unwrap();
    assert_all_returned(&a, "after a failed claim that had taken idle pages");
}

#[test]
fn stitched_mark_failing_at_the_end_of_a_claim_costs_nothing() {
    let (a, faults, _) = faulty("policy:stitched", 1 << 30, EventMode::Immediate);
    // The first slow path ends by recording an event on the stream (a mark for later remaps,
    // best effort): its failure must neither fail the allocation nor lose the page.
    faults.arm(DriverCall::EventRecord, 0, 1);
    let x = a.allocate(2 * MIB, 0).unwrap();
    faults.disarm();
    a.check().unwrap();
    a.free(x.ptr).unwrap();
    let y = a.allocate(2 * MIB, 0).unwrap();
    assert_eq!(y.ptr, x.ptr, "the page is reused");
    a.free(y.ptr).unwrap();
    assert_all_returned(&a, "after a failed cuEventRecord");
}

/// A stitched allocator holding one idle page, whose `empty_cache` failed at the unmap.
fn stitched_after_a_failed_unmap_in_empty_cache() -> Allocator {
    let (a, faults, _) = faulty("policy:stitched", 1 << 30, EventMode::Immediate);
    let x = a.allocate(2 * MIB, 0).unwrap();
    a.free(x.ptr).unwrap();
    faults.arm(DriverCall::MemUnmap, 0, 1);
    assert!(a.empty_cache().is_err());
    faults.disarm();
    a
}

#[test]
fn stitched_unmap_failure_in_empty_cache_keeps_the_page_for_a_retry() {
    let a = stitched_after_a_failed_unmap_in_empty_cache();
    // A transient failure: trying again must return the page.
    assert_all_returned(&a, "after a failed cuMemUnmap in empty_cache");
}

#[test]
fn stitched_allocation_after_a_failed_empty_cache_reuses_the_page() {
    let a = stitched_after_a_failed_unmap_in_empty_cache();
    // The page table still points the virtual page at the slot trim() emptied.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.allocate(2 * MIB, 0)));
    assert!(r.is_ok(), "allocate panicked after a failed empty_cache");
    assert!(a.check().is_ok(), "{:?}", a.check());
}

#[test]
fn expandable_map_failure_releases_the_chunks_it_made() {
    let (a, faults, _) = faulty("policy:expandable", 1 << 30, EventMode::Immediate);
    faults.arm(DriverCall::MemMap, 0, 1);
    assert!(a.allocate(30 * MIB, 0).is_err());
    faults.disarm();
    let x = a.allocate(30 * MIB, 0).unwrap();
    a.free(x.ptr).unwrap();
    assert_all_returned(&a, "expandable after a failed cuMemMap");
}

#[test]
fn caching_free_failure_in_empty_cache_keeps_the_segment_for_a_retry() {
    for policy in ["caching", "native"] {
        let (a, faults, _) = faulty(&format!("policy:{policy}"), 1 << 30, EventMode::Immediate);
        let x = a.allocate(30 * MIB, 0).unwrap();
        a.free(x.ptr).unwrap();
        faults.arm(DriverCall::MemFree, 0, 1);
        assert!(a.empty_cache().is_err());
        faults.disarm();
        a.check().unwrap();
        assert_all_returned(&a, policy);
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Engine: a stale Allocation handle.
// ---------------------------------------------------------------------------------------------

/// An `Allocation` of allocator `b` whose address is live in allocator `a` under another
/// block id (stitched places blocks deterministically from the same base address).
fn foreign_handle_at_live_address(
    conf: &str,
) -> (Allocator, gpumem_core::Allocation, gpumem_core::Allocation) {
    let a = sim(conf);
    let b = sim(conf);
    let _b0 = b.allocate(5 * MIB, 0).unwrap();
    let foreign = b.allocate(4 * MIB, 0).unwrap();
    let _a0 = a.allocate(3 * MIB, 0).unwrap();
    let _a1 = a.allocate(2 * MIB, 0).unwrap();
    let victim = a.allocate(4 * MIB, 0).unwrap();
    assert_eq!(victim.ptr, foreign.ptr, "same address");
    assert_ne!(
        format!("{victim:?}"),
        format!("{foreign:?}"),
        "different handle"
    );
    std::mem::forget(b);
    (a, foreign, victim)
}

#[test]
fn free_allocation_checks_the_handle_when_the_block_has_stream_uses() {
    // Control: without stream uses the mismatched handle is refused.
    let (a, foreign, _victim) = foreign_handle_at_live_address("policy:stitched");
    assert!(a.free_allocation(&foreign).is_err());
    // With a stream use recorded on the live block, the same call frees it.
    let (a, foreign, victim) = foreign_handle_at_live_address("policy:stitched");
    a.record_stream(victim.ptr, 7).unwrap();
    let r = a.free_allocation(&foreign);
    assert!(
        r.is_err(),
        "a handle that is not the live block's was accepted"
    );
    assert_eq!(
        a.memory_stats().allocated_bytes.all.current,
        (3 + 2 + 4) * MIB as i64,
        "the live block was freed through a handle that is not its own"
    );
}

#[test]
fn a_refused_free_leaves_the_block_in_the_leak_report() {
    let (a, foreign, victim) = foreign_handle_at_live_address("policy:stitched,leak_check:1");
    assert!(a.free_allocation(&foreign).is_err(), "refused, correctly");
    assert_eq!(a.memory_stats().allocation.all.current, 3, "nothing freed");
    let _ = victim;
    assert_eq!(
        leak_report(&a).allocations.len(),
        3,
        "a still-live block vanished from the leak report"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Stats.
// ---------------------------------------------------------------------------------------------

#[test]
fn prealloc_counts_each_driver_allocation() {
    // 64 MiB of 2 MiB pages: 32 cuMemCreate calls at start, counted as PyTorch counts its
    // cudaMalloc calls; the 4 pages the block took and empty_cache released are 4 frees.
    let a = sim("policy:stitched,prealloc:64MiB");
    assert_eq!(a.memory_stats().num_device_alloc, 32);
    let x = a.allocate(8 * MIB, 0).unwrap();
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    let st = a.memory_stats();
    assert_eq!((st.num_device_alloc, st.num_device_free), (32, 4));
    assert_eq!(st.segment.all.current, 0);
    // A plain reserve is one cudaMalloc.
    let a = sim("policy:caching,prealloc:64MiB");
    assert_eq!(a.memory_stats().num_device_alloc, 1);
}

/// Every policy, and the stitched one with one range shared by the streams (`range:shared`),
/// also with every third allocation of a stream spilled to a range of its own (`spill:3`),
/// with the configuration to add to `policy:NAME`.
fn policy_runs() -> Vec<(PolicyKind, &'static str)> {
    PolicyKind::ALL
        .into_iter()
        .map(|p| (p, ""))
        .chain([
            (PolicyKind::Stitched, ",range:shared"),
            (PolicyKind::Stitched, ",range:shared,spill:3"),
        ])
        .collect()
}

#[test]
fn every_policy_returns_everything_after_free_and_empty_cache() {
    for (p, extra) in policy_runs() {
        let a = sim(&format!("policy:{}{extra}", p.name()));
        let mut v = Vec::new();
        for (i, s) in [512u64, 3 * MIB, 100 * MIB, 7, 2 * MIB, 30 * MIB, 1 << 30]
            .iter()
            .enumerate()
        {
            v.push(a.allocate(*s, (i % 3) as u64).unwrap());
        }
        a.record_stream(v[1].ptr, 2).unwrap();
        for x in &v {
            a.free_allocation(x).unwrap();
        }
        assert_all_returned(&a, p.name());
        let st = a.memory_stats();
        assert_eq!(st.segment.all.current, 0, "{p:?} segments");
        assert_eq!(st.active_bytes.all.current, 0, "{p:?} active");
        assert_eq!(st.inactive_split.all.current, 0, "{p:?} inactive_split");
        assert_eq!(
            st.inactive_split_bytes.all.current, 0,
            "{p:?} inactive_split_bytes"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Random sequences: statistics against their own identities and the snapshot.
// ---------------------------------------------------------------------------------------------

fn stat_identities(st: &gpumem_core::MemoryStats) -> Result<(), String> {
    let arrays = [
        ("allocation", &st.allocation),
        ("segment", &st.segment),
        ("active", &st.active),
        ("inactive_split", &st.inactive_split),
        ("allocated_bytes", &st.allocated_bytes),
        ("reserved_bytes", &st.reserved_bytes),
        ("active_bytes", &st.active_bytes),
        ("inactive_split_bytes", &st.inactive_split_bytes),
        ("requested_bytes", &st.requested_bytes),
    ];
    for (name, a) in arrays {
        for (pool, s) in [
            ("all", &a.all),
            ("small", &a.small_pool),
            ("large", &a.large_pool),
        ] {
            if s.current < 0 {
                return Err(format!("{name}.{pool}.current = {} < 0", s.current));
            }
            if s.peak < s.current {
                return Err(format!(
                    "{name}.{pool}.peak {} < current {}",
                    s.peak, s.current
                ));
            }
            if s.allocated - s.freed != s.current {
                return Err(format!(
                    "{name}.{pool}: allocated {} - freed {} != current {}",
                    s.allocated, s.freed, s.current
                ));
            }
        }
        if a.all.current != a.small_pool.current + a.large_pool.current {
            return Err(format!("{name}: all != small + large"));
        }
    }
    Ok(())
}

fn snapshot_agrees(a: &Allocator, p: PolicyKind) -> Result<(), String> {
    use gpumem_core::policy::BlockKind;
    let st = a.memory_stats();
    let snap = a.snapshot();
    let sum = |k: BlockKind| -> i64 {
        snap.iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.kind == k)
            .map(|b| b.size as i64)
            .sum()
    };
    let alloc = sum(BlockKind::Allocated);
    if alloc != st.allocated_bytes.all.current {
        return Err(format!(
            "allocated_bytes {} vs snapshot {alloc}",
            st.allocated_bytes.all.current
        ));
    }
    let active = alloc + sum(BlockKind::Pending);
    if active != st.active_bytes.all.current {
        return Err(format!(
            "active_bytes {} vs snapshot {active}",
            st.active_bytes.all.current
        ));
    }
    if matches!(p, PolicyKind::Native | PolicyKind::Caching) {
        let split_free: i64 = snap
            .iter()
            .filter(|s| s.blocks.len() > 1)
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.kind == BlockKind::Free)
            .map(|b| b.size as i64)
            .sum();
        if split_free != st.inactive_split_bytes.all.current {
            return Err(format!(
                "inactive_split_bytes {} vs snapshot {split_free}",
                st.inactive_split_bytes.all.current
            ));
        }
        let segs = snap.len() as i64;
        if segs != st.segment.all.current {
            return Err(format!(
                "segment {} vs snapshot {segs}",
                st.segment.all.current
            ));
        }
        let bytes: i64 = snap.iter().map(|s| s.size as i64).sum();
        if bytes != st.reserved_bytes.all.current {
            return Err(format!(
                "reserved_bytes {} vs snapshot {bytes}",
                st.reserved_bytes.all.current
            ));
        }
    }
    Ok(())
}

#[test]
fn random_sequences_keep_stats_consistent() {
    let mut failures = Vec::new();
    for (p, extra) in policy_runs() {
        'seed: for seed in 1..=12u64 {
            let (sim, ctl) = SimBackend::new(SimConfig {
                total_bytes: 1 << 30,
                event_mode: EventMode::Manual,
                ..SimConfig::default()
            });
            let a = Allocator::new(
                Box::new(sim),
                Config::parse(&format!("policy:{}{extra}", p.name())).unwrap(),
            )
            .unwrap();
            let mut r = TestRng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut live: Vec<gpumem_core::Allocation> = Vec::new();
            let mut log = Vec::new();
            for step in 0..3000 {
                let op = r.below(100);
                let desc;
                if op < 45 {
                    let size = match r.below(4) {
                        0 => 1 + r.below(4096),
                        1 => 1 + r.below(1 << 20),
                        2 => 1 + r.below(24 << 20),
                        _ => [3072u64, 2 << 20, 9_437_184][r.below(3) as usize],
                    };
                    let s = r.below(3);
                    desc = format!("alloc {size} on {s}");
                    if let Ok(x) = a.allocate(size, s) {
                        live.push(x);
                    }
                } else if op < 80 {
                    if live.is_empty() {
                        continue;
                    }
                    let i = r.below(live.len() as u64) as usize;
                    let x = live.swap_remove(i);
                    desc = format!("free {:#x}", x.ptr);
                    a.free_allocation(&x).unwrap();
                } else if op < 88 {
                    if live.is_empty() {
                        continue;
                    }
                    let i = r.below(live.len() as u64) as usize;
                    let s = r.below(3);
                    desc = format!("record {:#x} on {s}", live[i].ptr);
                    a.record_stream(live[i].ptr, s).unwrap();
                } else if op < 94 {
                    desc = "complete events".into();
                    ctl.complete_recorded();
                    a.process_events().unwrap();
                } else if op < 97 {
                    desc = "reset peaks".into();
                    a.reset_peak_stats();
                } else {
                    desc = "empty_cache".into();
                    a.empty_cache().unwrap();
                }
                log.push(desc);
                let st = a.memory_stats();
                if let Err(e) = stat_identities(&st).and_then(|_| snapshot_agrees(&a, p)) {
                    let tail: Vec<_> = log.iter().rev().take(6).rev().cloned().collect();
                    failures.push(format!(
                        "{p:?}{extra} seed {seed} step {step}: {e}; last ops {tail:?}"
                    ));
                    continue 'seed;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 5. Replay.
// ---------------------------------------------------------------------------------------------

#[test]
fn replay_takes_a_block_whose_address_is_allocated_again_as_freed() {
    use gpumem_core::replay::{peak_live, replay, ReplayOptions};
    use gpumem_core::trace::{Event, Kind, Trace};
    let ev = |kind, size, t| Event {
        kind,
        stream: 0,
        addr: 0x7f00_0000_0000,
        size,
        time_us: t,
    };
    // A history that lost a free (PyTorch's ring buffer drops the oldest entries; a
    // hand-made or merged trace can do the same): two allocations at one address.
    let trace = Trace {
        events: vec![
            ev(Kind::Alloc, 10 * MIB, 1),
            ev(Kind::Alloc, 10 * MIB, 2),
            ev(Kind::FreeRequested, 0, 3),
            ev(Kind::FreeCompleted, 0, 4),
        ],
        meta: Default::default(),
    };
    assert_eq!(
        peak_live(&trace),
        10 * MIB,
        "peak_live counts the address once"
    );
    let opts = ReplayOptions {
        timeline_points: 4,
        ..ReplayOptions::default()
    };
    let w = trace.warnings();
    assert!(
        w.iter()
            .any(|w| w.starts_with("1 allocations at an address that was still live")),
        "{w:?}"
    );
    let r = replay(&trace, PolicyKind::Caching, &opts, None).unwrap();
    let last = r.timeline.last().unwrap();
    assert_eq!(last.live, 0, "nothing is live at the end: {:?}", r.timeline);
    assert!(
        r.peak_live_bytes >= r.timeline.iter().map(|p| p.live).max().unwrap(),
        "timeline live {:?} exceeds the peak_live reported ({})",
        r.timeline,
        r.peak_live_bytes
    );
}

/// `reset_accumulated_stats` zeroes the totals and counters and nothing else, and what
/// accumulates after it counts from zero; `free_on_sized` returns the block's bytes as handed
/// out, and refuses a second free of the same block.
#[test]
fn accumulated_stats_reset_and_sized_frees() {
    for conf in ["policy:caching", "policy:stitched", "policy:native"] {
        let a = sim(conf);
        let x = a.allocate(1000, 0).unwrap();
        let y = a.allocate(3 * MIB + 5, 0).unwrap();
        let z = a.allocate(7 * MIB, 0).unwrap();
        assert_eq!(a.free_on_sized(x.ptr, 0).unwrap(), x.size, "{conf}");
        let before = a.memory_stats();
        assert_eq!(before.allocation.all.allocated, 3, "{conf}");
        assert_eq!(before.allocation.all.freed, 1, "{conf}");
        assert!(before.num_device_alloc > 0, "{conf}");

        a.reset_accumulated_stats();
        let after = a.memory_stats();
        assert_eq!(after.allocation.all.allocated, 0, "{conf}");
        assert_eq!(after.allocation.all.freed, 0, "{conf}");
        assert_eq!(after.allocated_bytes.all.allocated, 0, "{conf}");
        assert_eq!(after.reserved_bytes.all.allocated, 0, "{conf}");
        assert_eq!(after.num_device_alloc, 0, "{conf}");
        // Current values and peaks are untouched.
        assert_eq!(after.allocation.all.current, 2, "{conf}");
        assert_eq!(after.allocation.all.peak, 3, "{conf}");
        assert_eq!(
            after.allocated_bytes.all.current,
            (y.size + z.size) as i64,
            "{conf}"
        );
        assert_eq!(
            after.reserved_bytes.all.current,
            before.reserved_bytes.all.current
        );

        // A block on another stream is found by the search and its bytes returned.
        let w = a.allocate(2 * MIB, 5).unwrap();
        assert_eq!(a.free_on_sized(w.ptr, 0).unwrap(), w.size, "{conf}");
        assert_eq!(a.free_on_sized(y.ptr, 0).unwrap(), y.size, "{conf}");
        assert!(a.free_on_sized(y.ptr, 0).is_err(), "{conf}: a double free");
        let later = a.memory_stats();
        assert_eq!(later.allocation.all.allocated, 1, "{conf}");
        assert_eq!(later.allocation.all.freed, 2, "{conf}");
        assert_eq!(
            later.allocated_bytes.all.freed,
            (w.size + y.size) as i64,
            "{conf}"
        );
        assert_eq!(later.allocation.all.current, 1, "{conf}");
        a.free_allocation(&z).unwrap();
    }
}
