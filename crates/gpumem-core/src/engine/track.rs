//! Optional bookkeeping for diagnostics: a ring buffer of allocation events (the allocation
//! history PyTorch's snapshots carry) and the table of live allocations with their age, stream
//! and backtrace (for leak reports). Off by default; the hot path pays one branch for it.

use crate::backend::{DevPtr, Stream};
use rustc_hash::FxHashMap;
use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// What happened, named as in PyTorch's `device_traces`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// The user freed a block.
    FreeRequested,
    /// The block became reusable.
    FreeCompleted,
    /// A request failed for lack of memory (`addr` holds the device's free bytes then, as in
    /// PyTorch).
    Oom,
    /// The policy took a plain segment from the device.
    SegmentAlloc,
    /// It returned one.
    SegmentFree,
    /// It mapped physical memory at a virtual range.
    SegmentMap,
    /// It unmapped a virtual range.
    SegmentUnmap,
}

impl Action {
    /// PyTorch's name for the action.
    pub fn torch_name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::Oom => "oom",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
        }
    }
}

/// One recorded event.
#[derive(Debug, Clone)]
pub struct Record {
    /// What happened.
    pub action: Action,
    /// Block address (for an OOM: the device's free bytes, as PyTorch records it).
    pub addr: DevPtr,
    /// Requested bytes (segment bytes for segment actions).
    pub size: u64,
    /// Stream (0 for segment actions: the device does not know it).
    pub stream: Stream,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// Where it was called from, when backtraces are on.
    pub backtrace: Option<Arc<Backtrace>>,
}

/// A live allocation.
#[derive(Debug, Clone)]
pub struct LiveRecord {
    /// Requested bytes.
    pub size: u64,
    /// Stream.
    pub stream: Stream,
    /// When it was allocated (µs since the epoch).
    pub time_us: u64,
    /// Where it was allocated from.
    pub backtrace: Option<Arc<Backtrace>>,
}

/// The tracker of one allocator.
pub struct Tracker {
    capacity: usize,
    history: VecDeque<Record>,
    live: Option<FxHashMap<DevPtr, LiveRecord>>,
    /// Requested bytes of blocks not yet reusable, so that free entries carry their size.
    sizes: FxHashMap<DevPtr, u64>,
    backtraces: bool,
}

/// Microseconds since the Unix epoch.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl Tracker {
    /// A tracker keeping `capacity` history entries, live allocations when `leaks`, and
    /// backtraces when `backtraces`.
    pub fn new(capacity: usize, leaks: bool, backtraces: bool) -> Self {
        Self {
            capacity,
            history: VecDeque::with_capacity(capacity.min(1 << 16)),
            live: leaks.then(FxHashMap::default),
            sizes: FxHashMap::default(),
            backtraces,
        }
    }

    /// Records an event. A free with `size` 0 gets the requested size of its allocation.
    pub fn record(&mut self, action: Action, addr: DevPtr, size: u64, stream: Stream) {
        self.record_at(action, addr, size, stream, now_us());
    }

    /// Records an event that happened at `time_us`.
    pub fn record_at(
        &mut self,
        action: Action,
        addr: DevPtr,
        mut size: u64,
        stream: Stream,
        time_us: u64,
    ) {
        if self.capacity > 0 {
            match action {
                Action::Alloc => {
                    self.sizes.insert(addr, size);
                }
                Action::FreeRequested if size == 0 => {
                    size = self.sizes.get(&addr).copied().unwrap_or(0);
                }
                Action::FreeCompleted => {
                    let known = self.sizes.remove(&addr).unwrap_or(0);
                    if size == 0 {
                        size = known;
                    }
                }
                _ => {}
            }
        }
        let bt = if self.backtraces && action == Action::Alloc {
            Some(Arc::new(Backtrace::force_capture()))
        } else {
            None
        };
        if let Some(live) = self.live.as_mut() {
            match action {
                Action::Alloc => {
                    live.insert(
                        addr,
                        LiveRecord {
                            size,
                            stream,
                            time_us,
                            backtrace: bt.clone(),
                        },
                    );
                }
                Action::FreeRequested => {
                    live.remove(&addr);
                }
                _ => {}
            }
        }
        if self.capacity > 0 {
            if self.history.len() == self.capacity {
                self.history.pop_front();
            }
            self.history.push_back(Record {
                action,
                addr,
                size,
                stream,
                time_us,
                backtrace: bt,
            });
        }
    }

    /// The history, oldest first.
    pub fn history(&self) -> impl Iterator<Item = &Record> {
        self.history.iter()
    }

    /// Live allocations by address (empty unless leak tracking is on).
    pub fn live(&self) -> Vec<(DevPtr, LiveRecord)> {
        let mut v: Vec<_> = self
            .live
            .iter()
            .flat_map(|m| m.iter().map(|(&a, r)| (a, r.clone())))
            .collect();
        v.sort_by_key(|(a, _)| *a);
        v
    }

    /// Whether live allocations are tracked.
    pub fn tracks_leaks(&self) -> bool {
        self.live.is_some()
    }
}
