//! The stitched policy with one virtual range shared by a device's streams (`range:shared`).
//!
//! By default each stream places its blocks in a virtual range of its own, so blocks of
//! different streams never share a 2 MiB page: a server whose five threads each keep a few
//! small blocks live holds a partly used page per thread and per gap (1.05 of live on the
//! server trace, against 1.03 for best fit in one range; docs/stitched.md). Here every stream
//! places its blocks in one range, under one lock, blocks under a page go to the end of their
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

use super::stitched::{Order, PagePool, Stitched};
use super::{Placement, Policy, SegmentInfo};
use crate::backend::{DevPtr, EventHandle, Stream};
use crate::device::{Device, DeviceState};
use crate::error::BackendError;
use crate::stats::MemoryStats;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Events kept per stream (the oldest is destroyed when a new one comes).
const EVENTS_KEPT: usize = 64;

/// Freed ranges remembered before the ones whose streams are known done are first dropped
/// (after that, whenever their number has doubled since the last time).
const DIRTY_PRUNE_AT: usize = 4096;

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
        self.clocks[i as usize].last_free = Some(stamp);
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

/// A freed range: its end, the stream that freed it, and the pool epoch of the free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dirty {
    end: u64,
    stream: u32,
    stamp: u64,
}

/// The one range and what the streams need to share it.
pub struct SharedCore {
    pool: Arc<PagePool>,
    va_bytes: u64,
    /// The range's placement and pages (made when the first stream comes).
    range: Option<Stitched>,
    clocks: StreamClocks,
    /// Live block address -> the stream index that allocated it (frees go through its
    /// handle, and a handle answers only for its stream's blocks, as a per-stream pool does).
    owner: FxHashMap<DevPtr, u32>,
    /// Blocks freed while used on other streams: address -> size, until the engine releases
    /// them.
    pending: FxHashMap<DevPtr, u64>,
    /// Freed bytes another stream must wait for before using: start -> range. Disjoint.
    dirty: BTreeMap<u64, Dirty>,
    /// Several streams have come: `owner` and `dirty` are kept.
    shared: bool,
    /// Size of `dirty` at which the records known done are dropped.
    prune_at: usize,
    /// Scratch list of `Order::Shared`'s `moved_in`.
    moved_in: Vec<u32>,
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
            owner: FxHashMap::default(),
            pending: FxHashMap::default(),
            dirty: BTreeMap::new(),
            shared: false,
            prune_at: DIRTY_PRUNE_AT,
            moved_in: Vec::new(),
        }
    }

    /// Stream `stream` comes: its index. With the second stream, the owners and freed bytes
    /// start being kept: the blocks live now are the first stream's, and all the range's
    /// bytes count as freed by it now (so the new stream's first use of any of them waits
    /// for what the first stream queued until then).
    fn join(&mut self, stream: Stream) -> u32 {
        let me = self.clocks.add(stream);
        if me == 0 {
            self.range = Some(Stitched::new(stream, self.pool.clone(), self.va_bytes).page_aware());
        } else if me == 1 {
            self.shared = true;
            let range = self.range.as_ref().expect("made with the first stream");
            self.owner = range.live_addrs().map(|a| (a, 0)).collect();
            let stamp = self.pool.epoch_now();
            self.clocks.freed(0, stamp);
            self.dirty.insert(
                0,
                Dirty {
                    end: u64::MAX,
                    stream: 0,
                    stamp,
                },
            );
        }
        me
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
        let over = self.overlapping(addr, end);
        if over.is_empty() {
            return Ok(());
        }
        let to = Wait::Device(self.clocks.stream(me));
        for &(_, r) in &over {
            if r.stream != me {
                self.clocks.settle(d, &self.pool, r.stream, r.stamp, to)?;
            }
        }
        self.cut(addr, end, over);
        Ok(())
    }

    /// The freed records that overlap `[addr, end)`.
    fn overlapping(&self, addr: u64, end: u64) -> Vec<(u64, Dirty)> {
        let mut over: Vec<(u64, Dirty)> = Vec::new();
        if let Some((&a, &r)) = self.dirty.range(..addr).next_back() {
            if r.end > addr {
                over.push((a, r));
            }
        }
        over.extend(self.dirty.range(addr..end).map(|(&a, &r)| (a, r)));
        over
    }

    /// Removes `[addr, end)` from the records `over` (its overlapping ones), keeping their
    /// parts outside it.
    fn cut(&mut self, addr: u64, end: u64, over: Vec<(u64, Dirty)>) {
        for (a, r) in over {
            self.dirty.remove(&a);
            if a < addr {
                self.dirty.insert(a, Dirty { end: addr, ..r });
            }
            if r.end > end {
                self.dirty.insert(end, r);
            }
        }
    }

    /// Stream `me` freed `[addr, addr + size)`.
    fn freed(&mut self, me: u32, addr: u64, size: u64) {
        let stamp = self.pool.epoch_now();
        self.clocks.freed(me, stamp);
        if !self.shared {
            return;
        }
        let over = self.overlapping(addr, addr + size);
        self.cut(addr, addr + size, over);
        self.dirty.insert(
            addr,
            Dirty {
                end: addr + size,
                stream: me,
                stamp,
            },
        );
        if self.dirty.len() > self.prune_at {
            let clocks = &self.clocks;
            self.dirty.retain(|_, r| !clocks.is_done(r.stream, r.stamp));
            self.prune_at = DIRTY_PRUNE_AT.max(2 * self.dirty.len());
        }
    }

    fn allocate(&mut self, me: u32, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        self.moved_in.clear();
        let mut order = Order::Shared {
            clocks: &mut self.clocks,
            me,
            moved_in: &mut self.moved_in,
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
        let moved = std::mem::take(&mut self.moved_in);
        for &v in &moved {
            let (start, end) = self.range().page_span(v);
            self.freed(me, start, end - start);
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
        self.owner.insert(p.addr, me);
        Ok(p)
    }

    fn owns(&self, me: u32, addr: DevPtr) -> bool {
        !self.shared || self.owner.get(&addr) == Some(&me)
    }

    fn free(
        &mut self,
        me: u32,
        handle: Option<u32>,
        addr: DevPtr,
        dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        if !self.owns(me, addr) {
            return Ok(None);
        }
        let freed = match handle {
            Some(h) => self.range().free_handle(h, addr, dev)?,
            None => self.range().free(addr, dev)?,
        };
        if let Some(size) = freed {
            self.owner.remove(&addr);
            self.freed(me, addr, size);
        }
        Ok(freed)
    }

    fn free_requested(&mut self, me: u32, addr: DevPtr) -> Option<u64> {
        if !self.owns(me, addr) {
            return None;
        }
        let size = self.range().free_requested(addr)?;
        self.pending.insert(addr, size);
        Some(size)
    }

    fn release(&mut self, me: u32, addr: DevPtr, dev: &Device) -> Result<(), BackendError> {
        if !self.owns(me, addr) {
            return Ok(());
        }
        let Some(size) = self.pending.remove(&addr) else {
            return Ok(());
        };
        self.range().release(addr, dev)?;
        self.owner.remove(&addr);
        // The other streams that used it are done; its own stream may not be.
        self.freed(me, addr, size);
        Ok(())
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        {
            let mut d = dev.lock();
            self.clocks.sync_all(&mut d, &self.pool)?;
        }
        // Every stream's work is done: no freed bytes need a wait any more.
        self.dirty.clear();
        self.range().release_cached(dev)
    }

    fn check(&self) -> Result<(), String> {
        let Some(range) = self.range.as_ref() else {
            return Ok(());
        };
        range.check()?;
        let mut last_end = 0;
        for (&a, r) in &self.dirty {
            if a < last_end || r.end <= a {
                return Err(format!("freed records overlap or are empty at {a:#x}"));
            }
            last_end = r.end;
        }
        for (&a, &s) in &self.owner {
            if s as usize >= self.clocks.clocks.len() {
                return Err(format!("block {a:#x} belongs to no stream"));
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

/// One stream's handle on a device's shared range.
pub struct SharedStitched {
    me: u32,
    /// The first handle made: reports the range's statistics and segments.
    reports: bool,
    core: Arc<CoreLock>,
}

impl SharedStitched {
    /// The handle of `stream` on `core` (made, with the range, for the first stream).
    pub fn new(stream: Stream, core: Arc<CoreLock>) -> Self {
        let me = core.lock().join(stream);
        Self {
            me,
            reports: me == 0,
            core,
        }
    }
}

impl Policy for SharedStitched {
    fn name(&self) -> &'static str {
        "stitched"
    }

    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        self.core.lock().allocate(self.me, size, dev)
    }

    fn free_requested(&mut self, addr: DevPtr) -> Option<u64> {
        self.core.lock().free_requested(self.me, addr)
    }

    fn release(&mut self, addr: DevPtr, dev: &Device) -> Result<(), BackendError> {
        self.core.lock().release(self.me, addr, dev)
    }

    fn free(&mut self, addr: DevPtr, dev: &Device) -> Result<Option<u64>, BackendError> {
        self.core.lock().free(self.me, None, addr, dev)
    }

    fn free_handle(
        &mut self,
        handle: u32,
        addr: DevPtr,
        dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        self.core.lock().free(self.me, Some(handle), addr, dev)
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        // The engine asks every stream's shard; the range is one, so the reporting handle
        // releases it (with every stream synchronised) and the others have nothing of their
        // own to release.
        if !self.reports {
            return Ok(0);
        }
        self.core.lock().release_cached(dev)
    }

    fn stats(&self) -> MemoryStats {
        match (self.reports, self.core.lock().range.as_ref()) {
            (true, Some(r)) => r.stats(),
            _ => MemoryStats::default(),
        }
    }

    fn reset_peaks(&mut self) {
        if self.reports {
            if let Some(r) = self.core.lock().range.as_mut() {
                r.reset_peaks();
            }
        }
    }

    fn largest_free(&self) -> u64 {
        self.core
            .lock()
            .range
            .as_ref()
            .map_or(0, |r| r.largest_free())
    }

    fn segments(&self) -> Vec<SegmentInfo> {
        match (self.reports, self.core.lock().range.as_ref()) {
            (true, Some(r)) => r.segments(),
            _ => Vec::new(),
        }
    }

    fn is_allocated(&self, addr: DevPtr) -> bool {
        let c = self.core.lock();
        c.owns(self.me, addr) && c.range.as_ref().is_some_and(|r| r.is_allocated(addr))
    }

    fn is_allocated_handle(&self, handle: u32, addr: DevPtr) -> bool {
        let c = self.core.lock();
        c.owns(self.me, addr)
            && c.range
                .as_ref()
                .is_some_and(|r| r.is_allocated_handle(handle, addr))
    }

    fn is_free_block(&self, addr: DevPtr) -> bool {
        self.core
            .lock()
            .range
            .as_ref()
            .is_some_and(|r| r.is_free_block(addr))
    }

    fn check(&self) -> Result<(), String> {
        self.core.lock().check()
    }
}
