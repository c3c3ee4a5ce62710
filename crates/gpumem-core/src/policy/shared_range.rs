//! The stitched policy with one virtual range shared by a device's streams (`range:shared`;
//! with `range:auto`, the default, once a second stream allocates: until then the first
//! stream places its blocks in a range of its own, which then becomes the shared one).
//!
//! With `range:stream` each stream places its blocks in a virtual range of its own, so blocks of
//! different streams never share a 2 MiB page: a server whose five threads each keep a few
//! small blocks live holds a partly used page per thread and per gap (1.05 of live on the
//! server trace, against 1.03 for best fit in one range; docs/stitched.md). Here every stream
//! places its blocks in one range, under one lock, blocks of at most 64 KiB go to the end of their
//! free block that touches fewer untouched pages, and three rules keep stream order:
//!
//! - Bytes a stream freed are remembered with the stream and the pool epoch of the free
//!   (`dirty`) until another stream takes them. That stream first waits, on the device, for an
//!   event the first stream recorded after the free (or a fresh one), unless the event has
//!   already completed. Once taken, the bytes are the taker's; its own free stamps them again.
//!   (cudaMallocAsync's pools hand blocks between streams the same way.)
//! - A physical page moved to another virtual page, or a virtual page unmapped, waits for
//!   every stream that freed anything before the page went idle (see
//!   `stitched::Order::Shared`).
//! - The rest of a page that moved counts as freed by the stream that took it, just then: the
//!   records are by address, and the page's bytes carry their history to the new address.
//!
//! While only one stream has allocated, none of this is kept: its handle places blocks as a
//! range of its own would, plus the lock. When a second stream comes, every block then live
//! is filed as the first stream's, and every byte counts as freed by it just then.
//!
//! Each stream's engine shard holds a [`SharedStitched`], a handle on the one [`SharedCore`].
//! The first handle made reports the range's statistics and segments, and releases its cached
//! memory, so that the engine's passes over its shards count and do them once.
//!
//! A stream whose operations spend a quarter of their time waiting for the one lock spills:
//! from then on its allocations go to a range of its own on the same page pool, and once all
//! the others have, so does the last stream left (see [`Spill`]). The shared range may take
//! an own range's idle pages, never the reverse.

use super::freed_ranges::{Freed, FreedRanges};
use super::stitched::{Order, PagePool, Stitched};
use super::{Placement, Policy, SegmentInfo};
use crate::backend::{DevPtr, EventHandle, Stream};
use crate::device::{Device, DeviceState};
use crate::error::BackendError;
use crate::stats::{BlockCurrents, MemoryStats};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Events kept per stream (the oldest is destroyed when a new one comes).
const EVENTS_KEPT: usize = 64;

/// Freed ranges remembered before the ones whose streams are known done are first dropped
/// (after that, whenever their number has doubled since the last time).
const DIRTY_PRUNE_AT: usize = 4096;

/// `SharedCore::owner`'s entry for a block id no stream has placed a block at.
const NO_OWNER: u32 = u32::MAX;

/// What a waiting call waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// The host (before an unmap: the device must be done with the virtual page).
    Host,
    /// This stream, on the device (before it uses memory another stream used).
    Device(Stream),
}

/// One stream's place in the shared range's history.
struct Clock {
    stream: Stream,
    /// Events recorded on the stream, with the pool epoch each was recorded at.
    events: VecDeque<(u64, EventHandle)>,
    /// The stream's work queued before this epoch is known done (an event recorded at it
    /// completed).
    done: u64,
    /// Pool epoch of the stream's latest free, if it freed anything.
    last_free: Option<u64>,
}

/// Every stream's events, for the waits of a shared range.
#[derive(Default)]
pub(crate) struct StreamClocks {
    clocks: Vec<Clock>,
}

impl StreamClocks {
    fn add(&mut self, stream: Stream) -> u32 {
        self.clocks.push(Clock {
            stream,
            events: VecDeque::new(),
            done: 0,
            last_free: None,
        });
        (self.clocks.len() - 1) as u32
    }

    /// The stream with index `i`.
    pub(crate) fn stream(&self, i: u32) -> Stream {
        self.clocks[i as usize].stream
    }

    fn freed(&mut self, i: u32, stamp: u64) {
        let last = &mut self.clocks[i as usize].last_free;
        *last = Some(last.map_or(stamp, |l| l.max(stamp)));
    }

    /// Whether stream `t`'s work queued before pool epoch `stamp` is known done.
    fn is_done(&self, t: u32, stamp: u64) -> bool {
        stamp < self.clocks[t as usize].done
    }

    /// Keeps event `ev`, recorded on stream `i` at pool epoch `epoch`.
    fn keep(&mut self, d: &mut DeviceState, i: u32, epoch: u64, ev: EventHandle) {
        let c = &mut self.clocks[i as usize];
        c.events.push_back((epoch, ev));
        if c.events.len() > EVENTS_KEPT {
            if let Some((_, old)) = c.events.pop_front() {
                d.event_destroy(old);
            }
        }
    }

    /// Records an event on stream `i` at pool epoch `epoch` (the end of a slow path), for
    /// later waits. Best effort: without it a later wait records a fresh event.
    pub(crate) fn mark(&mut self, d: &mut DeviceState, i: u32, epoch: u64) {
        if let Ok(ev) = d.event_record(self.stream(i)) {
            self.keep(d, i, epoch, ev);
        }
    }

    /// Makes `wait` come after stream `t`'s work queued before pool epoch `stamp` (a free
    /// stamped then): nothing if that is known done; else the first event `t` recorded after
    /// it, or a fresh one, is queried, and waited for if it has not completed.
    fn settle(
        &mut self,
        d: &mut DeviceState,
        pool: &PagePool,
        t: u32,
        stamp: u64,
        wait: Wait,
    ) -> Result<(), BackendError> {
        if self.is_done(t, stamp) {
            return Ok(());
        }
        let c = &self.clocks[t as usize];
        let (epoch, ev) = match c.events.iter().find(|&&(e, _)| e > stamp) {
            Some(&found) => found,
            None => {
                let epoch = pool.next_epoch();
                let ev = d.event_record(c.stream)?;
                self.keep(d, t, epoch, ev);
                (epoch, ev)
            }
        };
        let c = &mut self.clocks[t as usize];
        if d.event_query(ev)? {
            c.done = c.done.max(epoch);
            return Ok(());
        }
        match wait {
            Wait::Host => {
                d.event_synchronize(ev)?;
                c.done = c.done.max(epoch);
            }
            Wait::Device(s) => d.stream_wait_event(s, ev)?,
        }
        Ok(())
    }

    /// [`Self::settle`] for every stream (but `except`) that freed something, up to the
    /// earlier of `stamp` and its last free: what any of them did on a page that went idle
    /// at `stamp`.
    pub(crate) fn settle_all(
        &mut self,
        d: &mut DeviceState,
        pool: &PagePool,
        stamp: u64,
        wait: Wait,
        except: Option<u32>,
    ) -> Result<(), BackendError> {
        for t in 0..self.clocks.len() as u32 {
            if Some(t) == except {
                continue;
            }
            if let Some(last) = self.clocks[t as usize].last_free {
                self.settle(d, pool, t, stamp.min(last), wait)?;
            }
        }
        Ok(())
    }

    /// Waits on the host for all the work queued on every stream.
    fn sync_all(&mut self, d: &mut DeviceState, pool: &PagePool) -> Result<(), BackendError> {
        for t in 0..self.clocks.len() as u32 {
            let epoch = pool.next_epoch();
            let ev = d.event_record(self.stream(t))?;
            let waited = d.event_synchronize(ev);
            d.event_destroy(ev);
            waited?;
            let c = &mut self.clocks[t as usize];
            c.done = c.done.max(epoch);
        }
        Ok(())
    }
}

/// The one range and what the streams need to share it.
pub struct SharedCore {
    pool: Arc<PagePool>,
    va_bytes: u64,
    /// The range's placement and pages (made when the first stream comes).
    range: Option<Stitched>,
    clocks: StreamClocks,
    /// The range's block id -> the stream index that allocated it, set when a block is
    /// placed (frees go through its handle, and a handle answers only for its stream's
    /// blocks, as a per-stream pool does). Indexed by block id rather than keyed by address,
    /// so that a free through its handle checks it without a lookup. Entries of ids with no
    /// live block are stale; whatever they say, the range itself refuses a free through such
    /// an id.
    owner: Vec<u32>,
    /// Blocks freed while used on other streams: address -> size and the pool epoch of the
    /// free, until the engine releases them.
    pending: FxHashMap<DevPtr, (u64, u64)>,
    /// Freed bytes another stream must wait for before using. Disjoint.
    dirty: FreedRanges,
    /// Several streams have come: `owner` and `dirty` are kept.
    shared: bool,
    /// Size of `dirty` at which the records known done are dropped.
    prune_at: usize,
    /// Scratch list of `Order::Shared`'s `moved_in`.
    moved_in: Vec<u32>,
    /// Scratch list of `take_bytes`: each other stream to wait for, with its latest free there.
    waits: Vec<(u32, u64)>,
}

impl SharedCore {
    /// The core of a device whose pages come from `pool`, placing in `va_bytes` of virtual
    /// space.
    pub fn new(pool: Arc<PagePool>, va_bytes: u64) -> Self {
        Self {
            pool,
            va_bytes,
            range: None,
            clocks: StreamClocks::default(),
            owner: Vec::new(),
            pending: FxHashMap::default(),
            dirty: FreedRanges::default(),
            shared: false,
            prune_at: DIRTY_PRUNE_AT,
            moved_in: Vec::new(),
            waits: Vec::new(),
        }
    }

    /// Stream `stream` comes: its index. With the second stream, the owners and freed bytes
    /// start being kept: the blocks live now are the first stream's, and all the range's
    /// bytes count as freed by it now (so the new stream's first use of any of them waits
    /// for what the first stream queued until then).
    fn join(&mut self, stream: Stream) -> u32 {
        let me = self.clocks.add(stream);
        if me == 0 {
            let range = Stitched::new(stream, self.pool.clone(), self.va_bytes);
            self.range = Some(range.page_aware().keeps_pages());
        } else if me == 1 {
            self.shared = true;
            let stamp = self.pool.epoch_now();
            self.all_freed_by(0, stamp);
        }
        me
    }

    /// The range's live blocks are stream `me`'s, and all its bytes count as freed by `me` at
    /// pool epoch `stamp` (when the range starts being shared: nothing was recorded before).
    fn all_freed_by(&mut self, me: u32, stamp: u64) {
        let range = self.range.as_ref().expect("made with the first stream");
        let live: Vec<u32> = range
            .live_addrs()
            .filter_map(|a| range.live_at(a))
            .collect();
        for id in live {
            self.set_owner(id, me);
        }
        self.clocks.freed(me, stamp);
        self.dirty.clear();
        self.dirty.insert(
            0,
            Freed {
                end: u64::MAX,
                stream: me,
                stamp,
            },
        );
    }

    /// Stream `me`'s own range becomes the shared one (`range:auto`, when a second stream
    /// comes), in place of the range made at the first join, in which nothing was placed:
    /// the first stream's blocks (a model's weights) then share their pages with the other
    /// streams' instead of keeping pages of their own. Its live blocks are `me`'s, and all
    /// its bytes count as freed by `me` now, as at a second stream's join. `own` is left as
    /// it was if the shared range was used already.
    fn adopt(&mut self, me: u32, own: &mut Option<Stitched>) {
        if self.range.as_ref().is_some_and(|r| !r.is_unused()) {
            return;
        }
        let Some(mut range) = own.take() else {
            return;
        };
        range.become_shared();
        let stamp = self.pool.epoch_now();
        for (addr, size) in range.pending_blocks() {
            self.pending.insert(addr, (size, stamp));
        }
        self.range = Some(range);
        if self.shared {
            self.all_freed_by(me, stamp);
        }
    }

    fn range(&mut self) -> &mut Stitched {
        self.range
            .as_mut()
            .expect("made when the first stream came")
    }

    /// Forgets the freed records inside `[addr, end)` (the bytes now belong to stream `me`),
    /// after making `me` wait for the other streams that freed them. On error nothing is
    /// forgotten.
    fn take_bytes(
        &mut self,
        d: &mut DeviceState,
        me: u32,
        addr: u64,
        end: u64,
    ) -> Result<(), BackendError> {
        let Self {
            dirty,
            waits,
            clocks,
            pool,
            ..
        } = self;
        dirty.cut_after(addr, end, |over| {
            // One wait per other stream, for its latest free among the records: the event
            // that covers it covers the stream's earlier frees too (a stream's events complete
            // in order), so a wait per record would only repeat it.
            waits.clear();
            for &(_, r) in over {
                if r.stream == me {
                    continue;
                }
                match waits.iter_mut().find(|(t, _)| *t == r.stream) {
                    Some((_, stamp)) => *stamp = (*stamp).max(r.stamp),
                    None => waits.push((r.stream, r.stamp)),
                }
            }
            let to = Wait::Device(clocks.stream(me));
            for &(t, stamp) in waits.iter() {
                clocks.settle(d, pool, t, stamp, to)?;
            }
            Ok(())
        })
    }

    /// Stream `me` freed `[addr, addr + size)`.
    fn freed(&mut self, me: u32, addr: u64, size: u64) {
        let stamp = self.pool.epoch_now();
        self.freed_at(me, addr, size, stamp);
    }

    /// The pool epoch to stamp bytes stream `me` frees now with, after marking its place with
    /// an event recorded just after that epoch: a stream taking the bytes later waits for that
    /// event, not for a fresh one that would also cover what `me` queued since.
    fn stamp_and_mark(&mut self, me: u32, dev: &Device) -> u64 {
        let stamp = self.pool.epoch_now();
        // Best effort, as every mark: without it a later wait records a fresh event.
        let mut d = dev.lock();
        self.clocks.mark(&mut d, me, self.pool.next_epoch());
        stamp
    }

    /// Stream `me` freed `[addr, addr + size)` at pool epoch `stamp`.
    fn freed_at(&mut self, me: u32, addr: u64, size: u64, stamp: u64) {
        self.clocks.freed(me, stamp);
        if !self.shared {
            return;
        }
        self.dirty.insert(
            addr,
            Freed {
                end: addr + size,
                stream: me,
                stamp,
            },
        );
        if self.dirty.len() > self.prune_at {
            let clocks = &self.clocks;
            self.dirty.retain(|r| !clocks.is_done(r.stream, r.stamp));
            self.prune_at = DIRTY_PRUNE_AT.max(2 * self.dirty.len());
        }
    }

    fn allocate(&mut self, me: u32, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        self.moved_in.clear();
        let mut order = Order::Shared {
            clocks: &mut self.clocks,
            me,
            moved_in: &mut self.moved_in,
            together: self.shared,
            live_peak: 0,
            requested: size,
        };
        let range = self
            .range
            .as_mut()
            .expect("made when the first stream came");
        let p = range.allocate_in(size, dev, &mut order)?;
        if !self.shared {
            return Ok(p);
        }
        // A page that came from another virtual page carries its bytes' history, which the
        // records by address do not: this stream has waited for its last users, so the page
        // counts as freed by this stream now, and another stream placing a block there later
        // waits for this one. (First, so that it holds even if the block is given back below.)
        // An event marks this point of the stream, after its waits and before the work it
        // will queue on the new block: a later stream waits for that much and no more.
        let moved = std::mem::take(&mut self.moved_in);
        if !moved.is_empty() {
            let stamp = self.stamp_and_mark(me, dev);
            for &v in &moved {
                let (start, end) = self.range().page_span(v);
                self.freed_at(me, start, end - start, stamp);
            }
        }
        self.moved_in = moved;
        let taken = {
            let mut d = dev.lock();
            self.take_bytes(&mut d, me, p.addr, p.addr + p.size)
        };
        if let Err(e) = taken {
            // Give the block back (its bytes were free before; their records stay).
            self.range().free_handle(p.handle, p.addr, dev)?;
            return Err(e);
        }
        self.set_owner(p.handle, me);
        Ok(p)
    }

    /// Block `id` of the range is stream `me`'s.
    fn set_owner(&mut self, id: u32, me: u32) {
        let i = id as usize;
        if i >= self.owner.len() {
            self.owner.resize(i + 1, NO_OWNER);
        }
        self.owner[i] = me;
    }

    /// Whether the live block at `addr` (through handle `handle`, if given) is stream `me`'s
    /// to free. A handle that is not the live block at `addr` is refused by the range's free
    /// itself.
    fn owns(&self, me: u32, addr: DevPtr, handle: Option<u32>) -> bool {
        if !self.shared {
            return true;
        }
        let id = handle.or_else(|| self.range.as_ref().and_then(|r| r.live_at(addr)));
        id.is_some_and(|id| self.owner.get(id as usize) == Some(&me))
    }

    fn free(
        &mut self,
        me: u32,
        handle: Option<u32>,
        addr: DevPtr,
        dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        // A free by address (PyTorch's) looks its block up once: the owner check and the free
        // then go through the handle found.
        let handle = match handle {
            None if self.shared => self.range.as_ref().and_then(|r| r.live_at(addr)),
            h => h,
        };
        if !self.owns(me, addr, handle) {
            return Ok(None);
        }
        let freed = match handle {
            Some(h) => self.range().free_handle(h, addr, dev)?,
            None => self.range().free(addr, dev)?,
        };
        if let Some(size) = freed {
            self.freed(me, addr, size);
        }
        Ok(freed)
    }

    /// The block at `addr`, used on other streams too, was freed: it is released once their
    /// work queued by now is done. Its own stream's work queued by now is all that may still
    /// use it after that, so its bytes count as freed now, not at the release, and an event
    /// marks the stream's place now. A stream that takes the bytes later waits for that
    /// event: a fresh one, recorded then, would also cover what the stream queued since. (A
    /// pipeline's side stream queues the next batch's copy meanwhile: the compute stream would
    /// wait for that copy, which is meant to overlap its work.)
    fn free_requested(&mut self, me: u32, addr: DevPtr, dev: &Device) -> Option<u64> {
        if !self.owns(me, addr, None) {
            return None;
        }
        let size = self.range().free_requested(addr, dev)?;
        let stamp = if self.shared {
            self.stamp_and_mark(me, dev)
        } else {
            self.pool.epoch_now()
        };
        self.pending.insert(addr, (size, stamp));
        Some(size)
    }

    fn release(&mut self, me: u32, addr: DevPtr, dev: &Device) -> Result<(), BackendError> {
        if !self.owns(me, addr, None) {
            return Ok(());
        }
        let Some((size, stamp)) = self.pending.remove(&addr) else {
            return Ok(());
        };
        self.range().release(addr, dev)?;
        // The other streams that used it are done; its own stream may not be.
        self.freed_at(me, addr, size, stamp);
        Ok(())
    }

    /// Waits on the host for every stream's queued work: then no freed byte needs a wait,
    /// and the pool may unmap any idle page, the range's included.
    fn sync(&mut self, dev: &Device) -> Result<(), BackendError> {
        {
            let mut d = dev.lock();
            self.clocks.sync_all(&mut d, &self.pool)?;
        }
        self.dirty.clear();
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        let Some(range) = self.range.as_ref() else {
            return Ok(());
        };
        range.check()?;
        self.dirty.check()?;
        if self.shared {
            for a in range.live_addrs() {
                let s = range
                    .live_at(a)
                    .and_then(|id| self.owner.get(id as usize))
                    .copied();
                if s.is_none_or(|s| s as usize >= self.clocks.clocks.len()) {
                    return Err(format!("block {a:#x} belongs to no stream"));
                }
            }
        }
        Ok(())
    }
}

/// The lock of the shared range: a spin lock whose waiters yield the CPU, as the engine's
/// shard locks. Contended by threads that do nothing but allocate, parking them cost more
/// than the work under the lock (eight such threads: 3,062 ns per operation with a parking
/// mutex, H200).
pub type CoreLock = spin::mutex::SpinMutex<SharedCore, spin::relax::Yield>;

/// Allocations and frees of a stream in the shared range over which it measures the share of
/// time it spent waiting for the range's lock; spilled allocations are counted by windows of
/// as many.
const SPILL_WINDOW: u32 = 256;

/// Share of a window's time (from its first operation to its last) that the stream spent
/// waiting for the shared range's lock, from which it spills: its next allocations go to a
/// range of its own. Threads that do nothing but allocate wait most of their time (eight of
/// them on an H200 host spill within their first windows); a server's threads, which launch
/// kernels between allocations, wait a small share of it even when they allocate at the
/// same moments. (A first rule, sixteen waits within a window, spilled the server's threads
/// too: 1.17 of the live peak instead of 0.98; BENCHMARKS.md §3, session 16.)
const SPILL_WAIT_SHARE: f64 = 0.25;

/// When a stream places blocks in its own range instead of the shared one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spill {
    /// Never: every block goes to the shared range, whatever the wait for its lock.
    Off,
    /// Once the stream spent a quarter of the time of 256 operations in the shared range
    /// waiting for its lock: from then on, for good. (Spells that ended, and grew longer each
    /// time the stream came back to a lock still contended, cost threads that only allocate
    /// a window of waiting and cross-stream handovers at every return: eight such threads
    /// took 47–60 ns per operation on an H200 host against 22–23 with spills for good;
    /// BENCHMARKS.md §4, session 19.)
    ///
    /// Also once every other stream with a handle on the range has spilled: the last one
    /// left there no longer waits, but would keep paying the shared range's records for
    /// sharing its bytes with no one. (Two threads that only allocate, one of them spilled:
    /// 62–89 ns per operation on the development machine, against 50–62 with both spilled,
    /// for 96–144 MiB held at the peak instead of 84–100; BENCHMARKS.md §4, session 48.)
    Auto,
    /// Every n-th allocation of each stream (a testing aid: it mixes the two kinds of range
    /// deterministically, without threads).
    Every(u32),
}

/// The spills of a device's streams, for the policy's notes, and whether the streams place
/// their blocks in the shared range at all yet (`range:auto`).
#[derive(Debug, Default)]
pub struct SpillCount {
    /// Times a stream began to spill (each stream spills once, for good).
    spells: AtomicU64,
    /// Streams with a handle on the shared range.
    handles: AtomicU64,
    /// Allocations placed in streams' own ranges, by whole windows of [`SPILL_WINDOW`].
    allocations: AtomicU64,
    /// Whether the streams place blocks in the shared range: from the start with
    /// `range:shared`; with `range:auto` once a second stream allocates ([`Self::share`]).
    /// Until then the first stream places its blocks in a range of its own, which then
    /// becomes the shared one.
    together: AtomicBool,
    /// Whether they did from the start (`range:shared`): if not, `together` means they joined.
    from_start: bool,
}

impl SpillCount {
    /// Counts for streams that start in the shared range (`together`) or each in a range of
    /// its own until [`Self::share`].
    pub fn new(together: bool) -> Self {
        Self {
            together: AtomicBool::new(together),
            from_start: together,
            ..Self::default()
        }
    }

    /// From now on the streams place their blocks in the shared range.
    pub fn share(&self) {
        self.together.store(true, Ordering::Relaxed);
    }

    /// One line saying that the streams went from ranges of their own to the shared one
    /// (`range:auto`), if they did.
    pub fn joined_note(&self) -> Option<String> {
        (!self.from_start && self.together()).then(|| {
            "stitched: a second stream allocated: from then on the streams place their blocks \
             in one shared range, the first stream's (range:auto; range:stream keeps a range \
             per stream)"
                .to_string()
        })
    }

    /// Whether the streams place their blocks in the shared range.
    #[inline]
    pub fn together(&self) -> bool {
        self.together.load(Ordering::Relaxed)
    }

    /// A stream began to spill, for good.
    fn spilled_one(&self) {
        self.spells.fetch_add(1, Ordering::Relaxed);
    }

    /// A stream took a handle on the shared range.
    fn joined(&self) {
        self.handles.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether every stream with a handle on the shared range but one has spilled: that one
    /// is left alone there (see [`Spill::Auto`]).
    #[inline]
    fn left_alone(&self) -> bool {
        let handles = self.handles.load(Ordering::Relaxed);
        handles >= 2 && self.spells.load(Ordering::Relaxed) + 1 >= handles
    }

    /// One line on the spills so far, if there were any.
    pub fn note(&self) -> Option<String> {
        let spells = self.spells.load(Ordering::Relaxed);
        let allocations = self.allocations.load(Ordering::Relaxed);
        (allocations > 0).then(|| {
            format!(
                "stitched: about {allocations} allocations went to their stream's own range \
                 instead of the shared one, in {spells} spells (spill:auto: the shared range's lock was \
                 contended, or the other streams had spilled; or spill:N; their small blocks do \
                 not share pages with other streams')"
            )
        })
    }
}

/// A stream's count of the contention it met, and whether it spills now.
#[derive(Debug, Default)]
struct Contention {
    /// Allocations and frees in the shared range in the current window, when its first one
    /// came, and the nanoseconds they waited for the lock.
    ops: u32,
    start: Option<Instant>,
    waited_ns: u64,
    /// Allocations spilled in the current window.
    spilled: u32,
    /// The stream spilled: it places its blocks in its own range for good.
    gone: bool,
}

impl Contention {
    /// Counts an allocation or free in the shared range that waited `waited_ns` for the lock.
    /// Returns whether the stream begins to spill (at the end of a window). Once it has, its
    /// frees of its blocks left in the shared range are not counted. One clock read per
    /// window, and one around each wait: none on an uncontended lock's path.
    #[inline]
    fn came(&mut self, waited_ns: u64) -> bool {
        if self.gone {
            return false;
        }
        self.ops += 1;
        self.waited_ns += waited_ns;
        if self.ops == 1 {
            self.start = Some(Instant::now());
        }
        self.ops == SPILL_WINDOW && self.close_window()
    }

    /// Decides at the end of a window whether the stream spills.
    #[cold]
    fn close_window(&mut self) -> bool {
        let wall_ns = self
            .start
            .map_or(0, |t| t.elapsed().as_nanos() as u64)
            .max(self.waited_ns);
        let spill =
            self.waited_ns > 0 && self.waited_ns as f64 >= SPILL_WAIT_SHARE * wall_ns as f64;
        self.gone = spill;
        self.ops = 0;
        self.start = None;
        self.waited_ns = 0;
        spill
    }

    /// Counts an allocation placed in the stream's own range; returns whether it closed a
    /// window of them.
    fn spilled(&mut self) -> bool {
        self.spilled += 1;
        if self.spilled < SPILL_WINDOW {
            return false;
        }
        self.spilled = 0;
        true
    }
}

type CoreGuard<'a> = spin::mutex::SpinMutexGuard<'a, SharedCore, spin::relax::Yield>;

/// Waits for the shared range's lock, held by another thread; returns it with the nanoseconds
/// waited. Out of line: the uncontended path only tries the lock.
#[cold]
#[inline(never)]
fn wait_for(core: &CoreLock) -> (CoreGuard<'_>, u64) {
    let t = Instant::now();
    let c = core.lock();
    (c, t.elapsed().as_nanos() as u64)
}

/// One stream's handle on a device's shared range, and the stream's own range for the
/// allocations it spills (see [`Spill`]).
///
/// The own range is a stitched range per stream, as without `range:shared`, on the same page
/// pool: the shared range may take its idle pages (waiting for this stream's work, as ranges
/// per stream do), but it never takes the shared range's, which any stream may have used last.
/// Frees go to whichever range holds the address.
pub struct SharedStitched {
    me: u32,
    /// The first handle made: reports the range's statistics and segments.
    reports: bool,
    core: Arc<CoreLock>,
    stream: Stream,
    pool: Arc<PagePool>,
    va_bytes: u64,
    spill: Spill,
    contention: Contention,
    /// Allocations made (for [`Spill::Every`]).
    allocs: u64,
    /// The stream's own range: the first stream's until it becomes the shared one
    /// (`range:auto`), else made at the stream's first spill.
    own: Option<Stitched>,
    counted: Arc<SpillCount>,
}

impl SharedStitched {
    /// The handle of `stream` on `core` (made, with the range, for the first stream).
    pub fn new(
        stream: Stream,
        core: Arc<CoreLock>,
        spill: Spill,
        counted: Arc<SpillCount>,
    ) -> Self {
        let (me, pool, va_bytes) = {
            let mut c = core.lock();
            (c.join(stream), c.pool.clone(), c.va_bytes)
        };
        counted.joined();
        Self {
            me,
            reports: me == 0,
            core,
            stream,
            pool,
            va_bytes,
            spill,
            contention: Contention::default(),
            allocs: 0,
            own: None,
            counted,
        }
    }

    /// The shared range, locked; counts how long another thread held it.
    #[inline]
    fn lock_core(&mut self) -> CoreGuard<'_> {
        let (core, waited) = match self.core.try_lock() {
            Some(c) => (c, 0),
            None => wait_for(&self.core),
        };
        if self.spill == Spill::Auto && self.contention.came(waited) {
            self.counted.spilled_one();
        }
        core
    }

    /// Whether this allocation goes to the stream's own range.
    #[inline]
    fn spills(&mut self) -> bool {
        match self.spill {
            Spill::Off => false,
            Spill::Auto => {
                if !self.contention.gone && self.counted.left_alone() {
                    self.contention.gone = true;
                    self.counted.spilled_one();
                }
                self.contention.gone
            }
            Spill::Every(n) => {
                self.allocs += 1;
                self.allocs % n as u64 == 0
            }
        }
    }

    /// The stream's own range, made at its first use. Before the streams share a range
    /// (`range:auto`), it is the one they will share if this stream came first (see
    /// [`Policy::open_range_to_streams`]), so it places as the shared range does from the
    /// start: a model's small tensors, placed before a second stream comes, would otherwise
    /// sit on pages of their own (the server trace: 1.0298 of live instead of 1.0191).
    #[inline]
    fn own_range(&mut self) -> &mut Stitched {
        self.own.get_or_insert_with(|| {
            let r = Stitched::new(self.stream, self.pool.clone(), self.va_bytes);
            if !self.counted.together() {
                r.page_aware()
            } else {
                r
            }
        })
    }

    /// The stream's own range, if `addr` is in it. Before the streams place blocks together
    /// (`range:auto`), every block of the stream is there: no address check.
    #[inline]
    fn own_at(&mut self, addr: DevPtr) -> Option<&mut Stitched> {
        let apart = !self.counted.together();
        self.own.as_mut().filter(|o| apart || o.holds(addr))
    }

    /// [`Policy::allocate`] past its first check: the stream's first allocation, or the
    /// streams place their blocks together.
    #[inline(never)]
    fn allocate_elsewhere(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        if !self.counted.together() {
            return self.own_range().allocate(size, dev);
        }
        if self.spills() {
            // Counted by windows: one shared counter written by every spilling thread at
            // every allocation would cost them what spilling saves.
            if self.contention.spilled() {
                self.counted
                    .allocations
                    .fetch_add(SPILL_WINDOW as u64, Ordering::Relaxed);
            }
            match self.own_range().allocate(size, dev) {
                // Out of memory in its own range: the shared range may have idle pages.
                Err(e) if e.out_of_memory => {}
                placed => return placed,
            }
        }
        let me = self.me;
        self.lock_core().allocate(me, size, dev)
    }

    /// A free of a block in the shared range, out of line (see `allocate_elsewhere`).
    #[inline(never)]
    fn free_shared(
        &mut self,
        handle: u32,
        addr: DevPtr,
        dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        let me = self.me;
        self.lock_core().free(me, Some(handle), addr, dev)
    }

    fn owns_at(&self, addr: DevPtr) -> Option<&Stitched> {
        self.own.as_ref().filter(|o| o.holds(addr))
    }

    /// A figure of this handle's blocks (`of`, read from a range): the shared range's if this
    /// handle reports it, with its own range's added (`add`). Statistics and their current
    /// values are summed the same way.
    fn reported<T: Default>(&self, of: impl Fn(&Stitched) -> T, add: impl Fn(&mut T, T)) -> T {
        let mut t = match (self.reports, self.core.lock().range.as_ref()) {
            (true, Some(r)) => of(r),
            _ => T::default(),
        };
        if let Some(own) = self.own.as_ref() {
            add(&mut t, of(own));
        }
        t
    }
}

impl Policy for SharedStitched {
    fn name(&self) -> &'static str {
        "stitched"
    }

    #[inline]
    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        // `range:auto` before the streams shared memory: a range of the stream's own, exactly
        // as `range:stream` (an out-of-memory error included). The rest out of line, so that
        // this path costs a check, not the shared path's register saves.
        match self.own.as_mut() {
            Some(own) if !self.counted.together() => own.allocate(size, dev),
            _ => self.allocate_elsewhere(size, dev),
        }
    }

    fn free_requested(&mut self, addr: DevPtr, dev: &Device) -> Option<u64> {
        match self.own_at(addr) {
            Some(own) => own.free_requested(addr, dev),
            None => {
                let me = self.me;
                self.lock_core().free_requested(me, addr, dev)
            }
        }
    }

    fn release(&mut self, addr: DevPtr, dev: &Device) -> Result<(), BackendError> {
        match self.own_at(addr) {
            Some(own) => own.release(addr, dev),
            None => {
                let me = self.me;
                self.lock_core().release(me, addr, dev)
            }
        }
    }

    fn free(&mut self, addr: DevPtr, dev: &Device) -> Result<Option<u64>, BackendError> {
        match self.own_at(addr) {
            Some(own) => own.free(addr, dev),
            None => {
                let me = self.me;
                self.lock_core().free(me, None, addr, dev)
            }
        }
    }

    fn free_handle(
        &mut self,
        handle: u32,
        addr: DevPtr,
        dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        match self.own_at(addr) {
            Some(own) => own.free_handle(handle, addr, dev),
            None => self.free_shared(handle, addr, dev),
        }
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        // The engine asks every stream's shard. The shared range is one, so the reporting
        // handle releases it; each handle releases its own range. Either unmaps idle pages of
        // the whole pool, the shared range's among them, so every stream is synchronised first.
        if !self.reports && self.own.is_none() {
            return Ok(0);
        }
        let mut core = self.core.lock();
        core.sync(dev)?;
        let mut released = 0;
        if let Some(own) = self.own.as_mut() {
            released += own.release_cached(dev)?;
        }
        if self.reports {
            released += core.range().release_cached(dev)?;
        }
        Ok(released)
    }

    fn stats(&self) -> MemoryStats {
        self.reported(|r| r.stats(), |st, own| st.merge_blocks(&own))
    }

    fn block_currents(&self) -> BlockCurrents {
        self.reported(|r| r.block_currents(), |c, own| c.add(&own))
    }

    fn reset_peaks(&mut self) {
        if self.reports {
            if let Some(r) = self.core.lock().range.as_mut() {
                r.reset_peaks();
            }
        }
        if let Some(own) = self.own.as_mut() {
            own.reset_peaks();
        }
    }

    fn largest_obtainable(&self, fresh: u64) -> u64 {
        // Every range draws on the same page pool.
        match self.own.as_ref() {
            Some(own) => own.largest_obtainable(fresh),
            None => self
                .core
                .lock()
                .range
                .as_ref()
                .map_or(fresh, |r| r.largest_obtainable(fresh)),
        }
    }

    fn largest_free(&self) -> u64 {
        let shared = self
            .core
            .lock()
            .range
            .as_ref()
            .map_or(0, |r| r.largest_free());
        shared.max(self.own.as_ref().map_or(0, |o| o.largest_free()))
    }

    fn segments(&self) -> Vec<SegmentInfo> {
        let mut segs = match (self.reports, self.core.lock().range.as_ref()) {
            (true, Some(r)) => r.segments(),
            _ => Vec::new(),
        };
        if let Some(own) = self.own.as_ref() {
            segs.extend(own.segments());
        }
        segs
    }

    fn is_allocated(&self, addr: DevPtr) -> bool {
        if let Some(own) = self.owns_at(addr) {
            return own.is_allocated(addr);
        }
        let c = self.core.lock();
        c.owns(self.me, addr, None) && c.range.as_ref().is_some_and(|r| r.is_allocated(addr))
    }

    fn is_allocated_handle(&self, handle: u32, addr: DevPtr) -> bool {
        if let Some(own) = self.owns_at(addr) {
            return own.is_allocated_handle(handle, addr);
        }
        let c = self.core.lock();
        c.owns(self.me, addr, Some(handle))
            && c.range
                .as_ref()
                .is_some_and(|r| r.is_allocated_handle(handle, addr))
    }

    fn is_free_block(&self, addr: DevPtr) -> bool {
        if let Some(own) = self.owns_at(addr) {
            return own.is_free_block(addr);
        }
        self.core
            .lock()
            .range
            .as_ref()
            .is_some_and(|r| r.is_free_block(addr))
    }

    fn check(&self) -> Result<(), String> {
        if let Some(own) = self.own.as_ref() {
            own.check()?;
        }
        self.core.lock().check()
    }

    fn holds(&self, addr: DevPtr) -> bool {
        self.own.as_ref().is_some_and(|o| o.holds(addr))
            || self
                .core
                .lock()
                .range
                .as_ref()
                .is_some_and(|r| r.holds(addr))
    }

    fn open_range_to_streams(&mut self) {
        if self.counted.together() {
            return; // `range:shared`: shared from the start (its own range is a spill's)
        }
        let me = self.me;
        self.core.lock().adopt(me, &mut self.own);
        self.counted.share();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Runs a window of operations in the shared range that waited `waited` in all; returns
    /// whether the stream began to spill.
    fn window(c: &mut Contention, waited: Duration) -> bool {
        let waited = waited.as_nanos() as u64;
        let mut began = false;
        for i in 0..SPILL_WINDOW {
            let b = c.came(if i == 0 { waited } else { 0 });
            assert!(!b || i == SPILL_WINDOW - 1, "decided at the window's end");
            began |= b;
        }
        began
    }

    // A window of 256 operations here takes microseconds: a wait of seconds is most of it,
    // and none is none of it.
    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn a_stream_spills_once_the_lock_is_contended_and_stays_in_its_own_range() {
        let mut c = Contention::default();
        assert!(!window(&mut c, Duration::ZERO), "no wait: stays");
        assert!(!c.gone);
        assert!(window(&mut c, LONG), "waiting most of the time: spills");
        assert!(c.gone);
        assert!(
            !c.came(LONG.as_nanos() as u64),
            "its frees of blocks left in the shared range do not count"
        );
        // However many allocations it spills and however quiet the lock is meanwhile, it does
        // not come back; its spilled allocations are counted a window at a time.
        let windows = (0..10 * SPILL_WINDOW).filter(|_| c.spilled()).count();
        assert_eq!(windows, 10);
        assert!(!window(&mut c, Duration::ZERO));
        assert!(c.gone);
    }

    /// Handles of `streams` streams on one shared range (`range:shared`, `spill:auto`).
    fn handles(streams: u64) -> (Vec<SharedStitched>, Arc<SpillCount>) {
        let (sim, _) = crate::backend::sim::SimBackend::new(Default::default());
        let info = crate::backend::Backend::info(&sim);
        let pool = Arc::new(PagePool::new(
            &info,
            &super::super::PolicyOptions::default(),
        ));
        let core = Arc::new(CoreLock::new(SharedCore::new(pool, 1 << 36)));
        let counted = Arc::new(SpillCount::new(true));
        let h = (1..=streams)
            .map(|s| SharedStitched::new(s, core.clone(), Spill::Auto, counted.clone()))
            .collect();
        (h, counted)
    }

    /// What `lock_core` does after a window of allocations that mostly waited for the lock.
    fn contended(h: &mut SharedStitched) {
        assert!(window(&mut h.contention, LONG));
        h.counted.spilled_one();
    }

    #[test]
    fn the_last_stream_left_in_the_shared_range_spills_too() {
        let (mut h, counted) = handles(2);
        assert!(!h[0].spills() && !h[1].spills(), "no wait yet: both stay");
        contended(&mut h[1]);
        assert!(h[1].spills());
        assert!(
            h[0].spills(),
            "alone in the shared range: it follows the other"
        );
        assert!(h[0].spills(), "for good");
        assert_eq!(
            counted.spells.load(Ordering::Relaxed),
            2,
            "each stream counted once"
        );

        // With three streams, one spilled leaves two that still share the range.
        let (mut h, counted) = handles(3);
        contended(&mut h[2]);
        assert!(!h[0].spills() && !h[1].spills());
        contended(&mut h[1]);
        assert!(h[0].spills(), "now alone");
        assert_eq!(counted.spells.load(Ordering::Relaxed), 3);

        // A single stream is never alone in this sense: it has nothing to share with.
        let (mut h, _) = handles(1);
        assert!(!h[0].spills());
    }

    #[test]
    fn a_short_wait_in_a_long_window_does_not_spill() {
        let mut c = Contention::default();
        c.came(1_000);
        std::thread::sleep(Duration::from_millis(20));
        for _ in 1..SPILL_WINDOW {
            assert!(!c.came(0));
        }
        assert!(!c.gone);
    }
}
