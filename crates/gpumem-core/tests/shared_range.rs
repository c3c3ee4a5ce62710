//! Stream order in the stitched policy's shared range (`range:shared`), audited byte by byte
//! on the simulated device's real mappings.
//!
//! In a shared range, blocks of several streams sit on one physical page, so the page-level
//! audit of `stitched_streams.rs` (one stream per page at a time) does not apply. Instead,
//! every block's bytes are looked up in the simulated device's mapping table (which physical
//! page, at which offset), and the audit checks:
//! - no physical byte is in two live blocks at once;
//! - a physical byte last freed by another stream is used again only once that stream's work
//!   up to the free is ordered before the new use: the new stream has waited (on the device,
//!   in this call or earlier) for an event recorded after the free, on the old stream or on
//!   a stream that had itself waited for the old one (the audit keeps a vector clock per
//!   stream), or the host has waited for such an event (or the test completed it).
//!
//! Events never complete by themselves here (`EventMode::Manual`), so every handover the
//! policy makes must come with a wait.

mod common;

use common::{audited_sim, replay_trace, Audited};
use gpumem_core::backend::sim::{EventOp, SimBackend, SimConfig, SimControl};
use gpumem_core::backend::{EventHandle, PhysHandle, Stream};
use gpumem_core::testing::TestRng;
use gpumem_core::trace;
use gpumem_core::{Allocation, Allocator, Config};
use std::collections::HashMap;
use std::path::PathBuf;

const PAGE: u64 = 2 << 20;
const SHARED: &str = "policy:stitched,range:shared";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Use {
    Live,
    /// Freed (reusable by its stream) in this call.
    Freed(u64),
}

/// Bytes `[lo, hi)` of a physical page and who had them last.
#[derive(Clone, Copy, Debug)]
struct Rec {
    lo: u64,
    hi: u64,
    stream: Stream,
    state: Use,
    /// Virtual address of the page the bytes were used through.
    va: u64,
}

/// A block's bytes on one physical page.
#[derive(Clone, Copy)]
struct Piece {
    h: PhysHandle,
    lo: u64,
    hi: u64,
    va: u64,
}

struct ByteAudit {
    alloc: Allocator,
    ctl: SimControl,
    /// Physical page -> disjoint records of its bytes.
    phys: HashMap<PhysHandle, Vec<Rec>>,
    /// Live block -> its pieces (as mapped when it was allocated).
    pieces: HashMap<u64, Vec<Piece>>,
    /// Block freed after a use on another stream -> the call that freed it: its own stream's
    /// work up to that call is what a later user must come after (the other stream's use is
    /// covered by the events the test completes).
    freed_in: HashMap<u64, u64>,
    /// Event -> the clock of its stream when it was recorded.
    events: HashMap<EventHandle, Clock>,
    /// Stream -> its vector clock: for each stream, the latest call whose work on that stream
    /// comes before this stream's work from now on.
    clocks: HashMap<Stream, Clock>,
    /// The same for work the host knows is done (it waited for an event, or the test
    /// completed one).
    done: Clock,
    calls: u64,
    /// Bytes used again by another stream than the one that freed them (counted per piece).
    handovers: usize,
    /// Physical pages on which blocks of two streams were live at once.
    mixed_pages: usize,
}

impl ByteAudit {
    fn new(conf: &str, total: u64) -> ByteAudit {
        let (alloc, ctl) = audited_sim(conf, total);
        ByteAudit {
            alloc,
            ctl,
            phys: HashMap::new(),
            pieces: HashMap::new(),
            freed_in: HashMap::new(),
            events: HashMap::new(),
            clocks: HashMap::new(),
            done: Clock::new(),
            calls: 0,
            handovers: 0,
            mixed_pages: 0,
        }
    }

    /// Follows the event records and waits since the last call, in order, as made in the
    /// call just made.
    fn log_events(&mut self) {
        self.ctl.take_recorded();
        for op in self.ctl.take_ops() {
            match op {
                EventOp::Record { event, stream } => {
                    let mut c = self.clocks.get(&stream).cloned().unwrap_or_default();
                    c.insert(stream, self.calls);
                    self.events.insert(event, c);
                }
                EventOp::Wait { stream, event } => {
                    let c = self.events[&event].clone();
                    join(self.clocks.entry(stream).or_default(), &c);
                }
                EventOp::Synchronize { event } => self.note_completed(event),
            }
        }
    }

    fn note_completed(&mut self, ev: EventHandle) {
        if let Some(c) = self.events.get(&ev) {
            join(&mut self.done, c);
        }
    }

    /// Whether `stream`'s work from now on comes after `old`'s work of call `at`.
    fn ordered(&self, stream: Stream, old: Stream, at: u64) -> bool {
        let after = |c: &Clock| c.get(&old).is_some_and(|&k| k > at);
        self.clocks.get(&stream).is_some_and(after) || after(&self.done)
    }

    fn pieces_of(&self, a: &Allocation) -> Vec<Piece> {
        let end = a.ptr + a.size;
        let mut out = Vec::new();
        let mut page = a.ptr / PAGE * PAGE;
        while page < end {
            let h = self
                .ctl
                .handle_at(page)
                .unwrap_or_else(|| panic!("page {page:#x} of a live block is not mapped"));
            let lo = a.ptr.max(page) - page;
            let hi = end.min(page + PAGE) - page;
            out.push(Piece {
                h,
                lo,
                hi,
                va: page,
            });
            page += PAGE;
        }
        out
    }

    /// The block's bytes become reusable by its stream, freed in call `at`.
    fn released(&mut self, a: &Allocation, at: u64) {
        let pieces = self.pieces.remove(&a.ptr).expect("a live block");
        for p in pieces {
            let recs = self.phys.get_mut(&p.h).expect("page in use");
            let r = recs
                .iter_mut()
                .find(|r| r.lo == p.lo && r.hi == p.hi && r.state == Use::Live)
                .expect("the block's record");
            r.state = Use::Freed(at);
        }
    }
}

impl Audited for ByteAudit {
    fn allocate(&mut self, size: u64, stream: Stream) -> Allocation {
        self.log_events();
        self.calls += 1;
        let a = self.alloc.allocate(size, stream).unwrap();
        self.log_events();
        // The policy's own invariants too, after every allocation.
        self.alloc
            .check()
            .unwrap_or_else(|m| panic!("call {}: {m}", self.calls));
        let pieces = self.pieces_of(&a);
        for p in &pieces {
            let mut recs = self.phys.remove(&p.h).unwrap_or_default();
            let mut kept = Vec::with_capacity(recs.len() + 2);
            let mut mixed = false;
            for r in recs.drain(..) {
                if r.hi <= p.lo || r.lo >= p.hi {
                    mixed |= r.state == Use::Live && r.stream != stream;
                    kept.push(r);
                    continue;
                }
                match r.state {
                    Use::Live => panic!(
                        "bytes {:#x}..{:#x} of a physical page are in two live blocks (streams \
                         {:#x} and {stream:#x})",
                        r.lo.max(p.lo),
                        r.hi.min(p.hi),
                        r.stream
                    ),
                    Use::Freed(at) if r.stream != stream => {
                        assert!(
                            self.ordered(stream, r.stream, at),
                            "bytes stream {:#x} freed in call {at} went to stream {stream:#x} \
                             in call {} with no event ordering them (page {:#x}, then {:#x}, bytes {:#x}..{:#x} of {:#x}..{:#x})",
                            r.stream,
                            self.calls, r.va, p.va, r.lo, r.hi, p.lo, p.hi
                        );
                        self.handovers += 1;
                    }
                    Use::Freed(_) => {}
                }
                // Keep the parts outside the new block.
                if r.lo < p.lo {
                    kept.push(Rec { hi: p.lo, ..r });
                }
                if r.hi > p.hi {
                    kept.push(Rec { lo: p.hi, ..r });
                }
            }
            kept.push(Rec {
                lo: p.lo,
                hi: p.hi,
                stream,
                state: Use::Live,
                va: p.va,
            });
            self.phys.insert(p.h, kept);
            if mixed {
                self.mixed_pages += 1;
            }
        }
        self.pieces.insert(a.ptr, pieces);
        a
    }

    /// Frees `a`; with `used_on`, after a use on that stream: the events the free recorded
    /// are returned, and the bytes stay live until [`ByteAudit::complete`].
    fn free(&mut self, a: &Allocation, used_on: Option<Stream>) -> Vec<EventHandle> {
        self.log_events();
        self.calls += 1;
        match used_on {
            None => {
                self.released(a, self.calls);
                self.alloc.free_allocation(a).unwrap();
                // Events recorded by the free itself count as recorded after it.
                self.calls += 1;
                self.log_events();
                Vec::new()
            }
            Some(s) => {
                self.alloc.record_stream(a.ptr, s).unwrap();
                self.alloc.free_allocation(a).unwrap();
                self.freed_in.insert(a.ptr, self.calls);
                // The events on the stream that used the block: the test completes them.
                // Any other (the policy marking the freeing stream's place) counts, as the
                // free's own events do, as recorded after it.
                let used: Vec<EventHandle> = self
                    .ctl
                    .take_recorded()
                    .into_iter()
                    .filter(|&(_, on)| on == s)
                    .map(|(e, _)| e)
                    .collect();
                self.calls += 1;
                self.log_events();
                used
            }
        }
    }

    fn complete(&mut self, a: &Allocation, events: Vec<EventHandle>) {
        self.log_events();
        for e in events {
            self.ctl.complete(e);
            self.note_completed(e);
        }
        self.calls += 1;
        let at = self
            .freed_in
            .remove(&a.ptr)
            .expect("freed after a use elsewhere");
        self.released(a, at);
        self.alloc.process_events().unwrap();
        self.calls += 1;
        self.log_events();
    }
}

/// Stream -> a call of it.
type Clock = HashMap<Stream, u64>;

/// `into` becomes the later of itself and `other`, stream by stream.
fn join(into: &mut Clock, other: &Clock) {
    for (&s, &k) in other {
        let e = into.entry(s).or_insert(0);
        *e = (*e).max(k);
    }
}

impl ByteAudit {
    /// Frees `a` as PyTorch does, naming a stream (`free_on`), which may not be the one that
    /// allocated it.
    fn free_naming(&mut self, a: &Allocation, stream: Stream) {
        self.log_events();
        self.calls += 1;
        self.released(a, self.calls);
        self.alloc.free_on(a.ptr, stream).unwrap();
        self.calls += 1;
        self.log_events();
    }
}

const S1: Stream = 0x7f00_0000_1000;
const S2: Stream = 0x7f00_0000_2000;
const MIB: u64 = 1 << 20;

#[test]
fn small_blocks_of_two_streams_share_a_page() {
    let held = |conf: &str| {
        let mut t = ByteAudit::new(conf, 1 << 30);
        let a = t.allocate(64 << 10, S1);
        let b = t.allocate(64 << 10, S2);
        let held = t.alloc.held_bytes();
        t.free(&a, None);
        t.free(&b, None);
        t.alloc.check().unwrap();
        (held, t.mixed_pages)
    };
    assert_eq!(held(SHARED), (PAGE, 1), "one page for both streams' blocks");
    assert_eq!(
        held("policy:stitched,range:stream"),
        (2 * PAGE, 0),
        "a page per stream's range"
    );
}

#[test]
fn bytes_another_stream_freed_are_reused_only_after_its_event() {
    let mut t = ByteAudit::new(&format!("{SHARED},slack:0"), 1 << 30);
    let a = t.allocate(8 * MIB, S1);
    t.free(&a, None);
    let b = t.allocate(8 * MIB, S2);
    assert_eq!(
        b.ptr, a.ptr,
        "the second stream reuses the first one's block"
    );
    assert_eq!(t.alloc.held_bytes(), 8 * MIB, "and its pages");
    assert_eq!(t.handovers, 4, "one piece per page, each through an event");
    // Handing the bytes back: the first stream now waits for the second.
    t.free(&b, None);
    let c = t.allocate(8 * MIB, S1);
    assert_eq!((c.ptr, t.handovers), (a.ptr, 8));
    t.free(&c, None);
    t.alloc.check().unwrap();
}

/// A free that names another stream than the block's (a hand-written caller of the pluggable
/// allocator's hooks) frees it as its own stream's: the stream named must still wait before
/// it takes the bytes. (Each stream's handle answers only for the blocks it placed.)
#[test]
fn a_free_naming_another_stream_counts_as_the_owners() {
    let mut t = ByteAudit::new(&format!("{SHARED},slack:0"), 1 << 30);
    let other = t.allocate(2 * MIB, S2);
    let a = t.allocate(8 * MIB, S1);
    t.free_naming(&a, S2);
    assert_eq!(
        t.alloc.memory_stats().allocated_bytes.all.current,
        2 * MIB as i64,
        "freed"
    );
    let before = t.handovers;
    let b = t.allocate(8 * MIB, S2);
    assert_eq!(b.ptr, a.ptr, "the named stream reuses the block");
    assert!(
        t.handovers > before,
        "through S1's event, checked by the audit"
    );
    t.free(&b, None);
    t.free(&other, None);
    t.alloc.check().unwrap();
}

#[test]
fn a_block_used_on_another_stream_waits_for_that_stream_then_for_its_own() {
    let mut t = ByteAudit::new(&format!("{SHARED},slack:0"), 1 << 30);
    let a = t.allocate(4 * MIB, S1);
    let events = t.free(&a, Some(S2));
    assert_eq!(events.len(), 1, "one event, on the stream that used it");
    // Until S2's event completes the block is not free: S2 gets other bytes.
    let b = t.allocate(4 * MIB, S2);
    assert_ne!(b.ptr, a.ptr);
    t.complete(&a, events);
    // Released, the block is S1's freed bytes: S2 takes them through an event of S1.
    let before = t.handovers;
    let c = t.allocate(4 * MIB, S2);
    assert_eq!(c.ptr, a.ptr);
    assert!(t.handovers > before);
    t.free(&b, None);
    t.free(&c, None);
    t.alloc.check().unwrap();
}

/// A pipeline: the side stream's batch, used on the compute stream, is freed; the side stream
/// then queues the next batch's copy. Once the batch's bytes are released, the compute stream
/// taking them waits for the side stream's work up to the free, not for that later copy
/// (which it would otherwise wait for before its own work, losing the overlap).
#[test]
fn bytes_freed_after_a_use_elsewhere_are_handed_over_as_of_the_free() {
    let mut t = ByteAudit::new(&format!("{SHARED},slack:0"), 1 << 30);
    let weights = t.allocate(4 * MIB, S2);
    let batch = t.allocate(8 * MIB, S1);
    let events = t.free(&batch, Some(S2));
    let freed_in = t.calls - 1;
    // The next batch, on the side stream, while the first is pending: other bytes.
    let next = t.allocate(8 * MIB, S1);
    assert_ne!(next.ptr, batch.ptr);
    let next_in = t.calls;
    t.complete(&batch, events);
    let before = t.handovers;
    let act = t.allocate(8 * MIB, S2);
    assert_eq!(
        act.ptr, batch.ptr,
        "the compute stream takes the released bytes"
    );
    assert!(t.handovers > before, "through a wait");
    let seen = t.clocks[&S2][&S1];
    assert!(
        seen > freed_in && seen < next_in,
        "the compute stream waited for the side stream's call {seen}: the free was call \
         {freed_in}, the next batch call {next_in}"
    );
    for a in [&weights, &next, &act] {
        t.free(a, None);
    }
    t.alloc.check().unwrap();
}

fn joined(alloc: &Allocator) -> bool {
    alloc
        .policy_notes()
        .iter()
        .any(|n| n.contains("range:auto"))
}

/// `range:auto`, the default: the first stream's range alone until a second stream
/// allocates, then that range shared by both, before the second stream places anything;
/// stream order holds byte by byte across the switch.
#[test]
fn a_second_stream_shares_the_first_streams_range() {
    let mut t = ByteAudit::new("policy:stitched,slack:0", 1 << 30);
    let a = t.allocate(4 * MIB, S1);
    assert!(!joined(&t.alloc), "one stream: a range of its own");
    // S2's first allocation: the streams share S1's range from now on, and S2's first block
    // is already in it.
    let b = t.allocate(64 << 10, S2);
    assert!(joined(&t.alloc), "{:?}", t.alloc.policy_notes());
    let c = t.allocate(64 << 10, S1);
    assert_eq!(t.mixed_pages, 1, "S1's new block shares S2's page");
    assert_eq!(t.alloc.held_bytes(), 3 * PAGE, "a's two pages, one shared");
    // a's bytes go to S2 through an event: 8 MiB after the small blocks need four more pages,
    // two new (up to the peak in use) and a's two.
    t.free(&a, None);
    let d = t.allocate(8 * MIB, S2);
    assert_eq!(t.alloc.held_bytes(), 5 * PAGE, "a's pages reused, two new");
    assert!(t.handovers > 0, "no bytes changed streams");
    for z in [b, c, d] {
        t.free(&z, None);
    }
    t.alloc.check().unwrap();
}

/// What the first stream placed before the switch (a model's weights) stays where it is, in
/// the range the streams now share: the second stream's small blocks fill its pages, and a
/// block freed after a use on another stream, still pending at the switch, is released
/// there and handed over in order.
#[test]
fn the_first_streams_blocks_share_their_pages_after_the_switch() {
    let mut t = ByteAudit::new("policy:stitched,slack:0", 1 << 30);
    let w = t.allocate(64 << 10, S1);
    let x = t.allocate(256 << 10, S1);
    let used = t.free(&x, Some(S2));
    let y = t.allocate(64 << 10, S2);
    assert!(joined(&t.alloc), "{:?}", t.alloc.policy_notes());
    assert_eq!(
        t.mixed_pages, 1,
        "S2's first block shares the weights' page"
    );
    assert_eq!(t.alloc.held_bytes(), PAGE);
    // x's bytes are reused only once it is released, and by S2 only after S1's event.
    t.complete(&x, used);
    let z = t.allocate(256 << 10, S2);
    assert_eq!(z.ptr, x.ptr, "the released block, best fit");
    assert!(
        t.handovers > 0,
        "x's bytes went to S2 without the audit seeing it"
    );
    assert_eq!(t.alloc.held_bytes(), PAGE, "still the one page");
    for a in [w, y, z] {
        t.free(&a, None);
    }
    t.alloc.check().unwrap();
    assert_eq!(t.alloc.memory_stats().allocated_bytes.all.current, 0);
}

/// Threads that each allocate on their own stream share the first one's range by default
/// too: their small blocks share a page. (A thread that waits for the range's lock too long
/// spills to a range of its own; see the spill tests.)
#[test]
fn threads_on_their_own_streams_share_one_range_by_default() {
    let (sim, _ctl) = SimBackend::new(SimConfig::default());
    let alloc = std::sync::Arc::new(
        Allocator::new(Box::new(sim), Config::parse("policy:stitched").unwrap()).unwrap(),
    );
    let handles: Vec<_> = [S1, S2]
        .into_iter()
        .map(|s| {
            let alloc = alloc.clone();
            std::thread::spawn(move || {
                let a = alloc.allocate(64 << 10, s).unwrap();
                alloc.free_allocation(&a).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(joined(&alloc), "{:?}", alloc.policy_notes());
    assert_eq!(alloc.peak_held_bytes(), PAGE, "one page for both streams");
    alloc.check().unwrap();
}

/// Replays `path` under the audit with `conf` (see [`replay_trace`]).
fn replay(path: &str, conf: &str) -> ByteAudit {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    let tr = trace::load(&path, 0, None).unwrap();
    let mut t = ByteAudit::new(conf, gpumem_core::units::H200_TOTAL_BYTES);
    replay_trace(&tr, &mut t);
    t.alloc.check().unwrap();
    t
}

#[test]
fn two_stream_trace_respects_stream_order_in_a_shared_range() {
    let t = replay("traces/anchors/prefetch_mlp.gmt.gz", SHARED);
    assert!(
        t.handovers > 0,
        "no bytes changed streams: the audit saw nothing"
    );
    assert!(t.mixed_pages > 0, "the streams never shared a page");
}

/// The default (`range:auto`) on the two-stream trace: the replay's one thread allocates on
/// both streams, so they share a range from the second stream's first allocation.
#[test]
fn two_stream_trace_respects_stream_order_by_default() {
    let t = replay("traces/anchors/prefetch_mlp.gmt.gz", "policy:stitched");
    assert!(t.handovers > 0, "no bytes changed streams");
    assert!(t.mixed_pages > 0, "the streams never shared a page");
    let notes = t.alloc.policy_notes();
    assert!(notes.iter().any(|n| n.contains("range:auto")), "{notes:?}");
}

#[test]
fn five_stream_server_trace_respects_stream_order_in_a_shared_range() {
    let t = replay("traces/validation/serve_threads.pickle.gz", SHARED);
    assert!(t.handovers > 100, "{} handovers", t.handovers);
    assert!(t.mixed_pages > 100, "{} mixed pages", t.mixed_pages);
    // One thread replays it: the lock is never contended, so no stream spills.
    let notes = t.alloc.policy_notes();
    assert!(!notes.iter().any(|n| n.contains("own range")), "{notes:?}");
}

/// Every third allocation of each stream goes to a range of the stream's own (`spill:3`, the
/// deterministic form of what contention on the shared range's lock does): pages move between
/// the shared range and the streams' own ranges, and stream order still holds byte by byte.
#[test]
fn spilling_to_ranges_of_their_own_keeps_stream_order() {
    for path in [
        "traces/anchors/prefetch_mlp.gmt.gz",
        "traces/validation/serve_threads.pickle.gz",
    ] {
        let t = replay(path, &format!("{SHARED},spill:3"));
        assert!(t.handovers > 0, "{path}: no bytes changed streams");
        assert!(t.mixed_pages > 0, "{path}: the streams never shared a page");
        let notes = t.alloc.policy_notes();
        assert!(
            notes.iter().any(|n| n.contains("own range")),
            "{path}: {notes:?}"
        );
    }
}

/// The pages move one way: the shared range takes idle pages of the streams' own ranges
/// (after their stream's work), never the other way, since any of the shared range's streams
/// may have used its pages last.
#[test]
fn a_range_of_its_own_never_takes_the_shared_ranges_idle_pages() {
    // spill:2: a stream's odd allocations go to the shared range, its even ones to its own.
    let mut t = ByteAudit::new(&format!("{SHARED},spill:2,slack:0"), 1 << 30);
    let a = t.allocate(16 * MIB, S1); // shared range
    let b = t.allocate(2 * MIB, S1); // own range
    assert_eq!(t.alloc.held_bytes(), 18 * MIB);
    t.free(&a, None); // eight idle pages in the shared range
    let c = t.allocate(2 * MIB, S1); // shared range: one of them
    assert_eq!((c.ptr, t.alloc.held_bytes()), (a.ptr, 18 * MIB));
    // Own range: four pages, fewer than the peak in use, and seven idle in the shared range.
    // Ranges per stream would take idle pages; here only the shared range's are idle, and
    // they are not this range's to take: four new pages.
    let d = t.allocate(8 * MIB, S1);
    assert_eq!(t.alloc.held_bytes(), 26 * MIB);
    // The other way is allowed: the shared range takes the own range's idle pages (and S2,
    // on the shared range, waits for S1's event for them).
    t.free(&d, None);
    let e = t.allocate(22 * MIB, S2); // shared range: its 7 idle pages and 4 of S1's
    assert_eq!(t.alloc.held_bytes(), 26 * MIB, "{:#x}", e.ptr);
    for x in [b, c, e] {
        t.free(&x, None);
    }
    t.alloc.check().unwrap();
}

/// Pages a stream idled in its own range, taken by another stream in the shared range: that
/// stream waits for the first one's work (before the fix, the wait went on the stream the
/// shared range's shard was made for, here the first stream itself, which orders nothing).
#[test]
fn pages_from_a_range_of_its_own_reach_another_stream_in_order() {
    // spill:2: a stream's odd allocations go to the shared range, its even ones to its own.
    let mut t = ByteAudit::new(&format!("{SHARED},spill:2,slack:0"), 1 << 30);
    let a1 = t.allocate(64 << 10, S1); // shared range (made for S1)
    let a2 = t.allocate(4 * MIB, S1); // S1's own range: two pages
    let b1 = t.allocate(64 << 10, S2); // S2 joins the shared range now
    let b2 = t.allocate(64 << 10, S2); // S2's own range
    t.free(&a2, None); // after S2 joined: nothing S2 waited for covers it
    let before = t.handovers;
    let b3 = t.allocate(8 * MIB, S2); // shared range: new pages up to the peak, then S1's
    assert!(t.handovers > before, "S1's idle pages were not taken");
    for x in [a1, b1, b2, b3] {
        t.free(&x, None);
    }
    t.alloc.check().unwrap();
}

#[test]
fn ranges_per_stream_pass_the_same_audit_and_never_mix_pages() {
    let t = replay(
        "traces/anchors/prefetch_mlp.gmt.gz",
        "policy:stitched,range:stream",
    );
    assert!(t.handovers > 0);
    assert_eq!(t.mixed_pages, 0);
}

/// Four threads, each allocating and freeing random sizes on its own stream, and freeing
/// some of the others' blocks by pointer (as PyTorch's free hook may from any thread): no two
/// live blocks overlap at any time, and the range's invariants hold at the end, with every
/// byte back once all is freed.
#[test]
fn threads_on_their_own_streams_share_the_range_safely() {
    threads_free_each_others_blocks(SHARED);
    // With every other allocation in the thread's own range.
    threads_free_each_others_blocks(&format!("{SHARED},spill:2"));
    // The default: the first thread's range becomes the shared one while the others start.
    threads_free_each_others_blocks("policy:stitched");
}

fn threads_free_each_others_blocks(conf: &str) {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let (sim, _ctl) = SimBackend::new(SimConfig {
        total_bytes: 8 << 30,
        ..SimConfig::default()
    });
    let alloc = Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap();
    let live: Mutex<BTreeMap<u64, u64>> = Mutex::new(BTreeMap::new());
    let handed: Mutex<Vec<Allocation>> = Mutex::new(Vec::new());
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let (alloc, live, handed) = (&alloc, &live, &handed);
            sc.spawn(move || {
                let stream = 0x7f00_0000_0000 + (t + 1) * 0x1000;
                let mut rng = TestRng::new(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t + 1));
                let mut next = || rng.next_u64();
                let mut mine: Vec<Allocation> = Vec::new();
                for _ in 0..20_000 {
                    let r = next();
                    if mine.len() < 64 && r % 2 == 0 {
                        let size = 512 << (next() % 14); // 512 B .. 4 MiB
                        let a = alloc.allocate(size + next() % 512, stream).unwrap();
                        let mut l = live.lock().unwrap();
                        if let Some((&s, &e)) = l.range(..a.ptr + a.size).next_back() {
                            assert!(e <= a.ptr, "{:#x}.. overlaps live {s:#x}..{e:#x}", a.ptr);
                        }
                        l.insert(a.ptr, a.ptr + a.size);
                        drop(l);
                        if r % 16 == 0 {
                            handed.lock().unwrap().push(a);
                        } else {
                            mine.push(a);
                        }
                    } else if let Some(a) = mine.pop() {
                        live.lock().unwrap().remove(&a.ptr);
                        alloc.free_allocation(&a).unwrap();
                    }
                    // Free one of the blocks another thread handed over, by pointer.
                    if r % 7 == 0 {
                        let other = handed.lock().unwrap().pop();
                        if let Some(a) = other {
                            live.lock().unwrap().remove(&a.ptr);
                            alloc.free(a.ptr).unwrap();
                        }
                    }
                }
                for a in mine {
                    live.lock().unwrap().remove(&a.ptr);
                    alloc.free_allocation(&a).unwrap();
                }
            });
        }
    });
    for a in handed.into_inner().unwrap() {
        alloc.free(a.ptr).unwrap();
    }
    if !conf.contains("range:") {
        assert!(joined(&alloc), "{:?}", alloc.policy_notes());
    }
    alloc.check().unwrap();
    assert_eq!(alloc.memory_stats().allocated_bytes.all.current, 0);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.held_bytes(), 0, "every page returned");
}

/// Once several streams place in one range, a virtual page that needs a page gets a new one
/// rather than a remapped idle one while the pages held stay within `shared_spare` (2 % by
/// default) of the range's live peak. A program with one stream, and `shared_spare:0`, remap
/// the idle pages as before; stream order holds byte by byte either way.
#[test]
fn streams_in_one_range_make_spare_pages_up_to_a_share_of_the_live_peak() {
    // a and b (100 pages each) on S1; a freed; then 101 pages on `second`, which do not fit
    // in a's hole: they go above b, where no page is mapped. The peak in use becomes 201
    // pages, the live peak 201 pages' worth of bytes.
    let held_after = |conf: &str, second: Stream| {
        let mut t = ByteAudit::new(conf, 2 << 30);
        let a = t.allocate(100 * PAGE, S1);
        let b = t.allocate(100 * PAGE, S1);
        t.free(&a, None);
        let c = t.allocate(101 * PAGE, second);
        let held = t.alloc.held_bytes() / PAGE;
        let live_peak = 201;
        assert!(
            held as f64 <= 1.02 * live_peak as f64,
            "{conf}: {held} pages held for a live peak of {live_peak}"
        );
        for z in [b, c] {
            t.free(&z, None);
        }
        t.alloc.check().unwrap();
        let noted = t
            .alloc
            .policy_notes()
            .iter()
            .any(|n| n.contains("shared_spare"));
        assert_eq!(noted, held > 201, "{conf}: {:?}", t.alloc.policy_notes());
        (held, joined(&t.alloc))
    };
    // Two streams: floor(1.02 x 201) = 205 pages, so five are made before a's 100 idle pages
    // are remapped for the other 96.
    assert_eq!(held_after("policy:stitched", S2), (205, true));
    assert_eq!(
        held_after("policy:stitched,shared_spare:0.015", S2),
        (204, true)
    );
    assert_eq!(
        held_after("policy:stitched,shared_spare:0", S2),
        (201, true)
    );
    assert_eq!(
        held_after("policy:stitched,shared_spare:0.005", S2),
        (202, true)
    );
    // One stream: its layouts repeat, so it keeps no spare pages.
    assert_eq!(held_after("policy:stitched", S1), (201, false));
    // A cap on the memory held comes first: at 202 pages the pool makes one spare page and
    // remaps the rest, without an out-of-memory error.
    assert_eq!(
        held_after(&format!("policy:stitched,cap:{}", 202 * PAGE), S2),
        (202, true)
    );
}
