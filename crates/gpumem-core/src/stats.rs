//! Allocator statistics under PyTorch's names (`torch.cuda.memory_stats()`), so dashboards and
//! habits carry over: `allocated_bytes.all.peak`, `reserved_bytes.large_pool.current`, ...

use serde::Serialize;
use std::collections::BTreeMap;

/// One statistic: its current value, its high-water mark, and the totals added and removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Sum of all increases.
    pub allocated: i64,
    /// Sum of all decreases.
    pub freed: i64,
}

impl Stat {
    /// Adds `n`.
    #[inline]
    pub fn inc(&mut self, n: u64) {
        self.current += n as i64;
        self.allocated += n as i64;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    /// Removes `n`.
    #[inline]
    pub fn dec(&mut self, n: u64) {
        self.current -= n as i64;
        self.freed += n as i64;
    }

    /// Adds a signed change.
    #[inline]
    pub fn change(&mut self, delta: i64) {
        if delta >= 0 {
            self.inc(delta as u64)
        } else {
            self.dec(delta.unsigned_abs())
        }
    }
}

/// Which pool a block belongs to, for the per-pool statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Pool {
    /// Requests of at most 1 MiB.
    Small,
    /// Everything else.
    Large,
}

impl Pool {
    /// The pool PyTorch would put a request of `size` (rounded) bytes in.
    #[inline]
    pub fn of(size: u64) -> Pool {
        if size <= crate::units::SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        }
    }

    /// 0 for the small pool, 1 for the large one (the order of per-pool arrays).
    #[inline]
    pub fn index(self) -> usize {
        match self {
            Pool::Small => 0,
            Pool::Large => 1,
        }
    }

    /// "small_pool" / "large_pool".
    pub fn name(self) -> &'static str {
        match self {
            Pool::Small => "small_pool",
            Pool::Large => "large_pool",
        }
    }
}

/// A statistic for all pools together and for each pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StatArray {
    /// Both pools.
    pub all: Stat,
    /// Requests of at most 1 MiB.
    pub small_pool: Stat,
    /// Larger requests.
    pub large_pool: Stat,
}

impl StatArray {
    /// Adds `n` to the aggregate and to `pool`.
    #[inline]
    pub fn inc(&mut self, pool: Pool, n: u64) {
        self.all.inc(n);
        self.pool_mut(pool).inc(n);
    }

    /// Removes `n` from the aggregate and from `pool`.
    #[inline]
    pub fn dec(&mut self, pool: Pool, n: u64) {
        self.all.dec(n);
        self.pool_mut(pool).dec(n);
    }

    /// Signed change.
    #[inline]
    pub fn change(&mut self, pool: Pool, delta: i64) {
        self.all.change(delta);
        self.pool_mut(pool).change(delta);
    }

    #[inline]
    fn pool_mut(&mut self, pool: Pool) -> &mut Stat {
        match pool {
            Pool::Small => &mut self.small_pool,
            Pool::Large => &mut self.large_pool,
        }
    }

    /// The three pools under PyTorch's names, in PyTorch's order: `all`, `small_pool`,
    /// `large_pool`.
    pub fn each(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("small_pool", &self.small_pool),
            ("large_pool", &self.large_pool),
        ]
    }

    fn each_mut(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }
}

/// The statistics of one allocator, with `torch.cuda.memory_stats()`'s names and meanings:
///
/// - `allocation` / `allocated_bytes`: blocks handed out and not yet freed by the user.
/// - `active` / `active_bytes`: allocated, or freed but waiting for other streams' events.
/// - `inactive_split` / `inactive_split_bytes`: free blocks that are part of a split segment
///   (memory that cannot be returned to the device on its own).
/// - `segment` / `reserved_bytes`: physical allocations held from the device and their bytes.
/// - `requested_bytes`: the sizes the user asked for, before rounding.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    /// Live blocks.
    pub allocation: StatArray,
    /// Physical allocations held (segments, or physical pages for the virtual-memory policies).
    pub segment: StatArray,
    /// Live blocks plus blocks waiting for events.
    pub active: StatArray,
    /// Free blocks inside split segments.
    pub inactive_split: StatArray,
    /// Bytes of live blocks.
    pub allocated_bytes: StatArray,
    /// Bytes held from the device.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of free blocks inside split segments.
    pub inactive_split_bytes: StatArray,
    /// Bytes requested by the user for active blocks.
    pub requested_bytes: StatArray,
    /// Times the allocator released its cache and retried a request.
    pub num_alloc_retries: i64,
    /// Requests that failed for lack of memory.
    pub num_ooms: i64,
    /// Times every outstanding event was waited for.
    pub num_sync_all_streams: i64,
    /// Physical allocations made (cuMemAlloc or cuMemCreate).
    pub num_device_alloc: i64,
    /// Physical allocations returned.
    pub num_device_free: i64,
}

impl MemoryStats {
    // What a block's life changes in the block statistics: the same as `BlockStats`' methods
    // of these names, on the full form.

    /// A block of `bytes` (asked for `requested`) is handed out from `pool`.
    #[inline]
    pub fn block_handed_out(&mut self, pool: Pool, bytes: u64, requested: u64) {
        self.allocation.inc(pool, 1);
        self.allocated_bytes.inc(pool, bytes);
        self.active.inc(pool, 1);
        self.active_bytes.inc(pool, bytes);
        self.requested_bytes.inc(pool, requested);
    }

    /// The user freed it: no longer allocated, still active until its stream uses are done.
    #[inline]
    pub fn block_freed(&mut self, pool: Pool, bytes: u64) {
        self.allocation.dec(pool, 1);
        self.allocated_bytes.dec(pool, bytes);
    }

    /// It is reusable: no longer active either.
    #[inline]
    pub fn block_released(&mut self, pool: Pool, bytes: u64, requested: u64) {
        self.active.dec(pool, 1);
        self.active_bytes.dec(pool, bytes);
        self.requested_bytes.dec(pool, requested);
    }

    /// Adds the block statistics of `other` (another stream's shard) into `self`. Current
    /// values, totals and counters add exactly; peaks add too, which makes the combined peak
    /// an upper bound of the true device-wide peak when several streams allocate.
    pub fn merge_blocks(&mut self, other: &MemoryStats) {
        self.with_block_stats(other, |m, t| {
            m.current += t.current;
            m.peak += t.peak;
            m.allocated += t.allocated;
            m.freed += t.freed;
        });
        self.num_alloc_retries += other.num_alloc_retries;
        self.num_ooms += other.num_ooms;
        self.num_sync_all_streams += other.num_sync_all_streams;
    }

    /// Raises the block statistics' peaks of `self` to the current values `now`: the peaks of
    /// a sum of parts (the two tiers of one stream), kept by what sees every change of it.
    pub fn track_peaks(&mut self, now: &BlockCurrents) {
        for (arr, [small, large]) in self.block_arrays_mut().into_iter().zip(now.0) {
            arr.small_pool.peak = arr.small_pool.peak.max(small);
            arr.large_pool.peak = arr.large_pool.peak.max(large);
            arr.all.peak = arr.all.peak.max(small + large);
        }
    }

    /// The current values of the block statistics, per pool.
    pub fn block_currents(&self) -> BlockCurrents {
        BlockCurrents(
            self.block_arrays()
                .map(|a| [a.small_pool.current, a.large_pool.current]),
        )
    }

    /// Takes the block statistics' peaks from `tracked` (see [`MemoryStats::track_peaks`]) in
    /// place of the summed ones, never below the current value.
    pub fn use_peaks(&mut self, tracked: &MemoryStats) {
        self.with_block_stats(tracked, |m, t| m.peak = t.peak.max(m.current));
    }

    /// Calls `f` with each block statistic of `self` (every array, every pool) and the same
    /// statistic of `other`.
    fn with_block_stats(&mut self, other: &MemoryStats, mut f: impl FnMut(&mut Stat, &Stat)) {
        for (mine, theirs) in self
            .block_arrays_mut()
            .into_iter()
            .zip(other.block_arrays())
        {
            for (m, (_, t)) in mine.each_mut().into_iter().zip(theirs.each()) {
                f(m, t);
            }
        }
    }

    /// The block statistics (what a policy keeps; not the device's `segment` and
    /// `reserved_bytes`).
    fn block_arrays(&self) -> [&StatArray; 7] {
        [
            &self.allocation,
            &self.active,
            &self.inactive_split,
            &self.allocated_bytes,
            &self.active_bytes,
            &self.inactive_split_bytes,
            &self.requested_bytes,
        ]
    }

    fn block_arrays_mut(&mut self) -> [&mut StatArray; 7] {
        [
            &mut self.allocation,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Sets every peak to the current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peaks(&mut self) {
        for arr in self.arrays_mut() {
            for s in arr.each_mut() {
                s.peak = s.current;
            }
        }
    }

    /// Zeroes the `allocated`/`freed` totals and the counters
    /// (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        for arr in self.arrays_mut() {
            for s in arr.each_mut() {
                s.allocated = 0;
                s.freed = 0;
            }
        }
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// What accumulated since `base` was taken (the statistics at the last
    /// `torch.cuda.reset_accumulated_memory_stats`): `base`'s `allocated`/`freed` totals and
    /// counters are subtracted; current values and peaks are left as they are.
    pub fn since(&mut self, base: &MemoryStats) {
        for (mine, (_, theirs)) in self.arrays_mut().into_iter().zip(base.arrays()) {
            for (m, (_, t)) in mine.each_mut().into_iter().zip(theirs.each()) {
                m.allocated -= t.allocated;
                m.freed -= t.freed;
            }
        }
        self.num_alloc_retries -= base.num_alloc_retries;
        self.num_ooms -= base.num_ooms;
        self.num_sync_all_streams -= base.num_sync_all_streams;
        self.num_device_alloc -= base.num_device_alloc;
        self.num_device_free -= base.num_device_free;
    }

    /// The five counters under PyTorch's names, in the order of c10's `DeviceStats`.
    pub fn counters(&self) -> [(&'static str, i64); 5] {
        [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
        ]
    }

    /// The nine statistics under PyTorch's names, in the order of c10's `DeviceStats`.
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// The flat dictionary `torch.cuda.memory_stats()` returns:
    /// `"allocated_bytes.all.current" -> value`, plus the counters.
    pub fn to_flat(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        for (name, arr) in self.arrays() {
            for (pool, s) in arr.each() {
                m.insert(format!("{name}.{pool}.current"), s.current);
                m.insert(format!("{name}.{pool}.peak"), s.peak);
                m.insert(format!("{name}.{pool}.allocated"), s.allocated);
                m.insert(format!("{name}.{pool}.freed"), s.freed);
            }
        }
        for (name, value) in self.counters() {
            m.insert(name.into(), value);
        }
        // gpumem never refuses to split a block for its size (PyTorch's default too).
        m.insert("max_split_size".into(), -1);
        m
    }
}

/// One statistic of one pool as the allocation path keeps it: the value, its high-water mark
/// and the sum of increases. The sum of decreases is not kept: it is `up - current`.
#[derive(Debug, Clone, Copy, Default)]
struct Counter {
    current: i64,
    up: i64,
    peak: i64,
}

/// A statistic as the allocation path keeps it: per pool only. What [`StatArray`] holds for
/// both pools together (value, totals) is the sum of the pools, computed when read; only its
/// high-water mark is kept, since it is not the sum of the pools' marks. An increase writes
/// two fields and at most two marks (the pool's and both pools'), a decrease one field, where
/// [`StatArray`] writes four fields (and at most two marks) for either (see [`BlockStats`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Tally {
    pools: [Counter; 2],
    all_peak: i64,
}

impl Tally {
    /// Adds `n` to `pool`.
    #[inline]
    pub fn inc(&mut self, pool: Pool, n: u64) {
        let c = &mut self.pools[pool.index()];
        c.current += n as i64;
        c.up += n as i64;
        // Branches, not `max`: marks rarely move, and a skipped store is cheaper.
        if c.current > c.peak {
            c.peak = c.current;
        }
        let all = self.pools[0].current + self.pools[1].current;
        if all > self.all_peak {
            self.all_peak = all;
        }
    }

    /// Removes `n` from `pool`.
    #[inline]
    pub fn dec(&mut self, pool: Pool, n: u64) {
        self.pools[pool.index()].current -= n as i64;
    }

    /// Signed change.
    #[inline]
    pub fn change(&mut self, pool: Pool, delta: i64) {
        if delta >= 0 {
            self.inc(pool, delta as u64)
        } else {
            self.dec(pool, delta.unsigned_abs())
        }
    }

    /// Highest value of both pools together.
    #[inline]
    pub fn all_peak(&self) -> u64 {
        self.all_peak.max(0) as u64
    }

    /// Current value of both pools together.
    #[inline]
    pub fn all_current(&self) -> u64 {
        (self.pools[0].current + self.pools[1].current).max(0) as u64
    }

    /// Sets the marks to the current values.
    fn reset_peaks(&mut self) {
        for c in &mut self.pools {
            c.peak = c.current;
        }
        self.all_peak = self.pools[0].current + self.pools[1].current;
    }

    /// The full form.
    fn to_array(self) -> StatArray {
        let stat = |c: Counter| Stat {
            current: c.current,
            peak: c.peak,
            allocated: c.up,
            freed: c.up - c.current,
        };
        let [small, large] = self.pools.map(stat);
        StatArray {
            all: Stat {
                current: small.current + large.current,
                peak: self.all_peak,
                allocated: small.allocated + large.allocated,
                freed: small.freed + large.freed,
            },
            small_pool: small,
            large_pool: large,
        }
    }
}

/// What `active` (or `active_bytes`) holds beyond `allocation` (`allocated_bytes`): the blocks
/// freed by the user and waiting for other streams' events. Both statistics rise together when
/// a block is handed out, so `active` is kept as `allocation` plus this part, and its marks
/// need a look only while something is pending (see [`BlockStats`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Pending {
    /// Pending blocks (or bytes) per pool.
    current: [i64; 2],
    /// The marks of `active` per pool, as far as `allocation`'s marks do not hold them: set
    /// where a block is handed out while something is pending, and by a peak reset.
    peak: [i64; 2],
    /// The same for both pools together.
    all_peak: i64,
}

impl Pending {
    /// Whether any block is pending.
    #[inline(always)]
    fn any(&self) -> bool {
        (self.current[0] | self.current[1]) != 0
    }

    /// `active` (`base` plus this) rose in `pool`: its marks follow.
    #[inline]
    fn mark(&mut self, base: &Tally, pool: Pool) {
        let p = pool.index();
        let v = base.pools[p].current + self.current[p];
        if v > self.peak[p] {
            self.peak[p] = v;
        }
        let all = base.pools[0].current + base.pools[1].current + self.current[0] + self.current[1];
        if all > self.all_peak {
            self.all_peak = all;
        }
    }

    /// Marks at the current value of `active`.
    fn reset_peaks(&mut self, base: &Tally) {
        for p in 0..2 {
            self.peak[p] = base.pools[p].current + self.current[p];
        }
        self.all_peak = self.peak[0] + self.peak[1];
    }

    /// `active` in full, from its base.
    ///
    /// Its value is the base's plus the pending part, and its sum of increases the base's
    /// (both rise only when a block is handed out, by the same amount). Its mark is the
    /// higher of the base's and this part's: a mark of `active` reached with nothing pending
    /// is the base's value at that moment, which the base's mark holds; one reached with
    /// something pending, or set by a reset, is in `peak`. Neither exceeds `active`'s true mark,
    /// since the base never exceeds `active`.
    fn on(&self, base: &Tally) -> Tally {
        let mut t = *base;
        for p in 0..2 {
            t.pools[p].current += self.current[p];
            t.pools[p].peak = t.pools[p].peak.max(self.peak[p]);
        }
        t.all_peak = t.all_peak.max(self.all_peak);
        t
    }
}

/// The block statistics of [`MemoryStats`] (allocation, active, inactive_split, their bytes,
/// requested_bytes) in the form a policy updates on every allocation and free: [`Tally`]s
/// instead of [`StatArray`]s, and `active` (`active_bytes`) as `allocation`
/// (`allocated_bytes`) plus the [`Pending`] part. A block handed out and freed at once costs
/// 9 field writes instead of 40, marks aside. Read through [`BlockStats::to_memory_stats`],
/// which gives exactly what [`MemoryStats`]' own methods would have counted.
#[derive(Debug, Clone, Default)]
pub struct BlockStats {
    /// Live blocks.
    pub allocation: Tally,
    /// Blocks waiting for events (`active` is `allocation` plus these).
    pub active: Pending,
    /// Free blocks inside split segments.
    pub inactive_split: Tally,
    /// Bytes of live blocks.
    pub allocated_bytes: Tally,
    /// Bytes of blocks waiting for events (`active_bytes` is `allocated_bytes` plus these).
    pub active_bytes: Pending,
    /// Bytes of free blocks inside split segments.
    pub inactive_split_bytes: Tally,
    /// Bytes requested by the user for active blocks.
    pub requested_bytes: Tally,
}

/// The current values of the block statistics, per pool (small, large), in the order of
/// [`MemoryStats`]'s block arrays (allocation, active, inactive_split, and their bytes,
/// requested_bytes): all that a sum of parts needs to keep its own peaks, without building
/// whole [`MemoryStats`] at every allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockCurrents(pub [[i64; 2]; 7]);

impl BlockCurrents {
    /// Adds `other`'s values.
    pub fn add(&mut self, other: &BlockCurrents) {
        for (mine, theirs) in self.0.iter_mut().zip(&other.0) {
            mine[0] += theirs[0];
            mine[1] += theirs[1];
        }
    }
}

impl BlockStats {
    /// The current values [`BlockStats::to_memory_stats`] reports, alone.
    pub fn currents(&self) -> BlockCurrents {
        let tally = |t: &Tally| [t.pools[0].current, t.pools[1].current];
        let active = |p: &Pending, base: &Tally| {
            [
                base.pools[0].current + p.current[0],
                base.pools[1].current + p.current[1],
            ]
        };
        BlockCurrents([
            tally(&self.allocation),
            active(&self.active, &self.allocation),
            tally(&self.inactive_split),
            tally(&self.allocated_bytes),
            active(&self.active_bytes, &self.allocated_bytes),
            tally(&self.inactive_split_bytes),
            tally(&self.requested_bytes),
        ])
    }

    /// A block of `bytes` (asked for `requested`) is handed out from `pool`.
    #[inline(always)]
    pub fn block_handed_out(&mut self, pool: Pool, bytes: u64, requested: u64) {
        self.allocation.inc(pool, 1);
        self.allocated_bytes.inc(pool, bytes);
        self.requested_bytes.inc(pool, requested);
        // `active` rose with `allocation`; with nothing pending it equals it, marks included.
        if self.active.any() {
            self.active.mark(&self.allocation, pool);
            self.active_bytes.mark(&self.allocated_bytes, pool);
        }
    }

    /// The user freed it: no longer allocated, still active until its stream uses are done.
    #[inline(always)]
    pub fn block_freed(&mut self, pool: Pool, bytes: u64) {
        self.allocation.dec(pool, 1);
        self.allocated_bytes.dec(pool, bytes);
        self.active.current[pool.index()] += 1;
        self.active_bytes.current[pool.index()] += bytes as i64;
    }

    /// It is reusable: no longer active either.
    #[inline(always)]
    pub fn block_released(&mut self, pool: Pool, bytes: u64, requested: u64) {
        self.active.current[pool.index()] -= 1;
        self.active_bytes.current[pool.index()] -= bytes as i64;
        self.requested_bytes.dec(pool, requested);
    }

    /// [`BlockStats::block_freed`] and [`BlockStats::block_released`] at once: nothing is
    /// pending in between.
    #[inline(always)]
    pub fn block_freed_and_released(&mut self, pool: Pool, bytes: u64, requested: u64) {
        self.allocation.dec(pool, 1);
        self.allocated_bytes.dec(pool, bytes);
        self.requested_bytes.dec(pool, requested);
    }

    /// Sets every peak to the current value.
    pub fn reset_peaks(&mut self) {
        for t in [
            &mut self.allocation,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ] {
            t.reset_peaks();
        }
        self.active.reset_peaks(&self.allocation);
        self.active_bytes.reset_peaks(&self.allocated_bytes);
    }

    /// The full form, with the device-level statistics and the counters at zero.
    pub fn to_memory_stats(&self) -> MemoryStats {
        MemoryStats {
            allocation: self.allocation.to_array(),
            active: self.active.on(&self.allocation).to_array(),
            inactive_split: self.inactive_split.to_array(),
            allocated_bytes: self.allocated_bytes.to_array(),
            active_bytes: self.active_bytes.on(&self.allocated_bytes).to_array(),
            inactive_split_bytes: self.inactive_split_bytes.to_array(),
            requested_bytes: self.requested_bytes.to_array(),
            ..MemoryStats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestRng;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.inc(10);
        s.inc(5);
        s.dec(12);
        s.inc(1);
        assert_eq!(
            s,
            Stat {
                current: 4,
                peak: 15,
                allocated: 16,
                freed: 12
            }
        );
    }

    #[test]
    fn flat_names_match_torch() {
        let mut m = MemoryStats::default();
        m.allocated_bytes.inc(Pool::Large, 4 << 20);
        m.allocated_bytes.inc(Pool::Small, 512);
        let f = m.to_flat();
        assert_eq!(f["allocated_bytes.all.current"], (4 << 20) + 512);
        assert_eq!(f["allocated_bytes.large_pool.peak"], 4 << 20);
        assert_eq!(f["allocated_bytes.small_pool.allocated"], 512);
        assert_eq!(f["reserved_bytes.all.current"], 0);
        // 9 stats x 3 pools x 4 fields + 6 scalars
        assert_eq!(f.len(), 9 * 3 * 4 + 6);
    }

    #[test]
    fn reset_peaks_keeps_current() {
        let mut m = MemoryStats::default();
        m.active_bytes.inc(Pool::Small, 100);
        m.active_bytes.dec(Pool::Small, 60);
        m.reset_peaks();
        assert_eq!(m.active_bytes.all.peak, 40);
        assert_eq!(m.active_bytes.small_pool.peak, 40);
    }

    #[test]
    fn block_stats_read_as_the_full_form() {
        // Random block lives (handed out, freed, released later or at once) and peak resets,
        // applied to both forms, read the same throughout.
        let mut rng = TestRng::new(0x2545_F491_4F6C_DD1D);
        let (mut full, mut fast) = (MemoryStats::default(), BlockStats::default());
        // Blocks as (pool, bytes, requested).
        let mut live: Vec<(Pool, u64, u64)> = Vec::new();
        let mut pending: Vec<(Pool, u64, u64)> = Vec::new();
        for step in 0..20_000 {
            match rng.below(9) {
                0 => {
                    full.reset_peaks();
                    fast.reset_peaks();
                }
                1..=3 => {
                    let pool = if rng.below(2) == 0 {
                        Pool::Small
                    } else {
                        Pool::Large
                    };
                    let bytes = 512 * (1 + rng.below(64));
                    let requested = bytes - rng.below(512);
                    full.block_handed_out(pool, bytes, requested);
                    fast.block_handed_out(pool, bytes, requested);
                    live.push((pool, bytes, requested));
                }
                4..=5 if !live.is_empty() => {
                    let (pool, bytes, requested) = live.swap_remove(rng.index(live.len()));
                    full.block_freed(pool, bytes);
                    full.block_released(pool, bytes, requested);
                    fast.block_freed_and_released(pool, bytes, requested);
                }
                6 if !live.is_empty() => {
                    let b = live.swap_remove(rng.index(live.len()));
                    full.block_freed(b.0, b.1);
                    fast.block_freed(b.0, b.1);
                    pending.push(b);
                }
                7..=8 if !pending.is_empty() => {
                    let (pool, bytes, requested) = pending.swap_remove(rng.index(pending.len()));
                    full.block_released(pool, bytes, requested);
                    fast.block_released(pool, bytes, requested);
                }
                _ => {}
            }
            assert_eq!(fast.to_memory_stats(), full, "step {step}");
            // The current values alone, as a sum of parts reads them at every allocation.
            assert_eq!(fast.currents(), full.block_currents(), "step {step}");
        }
        assert!(full.active.all.peak > full.allocation.all.peak);
    }

    #[test]
    fn tally_reads_as_the_full_form() {
        // Random changes applied to both forms, with peak resets, read the same throughout.
        let mut rng = TestRng::new(0x9E37_79B9_7F4A_7C15);
        let (mut full, mut tally) = (StatArray::default(), Tally::default());
        for step in 0..10_000 {
            let pool = if rng.below(3) == 0 {
                Pool::Small
            } else {
                Pool::Large
            };
            let held = match pool {
                Pool::Small => full.small_pool.current,
                Pool::Large => full.large_pool.current,
            };
            let n = rng.below(1000);
            match rng.below(7) {
                0 => {
                    for s in full.each_mut() {
                        s.peak = s.current;
                    }
                    tally.reset_peaks();
                }
                1..=3 => {
                    full.inc(pool, n);
                    tally.inc(pool, n);
                }
                _ => {
                    let d = -((n as i64).min(held));
                    full.change(pool, d);
                    tally.change(pool, d);
                }
            }
            assert_eq!(tally.to_array(), full, "step {step}");
        }
        assert!(full.all.peak > full.small_pool.peak.max(full.large_pool.peak));
    }
}
