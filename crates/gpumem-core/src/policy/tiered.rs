//! The stitched policy in two tiers (`big_page`, on by default): the device's 2 MiB pages until
//! the pool holds `big_after` bytes (8 GiB), then 16 MiB pages for the blocks placed from then
//! on.
//!
//! Why: the driver charges each physical handle about 50 µs to create, map and set access on an
//! H200 whatever its size, so a pool of tens of GiB grown in 2 MiB pages pays for growth in
//! every step that meets a larger shape (BENCHMARKS.md §3, session 27), while 16 MiB pages cost
//! a small program's memory (a block holds whole pages: up to 1.10 of live on the small
//! traces, 1.003–1.009 on those of 4–24 GiB; §1, session 25). The tiers are two stitched pools
//! with ranges of their own. Once the second takes over, the first maps no page any more: it
//! keeps the blocks it holds, and takes a new one only where the block's pages are still
//! mapped and idle in place (no driver call). Every other block goes to the second tier. The
//! first tier's idle pages go back to the device once their work is known done (an event
//! query, no wait), and at once, waiting for that work, only when the memory held would pass
//! the live peak by half a percent; after such a wait the stream places nothing more in the
//! first tier. So the memory held stays at what is in use, and a pool that stops near the
//! threshold keeps its blocks where they are instead of moving them over.
//!
//! Replayed (BENCHMARKS.md §1, session 28): GPT-2's growth costs 0.29 s of driver time against
//! 0.49 s, at 1.005 of live against 1.001; pools under 8 GiB are untouched. On the H200, the
//! 64 timed steps of GPT-2 with random lengths spent 19–25 ms in driver calls after the third
//! step against 142–169 ms (§3, session 28).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::stitched::PagePool;
use super::{Placement, Policy, SegmentInfo};
use crate::backend::{DevPtr, Stream};
use crate::device::Device;
use crate::error::BackendError;
use crate::stats::{BlockCurrents, MemoryStats};

/// Makes a policy instance for a stream.
pub type MakePolicy = Box<dyn Fn(Stream) -> Box<dyn Policy> + Send + Sync>;

/// What the streams of one device share: when to switch, whether it happened, and how to make
/// a stream's instance of each tier.
pub struct TierSwitch {
    /// Bytes the first tier holds from which new blocks go to the second tier.
    after: u64,
    switched: AtomicBool,
    /// Bytes the first tier held when it switched (0: not yet).
    held_at_switch: AtomicU64,
    second: MakePolicy,
    /// The first tier's pages.
    first_pool: Arc<PagePool>,
    /// The second tier's pages.
    second_pool: Arc<PagePool>,
}

impl TierSwitch {
    /// A switch at `after` bytes held from the first tier's `first_pool` to second-tier
    /// instances made by `second`, drawing their (larger) pages from `second_pool`.
    pub fn new(
        after: u64,
        second: MakePolicy,
        first_pool: Arc<PagePool>,
        second_pool: Arc<PagePool>,
    ) -> Self {
        Self {
            after,
            switched: AtomicBool::new(false),
            held_at_switch: AtomicU64::new(0),
            second,
            first_pool,
            second_pool,
        }
    }

    /// After an allocation on the first tier alone: whether new blocks go to the second tier
    /// now (the first time the first tier holds `big_after`, the switch happens).
    #[inline]
    pub fn due(&self) -> bool {
        self.switched.load(Ordering::Relaxed)
            || (self.first_pool.held_bytes() >= self.after && self.switch_now())
    }

    #[cold]
    #[inline(never)]
    fn switch_now(&self) -> bool {
        if !self.switched.swap(true, Ordering::Relaxed) {
            let held = self.first_pool.held_bytes();
            self.held_at_switch.store(held, Ordering::Relaxed);
            self.first_pool.close();
        }
        true
    }

    /// The instance of `stream` in two tiers, over its first-tier instance `first`.
    pub fn wrap(self: &Arc<Self>, stream: Stream, first: Box<dyn Policy>) -> Box<dyn Policy> {
        Box::new(Tiered::new(stream, first, self.clone()))
    }

    /// Bytes of the first tier's idle pages.
    fn first_idle_bytes(&self) -> u64 {
        let c = self.first_pool.counters();
        c.held.saturating_sub(c.busy) * self.first_pool.page_bytes()
    }

    /// One line for the policy's notes once it switched.
    pub fn note(&self) -> Option<String> {
        let held = self.held_at_switch.load(Ordering::Relaxed);
        (held > 0).then(|| {
            format!(
                "stitched: the pool held {} when new blocks went to pages of {} (big_page, \
                 from big_after {}); the first pages keep their blocks and take new ones only \
                 where their pages are still mapped, and go back to the device as they go idle",
                crate::units::format_size(held),
                crate::units::format_size(self.second_pool.page_bytes()),
                crate::units::format_size(self.after),
            )
        })
    }
}

/// Idle bytes of the first tier from which they go back: a 256th of the bytes held (0.4 %),
/// and at least [`TRIM_MIN`] (each give-back queries events, or waits near the bound).
const TRIM_SHARE: u64 = 256;
/// See [`TRIM_SHARE`].
const TRIM_MIN: u64 = 64 << 20;

/// Second-tier allocations between two tries at giving the first tier's idle pages back (each
/// try reads the pool's counters and queries events).
const TRY_EVERY: u32 = 16;

/// Share over the live peak the memory held may reach before the first tier's idle pages go
/// back at once, waiting for their work.
const OVER: f64 = 0.005;

/// One stream's instance: its first-tier policy, and its second-tier one once it placed a
/// block there.
pub struct Tiered {
    stream: Stream,
    first: Box<dyn Policy>,
    second: Option<Box<dyn Policy>>,
    switch: Arc<TierSwitch>,
    /// A block of the first tier was freed since its idle pages were last given back.
    first_idle: bool,
    /// Second-tier allocations since the last try.
    since_try: u32,
    /// Bytes of this stream's live blocks, and their peak.
    live: u64,
    live_peak: u64,
    /// The first tier's idle pages had to go back with a wait: it takes no new block.
    sealed: bool,
    /// With two tiers: the peaks of their summed block statistics.
    peaks: MemoryStats,
}

impl Tiered {
    /// The instance of `stream` once the switch happened, over its first-tier instance
    /// `first`: it counts the stream's live bytes from what that one holds, and takes it that
    /// blocks of the first tier may have been freed.
    pub fn new(stream: Stream, first: Box<dyn Policy>, switch: Arc<TierSwitch>) -> Self {
        let st = first.stats();
        let live = st.allocated_bytes.all.current.max(0) as u64;
        let live_peak = st.allocated_bytes.all.peak.max(0) as u64;
        Self {
            stream,
            first,
            second: None,
            switch,
            first_idle: true,
            since_try: 0,
            live,
            live_peak,
            sealed: false,
            peaks: MemoryStats::default(),
        }
    }

    /// The tier that placed the block at `addr` (the second's ranges hold it, or else the
    /// first).
    fn tier(&mut self, addr: DevPtr) -> (&mut Box<dyn Policy>, bool) {
        match self.second.as_mut() {
            Some(s) if s.holds(addr) => (s, false),
            _ => (&mut self.first, true),
        }
    }

    /// A free of `size` bytes (None: no such block) reached the first tier, or the second.
    fn freed(&mut self, first: bool, size: Option<u64>) {
        self.first_idle |= first && size.is_some();
        self.live = self.live.saturating_sub(size.unwrap_or(0));
    }

    /// Both tiers' block statistics, summed, peaks included (each tier's own, added).
    fn summed_stats(&self) -> MemoryStats {
        let mut st = self.first.stats();
        if let Some(s) = self.second.as_ref() {
            st.merge_blocks(&s.stats());
        }
        st
    }

    /// Both tiers' block statistics, summed; peaks as tracked once there are two.
    fn merged_stats(&self) -> MemoryStats {
        let mut st = self.summed_stats();
        if self.second.is_some() {
            st.use_peaks(&self.peaks);
        }
        st
    }

    /// After an allocation with two tiers: the peaks of their sum (peaks rise only when a
    /// block is handed out). Summing each tier's own peak would count blocks that were never
    /// live together: GPT-2's allocated peak read 31 GiB for 23 (H200, session 28).
    fn track_peaks(&mut self) {
        if self.second.is_some() {
            // The current values alone: whole statistics of both tiers at every allocation
            // cost about 1,500 instructions (GPT-2 with random lengths, session 30).
            let now = Policy::block_currents(self);
            self.peaks.track_peaks(&now);
        }
    }

    fn tier_ref(&self, addr: DevPtr) -> &dyn Policy {
        match self.second.as_ref() {
            Some(s) if s.holds(addr) => s.as_ref(),
            _ => self.first.as_ref(),
        }
    }
}

impl Policy for Tiered {
    fn name(&self) -> &'static str {
        "stitched"
    }

    /// The first tier where the block's pages are mapped in place, else the second.
    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        if !self.sealed {
            // A block whose pages the first tier still has mapped and idle in place goes
            // there: no driver call, and a pool that stops near the threshold keeps most of
            // its blocks where they were (the Llama decoder with big_after:4GiB: 64 host
            // waits against 1,203 when every new block went to the second tier, and 52 in
            // one tier). The first tier maps no page any more, so anything else is refused.
            match self.first.allocate(size, dev) {
                Ok(placed) => {
                    self.live += placed.size;
                    self.live_peak = self.live_peak.max(self.live);
                    self.track_peaks();
                    return Ok(placed);
                }
                Err(e) if e.out_of_memory => {}
                Err(e) => return Err(e),
            }
        }
        self.since_try += 1;
        let held = if self.first_idle {
            self.switch.first_pool.held_bytes() + self.switch.second_pool.held_bytes()
        } else {
            0
        };
        let bound = (self.live_peak.max(self.live + size)) as f64 * (1.0 + OVER);
        // The second tier may grow past the bound while the first still holds idle pages.
        let over = self.first_idle && (held + size) as f64 > bound;
        if self.first_idle && (over || self.since_try >= TRY_EVERY) {
            // Blocks of the first tier were freed: once its idle pages add up they go back,
            // those whose work is done; the others at a later try, or at once (waiting for
            // their work) when the second tier would grow past the bound.
            self.since_try = 0;
            let limit = (held / TRIM_SHARE).max(TRIM_MIN);
            if self.switch.first_idle_bytes() < limit {
                self.first_idle = false;
            } else {
                self.switch.first_pool.trim_done(dev)?;
                if over && self.switch.first_idle_bytes() >= limit {
                    self.first.release_cached(dev)?;
                    // The first tier's reuse in place now costs host waits: blocks it takes
                    // go idle again and must go back the same way at the next step (GPT-2
                    // training with every wait counted: 600-1,000 calls a quarter, never
                    // settling). From now on this stream places new blocks in the second.
                    self.sealed = true;
                }
                self.first_idle = self.switch.first_idle_bytes() >= limit;
            }
        }
        // The second tier may make pages up to the bound less what the first still holds.
        let allowed = (bound as u64).saturating_sub(self.switch.first_pool.held_bytes())
            / self.switch.second_pool.page_bytes();
        self.switch.second_pool.allow(allowed);
        if self.second.is_none() {
            // The peaks so far are the first tier's alone.
            self.peaks = self.first.stats();
            self.second = Some((self.switch.second)(self.stream));
        }
        let placed = self
            .second
            .as_mut()
            .expect("made above")
            .allocate(size, dev)?;
        self.live += placed.size;
        self.live_peak = self.live_peak.max(self.live);
        self.track_peaks();
        Ok(placed)
    }

    fn free_requested(&mut self, addr: DevPtr, dev: &Device) -> Option<u64> {
        let (t, first) = self.tier(addr);
        let size = t.free_requested(addr, dev);
        self.freed(first, size);
        size
    }

    fn release(&mut self, addr: DevPtr, dev: &Device) -> Result<(), BackendError> {
        self.tier(addr).0.release(addr, dev)
    }

    fn free(&mut self, addr: DevPtr, dev: &Device) -> Result<Option<u64>, BackendError> {
        let (t, first) = self.tier(addr);
        let size = t.free(addr, dev)?;
        self.freed(first, size);
        Ok(size)
    }

    fn free_handle(
        &mut self,
        handle: u32,
        addr: DevPtr,
        dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        let (t, first) = self.tier(addr);
        let size = t.free_handle(handle, addr, dev)?;
        self.freed(first, size);
        Ok(size)
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        let mut released = self.first.release_cached(dev)?;
        if let Some(s) = self.second.as_mut() {
            released += s.release_cached(dev)?;
        }
        self.first_idle = false;
        Ok(released)
    }

    fn stats(&self) -> MemoryStats {
        self.merged_stats()
    }

    fn block_currents(&self) -> BlockCurrents {
        let mut now = self.first.block_currents();
        if let Some(s) = self.second.as_ref() {
            now.add(&s.block_currents());
        }
        now
    }

    fn reset_peaks(&mut self) {
        self.first.reset_peaks();
        if let Some(s) = self.second.as_mut() {
            s.reset_peaks();
        }
        self.peaks = self.merged_stats();
        self.peaks.reset_peaks();
    }

    fn largest_obtainable(&self, fresh: u64) -> u64 {
        let first = self.first.largest_obtainable(fresh);
        self.second
            .as_ref()
            .map_or(first, |s| first.max(s.largest_obtainable(fresh)))
    }

    fn largest_free(&self) -> u64 {
        let first = self.first.largest_free();
        self.second
            .as_ref()
            .map_or(first, |s| first.max(s.largest_free()))
    }

    fn segments(&self) -> Vec<SegmentInfo> {
        let mut segs = self.first.segments();
        if let Some(s) = self.second.as_ref() {
            segs.extend(s.segments());
        }
        segs
    }

    fn is_allocated(&self, addr: DevPtr) -> bool {
        self.tier_ref(addr).is_allocated(addr)
    }

    fn is_allocated_handle(&self, handle: u32, addr: DevPtr) -> bool {
        self.tier_ref(addr).is_allocated_handle(handle, addr)
    }

    fn is_free_block(&self, addr: DevPtr) -> bool {
        self.tier_ref(addr).is_free_block(addr)
    }

    fn check(&self) -> Result<(), String> {
        self.first.check()?;
        match self.second.as_ref() {
            Some(s) => s.check(),
            None => Ok(()),
        }
    }

    fn open_range_to_streams(&mut self) {
        self.first.open_range_to_streams();
        if let Some(s) = self.second.as_mut() {
            s.open_range_to_streams();
        }
    }

    fn holds(&self, addr: DevPtr) -> bool {
        self.first.holds(addr) || self.second.as_ref().is_some_and(|s| s.holds(addr))
    }
}
