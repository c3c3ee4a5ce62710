//! What the stream-order audits (`stitched_streams.rs`, page by page; `shared_range.rs`, byte
//! by byte) share: a simulated device that logs its mappings and events, and the replay of a
//! recorded trace through an audit.

use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use gpumem_core::backend::{EventHandle, Stream};
use gpumem_core::trace::{Kind, Trace};
use gpumem_core::{Allocation, Allocator, Config};
use std::collections::HashMap;

/// An allocator configured by `conf` over a simulated device of `total` bytes that keeps what
/// audits read (its mappings, event records and waits), with events that complete only when
/// the host waits for them or the test completes them.
pub fn audited_sim(conf: &str, total: u64) -> (Allocator, SimControl) {
    let (sim, ctl) = SimBackend::new(SimConfig {
        total_bytes: total,
        event_mode: EventMode::Manual,
        audit: true,
        ..SimConfig::default()
    });
    let alloc = Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap();
    (alloc, ctl)
}

/// An audit that a trace can be replayed through.
pub trait Audited {
    /// Allocates `size` bytes on `stream`, checking what the audit checks.
    fn allocate(&mut self, size: u64, stream: Stream) -> Allocation;
    /// Frees `a`; with `used_on`, after a use on that stream: returns the events the free
    /// recorded, which [`Audited::complete`] completes.
    fn free(&mut self, a: &Allocation, used_on: Option<Stream>) -> Vec<EventHandle>;
    /// Completes the events of a block freed with a use on another stream.
    fn complete(&mut self, a: &Allocation, events: Vec<EventHandle>);
}

/// Replays `tr` through `t`. A block whose free completes later than it is requested was used
/// on another stream of the trace (the first other one is taken); zero-byte allocations are
/// left out, as the replay does.
pub fn replay_trace(tr: &Trace, t: &mut impl Audited) {
    let streams = tr.streams();
    let mut live: HashMap<(u64, u64), Allocation> = HashMap::new();
    let mut waiting: HashMap<(u64, u64), (Allocation, Vec<EventHandle>)> = HashMap::new();
    for (i, e) in tr.events.iter().enumerate() {
        let key = (e.stream, e.addr);
        match e.kind {
            Kind::Alloc if e.size > 0 => {
                let a = t.allocate(e.size, e.stream);
                live.insert(key, a);
            }
            Kind::FreeRequested => {
                let Some(a) = live.remove(&key) else { continue };
                let next = tr.events.get(i + 1);
                let immediate =
                    next.is_some_and(|n| n.kind == Kind::FreeCompleted && n.addr == e.addr);
                if immediate {
                    t.free(&a, None);
                } else {
                    let other = *streams.iter().find(|&&s| s != e.stream).unwrap();
                    let evs = t.free(&a, Some(other));
                    waiting.insert(key, (a, evs));
                }
            }
            Kind::FreeCompleted => {
                if let Some((a, evs)) = waiting.remove(&key) {
                    t.complete(&a, evs);
                }
            }
            _ => {}
        }
    }
}
