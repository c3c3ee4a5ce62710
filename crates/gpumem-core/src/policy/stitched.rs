//! Virtual-memory stitching: blocks are placed best-fit in one large virtual range per stream,
//! at 512-byte granularity, and physical 2 MiB pages are mapped only under the virtual pages
//! that live blocks touch.
//!
//! A physical page stays mapped where it was when its blocks are freed, so the next step of a
//! training loop, which asks for the same sizes in the same order and gets the same addresses,
//! finds its memory already mapped: no driver call. A physical page may be mapped at several
//! virtual pages at once (aliases); it is used through at most one of them at a time. When a
//! newly touched virtual page has no free physical page behind it, the pool takes a free page
//! from anywhere (least recently freed first) and maps it there too, instead of asking the
//! device for more, once the pages held exceed the peak of pages in use by the `slack` factor.
//! So the memory held tracks the peak of pages touched by live blocks, which is within a page
//! per block boundary of the live bytes.
//!
//! Stream order: a virtual page is unmapped (to point it at another physical page) only after
//! its stream has finished the work queued before (an event is recorded and waited for); a
//! physical page last used by another stream is handed over through an event that the new
//! stream waits for on the device.

use super::blocks::{BlockSet, State};
use super::segmented::round_size;
use super::{Placement, Policy, PolicyOptions, SegmentInfo};
use crate::backend::{DevPtr, DeviceInfo, DriverCall, PhysHandle, Stream};
use crate::device::{Device, DeviceState};
use crate::error::BackendError;
use crate::stats::{MemoryStats, Pool};
use crate::units::MIN_BLOCK;
use parking_lot::Mutex;

const NONE: u32 = u32::MAX;

struct Phys {
    handle: PhysHandle,
    /// (shard, virtual page) using it now, if any.
    user: Option<(u32, u32)>,
    /// Shard that used it last.
    last_shard: u32,
    /// Every (shard, virtual page) it is mapped at.
    aliases: Vec<(u32, u32)>,
}

struct Table {
    stream: Stream,
    base: u64,
    /// Virtual page -> physical slot, or NONE.
    map: Vec<u32>,
}

struct Pages {
    phys: Vec<Option<Phys>>,
    spare: Vec<u32>,
    free: FreeList,
    held: u64,
    busy: u64,
    peak_busy: u64,
    tables: Vec<Table>,
    remaps: u64,
}

/// Physical pages shared by the stitched policy's streams on one device.
pub struct PagePool {
    inner: Mutex<Pages>,
    page: u64,
    slack: f64,
}

/// Counters of the page pool, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageCounters {
    /// Physical pages held.
    pub held: u64,
    /// Pages in use now.
    pub busy: u64,
    /// Peak of pages in use.
    pub peak_busy: u64,
    /// Virtual pages pointed at another physical page (unmap + map).
    pub remaps: u64,
}

impl PagePool {
    /// A pool for the device `info`.
    pub fn new(info: &DeviceInfo, opts: &PolicyOptions) -> Self {
        Self {
            inner: Mutex::new(Pages {
                phys: Vec::new(),
                spare: Vec::new(),
                free: FreeList::default(),
                held: 0,
                busy: 0,
                peak_busy: 0,
                tables: Vec::new(),
                remaps: 0,
            }),
            page: info.page_bytes,
            slack: opts.slack.max(0.0),
        }
    }

    /// Counters now.
    pub fn counters(&self) -> PageCounters {
        let p = self.inner.lock();
        PageCounters {
            held: p.held,
            busy: p.busy,
            peak_busy: p.peak_busy,
            remaps: p.remaps,
        }
    }

    fn register(&self, stream: Stream, base: u64, pages: u64) -> u32 {
        let mut p = self.inner.lock();
        p.tables.push(Table {
            stream,
            base,
            map: vec![NONE; pages as usize],
        });
        (p.tables.len() - 1) as u32
    }

    /// Gives shard `shard` a physical page under each virtual page of `vpages` (pages its new
    /// block touches for the first time). On failure nothing is claimed.
    fn claim(&self, shard: u32, vpages: &[u32], dev: &Device) -> Result<(), BackendError> {
        let mut p = self.inner.lock();
        let p = &mut *p;
        let mut need: Vec<u32> = Vec::new();
        // Pages claimed through their existing mapping: (slot, last shard) to restore if the
        // request fails.
        let mut got: Vec<(u32, u32)> = Vec::new();
        let mut other_shards: Vec<u32> = Vec::new();
        for &v in vpages {
            let slot = p.tables[shard as usize].map[v as usize];
            if slot != NONE {
                let ph = p.phys[slot as usize].as_mut().expect("mapped slot");
                if ph.user.is_none() {
                    ph.user = Some((shard, v));
                    if ph.last_shard != shard {
                        other_shards.push(ph.last_shard);
                    }
                    got.push((slot, ph.last_shard));
                    p.free.remove(slot);
                    continue;
                }
            }
            need.push(v);
        }
        p.busy += vpages.len() as u64;
        p.peak_busy = p.peak_busy.max(p.busy);
        if need.is_empty() {
            if !other_shards.is_empty() {
                let mut d = dev.lock();
                Self::order_after(p, shard, &mut other_shards, &mut d)?;
            }
            return Ok(());
        }
        let mut d = dev.lock();
        match self.fill(p, shard, &need, &mut other_shards, &mut d) {
            Ok(()) => Self::order_after(p, shard, &mut other_shards, &mut d),
            Err(e) => {
                // Give back what was claimed for this request, as it was.
                for (slot, last) in got {
                    let ph = p.phys[slot as usize].as_mut().expect("claimed slot");
                    ph.user = None;
                    ph.last_shard = last;
                    p.free.push_front(slot);
                }
                p.busy -= vpages.len() as u64;
                Err(e)
            }
        }
    }

    /// Finds physical pages for `need` and maps them.
    fn fill(
        &self,
        p: &mut Pages,
        shard: u32,
        need: &[u32],
        other_shards: &mut Vec<u32>,
        d: &mut DeviceState,
    ) -> Result<(), BackendError> {
        let budget = ((1.0 + self.slack) * p.peak_busy as f64).ceil() as u64;
        // Pick the pages first, so that a failure leaves the mappings untouched.
        let mut picked: Vec<u32> = Vec::with_capacity(need.len());
        let mut created: Vec<u32> = Vec::new();
        for _ in need {
            let want_new = p.free.is_empty() || p.held < budget || d.reserve_unused() > 0;
            let mut slot = None;
            if want_new {
                match d.create_page(Pool::Large) {
                    Ok(h) => {
                        let s = Self::new_slot(p, h, shard);
                        created.push(s);
                        slot = Some(s);
                    }
                    Err(e) if e.out_of_memory && !p.free.is_empty() => {}
                    Err(e) => {
                        Self::undo_pick(p, &picked, &created, d)?;
                        return Err(e);
                    }
                }
            }
            let s = match slot {
                Some(s) => s,
                None => {
                    let s = p.free.pop_front().expect("free page available");
                    let ph = p.phys[s as usize].as_ref().expect("free slot");
                    if ph.last_shard != shard {
                        other_shards.push(ph.last_shard);
                    }
                    s
                }
            };
            picked.push(s);
        }
        // Virtual pages still pointing at a busy physical page must be unmapped first, and
        // only once their stream's earlier work is done.
        let stale: Vec<u32> = need
            .iter()
            .copied()
            .filter(|&v| p.tables[shard as usize].map[v as usize] != NONE)
            .collect();
        let (base, stream) = (
            p.tables[shard as usize].base,
            p.tables[shard as usize].stream,
        );
        if !stale.is_empty() {
            let ev = d.event_record(stream)?;
            d.event_synchronize(ev)?;
            d.event_destroy(ev);
            for run in runs(&stale) {
                d.unmap(base + run.0 as u64 * self.page, run.1 as u64 * self.page)?;
            }
            for &v in &stale {
                let old = p.tables[shard as usize].map[v as usize];
                if let Some(ph) = p.phys[old as usize].as_mut() {
                    ph.aliases.retain(|&a| a != (shard, v));
                }
                p.tables[shard as usize].map[v as usize] = NONE;
                p.remaps += 1;
            }
        }
        for (&v, &s) in need.iter().zip(&picked) {
            let ph = p.phys[s as usize].as_mut().expect("picked slot");
            d.map(base + v as u64 * self.page, self.page, ph.handle)?;
            ph.aliases.push((shard, v));
            ph.user = Some((shard, v));
            p.tables[shard as usize].map[v as usize] = s;
        }
        let mut sorted = need.to_vec();
        sorted.sort_unstable();
        for run in runs(&sorted) {
            d.set_access(base + run.0 as u64 * self.page, run.1 as u64 * self.page)?;
        }
        Ok(())
    }

    /// Returns the pages picked for a request that failed: new ones to the device, taken
    /// ones to the free list with their old place in it.
    fn undo_pick(
        p: &mut Pages,
        picked: &[u32],
        created: &[u32],
        d: &mut DeviceState,
    ) -> Result<(), BackendError> {
        for &s in picked {
            if created.contains(&s) {
                let ph = p.phys[s as usize].take().expect("created slot");
                p.spare.push(s);
                p.held -= 1;
                d.release_page(ph.handle, Pool::Large)?;
            } else {
                p.free.push_front(s);
            }
        }
        Ok(())
    }

    fn new_slot(p: &mut Pages, handle: PhysHandle, shard: u32) -> u32 {
        let ph = Phys {
            handle,
            user: None,
            last_shard: shard,
            aliases: Vec::new(),
        };
        p.held += 1;
        match p.spare.pop() {
            Some(s) => {
                p.phys[s as usize] = Some(ph);
                s
            }
            None => {
                p.phys.push(Some(ph));
                (p.phys.len() - 1) as u32
            }
        }
    }

    fn make_free(p: &mut Pages, slot: u32, shard: u32) {
        let ph = p.phys[slot as usize].as_mut().expect("slot");
        ph.user = None;
        ph.last_shard = shard;
        p.free.push_back(slot);
    }

    /// Makes `shard`'s stream wait for the work of the shards whose pages it took over.
    fn order_after(
        p: &Pages,
        shard: u32,
        others: &mut Vec<u32>,
        d: &mut DeviceState,
    ) -> Result<(), BackendError> {
        others.sort_unstable();
        others.dedup();
        let me = p.tables[shard as usize].stream;
        for &o in others.iter() {
            let ev = d.event_record(p.tables[o as usize].stream)?;
            d.stream_wait_event(me, ev)?;
            d.event_destroy(ev);
        }
        others.clear();
        Ok(())
    }

    /// Shard `shard` no longer touches `vpages`: their physical pages become free.
    fn release(&self, shard: u32, vpages: &[u32]) {
        let mut p = self.inner.lock();
        let p = &mut *p;
        for &v in vpages {
            let slot = p.tables[shard as usize].map[v as usize];
            debug_assert!(slot != NONE, "released page was mapped");
            Self::make_free(p, slot, shard);
        }
        p.busy -= vpages.len() as u64;
    }

    /// Unmaps and releases every free physical page. Returns the bytes released.
    fn trim(&self, dev: &Device) -> Result<u64, BackendError> {
        let mut p = self.inner.lock();
        let p = &mut *p;
        if p.free.is_empty() {
            return Ok(0);
        }
        let slots: Vec<u32> = p.free.iter().collect();
        let mut d = dev.lock();
        // Every stream whose virtual pages will be unmapped must be idle first.
        let mut shards: Vec<u32> = slots
            .iter()
            .flat_map(|&s| {
                p.phys[s as usize]
                    .as_ref()
                    .expect("slot")
                    .aliases
                    .iter()
                    .map(|a| a.0)
            })
            .collect();
        shards.sort_unstable();
        shards.dedup();
        for &sh in &shards {
            let ev = d.event_record(p.tables[sh as usize].stream)?;
            d.event_synchronize(ev)?;
            d.event_destroy(ev);
        }
        let mut released = 0;
        for s in slots {
            let ph = p.phys[s as usize].take().expect("free slot");
            p.free.remove(s);
            for &(sh, v) in &ph.aliases {
                let t = &mut p.tables[sh as usize];
                d.unmap(t.base + v as u64 * self.page, self.page)?;
                t.map[v as usize] = NONE;
            }
            d.release_page(ph.handle, Pool::Large)?;
            p.spare.push(s);
            p.held -= 1;
            released += self.page;
        }
        Ok(released)
    }
}

/// Free physical pages, least recently freed first: a doubly linked list through the slots,
/// so that taking any page out of it (when its own virtual page touches it again) is O(1).
#[derive(Default)]
struct FreeList {
    head: u32,
    tail: u32,
    links: Vec<(u32, u32)>,
    member: Vec<bool>,
    len: usize,
}

impl FreeList {
    fn grow(&mut self, slot: u32) {
        if self.links.is_empty() {
            self.head = NONE;
            self.tail = NONE;
        }
        if self.links.len() <= slot as usize {
            self.links.resize(slot as usize + 1, (NONE, NONE));
            self.member.resize(slot as usize + 1, false);
        }
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push_back(&mut self, slot: u32) {
        self.grow(slot);
        debug_assert!(!self.member[slot as usize]);
        self.links[slot as usize] = (self.tail, NONE);
        if self.tail != NONE {
            self.links[self.tail as usize].1 = slot;
        } else {
            self.head = slot;
        }
        self.tail = slot;
        self.member[slot as usize] = true;
        self.len += 1;
    }

    fn push_front(&mut self, slot: u32) {
        self.grow(slot);
        debug_assert!(!self.member[slot as usize]);
        self.links[slot as usize] = (NONE, self.head);
        if self.head != NONE {
            self.links[self.head as usize].0 = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
        self.member[slot as usize] = true;
        self.len += 1;
    }

    fn remove(&mut self, slot: u32) {
        if !self.member.get(slot as usize).copied().unwrap_or(false) {
            return;
        }
        let (prev, next) = self.links[slot as usize];
        if prev != NONE {
            self.links[prev as usize].1 = next;
        } else {
            self.head = next;
        }
        if next != NONE {
            self.links[next as usize].0 = prev;
        } else {
            self.tail = prev;
        }
        self.member[slot as usize] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let s = self.head;
        self.remove(s);
        Some(s)
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = if self.len == 0 { NONE } else { self.head };
        std::iter::from_fn(move || {
            (cur != NONE).then(|| {
                let s = cur;
                cur = self.links[s as usize].1;
                s
            })
        })
    }
}

/// Runs of consecutive values in a sorted slice: (start, length).
fn runs(sorted: &[u32]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &v in sorted {
        match out.last_mut() {
            Some((s, n)) if *s + *n == v => *n += 1,
            _ => out.push((v, 1)),
        }
    }
    out
}

/// The stitched policy for one stream.
pub struct Stitched {
    stream: Stream,
    pool: std::sync::Arc<PagePool>,
    shard: u32,
    set: BlockSet,
    base: u64,
    va_bytes: u64,
    shift: u32,
    touch: Vec<u32>,
    fresh: Vec<u32>,
}

impl Stitched {
    /// A pool for `stream` drawing pages from `pool`, placing blocks in `va_bytes` of virtual
    /// space (reserved at the first allocation).
    pub fn new(stream: Stream, pool: std::sync::Arc<PagePool>, va_bytes: u64) -> Self {
        let page = pool.page;
        Self {
            stream,
            shift: page.trailing_zeros(),
            va_bytes: va_bytes.div_ceil(page) * page,
            pool,
            shard: NONE,
            set: BlockSet::new(false, false),
            base: 0,
            touch: Vec::new(),
            fresh: Vec::new(),
        }
    }

    /// The shared page pool's counters.
    pub fn page_counters(&self) -> PageCounters {
        self.pool.counters()
    }

    fn init(&mut self, dev: &Device) -> Result<(), BackendError> {
        let base = dev.lock().address_reserve(self.va_bytes)?;
        self.base = base;
        let pages = self.va_bytes >> self.shift;
        self.touch = vec![0; pages as usize];
        self.set
            .add_segment(base, self.va_bytes, Pool::Large, State::Free);
        self.shard = self.pool.register(self.stream, base, pages);
        Ok(())
    }

    #[inline]
    fn page_range(&self, addr: u64, size: u64) -> std::ops::RangeInclusive<u32> {
        let first = ((addr - self.base) >> self.shift) as u32;
        let last = ((addr + size - 1 - self.base) >> self.shift) as u32;
        first..=last
    }
}

impl Stitched {
    /// Makes pending block `id` reusable and lets go of the pages only it touched.
    fn release_block(&mut self, id: u32) {
        let (addr, size) = {
            let b = self.set.block(id);
            (b.addr, b.size)
        };
        self.fresh.clear();
        for v in self.page_range(addr, size) {
            let t = &mut self.touch[v as usize];
            *t -= 1;
            if *t == 0 {
                self.fresh.push(v);
            }
        }
        if !self.fresh.is_empty() {
            self.pool.release(self.shard, &self.fresh);
        }
        self.set.release(id);
    }
}

impl Policy for Stitched {
    fn name(&self) -> &'static str {
        "stitched"
    }

    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        if self.shard == NONE {
            self.init(dev)?;
        }
        let rounded = round_size(size);
        let Some(id) = self.set.best_fit(Pool::Large, rounded) else {
            return Err(BackendError::oom(
                DriverCall::AddressReserve,
                format!(
                    "the stream's virtual range of {} bytes has no free run of {rounded} bytes",
                    self.va_bytes
                ),
            ));
        };
        let addr = self.set.block(id).addr;
        self.fresh.clear();
        for v in self.page_range(addr, rounded) {
            let t = &mut self.touch[v as usize];
            *t += 1;
            if *t == 1 {
                self.fresh.push(v);
            }
        }
        if !self.fresh.is_empty() {
            if let Err(e) = self.pool.claim(self.shard, &self.fresh, dev) {
                for v in self.page_range(addr, rounded) {
                    self.touch[v as usize] -= 1;
                }
                return Err(e);
            }
        }
        let split = self.set.block(id).size - rounded >= MIN_BLOCK;
        let id = self
            .set
            .allocate(id, rounded, size, Pool::of(rounded), split);
        Ok(Placement {
            addr,
            size: self.set.block(id).size,
        })
    }

    fn free_requested(&mut self, addr: DevPtr) -> Option<u64> {
        let id = self.set.allocated_at(addr)?;
        self.set.free_requested(id);
        Some(self.set.block(id).size)
    }

    fn release(&mut self, addr: DevPtr, _dev: &Device) -> Result<(), BackendError> {
        if let Some(id) = self.set.pending_at(addr) {
            self.release_block(id);
        }
        Ok(())
    }

    fn free(&mut self, addr: DevPtr, _dev: &Device) -> Result<Option<u64>, BackendError> {
        let Some(id) = self.set.allocated_at(addr) else {
            return Ok(None);
        };
        let size = self.set.block(id).size;
        self.set.free_requested(id);
        self.release_block(id);
        Ok(Some(size))
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        self.pool.trim(dev)
    }

    fn stats(&self) -> &MemoryStats {
        &self.set.stats
    }

    fn reset_peaks(&mut self) {
        self.set.stats.reset_peaks();
    }

    fn largest_free(&self) -> u64 {
        // The virtual top block is not memory; report the largest free block below it.
        self.set
            .free_blocks(Pool::Large)
            .map(|id| self.set.block(id))
            .filter(|b| b.addr + b.size != self.base + self.va_bytes)
            .map(|b| b.size)
            .max()
            .unwrap_or(0)
    }

    fn segments(&self) -> Vec<SegmentInfo> {
        // Report the used part of the virtual range (up to the free top block).
        let mut segs = self.set.segments_info(self.stream);
        for s in &mut segs {
            if let Some(last) = s.blocks.last() {
                if last.kind == super::BlockKind::Free && s.blocks.len() > 1 {
                    s.size -= last.size;
                    s.blocks.pop();
                }
            }
        }
        segs.retain(|s| s.blocks.iter().any(|b| b.kind != super::BlockKind::Free));
        segs
    }

    fn is_allocated(&self, addr: DevPtr) -> bool {
        self.set.allocated_at(addr).is_some()
    }

    fn is_free_block(&self, addr: DevPtr) -> bool {
        self.set.is_free_start(addr)
    }

    fn check(&self) -> Result<(), String> {
        self.set.check()?;
        // Every touched virtual page is mapped to a physical page used through it.
        if self.shard == NONE {
            return Ok(());
        }
        let p = self.pool.inner.lock();
        let t = &p.tables[self.shard as usize];
        for (v, &n) in self.touch.iter().enumerate() {
            if n > 0 {
                let s = t.map[v];
                if s == NONE {
                    return Err(format!("touched virtual page {v} is not mapped"));
                }
                let ph = p.phys[s as usize]
                    .as_ref()
                    .ok_or("mapped to an empty slot")?;
                if ph.user != Some((self.shard, v as u32)) {
                    return Err(format!(
                        "virtual page {v} is touched but its physical page is used by {:?}",
                        ph.user
                    ));
                }
            }
        }
        Ok(())
    }
}
