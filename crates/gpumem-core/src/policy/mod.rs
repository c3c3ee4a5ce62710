//! Placement policies: where a block goes and where its memory comes from.
//!
//! One policy instance serves one stream (the engine keeps a shard per stream, as PyTorch
//! keeps blocks of different streams apart). Policies that share physical memory between
//! streams (stitched) share it through an object their factory hands to every shard.

/// The [`Policy`] methods that a policy built on a [`blocks::BlockSet`] (in a field `set`)
/// answers straight from the set, and its frees through its own `free_block(id, dev) -> u64`:
/// written once so the block policies cannot drift apart.
macro_rules! block_set_queries {
    () => {
        fn free(&mut self, addr: DevPtr, dev: &Device) -> Result<Option<u64>, BackendError> {
            Ok(self
                .set
                .allocated_at(addr)
                .map(|id| self.free_block(id, dev)))
        }

        fn free_handle(
            &mut self,
            handle: u32,
            addr: DevPtr,
            dev: &Device,
        ) -> Result<Option<u64>, BackendError> {
            Ok(self
                .set
                .allocated_handle(handle, addr)
                .map(|id| self.free_block(id, dev)))
        }

        fn free_requested(&mut self, addr: DevPtr, _dev: &Device) -> Option<u64> {
            let id = self.set.allocated_at(addr)?;
            self.set.free_requested(id);
            Some(self.set.block(id).size)
        }

        fn stats(&self) -> MemoryStats {
            self.set.stats.to_memory_stats()
        }

        fn block_currents(&self) -> $crate::stats::BlockCurrents {
            self.set.stats.currents()
        }

        fn reset_peaks(&mut self) {
            self.set.stats.reset_peaks();
        }

        fn is_allocated(&self, addr: DevPtr) -> bool {
            self.set.allocated_at(addr).is_some()
        }

        fn is_allocated_handle(&self, handle: u32, addr: DevPtr) -> bool {
            self.set.allocated_handle(handle, addr).is_some()
        }

        fn is_free_block(&self, addr: DevPtr) -> bool {
            self.set.is_free_start(addr)
        }
    };
}

pub mod blocks;
pub mod buddy;
pub mod expandable;
pub mod free_index;
mod freed_ranges;
mod live_map;
pub mod segmented;
pub mod shared_range;
pub mod stitched;
pub mod tiered;

use crate::backend::{DevPtr, DeviceInfo, Stream};
use crate::device::Device;
use crate::error::BackendError;
use crate::stats::{BlockCurrents, MemoryStats, Pool};
use serde::Serialize;
use std::sync::Arc;

/// What a block is doing, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum BlockKind {
    /// Handed out to the user.
    Allocated,
    /// Freed, waiting for other streams.
    Pending,
    /// Cached, reusable.
    Free,
    /// Address space with nothing mapped.
    Unmapped,
}

/// One block of a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlockInfo {
    /// Address.
    pub addr: u64,
    /// Size.
    pub size: u64,
    /// Bytes asked for (0 if free).
    pub requested: u64,
    /// State.
    pub kind: BlockKind,
}

/// One segment (contiguous range) of a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SegmentInfo {
    /// Address.
    pub addr: u64,
    /// Size.
    pub size: u64,
    /// Stream that owns it.
    pub stream: Stream,
    /// Pool.
    pub pool: Pool,
    /// Its blocks by address.
    pub blocks: Vec<BlockInfo>,
}

/// A placement: the address handed out and the block size behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Address of the block.
    pub addr: DevPtr,
    /// Bytes of the block (the request rounded up).
    pub size: u64,
    /// The policy's own handle of the block (lets a free skip the address lookup), or
    /// `NO_HANDLE`.
    pub handle: u32,
}

/// A placement without a policy handle.
pub const NO_HANDLE: u32 = u32::MAX;

/// A placement policy for one stream.
pub trait Policy: Send {
    /// The policy's name as `GPUMEM_CONF` spells it.
    fn name(&self) -> &'static str;

    /// Finds room for `size` (> 0) bytes. An error with `out_of_memory` set means the device
    /// (or the cap) refused more memory; the engine then releases caches and retries.
    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError>;

    /// The user freed the block at `addr`; it is reused once [`Policy::release`] says so: at
    /// once if no other stream used it ([`Policy::free`]), else when their work queued by now
    /// is done. Returns its size, or `None` if `addr` is not a live block of this policy.
    fn free_requested(&mut self, addr: DevPtr, dev: &Device) -> Option<u64>;

    /// The block at `addr` (freed earlier) may now be reused: all streams are done with it.
    fn release(&mut self, addr: DevPtr, dev: &Device) -> Result<(), BackendError>;

    /// The user freed the block at `addr` and no other stream used it: it is reusable at
    /// once. Returns its size, or `None` if `addr` is not a live block. (The same as
    /// `free_requested` then `release`; policies override it to look the block up once.)
    fn free(&mut self, addr: DevPtr, dev: &Device) -> Result<Option<u64>, BackendError> {
        match self.free_requested(addr, dev) {
            None => Ok(None),
            Some(size) => {
                self.release(addr, dev)?;
                Ok(Some(size))
            }
        }
    }

    /// [`Policy::free`] of the block placed with `handle` at `addr`. The handle is checked
    /// against the live block at `addr`, so a handle of another allocator, or of a block since
    /// split or merged into others, is refused like an unknown pointer. Handles carry no
    /// generation: one kept past its free, whose block was later handed out again at the same
    /// address, frees that new allocation, as a raw pointer would.
    fn free_handle(
        &mut self,
        handle: u32,
        addr: DevPtr,
        dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        let _ = handle;
        self.free(addr, dev)
    }

    /// Hands out `size` bytes (`requested` of them asked for) at exactly `addr`, inside a free
    /// block: how a private pool's checkpoint puts its blocks back (see
    /// [`crate::Allocator::restore_pool`]). Only the caching policy over plain segments, which
    /// serves private pools, can; the others refuse.
    fn allocate_at(
        &mut self,
        addr: DevPtr,
        size: u64,
        requested: u64,
    ) -> Result<Placement, String> {
        let _ = (addr, size, requested);
        Err(format!(
            "the {} policy cannot place a block at a given address",
            self.name()
        ))
    }

    /// Returns cached memory that no live block uses to the device; returns the bytes
    /// returned.
    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError>;

    /// Block statistics (allocation, active, inactive_split and their bytes, requested_bytes),
    /// read from the policy's [`crate::stats::BlockStats`].
    fn stats(&self) -> MemoryStats;

    /// The current values of [`Policy::stats`]'s block statistics alone: what a wrapper that
    /// sums policies needs at every allocation to keep the sum's peaks (see `tiered`).
    fn block_currents(&self) -> BlockCurrents {
        self.stats().block_currents()
    }

    /// Resets the peaks of the block statistics.
    fn reset_peaks(&mut self);

    /// Size of the largest free block.
    fn largest_free(&self) -> u64;

    /// The largest request this policy could meet now with at most `fresh` more bytes from
    /// the device (its free memory, within the cap): by default the larger of a free block as
    /// it is and a new segment. See [`crate::Allocator::largest_obtainable`].
    fn largest_obtainable(&self, fresh: u64) -> u64 {
        self.largest_free().max(fresh)
    }

    /// Segments and blocks, for snapshots.
    fn segments(&self) -> Vec<SegmentInfo>;

    /// Whether `addr` is a block handed out and not yet freed.
    fn is_allocated(&self, addr: DevPtr) -> bool;

    /// Whether `addr` is a block handed out with `handle` and not yet freed (the check of
    /// [`Policy::free_handle`]).
    fn is_allocated_handle(&self, handle: u32, addr: DevPtr) -> bool {
        let _ = handle;
        self.is_allocated(addr)
    }

    /// Whether `addr` is the start of a cached (free) block: a second free of it is a double
    /// free.
    fn is_free_block(&self, addr: DevPtr) -> bool;

    /// Checks internal invariants; for tests.
    fn check(&self) -> Result<(), String>;

    /// A second stream came (`range:auto`): the stitched policy's first stream makes its
    /// range the one its device's streams share, and from then on they place their blocks
    /// there. Other policies keep a pool per stream. Called with this stream's shard locked.
    fn open_range_to_streams(&mut self) {}

    /// Whether `addr` lies in virtual space this instance placed blocks in (the stitched
    /// policy's ranges; see [`tiered::Tiered`], which sends each free to the tier that holds
    /// it). The others place nothing of their own there: false.
    fn holds(&self, addr: DevPtr) -> bool {
        let _ = addr;
        false
    }
}

/// The policies gpumem knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum PolicyKind {
    /// A simulation of PyTorch's native caching allocator.
    Native,
    /// A simulation of PyTorch with `expandable_segments:True`.
    Expandable,
    /// gpumem's best-fit caching policy over plain segments.
    Caching,
    /// Power-of-two buddy allocation.
    Buddy,
    /// Virtual-memory stitching of physical pages.
    Stitched,
}

impl PolicyKind {
    /// Every policy, in the order the replay shows them.
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::Native,
        PolicyKind::Expandable,
        PolicyKind::Caching,
        PolicyKind::Buddy,
        PolicyKind::Stitched,
    ];

    /// The name `GPUMEM_CONF` and `--policy` use.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Native => "native",
            PolicyKind::Expandable => "expandable",
            PolicyKind::Caching => "caching",
            PolicyKind::Buddy => "buddy",
            PolicyKind::Stitched => "stitched",
        }
    }

    /// One line on what it is.
    pub fn describe(self) -> &'static str {
        match self {
            PolicyKind::Native => "simulation of PyTorch's native caching allocator",
            PolicyKind::Expandable => "simulation of PyTorch with expandable_segments:True",
            PolicyKind::Caching => "gpumem best-fit caching over cuMemAlloc segments",
            PolicyKind::Buddy => "power-of-two buddy allocator",
            PolicyKind::Stitched => "gpumem virtual-memory stitching of 2 MiB pages",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<PolicyKind> {
        let s = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .or(match s.as_str() {
                "pytorch" | "torch" => Some(PolicyKind::Native),
                "expandable_segments" => Some(PolicyKind::Expandable),
                "vmm" | "stitch" => Some(PolicyKind::Stitched),
                _ => None,
            })
    }

    /// Whether the policy takes memory through the virtual-memory API (pages) rather than
    /// plain segments; decides the form of preallocation.
    pub fn uses_pages(self) -> bool {
        matches!(self, PolicyKind::Expandable | PolicyKind::Stitched)
    }
}

/// Tuning knobs of the policies (from `GPUMEM_CONF`).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyOptions {
    /// Stitched: pages created beyond the peak of pages in use, as a fraction of it, rather
    /// than taking idle pages from elsewhere. 0 (the default) keeps the memory held at the
    /// page-touch minimum; replays of real traces show that 0.01 costs a full 1 % of memory
    /// and saves few driver calls.
    pub slack: f64,
    /// Stitched: virtual space reserved per stream, as a multiple of the device memory.
    pub va_factor: u64,
    /// Stitched: each stream may keep as many pages as its own peak in use (the pool holding
    /// up to the sum of the streams' peaks), instead of the pool holding no more than the
    /// highest total in use. Fewer remaps when many streams' use rises and falls
    /// independently; more memory when streams peak at different times (up to twice the
    /// live peak with two streams that take turns).
    pub own_stream_peaks: bool,
    /// Stitched: where the streams place their blocks (see [`RangeMode`]).
    pub range: RangeMode,
    /// Stitched, with a shared range: when a stream places blocks in a range of its own
    /// instead (see [`shared_range::Spill`]); by default when the shared range's lock is
    /// contended.
    pub spill: shared_range::Spill,
    /// Stitched, with several streams: the share of the time that moving idle pages from one
    /// stream to another may take. Once the driver time of the slow paths that took pages
    /// from other streams exceeds it over a window of at least [`TRADE_WINDOW_US`] (or, before
    /// the window's end, exceeds that share of a whole window), the streams stop taking each
    /// other's pages and keep their own peaks, as with `own_stream_peaks`. Infinite: never.
    pub trade_budget: f64,
    /// Stitched: the share of the time that remapping (pointing a virtual page whose physical
    /// page is in use elsewhere at another one: wait, unmap, map, set access) may take. After
    /// [`REMAP_WINDOWS_IN_A_ROW`] windows of at least [`TRADE_WINDOW_US`] in a row whose
    /// remapping slow paths spent more than this in the driver while the pool was not growing,
    /// the spare pages (`slack`) rise by the last window's share of the time times
    /// [`REMAP_SLACK_MAX`] of the peak in use, up to [`REMAP_SLACK_MAX`] more than configured.
    /// Spare pages are made only where a remap would otherwise happen. Infinite: never.
    pub remap_budget: f64,
    /// Stitched, several streams in one range: while the pages held stay within this share
    /// of the live peak (the peak of the bytes requested by the range's live blocks), a
    /// virtual page that needs a page gets a new one instead of a remapped idle one. Streams
    /// that interleave differently from step to step (a prefetch pipeline) keep changing their
    /// layout, and a pool held at the peak of pages in use then remaps at every new one.
    /// Programs with one stream repeat their layouts and never use it. The default spends the
    /// 1.02 bound's room and no more: spare pages never take the pool past it by themselves.
    pub shared_spare: f64,
    /// Stitched: once the device holds [`PolicyOptions::big_after`] bytes, every block placed
    /// from then on goes to a second pool whose pages are this many bytes (see
    /// [`tiered`]); 0: off. The driver's cost is per handle, so a large pool grows for a
    /// fraction of the time; the blocks placed before stay on 2 MiB pages. Default
    /// [`BIG_PAGE`].
    pub big_page: u64,
    /// Stitched: bytes held from which [`PolicyOptions::big_page`] applies.
    pub big_after: u64,
}

/// Where the stitched policy's streams place their blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeMode {
    /// Each stream in a virtual range of its own (`range:stream`): no lock shared by streams,
    /// but blocks of different streams never share a 2 MiB page, and a pipeline whose streams
    /// hand blocks to each other keeps a layout per stream.
    Stream,
    /// One virtual range shared by the device's streams (`range:shared`, see
    /// [`shared_range`]). Blocks and pages a stream freed go to another stream through an
    /// event of the first that the second waits for on the device, so streams share pages for
    /// their small blocks; placement takes one lock for all streams (a stream that waits for
    /// it too long spills to a range of its own, [`shared_range::Spill`]).
    Shared,
    /// The first stream's range alone until a second stream allocates; then that range
    /// becomes the one shared range (`range:auto`, the default), before the second stream
    /// places anything. A program with one stream never pays for sharing (the lock, the
    /// freed-bytes records); a pipeline's streams nest their layouts in one range; threads on
    /// streams of their own share pages for their small blocks, and one that waits for the
    /// lock too long spills to a range of its own, as with `range:shared`. The first
    /// stream's blocks (a model's weights) stay where they are, in the shared range.
    Auto,
}

impl RangeMode {
    /// Every mode.
    pub const ALL: [RangeMode; 3] = [RangeMode::Auto, RangeMode::Stream, RangeMode::Shared];

    /// The name the `range` key and reports use.
    pub fn name(self) -> &'static str {
        match self {
            RangeMode::Auto => "auto",
            RangeMode::Stream => "stream",
            RangeMode::Shared => "shared",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<RangeMode> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// Windows in a row over the remap budget, with the pool not growing in them, before the spare
/// pages are raised: remapping that goes on for 300 ms after the pool stopped growing, not the
/// burst of a warm-up or of a new batch shape (replays at a 10 % budget: two in a row happen
/// on the U-Net trace with random resolutions, whose remapping stops by itself; three do not).
pub const REMAP_WINDOWS_IN_A_ROW: u32 = 3;

/// Most spare pages the remap budget adds (share of the peak in use); `slack:0.1` takes the
/// allocation benchmark's 64 MiB random case to no driver calls (BENCHMARKS.md §1). Each raise
/// adds this times the share of the time remapping took: 9 % when it took 90 %.
pub const REMAP_SLACK_MAX: f64 = 0.1;

/// Default of [`PolicyOptions::big_page`]: 16 MiB handles cost the driver an eighth of the
/// calls of 2 MiB ones for the same growth, and the GPU streams them at 0.96-0.97 of
/// cudaMalloc's bandwidth against 0.73-0.80 (BENCHMARKS.md §3, session 25).
pub const BIG_PAGE: u64 = 16 << 20;

/// Default of [`PolicyOptions::big_after`]. Pools that stop between 4 and 8 GiB (ResNet-50 at
/// 5.6 GiB, the Llama decoder at 4.0 GiB) grew in their first steps, so larger pages save them
/// nothing, while moving their blocks to the second tier costs 25-40 ms of driver calls and
/// 0.3-0.5 % of live; a pool that keeps growing past 8 GiB (GPT-2 with random lengths, 23 GiB)
/// has its later growth cut as much as from 4 GiB (BENCHMARKS.md §1 and §3, session 28).
pub const BIG_AFTER: u64 = 8 << 30;

/// Default of [`PolicyOptions::shared_spare`]: the 1.02 bound. On the prefetch pipeline 1.5 %
/// still remapped a page every eight steps or so, 0.8-1.5 % of its step time on an H200 against
/// 2 % run beside it, which makes no remap after warm-up for 1.0194 of live instead of 1.0149
/// (BENCHMARKS.md §3, session 31).
pub const SHARED_SPARE: f64 = 0.02;

/// Shortest stretch of time (on the device's clock, microseconds) over which the stitched
/// policy's page trading is held against [`PolicyOptions::trade_budget`]: long against the
/// burst of page moves a new batch shape brings, short against a program's life.
pub const TRADE_WINDOW_US: u64 = 100_000;

impl Default for PolicyOptions {
    fn default() -> Self {
        Self {
            slack: 0.0,
            va_factor: 2,
            own_stream_peaks: false,
            range: RangeMode::Auto,
            spill: shared_range::Spill::Auto,
            trade_budget: 0.1,
            remap_budget: 0.2,
            shared_spare: SHARED_SPARE,
            big_page: BIG_PAGE,
            big_after: BIG_AFTER,
        }
    }
}

/// Makes the policy instance of each stream; shares what the streams of one device share.
pub struct PolicyFactory {
    kind: PolicyKind,
    make: Box<dyn Fn(Stream) -> Box<dyn Policy> + Send + Sync>,
    /// The stitched policy's page pool, shared by its streams.
    pages: Option<Arc<stitched::PagePool>>,
    /// With a shared range: the streams' spills to ranges of their own.
    spills: Option<Arc<shared_range::SpillCount>>,
    /// With `big_page`: the second tier's pool and spills, and the switch.
    second: Option<SecondTier>,
}

/// What [`PolicyFactory`] keeps of the second tier (`big_page`): its page pool, its shared
/// range's spills, and the switch.
type SecondTier = (
    Arc<stitched::PagePool>,
    Option<Arc<shared_range::SpillCount>>,
    Arc<tiered::TierSwitch>,
);

/// A maker of stitched instances drawing pages from `pool`, and the spills of its shared
/// range (none with `range:stream`).
fn stitched_maker(
    pool: Arc<stitched::PagePool>,
    va: u64,
    opts: &PolicyOptions,
) -> (tiered::MakePolicy, Option<Arc<shared_range::SpillCount>>) {
    if opts.range == RangeMode::Stream {
        return (
            Box::new(move |s| Box::new(stitched::Stitched::new(s, pool.clone(), va))),
            None,
        );
    }
    let core = Arc::new(shared_range::CoreLock::new(shared_range::SharedCore::new(
        pool, va,
    )));
    let spill = opts.spill;
    let counted = Arc::new(shared_range::SpillCount::new(
        opts.range == RangeMode::Shared,
    ));
    let spills = counted.clone();
    (
        Box::new(move |s| {
            Box::new(shared_range::SharedStitched::new(
                s,
                core.clone(),
                spill,
                counted.clone(),
            ))
        }),
        Some(spills),
    )
}

impl PolicyFactory {
    /// A factory for `kind` on the device described by `info`.
    pub fn new(kind: PolicyKind, info: &DeviceInfo, opts: &PolicyOptions) -> Self {
        let mut pages = None;
        let mut spills = None;
        let mut second = None;
        let make: Box<dyn Fn(Stream) -> Box<dyn Policy> + Send + Sync> = match kind {
            PolicyKind::Native => Box::new(|s| Box::new(segmented::Segmented::native(s))),
            PolicyKind::Caching => Box::new(|s| Box::new(segmented::Segmented::caching(s))),
            PolicyKind::Expandable => {
                let total = info.total_bytes;
                Box::new(move |s| Box::new(expandable::Expandable::new(s, total)))
            }
            PolicyKind::Buddy => Box::new(|s| Box::new(buddy::Buddy::new(s))),
            PolicyKind::Stitched => {
                let shared = Arc::new(stitched::PagePool::new(info, opts));
                pages = Some(shared.clone());
                // (Saturating: an absurd device total then fails at the reservation.)
                let va = info
                    .total_bytes
                    .max(info.page_bytes)
                    .saturating_mul(opts.va_factor);
                let (make, counted) = stitched_maker(shared.clone(), va, opts);
                spills = counted;
                if opts.big_page > info.page_bytes {
                    let pool2 =
                        Arc::new(stitched::PagePool::with_pages_of(info, opts, opts.big_page));
                    let (make2, counted2) = stitched_maker(pool2.clone(), va, opts);
                    let switch = Arc::new(tiered::TierSwitch::new(
                        opts.big_after,
                        make2,
                        shared,
                        pool2.clone(),
                    ));
                    second = Some((pool2, counted2, switch));
                    // The streams start on the first tier alone; the engine wraps a stream's
                    // instance in the tiers once the switch happened (`tiers`).
                    make
                } else {
                    make
                }
            }
        };
        Self {
            kind,
            make,
            pages,
            spills,
            second,
        }
    }

    /// What the policy changed on its own while running, one line each (the stitched
    /// policy's streams stopping page trading; its spare pages raised by the remap budget, or
    /// made where streams share a range; with a shared range, streams spilling to ranges of
    /// their own).
    pub fn notes(&self) -> Vec<String> {
        let Some(p) = self.pages.as_ref() else {
            return Vec::new();
        };
        let trade = p.trading_stopped().map(|t| t.to_string());
        let remap = p.spare_raised().map(|r| r.to_string());
        let spare = p.shared_spare_note();
        let joined = self.spills.as_ref().and_then(|s| s.joined_note());
        let spill = self.spills.as_ref().and_then(|s| s.note());
        let tier = self.second.as_ref().and_then(|(_, _, t)| t.note());
        let second: Vec<String> = self
            .second
            .as_ref()
            .map(|(p, s, _)| {
                let sp = s.as_ref();
                p.trading_stopped()
                    .map(|t| t.to_string())
                    .into_iter()
                    .chain(p.spare_raised().map(|r| r.to_string()))
                    .chain(p.shared_spare_note())
                    .chain(sp.and_then(|s| s.note()))
                    .map(|n| format!("{n} (second tier)"))
                    .collect()
            })
            .unwrap_or_default();
        trade
            .into_iter()
            .chain(remap)
            .chain(spare)
            .chain(joined)
            .chain(spill)
            .chain(tier)
            .chain(second)
            .collect()
    }

    /// A second stream allocates: with `range:auto`, the streams place their blocks in one
    /// shared range from now on (the first stream's, opened by
    /// [`Policy::open_range_to_streams`] just before).
    pub fn streams_share_memory(&self) {
        if let Some(s) = self.spills.as_ref() {
            s.share();
        }
        if let Some((_, Some(s), _)) = self.second.as_ref() {
            s.share();
        }
    }

    /// The policy kind.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// A fresh instance for `stream`.
    pub fn make(&self, stream: Stream) -> Box<dyn Policy> {
        (self.make)(stream)
    }

    /// With `big_page`: the switch to the second tier, shared by the streams.
    pub fn tiers(&self) -> Option<Arc<tiered::TierSwitch>> {
        self.second.as_ref().map(|(_, _, sw)| sw.clone())
    }
}
