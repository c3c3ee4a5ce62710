//! The allocator of one device: the public operations (allocate, free, record-stream,
//! empty-cache, stats), stream-ordered reuse through events, the out-of-memory retry, and the
//! split of state into one shard per stream so that threads on different streams never share
//! a lock on the hot path.

mod checkpoint;
pub mod pools;
pub mod streams;
pub mod track;

use crate::backend::{Backend, CallCounts, DevPtr, DeviceInfo, EventHandle, Stream};
use crate::config::Config;
use crate::device::{Device, SegmentAction};
use crate::error::{AllocError, BackendError, OomReport};
use crate::policy::{Placement, PolicyFactory, PolicyKind, SegmentInfo};
use crate::stats::MemoryStats;
pub use checkpoint::{CheckpointBlock, PoolCheckpoint, PoolRestore};
use parking_lot::Mutex;
pub use pools::PoolId;
use pools::{is_pool_key, Pools};
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use streams::StreamTable;
pub use streams::MAX_STREAMS;
use track::{Action, Tracker};

/// A block handed out: its address, its size after rounding, and the shard that owns it (so
/// that freeing it needs no search).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Device address.
    pub ptr: DevPtr,
    /// Bytes of the block (the request rounded up).
    pub size: u64,
    /// Stream it was allocated on.
    pub stream: Stream,
    shard: u32,
    handle: u32,
}

struct Pending {
    addr: DevPtr,
    events: Vec<EventHandle>,
    /// Streams whose events are still to be recorded: the block was freed while a capture was
    /// underway, when an event recorded on a capturing stream would become part of the graph
    /// and could not be queried. Recorded at the first poll after the captures end.
    deferred: Vec<Stream>,
}

struct ShardState {
    policy: Box<dyn crate::policy::Policy>,
    /// With `big_page`, while `policy` is the first tier's instance alone: the switch to the
    /// second tier (see `Engine::enter_tiers`).
    first_tier: Option<Arc<crate::policy::tiered::TierSwitch>>,
    /// Other streams each live block was used on (only blocks with such uses appear).
    uses: FxHashMap<DevPtr, Vec<Stream>>,
    /// Freed blocks waiting for events.
    pending: Vec<Pending>,
    retries: i64,
    ooms: i64,
    syncs: i64,
    /// A private pool in use (see [`pools`]): its cached memory is never released.
    kept: bool,
    /// A private pool's blocks: the stream each was allocated on (the pool's shard serves
    /// several), so that a use recorded on that stream is ignored as on a stream's own shard.
    /// Entries of freed blocks stay until their address is handed out again.
    owners: FxHashMap<DevPtr, Stream>,
}

/// The lock of a shard: a spin lock whose waiters yield the CPU. Uncontended (the common case:
/// one thread per stream) it costs one atomic exchange to lock and a plain store to unlock.
/// The shard lock is held across driver calls on slow paths; a second thread on the same
/// stream then yields until it is free.
type ShardLock<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;
type ShardGuard<'a> = spin::mutex::SpinMutexGuard<'a, ShardState, spin::relax::Yield>;

/// One stream's pool. Aligned to two cache lines so that threads working on neighbouring
/// streams of the table never write to the same line.
#[repr(align(128))]
struct Shard {
    stream: Stream,
    state: ShardLock<ShardState>,
}

/// The allocator of one device. Thread-safe; share it behind an `Arc`.
pub struct Allocator {
    device: Arc<Device>,
    factory: PolicyFactory,
    /// With `big_page`: the switch to the second tier.
    tiers: Option<Arc<crate::policy::tiered::TierSwitch>>,
    shards: StreamTable<Shard>,
    tracker: Option<Mutex<Tracker>>,
    config: Config,
    /// The first stream that allocated, and whether a second one has come since (see
    /// [`Allocator::note_new_stream`]).
    first_stream: Mutex<(Option<Stream>, bool)>,
    /// The cap as the fraction it was given as (`fraction:` or
    /// [`Allocator::set_memory_fraction`]), which the cap in bytes only approximates; `None`
    /// for a cap given in bytes, or none.
    cap_fraction: Mutex<Option<f64>>,
    /// The statistics at the last [`Allocator::reset_accumulated_stats`], whose totals and
    /// counters [`Allocator::memory_stats`] subtracts (the policies' own only ever grow).
    accumulated_base: Mutex<Option<MemoryStats>>,
    /// Private pools (CUDA graphs' memory).
    pools: Mutex<Pools>,
    /// Pools being filled by a capture now. While any is, no event is recorded or queried and
    /// no memory is given back (see [`Allocator::begin_pool`]).
    filling: AtomicUsize,
}

impl Allocator {
    /// An allocator over `backend` configured by `config`; preallocates and sets the cap as
    /// configured.
    pub fn new(backend: Box<dyn Backend>, config: Config) -> Result<Self, AllocError> {
        let mut device = Device::new(backend, config.costs.clone());
        // Like the other stitched keys, `page:` means nothing to the other policies (expandable
        // maps PyTorch's 2 and 20 MiB pages, the rest plain segments), so that one
        // configuration can be given to every policy of a replay or a benchmark.
        if let (Some(page), PolicyKind::Stitched) = (config.page, config.policy) {
            device.set_page(page)?;
        }
        let device = Arc::new(device);
        let info = device.info().clone();
        // A preallocated reserve is made of the device's pages, which the second tier of
        // `big_page` does not use: with one, the pool keeps a single page size.
        let mut options = config.options.clone();
        if config.prealloc.is_some() {
            options.big_page = 0;
        }
        let factory = PolicyFactory::new(config.policy, &info, &options);
        {
            let mut d = device.lock();
            if let Some(cap) = config.cap {
                let bytes = cap.bytes(info.total_bytes);
                // Every policy takes memory in pieces of at least a page (2 MiB segments or
                // pages): a smaller cap would refuse every allocation.
                if bytes < info.page_bytes {
                    let given = match cap {
                        crate::config::Amount::Fraction(f) => {
                            format!(
                                "a fraction of {f:e} of the device's {} bytes",
                                info.total_bytes
                            )
                        }
                        crate::config::Amount::Bytes(b) => format!("{b} bytes"),
                    };
                    return Err(AllocError::Config(format!(
                        "a cap of {given} is less than one {}-byte page: it would refuse every \
                         allocation",
                        info.page_bytes
                    )));
                }
                d.set_cap(Some(bytes));
            }
            if let Some(pre) = config.prealloc {
                let mut bytes = pre.bytes(info.total_bytes);
                if config.policy.uses_pages() {
                    bytes = bytes / info.page_bytes * info.page_bytes;
                }
                if bytes > info.total_bytes {
                    return Err(AllocError::Config(format!(
                        "prealloc of {bytes} bytes is more than the device's {}",
                        info.total_bytes
                    )));
                }
                if let Some(cap) = d.cap().filter(|&c| bytes > c) {
                    return Err(AllocError::Config(format!(
                        "prealloc of {bytes} bytes is more than the cap of {cap} bytes"
                    )));
                }
                d.preallocate(bytes, !config.policy.uses_pages())?;
            }
        }
        let tracker = (config.history > 0 || config.leak_check).then(|| {
            Mutex::new(Tracker::new(
                config.history,
                config.leak_check,
                config.backtraces,
            ))
        });
        if config.history > 0 {
            // Snapshots need the segment events in the history and the mapped ranges.
            device.lock().trace_segments(true);
        }
        let cap_fraction = match config.cap {
            Some(crate::config::Amount::Fraction(f)) => Some(f),
            _ => None,
        };
        Ok(Self {
            device,
            tiers: factory.tiers(),
            factory,
            shards: StreamTable::new(),
            tracker,
            config,
            first_stream: Mutex::new((None, false)),
            cap_fraction: Mutex::new(cap_fraction),
            accumulated_base: Mutex::new(None),
            pools: Mutex::new(Pools::default()),
            filling: AtomicUsize::new(0),
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// What the device is.
    pub fn device_info(&self) -> &DeviceInfo {
        self.device.info()
    }

    /// The policy in use.
    pub fn policy(&self) -> PolicyKind {
        self.factory.kind()
    }

    /// What the policy changed on its own while running, one line each (see
    /// [`PolicyFactory::notes`]), after a line naming the page size when `page:` set one.
    pub fn policy_notes(&self) -> Vec<String> {
        // A page other than the device's granularity is said first: every figure of memory
        // held is in whole pages of that size (a replay's lower reference counts 2 MiB ones).
        let stitched = self.config.policy == PolicyKind::Stitched;
        let page = self.config.page.filter(|_| stitched).map(|p| {
            format!(
                "stitched: physical pages of {} (page:), each one handle, mapped and held whole",
                crate::units::format_size(p)
            )
        });
        page.into_iter()
            .chain(self.factory.notes())
            .chain(self.pools_note())
            .collect()
    }

    /// A line on the private pools (CUDA graphs' memory), if any exist: how many, how many
    /// graphs use them, and the memory they hold, which `empty_cache` cannot give back while
    /// they are used.
    fn pools_note(&self) -> Option<String> {
        let pools: Vec<(PoolId, Stream, u32)> = {
            let p = self.pools.lock();
            p.keys().map(|(id, key)| (id, key, p.users(id))).collect()
        };
        if pools.is_empty() {
            return None;
        }
        let (mut held, mut live, mut users) = (0u64, 0u64, 0u32);
        for &(_, key, u) in &pools {
            users += u;
            if let Some((_, sh)) = self.shards.get(key) {
                let st = sh.state.lock();
                let s = st.policy.stats();
                live += s.allocated_bytes.all.current.max(0) as u64;
                held += st.policy.segments().iter().map(|g| g.size).sum::<u64>();
            }
        }
        let f = crate::units::format_size;
        Some(format!(
            "private pools (CUDA graphs, MemPools): {} holding {} ({} of it in live tensors); {} \
             user(s): while a pool has users, empty_cache leaves its memory",
            pools.len(),
            f(held),
            f(live),
            users
        ))
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The shard of `stream`, made on its first use.
    #[inline]
    fn shard(&self, stream: Stream) -> Result<(u32, &Shard), AllocError> {
        match self.shards.get(stream) {
            Some((i, s)) => Ok((i as u32, s)),
            None => self.new_shard(stream),
        }
    }

    /// The shard of `stream` when it was not found: made, unless the table is full (or
    /// another thread made it meanwhile).
    #[cold]
    #[inline(never)]
    fn new_shard(&self, stream: Stream) -> Result<(u32, &Shard), AllocError> {
        let mut made = false;
        let found = self
            .shards
            .get_or_insert(stream, || {
                made = true;
                Shard {
                    stream,
                    state: ShardLock::new(ShardState {
                        policy: self.factory.make(stream),
                        first_tier: self.tiers.clone(),
                        uses: FxHashMap::default(),
                        pending: Vec::new(),
                        retries: 0,
                        ooms: 0,
                        syncs: 0,
                        kept: false,
                        owners: FxHashMap::default(),
                    }),
                }
            })
            .map(|(i, s)| (i as u32, s));
        if made {
            self.note_new_stream(stream);
        }
        found.ok_or(if stream == u64::MAX {
            AllocError::ReservedStream { stream }
        } else {
            AllocError::TooManyStreams { limit: MAX_STREAMS }
        })
    }

    /// A stream's shard was made (its first allocation comes next). At the second stream,
    /// the first stream's policy opens its pool to the device's streams: with the stitched
    /// policy's `range:auto`, its range becomes the one they all share, before the new
    /// stream places anything. (The first stream's shard is complete: it was noted after
    /// it was made.)
    fn note_new_stream(&self, stream: Stream) {
        let mut first = self.first_stream.lock();
        match *first {
            (None, _) => first.0 = Some(stream),
            (Some(f), false) if f != stream => {
                first.1 = true;
                if let Some((_, sh)) = self.shards.get(f) {
                    sh.state.lock().policy.open_range_to_streams();
                }
                // Shared from now on even if the first stream's policy had nothing to open.
                self.factory.streams_share_memory();
            }
            _ => {}
        }
    }

    /// Allocates `size` bytes for use on `stream`.
    ///
    /// The common case (a valid size, placed at the first try) is inlined into callers; bad
    /// sizes and failed placements go to out-of-line paths.
    #[inline]
    pub fn allocate(&self, size: u64, stream: Stream) -> Result<Allocation, AllocError> {
        if size == 0 || size > self.device.info().total_bytes {
            return Err(self.invalid_size(size, stream));
        }
        let (idx, shard) = self.shard(stream)?;
        match self.place(shard, size, false)? {
            Ok(p) => Ok(self.handed_out(p, size, stream, idx)),
            Err(e) => self.allocate_again(size, stream, idx, shard, e),
        }
    }

    /// One placement attempt on `shard` (a `retry` is counted), after releasing the freed
    /// blocks whose events have completed.
    #[inline]
    fn place(
        &self,
        shard: &Shard,
        size: u64,
        retry: bool,
    ) -> Result<Result<Placement, BackendError>, AllocError> {
        let mut st = shard.state.lock();
        if !st.pending.is_empty() {
            self.poll_events(&mut st, shard.stream, false)?;
        }
        let mut r = st.policy.allocate(size, &self.device);
        if let Some(sw) = st.first_tier.as_ref() {
            if sw.due() {
                Self::enter_tiers(&mut st, shard.stream, &mut r, size, &self.device);
            }
        }
        if retry {
            st.retries += 1;
        }
        Ok(r)
    }

    /// The switch to the second tier happened (`big_page`): from now on the shard's instance
    /// is wrapped in the tiers. Before, the first tier's instance serves the stream directly,
    /// so that a program that never holds `big_after` pays for the tiers one check of the
    /// bytes held per allocation. A stream that had not allocated since another one switched
    /// may have been refused by the first tier, which maps no page any more: `r` is then the
    /// tiers' answer.
    #[cold]
    #[inline(never)]
    fn enter_tiers(
        st: &mut ShardState,
        stream: Stream,
        r: &mut Result<Placement, BackendError>,
        size: u64,
        dev: &Device,
    ) {
        let Some(sw) = st.first_tier.take() else {
            return;
        };
        // An empty policy holds the place for the instant of the move.
        let first = std::mem::replace(
            &mut st.policy,
            Box::new(crate::policy::segmented::Segmented::caching(stream)),
        );
        st.policy = sw.wrap(stream, first);
        if matches!(r, Err(e) if e.out_of_memory) {
            *r = st.policy.allocate(size, dev);
        }
    }

    /// The allocation for placement `p`, tracked.
    #[inline]
    fn handed_out(&self, p: Placement, size: u64, stream: Stream, shard: u32) -> Allocation {
        if self.tracker.is_some() {
            self.track(Action::Alloc, p.addr, size, stream);
        }
        Allocation {
            ptr: p.addr,
            size: p.size,
            stream,
            shard,
            handle: p.handle,
        }
    }

    /// The error for a zero size or one larger than the device.
    #[cold]
    #[inline(never)]
    fn invalid_size(&self, size: u64, stream: Stream) -> AllocError {
        if size == 0 {
            return AllocError::InvalidSize {
                size,
                reason: "zero-byte allocations have no address; skip the call".into(),
            };
        }
        // No device could hold it: PyTorch counts this as an out-of-memory too.
        if let Ok((_, shard)) = self.shard(stream) {
            shard.state.lock().ooms += 1;
        }
        AllocError::InvalidSize {
            size,
            reason: format!(
                "larger than the whole device ({} bytes of {})",
                self.device.info().total_bytes,
                self.device.info().name
            ),
        }
    }

    /// After a first placement failed with `first`: out of memory is retried once after
    /// returning every cached block to the device, then reported; other errors are returned.
    #[cold]
    #[inline(never)]
    fn allocate_again(
        &self,
        size: u64,
        stream: Stream,
        idx: u32,
        shard: &Shard,
        first: BackendError,
    ) -> Result<Allocation, AllocError> {
        if !first.out_of_memory {
            return Err(first.into());
        }
        self.release_all_cached()?;
        match self.place(shard, size, true)? {
            Ok(p) => Ok(self.handed_out(p, size, stream, idx)),
            Err(e) if e.out_of_memory => {
                // During a capture the retry released nothing (see `release_all_cached`).
                let released = u64::from(!self.pools_filling());
                let report = self.oom_report(size, stream, released);
                shard.state.lock().ooms += 1;
                // As in PyTorch, an OOM entry carries the device's free bytes as its address.
                self.track(Action::Oom, report.device_free, size, stream);
                Err(AllocError::OutOfMemory(Box::new(report)))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn oom_report(&self, size: u64, stream: Stream, retries: u64) -> OomReport {
        let stats = self.memory_stats();
        // Only the requesting stream's free blocks could have served it.
        let largest = self
            .shards
            .get(stream)
            .map(|(_, s)| s.state.lock().policy.largest_free())
            .unwrap_or(0);
        let mut d = self.device.lock();
        let (free, total) = d
            .mem_get_info()
            .unwrap_or((0, self.device.info().total_bytes));
        let held = d.held();
        let allocated = stats.allocated_bytes.all.current.max(0) as u64;
        OomReport {
            requested: size,
            stream,
            policy: self.policy().name().to_string(),
            device_total: total,
            device_free: free,
            cap: d.cap(),
            held,
            allocated,
            cached: held.saturating_sub(allocated),
            largest_free_block: largest,
            retries,
            during_capture: self.pools_filling(),
        }
    }

    /// Checks the events of freed blocks; releases those whose events completed (all of them
    /// when `wait`, waiting on the host).
    fn poll_events(
        &self,
        st: &mut ShardState,
        stream: Stream,
        wait: bool,
    ) -> Result<(), BackendError> {
        if self.pools_filling() {
            // While a capture is underway an event may be neither queried nor waited on (one
            // recorded on a capturing stream is part of the graph): the blocks wait.
            return Ok(());
        }
        let dev = &*self.device;
        let mut i = 0;
        while i < st.pending.len() {
            let done = {
                let mut d = dev.lock();
                let p = &mut st.pending[i];
                // Freed during a capture: the events are recorded now that none is underway.
                while let Some(&s) = p.deferred.last() {
                    p.events.push(d.event_record(s)?);
                    p.deferred.pop();
                }
                let mut all = true;
                for &e in &st.pending[i].events {
                    if wait {
                        d.event_synchronize(e)?;
                    } else if !d.event_query(e)? {
                        all = false;
                        break;
                    }
                }
                if all {
                    for &e in &st.pending[i].events {
                        d.event_destroy(e);
                    }
                }
                all
            };
            if done {
                let p = st.pending.swap_remove(i);
                // Recorded before the release, which may return the block's segment.
                self.track(Action::FreeCompleted, p.addr, 0, stream);
                st.policy.release(p.addr, dev)?;
            } else {
                i += 1;
            }
        }
        if wait {
            st.syncs += 1;
        }
        Ok(())
    }

    /// Frees the block at `ptr` (searching every stream's pool for it).
    pub fn free(&self, ptr: DevPtr) -> Result<(), AllocError> {
        self.free_searching(ptr, None).map(drop)
    }

    /// Frees the block at `ptr`, which was allocated on `stream` (PyTorch's free hook passes
    /// it); falls back to a search if it was not. The common case takes the stream's lock
    /// once: the free itself is the lookup.
    #[inline]
    pub fn free_on(&self, ptr: DevPtr, stream: Stream) -> Result<(), AllocError> {
        self.free_on_sized(ptr, stream).map(drop)
    }

    /// [`Allocator::free_on`], returning the bytes of the block freed (its size as handed out:
    /// the request rounded up), as PyTorch's profiler is told of a free.
    pub fn free_on_sized(&self, ptr: DevPtr, stream: Stream) -> Result<u64, AllocError> {
        let tried = self.shards.get(stream);
        if let Some((_, sh)) = tried {
            if let Some(bytes) = self.try_free_in(sh, ptr, None)? {
                return Ok(bytes);
            }
        }
        self.free_searching(ptr, tried.map(|(i, _)| i))
    }

    /// Frees the block at `ptr` in whichever stream's pool holds it, skipping the pool at
    /// index `tried` (already asked); returns its bytes.
    fn free_searching(&self, ptr: DevPtr, tried: Option<usize>) -> Result<u64, AllocError> {
        for (i, sh) in self.shards.iter() {
            if Some(i) != tried {
                if let Some(bytes) = self.try_free_in(sh, ptr, None)? {
                    return Ok(bytes);
                }
            }
        }
        Err(self.not_live(ptr))
    }

    /// Frees an allocation returned by [`Allocator::allocate`].
    #[inline]
    pub fn free_allocation(&self, a: &Allocation) -> Result<(), AllocError> {
        match self.shards.slot(a.shard as usize) {
            // (A private pool's block was handed out on a stream, from the pool's shard.)
            Some(sh) if sh.stream == a.stream || is_pool_key(sh.stream) => {
                if self.try_free_in(sh, a.ptr, Some(a.handle))?.is_some() {
                    Ok(())
                } else {
                    Err(self.not_live(a.ptr))
                }
            }
            _ => Err(AllocError::UnknownPointer { ptr: a.ptr }),
        }
    }

    /// Frees the block at `ptr` if it is a live block of `shard`, returning its bytes;
    /// `Ok(None)`, with nothing changed, if it is not.
    #[inline]
    fn try_free_in(
        &self,
        shard: &Shard,
        ptr: DevPtr,
        handle: Option<u32>,
    ) -> Result<Option<u64>, AllocError> {
        let mut st = shard.state.lock();
        if st.uses.is_empty() && self.tracker.is_none() {
            // The common case: no block of the stream was used on another one and no history
            // is kept, so the block is reusable at once and the policy's free checks it.
            return Ok(match handle {
                Some(h) => st.policy.free_handle(h, ptr, &self.device)?,
                None => st.policy.free(ptr, &self.device)?,
            });
        }
        self.try_free_tracked(shard, st, ptr, handle)
    }

    /// [`Allocator::try_free_in`] when the stream has blocks used on other streams, or a
    /// history is kept: events first, then the free, recorded.
    #[inline(never)]
    fn try_free_tracked(
        &self,
        shard: &Shard,
        mut st: ShardGuard<'_>,
        ptr: DevPtr,
        handle: Option<u32>,
    ) -> Result<Option<u64>, AllocError> {
        let uses = if st.uses.is_empty() {
            None
        } else {
            st.uses.remove(&ptr)
        };
        // Before anything is recorded (events, history), the block must be the live one the
        // caller names. (Without uses or history the policy's free checks this itself.)
        if uses.is_some() || self.tracker.is_some() {
            let live = match handle {
                Some(h) => st.policy.is_allocated_handle(h, ptr),
                None => st.policy.is_allocated(ptr),
            };
            if !live {
                if let Some(u) = uses.filter(|_| st.policy.is_allocated(ptr)) {
                    st.uses.insert(ptr, u); // live under another handle: its uses stay
                }
                return Ok(None);
            }
        }
        // Used on other streams: an event on each of them first, so that if the driver
        // refuses one the block stays live, its uses recorded, and the free can be retried.
        let mut events = Vec::new();
        let mut deferred = Vec::new();
        if let Some(streams) = uses.as_ref().filter(|_| self.pools_filling()) {
            // No event may be recorded while a capture is underway: recorded at the first
            // poll after it (see `poll_events`), the block waiting until then.
            deferred = streams.clone();
        } else if let Some(streams) = uses.as_ref() {
            let mut d = self.device.lock();
            for &s in streams {
                match d.event_record(s) {
                    Ok(e) => events.push(e),
                    Err(e) => {
                        for ev in events {
                            d.event_destroy(ev);
                        }
                        drop(d);
                        st.uses.insert(ptr, uses.expect("checked above"));
                        return Err(e.into());
                    }
                }
            }
        }
        if self.tracker.is_some() {
            // Recorded before the release, which may return the block's segment.
            self.track(Action::FreeRequested, ptr, 0, shard.stream);
            if uses.is_none() {
                self.track(Action::FreeCompleted, ptr, 0, shard.stream);
            }
        }
        let freed = match uses {
            // Used on no other stream: reusable at once.
            None => match handle {
                Some(h) => st.policy.free_handle(h, ptr, &self.device)?,
                None => st.policy.free(ptr, &self.device)?,
            },
            Some(_) => st.policy.free_requested(ptr, &self.device),
        };
        if freed.is_some() && uses.is_some() {
            st.pending.push(Pending {
                addr: ptr,
                events,
                deferred,
            });
        }
        Ok(freed)
    }

    /// The error for `ptr`, which is no live block: a double free if it starts a cached block
    /// of any stream, else a pointer gpumem never handed out.
    fn not_live(&self, ptr: DevPtr) -> AllocError {
        let double = self
            .shards
            .iter()
            .any(|(_, sh)| sh.state.lock().policy.is_free_block(ptr));
        if double {
            AllocError::DoubleFree { ptr }
        } else {
            AllocError::UnknownPointer { ptr }
        }
    }

    /// Marks the block at `ptr` as used on `stream` too: when freed, it is reused only after
    /// the work queued on `stream` by then has completed.
    pub fn record_stream(&self, ptr: DevPtr, stream: Stream) -> Result<(), AllocError> {
        // The use is recorded under the same lock that found the block live, so a free on
        // another thread cannot come between (a use recorded after it would outlive it).
        for (_, sh) in self.shards.iter() {
            let mut st = sh.state.lock();
            if !st.policy.is_allocated(ptr) {
                continue;
            }
            let own = sh.stream == stream
                || (is_pool_key(sh.stream) && st.owners.get(&ptr) == Some(&stream));
            if !own {
                let uses = st.uses.entry(ptr).or_default();
                if !uses.contains(&stream) {
                    uses.push(stream);
                }
            }
            return Ok(());
        }
        Err(self.not_live(ptr))
    }

    /// Releases the freed blocks whose stream events have completed (without waiting for the
    /// others). Allocation does this on its own stream; this does it for all streams.
    pub fn process_events(&self) -> Result<(), AllocError> {
        for (_, sh) in self.shards.iter() {
            let mut st = sh.state.lock();
            if !st.pending.is_empty() {
                self.poll_events(&mut st, sh.stream, false)?;
            }
        }
        Ok(())
    }

    /// Waits for every outstanding event and releases those blocks.
    pub fn synchronize_events(&self) -> Result<(), AllocError> {
        for (_, sh) in self.shards.iter() {
            let mut st = sh.state.lock();
            if !st.pending.is_empty() {
                self.poll_events(&mut st, sh.stream, true)?;
            }
        }
        Ok(())
    }

    /// Returns every cached byte no live block uses to the device, except what private pools
    /// in use hold; then forgets the unused pools left empty. Nothing while a capture is
    /// underway (the driver refuses frees and event waits then).
    fn release_all_cached(&self) -> Result<u64, AllocError> {
        if self.pools_filling() {
            return Ok(0);
        }
        self.synchronize_events()?;
        let mut freed = 0;
        for (_, sh) in self.shards.iter() {
            let mut st = sh.state.lock();
            if !st.kept {
                freed += st.policy.release_cached(&self.device)?;
            }
        }
        self.retire_pools();
        Ok(freed)
    }

    /// Returns to the device the cached memory of private pool `id` alone, if no one uses it
    /// any more (PyTorch's `emptyCache(mempool_id)`, which a `torch.cuda.MemPool`'s destructor
    /// calls), and forgets it if that leaves it empty. Returns the bytes released: 0 for a pool
    /// still in use or unknown, and while a capture is underway.
    pub fn empty_pool_cache(&self, id: PoolId) -> Result<u64, AllocError> {
        if self.pools_filling() {
            return Ok(0);
        }
        let Some(key) = self.pools.lock().key_of(id) else {
            return Ok(0);
        };
        let Some((_, sh)) = self.shards.get(key) else {
            return Ok(0);
        };
        let freed = {
            let mut st = sh.state.lock();
            if st.kept {
                return Ok(0);
            }
            if !st.pending.is_empty() {
                self.poll_events(&mut st, sh.stream, true)?;
            }
            st.policy.release_cached(&self.device)?
        };
        self.retire_pools();
        Ok(freed)
    }

    /// Forgets the private pools no one uses whose shards hold nothing any more.
    fn retire_pools(&self) {
        let mut pools = self.pools.lock();
        for (id, key) in pools.unused() {
            if let Some((_, sh)) = self.shards.get(key) {
                let st = sh.state.lock();
                if st.pending.is_empty() && st.policy.segments().is_empty() {
                    pools.retire(id);
                }
            }
        }
    }

    /// Returns every cached byte that no live block uses to the device
    /// (`torch.cuda.empty_cache`). Returns the bytes released.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        self.release_all_cached()
    }

    /// The largest request that can be met now without running out of memory, by the
    /// policy's own measure ([`crate::policy::Policy::largest_obtainable`]): a free block as
    /// it is or the device's free bytes within the cap (a new segment), or, for the stitched
    /// policy, the pool's idle pages and the device's free bytes together. What PyTorch's
    /// `cacheInfo` reports, which cuDNN sizes its workspaces by when
    /// `torch.backends.cudnn.benchmark` is on. An estimate, as PyTorch's own: requests are
    /// rounded up, and a segment policy may free more by giving back whole cached segments.
    pub fn largest_obtainable(&self) -> u64 {
        let fresh = {
            let mut d = self.device.lock();
            let (free, _) = d.mem_get_info().unwrap_or((0, 0));
            let room = d.cap().map_or(u64::MAX, |cap| cap.saturating_sub(d.held()));
            free.min(room)
        };
        self.shards
            .iter()
            .map(|(_, sh)| sh.state.lock().policy.largest_obtainable(fresh))
            .max()
            .unwrap_or(fresh)
    }

    /// The most this allocator may hold (its cap, or the device's total bytes without one)
    /// and the device's free bytes now: what PyTorch tells its out-of-memory observers.
    pub fn limit_and_free(&self) -> (u64, u64) {
        let total = self.device_info().total_bytes;
        let mut d = self.device.lock();
        let (free, _) = d.mem_get_info().unwrap_or((0, total));
        (d.cap().unwrap_or(total), free)
    }

    /// Statistics under PyTorch's names. Block statistics are summed over streams (peaks too:
    /// with several streams allocating, the peak shown is an upper bound); physical memory
    /// statistics are exact.
    pub fn memory_stats(&self) -> MemoryStats {
        let mut m = self.memory_stats_since_start();
        if let Some(base) = self.accumulated_base.lock().as_ref() {
            m.since(base);
        }
        m
    }

    /// Zeroes the `allocated`/`freed` totals and the counters of [`Allocator::memory_stats`]
    /// (`torch.cuda.reset_accumulated_memory_stats`); current values and peaks stay.
    pub fn reset_accumulated_stats(&self) {
        let mut base = self.accumulated_base.lock();
        *base = Some(self.memory_stats_since_start());
    }

    /// [`Allocator::memory_stats`] counted from the allocator's start.
    fn memory_stats_since_start(&self) -> MemoryStats {
        let mut m = MemoryStats::default();
        for (_, sh) in self.shards.iter() {
            let st = sh.state.lock();
            m.merge_blocks(&st.policy.stats());
            m.num_alloc_retries += st.retries;
            m.num_ooms += st.ooms;
            m.num_sync_all_streams += st.syncs;
        }
        let d = self.device.lock();
        let h = d.held_stats();
        m.segment = h.segment;
        m.reserved_bytes = h.reserved_bytes;
        m.num_device_alloc = h.num_device_alloc;
        m.num_device_free = h.num_device_free;
        m
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        for (_, sh) in self.shards.iter() {
            sh.state.lock().policy.reset_peaks();
        }
        self.device.lock().reset_peak();
    }

    /// Caps the memory held at `fraction` of the device
    /// (`torch.cuda.set_per_process_memory_fraction`).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(AllocError::Config(format!(
                "memory fraction {fraction} is not in (0, 1]"
            )));
        }
        let total = self.device.info().total_bytes;
        let mut given = self.cap_fraction.lock();
        self.device
            .lock()
            .set_cap(Some((total as f64 * fraction) as u64));
        *given = Some(fraction);
        Ok(())
    }

    /// Caps the memory held at `bytes` (`None`: no cap).
    pub fn set_cap(&self, bytes: Option<u64>) {
        let mut given = self.cap_fraction.lock();
        self.device.lock().set_cap(bytes);
        *given = None;
    }

    /// The cap as a fraction of the device (1 without one), as it was given:
    /// `torch.cuda.get_per_process_memory_fraction`.
    pub fn memory_fraction(&self) -> f64 {
        if let Some(f) = *self.cap_fraction.lock() {
            return f;
        }
        let total = self.device.info().total_bytes;
        match self.device.lock().cap() {
            Some(cap) if total > 0 => (cap as f64 / total as f64).min(1.0),
            _ => 1.0,
        }
    }

    /// Driver calls made so far.
    pub fn driver_calls(&self) -> CallCounts {
        self.device.lock().calls().clone()
    }

    /// Bytes held from the device now.
    pub fn held_bytes(&self) -> u64 {
        self.device.lock().held()
    }

    /// Most bytes held from the device so far.
    pub fn peak_held_bytes(&self) -> u64 {
        self.device.lock().peak_held()
    }

    /// Segments and blocks of every stream, by address. A private pool's segments carry its
    /// shard key as their stream (see [`Allocator::private_pool_of`]).
    pub fn snapshot(&self) -> Vec<SegmentInfo> {
        let mut v: Vec<SegmentInfo> = self
            .shards
            .iter()
            .flat_map(|(_, sh)| sh.state.lock().policy.segments())
            .collect();
        v.sort_by_key(|s| s.addr);
        v
    }

    /// Streams seen so far.
    pub fn streams(&self) -> Vec<Stream> {
        self.shards
            .iter()
            .map(|(_, s)| s.stream)
            .filter(|&s| !is_pool_key(s))
            .collect()
    }

    /// Records an event in the tracker, if any, after the segment events that preceded it.
    /// Lock order: tracker, then device (the device never takes the tracker's lock).
    fn track(&self, action: Action, addr: DevPtr, size: u64, stream: Stream) {
        if let Some(t) = &self.tracker {
            let mut t = t.lock();
            self.collect_segment_events(&mut t);
            t.record(action, addr, size, stream);
        }
    }

    fn collect_segment_events(&self, t: &mut Tracker) {
        for e in self.device.lock().take_segment_events() {
            let action = match e.action {
                SegmentAction::Alloc => Action::SegmentAlloc,
                SegmentAction::Free => Action::SegmentFree,
                SegmentAction::Map => Action::SegmentMap,
                SegmentAction::Unmap => Action::SegmentUnmap,
            };
            // Plain segments' streams are inferred by the snapshot; mappings carry theirs.
            let stream = e.owner.map_or(0, |(s, _)| s);
            t.record_at(action, e.addr, e.bytes, stream, e.time_us);
        }
    }

    /// Runs `f` on the tracker, if history or leak tracking is on. `f` must not call back
    /// into the allocator (the tracker stays locked while it runs).
    pub fn with_tracker<R>(&self, f: impl FnOnce(&Tracker) -> R) -> Option<R> {
        self.tracker.as_ref().map(|t| {
            let mut t = t.lock();
            self.collect_segment_events(&mut t);
            f(&t)
        })
    }

    /// Starts filling private pool `id`, made on its first use, which gains a user (PyTorch's
    /// `beginAllocateToPool`, called as a CUDA graph capture begins). Until
    /// [`Allocator::end_pool`], [`Allocator::allocate_in_pool`] serves from it. While any pool
    /// is being filled, no event is recorded or queried and no memory is given back to the
    /// device, which a capture forbids: frees of blocks used on other streams wait, and an
    /// allocation that finds no room fails without emptying the cache.
    ///
    /// A pool's memory is its own until its last user is gone ([`Allocator::release_pool`]):
    /// blocks freed in it are reused only by allocations in it, and
    /// [`Allocator::empty_cache`] leaves it.
    pub fn begin_pool(&self, id: PoolId) -> Result<(), AllocError> {
        let mut pools = self.pools.lock();
        let key = pools.begin(id).map_err(AllocError::Pool)?;
        if let Err(e) = self.keep_pool_shard(&mut pools, id, key) {
            let _ = pools.end(id); // (an error if the pool was forgotten: nothing to end)
            return Err(e);
        }
        self.filling.fetch_add(1, Ordering::AcqRel);
        let streams = self.streams();
        self.device.lock().begin_capture(&streams);
        Ok(())
    }

    /// One more user of private pool `id`, made on first use, without filling it (PyTorch's
    /// `createOrIncrefPool`, which a `torch.cuda.MemPool` calls when made; its
    /// `use_mem_pool` then fills it through [`Allocator::begin_pool`], and it lets go of it
    /// with [`Allocator::release_pool`]).
    pub fn retain_pool(&self, id: PoolId) -> Result<(), AllocError> {
        let mut pools = self.pools.lock();
        let key = pools.retain(id).map_err(AllocError::Pool)?;
        self.keep_pool_shard(&mut pools, id, key)
    }

    /// Marks the shard of pool `id` (key `key`), made if new, as kept; if the stream table has
    /// no room for it, the user just added to the pool is taken back, and the pool forgotten if
    /// that was its only one.
    fn keep_pool_shard(
        &self,
        pools: &mut Pools,
        id: PoolId,
        key: Stream,
    ) -> Result<(), AllocError> {
        match self.pool_shard(key) {
            Ok((_, sh)) => {
                sh.state.lock().kept = true;
                Ok(())
            }
            Err(e) => {
                if let Ok((_, false)) = pools.release(id) {
                    pools.retire(id);
                }
                Err(e)
            }
        }
    }

    /// The capture filling private pool `id` ended (PyTorch's `endAllocateToPool`); the pool
    /// keeps its user until [`Allocator::release_pool`].
    pub fn end_pool(&self, id: PoolId) -> Result<(), AllocError> {
        let mut pools = self.pools.lock();
        pools.end(id).map_err(AllocError::Pool)?;
        if self.filling.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.device.lock().clear_capturing();
        }
        Ok(())
    }

    /// A user of private pool `id` is gone (PyTorch's `releasePool`, when a graph is
    /// destroyed). With the last one, the pool's cached memory is given back at the next
    /// [`Allocator::empty_cache`] or out-of-memory retry, and its blocks still live return it
    /// when freed.
    pub fn release_pool(&self, id: PoolId) -> Result<(), AllocError> {
        let mut pools = self.pools.lock();
        let (key, in_use) = pools.release(id).map_err(AllocError::Pool)?;
        if !in_use {
            if let Some((_, sh)) = self.shards.get(key) {
                sh.state.lock().kept = false;
            }
        }
        Ok(())
    }

    /// Users of private pool `id` (0 if there is no such pool): PyTorch's `getPoolUseCount`.
    pub fn pool_use_count(&self, id: PoolId) -> u32 {
        self.pools.lock().users(id)
    }

    /// The private pool whose shard has stream-table key `key` (the `stream` of its segments
    /// in [`Allocator::snapshot`]), with the first stream that allocated in it.
    pub fn private_pool_of(&self, key: Stream) -> Option<(PoolId, Option<Stream>)> {
        if !is_pool_key(key) {
            return None;
        }
        self.pools.lock().of_key(key)
    }

    /// Private pools that exist (in use, or unused but still holding memory).
    pub fn pool_count(&self) -> usize {
        self.pools.lock().len()
    }

    /// Whether a capture is filling a private pool now: the one check an allocation hook makes
    /// before asking which pool, if any, a request belongs to.
    #[inline]
    pub fn pools_filling(&self) -> bool {
        self.filling.load(Ordering::Acquire) != 0
    }

    /// Allocates `size` bytes for use on `stream` from private pool `id`, which a capture must
    /// be filling ([`Allocator::begin_pool`]). Freed, the block returns to the pool.
    pub fn allocate_in_pool(
        &self,
        size: u64,
        stream: Stream,
        id: PoolId,
    ) -> Result<Allocation, AllocError> {
        if size == 0 || size > self.device.info().total_bytes {
            return Err(self.invalid_size(size, stream));
        }
        let key = self.pools.lock().filling_key(id, stream).ok_or_else(|| {
            AllocError::Pool(format!(
                "private pool ({}, {}) is not being filled by a capture",
                id.0, id.1
            ))
        })?;
        let (idx, shard) = self.pool_shard(key)?;
        // The stream is capturing: no event may be recorded on it until the capture ends.
        self.device.lock().note_capturing(stream);
        let a = match self.place(shard, size, false)? {
            Ok(p) => self.handed_out(p, size, stream, idx),
            Err(e) => self.allocate_again(size, stream, idx, shard, e)?,
        };
        shard.state.lock().owners.insert(a.ptr, stream);
        Ok(a)
    }

    /// The shard of the private pool under `key`, made on first use: always the caching
    /// policy over plain segments, whatever the configured policy (see [`pools`]).
    fn pool_shard(&self, key: Stream) -> Result<(u32, &Shard), AllocError> {
        self.shards
            .get_or_insert(key, || Shard {
                stream: key,
                state: ShardLock::new(ShardState {
                    policy: Box::new(crate::policy::segmented::Segmented::caching(key)),
                    first_tier: None,
                    uses: FxHashMap::default(),
                    pending: Vec::new(),
                    retries: 0,
                    ooms: 0,
                    syncs: 0,
                    kept: true,
                    owners: FxHashMap::default(),
                }),
            })
            .map(|(i, s)| (i as u32, s))
            .ok_or(AllocError::TooManyStreams { limit: MAX_STREAMS })
    }

    /// Checks every policy's invariants (tests and fuzzing).
    pub fn check(&self) -> Result<(), String> {
        for (_, sh) in self.shards.iter() {
            sh.state.lock().policy.check()?;
        }
        Ok(())
    }
}
