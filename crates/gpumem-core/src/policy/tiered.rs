//! The stitched policy in two tiers (`big_page`): the device's 2 MiB pages until the device
//! holds `big_after` bytes, then larger pages for every block placed from then on.
//!
//! Why: the driver charges each physical handle about 50 µs to create, map and set access on an
//! H200 whatever its size, so a pool of tens of GiB grown in 2 MiB pages pays for growth in
//! every step that meets a larger shape (BENCHMARKS.md §3, session 27), while 16 MiB pages cost
//! a small program's memory (a block holds whole pages: up to 1.10 of live on the small
//! traces, 1.003–1.009 on those of 4–24 GiB; §1, session 25). The tiers are two stitched pools
//! with ranges of their own; once the second takes over, the first keeps the blocks it holds
//! and takes no new ones. Its idle pages go back to the device once their work is known done
//! (an event query, no wait), and at once, waiting for that work, only when the memory held
//! would pass the live peak by half a percent: so the memory held stays at what is in use.
//!
//! Off by default (`big_page:off`). Replayed (BENCHMARKS.md §1, session 27): GPT-2 grows for a
//! third of the driver time, with fewer host waits, at 1.003–1.007 of live; but a pool that
//! stops at the threshold keeps moving blocks' pages from tier to tier (the Llama decoder at
//! 4 GiB: 1,203 host waits against 52), which is why it is not the default.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::stitched::PagePool;
use super::{Placement, Policy, SegmentInfo};
use crate::backend::{DevPtr, Stream};
use crate::device::Device;
use crate::error::BackendError;
use crate::stats::MemoryStats;

/// Makes a policy instance for a stream.
pub type MakePolicy = Box<dyn Fn(Stream) -> Box<dyn Policy> + Send + Sync>;

/// What the streams of one device share: when to switch, whether it happened, and how to make
/// a stream's instance of each tier.
pub struct TierSwitch {
    /// Bytes held from the device at which new blocks go to the second tier.
    after: u64,
    switched: AtomicBool,
    /// Bytes held when it switched (0: not yet).
    held_at_switch: AtomicU64,
    /// Bytes of a second-tier page.
    big_page: u64,
    second: MakePolicy,
    /// The first tier's pages: how many are idle.
    first_pool: Arc<PagePool>,
}

impl TierSwitch {
    /// A switch at `after` bytes held from the first tier's `first_pool` to second-tier
    /// instances made by `second`, whose pages are `big_page` bytes.
    pub fn new(after: u64, big_page: u64, second: MakePolicy, first_pool: Arc<PagePool>) -> Self {
        Self {
            after,
            switched: AtomicBool::new(false),
            held_at_switch: AtomicU64::new(0),
            big_page,
            second,
            first_pool,
        }
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
                "stitched: the device held {} when new blocks went to pages of {} (big_page, \
                 from big_after {}); the blocks placed before stay on the first pages, which go \
                 back to the device as they go idle",
                crate::units::format_size(held),
                crate::units::format_size(self.big_page),
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
}

impl Tiered {
    /// The instance of `stream` with first-tier policy `first`.
    pub fn new(stream: Stream, first: Box<dyn Policy>, switch: Arc<TierSwitch>) -> Self {
        Self {
            stream,
            first,
            second: None,
            switch,
            first_idle: false,
            since_try: 0,
            live: 0,
            live_peak: 0,
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

    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        if !self.switch.switched.load(Ordering::Relaxed) {
            let placed = self.first.allocate(size, dev)?;
            self.live += placed.size;
            self.live_peak = self.live_peak.max(self.live);
            let held = dev.lock().held();
            if held >= self.switch.after && !self.switch.switched.swap(true, Ordering::Relaxed) {
                self.switch.held_at_switch.store(held, Ordering::Relaxed);
            }
            return Ok(placed);
        }
        self.since_try += 1;
        let held = if self.first_idle {
            dev.lock().held()
        } else {
            0
        };
        // The second tier may grow past the bound while the first still holds idle pages.
        let over = self.first_idle
            && (held + size) as f64 > (self.live_peak.max(self.live + size)) as f64 * (1.0 + OVER);
        if self.first_idle && (over || self.since_try >= TRY_EVERY) {
            // Blocks of the first tier were freed: its idle pages serve no new block, so once
            // they add up they go back, those whose work is done; the others at a later try,
            // or at once (waiting for their work) when the second tier would grow past the
            // bound.
            self.since_try = 0;
            let limit = (held / TRIM_SHARE).max(TRIM_MIN);
            if self.switch.first_idle_bytes() < limit {
                self.first_idle = false;
            } else {
                self.switch.first_pool.trim_done(dev)?;
                if over && self.switch.first_idle_bytes() >= limit {
                    self.first.release_cached(dev)?;
                }
                self.first_idle = self.switch.first_idle_bytes() >= limit;
            }
        }
        let switch = self.switch.clone();
        let second = self
            .second
            .get_or_insert_with(|| (switch.second)(self.stream));
        let placed = second.allocate(size, dev)?;
        self.live += placed.size;
        self.live_peak = self.live_peak.max(self.live);
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
        let mut st = self.first.stats();
        if let Some(s) = self.second.as_ref() {
            st.merge_blocks(&s.stats());
        }
        st
    }

    fn reset_peaks(&mut self) {
        self.first.reset_peaks();
        if let Some(s) = self.second.as_mut() {
            s.reset_peaks();
        }
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
