//! Drives every policy with long random sequences of allocations, frees, cross-stream uses,
//! event completions and cache releases, and checks each step against a simple model:
//! no two live blocks overlap, a block freed with pending stream uses is not handed out again
//! before its events complete, the byte statistics equal the model's sums exactly, the bytes
//! held equal the device's, and (every few steps) the policy's structure holds (blocks tile
//! their segments, no two free neighbours are left unmerged).
//!
//! CUDA graph captures come and go too: while one is underway, its stream allocates from a
//! private pool (as PyTorch routes it), and no allocation outside a pool may ever overlap memory
//! a pool with users has handed out; the pool's memory is free for others only once its last
//! user is gone.
//!
//! Checkpoints of a pool are taken and restored, as torch.compile's CUDA graph trees do: a
//! restore frees the pool's live blocks and hands the checkpoint's out again at their
//! addresses, which must overlap nothing live.
//!
//! GPUMEM_FUZZ_OPS sets the total number of operations (default 2,000,000 across all policies).

use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use gpumem_core::{AllocError, Allocation, Allocator, Config, PolicyKind};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestRunner};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Restores that put blocks back, over the whole run (the fuzz must reach them).
static RESTORED: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug, Clone)]
enum Op {
    Alloc { size: u64, stream: u8 },
    Free { pick: usize },
    UseOnStream { pick: usize, stream: u8 },
    CompleteEvents { count: usize },
    EmptyCache,
    BeginCapture { pool: u8, stream: u8 },
    EndCapture,
    ReleasePool { pool: u8 },
    Checkpoint { pool: u8 },
    Restore { pool: u8 },
}

const POOLS: [(u64, u64); 3] = [(1, 0), (2, 0), (0, 3)];

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        8 => 1u64..=4096,
        6 => 4097u64..=(1 << 20),
        4 => (1u64 << 20)..=(24 << 20),
        1 => (24u64 << 20)..=(160 << 20),
        // Exact sizes that repeat, as in training loops.
        3 => prop::sample::select(vec![3072u64, 9216, 2 << 20, 9_437_184, 4_718_592]),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size_strategy(), 0u8..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        8 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0u8..3).prop_map(|(pick, stream)| Op::UseOnStream { pick, stream }),
        2 => (1usize..6).prop_map(|count| Op::CompleteEvents { count }),
        1 => Just(Op::EmptyCache),
        1 => (0u8..3, 0u8..3).prop_map(|(pool, stream)| Op::BeginCapture { pool, stream }),
        1 => Just(Op::EndCapture),
        1 => (0u8..3).prop_map(|pool| Op::ReleasePool { pool }),
        1 => (0u8..3).prop_map(|pool| Op::Checkpoint { pool }),
        1 => (0u8..3).prop_map(|pool| Op::Restore { pool }),
    ]
}

const STREAMS: [u64; 3] = [0, 0x7f00_dead_0000, 0x7f00_beef_0000];

struct Live {
    a: Allocation,
    requested: u64,
    used_on: Vec<u64>,
    /// The private pool it came from.
    pool: Option<usize>,
}

type Pending = (
    u64,
    u64,
    u64,
    Vec<gpumem_core::backend::EventHandle>,
    Option<usize>,
);

struct Model {
    live: Vec<Live>,
    /// Address ranges freed but waiting for events: (start, end, requested bytes, events, the
    /// private pool of the block).
    quarantine: Vec<Pending>,
    /// The capture underway: its pool and stream.
    capture: Option<(usize, u64)>,
    /// Each pool's users, and every range it handed out since it last had none.
    pools: [(u32, Vec<(u64, u64)>); 3],
    /// Each pool's last checkpoint, kept while the pool has had users ever since.
    checkpoints: [Option<gpumem_core::PoolCheckpoint>; 3],
}

impl Model {
    /// A pool with users that handed out memory overlapping `start..end`, other than `mine`.
    fn pool_memory_at(&self, start: u64, end: u64, mine: Option<usize>) -> Option<usize> {
        (0..POOLS.len()).find(|&p| {
            Some(p) != mine
                && self.pools[p].0 > 0
                && self.pools[p].1.iter().any(|&(s, e)| start < e && s < end)
        })
    }

    /// A range a pool with users handed out that the allocator no longer holds (given back to
    /// the device, where another allocation could get it).
    fn pool_memory_lost(&self, alloc: &Allocator) -> Option<(usize, u64, u64)> {
        let segments = alloc.snapshot();
        let held = |s: u64, e: u64| segments.iter().any(|g| g.addr <= s && e <= g.addr + g.size);
        (0..POOLS.len())
            .filter(|&p| self.pools[p].0 > 0)
            .flat_map(|p| self.pools[p].1.iter().map(move |&(s, e)| (p, s, e)))
            .find(|&(_, s, e)| !held(s, e))
    }

    fn pools_hold_memory(&self) -> bool {
        self.capture.is_some() || self.pools.iter().any(|p| p.0 > 0 || !p.1.is_empty())
    }
}

fn overlaps(map: &BTreeMap<u64, u64>, start: u64, end: u64) -> Option<(u64, u64)> {
    if let Some((&s, &e)) = map.range(..end).next_back() {
        if e > start {
            return Some((s, e));
        }
    }
    None
}

fn run_sequence(policy: PolicyKind, extra: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let (sim, ctl): (SimBackend, SimControl) = SimBackend::new(SimConfig {
        // A small device, so that out-of-memory and cache release are exercised too.
        total_bytes: 1 << 30,
        event_mode: EventMode::Manual,
        ..SimConfig::default()
    });
    let cfg = Config::parse(&format!("policy:{}{extra}", policy.name())).unwrap();
    let alloc = Allocator::new(Box::new(sim), cfg).unwrap();
    let mut m = Model {
        live: Vec::new(),
        quarantine: Vec::new(),
        capture: None,
        pools: Default::default(),
        checkpoints: Default::default(),
    };
    let mut ranges: BTreeMap<u64, u64> = BTreeMap::new();
    let mut retries = 0;
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Alloc { size, stream } => {
                let s = STREAMS[*stream as usize];
                // During a capture its stream's requests go to the capture's pool (PyTorch's
                // filter routes them there).
                let pool = m.capture.filter(|&(_, cs)| cs == s).map(|(p, _)| p);
                let r = match pool {
                    Some(p) => alloc.allocate_in_pool(*size, s, POOLS[p]),
                    None => alloc.allocate(*size, s),
                };
                match r {
                    Ok(a) => {
                        prop_assert!(a.size >= *size, "block smaller than the request");
                        let (start, end) = (a.ptr, a.ptr + a.size);
                        if let Some(p) = m.pool_memory_at(start, end, pool) {
                            return Err(TestCaseError::fail(format!(
                                "{policy:?} step {step}: block {start:#x}..{end:#x} (pool {pool:?}) is in memory of pool {p}, which has users"
                            )));
                        }
                        if let Some(p) = pool {
                            m.pools[p].1.push((start, end));
                        }
                        let r = alloc.memory_stats().num_alloc_retries;
                        if r > retries {
                            // This request found no room at first: the allocator waited for
                            // every event and released its cache (as PyTorch does), so nothing
                            // is pending any more; during a capture it could do neither.
                            retries = r;
                            if m.capture.is_none() {
                                m.quarantine.clear();
                            }
                        }
                        if let Some((os, oe)) = overlaps(&ranges, start, end) {
                            return Err(TestCaseError::fail(format!(
                                "{policy:?} step {step}: new block {start:#x}..{end:#x} overlaps live {os:#x}..{oe:#x}"
                            )));
                        }
                        for (qs, qe, ..) in &m.quarantine {
                            prop_assert!(
                                end <= *qs || start >= *qe,
                                "{:?} step {}: block {:#x} reuses memory freed with pending stream uses",
                                policy,
                                step,
                                start
                            );
                        }
                        ranges.insert(start, end);
                        m.live.push(Live {
                            a,
                            requested: *size,
                            used_on: Vec::new(),
                            pool,
                        });
                    }
                    Err(AllocError::OutOfMemory(r)) => {
                        // Segment-based policies may fail through fragmentation (that is what
                        // they are). The stitched policy maps pages wherever they are needed:
                        // it may fail only when the pages its live blocks touch fill the device.
                        let live: u64 = m.live.iter().map(|l| l.a.size).sum();
                        let touch_bound = live + size + 4 * (2 << 20) * (m.live.len() as u64 + 1);
                        prop_assert!(
                            policy != PolicyKind::Stitched
                                || touch_bound >= 1 << 30
                                || m.pools_hold_memory(),
                            "{:?} step {}: OOM with only {} bytes live: {}",
                            policy,
                            step,
                            live,
                            r
                        );
                        retries = alloc.memory_stats().num_alloc_retries;
                        if m.capture.is_none() {
                            m.quarantine.clear();
                        }
                    }
                    Err(e) => {
                        return Err(TestCaseError::fail(format!("{policy:?} step {step}: {e}")))
                    }
                }
            }
            Op::Free { pick } => {
                if m.live.is_empty() {
                    continue;
                }
                // A block used on other streams freed during a capture waits, with no event,
                // until the capture ends: not modelled here.
                if m.capture.is_some() && !m.live[pick % m.live.len()].used_on.is_empty() {
                    continue;
                }
                let l = m.live.swap_remove(pick % m.live.len());
                ranges.remove(&l.a.ptr);
                ctl.take_recorded();
                alloc
                    .free_allocation(&l.a)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                // One event per other stream that used the block; besides them, only the
                // block's own stream may get one (the shared range marks its place at the free).
                let (evs, own): (Vec<_>, Vec<_>) = ctl
                    .take_recorded()
                    .into_iter()
                    .partition(|(_, s)| l.used_on.contains(s));
                prop_assert!(
                    own.iter().all(|&(_, s)| s == l.a.stream),
                    "events recorded on unrelated streams at a free: {:?}",
                    own
                );
                let evs: Vec<_> = evs.into_iter().map(|(h, _)| h).collect();
                if !l.used_on.is_empty() {
                    prop_assert_eq!(evs.len(), l.used_on.len(), "one event per stream used");
                    m.quarantine
                        .push((l.a.ptr, l.a.ptr + l.a.size, l.requested, evs, l.pool));
                }
                // A second free of the same pointer is an error, never a crash.
                prop_assert!(alloc.free(l.a.ptr).is_err());
            }
            Op::UseOnStream { pick, stream } => {
                if m.live.is_empty() {
                    continue;
                }
                let n = m.live.len();
                let l = &mut m.live[pick % n];
                let s = STREAMS[*stream as usize];
                alloc
                    .record_stream(l.a.ptr, s)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                if s != l.a.stream && !l.used_on.contains(&s) {
                    l.used_on.push(s);
                }
            }
            Op::CompleteEvents { .. } if m.capture.is_some() => {
                // No event is queried during a capture: the blocks stay pending.
                alloc
                    .process_events()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::CompleteEvents { count } => {
                for (_, _, _, evs, _) in m.quarantine.drain(..(*count).min(m.quarantine.len())) {
                    for e in evs {
                        ctl.complete(e);
                    }
                }
                alloc
                    .process_events()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::EmptyCache if m.capture.is_some() => {
                // Nothing is given back during a capture.
                let held = alloc.held_bytes();
                let freed = alloc
                    .empty_cache()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(
                    (freed, alloc.held_bytes()),
                    (0, held),
                    "empty_cache in a capture"
                );
            }
            Op::BeginCapture { pool, stream } => {
                if m.capture.is_some() {
                    continue;
                }
                let p = *pool as usize;
                alloc
                    .begin_pool(POOLS[p])
                    .map_err(|e| TestCaseError::fail(format!("{policy:?} step {step}: {e}")))?;
                m.pools[p].0 += 1;
                m.capture = Some((p, STREAMS[*stream as usize]));
            }
            Op::EndCapture => {
                if let Some((p, _)) = m.capture.take() {
                    alloc
                        .end_pool(POOLS[p])
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
            Op::ReleasePool { pool } => {
                let p = *pool as usize;
                if m.pools[p].0 == 0 || m.capture.is_some_and(|(c, _)| c == p) {
                    prop_assert!(m.pools[p].0 > 0 || alloc.release_pool(POOLS[p]).is_err());
                    continue;
                }
                alloc
                    .release_pool(POOLS[p])
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                m.pools[p].0 -= 1;
                if m.pools[p].0 == 0 {
                    // Its memory may go to anyone now, once freed and given back.
                    m.pools[p].1.clear();
                    m.checkpoints[p] = None;
                }
                prop_assert_eq!(alloc.pool_use_count(POOLS[p]), m.pools[p].0);
            }
            Op::Checkpoint { pool } => {
                let p = *pool as usize;
                if m.pools[p].0 == 0 {
                    continue;
                }
                let cp = alloc
                    .checkpoint_pool(POOLS[p])
                    .map_err(|e| TestCaseError::fail(format!("{policy:?} step {step}: {e}")))?;
                let mut got: Vec<_> = cp.blocks.iter().map(|b| (b.addr, b.size)).collect();
                let mut want: Vec<_> = m
                    .live
                    .iter()
                    .filter(|l| l.pool == Some(p))
                    .map(|l| (l.a.ptr, l.a.size))
                    .collect();
                got.sort_unstable();
                want.sort_unstable();
                prop_assert_eq!(
                    got,
                    want,
                    "{:?} step {}: checkpoint of pool {}",
                    policy,
                    step,
                    p
                );
                m.checkpoints[p] = Some(cp);
            }
            Op::Restore { pool } => {
                let p = *pool as usize;
                let Some(cp) = m.checkpoints[p].clone() else {
                    continue;
                };
                let used_elsewhere = m
                    .live
                    .iter()
                    .any(|l| l.pool == Some(p) && !l.used_on.is_empty());
                if m.capture.is_some_and(|(c, _)| c == p) || used_elsewhere {
                    // Refused, and nothing changes (the statistics below check it).
                    prop_assert!(
                        alloc.restore_pool(&cp).is_err(),
                        "{:?} step {}",
                        policy,
                        step
                    );
                    continue;
                }
                if m.capture.is_some() {
                    continue; // another pool fills: its pending blocks could not be waited for
                }
                let r = alloc
                    .restore_pool(&cp)
                    .map_err(|e| TestCaseError::fail(format!("{policy:?} step {step}: {e}")))?;
                // Every live block of the pool is freed, its pending ones waited for.
                let (gone, kept): (Vec<_>, Vec<_>) =
                    m.live.drain(..).partition(|l| l.pool == Some(p));
                m.live = kept;
                let mut freed: Vec<_> = gone.iter().map(|l| l.a.ptr).collect();
                let mut got = r.freed.clone();
                freed.sort_unstable();
                got.sort_unstable();
                prop_assert_eq!(
                    got,
                    freed,
                    "{:?} step {}: blocks freed by the restore",
                    policy,
                    step
                );
                for l in &gone {
                    ranges.remove(&l.a.ptr);
                }
                m.quarantine.retain(|q| q.4 != Some(p));
                // The checkpoint's blocks are live again, where they were, on top of nothing.
                for (a, b) in r.allocated.iter().zip(&cp.blocks) {
                    prop_assert_eq!((a.ptr, a.size), (b.addr, b.size));
                    let (start, end) = (a.ptr, a.ptr + a.size);
                    if let Some((os, oe)) = overlaps(&ranges, start, end) {
                        return Err(TestCaseError::fail(format!(
                            "{policy:?} step {step}: restored block {start:#x}..{end:#x} overlaps live {os:#x}..{oe:#x}"
                        )));
                    }
                    for (qs, qe, ..) in &m.quarantine {
                        prop_assert!(end <= *qs || start >= *qe, "restored over a pending block");
                    }
                    ranges.insert(start, end);
                    m.pools[p].1.push((start, end));
                    m.live.push(Live {
                        a: *a,
                        requested: b.requested,
                        used_on: Vec::new(),
                        pool: Some(p),
                    });
                }
                prop_assert_eq!(r.allocated.len(), cp.blocks.len());
                if !r.allocated.is_empty() {
                    RESTORED.fetch_add(1, Ordering::Relaxed);
                }
            }
            Op::EmptyCache => {
                // empty_cache waits for every event (the host synchronizes).
                alloc
                    .empty_cache()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                m.quarantine.clear();
            }
        }
        // Exact statistics against the model.
        let st = alloc.memory_stats();
        if st.num_alloc_retries > retries {
            // A request found no room, so the allocator waited for every event and released
            // its cache before retrying (as PyTorch does): nothing is pending any more (unless
            // a capture was underway, during which it can do neither).
            retries = st.num_alloc_retries;
            if m.capture.is_none() {
                m.quarantine.clear();
            }
        }
        let allocated: u64 = m.live.iter().map(|l| l.a.size).sum();
        prop_assert_eq!(
            st.allocated_bytes.all.current as u64,
            allocated,
            "allocated_bytes"
        );
        prop_assert_eq!(
            st.allocation.all.current as usize,
            m.live.len(),
            "allocation count"
        );
        let pending: u64 = m.quarantine.iter().map(|q| q.1 - q.0).sum();
        prop_assert_eq!(
            st.active_bytes.all.current as u64,
            allocated + pending,
            "active_bytes at step {} after {:?}",
            step,
            op
        );
        // As in PyTorch, a block's requested bytes are counted until it is reusable: the live
        // blocks' and those of blocks freed but waiting for their stream uses.
        let requested: u64 = m.live.iter().map(|l| l.requested).sum::<u64>()
            + m.quarantine.iter().map(|q| q.2).sum::<u64>();
        prop_assert_eq!(
            st.requested_bytes.all.current as u64,
            requested,
            "requested_bytes"
        );
        prop_assert_eq!(
            st.reserved_bytes.all.current as u64,
            alloc.held_bytes(),
            "reserved = held"
        );
        prop_assert!(alloc.held_bytes() >= allocated, "held below allocated");
        if matches!(op, Op::EmptyCache | Op::Alloc { .. }) {
            // Where memory can be given back: a pool with users keeps all of its own.
            if let Some((p, s, e)) = m.pool_memory_lost(&alloc) {
                return Err(TestCaseError::fail(format!(
                    "{policy:?} step {step}: pool {p} (with users) no longer holds {s:#x}..{e:#x}"
                )));
            }
        }
        if step % 32 == 0 {
            alloc
                .check()
                .map_err(|e| TestCaseError::fail(format!("{policy:?} step {step}: {e}")))?;
        }
    }
    alloc.check().map_err(TestCaseError::fail)?;
    Ok(())
}

#[test]
fn random_operations_keep_every_invariant() {
    let total: usize = std::env::var("GPUMEM_FUZZ_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    let per_case = 4000;
    // Every policy, and the stitched one with one range shared by the streams (with every
    // third allocation of a stream in a range of its own, as contention makes them).
    let runs: Vec<(PolicyKind, &str)> = PolicyKind::ALL
        .into_iter()
        .map(|p| (p, ""))
        .chain([
            (PolicyKind::Stitched, ",range:shared"),
            (PolicyKind::Stitched, ",range:shared,spill:3"),
        ])
        .collect();
    let cases = (total / per_case / runs.len()).max(1) as u32;
    for (policy, extra) in runs {
        let mut runner = TestRunner::new(PtConfig {
            cases,
            failure_persistence: None,
            ..PtConfig::default()
        });
        let r = runner.run(&prop::collection::vec(op_strategy(), per_case), |ops| {
            run_sequence(policy, extra, &ops)
        });
        if let Err(e) = r {
            panic!("{policy:?}{extra}: {e}");
        }
    }
    let restored = RESTORED.load(Ordering::Relaxed);
    eprintln!("{restored} checkpoint restores put blocks back");
    assert!(
        total < 100_000 || restored > 0,
        "no restore put a block back: the fuzz does not reach them"
    );
}
