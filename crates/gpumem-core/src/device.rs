//! One device as the policies see it: the backend behind a lock, with every call counted and
//! costed, the bytes held from the device tracked exactly, the memory cap enforced, and the
//! preallocated reserve served before the driver is asked.

use crate::backend::{
    Backend, CallCounts, CostModel, DevPtr, DeviceInfo, DriverCall, EventHandle, PhysHandle, Stream,
};
use crate::error::{AllocError, BackendError};
use crate::stats::{Pool, StatArray};
use parking_lot::{Mutex, MutexGuard};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The largest physical page `page:` may ask for.
pub const MAX_PAGE: u64 = 1 << 30;

/// Device-level statistics: physical allocations and their bytes.
#[derive(Debug, Clone, Default)]
pub struct HeldStats {
    /// Physical allocations held (segments or pages).
    pub segment: StatArray,
    /// Bytes held.
    pub reserved_bytes: StatArray,
    /// Physical allocations made.
    pub num_device_alloc: i64,
    /// Physical allocations returned.
    pub num_device_free: i64,
}

/// What happened to the memory the policies hold, as PyTorch's snapshots name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentAction {
    /// A plain segment was handed to a policy (from the driver or the preallocated reserve).
    Alloc,
    /// A plain segment was returned.
    Free,
    /// Physical memory was mapped at a virtual range.
    Map,
    /// A virtual range was unmapped.
    Unmap,
}

/// One change to the segments or mappings, recorded for allocation histories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentEvent {
    /// What happened.
    pub action: SegmentAction,
    /// Segment address, or virtual address of the (un)mapped range.
    pub addr: DevPtr,
    /// Bytes.
    pub bytes: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// For a map or unmap: the stream whose policy reserved the virtual range (and so owns
    /// the mapping), and that range's pool.
    pub owner: Option<(Stream, Pool)>,
}

/// Segment events not yet collected by the tracker, and the virtual ranges mapped now
/// (coalesced), kept while an allocation history is recorded.
#[derive(Default)]
struct SegmentTrace {
    pending: Vec<SegmentEvent>,
    mapped: BTreeMap<DevPtr, u64>,
}

impl SegmentTrace {
    fn push(
        &mut self,
        action: SegmentAction,
        addr: DevPtr,
        bytes: u64,
        owner: Option<(Stream, Pool)>,
    ) {
        self.pending.push(SegmentEvent {
            action,
            addr,
            bytes,
            time_us: crate::engine::track::now_us(),
            owner,
        });
        match action {
            SegmentAction::Map => {
                let (mut start, mut end) = (addr, addr + bytes);
                if let Some((&p, &len)) = self.mapped.range(..=start).next_back() {
                    if p + len >= start {
                        self.mapped.remove(&p);
                        start = p;
                        end = end.max(p + len);
                    }
                }
                while let Some((&p, &len)) = self.mapped.range(start..=end).next() {
                    self.mapped.remove(&p);
                    end = end.max(p + len);
                }
                self.mapped.insert(start, end - start);
            }
            SegmentAction::Unmap => {
                let end = addr + bytes;
                let hit: Vec<(DevPtr, u64)> = self
                    .mapped
                    .range(..end)
                    .rev()
                    .take_while(|&(&p, &len)| p + len > addr)
                    .map(|(&p, &len)| (p, len))
                    .collect();
                for (p, len) in hit {
                    self.mapped.remove(&p);
                    if p < addr {
                        self.mapped.insert(p, addr - p);
                    }
                    if p + len > end {
                        self.mapped.insert(end, p + len - end);
                    }
                }
            }
            SegmentAction::Alloc | SegmentAction::Free => {}
        }
    }
}

/// Memory taken from the device at start and handed out before the driver is asked again.
#[derive(Default)]
struct Reserve {
    /// One big segment carved into smaller ones: free ranges by address.
    segment: Option<(DevPtr, u64)>,
    free_ranges: BTreeMap<DevPtr, u64>,
    /// Pre-created physical pages.
    pages: Vec<PhysHandle>,
    /// Bytes of the reserve (counted as held from the start).
    bytes: u64,
}

/// The backend and everything counted about it. Obtained from [`Device::lock`].
pub struct DeviceState {
    backend: Box<dyn Backend>,
    info: DeviceInfo,
    cost: CostModel,
    calls: CallCounts,
    held: u64,
    peak_held: u64,
    cap: Option<u64>,
    stats: HeldStats,
    reserve: Reserve,
    segment_log: Option<Vec<u64>>,
    segment_trace: Option<SegmentTrace>,
    /// Virtual ranges reserved, by start: (bytes, the stream and pool of the policy that
    /// reserved it). What a mapping belongs to, for histories and snapshots.
    reservations: BTreeMap<DevPtr, (u64, Stream, Pool)>,
    /// Whether the backend is the simulated device (see [`DeviceState::driver_seconds`]).
    simulated: bool,
    /// Streams seen capturing a CUDA graph (allocating into a private pool) while captures are
    /// underway: nothing is recorded on them, which would become part of the graph, and no
    /// stream wait is added to them (see [`DeviceState::note_capturing`]).
    capturing: Vec<Stream>,
    /// Events recorded on the allocator's streams as the latest capture began (before PyTorch
    /// begins the capture itself): they cover all the work a capturing stream will run before
    /// its graph is launched (see [`DeviceState::event_record`]).
    pre_capture: Vec<(Stream, EventHandle)>,
}

/// A device shared by the allocator's stream shards.
pub struct Device {
    state: Mutex<DeviceState>,
    info: DeviceInfo,
    /// Start of the device's clock (see [`Device::now_us`]).
    born: Instant,
    /// A replay's trace time, microseconds (u64::MAX: none set, the wall clock runs).
    trace_time_us: AtomicU64,
}

impl Device {
    /// Wraps a backend; calls are charged with `cost`.
    pub fn new(backend: Box<dyn Backend>, cost: CostModel) -> Self {
        let info = backend.info();
        let simulated = backend.is_simulated();
        Self {
            state: Mutex::new(DeviceState {
                backend,
                info: info.clone(),
                cost,
                calls: CallCounts::default(),
                held: 0,
                peak_held: 0,
                cap: None,
                stats: HeldStats::default(),
                reserve: Reserve::default(),
                segment_log: None,
                segment_trace: None,
                reservations: BTreeMap::new(),
                simulated,
                capturing: Vec::new(),
                pre_capture: Vec::new(),
            }),
            info,
            born: Instant::now(),
            trace_time_us: AtomicU64::new(u64::MAX),
        }
    }

    /// Microseconds on the device's clock: the trace's time while a replay sets it
    /// ([`Device::set_trace_time_us`]), else the wall time since the device was opened. What
    /// the policies measure their driver time against.
    pub fn now_us(&self) -> u64 {
        match self.trace_time_us.load(Ordering::Relaxed) {
            u64::MAX => self.born.elapsed().as_micros() as u64,
            t => t,
        }
    }

    /// Sets the clock to a replayed trace's time (microseconds; from then on the wall clock is
    /// no longer read).
    pub fn set_trace_time_us(&self, t: u64) {
        self.trace_time_us
            .store(t.min(u64::MAX - 1), Ordering::Relaxed);
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Makes the physical page `bytes`, a power-of-two multiple of the backend's granularity
    /// (`page:` in the configuration, stitched policy only): every page [`DeviceState::create_page`]
    /// makes is then one handle of that size, and every virtual range is aligned to it.
    /// Before any allocation.
    ///
    /// Why one would: on an H200 a streaming copy runs at 0.73 of cudaMalloc'ed memory's
    /// bandwidth on memory made of separate 2 MiB handles, 0.92 with 8 MiB and 0.97 with
    /// 16 MiB (`scripts/vmm_bandwidth.py`, BENCHMARKS.md §3, session 25), while a block
    /// holds whole pages, so larger ones cost memory.
    pub fn set_page(&mut self, bytes: u64) -> Result<(), AllocError> {
        let granularity = self.info.page_bytes;
        if !bytes.is_power_of_two() || bytes % granularity != 0 || bytes > MAX_PAGE {
            return Err(AllocError::Config(format!(
                "page:{bytes}: expected a power of two that is a multiple of the device's \
                 {granularity}-byte granularity, at most {MAX_PAGE} bytes"
            )));
        }
        self.info.page_bytes = bytes;
        self.state.get_mut().info.page_bytes = bytes;
        Ok(())
    }

    /// Locks the device for a sequence of calls.
    pub fn lock(&self) -> MutexGuard<'_, DeviceState> {
        self.state.lock()
    }
}

impl DeviceState {
    /// Seconds spent in driver calls so far: measured on a real device, the cost model's
    /// estimate on the simulated one (whose calls take next to no time).
    pub fn driver_seconds(&self) -> f64 {
        if self.simulated {
            self.calls.est_seconds()
        } else {
            self.calls.measured_total_seconds()
        }
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Physical page size.
    pub fn page(&self) -> u64 {
        self.info.page_bytes
    }

    /// Bytes held from the device now (segments, pages and the preallocated reserve).
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Highest `held` so far.
    pub fn peak_held(&self) -> u64 {
        self.peak_held
    }

    /// Sets the peak to the current value.
    pub fn reset_peak(&mut self) {
        self.peak_held = self.held;
        for s in [&mut self.stats.segment, &mut self.stats.reserved_bytes] {
            s.all.peak = s.all.current;
            s.small_pool.peak = s.small_pool.current;
            s.large_pool.peak = s.large_pool.current;
        }
    }

    /// Driver calls made so far.
    pub fn calls(&self) -> &CallCounts {
        &self.calls
    }

    /// Device-level statistics.
    pub fn held_stats(&self) -> &HeldStats {
        &self.stats
    }

    /// The most bytes the allocator may hold, if limited.
    pub fn cap(&self) -> Option<u64> {
        self.cap
    }

    /// Limits the bytes held (`None`: no limit beyond the device).
    pub fn set_cap(&mut self, cap: Option<u64>) {
        self.cap = cap;
    }

    /// Starts (or stops) logging the size of every segment allocation, for fidelity checks.
    pub fn log_segments(&mut self, on: bool) {
        self.segment_log = on.then(Vec::new);
    }

    /// Sizes of the segments allocated since logging started.
    pub fn segment_log(&self) -> &[u64] {
        self.segment_log.as_deref().unwrap_or(&[])
    }

    /// Starts (or stops) recording segment events and mapped ranges, for allocation histories.
    pub fn trace_segments(&mut self, on: bool) {
        self.segment_trace = on.then(SegmentTrace::default);
    }

    /// The segment events since the last call (empty unless [`Self::trace_segments`] is on).
    pub fn take_segment_events(&mut self) -> Vec<SegmentEvent> {
        self.segment_trace
            .as_mut()
            .map(|t| std::mem::take(&mut t.pending))
            .unwrap_or_default()
    }

    /// Virtual ranges mapped now, coalesced, by address (empty unless segments are traced).
    pub fn mapped_ranges(&self) -> Vec<(DevPtr, u64)> {
        self.segment_trace
            .as_ref()
            .map(|t| t.mapped.iter().map(|(&a, &l)| (a, l)).collect())
            .unwrap_or_default()
    }

    fn trace(&mut self, action: SegmentAction, addr: DevPtr, bytes: u64) {
        if self.segment_trace.is_none() {
            return;
        }
        let owner = match action {
            SegmentAction::Map | SegmentAction::Unmap => self.reservation_of(addr),
            SegmentAction::Alloc | SegmentAction::Free => None,
        };
        if let Some(t) = self.segment_trace.as_mut() {
            t.push(action, addr, bytes, owner);
        }
    }

    /// The stream and pool of the reserved virtual range containing `addr`.
    pub fn reservation_of(&self, addr: DevPtr) -> Option<(Stream, Pool)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|(&base, &(len, _, _))| addr < base + len)
            .map(|(_, &(_, stream, pool))| (stream, pool))
    }

    /// Every reserved virtual range: (start, bytes, stream, pool), by address.
    pub fn reservations(&self) -> Vec<(DevPtr, u64, Stream, Pool)> {
        self.reservations
            .iter()
            .map(|(&a, &(len, stream, pool))| (a, len, stream, pool))
            .collect()
    }

    /// Runs one backend call covering `bytes` made of `handles` physical handles: counted
    /// (with its estimated cost) and its wall time added to the calls' measured time.
    fn call<T>(
        &mut self,
        kind: DriverCall,
        bytes: u64,
        handles: u64,
        f: impl FnOnce(&mut dyn Backend) -> T,
    ) -> T {
        let pages = bytes.div_ceil(self.info.page_bytes.max(1));
        self.calls.add(kind, pages, handles, &self.cost);
        let t = Instant::now();
        let r = f(self.backend.as_mut());
        self.calls.add_measured(kind, t.elapsed());
        r
    }

    fn check_cap(&self, call: DriverCall, bytes: u64) -> Result<(), BackendError> {
        match self.cap {
            Some(cap) if self.held + bytes > cap => Err(BackendError::oom(
                call,
                format!(
                    "the memory cap of {cap} bytes would be exceeded ({} held, {bytes} more asked)",
                    self.held
                ),
            )),
            _ => Ok(()),
        }
    }

    fn gain(&mut self, bytes: u64, pool: Pool) {
        self.held += bytes;
        self.peak_held = self.peak_held.max(self.held);
        self.stats.segment.inc(pool, 1);
        self.stats.reserved_bytes.inc(pool, bytes);
        self.stats.num_device_alloc += 1;
    }

    fn lose(&mut self, bytes: u64, pool: Pool) {
        self.held -= bytes;
        self.stats.segment.dec(pool, 1);
        self.stats.reserved_bytes.dec(pool, bytes);
        self.stats.num_device_free += 1;
    }

    /// Takes `bytes` (a multiple of the page size, or for `plain` any size) at start and keeps
    /// it for later requests: as one segment when `plain`, else as physical pages.
    pub fn preallocate(&mut self, bytes: u64, plain: bool) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        if plain {
            let ptr = self.call(DriverCall::MemAlloc, bytes, 0, |b| b.mem_alloc(bytes))?;
            self.reserve.segment = Some((ptr, bytes));
            self.reserve.free_ranges.insert(ptr, bytes);
            self.stats.num_device_alloc += 1;
        } else {
            let page = self.page();
            for _ in 0..bytes / page {
                let h = self.call(DriverCall::MemCreate, page, 1, |b| b.mem_create(page))?;
                self.reserve.pages.push(h);
                // Each page is one driver allocation, and is counted freed when released.
                self.stats.num_device_alloc += 1;
            }
        }
        let got = if plain {
            bytes
        } else {
            bytes / self.page() * self.page()
        };
        self.reserve.bytes = got;
        self.held += got;
        self.peak_held = self.peak_held.max(self.held);
        self.stats.reserved_bytes.inc(Pool::Large, got);
        Ok(())
    }

    /// Allocates a plain segment of `bytes` for `pool`.
    pub fn alloc_segment(&mut self, bytes: u64, pool: Pool) -> Result<DevPtr, BackendError> {
        // First fit in the preallocated reserve (already counted as held).
        let fit = self
            .reserve
            .free_ranges
            .iter()
            .find(|&(_, &len)| len >= bytes)
            .map(|(&p, &len)| (p, len));
        if let Some((p, len)) = fit {
            self.reserve.free_ranges.remove(&p);
            if len > bytes {
                self.reserve.free_ranges.insert(p + bytes, len - bytes);
            }
            self.stats.segment.inc(pool, 1);
            if let Some(log) = self.segment_log.as_mut() {
                log.push(bytes);
            }
            self.trace(SegmentAction::Alloc, p, bytes);
            return Ok(p);
        }
        self.check_cap(DriverCall::MemAlloc, bytes)?;
        let ptr = self.call(DriverCall::MemAlloc, bytes, 0, |b| b.mem_alloc(bytes))?;
        self.gain(bytes, pool);
        if let Some(log) = self.segment_log.as_mut() {
            log.push(bytes);
        }
        self.trace(SegmentAction::Alloc, ptr, bytes);
        Ok(ptr)
    }

    /// Frees a plain segment.
    pub fn free_segment(
        &mut self,
        ptr: DevPtr,
        bytes: u64,
        pool: Pool,
    ) -> Result<(), BackendError> {
        if let Some((base, len)) = self.reserve.segment {
            if ptr >= base && ptr + bytes <= base + len {
                self.return_range(ptr, bytes);
                self.stats.segment.dec(pool, 1);
                self.trace(SegmentAction::Free, ptr, bytes);
                return Ok(());
            }
        }
        self.call(DriverCall::MemFree, bytes, 0, |b| b.mem_free(ptr, bytes))?;
        self.lose(bytes, pool);
        self.trace(SegmentAction::Free, ptr, bytes);
        Ok(())
    }

    fn return_range(&mut self, mut ptr: DevPtr, mut bytes: u64) {
        let ranges = &mut self.reserve.free_ranges;
        if let Some((&p, &len)) = ranges.range(..ptr).next_back() {
            if p + len == ptr {
                ranges.remove(&p);
                ptr = p;
                bytes += len;
            }
        }
        if let Some(len) = ranges.remove(&(ptr + bytes)) {
            bytes += len;
        }
        ranges.insert(ptr, bytes);
    }

    /// Reserves a virtual range for the policy of `stream` (its `pool`).
    pub fn address_reserve(
        &mut self,
        bytes: u64,
        stream: Stream,
        pool: Pool,
    ) -> Result<DevPtr, BackendError> {
        self.address_reserve_aligned(bytes, stream, pool, 0)
    }

    /// [`DeviceState::address_reserve`] aligned to at least `align` bytes as well (the pages of
    /// a pool larger than the device's page).
    pub fn address_reserve_aligned(
        &mut self,
        bytes: u64,
        stream: Stream,
        pool: Pool,
        align: u64,
    ) -> Result<DevPtr, BackendError> {
        // Aligned to the page, which `page:` may make larger than the backend's granularity.
        let align = self.info.page_bytes.max(align);
        let va = self.call(DriverCall::AddressReserve, 0, 0, |b| {
            b.address_reserve(bytes, align)
        })?;
        self.reservations.insert(va, (bytes, stream, pool));
        Ok(va)
    }

    /// Returns a virtual range.
    pub fn address_free(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        self.call(DriverCall::AddressFree, 0, 0, |b| b.address_free(va, bytes))?;
        self.reservations.remove(&va);
        Ok(())
    }

    /// A physical page for `pool`: from the preallocated reserve if any is left, else created.
    pub fn create_page(&mut self, pool: Pool) -> Result<PhysHandle, BackendError> {
        let page = self.page();
        if let Some(h) = self.reserve.pages.pop() {
            // Already counted in `held`; from now on it is an ordinary page.
            self.reserve.bytes -= page;
            self.stats.reserved_bytes.dec(Pool::Large, page);
            self.stats.reserved_bytes.inc(pool, page);
            self.stats.segment.inc(pool, 1);
            return Ok(h);
        }
        self.check_cap(DriverCall::MemCreate, page)?;
        let h = self.call(DriverCall::MemCreate, page, 1, |b| b.mem_create(page))?;
        self.gain(page, pool);
        Ok(h)
    }

    /// Releases a physical page (which must be unmapped everywhere).
    pub fn release_page(&mut self, h: PhysHandle, pool: Pool) -> Result<(), BackendError> {
        let page = self.page();
        self.call(DriverCall::MemRelease, page, 1, |b| b.mem_release(h))?;
        self.lose(page, pool);
        Ok(())
    }

    /// Creates a physical allocation of several pages at once (one handle).
    pub fn create_chunk(&mut self, bytes: u64, pool: Pool) -> Result<PhysHandle, BackendError> {
        self.check_cap(DriverCall::MemCreate, bytes)?;
        let h = self.call(DriverCall::MemCreate, bytes, 1, |b| b.mem_create(bytes))?;
        self.gain(bytes, pool);
        Ok(h)
    }

    /// Releases a physical allocation of `bytes`.
    pub fn release_chunk(
        &mut self,
        h: PhysHandle,
        bytes: u64,
        pool: Pool,
    ) -> Result<(), BackendError> {
        self.call(DriverCall::MemRelease, bytes, 1, |b| b.mem_release(h))?;
        self.lose(bytes, pool);
        Ok(())
    }

    /// Maps a physical allocation of `bytes` at `va`.
    pub fn map(&mut self, va: DevPtr, bytes: u64, h: PhysHandle) -> Result<(), BackendError> {
        self.call(DriverCall::MemMap, bytes, 1, |b| b.mem_map(va, bytes, h))?;
        self.trace(SegmentAction::Map, va, bytes);
        Ok(())
    }

    /// Unmaps `[va, va + bytes)`, where `handles` physical handles are mapped.
    pub fn unmap(&mut self, va: DevPtr, bytes: u64, handles: u64) -> Result<(), BackendError> {
        self.call(DriverCall::MemUnmap, bytes, handles, |b| {
            b.mem_unmap(va, bytes)
        })?;
        self.trace(SegmentAction::Unmap, va, bytes);
        Ok(())
    }

    /// Grants access to a mapped range made of `handles` physical handles.
    pub fn set_access(&mut self, va: DevPtr, bytes: u64, handles: u64) -> Result<(), BackendError> {
        self.call(DriverCall::SetAccess, bytes, handles, |b| {
            b.set_access(va, bytes)
        })
    }

    /// Records an event on `stream`.
    ///
    /// On a stream capturing a CUDA graph an event cannot be recorded (it would become a node
    /// of the graph, and a query of it would read as completed at once). Nothing queued there
    /// since the capture began runs before the graph is launched, so the point such an event
    /// would mark is the end of the work queued before the capture, which the stream's
    /// pre-capture event covers: the host waits for that one (once; it stays completed) and
    /// gets an event that reads as completed. A capturing stream without one (it had allocated
    /// nothing when the capture began) is refused.
    pub fn event_record(&mut self, stream: Stream) -> Result<EventHandle, BackendError> {
        if self.capturing.contains(&stream) {
            let Some(&(_, pre)) = self.pre_capture.iter().find(|&&(s, _)| s == stream) else {
                return Err(BackendError::new(
                    DriverCall::EventRecord,
                    format!(
                        "stream {stream:#x} is capturing a CUDA graph and gpumem has no event \
                         of its work before the capture"
                    ),
                ));
            };
            self.event_synchronize(pre)?;
            return self.call(DriverCall::EventRecord, 0, 0, |b| b.event_completed());
        }
        self.call(DriverCall::EventRecord, 0, 0, |b| b.event_record(stream))
    }

    /// `stream` allocated in a private pool: if the device says it is capturing a CUDA graph,
    /// then until [`DeviceState::clear_capturing`] events on it stand for its pre-capture work
    /// (see [`DeviceState::event_record`]) and no stream wait is added to it (that would join
    /// outside work to the graph).
    pub fn note_capturing(&mut self, stream: Stream) {
        if !self.capturing.contains(&stream)
            && self.backend.stream_is_capturing(stream).unwrap_or(false)
        {
            self.capturing.push(stream);
        }
    }

    /// A capture is about to begin (a private pool is being filled; PyTorch begins the capture
    /// itself right after): an event is recorded on each of `streams` (the allocator's) but
    /// those already capturing, replacing the one an earlier begin recorded (the work it
    /// covers must be all the work before this capture), and the backend's calls go in the
    /// relaxed capture mode (see [`Backend::set_capture_underway`]). A stream whose event
    /// fails gets none.
    pub fn begin_capture(&mut self, streams: &[Stream]) {
        self.backend.set_capture_underway(true);
        for &s in streams {
            if self.capturing.contains(&s) {
                continue;
            }
            if let Some(k) = self.pre_capture.iter().position(|&(x, _)| x == s) {
                let (_, old) = self.pre_capture.swap_remove(k);
                self.event_destroy(old);
            }
            if let Ok(e) = self.call(DriverCall::EventRecord, 0, 0, |b| b.event_record(s)) {
                self.pre_capture.push((s, e));
            }
        }
    }

    /// No capture is underway any more.
    pub fn clear_capturing(&mut self) {
        self.capturing.clear();
        for (_, e) in std::mem::take(&mut self.pre_capture) {
            self.event_destroy(e);
        }
        self.backend.set_capture_underway(false);
    }

    fn refuse_capturing(&self, call: DriverCall, stream: Stream) -> Result<(), BackendError> {
        if self.capturing.contains(&stream) {
            return Err(BackendError::new(
                call,
                format!(
                    "stream {stream:#x} is capturing a CUDA graph: gpumem makes it wait for no \
                     event until the capture ends"
                ),
            ));
        }
        Ok(())
    }

    /// Whether an event has completed.
    pub fn event_query(&mut self, e: EventHandle) -> Result<bool, BackendError> {
        self.call(DriverCall::EventQuery, 0, 0, |b| b.event_query(e))
    }

    /// Waits on the host for an event.
    pub fn event_synchronize(&mut self, e: EventHandle) -> Result<(), BackendError> {
        self.call(DriverCall::EventSynchronize, 0, 0, |b| {
            b.event_synchronize(e)
        })
    }

    /// Destroys an event (not a driver call worth counting: events are pooled).
    pub fn event_destroy(&mut self, e: EventHandle) {
        self.backend.event_destroy(e)
    }

    /// Makes `stream` wait for `e` on the device.
    pub fn stream_wait_event(
        &mut self,
        stream: Stream,
        e: EventHandle,
    ) -> Result<(), BackendError> {
        self.refuse_capturing(DriverCall::StreamWaitEvent, stream)?;
        self.call(DriverCall::StreamWaitEvent, 0, 0, |b| {
            b.stream_wait_event(stream, e)
        })
    }

    /// (free, total) bytes of the device.
    pub fn mem_get_info(&mut self) -> Result<(u64, u64), BackendError> {
        self.call(DriverCall::MemGetInfo, 0, 0, |b| b.mem_get_info())
    }

    /// Bytes of the preallocated reserve not handed out yet.
    pub fn reserve_unused(&self) -> u64 {
        self.reserve.pages.len() as u64 * self.page()
            + self.reserve.free_ranges.values().sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::units::MIB;

    fn dev() -> Device {
        let (b, _) = SimBackend::new(SimConfig {
            total_bytes: 100 * MIB,
            ..SimConfig::default()
        });
        Device::new(Box::new(b), CostModel::h200())
    }

    /// A device whose events complete only when the test (or a host wait) says so.
    fn manual_dev() -> (Device, crate::backend::sim::SimControl) {
        let (b, ctl) = SimBackend::new(SimConfig {
            event_mode: crate::backend::sim::EventMode::Manual,
            ..SimConfig::default()
        });
        (Device::new(Box::new(b), CostModel::h200()), ctl)
    }

    #[test]
    fn no_event_is_recorded_or_waited_for_on_a_capturing_stream() {
        let (d, ctl) = manual_dev();
        let mut s = d.lock();
        let before = s.event_record(5).unwrap();
        // Stream 7 had work when the capture began; stream 5 is not one of the allocator's.
        s.begin_capture(&[7]);
        let pre = ctl.take_recorded();
        assert_eq!(pre.iter().map(|&(_, st)| st).collect::<Vec<_>>(), [5, 7]);
        s.note_capturing(5);
        s.note_capturing(7);
        let e = s.event_record(5).unwrap_err();
        assert!(e.message.contains("capturing a CUDA graph"), "{e}");
        assert!(s.stream_wait_event(7, before).is_err());
        // On stream 7 an event stands for the work queued before the capture: the host waits
        // for that, and the event reads as completed; nothing is recorded on the stream.
        let during = s.event_record(7).unwrap();
        assert!(ctl.take_recorded().is_empty());
        assert!(
            s.event_query(pre[1].0).unwrap(),
            "the pre-capture work was waited for"
        );
        assert!(s.event_query(during).unwrap());
        // Other streams are unaffected.
        let other = s.event_record(6).unwrap();
        s.stream_wait_event(6, before).unwrap();
        assert!(!s.event_query(other).unwrap());
        s.clear_capturing();
        s.event_record(5).unwrap();
        for e in [before, during, other] {
            s.event_destroy(e);
        }
    }

    #[test]
    fn each_capture_waits_for_the_work_before_it_and_not_on_capturing_streams() {
        let (d, ctl) = manual_dev();
        let mut s = d.lock();
        // A first pool filled without a capture (a MemPool), then a capture begins: stream 7's
        // pre-capture event is recorded again, so that it covers the work queued in between.
        s.begin_capture(&[7]);
        let first = ctl.take_recorded();
        s.note_capturing(8);
        s.begin_capture(&[7, 8]);
        let second = ctl.take_recorded();
        assert_eq!(
            second.iter().map(|&(_, st)| st).collect::<Vec<_>>(),
            [7],
            "none on 8"
        );
        s.note_capturing(7);
        let e = s.event_record(7).unwrap();
        assert!(
            s.event_query(second[0].0).unwrap(),
            "waited for the newer event"
        );
        assert!(
            s.event_query(first[0].0).is_err(),
            "the older event was destroyed"
        );
        s.event_destroy(e);
        s.clear_capturing();
    }

    #[test]
    fn held_bytes_and_calls_are_counted() {
        let d = dev();
        let mut s = d.lock();
        let a = s.alloc_segment(20 * MIB, Pool::Large).unwrap();
        let h = s.create_page(Pool::Small).unwrap();
        assert_eq!(s.held(), 22 * MIB);
        s.free_segment(a, 20 * MIB, Pool::Large).unwrap();
        s.release_page(h, Pool::Small).unwrap();
        assert_eq!(s.held(), 0);
        assert_eq!(s.peak_held(), 22 * MIB);
        assert_eq!(s.calls().count(DriverCall::MemAlloc), 1);
        assert_eq!(s.calls().count(DriverCall::MemCreate), 1);
        // 65 µs for the alloc/free pair, 7.5 µs for create+release of one page.
        assert!((s.calls().est_seconds() - 72.5e-6).abs() < 1e-9);
        assert_eq!(s.held_stats().num_device_alloc, 2);
        assert_eq!(s.held_stats().segment.all.current, 0);
    }

    #[test]
    fn virtual_memory_calls_cost_per_handle_not_per_byte() {
        let d = dev();
        let mut s = d.lock();
        let va = s.address_reserve(64 * MIB, 0, Pool::Large).unwrap();
        let before = s.calls().est_seconds();
        // One 32 MiB handle: one create, one map, access over one handle.
        let big = s.create_chunk(32 * MIB, Pool::Large).unwrap();
        s.map(va, 32 * MIB, big).unwrap();
        s.set_access(va, 32 * MIB, 1).unwrap();
        let one = s.calls().est_seconds() - before;
        // The same bytes as sixteen 2 MiB pages: sixteen of each.
        let mid = s.calls().est_seconds();
        for i in 0..16 {
            let h = s.create_page(Pool::Large).unwrap();
            s.map(va + 32 * MIB + i * 2 * MIB, 2 * MIB, h).unwrap();
        }
        s.set_access(va + 32 * MIB, 32 * MIB, 16).unwrap();
        let sixteen = s.calls().est_seconds() - mid;
        assert!((sixteen - 16.0 * one).abs() < 1e-12, "{one} vs {sixteen}");
        // Both count as 16 pages covered, for reports.
        assert_eq!(s.calls().pages(DriverCall::MemMap), 32);
        assert_eq!(s.calls().pages(DriverCall::SetAccess), 32);
    }

    #[test]
    fn cap_is_enforced() {
        let d = dev();
        let mut s = d.lock();
        s.set_cap(Some(30 * MIB));
        s.alloc_segment(20 * MIB, Pool::Large).unwrap();
        let e = s.alloc_segment(20 * MIB, Pool::Large).unwrap_err();
        assert!(e.out_of_memory);
        assert!(e.message.contains("cap"));
    }

    #[test]
    fn reserve_serves_segments_without_driver_calls() {
        let d = dev();
        let mut s = d.lock();
        s.preallocate(64 * MIB, true).unwrap();
        assert_eq!(s.held(), 64 * MIB);
        let a = s.alloc_segment(20 * MIB, Pool::Large).unwrap();
        let b = s.alloc_segment(20 * MIB, Pool::Large).unwrap();
        assert_eq!(
            s.calls().count(DriverCall::MemAlloc),
            1,
            "only the preallocation"
        );
        s.free_segment(a, 20 * MIB, Pool::Large).unwrap();
        s.free_segment(b, 20 * MIB, Pool::Large).unwrap();
        assert_eq!(s.reserve_unused(), 64 * MIB, "ranges coalesce back");
        assert_eq!(s.held(), 64 * MIB);
    }

    #[test]
    fn segment_trace_keeps_events_and_coalesced_mappings() {
        let d = dev();
        let mut s = d.lock();
        s.trace_segments(true);
        let seg = s.alloc_segment(4 * MIB, Pool::Large).unwrap();
        let va = s.address_reserve(64 * MIB, 0, Pool::Large).unwrap();
        let pages: Vec<_> = (0..3)
            .map(|_| s.create_page(Pool::Large).unwrap())
            .collect();
        for (i, &h) in pages.iter().enumerate() {
            s.map(va + i as u64 * 2 * MIB, 2 * MIB, h).unwrap();
        }
        assert_eq!(
            s.mapped_ranges(),
            vec![(va, 6 * MIB)],
            "adjacent maps coalesce"
        );
        s.unmap(va + 2 * MIB, 2 * MIB, 1).unwrap();
        assert_eq!(
            s.mapped_ranges(),
            vec![(va, 2 * MIB), (va + 4 * MIB, 2 * MIB)],
            "an unmap in the middle splits the range"
        );
        s.free_segment(seg, 4 * MIB, Pool::Large).unwrap();
        let ev = s.take_segment_events();
        let kinds: Vec<_> = ev.iter().map(|e| (e.action, e.addr, e.bytes)).collect();
        assert_eq!(kinds[0], (SegmentAction::Alloc, seg, 4 * MIB));
        assert_eq!(kinds[1], (SegmentAction::Map, va, 2 * MIB));
        assert_eq!(kinds[4], (SegmentAction::Unmap, va + 2 * MIB, 2 * MIB));
        assert_eq!(kinds[5], (SegmentAction::Free, seg, 4 * MIB));
        assert_eq!(ev.len(), 6);
        assert!(s.take_segment_events().is_empty(), "taken once");
    }
}
