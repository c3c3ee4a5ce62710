//! The boundary between the engine and a device.
//!
//! The engine keeps all metadata on the host and asks a [`Backend`] for physical memory,
//! virtual ranges, mappings and stream-ordering events. [`sim::SimBackend`] implements it
//! deterministically with no GPU; the `gpumem-cuda` crate implements it over the CUDA driver.
//! Every call goes through [`crate::device::Device`], which counts calls by [`DriverCall`]
//! kind and charges each an estimated cost from a [`CostModel`], whatever the backend.

pub mod sim;

use crate::error::BackendError;
use serde::Serialize;
use std::fmt;

/// A device address (or an address in the simulated space).
pub type DevPtr = u64;
/// A stream, as its raw handle value (`cudaStream_t` cast to an integer; 0 is the legacy
/// default stream).
pub type Stream = u64;

/// A physical memory allocation of the virtual-memory API (`CUmemGenericAllocationHandle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysHandle(pub u64);

/// A recorded stream event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventHandle(pub u64);

/// What a backend knows of its device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// Device name ("NVIDIA H200", "sim").
    pub name: String,
    /// Ordinal of the device.
    pub ordinal: u32,
    /// Total device memory in bytes.
    pub total_bytes: u64,
    /// Physical page size of the virtual-memory API (cuMemGetAllocationGranularity).
    pub page_bytes: u64,
    /// Whether the virtual-memory API is usable.
    pub supports_vmm: bool,
}

/// The kinds of driver call the engine makes, named after the CUDA driver functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum DriverCall {
    /// cuMemAlloc: a plain segment.
    MemAlloc,
    /// cuMemFree.
    MemFree,
    /// cuMemAddressReserve: a virtual range.
    AddressReserve,
    /// cuMemAddressFree.
    AddressFree,
    /// cuMemCreate: one physical allocation.
    MemCreate,
    /// cuMemRelease.
    MemRelease,
    /// cuMemMap: one physical allocation mapped at a virtual address.
    MemMap,
    /// cuMemUnmap.
    MemUnmap,
    /// cuMemSetAccess.
    SetAccess,
    /// cuEventRecord.
    EventRecord,
    /// cuEventQuery.
    EventQuery,
    /// cuEventSynchronize (the host waits for the device).
    EventSynchronize,
    /// cuStreamWaitEvent (a device-side dependency between streams).
    StreamWaitEvent,
    /// cuMemGetInfo.
    MemGetInfo,
}

impl DriverCall {
    /// Every kind, in a stable order.
    pub const ALL: [DriverCall; 14] = [
        DriverCall::MemAlloc,
        DriverCall::MemFree,
        DriverCall::AddressReserve,
        DriverCall::AddressFree,
        DriverCall::MemCreate,
        DriverCall::MemRelease,
        DriverCall::MemMap,
        DriverCall::MemUnmap,
        DriverCall::SetAccess,
        DriverCall::EventRecord,
        DriverCall::EventQuery,
        DriverCall::EventSynchronize,
        DriverCall::StreamWaitEvent,
        DriverCall::MemGetInfo,
    ];

    /// The CUDA driver function's name.
    pub fn cuda_name(self) -> &'static str {
        match self {
            DriverCall::MemAlloc => "cuMemAlloc",
            DriverCall::MemFree => "cuMemFree",
            DriverCall::AddressReserve => "cuMemAddressReserve",
            DriverCall::AddressFree => "cuMemAddressFree",
            DriverCall::MemCreate => "cuMemCreate",
            DriverCall::MemRelease => "cuMemRelease",
            DriverCall::MemMap => "cuMemMap",
            DriverCall::MemUnmap => "cuMemUnmap",
            DriverCall::SetAccess => "cuMemSetAccess",
            DriverCall::EventRecord => "cuEventRecord",
            DriverCall::EventQuery => "cuEventQuery",
            DriverCall::EventSynchronize => "cuEventSynchronize",
            DriverCall::StreamWaitEvent => "cuStreamWaitEvent",
            DriverCall::MemGetInfo => "cuMemGetInfo",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|&k| k == self).unwrap_or(0)
    }
}

impl fmt::Display for DriverCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.cuda_name())
    }
}

/// Estimated cost of one call: a fixed part plus a part per physical allocation (handle) it
/// covers. The virtual-memory calls cost per handle, not per byte: mapping, setting access on
/// and unmapping 1 GiB made of 2 MiB handles costs about 20 times what it costs made of
/// 32 MiB handles (`scripts/vmm_cost.py`, BENCHMARKS.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CallCost {
    /// Microseconds per call.
    pub per_call_us: f64,
    /// Microseconds per physical handle covered by the call.
    pub per_handle_us: f64,
}

/// The estimated cost of each kind of call, used to turn call counts into driver time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostModel {
    costs: [CallCost; DriverCall::ALL.len()],
}

impl CostModel {
    /// Costs measured on an H200 with driver 580 and CUDA 13 (ANCHORS.md §3), split into
    /// kinds. cuMemAlloc+cuMemFree of 1 MiB cost 65 µs a pair (split evenly here). The full
    /// create/map/access/unmap/release cycle of one page costs 53 µs; map is 1.1 µs a page,
    /// access 7.2 ms / 256 = 28 µs a page and unmap 4.2 ms / 256 = 16.4 µs a page, which leaves
    /// about 7.5 µs for create + release. Event and reserve costs were not measured there: they
    /// are typical figures for the driver and marked as estimates in the docs.
    pub fn h200() -> Self {
        let mut m = Self::zero();
        let c = |per_call_us, per_handle_us| CallCost {
            per_call_us,
            per_handle_us,
        };
        m.set(DriverCall::MemAlloc, c(32.5, 0.0));
        m.set(DriverCall::MemFree, c(32.5, 0.0));
        m.set(DriverCall::AddressReserve, c(10.0, 0.0));
        m.set(DriverCall::AddressFree, c(10.0, 0.0));
        m.set(DriverCall::MemCreate, c(0.0, 3.75));
        m.set(DriverCall::MemRelease, c(0.0, 3.75));
        m.set(DriverCall::MemMap, c(0.0, 1.1));
        m.set(DriverCall::MemUnmap, c(0.0, 16.4));
        m.set(DriverCall::SetAccess, c(0.0, 28.1));
        m.set(DriverCall::EventRecord, c(2.0, 0.0));
        m.set(DriverCall::EventQuery, c(0.5, 0.0));
        m.set(DriverCall::EventSynchronize, c(20.0, 0.0));
        m.set(DriverCall::StreamWaitEvent, c(2.0, 0.0));
        m.set(DriverCall::MemGetInfo, c(1.0, 0.0));
        m
    }

    /// Every call free: for counting only.
    pub fn zero() -> Self {
        Self {
            costs: [CallCost {
                per_call_us: 0.0,
                per_handle_us: 0.0,
            }; DriverCall::ALL.len()],
        }
    }

    /// Sets the cost of one kind.
    pub fn set(&mut self, kind: DriverCall, cost: CallCost) {
        self.costs[kind.index()] = cost;
    }

    /// The cost of one kind.
    pub fn get(&self, kind: DriverCall) -> CallCost {
        self.costs[kind.index()]
    }

    /// Seconds charged for one call covering `handles` physical handles.
    pub fn seconds(&self, kind: DriverCall, handles: u64) -> f64 {
        let c = self.get(kind);
        (c.per_call_us + c.per_handle_us * handles as f64) * 1e-6
    }
}

impl Default for CostModel {
    fn default() -> Self {
        Self::h200()
    }
}

/// Driver calls made so far, by kind, with their estimated cost.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CallCounts {
    counts: [u64; DriverCall::ALL.len()],
    pages: [u64; DriverCall::ALL.len()],
    est_seconds: f64,
    /// Wall time measured around each backend call, nanoseconds (on the simulated device:
    /// the simulation's own cost, not the driver's).
    measured_ns: [u64; DriverCall::ALL.len()],
}

impl CallCounts {
    /// Records one call covering `pages` pages (bytes ÷ page size, for reports) made of
    /// `handles` physical handles (what it costs).
    pub fn add(&mut self, kind: DriverCall, pages: u64, handles: u64, cost: &CostModel) {
        let i = kind.index();
        self.counts[i] += 1;
        self.pages[i] += pages;
        self.est_seconds += cost.seconds(kind, handles);
    }

    /// Adds the measured wall time of one call.
    pub fn add_measured(&mut self, kind: DriverCall, took: std::time::Duration) {
        self.measured_ns[kind.index()] += took.as_nanos() as u64;
    }

    /// Measured wall time of the calls of one kind, in seconds.
    pub fn measured_seconds(&self, kind: DriverCall) -> f64 {
        self.measured_ns[kind.index()] as f64 * 1e-9
    }

    /// Measured wall time of all calls, in seconds.
    pub fn measured_total_seconds(&self) -> f64 {
        self.measured_ns.iter().sum::<u64>() as f64 * 1e-9
    }

    /// Calls of one kind.
    pub fn count(&self, kind: DriverCall) -> u64 {
        self.counts[kind.index()]
    }

    /// Pages covered by calls of one kind.
    pub fn pages(&self, kind: DriverCall) -> u64 {
        self.pages[kind.index()]
    }

    /// All calls.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Estimated driver time of all calls, in seconds.
    pub fn est_seconds(&self) -> f64 {
        self.est_seconds
    }

    /// (name, count) for every kind with at least one call.
    pub fn nonzero(&self) -> Vec<(DriverCall, u64)> {
        DriverCall::ALL
            .iter()
            .map(|&k| (k, self.count(k)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Calls made since `earlier` (a copy taken before).
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        let mut d = self.clone();
        for i in 0..d.counts.len() {
            d.counts[i] -= earlier.counts[i];
            d.pages[i] -= earlier.pages[i];
            d.measured_ns[i] -= earlier.measured_ns[i];
        }
        d.est_seconds -= earlier.est_seconds;
        d
    }

    /// A JSON object `{"cuMemMap": 12, ...}` of the non-zero counts.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (k, n) in self.nonzero() {
            m.insert(k.cuda_name().to_string(), n.into());
        }
        serde_json::Value::Object(m)
    }
}

/// The alignment of a range that [`Backend::address_reserve`] was asked to align to `align`
/// on a device whose page is `page`: `align` raised to at least the page (0: the page); an
/// error unless that is a power of two multiple of the page. Shared so that every backend
/// checks it the same way.
pub fn reserve_alignment(align: u64, page: u64) -> Result<u64, BackendError> {
    let align = align.max(page);
    if align.is_power_of_two() && align % page == 0 {
        Ok(align)
    } else {
        Err(BackendError::new(
            DriverCall::AddressReserve,
            format!("alignment {align} is not a power of two multiple of the {page}-byte page"),
        ))
    }
}

/// Whether `[va, va + bytes)` (non-empty) lies inside one of `reservations` (start -> length):
/// the check every backend makes before a map, unmap or access call, so that it only ever
/// touches address space it reserved itself.
pub fn inside_reservation(
    reservations: &std::collections::BTreeMap<DevPtr, u64>,
    va: DevPtr,
    bytes: u64,
) -> bool {
    let Some(end) = va.checked_add(bytes).filter(|_| bytes > 0) else {
        return false;
    };
    reservations
        .range(..=va)
        .next_back()
        .is_some_and(|(&start, &len)| end <= start.saturating_add(len))
}

/// A device as the engine sees it. Implementations must not call back into the allocator.
///
/// Sizes passed to the virtual-memory calls are multiples of [`DeviceInfo::page_bytes`], and
/// addresses passed to `map`/`unmap`/`set_access` lie inside ranges returned by
/// `address_reserve`. Implementations report failures as [`BackendError`]s; they never panic on
/// bad arguments.
pub trait Backend: Send {
    /// What the device is.
    fn info(&self) -> DeviceInfo;
    /// Whether this is a simulated device, whose calls cost what the cost model says rather
    /// than the time they take.
    fn is_simulated(&self) -> bool {
        false
    }
    /// A CUDA graph capture is underway (or no longer is): until told otherwise, the backend
    /// makes its calls in the relaxed capture mode, as PyTorch's allocator does, so that a
    /// capture begun in the global mode neither refuses them nor is invalidated by them. (Only
    /// while one is underway: the mode switch is two more driver calls.)
    fn set_capture_underway(&mut self, _underway: bool) {}
    /// Whether `stream` is capturing a CUDA graph now. A private pool is also filled outside
    /// captures (PyTorch's `torch.cuda.MemPool`, and torch.compile's warm-up runs), where the
    /// stream's work runs at once and its events must be real. The default (the simulated
    /// device's answer) is yes: its pools stand for captures.
    fn stream_is_capturing(&mut self, _stream: Stream) -> Result<bool, BackendError> {
        Ok(true)
    }
    /// An event that reads as completed (made, never recorded). What stands for a point of a
    /// capturing stream's work, none of which runs before the graph is launched (see
    /// `DeviceState::event_record`).
    fn event_completed(&mut self) -> Result<EventHandle, BackendError> {
        Err(BackendError::new(
            DriverCall::EventRecord,
            "this backend cannot make an event that reads as completed",
        ))
    }
    /// (free, total) bytes of the device.
    fn mem_get_info(&mut self) -> Result<(u64, u64), BackendError>;
    /// Allocates a plain segment (cuMemAlloc).
    fn mem_alloc(&mut self, bytes: u64) -> Result<DevPtr, BackendError>;
    /// Frees a plain segment.
    fn mem_free(&mut self, ptr: DevPtr, bytes: u64) -> Result<(), BackendError>;
    /// Reserves a virtual address range of `bytes` aligned to `align`, a power of two that is
    /// a multiple of the page size (or 0: the page size).
    fn address_reserve(&mut self, bytes: u64, align: u64) -> Result<DevPtr, BackendError>;
    /// Returns a virtual range (which must be wholly unmapped).
    fn address_free(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError>;
    /// Creates one physical allocation of `bytes` (a multiple of the page size).
    fn mem_create(&mut self, bytes: u64) -> Result<PhysHandle, BackendError>;
    /// Releases a physical allocation (which must no longer be mapped anywhere).
    fn mem_release(&mut self, handle: PhysHandle) -> Result<(), BackendError>;
    /// Maps a whole physical allocation at `va`.
    fn mem_map(&mut self, va: DevPtr, bytes: u64, handle: PhysHandle) -> Result<(), BackendError>;
    /// Unmaps every mapping inside `[va, va + bytes)`.
    fn mem_unmap(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError>;
    /// Grants the device read/write access to a mapped range.
    fn set_access(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError>;
    /// Records an event on a stream.
    fn event_record(&mut self, stream: Stream) -> Result<EventHandle, BackendError>;
    /// Whether the work before the event has completed.
    fn event_query(&mut self, event: EventHandle) -> Result<bool, BackendError>;
    /// Blocks the host until the event has completed.
    fn event_synchronize(&mut self, event: EventHandle) -> Result<(), BackendError>;
    /// Destroys (or recycles) an event.
    fn event_destroy(&mut self, event: EventHandle);
    /// Makes later work on `stream` wait for `event`.
    fn stream_wait_event(&mut self, stream: Stream, event: EventHandle)
        -> Result<(), BackendError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn only_ranges_inside_one_reservation_are_this_backends_own() {
        const MB2: u64 = 2 << 20;
        let mut r = BTreeMap::new();
        r.insert(0x1000_0000, 8 * MB2);
        r.insert(0x2000_0000, 2 * MB2);
        // Inside: the whole reservation, its first and last pages.
        assert!(inside_reservation(&r, 0x1000_0000, 8 * MB2));
        assert!(inside_reservation(&r, 0x1000_0000, MB2));
        assert!(inside_reservation(&r, 0x1000_0000 + 7 * MB2, MB2));
        assert!(inside_reservation(&r, 0x2000_0000, 2 * MB2));
        // Outside: past the end, before the first, in the gap, across two reservations.
        assert!(!inside_reservation(&r, 0x1000_0000 + 7 * MB2, 2 * MB2));
        assert!(!inside_reservation(&r, 0x0fe0_0000, MB2));
        assert!(!inside_reservation(&r, 0x1800_0000, MB2));
        assert!(!inside_reservation(&r, 0x1000_0000, 0x1000_0000 + 2 * MB2));
        // Empty and overflowing ranges are never inside.
        assert!(!inside_reservation(&r, 0x1000_0000, 0));
        assert!(!inside_reservation(&r, u64::MAX - 10, MB2));
        assert!(!inside_reservation(&BTreeMap::new(), 0x1000_0000, MB2));
    }
}
