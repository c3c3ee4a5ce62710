//! Virtual-memory stitching: blocks are placed best-fit in one large virtual range per stream,
//! at 512-byte granularity, and physical 2 MiB pages are mapped only under the virtual pages
//! that live blocks touch.
//!
//! A physical page stays mapped where it was when its blocks are freed, so the next step of a
//! training loop, which asks for the same sizes in the same order and gets the same addresses,
//! finds its memory already mapped: no driver call. A physical page may be mapped at several
//! virtual pages at once (aliases); it is used through at most one of them at a time. When a
//! newly touched virtual page has no idle physical page behind it, the pool takes an idle page
//! from anywhere (least recently idled first) and maps it there too, instead of asking the
//! device for more, once the pages held exceed the peak of pages in use by the `slack` factor.
//! So the memory held tracks the peak of pages touched by live blocks, which is within a page
//! per block boundary of the live bytes.
//!
//! Concurrency: each stream keeps its own page table and its own list of idle pages, under its
//! own lock, so re-touching a page it let go of (the common case) touches no shared state. The
//! pool's lock is taken only when a page must come from elsewhere (created, or taken from
//! another list, or remapped), and then every stream's list is locked too (in index order;
//! fast paths hold only their own list, so this cannot deadlock).
//!
//! Stream order: a virtual page is unmapped (to point it at another physical page) only after
//! its stream has finished the work queued before that virtual page went idle (the first event
//! recorded after that point is waited for; a page taken back through another virtual page
//! records one there, so that it has usually completed by then); a
//! physical page last used by another stream is handed over through an event that the new
//! stream waits for on the device: the first one the old stream recorded after the page went
//! idle. With several streams, a stream records one when pages it took from another go idle
//! (`PagePool::mark`), so that handing them back does not wait for all its later work.
//!
//! Trade budget: taking idle pages from other streams saves memory at the price of driver
//! calls. When those calls take more than `trade_budget` of the time (`PagePool::note_trade`,
//! over windows of 100 ms, decided as soon as a window's calls alone pass that share of it),
//! the streams stop and each keeps its own peak of pages, as with `stream_pages:own`.
//!
//! Remap budget: a virtual page whose physical page went to another address must be unmapped
//! (after its stream's earlier work) and mapped again. A workload whose layout keeps moving
//! pays this at every step. When it takes more than `remap_budget` of the time
//! (`PagePool::note_remap`), the pool raises its spare pages a step at a time, so that such
//! virtual pages get pages of their own instead.

use super::blocks::{BlockSet, State, NIL};
use super::segmented::round_size;
use super::shared_range::{StreamClocks, Wait};
use super::{
    Placement, Policy, PolicyOptions, SegmentInfo, REMAP_SLACK_MAX, REMAP_WINDOWS_IN_A_ROW,
    TRADE_WINDOW_US,
};
use crate::backend::{DevPtr, DeviceInfo, DriverCall, PhysHandle, Stream};
use crate::device::{Device, DeviceState};
use crate::error::BackendError;
use crate::stats::{MemoryStats, Pool};
use crate::units::MIN_BLOCK;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A stream's page list lock: a spin lock whose waiters yield the CPU, as the engine's shard
/// lock. Its unlock is a plain store, where a parking mutex's is a second locked instruction;
/// a quarter of the allocations and frees on random sizes take it, and on the H100 hosts the
/// locked instructions were a measurable part of the stitched policy's cost (session 46,
/// pinned: 0.97-0.99 of the parking mutex's time; a test build with no lock at all, 0.93).
/// A waiter spins only while another stream's slow path holds every list
/// (`PagePool::lock_all`), yielding meanwhile.
type LocalLock = spin::mutex::SpinMutex<Local, spin::relax::Yield>;
type LocalGuard<'a> = spin::mutex::SpinMutexGuard<'a, Local, spin::relax::Yield>;

const NONE: u32 = u32::MAX;

/// Whose earlier work a slow path waits for before it moves a page.
pub(crate) enum Order<'a> {
    /// A range per stream: the shard's own stream (its events, kept in its page list).
    Own,
    /// One range shared by several streams (`range:shared`): every stream that freed
    /// something there, through `clocks`; `me` is the stream allocating.
    Shared {
        /// Every stream's events.
        clocks: &'a mut StreamClocks,
        /// The allocating stream's index in `clocks`.
        me: u32,
        /// Virtual pages that got a physical page last used through another virtual page:
        /// the allocating stream has waited for its last users, and other streams' blocks
        /// placed on it later must wait for the allocating stream (see
        /// `SharedCore::allocate`).
        moved_in: &'a mut Vec<u32>,
        /// Several streams place in the range (before the switch of `range:auto`, one).
        together: bool,
        /// Peak of the bytes asked for by the blocks live in the range (the sizes requested,
        /// as the 1.02 bound counts them), this request included, once several streams place
        /// there (0 otherwise): the measure of the spare pages the pool may keep instead of
        /// remapping ([`PolicyOptions::shared_spare`]). Set by the range where a block needs
        /// pages, the only place the pool reads it.
        live_peak: u64,
        /// The bytes this request asked for (before rounding).
        requested: u64,
    },
}

/// Largest block a page-aware range places at the high end of its free block (see
/// [`Stitched::page_aware`]): a model's biases and norms, a server's small tensors. Larger
/// blocks placed there split the holes that later large blocks fill: replayed, every limit
/// from 16 to 128 KiB gives the same memory on the 13 traces (the server 1.0191), while
/// 256 KiB and up, the first page-aware range of a program with one stream costs the ViT
/// trace 1.0083 -> 1.0134 of live and 12-16 driver calls in its last quarter.
const PAGE_AWARE_MAX: u64 = 64 << 10;

/// Largest block the quick cache keeps (smaller blocks share their pages with neighbours, so
/// keeping them counted on their pages while cached costs next to no memory).
const QUICK_MAX: u64 = 1 << 20;

/// A physical page. Its owner (the stream that uses it, or let go of it last) changes only
/// under the pool's lock.
struct Phys {
    handle: PhysHandle,
    owner: u32,
    /// Every (shard, virtual page) it is mapped at.
    aliases: Vec<(u32, u32)>,
}

/// What one stream keeps: its page table and the pages it let go of.
struct Local {
    /// Virtual page -> physical slot, or NONE.
    map: Vec<u32>,
    /// Virtual page -> pool epoch when it last went idle (its blocks' work was all queued by
    /// then): what unmapping it waits for. Its physical page's own stamp may be later, when
    /// another virtual page mapped to it went idle since.
    vstamp: Vec<u64>,
    /// Idle pages owned by this stream, least recently idled first, and what the stream
    /// knows of every slot (see [`SlotNote`]).
    idle: FreeList,
    /// Pages this stream uses now, and their peak.
    busy: u64,
    peak_busy: u64,
    /// Events recorded on this stream by recent slow paths, with the pool epoch of each: a
    /// page that went idle before one that has completed can be unmapped without waiting.
    events: std::collections::VecDeque<(u64, crate::backend::EventHandle)>,
    /// Pages taken from another stream's idle list went idle since the last event recorded
    /// on this stream (the other stream may take them back through its old mapping).
    idle_unmarked: bool,
    /// Another stream had to wait for all this stream's queued work to take a page from it:
    /// record marks (see `PagePool::mark`).
    marks_wanted: bool,
}

/// Recent events kept per stream. A page that went idle is unmapped after the first of them
/// recorded after it, so the longer the history, the less the host waits for work queued
/// later (simulated GPU 10 ms behind the host: host waits 99 → 64 on the GPT-2 random-length
/// trace with 4 kept, 58 → 17 on the prefetch trace).
const EPOCH_EVENTS: usize = 64;

impl Local {
    /// Virtual page `v`, which a new block is the first to touch, takes its page back from
    /// this stream's idle list if it is there (counted in `scratch.fast`); otherwise it is left
    /// for the slow path (`scratch.need`). See [`PagePool::claim`].
    #[inline]
    fn take_idle(&mut self, v: u32, scratch: &mut ClaimScratch) {
        // An unmapped page (NONE) is in no list: `remove` finds no note for it.
        let slot = self.map[v as usize];
        if let Some(note) = self.idle.remove(slot) {
            scratch.fast += 1;
            if note.via != v {
                scratch.moved.push((slot, v));
            }
        } else {
            scratch.need.push(v);
        }
    }

    /// Virtual page `v`, which no block touches any more, lets its page go idle, still mapped,
    /// at pool epoch `epoch`. See [`PagePool::released`].
    #[inline]
    fn let_go(&mut self, v: u32, epoch: u64) {
        let slot = self.map[v as usize];
        debug_assert!(slot != NONE, "released page was mapped");
        self.vstamp[v as usize] = epoch;
        let note = self.idle.push_back(slot);
        note.stamp = epoch;
        note.via = v;
        self.idle_unmarked |= note.foreign;
    }

    /// Makes the slot notes cover slots `0..n` (every slot the pool has made), so that the
    /// fast paths index them without growing them.
    fn fit_slots(&mut self, n: usize) {
        self.idle.fit(n);
    }

    /// The first event this stream recorded after pool epoch `idle_since` (when a page went
    /// idle), if one is still kept: waiting for it covers the work queued before the page went
    /// idle and nothing queued later.
    fn covering_event(&self, idle_since: u64) -> Option<crate::backend::EventHandle> {
        if idle_since == u64::MAX {
            return None;
        }
        self.events
            .iter()
            .find(|&&(e, _)| e > idle_since)
            .map(|&(_, ev)| ev)
    }
}

struct ShardPages {
    stream: Stream,
    base: u64,
    /// Other shards may take its idle pages. Not a shared range's: its pages were last used
    /// by any of its streams, which only the range's own slow path knows how to wait for.
    /// Cleared when a stream's range becomes the shared one (written under the pool's lock,
    /// which every reader holds).
    lends: AtomicBool,
    local: LocalLock,
}

struct Pages {
    phys: Vec<Option<Phys>>,
    spare: Vec<u32>,
    held: u64,
    remaps: u64,
    shards: Vec<Arc<ShardPages>>,
    /// Highest total of pages in use seen by a slow path.
    peak_seen: u64,
    /// Driver time of the slow paths that took pages from other streams, in the current
    /// window (see `PagePool::note_trade`).
    trades: BudgetWindow,
    /// When and why the streams stopped taking each other's pages, if they did.
    stopped_trading: Option<TradeStop>,
    /// Driver time of the slow paths that remapped, in the current window (see
    /// `PagePool::note_remap`).
    remaps_window: BudgetWindow,
    /// Pages created since the pool began; that count and `remaps` when the current remap
    /// window began (to tell a growing pool from a churning one).
    created: u64,
    created_at_window: u64,
    remaps_at_window: u64,
    /// Remap windows in a row over the budget while the pool was not growing.
    over_in_a_row: u32,
    /// Spare pages added by the remap budget (share of the peak in use), and why.
    raised: SpareRaise,
    /// Pages made where streams share a range instead of remapping an idle one
    /// (`shared_spare`).
    shared_spares: u64,
}

/// Slow paths of one kind (trades, remaps) since a window started, on the device's clock.
#[derive(Default)]
struct BudgetWindow {
    /// Device clock at the window's start (None: none yet).
    start_us: Option<u64>,
    cost_s: f64,
    count: u64,
}

/// A window closed by `BudgetWindow::add`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClosedWindow {
    /// Device clock at its end, microseconds (trace time in a replay).
    pub at_us: u64,
    /// Its length.
    pub window_us: u64,
    /// Driver seconds its slow paths took.
    pub cost_s: f64,
    /// Slow paths counted in it.
    pub count: u64,
}

impl ClosedWindow {
    /// Share of the window spent in the driver.
    pub fn share(&self) -> f64 {
        self.cost_s / (self.window_us as f64 * 1e-6).max(1e-9)
    }
}

impl BudgetWindow {
    /// Counts a slow path that cost `cost_s` of driver time, ending at `now_us`. Once the
    /// window spans [`TRADE_WINDOW_US`] from its first slow path (taken to have started
    /// `cost_s` before it ended), returns it and starts the next one. With a `budget`, it is
    /// returned as soon as its driver time alone is more than that share of a whole window:
    /// the verdict is then known, and waiting for the window's end only prolongs what the
    /// budget is there to stop (eight threads on their own streams: the timed runs of
    /// `gpumem bench alloc` are 27 ms each, so a whole window spanned the first three).
    fn add(&mut self, cost_s: f64, now_us: u64, budget: Option<f64>) -> Option<ClosedWindow> {
        let start = *self
            .start_us
            .get_or_insert(now_us.saturating_sub((cost_s * 1e6) as u64));
        self.cost_s += cost_s;
        self.count += 1;
        let window_us = now_us.saturating_sub(start);
        let over = budget.is_some_and(|b| self.cost_s > b * TRADE_WINDOW_US as f64 * 1e-6);
        if window_us < TRADE_WINDOW_US && !over {
            return None;
        }
        let closed = ClosedWindow {
            at_us: now_us,
            window_us,
            cost_s: self.cost_s,
            count: self.count,
        };
        *self = BudgetWindow {
            start_us: Some(now_us),
            ..BudgetWindow::default()
        };
        Some(closed)
    }
}

/// Spare pages the remap budget added, and the last window that went over it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SpareRaise {
    /// Share of the peak in use added to `slack`.
    pub added: f64,
    /// Times the spare pages were raised (see `PagePool::note_remap`).
    pub raises: u32,
    /// The last of them.
    pub last: Option<ClosedWindow>,
    /// The budget (share of the time).
    pub budget: f64,
}

impl std::fmt::Display for SpareRaise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(w) = self.last else {
            return write!(f, "stitched: remapping stayed within its budget");
        };
        write!(
            f,
            "stitched: spare pages raised to {:.0} % of the peak in use, in {} step(s), as \
             remapping went over the remap_budget of {:.0} % (the last time at {:.1} s: {} \
             allocations that remapped spent {:.1} ms in driver calls in {:.1} ms, {:.0} %); a \
             virtual page that would be remapped gets a page of its own instead, which holds \
             more memory and makes fewer driver calls",
            100.0 * self.added,
            self.raises,
            100.0 * self.budget,
            w.at_us as f64 * 1e-6,
            w.count,
            w.cost_s * 1e3,
            w.window_us as f64 * 1e-3,
            100.0 * w.share()
        )
    }
}

/// The window in which page trading went over its budget, after which each stream keeps its
/// own peak of pages (as with `stream_pages:own`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TradeStop {
    /// The window; its slow paths are the allocations that took pages from another stream.
    pub window: ClosedWindow,
    /// The budget they went over (share of the window).
    pub budget: f64,
}

impl std::fmt::Display for TradeStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stitched: the streams stopped taking each other's idle pages: {} allocations that took \
             pages from another stream spent {:.1} ms in driver calls in {:.1} ms ({:.0} %, over \
             the trade_budget of {:.0} %); from then on each stream keeps as many pages as its \
             own peak (as with stream_pages:own), which holds more memory and makes fewer driver \
             calls",
            self.window.count,
            self.window.cost_s * 1e3,
            self.window.window_us as f64 * 1e-3,
            100.0 * self.window.share(),
            100.0 * self.budget
        )
    }
}

/// Physical pages shared by the stitched policy's streams on one device.
pub struct PagePool {
    inner: Mutex<Pages>,
    /// Advanced by every slow-path operation; stamps idle pages (read without the lock).
    epoch: AtomicU64,
    page: u64,
    slack: f64,
    /// Each stream keeps its own peak (`stream_pages:own`, or trading went over its budget).
    own_stream_peaks: AtomicBool,
    trade_budget: f64,
    remap_budget: f64,
    shared_spare: f64,
    /// Its pages are handles of `page` bytes made for it (`create_chunk`), not the device's
    /// own pages: the second tier's larger pages (see [`PolicyOptions::big_page`]).
    chunked: bool,
    /// Streams registered: marks are recorded only when there are several.
    streams: AtomicU64,
    /// Maps no page any more (see [`PagePool::close`]).
    closed: AtomicBool,
    /// Pages the pool may hold whatever its own peak (see [`PagePool::allow`]).
    floor: AtomicU64,
    /// `Pages::held`, readable without the lock.
    held_pages: AtomicU64,
}

/// Counters of the page pool, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageCounters {
    /// Physical pages held.
    pub held: u64,
    /// Pages in use now.
    pub busy: u64,
    /// Highest total of pages in use seen when pages were taken from the pool (or one
    /// stream's own peak, if higher).
    pub peak_busy: u64,
    /// Virtual pages pointed at another physical page (unmap + map).
    pub remaps: u64,
}

/// Every stream's list locked, in index order.
struct AllLocals<'a> {
    guards: Vec<LocalGuard<'a>>,
}

impl PagePool {
    /// A pool for the device `info`.
    pub fn new(info: &DeviceInfo, opts: &PolicyOptions) -> Self {
        Self {
            inner: Mutex::new(Pages {
                phys: Vec::new(),
                spare: Vec::new(),
                held: 0,
                remaps: 0,
                shards: Vec::new(),
                peak_seen: 0,
                trades: BudgetWindow::default(),
                stopped_trading: None,
                remaps_window: BudgetWindow::default(),
                created: 0,
                shared_spares: 0,
                created_at_window: 0,
                remaps_at_window: 0,
                over_in_a_row: 0,
                raised: SpareRaise {
                    budget: opts.remap_budget,
                    ..SpareRaise::default()
                },
            }),
            epoch: AtomicU64::new(0),
            page: info.page_bytes,
            slack: opts.slack.max(0.0),
            own_stream_peaks: AtomicBool::new(opts.own_stream_peaks),
            trade_budget: opts.trade_budget,
            remap_budget: opts.remap_budget,
            shared_spare: opts.shared_spare.max(0.0),
            chunked: false,
            streams: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            floor: AtomicU64::new(0),
            held_pages: AtomicU64::new(0),
        }
    }

    /// Lets the pool make pages up to `pages` held even where its own peak of pages in use is
    /// lower (never lowers an earlier allowance): the second tier's, which takes over the
    /// blocks of the first. Without it the second tier, whose own peak is low while the
    /// blocks move over, remaps its idle pages with a host wait each instead of making new
    /// ones: the Llama decoder, whose pool stops at the 4 GiB threshold, waited 1,346 times
    /// against 52 (BENCHMARKS.md §1, session 28).
    pub fn allow(&self, pages: u64) {
        // Read first: the allowance rarely rises, and a read leaves the line shared.
        if pages > self.floor.load(Ordering::Relaxed) {
            self.floor.fetch_max(pages, Ordering::Relaxed);
        }
    }

    /// From now on the pool maps no page: it takes a block only where the block's pages are
    /// still mapped and idle in place (the fast path of `PagePool::claim`); any other block
    /// is refused as out of memory before anything changes, so that the tier above places it
    /// on another pool (see `policy/tiered.rs`). Remapping its idle pages instead would take
    /// a host wait for each (their stream's work must be done), and the blocks it would
    /// place differ from step to step: GPT-2 kept remapping, 20 waits per quarter of the run.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// A pool of `page`-byte pages made as handles of that size, for the second tier of
    /// [`PolicyOptions::big_page`].
    pub fn with_pages_of(info: &DeviceInfo, opts: &PolicyOptions, page: u64) -> Self {
        let mut p = Self::new(info, opts);
        p.page = page;
        p.chunked = page != info.page_bytes;
        p
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> u64 {
        self.page
    }

    /// Bytes of the pages held, without taking the pool's lock (a slow path may be changing
    /// it: the count as of its last change).
    pub fn held_bytes(&self) -> u64 {
        self.held_pages.load(Ordering::Relaxed) * self.page
    }

    /// A new page.
    fn create(&self, d: &mut DeviceState) -> Result<PhysHandle, BackendError> {
        if self.chunked {
            d.create_chunk(self.page, Pool::Large)
        } else {
            d.create_page(Pool::Large)
        }
    }

    /// Gives page `h` back to the device.
    fn release(&self, d: &mut DeviceState, h: PhysHandle) -> Result<(), BackendError> {
        if self.chunked {
            d.release_chunk(h, self.page, Pool::Large)
        } else {
            d.release_page(h, Pool::Large)
        }
    }

    /// Counters now.
    pub fn counters(&self) -> PageCounters {
        let p = self.inner.lock();
        let mut c = PageCounters {
            held: p.held,
            remaps: p.remaps,
            peak_busy: p.peak_seen,
            ..PageCounters::default()
        };
        for sh in &p.shards {
            let l = sh.local.lock();
            c.busy += l.busy;
            c.peak_busy = c.peak_busy.max(l.peak_busy);
        }
        c
    }

    /// Shard `shard`'s idle pages are no longer lent to other shards (its range became a
    /// shared one, see [`Stitched::keeps_pages`]).
    fn stop_lending(&self, shard: u32) {
        let p = self.inner.lock();
        if let Some(sh) = p.shards.get(shard as usize) {
            sh.lends.store(false, Ordering::Relaxed);
        }
    }

    fn register(
        &self,
        stream: Stream,
        base: u64,
        pages: u64,
        lends: bool,
    ) -> (u32, Arc<ShardPages>) {
        let mut p = self.inner.lock();
        let mut local = Local {
            map: vec![NONE; pages as usize],
            vstamp: vec![0; pages as usize],
            idle: FreeList::default(),
            busy: 0,
            peak_busy: 0,
            events: std::collections::VecDeque::new(),
            idle_unmarked: false,
            marks_wanted: false,
        };
        local.fit_slots(p.phys.len());
        let sh = Arc::new(ShardPages {
            stream,
            base,
            lends: AtomicBool::new(lends),
            local: LocalLock::new(local),
        });
        p.shards.push(sh.clone());
        self.streams.store(p.shards.len() as u64, Ordering::Relaxed);
        ((p.shards.len() - 1) as u32, sh)
    }

    fn lock_all(shards: &[Arc<ShardPages>]) -> AllLocals<'_> {
        AllLocals {
            guards: shards.iter().map(|s| s.local.lock()).collect(),
        }
    }

    /// Finishes a claim begun by [`Local::take_idle`] on shard `me`'s list `l` (locked by the
    /// caller): the pages taken from its own idle list count as busy, and the virtual pages
    /// left in `block.scratch.need` get pages through the slow path. On failure nothing is
    /// claimed.
    fn claim(
        &self,
        me: u32,
        mine: &ShardPages,
        mut l: LocalGuard<'_>,
        dev: &Device,
        block: &Touched,
        order: &mut Order,
    ) -> Result<(), BackendError> {
        let ClaimScratch { need, fast, moved } = block.scratch;
        if !need.is_empty() && self.closed.load(Ordering::Relaxed) {
            block.put_back(&mut l);
            return Err(BackendError::oom(
                DriverCall::MemMap,
                format!(
                    "the pool maps no more pages: {} of the block's pages are not idle in place",
                    need.len()
                ),
            ));
        }
        if let Order::Shared {
            clocks,
            me: acting,
            moved_in,
            ..
        } = order
        {
            if !moved.is_empty() {
                // Taken back through another virtual page than the one it went idle from: the
                // bytes' last users, of any stream, are not found by the block's address.
                let since = moved.iter().map(|&(s, _)| l.idle.note(s).stamp).max();
                let to = Wait::Device(clocks.stream(*acting));
                let settled = since.map_or(Ok(()), |since| {
                    let mut d = dev.lock();
                    clocks.settle_all(&mut d, self, since, to, Some(*acting))
                });
                if let Err(e) = settled {
                    block.put_back(&mut l);
                    return Err(e);
                }
                moved_in.extend(moved.iter().map(|&(_, v)| v));
            }
        }
        // A page taken back through another virtual page than the one it went idle from
        // leaves that one pointing at a page in use: when a block next needs it, it must be
        // unmapped after the work queued before it went idle. If no event was recorded on the
        // stream since then, one is recorded now (once per request, not per page), so that
        // the later unmap finds it long completed instead of recording a fresh one and making
        // the host wait for everything queued by then (GPT-2 with random lengths: one such
        // wait of 24-31 ms in each step that remapped, session 22).
        let newest = l.events.back().map_or(0, |&(e, _)| e);
        if matches!(order, Order::Own)
            && moved
                .iter()
                .any(|&(s, _)| l.vstamp[l.idle.note(s).via as usize] >= newest)
        {
            let mut d = dev.lock();
            let epoch = self.next_epoch();
            if let Ok(ev) = d.event_record(mine.stream) {
                Self::push_event(&mut l, epoch, ev, &mut d);
            }
        }
        l.busy += *fast as u64;
        if need.is_empty() {
            l.peak_busy = l.peak_busy.max(l.busy);
            return Ok(());
        }
        drop(l);
        let result = self.claim_slow(me, need, dev, order);
        let mut l = mine.local.lock();
        match result {
            Ok(()) => {
                l.busy += need.len() as u64;
                l.peak_busy = l.peak_busy.max(l.busy);
                Ok(())
            }
            Err(e) => {
                // Put back what was taken for this request.
                l.busy -= *fast as u64;
                block.put_back(&mut l);
                Err(e)
            }
        }
    }

    /// Finds and maps physical pages for `need` (virtual pages of shard `me`). Out of line,
    /// so that the fast paths it is called from keep their registers.
    #[cold]
    #[inline(never)]
    fn claim_slow(
        &self,
        me: u32,
        need: &[u32],
        dev: &Device,
        order: &mut Order,
    ) -> Result<(), BackendError> {
        let mut p = self.inner.lock();
        let epoch = self.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        let shards = p.shards.clone();
        let mut all = Self::lock_all(&shards);
        let mut d = dev.lock();
        let driver_before = d.driver_seconds();
        let m = me as usize;
        // The pages the pool may hold. By default the peak of pages in use across streams:
        // the highest total a slow path has seen, and no less than any one stream's own peak
        // (exact with one stream; with several it may be low, which costs remaps, never
        // memory). With `stream_pages:own`, the sum of each stream's own peak: a stream keeps
        // as many pages as it once used instead of taking them from the others, which with
        // many streams trades idle pages back and forth (eight threads on their own streams:
        // 1,310 calls per run on the simulated device by default, 22 with their own peaks).
        let busy: u64 = all.guards.iter().map(|l| l.busy).sum::<u64>() + need.len() as u64;
        p.peak_seen = p.peak_seen.max(busy);
        let own = all.guards[m].busy + need.len() as u64;
        let peaks = all.guards.iter().enumerate().map(|(i, l)| {
            if i == m {
                l.peak_busy.max(own)
            } else {
                l.peak_busy
            }
        });
        let own_peaks = self.own_stream_peaks.load(Ordering::Relaxed);
        let peak = if own_peaks {
            peaks.sum::<u64>()
        } else {
            peaks.max().unwrap_or(0)
        }
        .max(p.peak_seen);
        let budget = (((1.0 + self.slack + p.raised.added) * peak as f64).ceil() as u64)
            .max(self.floor.load(Ordering::Relaxed));
        // Several streams in one range interleave differently from one step to the next, so
        // their layouts do not repeat as a single stream's do: a page is made rather than
        // remapped while the pages held stay within `shared_spare` of the live peak.
        let spare_cap = match order {
            Order::Shared { live_peak, .. } => {
                ((1.0 + self.shared_spare) * *live_peak as f64 / self.page as f64) as u64
            }
            Order::Own => 0,
        };
        let remaps_before = p.remaps;
        // Streams whose idle pages are taken, with the latest epoch one of them went idle.
        let mut others: Vec<(u32, u64)> = Vec::new();
        // 1. Virtual pages whose page idles in another stream's list: take it over (with own
        //    peaks, only once no new page may be made: streams that shared pages before
        //    trading stopped part, each mapping pages of its own).
        // 2. The rest get a page: created (within the budget), or the oldest idle one.
        let mut picked: Vec<(u32, u32)> = Vec::new(); // (virtual page, slot)
        let mut taken: Vec<(u32, u32)> = Vec::new(); // (slot, previous owner) to undo
        let mut created: Vec<u32> = Vec::new();
        let mut todo: Vec<u32> = Vec::new();
        // Idle pages this shard may take: its own, and those of shards that lend.
        let may_take = |i: usize| i == m || shards[i].lends.load(Ordering::Relaxed);
        for &v in need {
            let slot = all.guards[m].map[v as usize];
            if slot != NONE {
                let owner = p.phys[slot as usize].as_ref().expect("mapped slot").owner;
                let shared =
                    may_take(owner as usize) && (owner == me || !own_peaks || p.held >= budget);
                if shared && all.guards[owner as usize].idle.remove(slot).is_some() {
                    taken.push((slot, owner));
                    picked.push((v, slot));
                    continue;
                }
            }
            todo.push(v);
        }
        let idle_total = |all: &AllLocals| {
            (0..all.guards.len())
                .filter(|&i| may_take(i))
                .map(|i| all.guards[i].idle.len())
                .sum::<usize>()
        };
        for &v in &todo {
            let idle = idle_total(&all);
            let reserve = !self.chunked && d.reserve_unused() > 0;
            // A page only `shared_spare` allows: idle pages exist, nothing else asks for one.
            let spare = idle > 0 && p.held >= budget && p.held < spare_cap && !reserve;
            let want_new = idle == 0 || p.held < budget || reserve || spare;
            let mut slot = None;
            if want_new {
                match self.create(&mut d) {
                    Ok(h) => {
                        let s = Self::new_slot(&mut p, &mut all, h, me);
                        self.held_pages.store(p.held, Ordering::Relaxed);
                        created.push(s);
                        p.created += 1;
                        if spare {
                            p.shared_spares += 1;
                        }
                        slot = Some(s);
                    }
                    Err(e) if e.out_of_memory && idle_total(&all) > 0 => {}
                    Err(e) => {
                        self.undo(&mut p, &mut all, &taken, &created, &mut d);
                        return Err(e);
                    }
                }
            }
            let s = match slot {
                Some(s) => s,
                None => {
                    // The least recently idled page of any stream. (Replays showed that
                    // predicting reuse from each virtual page's past idle gaps does no better.)
                    let (_, i, s) = (0..all.guards.len())
                        .filter(|&i| may_take(i))
                        .filter_map(|i| {
                            let l = &all.guards[i];
                            l.idle.front().map(|s| (l.idle.note(s).stamp, i, s))
                        })
                        .min()
                        .expect("an idle page exists");
                    all.guards[i].idle.remove(s);
                    taken.push((s, i as u32));
                    s
                }
            };
            picked.push((v, s));
        }
        // Every taken page changes owner once the request succeeds; the previous owner's work
        // must come first.
        for &(s, prev) in &taken {
            if prev != me {
                others.push((prev, all.guards[prev as usize].idle.note(s).stamp));
            }
        }
        let traded = !others.is_empty();
        if let Order::Shared {
            clocks,
            me: acting,
            moved_in,
            ..
        } = order
        {
            // In a shared range a page taken from the idle list was last used, through
            // whichever virtual page, by any of the streams: the allocating stream waits (on
            // the device) for each other stream's work up to when the page went idle.
            let since = taken
                .iter()
                .map(|&(s, o)| all.guards[o as usize].idle.note(s).stamp)
                .filter(|&t| t != u64::MAX)
                .max();
            if let Some(since) = since {
                let to = Wait::Device(clocks.stream(*acting));
                if let Err(e) = clocks.settle_all(&mut d, self, since, to, Some(*acting)) {
                    self.undo(&mut p, &mut all, &taken, &created, &mut d);
                    return Err(e);
                }
            }
            moved_in.extend(
                picked
                    .iter()
                    .filter(|&&(_, s)| !created.contains(&s))
                    .map(|&(v, _)| v),
            );
        }
        let mut mapped: Vec<u32> = Vec::new();
        let connected = self.connect(
            &mut p,
            &mut all,
            &mut d,
            me,
            epoch,
            &picked,
            &mut others,
            &mut mapped,
            order,
        );
        if let Err(e) = connected {
            // The driver refused a call part-way. What it did is already in the page tables
            // (each unmap and map is recorded as it succeeds); take back this request's new
            // mappings, whose access may not be set and whose stream order is not yet
            // established, and return the picked pages to where they came from.
            mapped.sort_unstable();
            for run in runs(&mapped) {
                let (va, n) = (p.shards[m].base + run.0 as u64 * self.page, run.1 as u64);
                if d.unmap(va, n * self.page, n).is_err() {
                    continue; // left mapped and recorded as such: a later trim unmaps it
                }
                for v in run.0..run.0 + run.1 {
                    let s = all.guards[m].map[v as usize];
                    if let Some(ph) = p.phys[s as usize].as_mut() {
                        ph.aliases.retain(|&a| a != (me, v));
                    }
                    all.guards[m].map[v as usize] = NONE;
                }
            }
            self.undo(&mut p, &mut all, &taken, &created, &mut d);
            return Err(e);
        }
        for &(s, prev) in &taken {
            if prev != me {
                all.guards[m].idle.note_mut(s).foreign = true;
            }
            p.phys[s as usize].as_mut().expect("taken slot").owner = me;
        }
        let remapped = p.remaps > remaps_before;
        if traded || remapped {
            let cost = d.driver_seconds() - driver_before;
            let now = dev.now_us();
            if traded {
                self.note_trade(&mut p, &mut all, cost, now);
            }
            if remapped {
                self.note_remap(&mut p, cost, now);
            }
        }
        Ok(())
    }

    /// Counts a slow path that took pages from another stream and cost `cost_s` of driver
    /// time, at `now_us` on the device's clock. Once a window of at least [`TRADE_WINDOW_US`]
    /// has passed since the window's first trade, its trades' driver time is held against the
    /// budget: over it, the streams stop taking each other's pages for good; under it, a new
    /// window starts. Trading saves memory only while it is cheap against the work around
    /// it: a server's threads that move a few pages per request pay 2–4 % of their time,
    /// threads that do nothing but allocate pay over half of theirs (docs/stitched.md).
    fn note_trade(&self, p: &mut Pages, all: &mut AllLocals, cost_s: f64, now_us: u64) {
        if !self.trade_budget.is_finite() || self.own_stream_peaks.load(Ordering::Relaxed) {
            return;
        }
        let Some(w) = p.trades.add(cost_s, now_us, Some(self.trade_budget)) else {
            return;
        };
        if w.share() > self.trade_budget {
            self.own_stream_peaks.store(true, Ordering::Relaxed);
            // The pages each stream took from others are its own from now on: no marks for
            // handing them back (see `mark`), unless trading resumes at the memory cap.
            for l in all.guards.iter_mut() {
                l.idle.forget_foreign();
                l.marks_wanted = false;
                l.idle_unmarked = false;
            }
            p.stopped_trading = Some(TradeStop {
                window: w,
                budget: self.trade_budget,
            });
        }
    }

    /// Counts a slow path that remapped virtual pages (unmapped them to point them at other
    /// physical pages) and cost `cost_s` of driver time, at `now_us`. After
    /// [`REMAP_WINDOWS_IN_A_ROW`] windows in a row over `remap_budget` in which the pool was
    /// not growing, the spare pages rise by the last window's share of the time times
    /// [`REMAP_SLACK_MAX`] (up to [`REMAP_SLACK_MAX`] in all): from then on a
    /// virtual page that would be remapped gets a new page of its own while the pages held are
    /// under the raised cap, and keeps it. A layout that repeats stops remapping after its
    /// first steps and a warm-up grows the pool, so neither pays; a layout that keeps moving
    /// (random sizes, batch shapes that change every step) buys back time with memory.
    fn note_remap(&self, p: &mut Pages, cost_s: f64, now_us: u64) {
        if !self.remap_budget.is_finite() || p.raised.added >= REMAP_SLACK_MAX - 1e-9 {
            return;
        }
        let Some(w) = p.remaps_window.add(cost_s, now_us, None) else {
            return;
        };
        let (made, moved) = (
            p.created - p.created_at_window,
            p.remaps - p.remaps_at_window,
        );
        // Still growing: the window made at least a tenth as many pages as it remapped (a
        // warm-up, a new largest batch). Spare pages would add to what growth adds anyway.
        let grew = made * 10 >= moved.max(1);
        p.created_at_window = p.created;
        p.remaps_at_window = p.remaps;
        if w.share() > self.remap_budget && !grew {
            p.over_in_a_row += 1;
        } else {
            p.over_in_a_row = 0;
        }
        if p.over_in_a_row >= REMAP_WINDOWS_IN_A_ROW {
            p.over_in_a_row = 0;
            let step = REMAP_SLACK_MAX * w.share().min(1.0);
            p.raised.added = (p.raised.added + step).min(REMAP_SLACK_MAX);
            p.raised.raises += 1;
            p.raised.last = Some(w);
        }
    }

    /// The spare pages the remap budget added (see [`PolicyOptions::remap_budget`]), if it
    /// added any.
    pub fn spare_raised(&self) -> Option<SpareRaise> {
        let p = self.inner.lock();
        (p.raised.raises > 0).then_some(p.raised)
    }

    /// What `shared_spare` did, if it made any page: a line for the policy's notes.
    pub fn shared_spare_note(&self) -> Option<String> {
        let n = self.inner.lock().shared_spares;
        (n > 0).then(|| {
            format!(
                "stitched: streams share a range, so {n} time(s) a page was made instead of \
                 remapping an idle one, the pages held staying within {:.1} % of the range's live \
                 peak (shared_spare; shared_spare:0 turns it off)",
                100.0 * self.shared_spare
            )
        })
    }

    /// When and why the streams stopped taking each other's pages (see
    /// [`PolicyOptions::trade_budget`]), if they did.
    pub fn trading_stopped(&self) -> Option<TradeStop> {
        self.inner.lock().stopped_trading
    }

    /// The fallible part of [`Self::claim_slow`]: unmaps the virtual pages of shard `me` that
    /// still show another page (once their stream's earlier work is done), maps the picked
    /// pages, sets their access, and makes the stream wait for the streams whose pages it
    /// took. Every unmap and map is recorded in the page tables as soon as it succeeds, and the
    /// virtual pages newly mapped are pushed to `mapped`, so that a failure part-way leaves the
    /// tables true to the driver.
    #[allow(clippy::too_many_arguments)]
    fn connect(
        &self,
        p: &mut Pages,
        all: &mut AllLocals,
        d: &mut DeviceState,
        me: u32,
        epoch: u64,
        picked: &[(u32, u32)],
        others: &mut [(u32, u64)],
        mapped: &mut Vec<u32>,
        order: &mut Order,
    ) -> Result<(), BackendError> {
        let m = me as usize;
        let base = p.shards[m].base;
        // Virtual pages still pointing at a page in use elsewhere are unmapped first, once
        // their stream's earlier work is done.
        let stale: Vec<u32> = picked
            .iter()
            .filter(|&&(v, s)| {
                let cur = all.guards[m].map[v as usize];
                cur != NONE && cur != s
            })
            .map(|&(v, _)| v)
            .collect();
        if !stale.is_empty() {
            // The stream's work before the virtual pages went idle must be done (their own
            // idle stamps: the physical pages behind them may have gone idle later through
            // other virtual pages). An event recorded after that (by a slow path, or when the
            // page was taken through another virtual page, see `claim`) usually has
            // completed: then nothing waits.
            let idle_since = stale
                .iter()
                .map(|&v| all.guards[m].vstamp[v as usize])
                .max()
                .unwrap_or(u64::MAX);
            match order {
                // In a shared range, every stream that freed blocks there before the pages
                // went idle.
                Order::Shared { clocks, .. } => {
                    clocks.settle_all(d, self, idle_since, Wait::Host, None)?
                }
                Order::Own => match all.guards[m].covering_event(idle_since) {
                    Some(ev) => {
                        if !d.event_query(ev)? {
                            d.event_synchronize(ev)?;
                        }
                    }
                    None => {
                        let ev = d.event_record(p.shards[m].stream)?;
                        let waited = d.event_synchronize(ev);
                        d.event_destroy(ev);
                        waited?;
                    }
                },
            }
            let mut sorted = stale;
            sorted.sort_unstable();
            for run in runs(&sorted) {
                let (va, n) = (base + run.0 as u64 * self.page, run.1 as u64);
                d.unmap(va, n * self.page, n)?;
                for v in run.0..run.0 + run.1 {
                    let old = all.guards[m].map[v as usize];
                    if let Some(ph) = p.phys[old as usize].as_mut() {
                        ph.aliases.retain(|&a| a != (me, v));
                    }
                    all.guards[m].map[v as usize] = NONE;
                    p.remaps += 1;
                }
            }
        }
        for &(v, s) in picked {
            if all.guards[m].map[v as usize] == s {
                continue; // taken over through its existing mapping
            }
            let ph = p.phys[s as usize].as_mut().expect("picked slot");
            d.map(base + v as u64 * self.page, self.page, ph.handle)?;
            ph.aliases.push((me, v));
            all.guards[m].map[v as usize] = s;
            mapped.push(v);
        }
        let mut fresh = mapped.clone();
        fresh.sort_unstable();
        for run in runs(&fresh) {
            let (va, n) = (base + run.0 as u64 * self.page, run.1 as u64);
            d.set_access(va, n * self.page, n)?;
        }
        // This stream waits (on the device) for the other streams' work up to when their
        // pages went idle: an event they recorded after that if there is one (waiting for
        // their later work, such as the next prefetch, would serialise the streams), else a
        // fresh one.
        others.sort_unstable();
        // The stream that will use the pages: in a shared range the allocating one, not the
        // stream the range's shard was made for (pages a stream idled in a range of its own
        // reach the shared range only through these waits).
        let stream = match order {
            Order::Shared { clocks, me, .. } => clocks.stream(*me),
            Order::Own => p.shards[m].stream,
        };
        let mut i = 0;
        while i < others.len() {
            let o = others[i].0;
            let mut idle_since = 0;
            while i < others.len() && others[i].0 == o {
                idle_since = idle_since.max(others[i].1);
                i += 1;
            }
            let covering = all.guards[o as usize].covering_event(idle_since);
            match covering {
                Some(ev) => d.stream_wait_event(stream, ev)?,
                None => {
                    let ev = d.event_record(p.shards[o as usize].stream)?;
                    // Still running: this stream now waits for all of `o`'s queued work, not
                    // just what came before the pages went idle. From now on `o` marks its
                    // place when such pages go idle (see `mark`).
                    let waited = d.event_query(ev).and_then(|done| {
                        if !done {
                            all.guards[o as usize].marks_wanted = true;
                        }
                        d.stream_wait_event(stream, ev)
                    });
                    d.event_destroy(ev);
                    waited?;
                }
            }
        }
        // Mark this point of the stream's work for later remaps (see above). Best effort, as
        // in `mark`: without it a later remap waits for a fresh event instead.
        match order {
            Order::Own => {
                if let Ok(ev) = d.event_record(stream) {
                    Self::push_event(&mut all.guards[m], epoch, ev, d);
                }
            }
            // A new epoch: events made by this slow path's waits took later ones.
            Order::Shared { clocks, me, .. } => clocks.mark(d, *me, self.next_epoch()),
        }
        Ok(())
    }

    /// Returns the pages picked for a request that failed: new ones to the device, taken ones
    /// to their owner's idle list. A new page the driver would not unmap or release stays as an
    /// idle page of its stream, so that a later trim tries again and nothing is lost.
    fn undo(
        &self,
        p: &mut Pages,
        all: &mut AllLocals,
        taken: &[(u32, u32)],
        created: &[u32],
        d: &mut DeviceState,
    ) {
        for &(s, owner) in taken {
            all.guards[owner as usize].idle.push_front(s);
        }
        for &s in created {
            let ph = p.phys[s as usize].as_ref().expect("created slot");
            if !ph.aliases.is_empty() || self.release(d, ph.handle).is_err() {
                all.guards[ph.owner as usize].idle.push_front(s);
                continue;
            }
            p.phys[s as usize] = None;
            p.spare.push(s);
            p.held -= 1;
        }
        self.held_pages.store(p.held, Ordering::Relaxed);
    }

    /// Files a new physical page in a free slot; every stream's per-slot arrays are made to
    /// cover it (see [`Local::fit_slots`]).
    fn new_slot(p: &mut Pages, all: &mut AllLocals, handle: PhysHandle, owner: u32) -> u32 {
        let ph = Phys {
            handle,
            owner,
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
                let slot = (p.phys.len() - 1) as u32;
                assert!(slot < OUT, "physical page slots exhausted");
                for l in all.guards.iter_mut() {
                    l.fit_slots(p.phys.len());
                }
                slot
            }
        }
    }

    /// Pool epoch now, the stamp [`Local::let_go`] gives pages going idle (see
    /// [`Local::covering_event`]). Only the stream's own slow paths and marks put events in its
    /// list, and they are ordered against its frees by the engine's lock on the stream, so the
    /// stamp is never older than an event recorded before the pages went idle.
    #[inline]
    pub(crate) fn epoch_now(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// A new epoch, for an event about to be recorded: later than every page stamped idle
    /// so far.
    pub(crate) fn next_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Shard `mine`'s list `l` let `n` pages go idle ([`Local::let_go`]); no shared state is
    /// touched. Returns whether the stream should now mark its place (see [`PagePool::mark`]).
    #[inline]
    fn released(&self, l: &mut Local, n: u64) -> bool {
        l.busy -= n;
        l.idle_unmarked && l.marks_wanted && self.streams.load(Ordering::Relaxed) >= 2
    }

    /// Records an event on `mine`'s stream if pages it took from another stream went idle
    /// since its last one. Another stream that takes one of those pages back then waits (on
    /// the device) for this point of the stream only; without it, it waits for everything
    /// queued on the stream by the time it takes the page (in a prefetch pipeline: the next
    /// batch's copy held behind the rest of this step's compute). Only once such a wait has
    /// met work still running (`marks_wanted`): where the streams' work is done by the time
    /// pages change hands (the allocation benchmark's threads launch no kernels), marks would
    /// be calls for nothing. One stream never hands pages over and records nothing.
    ///
    /// Best effort: it runs after a free has been done, and a mark that could not be recorded
    /// costs only a wait for a fresh event later, so a failure leaves the pages unmarked (the
    /// next free tries again) rather than failing the free.
    fn mark(&self, mine: &ShardPages, dev: &Device) {
        if self.streams.load(Ordering::Relaxed) < 2 {
            return;
        }
        let mut l = mine.local.lock();
        if !l.idle_unmarked || !l.marks_wanted {
            return;
        }
        let mut d = dev.lock();
        let epoch = self.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        if let Ok(ev) = d.event_record(mine.stream) {
            Self::push_event(&mut l, epoch, ev, &mut d);
        }
    }

    /// Keeps `ev`, recorded on `l`'s stream at pool epoch `epoch`, among its recent events.
    fn push_event(l: &mut Local, epoch: u64, ev: crate::backend::EventHandle, d: &mut DeviceState) {
        l.idle_unmarked = false;
        l.events.push_back((epoch, ev));
        if l.events.len() > EPOCH_EVENTS {
            if let Some((_, old)) = l.events.pop_front() {
                d.event_destroy(old);
            }
        }
    }

    /// Unmaps and releases every idle physical page. Returns the bytes released.
    /// Gives back the idle pages whose work is known done, without waiting: every virtual
    /// page a page is mapped at went idle before an event of its range's stream that has
    /// completed. Pages still in flight stay for a later call; pages of a range shared by
    /// streams are left (their last users may be any of its streams). Returns the bytes given
    /// back.
    pub fn trim_done(&self, dev: &Device) -> Result<u64, BackendError> {
        let mut p = self.inner.lock();
        let shards = p.shards.clone();
        let mut all = Self::lock_all(&shards);
        let slots: Vec<u32> = all.guards.iter().flat_map(|l| l.idle.iter()).collect();
        if slots.is_empty() {
            return Ok(0);
        }
        let mut d = dev.lock();
        let mut known: Vec<(crate::backend::EventHandle, bool)> = Vec::new();
        // Own ranges with idle pages that no event follows yet: one is recorded there, for a
        // later call to find completed.
        let mut unmarked: Vec<u32> = Vec::new();
        let mut released = 0;
        // Pages that went idle together sit together in the lists, with one stamp and so one
        // covering event: the last answer is kept, which saves the searches of a list of
        // thousands of idle pages (GPT-2 with random lengths past the tier switch: about 500
        // instructions a page, 87 calls over 2,200 pages each).
        let mut last_cover: Option<(u32, u64, Option<crate::backend::EventHandle>)> = None;
        let mut last_known: Option<(crate::backend::EventHandle, bool)> = None;
        for s in slots {
            let mut safe = true;
            for &(sh, v) in &p.phys[s as usize].as_ref().expect("idle slot").aliases {
                let l = &all.guards[sh as usize];
                if !shards[sh as usize].lends.load(Ordering::Relaxed) {
                    safe = false;
                    break;
                }
                let stamp = l.vstamp[v as usize];
                let cover = match last_cover {
                    Some((lsh, lstamp, ev)) if lsh == sh && lstamp == stamp => ev,
                    _ => {
                        let ev = l.covering_event(stamp);
                        last_cover = Some((sh, stamp, ev));
                        ev
                    }
                };
                let Some(ev) = cover else {
                    if !unmarked.contains(&sh) {
                        unmarked.push(sh);
                    }
                    safe = false;
                    break;
                };
                let done = match last_known {
                    Some((e, done)) if e == ev => done,
                    _ => {
                        let done = match known.iter().find(|(e, _)| *e == ev) {
                            Some(&(_, done)) => done,
                            None => {
                                let done = d.event_query(ev)?;
                                known.push((ev, done));
                                done
                            }
                        };
                        last_known = Some((ev, done));
                        done
                    }
                };
                if !done {
                    safe = false;
                    break;
                }
            }
            if !safe {
                continue;
            }
            self.give_back(&mut p, &mut all, &mut d, s)?;
            released += self.page;
        }
        for sh in unmarked {
            let epoch = self.next_epoch();
            if let Ok(ev) = d.event_record(p.shards[sh as usize].stream) {
                Self::push_event(&mut all.guards[sh as usize], epoch, ev, &mut d);
            }
        }
        Ok(released)
    }

    fn trim(&self, dev: &Device) -> Result<u64, BackendError> {
        let mut p = self.inner.lock();
        let shards = p.shards.clone();
        let mut all = Self::lock_all(&shards);
        let slots: Vec<u32> = all.guards.iter().flat_map(|l| l.idle.iter()).collect();
        if slots.is_empty() {
            return Ok(0);
        }
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
            let ev = d.event_record(p.shards[sh as usize].stream)?;
            d.event_synchronize(ev)?;
            d.event_destroy(ev);
        }
        let mut released = 0;
        for s in slots {
            self.give_back(&mut p, &mut all, &mut d, s)?;
            released += self.page;
        }
        drop(all);
        Ok(released)
    }

    /// Gives idle page `s` back to the device: unmaps it wherever it is mapped, releases it,
    /// and files its slot as spare. Each alias is forgotten only once unmapped, and the page
    /// only once released: a refused call leaves the page idle and mapped where it still is,
    /// for a later trim.
    fn give_back(
        &self,
        p: &mut Pages,
        all: &mut AllLocals,
        d: &mut DeviceState,
        s: u32,
    ) -> Result<(), BackendError> {
        while let Some(&(sh, v)) = p.phys[s as usize]
            .as_ref()
            .expect("idle slot")
            .aliases
            .last()
        {
            d.unmap(
                p.shards[sh as usize].base + v as u64 * self.page,
                self.page,
                1,
            )?;
            all.guards[sh as usize].map[v as usize] = NONE;
            p.phys[s as usize]
                .as_mut()
                .expect("idle slot")
                .aliases
                .pop();
        }
        let handle = p.phys[s as usize].as_ref().expect("idle slot").handle;
        self.release(d, handle)?;
        let ph = p.phys[s as usize].take().expect("idle slot");
        let owner = &mut all.guards[ph.owner as usize].idle;
        owner.remove(s);
        owner.note_mut(s).foreign = false; // the slot number may be reused for a new page
        p.spare.push(s);
        p.held -= 1;
        self.held_pages.store(p.held, Ordering::Relaxed);
        Ok(())
    }

    /// Checks shard `me`'s view: every touched virtual page maps to a page it owns and does
    /// not list as idle, and no two touched pages share one.
    fn check(&self, me: u32, touch: &[u32]) -> Result<(), String> {
        let p = self.inner.lock();
        let l = p.shards[me as usize].local.lock();
        let mut seen = std::collections::HashSet::new();
        for (v, &n) in touch.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let s = l.map[v];
            if s == NONE {
                return Err(format!("touched virtual page {v} is not mapped"));
            }
            let ph = p.phys[s as usize]
                .as_ref()
                .ok_or("mapped to an empty slot")?;
            if ph.owner != me {
                return Err(format!(
                    "virtual page {v} is touched but its page belongs to shard {}",
                    ph.owner
                ));
            }
            if l.idle.contains(s) {
                return Err(format!("virtual page {v} is touched but its page is idle"));
            }
            if !seen.insert(s) {
                return Err(format!("two touched virtual pages share physical page {s}"));
            }
        }
        Ok(())
    }
}

/// What a stream knows of one physical page (slot): its links in the stream's idle list and
/// what it needs when the page goes idle or is taken back. One entry per slot, so that a page
/// going idle or being taken back reads and writes one place.
#[derive(Clone, Copy)]
struct SlotNote {
    /// Previous and next slot in the idle list, NONE at the ends; `OUT` as the previous: not
    /// in the list.
    prev: u32,
    next: u32,
    /// The virtual page it last went idle from (a shared range's blocks of other streams may
    /// have used it through another alias than the one it is taken back at).
    via: u32,
    /// This stream took the page from another stream (which may still map it).
    foreign: bool,
    /// Pool epoch when it went idle (to find the oldest idle page across streams);
    /// `u64::MAX` if it never did here.
    stamp: u64,
}

const BLANK_NOTE: SlotNote = SlotNote {
    prev: OUT,
    next: NONE,
    via: NONE,
    foreign: false,
    stamp: u64::MAX,
};

/// Idle physical pages, least recently idled first: a doubly linked list through the slots'
/// notes, so that taking any page out of it (when its own virtual page touches it again) is
/// O(1). A slot's links say whether it is in the list, so a membership test and a removal
/// read the same entry.
struct FreeList {
    head: u32,
    tail: u32,
    /// Slot -> its note, for every slot the pool has made (in the list or not).
    notes: Vec<SlotNote>,
    len: usize,
}

/// The `previous` link of a slot that is not in the list.
const OUT: u32 = NONE - 1;

impl Default for FreeList {
    fn default() -> Self {
        Self {
            head: NONE,
            tail: NONE,
            notes: Vec::new(),
            len: 0,
        }
    }
}

impl FreeList {
    /// Makes room for slots `0..n` (see [`Local::fit_slots`]).
    fn fit(&mut self, n: usize) {
        if self.notes.len() < n {
            self.notes.resize(n, BLANK_NOTE);
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Slot `slot`'s note.
    #[inline]
    fn note(&self, slot: u32) -> &SlotNote {
        &self.notes[slot as usize]
    }

    #[inline]
    fn note_mut(&mut self, slot: u32) -> &mut SlotNote {
        &mut self.notes[slot as usize]
    }

    #[inline]
    fn contains(&self, slot: u32) -> bool {
        self.notes.get(slot as usize).is_some_and(|n| n.prev != OUT)
    }

    fn front(&self) -> Option<u32> {
        (self.len > 0).then_some(self.head)
    }

    /// Appends `slot`; returns its note.
    #[inline]
    fn push_back(&mut self, slot: u32) -> &mut SlotNote {
        debug_assert!(!self.contains(slot));
        let tail = self.tail;
        if tail != NONE {
            self.notes[tail as usize].next = slot;
        } else {
            self.head = slot;
        }
        self.tail = slot;
        self.len += 1;
        let note = &mut self.notes[slot as usize];
        note.prev = tail;
        note.next = NONE;
        note
    }

    fn push_front(&mut self, slot: u32) {
        debug_assert!(!self.contains(slot));
        let head = self.head;
        if head != NONE {
            self.notes[head as usize].prev = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
        self.len += 1;
        let note = &mut self.notes[slot as usize];
        note.prev = NONE;
        note.next = head;
    }

    /// Takes `slot` out of the list; returns its note if it was in it.
    #[inline]
    fn remove(&mut self, slot: u32) -> Option<&SlotNote> {
        let &SlotNote { prev, next, .. } = self.notes.get(slot as usize)?;
        if prev == OUT {
            return None;
        }
        if prev != NONE {
            self.notes[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NONE {
            self.notes[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        self.len -= 1;
        let note = &mut self.notes[slot as usize];
        note.prev = OUT;
        note.next = NONE;
        Some(note)
    }

    /// No slot counts as taken from another stream any more.
    fn forget_foreign(&mut self) {
        for n in &mut self.notes {
            n.foreign = false;
        }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = if self.len == 0 { NONE } else { self.head };
        std::iter::from_fn(move || {
            (cur != NONE).then(|| {
                let s = cur;
                cur = self.notes[s as usize].next;
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

/// The lists [`Local::take_idle`] fills for [`PagePool::claim`]: virtual pages that need a page
/// from the pool, and pages taken back from the stream's own idle list (returned if the
/// request fails).
#[derive(Default)]
struct ClaimScratch {
    need: Vec<u32>,
    /// How many pages were taken back from the stream's own idle list. A count, not a list:
    /// pushing each slot cost about 30 instructions an alloc/free pair on the 512 B–64 MiB
    /// case (session 47), and only a failed claim needs the slots, which
    /// [`Touched::put_back`] finds again.
    fast: usize,
    /// Of `fast`, the pages taken back at another virtual page than they went idle from,
    /// with that virtual page.
    moved: Vec<(u32, u32)>,
}

/// A claim in progress ([`PagePool::claim`]): the block's virtual pages, their counts with the
/// block counted, and what [`Local::take_idle`] found for the pages it is the first to touch.
struct Touched<'a> {
    range: std::ops::Range<usize>,
    touch: &'a [u32],
    scratch: &'a ClaimScratch,
}

impl Touched<'_> {
    /// A failed claim puts the pages it took from the stream's idle list back, each pushed to
    /// the list's front in the order they were taken: the pages the block is the first to touch
    /// (count 1) that were not left for the slow path (`need`, in ascending order).
    #[cold]
    fn put_back(&self, l: &mut Local) {
        let need = &self.scratch.need;
        for v in self.range.clone() {
            if self.touch[v] == 1 && need.binary_search(&(v as u32)).is_err() {
                let slot = l.map[v];
                l.idle.push_front(slot);
            }
        }
    }
}

/// The stitched policy for one stream.
pub struct Stitched {
    stream: Stream,
    pool: Arc<PagePool>,
    shard: u32,
    pages: Option<Arc<ShardPages>>,
    set: BlockSet,
    base: u64,
    va_bytes: u64,
    shift: u32,
    touch: Vec<u32>,
    /// Scratch lists of [`PagePool::claim`], kept so that claiming pages allocates nothing.
    scratch: ClaimScratch,
    /// Pages went idle that call for a mark (see [`PagePool::mark`]): recorded once the free
    /// is done, without taking the stream's page lock again on frees that need none.
    mark_due: bool,
    /// Place a small block at the high end of its free block when that touches
    /// fewer untouched pages than the low end (see [`Stitched::page_aware`]).
    page_aware: bool,
    /// Other streams' ranges may take this range's idle pages (see [`Stitched::keeps_pages`]).
    lends: bool,
}

impl Stitched {
    /// A pool for `stream` drawing pages from `pool`, placing blocks in `va_bytes` of virtual
    /// space (reserved at the first allocation).
    pub fn new(stream: Stream, pool: Arc<PagePool>, va_bytes: u64) -> Self {
        let page = pool.page;
        Self {
            stream,
            shift: page.trailing_zeros(),
            va_bytes: va_bytes.div_ceil(page) * page,
            pool,
            shard: NONE,
            pages: None,
            set: BlockSet::new(false, false).with_quick_cache(1, QUICK_MAX),
            base: 0,
            touch: Vec::new(),
            scratch: ClaimScratch::default(),
            mark_due: false,
            page_aware: false,
            lends: true,
        }
    }

    /// Places a block of at most [`PAGE_AWARE_MAX`] at the high end of its best-fit free block
    /// when that touches fewer pages no block touches yet than the low end would. The shared range
    /// does, as its streams' small blocks mix: the server trace holds 1.0325 of live without
    /// it, 1.0191 with it, and 1.0298 when it starts only once a second stream comes (the
    /// model's small tensors, placed by the first stream, then sit on pages of their own).
    pub(crate) fn page_aware(mut self) -> Self {
        self.page_aware = true;
        self
    }

    /// Keeps this range's idle pages from other streams' ranges: a shared range's, whose
    /// pages any of its streams may have used last (the range takes other ranges' pages, and
    /// gives them back through `release_cached`).
    pub(crate) fn keeps_pages(mut self) -> Self {
        self.lends = false;
        self
    }

    /// A range built for one stream becomes a shared one (see `SharedCore::adopt`): from now
    /// on its small blocks go where they touch the fewest untouched pages, and its idle pages
    /// are no longer lent to other ranges.
    pub(crate) fn become_shared(&mut self) {
        self.page_aware = true;
        self.lends = false;
        if self.shard != NONE {
            self.pool.stop_lending(self.shard);
        }
    }

    /// Whether nothing was ever placed here (no virtual space reserved yet).
    pub(crate) fn is_unused(&self) -> bool {
        self.shard == NONE
    }

    /// The pending blocks (freed while used on other streams, not yet released): address and
    /// size.
    pub(crate) fn pending_blocks(&self) -> Vec<(u64, u64)> {
        self.set
            .live_addrs()
            .filter_map(|a| {
                self.set
                    .pending_at(a)
                    .map(|id| (a, self.set.block(id).size))
            })
            .collect()
    }

    /// Whether `addr` lies in this range's virtual space.
    pub(crate) fn holds(&self, addr: u64) -> bool {
        self.shard != NONE && addr >= self.base && addr - self.base < self.va_bytes
    }

    /// Addresses of the live (allocated or pending) blocks.
    pub(crate) fn live_addrs(&self) -> impl Iterator<Item = u64> + '_ {
        self.set.live_addrs()
    }

    /// The live (allocated or pending) block at `addr`: its handle.
    #[inline]
    pub(crate) fn live_at(&self, addr: u64) -> Option<u32> {
        self.set.live_at(addr)
    }

    /// The addresses of virtual page `v`.
    pub(crate) fn page_span(&self, v: u32) -> (u64, u64) {
        let start = self.base + ((v as u64) << self.shift);
        (start, start + (1u64 << self.shift))
    }

    /// Pages of `[addr, addr + size)` that no block touches.
    fn untouched(&self, addr: u64, size: u64) -> usize {
        self.page_range(addr, size)
            .filter(|&v| self.touch[v] == 0)
            .count()
    }

    /// The shared page pool's counters.
    pub fn page_counters(&self) -> PageCounters {
        self.pool.counters()
    }

    fn init(&mut self, dev: &Device) -> Result<(), BackendError> {
        let base = dev.lock().address_reserve_aligned(
            self.va_bytes,
            self.stream,
            Pool::Large,
            1 << self.shift,
        )?;
        self.base = base;
        let pages = self.va_bytes >> self.shift;
        self.touch = vec![0; pages as usize];
        self.set
            .add_segment(base, self.va_bytes, Pool::Large, State::Free);
        let (shard, sp) = self.pool.register(self.stream, base, pages, self.lends);
        self.shard = shard;
        self.pages = Some(sp);
        Ok(())
    }

    #[inline]
    fn page_range(&self, addr: u64, size: u64) -> std::ops::Range<usize> {
        // A half-open range: an inclusive one carries an `exhausted` flag through every step.
        let first = ((addr - self.base) >> self.shift) as usize;
        let end = ((addr + size - 1 - self.base) >> self.shift) as usize + 1;
        first..end
    }

    /// Makes pending block `id` reusable and lets go of the pages only it touched.
    fn release_block(&mut self, id: u32) {
        let (addr, size) = {
            let b = self.set.block(id);
            (b.addr, b.size)
        };
        self.untouch_pages(addr, size);
        self.set.release(id);
    }

    /// Frees allocated block `id` used on no other stream; returns its size.
    fn free_block(&mut self, id: u32, dev: &Device) -> u64 {
        let (addr, size) = {
            let b = self.set.block(id);
            (b.addr, b.size)
        };
        if size > QUICK_MAX {
            self.untouch_pages(addr, size);
        }
        // A small block waits whole in the quick cache, still counted on its pages (which it
        // shares with its neighbours anyway), so that taking it back touches no page; it lets
        // go of them when it is merged back.
        if let Some((a, s)) = self.set.free_now(id) {
            self.untouch_pages(a, s);
        }
        self.mark_idle(dev);
        size
    }

    /// After pages went idle: with several streams, an event on this stream at this point
    /// (see [`PagePool::mark`]).
    #[inline]
    fn mark_idle(&mut self, dev: &Device) {
        if self.mark_due {
            self.mark_now(dev);
        }
    }

    /// [`Stitched::mark_idle`] when a mark is due: out of line, so that every free does not
    /// carry its call.
    #[cold]
    #[inline(never)]
    fn mark_now(&mut self, dev: &Device) {
        self.mark_due = false;
        if let Some(sp) = self.pages.as_ref() {
            self.pool.mark(sp, dev);
        }
    }

    /// Counts a block on (`now` = 1) or off (`now` = 0) its page range `pages` in the counts
    /// `t`, and returns the run of its pages that it is the first to touch (on) or was the
    /// last to touch (off), as a half-open range.
    ///
    /// Only the two end pages can be counted by other blocks too: the pages between them lie
    /// wholly inside the block. So only the end pages are counted here, the run is read from
    /// their counts alone, and the caller sets the run's counts to `now` (the inner pages go
    /// from `1 - now` to `now`; the end pages in the run are there already). No test per page:
    /// one mispredicted wherever its answer changed along the block.
    #[inline]
    fn counted(t: &mut [u32], pages: std::ops::Range<usize>, now: u32) -> (usize, usize) {
        let (first, last) = (pages.start, pages.end - 1);
        let delta = if now == 1 { 1 } else { u32::MAX }; // +1 or -1, wrapping
        t[first] = t[first].wrapping_add(delta);
        // A one-page block is counted once.
        t[last] = t[last].wrapping_add(delta.wrapping_mul((last != first) as u32));
        let lo = first + (t[first] != now) as usize;
        let hi = last + (t[last] == now) as usize;
        // A one-page block counted by others too gives lo = hi + 1.
        (lo, hi.max(lo))
    }

    /// A block now covers `[addr, addr + size)`: count it on its pages and claim a physical
    /// page for each page it is the first to touch. On failure nothing changes.
    fn touch_pages(
        &mut self,
        addr: u64,
        size: u64,
        dev: &Device,
        order: &mut Order,
    ) -> Result<(), BackendError> {
        let range = self.page_range(addr, size);
        let sp = self
            .pages
            .as_ref()
            .expect("initialised with the first allocation");
        // The stream's page list is locked only if the block is the first to touch a page.
        let (lo, hi) = Self::counted(&mut self.touch, range.clone(), 1);
        if lo == hi {
            return Ok(());
        }
        let scratch = &mut self.scratch;
        scratch.need.clear();
        scratch.fast = 0;
        scratch.moved.clear();
        let mut l = sp.local.lock();
        for (v, t) in (lo as u32..).zip(&mut self.touch[lo..hi]) {
            *t = 1;
            l.take_idle(v, scratch);
        }
        if let Order::Shared {
            together: true,
            live_peak,
            requested,
            ..
        } = order
        {
            // The range's live peak if this block were added now, in requested bytes: the
            // spare pages then cannot take the pool past `1 + shared_spare` of what the
            // program asked for, rounding of the block sizes included.
            let live = &self.set.stats.requested_bytes;
            *live_peak = live.all_peak().max(live.all_current() + *requested);
        }
        let block = Touched {
            range: range.clone(),
            touch: &self.touch,
            scratch,
        };
        let claimed = self.pool.claim(self.shard, sp, l, dev, &block, order);
        if claimed.is_err() {
            for v in range {
                self.touch[v] -= 1;
            }
        }
        claimed
    }

    /// No block covers `[addr, addr + size)` any more: pages nothing else touches go idle, in
    /// the stream's own list (no shared state touched).
    fn untouch_pages(&mut self, addr: u64, size: u64) {
        let range = self.page_range(addr, size);
        let sp = self
            .pages
            .as_ref()
            .expect("initialised with the first allocation");
        // The stream's page list is locked only if the block was the last to touch a page.
        let (lo, hi) = Self::counted(&mut self.touch, range, 0);
        if lo == hi {
            return;
        }
        let mut l = sp.local.lock();
        let epoch = self.pool.epoch_now();
        for (v, t) in (lo as u32..).zip(&mut self.touch[lo..hi]) {
            *t = 0;
            l.let_go(v, epoch);
        }
        self.mark_due |= self.pool.released(&mut l, (hi - lo) as u64);
    }
}

impl Policy for Stitched {
    block_set_queries!();

    fn name(&self) -> &'static str {
        "stitched"
    }

    fn holds(&self, addr: DevPtr) -> bool {
        Stitched::holds(self, addr)
    }

    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        self.allocate_in(size, dev, &mut Order::Own)
    }

    fn release(&mut self, addr: DevPtr, dev: &Device) -> Result<(), BackendError> {
        if let Some(id) = self.set.pending_at(addr) {
            self.release_block(id);
            self.mark_idle(dev);
        }
        Ok(())
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        for (a, s) in self.set.flush_cache() {
            self.untouch_pages(a, s);
        }
        self.pool.trim(dev)
    }

    /// Any virtual run will do (the range is far larger than the device): what limits a block
    /// is the physical pages it can get, the idle ones of the pool and fresh ones.
    fn largest_obtainable(&self, fresh: u64) -> u64 {
        let c = self.pool.counters();
        c.held
            .saturating_sub(c.busy)
            .saturating_mul(self.pool.page_bytes())
            .saturating_add(fresh)
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

    fn check(&self) -> Result<(), String> {
        self.set.check()?;
        // Every touched virtual page is mapped to a physical page used through it.
        if self.shard == NONE {
            return Ok(());
        }
        self.pool.check(self.shard, &self.touch)
    }
}

impl Stitched {
    /// [`Policy::allocate`], with `order` saying whose work a page move waits for.
    pub(crate) fn allocate_in(
        &mut self,
        size: u64,
        dev: &Device,
        order: &mut Order,
    ) -> Result<Placement, BackendError> {
        if self.shard == NONE {
            self.init(dev)?;
        }
        let rounded = round_size(size);
        let pool = Pool::of(rounded);
        // Same size as a block in the quick cache: its pages are still counted as touched.
        if let Some(id) = self.set.find_cached(rounded, Pool::Large) {
            let id = self.set.take_cached(id, size, pool);
            let b = self.set.block(id);
            return Ok(Placement {
                addr: b.addr,
                size: b.size,
                handle: id,
            });
        }
        let mut found = self.set.best_fit(Pool::Large, rounded);
        let at_frontier = found.is_some_and(|id| self.set.block(id).next == NIL);
        if at_frontier && self.set.has_cached() {
            // Before growing into fresh address space, merge the cached blocks back:
            // together they may fit.
            for (a, s) in self.set.flush_cache() {
                self.untouch_pages(a, s);
            }
            found = self.set.best_fit(Pool::Large, rounded);
        }
        let id = found.ok_or_else(|| {
            BackendError::oom(
                DriverCall::AddressReserve,
                format!(
                    "the stream's virtual range of {} bytes has no free run of {rounded} bytes",
                    self.va_bytes
                ),
            )
        })?;
        let (mut addr, free_size) = {
            let b = self.set.block(id);
            (b.addr, b.size)
        };
        let mut high = false;
        if self.page_aware && rounded <= PAGE_AWARE_MAX && free_size - rounded >= MIN_BLOCK {
            let top = addr + free_size == self.base + self.va_bytes;
            let hi = addr + free_size - rounded;
            if !top && self.untouched(hi, rounded) < self.untouched(addr, rounded) {
                addr = hi;
                high = true;
            }
        }
        self.touch_pages(addr, rounded, dev, order)?;
        let id = if high {
            // The free block's head stays free; its tail is handed out whole.
            self.set.detach(id);
            let tail = self.set.split_off(id, free_size - rounded);
            self.set.attach(id);
            self.set.allocate(tail, rounded, size, pool, false)
        } else {
            let split = free_size - rounded >= MIN_BLOCK;
            self.set.allocate(id, rounded, size, pool, split)
        };
        Ok(Placement {
            addr,
            size: self.set.block(id).size,
            handle: id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{BudgetWindow, Stitched, TRADE_WINDOW_US};
    use proptest::prelude::*;

    proptest! {
        /// `Stitched::counted` finds the pages a block is the first (or last) to touch from its
        /// end pages alone; counting every page one by one must find the same pages, and leave
        /// the same counts. Blocks start and end anywhere within pages (8 units each), so that
        /// neighbours share end pages, and some cover a single page.
        #[test]
        fn counted_runs_match_counting_page_by_page(
            ops in prop::collection::vec((0u64..512, 1u64..40, any::<bool>()), 1..300)
        ) {
            const UNIT_PAGE: u64 = 8;
            let pages_of = |(a, n): (u64, u64)| (a / UNIT_PAGE) as usize..((a + n - 1) / UNIT_PAGE) as usize + 1;
            let mut blocks: Vec<(u64, u64)> = Vec::new();
            let mut counts = vec![0u32; 70];
            let mut reference = vec![0u32; 70];
            for (start, len, remove) in ops {
                let (block, now) = if remove && !blocks.is_empty() {
                    (blocks.swap_remove(start as usize % blocks.len()), 0)
                } else if blocks.iter().all(|&(a, n)| start + len <= a || a + n <= start) {
                    blocks.push((start, len));
                    ((start, len), 1)
                } else {
                    continue;
                };
                let pages = pages_of(block);
                let mut expected = Vec::new();
                for v in pages.clone() {
                    if now == 1 {
                        reference[v] += 1;
                    } else {
                        reference[v] -= 1;
                    }
                    if reference[v] == now {
                        expected.push(v);
                    }
                }
                let (lo, hi) = Stitched::counted(&mut counts, pages, now);
                prop_assert_eq!((lo..hi).collect::<Vec<_>>(), expected, "block {:?}", block);
                for c in &mut counts[lo..hi] {
                    *c = now;
                }
                prop_assert_eq!(&counts, &reference);
            }
        }
    }

    /// A window closes once it spans `TRADE_WINDOW_US`; with a budget, as soon as its driver
    /// time alone is over the budget's share of a whole window, and not before.
    #[test]
    fn a_window_over_its_budget_closes_early() {
        let budget = 0.1;
        let whole_s = budget * TRADE_WINDOW_US as f64 * 1e-6; // 10 ms of driver time
        let mut plain = BudgetWindow::default();
        let mut budgeted = BudgetWindow::default();
        // 1.2 ms of driver time every 2 ms: over the budget from the start.
        let mut closed_at = None;
        for i in 1..=60u64 {
            let now = i * 2_000;
            assert!(plain.add(1.2e-3, now, None).is_none(), "closed at {now} µs");
            if let Some(w) = budgeted.add(1.2e-3, now, Some(budget)) {
                closed_at = Some((i, w));
                break;
            }
        }
        let (i, w) = closed_at.expect("the budgeted window closed within 120 ms");
        // It closes at the first slow path that takes it past 10 ms: the ninth (10.8 ms), 18
        // ms in, the window counted from 1.2 ms before the first one ended.
        assert_eq!(i, 9);
        assert!(w.cost_s > whole_s && w.cost_s < whole_s + 1e-3, "{w:?}");
        assert_eq!(w.window_us, 18_000 - 800);
        assert!(w.share() > 0.5, "{w:?}");
        // Without a budget the same window runs its whole length.
        let w = plain
            .add(1.2e-3, 101_000, None)
            .expect("closed at its length");
        assert_eq!(w.window_us, 101_000 - 800);
        // Under the budget the budgeted window runs its whole length too.
        let mut quiet = BudgetWindow::default();
        for i in 1..=50u64 {
            assert!(quiet.add(1e-4, i * 2_000, Some(budget)).is_none());
        }
        assert!(quiet.add(1e-4, 102_000, Some(budget)).is_some());
    }
}
