//! Runs a recorded allocation trace through a policy and measures what it would have held.
//!
//! The trace's requests are replayed in order: `alloc` allocates, `free_requested` frees, and
//! a block whose `free_completed` comes later than its `free_requested` (it was used on
//! another stream) is freed with a stream use whose event completes exactly where the trace
//! says it did. Peak live bytes come from the trace itself (requested sizes, live from `alloc`
//! to `free_completed`), so every policy is measured against the same denominator.

use crate::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use crate::backend::{Backend, CallCounts, DriverCall, EventHandle, Stream};
use crate::config::Config;
use crate::engine::{Allocation, Allocator};
use crate::error::AllocError;
use crate::policy::PolicyKind;
use crate::trace::{Kind, Trace};
use crate::units::H200_TOTAL_BYTES;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The stream a cross-stream use is recorded on when the trace does not say which.
pub const OTHER_STREAM: Stream = u64::MAX - 1;

/// How the simulated policy compares with what the recording allocator did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fidelity {
    /// Same number of segment allocations, of the same sizes, in the same order.
    pub segments_match: bool,
    /// (simulated peak held − recorded peak held) / recorded peak held.
    pub peak_held_error: f64,
    /// Segment allocations in the trace.
    pub trace_segments: usize,
    /// Segment allocations in the simulation.
    pub sim_segments: usize,
    /// Peak bytes the recording allocator held.
    pub trace_peak_held: u64,
    /// Index of the first segment allocation that differs, if any.
    pub first_mismatch: Option<usize>,
}

/// The result of replaying one trace under one policy.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// The stitched policy's virtual ranges: `stream` (one per stream, the default) or
    /// `shared` (`range:shared`); none for the other policies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub range: Option<&'static str>,
    /// The stitched policy's physical page (`page:`, else the device's granularity; with
    /// `big_page`, the second tier's); none for the other policies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_bytes: Option<u64>,
    /// Peak bytes held from the device.
    pub peak_held_bytes: u64,
    /// Peak bytes of live requested tensors.
    pub peak_live_bytes: u64,
    /// peak_held / peak_live.
    pub ratio: f64,
    /// Driver calls by kind.
    pub driver_calls: serde_json::Value,
    /// Total driver calls.
    pub driver_calls_total: u64,
    /// Estimated driver time (cost model × calls), seconds.
    pub est_driver_seconds: f64,
    /// Driver calls in each quarter of the trace (by event index).
    pub calls_by_quarter: [u64; 4],
    /// Each quarter's driver calls by kind (the last one: a training loop's steady state).
    pub calls_by_quarter_by_kind: [serde_json::Value; 4],
    /// Estimated driver seconds in each quarter.
    pub est_seconds_by_quarter: [f64; 4],
    /// Requests that failed for lack of memory.
    pub ooms: u64,
    /// Allocations replayed.
    pub allocs: u64,
    /// Wall time of the replay (host side, engine + simulated device), seconds.
    pub replay_seconds: f64,
    /// Host time per allocator operation (alloc or free), nanoseconds.
    pub ns_per_op: f64,
    /// Samples of (event index, trace time µs, bytes held, bytes live), when asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<TimelinePoint>,
    /// Comparison with the recording allocator (native simulation of a trace with segment
    /// events only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fidelity: Option<Fidelity>,
    /// What the policy changed on its own during the replay, one line each
    /// ([`Allocator::policy_notes`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// The trace's lower reference ([`crate::reference`]: best fit in one range, pages held
    /// only while touched), held ÷ live, when the caller computed it; the same for every
    /// policy of a trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lower_reference: Option<f64>,
    /// The allocations that remapped pages, grouped by requested size and stream, most pages
    /// first, when asked for ([`ReplayOptions::remap_sites`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub remap_sites: Vec<RemapSite>,
}

/// Allocations of one requested size on one stream that unmapped pages to place their block
/// (a virtual page whose physical page had gone elsewhere): where a layout that keeps moving
/// pays its driver calls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RemapSite {
    /// Bytes the trace asked for.
    pub size: u64,
    /// The trace's stream.
    pub stream: u64,
    /// Allocations of that size and stream that unmapped at least one page.
    pub allocations: u64,
    /// Pages they unmapped in all.
    pub pages: u64,
    /// Of those, pages unmapped in the trace's second half (after warm-up, for a loop).
    pub pages_second_half: u64,
    /// Index of the first such allocation's event in the trace.
    pub first_event: usize,
    /// Index of the last one's.
    pub last_event: usize,
}

/// One sample of a replay's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimelinePoint {
    /// Index of the event in the trace.
    pub event: usize,
    /// Trace time (µs).
    pub time_us: u64,
    /// Bytes held from the device after the event.
    pub held: u64,
    /// Bytes of live requested tensors after the event.
    pub live: u64,
}

/// Options of a replay.
#[derive(Clone)]
pub struct ReplayOptions {
    /// Configuration applied to every policy (the policy field is replaced).
    pub config: Config,
    /// Memory of the simulated device.
    pub device_total: u64,
    /// Check every policy invariant this often (events), for tests; 0: never.
    pub check_every: usize,
    /// Record about this many (time, held, live) samples for a timeline plot; 0: none.
    pub timeline_points: usize,
    /// Called with the allocator once the whole trace has been replayed (to write a
    /// snapshot of its final state and history, for instance).
    pub at_end: Option<AtEnd>,
    /// On the simulated device, events the policy records complete this many microseconds
    /// of trace time after they were recorded (the GPU running that far behind the host),
    /// so that host waits are counted only where the GPU would not have got there yet.
    /// `None`: they complete only when the host waits for them (every wait counted).
    pub gpu_lag_us: Option<u64>,
    /// Record which allocations remapped pages ([`PolicyResult::remap_sites`]).
    pub remap_sites: bool,
    /// Free by address and stream, as PyTorch's allocator hooks do (`Allocator::free_on`),
    /// instead of through the allocation's handle: the same placements, but each free looks
    /// its block up as a real PyTorch program's does.
    pub free_by_address: bool,
    /// Before each allocation and free, write to this many bytes of other memory (one byte
    /// per 64-byte line), as a program's own work does between its allocator calls: under a
    /// cache simulator (`scripts/cold_replay.sh`) each call then finds the allocator's data
    /// out of the caches, as in a real training step. 0: off.
    pub cold_bytes: usize,
}

/// A function given the allocator at the end of a replay.
pub type AtEnd = std::sync::Arc<dyn Fn(&Allocator) + Send + Sync>;

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            config: Config::default(),
            device_total: H200_TOTAL_BYTES,
            check_every: 0,
            timeline_points: 0,
            at_end: None,
            gpu_lag_us: None,
            remap_sites: false,
            free_by_address: false,
            cold_bytes: 0,
        }
    }
}

/// Memory written between the allocator's calls ([`ReplayOptions::cold_bytes`]).
struct Evictor {
    buf: Vec<u8>,
    round: u8,
}

impl Evictor {
    fn new(bytes: usize) -> Option<Self> {
        (bytes > 0).then(|| Self {
            buf: vec![0; bytes],
            round: 0,
        })
    }

    /// Writes one byte of every cache line of the buffer.
    fn run(&mut self) {
        self.round = self.round.wrapping_add(1);
        for b in self.buf.iter_mut().step_by(64) {
            *b = self.round;
        }
        std::hint::black_box(&mut self.buf);
    }
}

/// Peak live bytes of a trace: requested sizes, live from `alloc` to `free_completed`.
pub fn peak_live(trace: &Trace) -> u64 {
    let mut live: FxHashMap<u64, u64> = FxHashMap::default();
    let (mut cur, mut peak) = (0u64, 0u64);
    for e in &trace.events {
        match e.kind {
            Kind::Alloc => {
                if let Some(old) = live.insert(e.addr, e.size) {
                    cur -= old;
                }
                cur += e.size;
                peak = peak.max(cur);
            }
            Kind::FreeCompleted => {
                if let Some(s) = live.remove(&e.addr) {
                    cur -= s;
                }
            }
            _ => {}
        }
    }
    peak
}

/// The recording allocator's own segment allocations (sizes in order) and its peak held.
fn recorded_segments(trace: &Trace) -> (Vec<u64>, u64) {
    let (mut sizes, mut cur, mut peak) = (Vec::new(), 0u64, 0u64);
    for e in &trace.events {
        match e.kind {
            Kind::SegmentAlloc | Kind::SegmentMap => {
                if e.kind == Kind::SegmentAlloc {
                    sizes.push(e.size);
                }
                cur = cur.saturating_add(e.size);
                peak = peak.max(cur);
            }
            Kind::SegmentFree | Kind::SegmentUnmap => cur = cur.saturating_sub(e.size),
            _ => {}
        }
    }
    (sizes, peak)
}

/// Replays `trace` under `policy` on a simulated device. `progress` is increased by one for
/// every event replayed.
pub fn replay(
    trace: &Trace,
    policy: PolicyKind,
    opts: &ReplayOptions,
    progress: Option<&AtomicU64>,
) -> Result<PolicyResult, AllocError> {
    // The native simulation gets the recorded segment addresses, so that it breaks best-fit
    // ties between equal free blocks as the real allocator did.
    let segment_addresses = if policy == PolicyKind::Native {
        trace
            .events
            .iter()
            .filter(|e| e.kind == Kind::SegmentAlloc)
            .map(|e| (e.size, e.addr))
            .collect()
    } else {
        Default::default()
    };
    let (sim, ctl) = SimBackend::new(SimConfig {
        total_bytes: opts.device_total,
        event_mode: EventMode::Manual,
        segment_addresses,
        ..SimConfig::default()
    });
    replay_on(
        trace,
        policy,
        opts,
        Box::new(sim),
        Some(ctl),
        progress,
        None,
    )
}

/// The trace's free of the block at `key` (stream, address) has completed: it stops counting
/// as live, by the size it was allocated with (a malformed trace may free another), and the
/// events its free recorded complete. Returns the block, if there was one.
fn free_completed(
    key: (u64, u64),
    blocks: &mut FxHashMap<(u64, u64), (Allocation, u64)>,
    waiting: &mut FxHashMap<(u64, u64), Vec<EventHandle>>,
    events: &Option<SimControl>,
    live_now: &mut u64,
) -> Option<Allocation> {
    let block = blocks.remove(&key).map(|(a, size)| {
        *live_now -= size;
        a
    });
    if let (Some(evs), Some(ctl)) = (waiting.remove(&key), events.as_ref()) {
        for h in evs {
            ctl.complete(h);
        }
    }
    block
}

/// Frees one of the replay's blocks: by address as PyTorch's free hook does, or by the
/// allocation's handle. Never inlined, so that a profile of a replay shows the engine's cost of
/// a free apart from the replay's own bookkeeping (scripts/engine_cost.py reads it).
#[inline(never)]
fn free_one(alloc: &Allocator, a: &Allocation, by_address: bool) -> Result<(), AllocError> {
    if by_address {
        alloc.free_on(a.ptr, a.stream)
    } else {
        alloc.free_allocation(a)
    }
}

/// A function given every block the replay allocates (address, bytes, the trace's stream): the
/// CUDA replay writes into them, on the stream standing for the trace's.
pub type TouchFn<'a> = &'a (dyn Fn(u64, u64, Stream) + Sync);

/// Replays `trace` under `policy` on any backend. With `events` (a simulated device), stream
/// uses complete where the trace says; without, they complete when the device says.
pub fn replay_on(
    trace: &Trace,
    policy: PolicyKind,
    opts: &ReplayOptions,
    backend: Box<dyn Backend>,
    events: Option<SimControl>,
    progress: Option<&AtomicU64>,
    touch: Option<TouchFn<'_>>,
) -> Result<PolicyResult, AllocError> {
    let mut cfg = opts.config.clone();
    cfg.policy = policy;
    let alloc = Allocator::new(backend, cfg)?;
    let by_address = opts.free_by_address;
    let evictor = std::cell::RefCell::new(Evictor::new(opts.cold_bytes));
    let cool = || {
        if let Some(ev) = evictor.borrow_mut().as_mut() {
            ev.run();
        }
    };
    let free = |alloc: &Allocator, a: &Allocation| {
        cool();
        free_one(alloc, a, by_address)
    };
    let fidelity_wanted = policy == PolicyKind::Native && trace.has_segment_events();
    if fidelity_wanted {
        alloc.device().lock().log_segments(true);
    }
    let n = trace.events.len();
    let quarter = n.div_ceil(4).max(1);
    let mut calls_at: Vec<CallCounts> = Vec::new();
    // Live blocks by (stream, address), with the size the trace asked for.
    let mut blocks: FxHashMap<(u64, u64), (Allocation, u64)> = FxHashMap::default();
    let mut waiting: FxHashMap<(u64, u64), Vec<EventHandle>> = FxHashMap::default();
    let (mut ooms, mut allocs, mut ops) = (0u64, 0u64, 0u64);
    let mut live_now = 0u64;
    let mut timeline = Vec::new();
    let sample_every = n
        .checked_div(opts.timeline_points)
        .map_or(usize::MAX, |k| k.max(1));
    let start = Instant::now();
    let mut reported = 0usize;
    // Events recorded by the policy, with the trace time they were recorded at (GPU lag model).
    let mut lagging: std::collections::VecDeque<(u64, EventHandle)> = Default::default();
    let mut previous_time = 0u64;
    let mut sites: FxHashMap<(u64, u64), RemapSite> = FxHashMap::default();
    for (i, e) in trace.events.iter().enumerate() {
        if i % quarter == 0 && i > 0 {
            calls_at.push(alloc.driver_calls());
        }
        // The policies measure their driver time against the trace's clock, as the recorded
        // program ran, not against the replay's.
        alloc.device().set_trace_time_us(e.time_us);
        if let (Some(lag), Some(ctl)) = (opts.gpu_lag_us, events.as_ref()) {
            // What the previous operation recorded, at its time; then what the GPU has passed
            // by now.
            let at = previous_time;
            lagging.extend(ctl.take_recorded().into_iter().map(|(h, _)| (at, h)));
            previous_time = e.time_us;
            while let Some(&(t, h)) = lagging.front() {
                if t.saturating_add(lag) > e.time_us {
                    break;
                }
                ctl.complete(h);
                lagging.pop_front();
            }
        }
        match e.kind {
            Kind::Alloc if e.size > 0 => {
                ops += 1;
                // The trace lost this address's free (`Trace::warnings` counts these): the
                // earlier block is taken as freed here, as PyTorch must have freed it.
                let key = (e.stream, e.addr);
                let lost = free_completed(key, &mut blocks, &mut waiting, &events, &mut live_now);
                if let Some(old) = lost {
                    match free(&alloc, &old) {
                        // Already freed by the trace, its completion the missing part.
                        Ok(())
                        | Err(AllocError::UnknownPointer { .. })
                        | Err(AllocError::DoubleFree { .. }) => {}
                        Err(err) => return Err(err),
                    }
                }
                let unmapped_before = opts.remap_sites.then(|| unmapped_pages(&alloc));
                cool();
                match alloc.allocate(e.size, e.stream) {
                    Ok(a) => {
                        if let Some(before) = unmapped_before {
                            let pages = unmapped_pages(&alloc) - before;
                            if pages > 0 {
                                let site = sites.entry((e.size, e.stream)).or_insert(RemapSite {
                                    size: e.size,
                                    stream: e.stream,
                                    allocations: 0,
                                    pages: 0,
                                    pages_second_half: 0,
                                    first_event: i,
                                    last_event: i,
                                });
                                site.allocations += 1;
                                site.pages += pages;
                                if i >= n / 2 {
                                    site.pages_second_half += pages;
                                }
                                site.last_event = i;
                            }
                        }
                        allocs += 1;
                        live_now += e.size;
                        if let Some(t) = touch {
                            t(a.ptr, e.size, e.stream);
                        }
                        blocks.insert((e.stream, e.addr), (a, e.size));
                    }
                    Err(err) if err.is_oom() => ooms += 1,
                    Err(err) => return Err(err),
                }
            }
            Kind::FreeRequested => {
                let Some((a, _)) = blocks.get(&(e.stream, e.addr)).copied() else {
                    continue;
                };
                ops += 1;
                let immediate = trace.events.get(i + 1).is_some_and(|nx| {
                    nx.kind == Kind::FreeCompleted && nx.addr == e.addr && nx.stream == e.stream
                });
                match (&events, immediate) {
                    (Some(ctl), false) => {
                        // Used on another stream: the event recorded at the free completes
                        // where the trace's free_completed is.
                        ctl.take_recorded();
                        alloc.record_stream(a.ptr, OTHER_STREAM)?;
                        free(&alloc, &a)?;
                        let evs = ctl.take_recorded().into_iter().map(|(h, _)| h).collect();
                        waiting.insert((e.stream, e.addr), evs);
                    }
                    (None, false) => {
                        alloc.record_stream(a.ptr, OTHER_STREAM)?;
                        free(&alloc, &a)?;
                    }
                    (_, true) => free(&alloc, &a)?,
                }
            }
            Kind::FreeCompleted => {
                let key = (e.stream, e.addr);
                free_completed(key, &mut blocks, &mut waiting, &events, &mut live_now);
            }
            _ => {}
        }
        if i % sample_every == 0 || (sample_every != usize::MAX && i + 1 == n) {
            timeline.push(TimelinePoint {
                event: i,
                time_us: e.time_us,
                held: alloc.held_bytes(),
                live: live_now,
            });
        }
        if opts.check_every > 0 && i % opts.check_every == 0 {
            alloc
                .check()
                .map_err(|m| AllocError::Config(format!("invariant broken at event {i}: {m}")))?;
        }
        if let Some(p) = progress {
            if i - reported >= 4096 {
                p.fetch_add((i - reported) as u64, Ordering::Relaxed);
                reported = i;
            }
        }
    }
    if let Some(p) = progress {
        p.fetch_add((n - reported) as u64, Ordering::Relaxed);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let calls = alloc.driver_calls();
    while calls_at.len() < 3 {
        calls_at.push(calls.clone());
    }
    calls_at.push(calls.clone());
    let mut calls_by_quarter = [0u64; 4];
    let mut est_by_quarter = [0f64; 4];
    let mut calls_by_quarter_by_kind: [serde_json::Value; 4] = Default::default();
    let mut prev = CallCounts::default();
    for (q, c) in calls_at.iter().take(4).enumerate() {
        let d = c.since(&prev);
        calls_by_quarter[q] = d.total();
        calls_by_quarter_by_kind[q] = d.to_json();
        est_by_quarter[q] = d.est_seconds();
        prev = c.clone();
    }
    if let Some(f) = &opts.at_end {
        f(&alloc);
    }
    let peak_live_bytes = peak_live(trace);
    let peak_held_bytes = alloc.peak_held_bytes();
    let fidelity = fidelity_wanted.then(|| {
        let (trace_sizes, trace_peak) = recorded_segments(trace);
        let d = alloc.device().lock();
        let sim_sizes = d.segment_log();
        let first_mismatch = trace_sizes
            .iter()
            .zip(sim_sizes)
            .position(|(a, b)| a != b)
            .or((trace_sizes.len() != sim_sizes.len())
                .then(|| trace_sizes.len().min(sim_sizes.len())));
        Fidelity {
            segments_match: first_mismatch.is_none(),
            peak_held_error: if trace_peak == 0 {
                0.0
            } else {
                (peak_held_bytes as f64 - trace_peak as f64) / trace_peak as f64
            },
            trace_segments: trace_sizes.len(),
            sim_segments: sim_sizes.len(),
            trace_peak_held: trace_peak,
            first_mismatch,
        }
    });
    Ok(PolicyResult {
        policy: policy.name().to_string(),
        range: (policy == PolicyKind::Stitched).then_some(alloc.config().options.range.name()),
        page_bytes: (policy == PolicyKind::Stitched).then(|| {
            alloc
                .device()
                .lock()
                .page()
                .max(alloc.config().options.big_page)
        }),
        peak_held_bytes,
        peak_live_bytes,
        ratio: if peak_live_bytes == 0 {
            0.0
        } else {
            peak_held_bytes as f64 / peak_live_bytes as f64
        },
        driver_calls: calls.to_json(),
        calls_by_quarter_by_kind,
        driver_calls_total: calls.total(),
        est_driver_seconds: calls.est_seconds(),
        calls_by_quarter,
        est_seconds_by_quarter: est_by_quarter,
        ooms,
        allocs,
        replay_seconds: elapsed,
        ns_per_op: if ops == 0 {
            0.0
        } else {
            elapsed * 1e9 / ops as f64
        },
        timeline,
        fidelity,
        notes: alloc.policy_notes(),
        lower_reference: None,
        remap_sites: {
            let mut v: Vec<RemapSite> = sites.into_values().collect();
            v.sort_by(|a, b| (b.pages, a.size, a.stream).cmp(&(a.pages, b.size, b.stream)));
            v
        },
    })
}

/// Pages unmapped so far on the allocator's device.
fn unmapped_pages(alloc: &Allocator) -> u64 {
    alloc.device().lock().calls().pages(DriverCall::MemUnmap)
}

/// Replays `trace` under each policy, in parallel threads.
pub fn replay_all(
    trace: &Trace,
    policies: &[PolicyKind],
    opts: &ReplayOptions,
    progress: Option<&AtomicU64>,
) -> Vec<Result<PolicyResult, AllocError>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = policies
            .iter()
            .map(|&p| s.spawn(move || replay(trace, p, opts, progress)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(AllocError::Config("replay thread panicked".into())))
            })
            .collect()
    })
}
