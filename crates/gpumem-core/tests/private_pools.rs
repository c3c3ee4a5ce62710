//! Private pools (CUDA graphs' memory): what a capture allocates stays the pool's while the
//! pool has users, no matter what the rest of the program allocates, frees or empties; during
//! a capture no event is recorded or queried and nothing is given back to the device.

// Only the audited device's setup is used here, not the trace replay beside it.
#[allow(dead_code)]
mod common;

use common::audited_sim;
use gpumem_core::backend::DriverCall;
use gpumem_core::error::AllocError;
use gpumem_core::Allocator;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// A capture stream and an eager stream, as PyTorch's handles would be.
const CAPTURE: u64 = 0x7f00_0000_1000;
const SIDE: u64 = 0x7f00_0000_2000;
const GRAPH: (u64, u64) = (1, 0);

fn every_policy() -> [&'static str; 5] {
    ["native", "expandable", "caching", "buddy", "stitched"]
}

fn events_recorded(a: &Allocator) -> u64 {
    a.driver_calls().count(DriverCall::EventRecord)
}

#[test]
fn a_pools_blocks_go_only_to_allocations_in_that_pool() {
    for p in every_policy() {
        let (a, _) = audited_sim(&format!("policy:{p}"), 8 * GIB);
        a.begin_pool(GRAPH).unwrap();
        assert!(a.pools_filling());
        // What a capture allocates and frees (a temporary), and what it keeps (the output).
        let tmp = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
        let out = a.allocate_in_pool(MIB, CAPTURE, GRAPH).unwrap();
        a.free_on(tmp.ptr, CAPTURE).unwrap();
        // Within the capture the freed temporary is the pool's to reuse.
        let again = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
        assert_eq!(
            again.ptr, tmp.ptr,
            "{p}: the pool reuses its own free block"
        );
        a.free_on(again.ptr, CAPTURE).unwrap();
        a.end_pool(GRAPH).unwrap();
        assert!(!a.pools_filling());
        // After the capture, eager allocations of the same sizes on the same stream never get
        // the graph's addresses, and neither does anything after empty_cache.
        let eager: Vec<_> = (0..4)
            .flat_map(|_| {
                [
                    a.allocate(3 * MIB, CAPTURE).unwrap(),
                    a.allocate(MIB, CAPTURE).unwrap(),
                ]
            })
            .collect();
        for e in &eager {
            let overlaps =
                |b: &gpumem_core::Allocation| e.ptr < b.ptr + b.size && b.ptr < e.ptr + e.size;
            assert!(
                !overlaps(&tmp) && !overlaps(&out),
                "{p}: eager block {e:?} is in the graph's memory"
            );
        }
        for e in &eager {
            a.free(e.ptr).unwrap();
        }
        let held = a.held_bytes();
        a.empty_cache().unwrap();
        assert!(
            a.held_bytes() >= 4 * MIB,
            "{p}: empty_cache left the pool's memory ({} bytes held of {held})",
            a.held_bytes()
        );
        let fresh = a.allocate(3 * MIB, SIDE).unwrap();
        assert!(
            fresh.ptr + fresh.size <= tmp.ptr || fresh.ptr >= tmp.ptr + tmp.size,
            "{p}: after empty_cache another stream took the graph's temporary"
        );
        a.free(fresh.ptr).unwrap();
        // The graph's output is freed eagerly (by pointer, on its stream): back to the pool.
        a.free_on(out.ptr, CAPTURE).unwrap();
        assert_eq!(a.memory_stats().allocation.all.current, 0, "{p}");
        a.check().unwrap();
    }
}

#[test]
fn the_last_user_gone_the_pools_memory_is_given_back_and_its_slot_reused() {
    let (a, _) = audited_sim("policy:caching", 8 * GIB);
    a.begin_pool(GRAPH).unwrap();
    let x = a.allocate_in_pool(5 * MIB, CAPTURE, GRAPH).unwrap();
    a.free_on(x.ptr, CAPTURE).unwrap();
    a.end_pool(GRAPH).unwrap();
    // A second graph shares the pool (torch.cuda.graph(pool=g.pool())).
    a.begin_pool(GRAPH).unwrap();
    let y = a.allocate_in_pool(5 * MIB, CAPTURE, GRAPH).unwrap();
    assert_eq!(
        y.ptr, x.ptr,
        "the second graph reuses the first one's free block"
    );
    a.free_on(y.ptr, CAPTURE).unwrap();
    a.end_pool(GRAPH).unwrap();
    assert_eq!(a.pool_use_count(GRAPH), 2);
    let held = a.held_bytes();
    assert!(held > 0);
    a.release_pool(GRAPH).unwrap();
    assert_eq!(a.empty_cache().unwrap(), 0, "one graph still uses the pool");
    assert_eq!(a.held_bytes(), held);
    a.release_pool(GRAPH).unwrap();
    assert_eq!(a.pool_use_count(GRAPH), 0);
    // Released at the next empty_cache, as PyTorch releases a freed graph pool.
    assert_eq!(a.held_bytes(), held);
    assert_eq!(a.empty_cache().unwrap(), held);
    assert_eq!(a.held_bytes(), 0);
    assert_eq!(a.pool_count(), 0, "the empty unused pool is forgotten");
    assert!(matches!(a.release_pool(GRAPH), Err(AllocError::Pool(_))));
    // Graphs made and dropped one after another do not use up the stream table.
    let shards_before = a.streams().len();
    for g in 2..2000u64 {
        a.begin_pool((g, 0)).unwrap();
        let b = a.allocate_in_pool(MIB, CAPTURE, (g, 0)).unwrap();
        a.free_on(b.ptr, CAPTURE).unwrap();
        a.end_pool((g, 0)).unwrap();
        a.release_pool((g, 0)).unwrap();
        a.empty_cache().unwrap();
    }
    assert_eq!(a.pool_count(), 0);
    assert_eq!(a.streams().len(), shards_before, "pools are not streams");
    a.check().unwrap();
}

#[test]
fn an_unused_pools_live_block_returns_its_memory_once_freed() {
    let (a, _) = audited_sim("policy:stitched", 8 * GIB);
    a.begin_pool(GRAPH).unwrap();
    let out = a.allocate_in_pool(7 * MIB, CAPTURE, GRAPH).unwrap();
    a.end_pool(GRAPH).unwrap();
    a.release_pool(GRAPH).unwrap();
    // The graph is gone but its output tensor lives on.
    a.empty_cache().unwrap();
    assert_eq!(a.pool_count(), 1);
    assert!(a.held_bytes() >= 7 * MIB);
    a.free(out.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.held_bytes(), 0);
    assert_eq!(a.pool_count(), 0);
}

#[test]
fn no_event_is_recorded_or_queried_while_a_capture_is_underway() {
    for p in every_policy() {
        let (a, ctl) = audited_sim(&format!("policy:{p}"), 8 * GIB);
        // An eager block used on a side stream, freed during the capture.
        let x = a.allocate(2 * MIB, CAPTURE).unwrap();
        a.record_stream(x.ptr, SIDE).unwrap();
        a.begin_pool(GRAPH).unwrap();
        let recorded = events_recorded(&a);
        a.free_on(x.ptr, CAPTURE).unwrap();
        assert_eq!(
            events_recorded(&a),
            recorded,
            "{p}: an event recorded during capture"
        );
        // Not reusable yet: its stream use has not been waited for.
        let y = a.allocate(2 * MIB, CAPTURE).unwrap();
        assert_ne!(
            y.ptr, x.ptr,
            "{p}: reused before its side-stream use was waited for"
        );
        a.synchronize_events().unwrap();
        assert!(
            ctl.take_waits().is_empty(),
            "{p}: the host waited during capture"
        );
        a.end_pool(GRAPH).unwrap();
        // After the capture, the first poll records the deferred event; the block is reused
        // only once it completes.
        a.free(y.ptr).unwrap();
        a.process_events().unwrap();
        assert!(
            events_recorded(&a) > recorded,
            "{p}: the deferred event was not recorded"
        );
        let z = a.allocate(2 * MIB, CAPTURE).unwrap();
        assert_ne!(z.ptr, x.ptr, "{p}: reused before the event completed");
        for (e, _) in ctl.take_recorded() {
            ctl.complete(e);
        }
        a.process_events().unwrap();
        a.free(z.ptr).unwrap();
        assert_eq!(a.memory_stats().active.all.current, 0, "{p}");
        a.release_pool(GRAPH).unwrap();
        a.check().unwrap();
    }
}

#[test]
fn running_out_of_memory_during_a_capture_gives_nothing_back() {
    let (a, _) = audited_sim("policy:caching", GIB);
    let cached = a.allocate(600 * MIB, SIDE).unwrap();
    a.free(cached.ptr).unwrap();
    let held = a.held_bytes();
    a.begin_pool(GRAPH).unwrap();
    // 600 MiB cached on another stream: outside a capture the retry would free it.
    let e = a.allocate_in_pool(600 * MIB, CAPTURE, GRAPH).unwrap_err();
    assert!(e.is_oom(), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("0 retries after releasing the cache")
            && msg.contains("a CUDA graph capture was underway")
            && msg.contains("600.00 MiB of cached memory"),
        "{msg}"
    );
    assert_eq!(
        a.held_bytes(),
        held,
        "nothing given back during the capture"
    );
    assert_eq!(a.empty_cache().unwrap(), 0);
    a.end_pool(GRAPH).unwrap();
    let ok = a.allocate_in_pool(1, CAPTURE, GRAPH);
    assert!(matches!(ok, Err(AllocError::Pool(_))), "{ok:?}");
    // Outside the capture, the same request on the stream succeeds after the retry.
    let b = a.allocate(600 * MIB, CAPTURE).unwrap();
    a.free(b.ptr).unwrap();
    a.release_pool(GRAPH).unwrap();
}

#[test]
fn misuse_of_pools_is_refused_and_changes_nothing() {
    let (a, _) = audited_sim("policy:caching", GIB);
    for r in [
        a.begin_pool((0, 0)),
        a.end_pool(GRAPH),
        a.release_pool(GRAPH),
        a.allocate_in_pool(MIB, CAPTURE, GRAPH).map(drop),
    ] {
        assert!(matches!(r, Err(AllocError::Pool(_))), "{r:?}");
    }
    a.begin_pool(GRAPH).unwrap();
    let twice = a.begin_pool(GRAPH).unwrap_err();
    assert!(
        twice.to_string().contains("already being filled"),
        "{twice}"
    );
    assert!(a.allocate_in_pool(0, CAPTURE, GRAPH).is_err());
    a.end_pool(GRAPH).unwrap();
    assert!(
        !a.pools_filling(),
        "a refused begin left no capture counted"
    );
    assert_eq!(a.pool_use_count(GRAPH), 1);
}

#[test]
fn snapshots_show_a_graphs_pool_with_its_id_and_stream() {
    // With the history on, the stitched policy's snapshot is built from its mapped ranges; a
    // pool's plain segments are shown beside them, named by the pool and the capture stream.
    for p in ["stitched", "caching"] {
        let (a, _) = audited_sim(&format!("policy:{p},history:1000"), 8 * GIB);
        let eager = a.allocate(5 * MIB, SIDE).unwrap();
        a.begin_pool(GRAPH).unwrap();
        let out = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
        a.end_pool(GRAPH).unwrap();
        let snap = gpumem_core::report::snapshot::collect(&a).unwrap();
        let pooled: Vec<_> = snap
            .segments
            .iter()
            .filter(|s| s.pool_id != (0, 0))
            .collect();
        assert_eq!(pooled.len(), 1, "{p}");
        assert_eq!(pooled[0].pool_id, GRAPH, "{p}");
        assert_eq!(pooled[0].stream, CAPTURE, "{p}");
        assert!(!pooled[0].is_expandable, "{p}: a pool holds plain segments");
        assert!(
            pooled[0].address <= out.ptr
                && out.ptr + out.size <= pooled[0].address + pooled[0].total_size,
            "{p}"
        );
        let eager_seg = snap
            .segments
            .iter()
            .find(|s| s.address <= eager.ptr && eager.ptr < s.address + s.total_size)
            .unwrap();
        assert_eq!((eager_seg.pool_id, eager_seg.stream), ((0, 0), SIDE), "{p}");
        // The pickle PyTorch's visualizer reads is written from the same segments, and the
        // trace reader finds the pool in it: a replay warns that it serves such allocations
        // from the ordinary pools.
        let bytes = gpumem_core::report::snapshot::snapshot_pickle(&a).unwrap();
        let back = gpumem_core::trace::pickle::read_snapshot_bytes(bytes, p, 0).unwrap();
        let ids: Vec<_> = back.segments.iter().map(|s| s.pool_id).collect();
        assert_eq!(
            ids.iter().filter(|&&id| id == GRAPH).count(),
            1,
            "{p}: {ids:?}"
        );
        assert!(
            ids.iter().all(|&id| id == GRAPH || id == (0, 0)),
            "{p}: {ids:?}"
        );
        assert_eq!(back.trace.meta.pool_segments, 1, "{p}");
        // `gpumem summary` of it says so too.
        let summary = gpumem_core::report::summary::snapshot_stats(&back);
        assert!(
            summary
                .notes
                .iter()
                .any(|n| n.contains("(20.00 MiB held) belong to 1 private pool")),
            "{p}: {:?}",
            summary.notes
        );
        assert!(
            back.trace
                .warnings()
                .iter()
                .any(|w| w.starts_with("1 segments belonged to private pools")),
            "{p}: {:?}",
            back.trace.warnings()
        );
    }
}

#[test]
fn the_notes_say_what_the_pools_hold() {
    let (a, _) = audited_sim("policy:stitched", 8 * GIB);
    assert!(!a.policy_notes().iter().any(|n| n.contains("private pools")));
    a.begin_pool(GRAPH).unwrap();
    let out = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
    a.end_pool(GRAPH).unwrap();
    let note = a
        .policy_notes()
        .into_iter()
        .find(|n| n.contains("private pools"))
        .expect("a note on the pools");
    // One pool of one 20 MiB segment (a 3 MiB request), 3 MiB of it live, one graph using it.
    assert!(
        note.contains(": 1 holding 20.00 MiB (3.00 MiB of it in live tensors); 1 user(s)"),
        "{note}"
    );
    a.free(out.ptr).unwrap();
    a.release_pool(GRAPH).unwrap();
    a.empty_cache().unwrap();
    assert!(!a.policy_notes().iter().any(|n| n.contains("private pools")));
}

#[test]
fn a_pools_own_empty_cache_gives_back_that_pool_alone() {
    let (a, _) = audited_sim("policy:caching", 8 * GIB);
    let eager = a.allocate(5 * MIB, SIDE).unwrap();
    a.free(eager.ptr).unwrap(); // 20 MiB cached on another stream
    a.begin_pool(GRAPH).unwrap();
    let x = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
    a.end_pool(GRAPH).unwrap();
    a.free(x.ptr).unwrap();
    assert_eq!(
        a.empty_pool_cache(GRAPH).unwrap(),
        0,
        "a graph still uses the pool"
    );
    assert_eq!(a.empty_pool_cache((7, 7)).unwrap(), 0, "no such pool");
    a.release_pool(GRAPH).unwrap();
    let held = a.held_bytes();
    assert_eq!(a.empty_pool_cache(GRAPH).unwrap(), 20 * MIB);
    assert_eq!(
        a.held_bytes(),
        held - 20 * MIB,
        "the other stream's cache stays"
    );
    assert_eq!(a.pool_count(), 0);
    assert_eq!(a.empty_cache().unwrap(), 20 * MIB);
}

/// (address, bytes) of segments or blocks.
type Ranges = Vec<(u64, u64)>;

/// The pool's segments and its allocated blocks, from the snapshot: what a checkpoint restore
/// must reproduce.
fn pool_layout(a: &Allocator) -> (Ranges, Ranges) {
    let segs: Vec<_> = a
        .snapshot()
        .into_iter()
        .filter(|s| a.private_pool_of(s.stream).is_some())
        .collect();
    let blocks = segs
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.kind == gpumem_core::policy::BlockKind::Allocated)
        .map(|b| (b.addr, b.size))
        .collect();
    (segs.iter().map(|s| (s.addr, s.size)).collect(), blocks)
}

fn overlaps(x: &gpumem_core::Allocation, y: &gpumem_core::Allocation) -> bool {
    x.ptr < y.ptr + y.size && y.ptr < x.ptr + x.size
}

/// What torch.compile's CUDA graph trees do: record a graph, checkpoint the pool, replay (the
/// outputs live in the pool unbeknown to the allocator), record more, then set the pool back to
/// the checkpoint before recording a new branch.
#[test]
fn a_checkpoint_puts_the_pools_blocks_back_where_they_were() {
    for p in every_policy() {
        let (a, _) = audited_sim(&format!("policy:{p}"), 8 * GIB);
        a.begin_pool(GRAPH).unwrap();
        let x = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
        let tmp = a.allocate_in_pool(MIB / 2, CAPTURE, GRAPH).unwrap();
        let y = a.allocate_in_pool(MIB + 4096, CAPTURE, GRAPH).unwrap();
        let z = a.allocate_in_pool(5 * MIB, CAPTURE, GRAPH).unwrap();
        let small = a.allocate_in_pool(3000, CAPTURE, GRAPH).unwrap();
        a.free_on(tmp.ptr, CAPTURE).unwrap();
        a.end_pool(GRAPH).unwrap();
        let at_checkpoint = pool_layout(&a);
        let cp = a.checkpoint_pool(GRAPH).unwrap();
        let mut want: Vec<_> = [x, y, z, small].iter().map(|b| (b.ptr, b.size)).collect();
        want.sort_unstable();
        let mut got: Vec<_> = cp.blocks.iter().map(|b| (b.addr, b.size)).collect();
        got.sort_unstable();
        assert_eq!(got, want, "{p}: the checkpoint lists the live blocks");
        assert_eq!(cp.segments, at_checkpoint.0);

        // Later: y died, and a second graph of the chain recorded w and a temporary.
        a.free_on(y.ptr, CAPTURE).unwrap();
        a.begin_pool(GRAPH).unwrap();
        let w = a.allocate_in_pool(2 * MIB, CAPTURE, GRAPH).unwrap();
        let t2 = a.allocate_in_pool(MIB / 2, CAPTURE, GRAPH).unwrap();
        a.free_on(t2.ptr, CAPTURE).unwrap();
        a.end_pool(GRAPH).unwrap();
        let allocs = a.driver_calls().count(DriverCall::MemAlloc);

        let r = a.restore_pool(&cp).unwrap();
        let mut freed = r.freed.clone();
        freed.sort_unstable();
        let mut live_before: Vec<_> = [x.ptr, z.ptr, small.ptr, w.ptr].to_vec();
        live_before.sort_unstable();
        assert_eq!(freed, live_before, "{p}: every block live before is freed");
        let mut back: Vec<_> = r.allocated.iter().map(|b| (b.ptr, b.size)).collect();
        back.sort_unstable();
        assert_eq!(back, want, "{p}: the checkpoint's blocks are back");
        assert_eq!(pool_layout(&a), at_checkpoint, "{p}: the pool's layout");
        assert_eq!(
            a.driver_calls().count(DriverCall::MemAlloc),
            allocs,
            "{p}: a restore asks the device for nothing"
        );
        let stats = a.memory_stats();
        assert_eq!(
            stats.allocated_bytes.all.current as u64,
            x.size + y.size + z.size + small.size,
            "{p}: the statistics count the checkpoint's blocks"
        );
        a.check().unwrap();

        // A new branch records into the pool: it must not get the restored blocks.
        a.begin_pool(GRAPH).unwrap();
        let v = a.allocate_in_pool(MIB + 4096, CAPTURE, GRAPH).unwrap();
        a.end_pool(GRAPH).unwrap();
        assert!(
            r.allocated.iter().all(|b| !overlaps(b, &v)),
            "{p}: the new branch's block {v:?} overlaps a restored one"
        );
        // The restored blocks are ordinary allocations: freed by handle or by pointer.
        a.free_allocation(&r.allocated[0]).unwrap();
        for b in &r.allocated[1..] {
            a.free(b.ptr).unwrap();
        }
        a.free(v.ptr).unwrap();
        assert!(a.free(w.ptr).is_err(), "{p}: w was freed by the restore");
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0, "{p}");
        a.check().unwrap();
        // Released by its users, the pool gives its memory back as before.
        for _ in 0..3 {
            a.release_pool(GRAPH).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.held_bytes(), 0, "{p}");
    }
}

#[test]
fn a_restore_that_cannot_be_done_is_refused_and_changes_nothing() {
    let (a, _) = audited_sim("policy:stitched", 8 * GIB);
    assert!(matches!(a.checkpoint_pool(GRAPH), Err(AllocError::Pool(_))));
    a.begin_pool(GRAPH).unwrap();
    let x = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
    a.end_pool(GRAPH).unwrap();
    let cp = a.checkpoint_pool(GRAPH).unwrap();
    let y = a.allocate(MIB, SIDE).unwrap();
    let before = pool_layout(&a);

    // While a capture fills the pool.
    a.begin_pool(GRAPH).unwrap();
    let e = a.restore_pool(&cp).unwrap_err().to_string();
    assert!(e.contains("a capture is filling it"), "{e}");
    a.end_pool(GRAPH).unwrap();
    assert_eq!(pool_layout(&a), before);

    // A live block of the pool used on another stream.
    a.record_stream(x.ptr, SIDE).unwrap();
    let e = a.restore_pool(&cp).unwrap_err().to_string();
    assert!(e.contains("record_stream"), "{e}");
    assert_eq!(pool_layout(&a), before);

    // A checkpoint naming a segment the pool does not have.
    let mut bogus = cp.clone();
    bogus.segments.push((y.ptr, 2 * MIB));
    let e = a.restore_pool(&bogus).unwrap_err().to_string();
    assert!(e.contains("is gone"), "{e}");
    let mut other = cp.clone();
    other.id = (9, 9);
    assert!(a.restore_pool(&other).is_err());
    // Blocks that overlap, or lie outside the checkpoint's segments (built by hand).
    let b = cp.blocks[0];
    for blocks in [
        vec![
            b,
            gpumem_core::CheckpointBlock {
                addr: b.addr + 512,
                ..b
            },
        ],
        vec![gpumem_core::CheckpointBlock { addr: y.ptr, ..b }],
        vec![gpumem_core::CheckpointBlock { size: 0, ..b }],
    ] {
        let bad = gpumem_core::PoolCheckpoint {
            blocks,
            ..cp.clone()
        };
        let e = a.restore_pool(&bad).unwrap_err().to_string();
        assert!(e.contains("overlaps another or lies outside"), "{e}");
    }
    assert_eq!(pool_layout(&a), before);

    // Everything still frees as it should.
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.synchronize_events().unwrap();
    a.check().unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
}

#[test]
fn with_the_history_on_a_restore_is_recorded_and_snapshots_agree() {
    for p in ["stitched", "caching"] {
        let (a, _) = audited_sim(&format!("policy:{p},history:1000"), 8 * GIB);
        a.begin_pool(GRAPH).unwrap();
        let x = a.allocate_in_pool(3 * MIB, CAPTURE, GRAPH).unwrap();
        let y = a.allocate_in_pool(MIB, CAPTURE, GRAPH).unwrap();
        a.end_pool(GRAPH).unwrap();
        let cp = a.checkpoint_pool(GRAPH).unwrap();
        a.free(y.ptr).unwrap();
        let r = a.restore_pool(&cp).unwrap();
        assert_eq!(r.freed, vec![x.ptr], "{p}");
        // The snapshot, built from the history, checks that it agrees with the policies'
        // blocks: both blocks are live again.
        let snap = gpumem_core::report::snapshot::collect(&a).unwrap();
        let mut active: Vec<_> = snap
            .segments
            .iter()
            .filter(|s| s.pool_id == GRAPH)
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == gpumem_core::trace::pickle::BlockState::ActiveAllocated)
            .map(|b| b.address)
            .collect();
        active.sort_unstable();
        let mut want = vec![x.ptr, y.ptr];
        want.sort_unstable();
        assert_eq!(active, want, "{p}");
        for b in &r.allocated {
            a.free(b.ptr).unwrap();
        }
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0, "{p}");
    }
}
