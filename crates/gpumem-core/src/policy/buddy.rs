//! A binary buddy allocator: every block is a power of two (at least 512 B) inside a
//! power-of-two arena, split in halves on the way down and merged with its buddy on the way
//! up. Fragmentation between blocks is impossible; the price is rounding, up to half of each
//! block.
//!
//! A request of order `o` takes a free block of the smallest order `k >= o` that has one,
//! oldest arena first, lowest offset within it: never by absolute address, which depends on
//! where the device put each arena (the simulated device and the driver place them
//! differently, and choosing by address made the GPU hold 3–12 % more than the replay on the
//! same trace).
//!
//! Every allocation and free runs under the engine's shard lock, so the free-block index is
//! built for a few nanoseconds per step, without ordered trees (a node search and memmoves for
//! each block split or merged, and an arena search by address on every call):
//!
//! - Arenas sit in a `Vec` in creation order, so "oldest arena" is "lowest slot", and each
//!   live block remembers its slot: a free needs no address search. `release_cached` compacts
//!   the `Vec` (keeping the order) and renumbers the live blocks.
//! - Each arena keeps, per order, a bitmap of its free blocks (bit `offset >> order`) under
//!   summary levels of one bit per non-zero word below (`Bits`): the lowest free block is one
//!   `trailing_zeros` per level (at most 3 in a 64 MiB arena), a buddy test is one bit, and
//!   splitting or merging sets or clears one bit per order. An order's bitmap is allocated the
//!   first time the arena holds a free block of that order; all of them together take about
//!   1/2000 of the arena's size in host memory (32 KiB for a 64 MiB arena).
//! - Per order, the same kind of bitmap over arena slots says which arenas hold a free block
//!   of that order, and one `u64` says which orders have any: the smallest order `>= o` is one
//!   `trailing_zeros`.
//!
//! Merging is lazy by one block per order. A block freed while its order has no parked block
//! is parked: kept whole, unmerged, still filed as a block. The next request of its order takes
//! it back, unless the free blocks hold one of an older arena (then it is merged and placement
//! goes on as usual). Every parked block is merged before placement would need a new arena and
//! before the cache is released. A free then an allocation of the same size (a training step,
//! the benchmark's same-size case) then costs no split and no merge: a 1 MiB block in a fresh
//! 64 MiB arena was split six times on each allocation and merged six times on each free.
//! Parking changes placement a little: of the 13 recorded traces, 10 replay to the same
//! peak, llama_decode needs one 64 MiB arena fewer, serve_threads and vit_accum one more
//! (BENCHMARKS.md §1, session 11). Without the older-arena rule prefetch_mlp needed two more.

use super::{BlockInfo, BlockKind, Placement, Policy, SegmentInfo};
use crate::backend::{DevPtr, Stream};
use crate::device::Device;
use crate::error::BackendError;
use crate::stats::{BlockStats, MemoryStats, Pool};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

const MIN_ORDER: u32 = 9; // 512 B
const ARENA_ORDER: u32 = 26; // 64 MiB arenas; larger requests get an arena of their own
const MAX_ORDER: u32 = 50;

/// A set of `2^log_len` bits under summary levels: bit `j` of level `l + 1` says whether word
/// `j` of level `l` is non-zero, up to a top level of one word. The lowest set bit is one
/// `trailing_zeros` per level, and a set or clear is one word per level.
struct Bits {
    /// The top level, inline: a set of up to 64 bits needs no other memory, and emptiness and
    /// the first step of a search read no other cache line.
    top: u64,
    /// The levels below the top, leaves first (level `l` has `2^(log_len - 6 (l + 1))` words);
    /// allocated when a bit is first set, so orders an arena never splits down to cost nothing.
    below: Box<[u64]>,
    log_len: u8,
    /// Levels below the top.
    depth: u8,
}

impl Bits {
    fn new(log_len: u32) -> Self {
        Self {
            top: 0,
            below: Box::default(),
            log_len: log_len as u8,
            // Levels in all: one per 6 bits of length, at least one (the top).
            depth: (log_len.max(1).div_ceil(6) - 1) as u8,
        }
    }

    /// Words in level `l` (below the top).
    #[inline]
    fn words(&self, l: u32) -> usize {
        1 << (u32::from(self.log_len) - 6 * (l + 1))
    }

    fn is_empty(&self) -> bool {
        self.top == 0
    }

    /// Whether bit `i` is set.
    #[inline]
    fn test(&self, i: usize) -> bool {
        debug_assert!(i >> self.log_len == 0);
        if self.depth == 0 {
            return self.top >> i & 1 != 0;
        }
        self.below
            .get(i >> 6)
            .is_some_and(|&w| w >> (i & 63) & 1 != 0)
    }

    /// Sets bit `i` if `cond`; returns whether the set was empty before. Without branches on
    /// the bits (their outcomes are random on a random workload): every level is or-ed, which
    /// leaves a summary bit that was set as it was.
    #[inline]
    fn set_if(&mut self, mut i: usize, cond: bool) -> bool {
        debug_assert!(i >> self.log_len == 0);
        let bit = u64::from(cond);
        if self.depth > 0 {
            if self.below.is_empty() {
                self.allocate();
            }
            let mut at = 0;
            for l in 0..u32::from(self.depth) {
                self.below[at + (i >> 6)] |= bit << (i & 63);
                at += self.words(l);
                i >>= 6;
            }
        }
        let was = self.top;
        self.top = was | bit << i;
        was == 0
    }

    /// Sets bit `i` (clear before); returns whether the set was empty before.
    #[inline]
    fn set(&mut self, i: usize) -> bool {
        debug_assert!(!self.test(i));
        self.set_if(i, true)
    }

    #[cold]
    #[inline(never)]
    fn allocate(&mut self) {
        let n = (0..u32::from(self.depth)).map(|l| self.words(l)).sum();
        self.below = vec![0; n].into_boxed_slice();
    }

    /// Clears bit `i` if `cond` (it is set then); returns whether the set is empty now. Without
    /// branches on the bits, as `set_if`: a summary bit is cleared only where the word below
    /// it turned zero.
    #[inline]
    fn clear_if(&mut self, mut i: usize, cond: bool) -> bool {
        debug_assert!(!cond || self.test(i));
        let mut clear = u64::from(cond);
        let mut at = 0;
        for l in 0..u32::from(self.depth) {
            let w = &mut self.below[at + (i >> 6)];
            *w &= !(clear << (i & 63));
            clear &= u64::from(*w == 0);
            at += self.words(l);
            i >>= 6;
        }
        self.top &= !(clear << i);
        self.top == 0
    }

    /// Clears bit `i` (set before); returns whether the set is empty now.
    #[inline]
    fn clear(&mut self, i: usize) -> bool {
        self.clear_if(i, true)
    }

    /// The lowest set bit.
    #[inline]
    fn first(&self) -> Option<usize> {
        if self.top == 0 {
            return None;
        }
        let mut i = self.top.trailing_zeros() as usize;
        let mut at = self.below.len();
        for l in (0..u32::from(self.depth)).rev() {
            at -= self.words(l);
            i = i << 6 | self.below[at + i].trailing_zeros() as usize;
        }
        Some(i)
    }

    /// The levels, leaves first (the last is `top`); only the top while `below` is not
    /// allocated.
    fn levels(&self) -> Vec<&[u64]> {
        let mut levels = Vec::new();
        let mut at = 0;
        if !self.below.is_empty() {
            for l in 0..u32::from(self.depth) {
                levels.push(&self.below[at..at + self.words(l)]);
                at += self.words(l);
            }
        }
        levels.push(std::slice::from_ref(&self.top));
        levels
    }

    /// The set bits, lowest first.
    fn ones(&self) -> impl Iterator<Item = usize> + '_ {
        let leaves = if self.depth > 0 && self.below.is_empty() {
            &[][..]
        } else {
            self.levels()[0]
        };
        leaves.iter().enumerate().flat_map(|(j, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                (w != 0).then(|| {
                    let b = w.trailing_zeros() as usize;
                    w &= w - 1;
                    j << 6 | b
                })
            })
        })
    }

    /// The same bits in a set of `2^log_len` bits (large enough for them).
    fn resized(&self, log_len: u32) -> Self {
        let mut b = Self::new(log_len);
        for i in self.ones() {
            b.set(i);
        }
        b
    }

    /// Checks that no bit lies beyond the length and that the summary levels agree with the
    /// levels below them.
    fn check(&self) -> Result<(), String> {
        if self.depth > 0 && self.below.is_empty() {
            return match self.top {
                0 => Ok(()),
                _ => Err("bitmap: summary bits set over no leaves".into()),
            };
        }
        let levels = self.levels();
        let top_bits = u32::from(self.log_len) - 6 * u32::from(self.depth);
        if top_bits < 6 && self.top >> (1 << top_bits) != 0 {
            return Err("bitmap: bits set past its length".into());
        }
        for (l, pair) in levels.windows(2).enumerate() {
            let (below, above) = (pair[0], pair[1]);
            for (j, &w) in below.iter().enumerate() {
                if (above[j >> 6] >> (j & 63) & 1 != 0) != (w != 0) {
                    return Err(format!(
                        "bitmap level {}: bit {j} disagrees with its word",
                        l + 1
                    ));
                }
            }
        }
        Ok(())
    }
}

struct Arena {
    /// Creation order (rises with the slot): free blocks are taken from older arenas first.
    seq: u64,
    base: u64,
    order: u32,
    pool: Pool,
    /// The free blocks of each order from `MIN_ORDER` up, by offset >> order.
    by_order: Box<[Bits]>,
}

impl Arena {
    fn new(seq: u64, base: u64, order: u32, pool: Pool) -> Self {
        Self {
            seq,
            base,
            order,
            pool,
            by_order: (MIN_ORDER..=order).map(|k| Bits::new(order - k)).collect(),
        }
    }

    /// The free blocks of order `k` (at least `MIN_ORDER`, at most the arena's).
    #[inline]
    fn free(&self, k: u32) -> &Bits {
        &self.by_order[(k - MIN_ORDER) as usize]
    }

    #[inline]
    fn free_mut(&mut self, k: u32) -> &mut Bits {
        &mut self.by_order[(k - MIN_ORDER) as usize]
    }
}

/// Which arenas hold a free block of each order, and which orders have any.
struct ByOrder {
    /// Bit k: some arena holds a free block of order k.
    orders: u64,
    /// `slots[k]`: the slots of the arenas holding a free block of order k.
    slots: Vec<Bits>,
}

impl ByOrder {
    /// Room for 64 arenas before the first resize.
    const MIN_LOG_SLOTS: u32 = 6;

    fn new() -> Self {
        Self {
            orders: 0,
            slots: (0..=MAX_ORDER)
                .map(|_| Bits::new(Self::MIN_LOG_SLOTS))
                .collect(),
        }
    }

    /// Makes room for slot `slot`.
    fn reserve(&mut self, slot: usize) {
        let log = u32::from(self.slots[0].log_len);
        if slot >> log != 0 {
            for s in &mut self.slots {
                *s = s.resized(log + 1);
            }
        }
    }

    /// The index built again from the arenas' bitmaps, sized for them.
    fn rebuild(&mut self, arenas: &[Arena]) {
        let log = arenas
            .len()
            .next_power_of_two()
            .trailing_zeros()
            .max(Self::MIN_LOG_SLOTS);
        self.orders = 0;
        self.slots = (0..=MAX_ORDER).map(|_| Bits::new(log)).collect();
        for (slot, a) in arenas.iter().enumerate() {
            for k in MIN_ORDER..=a.order {
                if !a.free(k).is_empty() {
                    self.slots[k as usize].set(slot);
                    self.orders |= 1 << k;
                }
            }
        }
    }

    /// Files block `idx` of order `k` of arena `a` (at `slot`) as free. Whether it is the
    /// arena's first block of that order is random on a random workload, hence no branch on it.
    /// (Always inlined: the split and merge loops call these, and a call each was measurable.)
    #[inline(always)]
    fn push(&mut self, a: &mut Arena, slot: usize, k: u32, idx: usize) {
        let first = a.free_mut(k).set(idx);
        self.slots[k as usize].set_if(slot, first);
        self.orders |= 1 << k;
    }

    /// Takes the free block `idx` of order `k` of arena `a` (at `slot`) off the index.
    #[inline(always)]
    fn take(&mut self, a: &mut Arena, slot: usize, k: u32, idx: usize) {
        let last = a.free_mut(k).clear(idx);
        let none = self.slots[k as usize].clear_if(slot, last);
        self.orders &= !(u64::from(none) << k);
    }
}

/// Where a block of `Buddy::slab` is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Held {
    /// Handed out.
    Allocated,
    /// Freed by the user, waiting for other streams.
    Pending,
    /// Free, parked unmerged for the next request of its order.
    Parked,
    /// An entry of `Buddy::slab` no block uses (its block merged back into the free blocks).
    Vacant,
}

/// A block handed out, waiting, or parked.
struct Live {
    addr: u64,
    requested: u64,
    /// The arena's index in `Buddy::arenas`.
    slot: u32,
    order: u8,
    pool: Pool,
    state: Held,
}

/// Orders that can park a block: those below an arena's (a split block).
const PARK_ORDERS: usize = (ARENA_ORDER - MIN_ORDER) as usize;
/// An empty parking place.
const NOT_PARKED: u32 = u32::MAX;

/// The buddy policy for one stream.
pub struct Buddy {
    stream: Stream,
    /// Arenas in creation order.
    arenas: Vec<Arena>,
    /// Arena slots by base address, for the lookups by address (none on the hot path).
    by_base: BTreeMap<u64, u32>,
    /// Which arenas hold free blocks of each order (the blocks themselves are in the arenas).
    index: ByOrder,
    /// Blocks handed out, waiting or parked, by handle (the index an allocation's handle
    /// carries, so that freeing by handle needs no lookup); vacant entries are listed in
    /// `vacant`.
    slab: Vec<Live>,
    vacant: Vec<u32>,
    /// Handles by address, for frees and queries by pointer.
    live: FxHashMap<u64, u32>,
    /// The handle of the block parked for each order from `MIN_ORDER` (or `NOT_PARKED`).
    parked: [u32; PARK_ORDERS],
    /// The arena slot of each parked block.
    parked_slot: [u32; PARK_ORDERS],
    /// Bit `k - MIN_ORDER`: order `k` has a parked block.
    parked_bits: u32,
    next_seq: u64,
    stats: BlockStats,
}

fn order_of(size: u64) -> u32 {
    (64 - (size.max(1) - 1).leading_zeros()).max(MIN_ORDER)
}

impl Buddy {
    /// An empty buddy allocator for `stream`.
    pub fn new(stream: Stream) -> Self {
        Self {
            stream,
            arenas: Vec::new(),
            by_base: BTreeMap::new(),
            index: ByOrder::new(),
            slab: Vec::new(),
            vacant: Vec::new(),
            live: FxHashMap::default(),
            parked: [NOT_PARKED; PARK_ORDERS],
            parked_slot: [0; PARK_ORDERS],
            parked_bits: 0,
            next_seq: 0,
            stats: BlockStats::default(),
        }
    }

    #[cfg(test)]
    fn arena_of(&self, addr: u64) -> &Arena {
        &self.arenas[self.find_slot(addr).expect("address inside an arena")]
    }

    /// The slot of the arena holding `addr`, if any.
    fn find_slot(&self, addr: u64) -> Option<usize> {
        self.by_base
            .range(..=addr)
            .next_back()
            .map(|(_, &s)| s as usize)
            .filter(|&s| addr - self.arenas[s].base < 1 << self.arenas[s].order)
    }

    /// A new arena of order `order`, with no free block yet.
    fn new_arena(&mut self, order: u32, pool: Pool, dev: &Device) -> Result<usize, BackendError> {
        let base = dev.lock().alloc_segment(1 << order, pool)?;
        let slot = self.arenas.len();
        self.index.reserve(slot);
        self.arenas
            .push(Arena::new(self.next_seq, base, order, pool));
        self.next_seq += 1;
        self.by_base.insert(base, slot as u32);
        Ok(slot)
    }

    /// The block of handle `h`, if it is `from` (handed out, or freed and waiting), stops being
    /// active: it is parked if its order has no parked block, and otherwise merged into the
    /// free blocks at once. Returns its size, or `None` if that block is not `from`.
    #[inline(always)]
    fn retire(&mut self, h: u32, from: Held) -> Option<u64> {
        let l = &mut self.slab[h as usize];
        if l.state != from {
            return None;
        }
        let (order, slot) = (u32::from(l.order), l.slot as usize);
        if from == Held::Allocated {
            self.stats
                .block_freed_and_released(l.pool, 1 << order, l.requested);
        } else {
            self.stats.block_released(l.pool, 1 << order, l.requested);
        }
        let i = order.wrapping_sub(MIN_ORDER) as usize;
        if i < PARK_ORDERS && self.parked[i] == NOT_PARKED {
            l.state = Held::Parked;
            l.requested = 0;
            self.parked[i] = h;
            self.parked_slot[i] = slot as u32;
            self.parked_bits |= 1 << i;
            // A parked block is a free piece of a split arena, as a free block is.
            let pool = self.arenas[slot].pool;
            self.stats.inactive_split.inc(pool, 1);
            self.stats.inactive_split_bytes.inc(pool, 1 << order);
            return Some(1 << order);
        }
        self.merge_back(h);
        Some(1 << order)
    }

    /// Merges the filed block of handle `h` into the free blocks and drops its entry.
    fn merge_back(&mut self, h: u32) {
        let l = &self.slab[h as usize];
        let (addr, order, slot) = (l.addr, u32::from(l.order), l.slot as usize);
        self.forget(h);
        self.merge_free(addr, slot, order);
    }

    /// Files a new block as handed out; returns its handle.
    #[inline]
    fn file(&mut self, l: Live) -> u32 {
        let addr = l.addr;
        let h = match self.vacant.pop() {
            Some(h) => {
                self.slab[h as usize] = l;
                h
            }
            None => {
                self.slab.push(l);
                (self.slab.len() - 1) as u32
            }
        };
        self.live.insert(addr, h);
        h
    }

    /// Drops the entry of handle `h` (a block merged back into the free blocks).
    #[inline]
    fn forget(&mut self, h: u32) {
        let l = &mut self.slab[h as usize];
        l.state = Held::Vacant;
        self.live.remove(&l.addr);
        self.vacant.push(h);
    }

    /// The handle of the block at `addr`, if one is filed there.
    #[inline]
    fn handle_at(&self, addr: u64) -> Option<u32> {
        self.live.get(&addr).copied()
    }

    /// The blocks filed (handed out, waiting or parked).
    fn filed(&self) -> impl Iterator<Item = &Live> {
        self.live.values().map(|&h| &self.slab[h as usize])
    }

    /// Hands the block parked under handle `h` (of order `order`) out again for `size` bytes.
    #[inline]
    fn unpark(&mut self, h: u32, order: u32, size: u64) -> Placement {
        self.leave_parking((order - MIN_ORDER) as usize);
        let l = &mut self.slab[h as usize];
        debug_assert_eq!((l.state, u32::from(l.order)), (Held::Parked, order));
        l.state = Held::Allocated;
        l.requested = size;
        self.stats.block_handed_out(l.pool, 1 << order, size);
        Placement {
            addr: l.addr,
            size: 1 << order,
            handle: h,
        }
    }

    /// Merges the block parked for order `i + MIN_ORDER` into the free blocks.
    fn unpark_to_free(&mut self, i: usize) {
        let h = self.leave_parking(i);
        self.merge_back(h);
    }

    /// Empties the parking place of order `i + MIN_ORDER` and stops counting its block as a
    /// free piece of a split arena (what parking it counted); returns the block's handle.
    #[inline]
    fn leave_parking(&mut self, i: usize) -> u32 {
        let h = self.parked[i];
        self.parked[i] = NOT_PARKED;
        self.parked_bits &= !(1 << i);
        let pool = self.arenas[self.parked_slot[i] as usize].pool;
        let bytes = 1u64 << (i as u32 + MIN_ORDER);
        self.stats.inactive_split.dec(pool, 1);
        self.stats.inactive_split_bytes.dec(pool, bytes);
        h
    }

    /// Merges every parked block into the free blocks, smallest order first.
    fn flush_parked(&mut self) {
        while self.parked_bits != 0 {
            self.unpark_to_free(self.parked_bits.trailing_zeros() as usize);
        }
    }

    /// Files the free block of order `order` at `addr` (in the arena at `slot`), merging it with
    /// free buddies.
    fn merge_free(&mut self, addr: u64, slot: usize, order: u32) {
        let a = &mut self.arenas[slot];
        let (mut off, mut k) = (addr - a.base, order);
        while k < a.order {
            let buddy = (off >> k) as usize ^ 1;
            if !a.free(k).test(buddy) {
                break;
            }
            self.index.take(a, slot, k, buddy);
            off &= !(1 << k);
            k += 1;
        }
        // Every buddy merged was a split block (below the arena's order), and so is the merged
        // block unless it is the whole arena. One update for all the buddies gives the totals
        // and peak that one per buddy gave (decrements set no peak).
        if k > order {
            self.stats.inactive_split.dec(a.pool, u64::from(k - order));
            self.stats
                .inactive_split_bytes
                .dec(a.pool, (1 << k) - (1 << order));
        }
        if k < a.order {
            self.stats.inactive_split.inc(a.pool, 1);
            self.stats.inactive_split_bytes.inc(a.pool, 1 << k);
        }
        self.index.push(a, slot, k, (off >> k) as usize);
    }
}

impl Policy for Buddy {
    fn name(&self) -> &'static str {
        "buddy"
    }

    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        let order = order_of(size);
        if order > MAX_ORDER {
            return Err(BackendError::oom(
                crate::backend::DriverCall::MemAlloc,
                "request larger than the buddy allocator's largest order",
            ));
        }
        let i = order.wrapping_sub(MIN_ORDER) as usize;
        if i < PARK_ORDERS && self.parked[i] != NOT_PARKED {
            let h = self.parked[i];
            // Placement takes older arenas first; the parked block is handed back unless the
            // free blocks offer one of an older arena (then it is merged, and placed as usual).
            // (No arena is older than the first: then nothing to look up.)
            let fit = self.index.orders >> order;
            let older = self.parked_slot[i] != 0 && fit != 0 && {
                let k = order + fit.trailing_zeros();
                let slot = self.index.slots[k as usize].first();
                slot.expect("an arena is filed under each order in use")
                    < self.parked_slot[i] as usize
            };
            if !older {
                return Ok(self.unpark(h, order, size));
            }
            self.unpark_to_free(i);
        }
        let pool = Pool::of(1 << order);
        let mut fit = self.index.orders >> order;
        if fit == 0 && self.parked_bits != 0 {
            // Merging the parked blocks may make room without a new arena.
            self.flush_parked();
            fit = self.index.orders >> order;
        }
        let (slot, mut k, off) = if fit != 0 {
            let k = order + fit.trailing_zeros();
            let slot = self.index.slots[k as usize]
                .first()
                .expect("an arena is filed under each order in use");
            let a = &mut self.arenas[slot];
            let idx = a
                .free(k)
                .first()
                .expect("an arena filed under an order has a block of it");
            self.index.take(a, slot, k, idx);
            if k < a.order {
                self.stats.inactive_split.dec(a.pool, 1);
                self.stats.inactive_split_bytes.dec(a.pool, 1 << k);
            }
            (slot, k, (idx as u64) << k)
        } else {
            let aorder = order.max(ARENA_ORDER);
            (self.new_arena(aorder, pool, dev)?, aorder, 0)
        };
        let a = &mut self.arenas[slot];
        if k > order {
            // The upper halves split off, all below the arena's order: one update for all gives
            // the totals and peak that one per half gave (the value only rises).
            self.stats.inactive_split.inc(a.pool, u64::from(k - order));
            self.stats
                .inactive_split_bytes
                .inc(a.pool, (1 << k) - (1 << order));
            while k > order {
                k -= 1;
                self.index.push(a, slot, k, (off >> k) as usize | 1);
            }
        }
        let addr = a.base + off;
        let handle = self.file(Live {
            addr,
            order: order as u8,
            slot: slot as u32,
            requested: size,
            pool,
            state: Held::Allocated,
        });
        let bytes = 1u64 << order;
        self.stats.block_handed_out(pool, bytes, size);
        Ok(Placement {
            addr,
            size: bytes,
            handle,
        })
    }

    fn free_requested(&mut self, addr: DevPtr, _dev: &Device) -> Option<u64> {
        let h = self.handle_at(addr)?;
        let l = &mut self.slab[h as usize];
        if l.state != Held::Allocated {
            return None;
        }
        l.state = Held::Pending;
        let (pool, bytes) = (l.pool, 1u64 << l.order);
        self.stats.block_freed(pool, bytes);
        Some(bytes)
    }

    fn release(&mut self, addr: DevPtr, _dev: &Device) -> Result<(), BackendError> {
        if let Some(h) = self.handle_at(addr) {
            self.retire(h, Held::Pending);
        }
        Ok(())
    }

    /// `free_requested` then `release`, with one lookup.
    fn free(&mut self, addr: DevPtr, _dev: &Device) -> Result<Option<u64>, BackendError> {
        Ok(self
            .handle_at(addr)
            .and_then(|h| self.retire(h, Held::Allocated)))
    }

    /// [`Policy::free`] by handle: no lookup when the handle names the block at `addr`.
    #[inline]
    fn free_handle(
        &mut self,
        handle: u32,
        addr: DevPtr,
        _dev: &Device,
    ) -> Result<Option<u64>, BackendError> {
        let named = (self.slab.get(handle as usize)).is_some_and(|l| l.addr == addr);
        Ok(named
            .then_some(handle)
            .and_then(|h| self.retire(h, Held::Allocated)))
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        self.flush_parked();
        // Whole free arenas, returned in address order.
        let whole: Vec<usize> = self
            .by_base
            .values()
            .map(|&s| s as usize)
            .filter(|&s| {
                let a = &self.arenas[s];
                a.free(a.order).test(0)
            })
            .collect();
        if whole.is_empty() {
            return Ok(0);
        }
        let mut gone = vec![false; self.arenas.len()];
        let mut freed = 0;
        let mut result = Ok(());
        {
            let mut d = dev.lock();
            for s in whole {
                let a = &self.arenas[s];
                // Forgotten before the call: an arena the driver refuses to free is not reused.
                gone[s] = true;
                if let Err(e) = d.free_segment(a.base, 1 << a.order, a.pool) {
                    result = Err(e);
                    break;
                }
                freed += 1u64 << a.order;
            }
        }
        // Compact the arenas, keeping creation order, and renumber everything holding a slot.
        let mut new_slot = vec![u32::MAX; self.arenas.len()];
        let old = std::mem::take(&mut self.arenas);
        for (s, a) in old.into_iter().enumerate() {
            if !gone[s] {
                new_slot[s] = self.arenas.len() as u32;
                self.arenas.push(a);
            }
        }
        for &h in self.live.values() {
            let l = &mut self.slab[h as usize];
            l.slot = new_slot[l.slot as usize];
        }
        self.by_base = (self.arenas.iter().enumerate())
            .map(|(s, a)| (a.base, s as u32))
            .collect();
        self.index.rebuild(&self.arenas);
        result.map(|()| freed)
    }

    fn stats(&self) -> MemoryStats {
        self.stats.to_memory_stats()
    }

    fn reset_peaks(&mut self) {
        self.stats.reset_peaks();
    }

    fn largest_free(&self) -> u64 {
        let parked = match self.parked_bits {
            0 => 0,
            b => 1 << (31 - b.leading_zeros() + MIN_ORDER),
        };
        match self.index.orders {
            0 => parked,
            o => parked.max(1 << (63 - o.leading_zeros())),
        }
    }

    fn segments(&self) -> Vec<SegmentInfo> {
        self.by_base
            .values()
            .map(|&s| {
                let a = &self.arenas[s as usize];
                let mut blocks: Vec<BlockInfo> = self
                    .filed()
                    .filter(|l| l.slot == s)
                    .map(|l| BlockInfo {
                        addr: l.addr,
                        size: 1 << l.order,
                        requested: l.requested,
                        kind: match l.state {
                            Held::Allocated => BlockKind::Allocated,
                            Held::Pending => BlockKind::Pending,
                            // (`filed` yields no vacant entry.)
                            Held::Parked | Held::Vacant => BlockKind::Free,
                        },
                    })
                    .collect();
                for k in MIN_ORDER..=a.order {
                    blocks.extend(a.free(k).ones().map(|i| BlockInfo {
                        addr: a.base + ((i as u64) << k),
                        size: 1 << k,
                        requested: 0,
                        kind: BlockKind::Free,
                    }));
                }
                blocks.sort_by_key(|b| b.addr);
                SegmentInfo {
                    addr: a.base,
                    size: 1 << a.order,
                    stream: self.stream,
                    pool: a.pool,
                    blocks,
                }
            })
            .collect()
    }

    fn is_allocated(&self, addr: DevPtr) -> bool {
        self.handle_at(addr)
            .is_some_and(|h| self.slab[h as usize].state == Held::Allocated)
    }

    fn is_free_block(&self, addr: DevPtr) -> bool {
        if (self.handle_at(addr)).is_some_and(|h| self.slab[h as usize].state == Held::Parked) {
            return true;
        }
        self.find_slot(addr).is_some_and(|s| {
            let a = &self.arenas[s];
            let off = addr - a.base;
            (MIN_ORDER..=a.order)
                .any(|k| off & ((1 << k) - 1) == 0 && a.free(k).test((off >> k) as usize))
        })
    }

    fn check(&self) -> Result<(), String> {
        // The blocks (live ones by their slot, free ones from the bitmaps) tile each arena.
        for seg in self.segments() {
            let mut at = seg.addr;
            for b in &seg.blocks {
                if b.addr != at {
                    return Err(format!("arena {:#x}: gap or overlap at {at:#x}", seg.addr));
                }
                if (b.addr - seg.addr) % b.size != 0 {
                    return Err(format!("block {:#x} not aligned to its size", b.addr));
                }
                at += b.size;
            }
            if at != seg.addr + seg.size {
                return Err(format!("arena {:#x} not tiled", seg.addr));
            }
        }
        if self.by_base.len() != self.arenas.len()
            || (self.by_base.iter())
                .any(|(&b, &s)| self.arenas.get(s as usize).map(|a| a.base) != Some(b))
        {
            return Err("arenas by address disagree with the arenas".into());
        }
        if let Some(l) = self
            .filed()
            .find(|l| self.find_slot(l.addr) != Some(l.slot as usize))
        {
            return Err(format!(
                "live block {:#x} filed under the wrong arena",
                l.addr
            ));
        }
        // Every filed block's entry has its address and is in use; the vacant entries are the
        // others.
        if let Some((&p, _)) = (self.live.iter()).find(|(&p, &h)| {
            self.slab
                .get(h as usize)
                .is_none_or(|l| l.addr != p || l.state == Held::Vacant)
        }) {
            return Err(format!("block {p:#x} filed under a wrong or vacant entry"));
        }
        if self.live.len() + self.vacant.len() != self.slab.len()
            || (self.vacant.iter()).any(|&h| self.slab[h as usize].state != Held::Vacant)
        {
            return Err("vacant entries disagree with the filed blocks".into());
        }
        let (mut split, mut split_bytes) = ([0i64; 2], [0i64; 2]);
        for (s, a) in self.arenas.iter().enumerate() {
            if s > 0 && self.arenas[s - 1].seq >= a.seq {
                return Err(format!("arena {:#x} out of creation order", a.base));
            }
            for k in 0..=MAX_ORDER {
                let f = (MIN_ORDER..=a.order).contains(&k).then(|| a.free(k));
                if f.is_some_and(|f| !f.is_empty()) != self.index.slots[k as usize].test(s) {
                    return Err(format!("arena {:#x}: order {k} misfiled by order", a.base));
                }
                let Some(f) = f else { continue };
                f.check()
                    .map_err(|e| format!("arena {:#x}, order {k}: {e}", a.base))?;
                if k < a.order {
                    for i in f.ones() {
                        // No free block may have a free buddy of the same order.
                        if f.test(i ^ 1) {
                            return Err(format!(
                                "free buddies at {:#x} and {:#x} not merged",
                                a.base + ((i as u64) << k),
                                a.base + (((i ^ 1) as u64) << k)
                            ));
                        }
                        split[a.pool.index()] += 1;
                        split_bytes[a.pool.index()] += 1 << k;
                    }
                }
            }
        }
        // Parked blocks: one per order at most, each in `live` as parked, of its order, and
        // counted as a free piece of a split arena.
        let mut parked = 0;
        for (&p, &h) in &self.live {
            let l = &self.slab[h as usize];
            if l.state != Held::Parked {
                continue;
            }
            parked += 1;
            let i = usize::from(l.order) - MIN_ORDER as usize;
            if self.parked.get(i) != Some(&h)
                || self.parked_slot[i] != l.slot
                || self.parked_bits >> i & 1 == 0
            {
                return Err(format!("parked block {p:#x} not filed under its order"));
            }
            let pool = self.arenas[l.slot as usize].pool;
            split[pool.index()] += 1;
            split_bytes[pool.index()] += 1 << l.order;
        }
        let filed = |i: usize| self.parked[i] != NOT_PARKED;
        if parked != self.parked_bits.count_ones()
            || (0..PARK_ORDERS).any(|i| filed(i) != (self.parked_bits >> i & 1 != 0))
        {
            return Err("parking places disagree with the parked blocks".into());
        }
        for (k, s) in self.index.slots.iter().enumerate() {
            s.check().map_err(|e| format!("arenas of order {k}: {e}"))?;
            if s.ones().any(|slot| slot >= self.arenas.len()) {
                return Err(format!("arenas of order {k}: a slot past the last arena"));
            }
            if s.is_empty() == (self.index.orders >> k & 1 != 0) {
                return Err(format!("order {k} misfiled in the orders in use"));
            }
        }
        let st = self.stats.to_memory_stats();
        for (pool, stat, bytes) in [
            (
                Pool::Small,
                st.inactive_split.small_pool,
                st.inactive_split_bytes.small_pool,
            ),
            (
                Pool::Large,
                st.inactive_split.large_pool,
                st.inactive_split_bytes.large_pool,
            ),
        ] {
            if (stat.current, bytes.current) != (split[pool.index()], split_bytes[pool.index()]) {
                return Err(format!(
                    "inactive_split of {} disagrees with the free blocks",
                    pool.name()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::backend::CostModel;
    use crate::testing::TestRng;
    use std::collections::{BTreeSet, HashMap};

    /// A simulated device whose calls cost nothing.
    fn sim_device(cfg: SimConfig) -> Device {
        Device::new(Box::new(SimBackend::new(cfg).0), CostModel::zero())
    }

    #[test]
    fn orders_round_to_powers_of_two() {
        assert_eq!(order_of(1), 9);
        assert_eq!(order_of(512), 9);
        assert_eq!(order_of(513), 10);
        assert_eq!(order_of(1 << 20), 20);
        assert_eq!(order_of((1 << 20) + 1), 21);
    }

    #[test]
    fn split_and_merge_back_to_one_arena() {
        let d = sim_device(SimConfig::default());
        let mut b = Buddy::new(0);
        let x = b.allocate(1000, &d).unwrap();
        let y = b.allocate(3000, &d).unwrap();
        assert_eq!(x.size, 1024);
        assert_eq!(y.size, 4096);
        b.check().unwrap();
        // Halving the arena down to 1 KiB for x leaves one free buddy of each order from 10
        // to ARENA_ORDER - 1; y takes the free 4 KiB one (order 12). What stays free are the
        // buddies of orders 10, 11 and 13..ARENA_ORDER: ARENA_ORDER - 11 blocks.
        assert_eq!(
            b.stats().inactive_split.all.current,
            i64::from(ARENA_ORDER - 11)
        );
        assert_eq!(
            b.stats().inactive_split_bytes.all.current,
            (1i64 << ARENA_ORDER) - 1024 - 4096
        );
        for p in [x, y] {
            b.free_requested(p.addr, &d).unwrap();
            b.release(p.addr, &d).unwrap();
        }
        b.check().unwrap();
        // Both are parked, unmerged: two more free pieces of a split arena, and the largest
        // free block is still the arena's upper half.
        assert_eq!(
            b.stats().inactive_split.all.current,
            i64::from(ARENA_ORDER - 11) + 2
        );
        assert_eq!(b.largest_free(), 1 << (ARENA_ORDER - 1));
        assert!(b.is_free_block(x.addr) && !b.is_allocated(x.addr));
        // The next request of x's order takes x back, with nothing split.
        let again = b.allocate(900, &d).unwrap();
        assert_eq!((again.addr, again.size), (x.addr, 1024));
        assert_eq!(
            b.stats().inactive_split.all.current,
            i64::from(ARENA_ORDER - 11) + 1
        );
        assert_eq!(b.free(again.addr, &d).unwrap(), Some(1024));
        assert_eq!(
            b.free(again.addr, &d).unwrap(),
            None,
            "a parked block is not freed twice"
        );
        // Releasing the cache merges the parked blocks and returns the whole arena.
        assert_eq!(b.release_cached(&d).unwrap(), 1 << ARENA_ORDER);
        b.check().unwrap();
        assert_eq!(b.stats().inactive_split.all.current, 0);
        assert_eq!(d.lock().held(), 0);
    }

    /// A request that finds no free block merges the parked ones before asking for an arena.
    #[test]
    fn parked_blocks_merge_before_a_new_arena() {
        let d = sim_device(SimConfig::default());
        let mut b = Buddy::new(0);
        let half = 1u64 << (ARENA_ORDER - 1);
        let (lo, hi) = (b.allocate(half, &d).unwrap(), b.allocate(half, &d).unwrap());
        assert_eq!(hi.addr, lo.addr + half);
        b.free(lo.addr, &d).unwrap();
        b.free(hi.addr, &d).unwrap();
        // lo is parked; hi could not park (its order's place is taken) and stays free beside it.
        b.check().unwrap();
        assert_eq!(b.largest_free(), half);
        let whole = b.allocate(half + 1, &d).unwrap();
        assert_eq!((whole.addr, whole.size), (lo.addr, 2 * half));
        assert_eq!(d.lock().held(), 2 * half, "no second arena");
        b.check().unwrap();
    }

    /// Where the device puts each arena must not change which blocks are chosen: the same
    /// requests give the same offsets and the same peak with arenas at rising or falling
    /// addresses.
    #[test]
    fn placement_does_not_depend_on_arena_addresses() {
        fn run(falling: bool) -> (u64, Vec<u64>) {
            let mut cfg = SimConfig::default();
            if falling {
                let top = 1u64 << 40;
                cfg.segment_addresses = (1..=16u64)
                    .map(|i| (1u64 << ARENA_ORDER, top - i * (1u64 << ARENA_ORDER)))
                    .collect();
            }
            let d = sim_device(cfg);
            let mut b = Buddy::new(0);
            let mut live: Vec<u64> = Vec::new();
            let mut offsets = Vec::new();
            let mut rng = TestRng::new(12345);
            for _ in 0..4000 {
                let x = rng.next_u64();
                if live.len() < 40 && (x % 3 != 0 || live.is_empty()) {
                    let size = 512 + x % (12 << 20);
                    let p = b.allocate(size, &d).unwrap();
                    let a = b.arena_of(p.addr);
                    offsets.push(a.seq << 32 | (p.addr - a.base) >> 9);
                    live.push(p.addr);
                } else {
                    let p = live.swap_remove((x >> 8) as usize % live.len());
                    b.free_requested(p, &d).unwrap();
                    b.release(p, &d).unwrap();
                }
                b.check().unwrap();
            }
            let peak = d.lock().peak_held();
            (peak, offsets)
        }
        let (rising_peak, rising) = run(false);
        let (falling_peak, falling) = run(true);
        assert!(
            rising_peak > 2 << ARENA_ORDER,
            "the test needs several arenas"
        );
        assert_eq!(rising, falling);
        assert_eq!(rising_peak, falling_peak);
    }
    /// The placement rule spelled out the slow way, as the allocator kept it before the
    /// bitmaps: free blocks by order in ordered sets of (arena seq, offset), and the
    /// statistics updated block by block.
    struct Model {
        /// Order and pool of each arena, by seq.
        arenas: BTreeMap<u64, (u32, Pool)>,
        free: Vec<BTreeSet<(u64, u64)>>,
        /// (order, requested, pool, pending) by (seq, offset).
        live: HashMap<(u64, u64), (u32, u64, Pool, bool)>,
        /// The block parked for each order, if any.
        parked: Vec<Option<(u64, u64)>>,
        /// Parked blocks handed back, merged for an older arena's block, and merged before a
        /// new arena would be needed (so the test can tell it went through each).
        reused: usize,
        older: usize,
        flushed: usize,
        next_seq: u64,
        stats: MemoryStats,
    }

    impl Model {
        fn new() -> Self {
            Self {
                arenas: BTreeMap::new(),
                free: vec![BTreeSet::new(); MAX_ORDER as usize + 1],
                live: HashMap::new(),
                parked: vec![None; MAX_ORDER as usize + 1],
                reused: 0,
                older: 0,
                flushed: 0,
                next_seq: 0,
                stats: MemoryStats::default(),
            }
        }

        /// Counts or uncounts the parked block at `at` of order `k` as an inactive split.
        fn count_parked(&mut self, at: (u64, u64), k: u32, on: bool) {
            let pool = self.arenas[&at.0].1;
            if on {
                self.stats.inactive_split.inc(pool, 1);
                self.stats.inactive_split_bytes.inc(pool, 1 << k);
            } else {
                self.stats.inactive_split.dec(pool, 1);
                self.stats.inactive_split_bytes.dec(pool, 1 << k);
            }
        }

        /// Merges the free block of order `k` at `at` with its free buddies.
        fn merge(&mut self, at: (u64, u64), mut k: u32) {
            let (seq, mut off) = at;
            while k < self.arenas[&seq].0 && self.take(seq, off ^ (1 << k), k) {
                off &= !(1 << k);
                k += 1;
            }
            self.push(seq, off, k);
        }

        fn unpark_to_free(&mut self, k: u32) {
            let at = self.parked[k as usize].take().unwrap();
            self.count_parked(at, k, false);
            self.merge(at, k);
        }

        fn flush(&mut self) {
            for k in 0..=MAX_ORDER {
                if self.parked[k as usize].is_some() {
                    self.unpark_to_free(k);
                }
            }
        }

        fn push(&mut self, seq: u64, off: u64, k: u32) {
            self.free[k as usize].insert((seq, off));
            let (order, pool) = self.arenas[&seq];
            if k < order {
                self.stats.inactive_split.inc(pool, 1);
                self.stats.inactive_split_bytes.inc(pool, 1 << k);
            }
        }

        fn take(&mut self, seq: u64, off: u64, k: u32) -> bool {
            if !self.free[k as usize].remove(&(seq, off)) {
                return false;
            }
            let (order, pool) = self.arenas[&seq];
            if k < order {
                self.stats.inactive_split.dec(pool, 1);
                self.stats.inactive_split_bytes.dec(pool, 1 << k);
            }
            true
        }

        /// (arena seq, offset) of the block placed.
        fn allocate(&mut self, size: u64) -> (u64, u64) {
            let order = order_of(size);
            let pool = Pool::of(1 << order);
            let find = |m: &Self| {
                (order..=MAX_ORDER)
                    .find_map(|k| m.free[k as usize].first().map(|&(s, o)| (k, s, o)))
            };
            if let Some(at) = self.parked[order as usize] {
                if find(self).is_some_and(|(_, s, _)| s < at.0) {
                    self.older += 1;
                    self.unpark_to_free(order);
                } else {
                    self.reused += 1;
                    self.parked[order as usize] = None;
                    self.count_parked(at, order, false);
                    self.live.insert(at, (order, size, pool, false));
                    self.stats.block_handed_out(pool, 1 << order, size);
                    return at;
                }
            }
            let mut found = find(self);
            if found.is_none() && self.parked.iter().any(Option::is_some) {
                self.flushed += 1;
                self.flush();
                found = find(self);
            }
            let (mut k, seq, off) = found.unwrap_or_else(|| {
                let aorder = order.max(ARENA_ORDER);
                let seq = self.next_seq;
                self.next_seq += 1;
                self.arenas.insert(seq, (aorder, pool));
                self.free[aorder as usize].insert((seq, 0));
                (aorder, seq, 0)
            });
            assert!(self.take(seq, off, k));
            while k > order {
                k -= 1;
                self.push(seq, off + (1 << k), k);
            }
            self.live.insert((seq, off), (order, size, pool, false));
            self.stats.block_handed_out(pool, 1 << order, size);
            (seq, off)
        }

        fn free_requested(&mut self, at: (u64, u64)) -> Option<u64> {
            let l = self.live.get_mut(&at)?;
            if l.3 {
                return None;
            }
            l.3 = true;
            self.stats.block_freed(l.2, 1 << l.0);
            Some(1 << l.0)
        }

        fn release(&mut self, at: (u64, u64)) {
            if !self.live.get(&at).is_some_and(|l| l.3) {
                return;
            }
            let (order, requested, pool, _) = self.live.remove(&at).unwrap();
            self.stats.block_released(pool, 1 << order, requested);
            if order < ARENA_ORDER && self.parked[order as usize].is_none() {
                self.parked[order as usize] = Some(at);
                self.count_parked(at, order, true);
            } else {
                self.merge(at, order);
            }
        }

        fn release_cached(&mut self) -> u64 {
            self.flush();
            let whole: Vec<(u64, u32)> = (self.arenas.iter())
                .filter(|(&s, &(o, _))| self.free[o as usize].contains(&(s, 0)))
                .map(|(&s, &(o, _))| (s, o))
                .collect();
            for &(s, o) in &whole {
                self.free[o as usize].remove(&(s, 0));
                self.arenas.remove(&s);
            }
            whole.iter().map(|&(_, o)| 1u64 << o).sum()
        }

        fn is_free(&self, at: (u64, u64)) -> bool {
            self.free.iter().any(|s| s.contains(&at)) || self.parked.contains(&Some(at))
        }

        fn largest_free(&self) -> u64 {
            (0..=MAX_ORDER)
                .rev()
                .find(|&k| !self.free[k as usize].is_empty() || self.parked[k as usize].is_some())
                .map_or(0, |k| 1 << k)
        }
    }

    /// Random requests (a few larger than an arena), frees now or after a wait, and cache
    /// releases: every placement, the statistics after every step and the free-block queries
    /// agree with the reference model.
    #[test]
    fn placements_match_a_reference_model() {
        let (mut compacted, mut huge) = (0, 0);
        let (mut reused, mut older, mut flushed) = (0, 0, 0);
        for seed in [1u64, 2, 3, 0x9e37_79b9_7f4a_7c15] {
            let d = sim_device(SimConfig::default());
            let (mut b, mut m) = (Buddy::new(0), Model::new());
            // (address, (arena seq, offset)) of the blocks live, and of those freed but waiting.
            // Live ones carry their handle too.
            let mut live: Vec<(u64, (u64, u64), u32)> = Vec::new();
            let mut waiting: Vec<(u64, (u64, u64))> = Vec::new();
            let mut rng = TestRng::new(seed);
            for step in 0..20_000 {
                // One draw a step: its bit fields pick the operation, size, block and probe.
                let x = rng.next_u64();
                let r = x % 1000;
                if (r < 540 && live.len() < 300) || (live.is_empty() && waiting.is_empty()) {
                    let size = match (x >> 12) % 100 {
                        0..=69 => 1 + (x >> 20) % (64 << 10),
                        70..=89 => 1 + (x >> 20) % (8 << 20),
                        90..=97 => 1 + (x >> 20) % (64 << 20),
                        _ => (64 << 20) + (x >> 20) % (448 << 20),
                    };
                    huge += usize::from(order_of(size) > ARENA_ORDER);
                    let p = b.allocate(size, &d).unwrap();
                    let at = m.allocate(size);
                    let a = b.arena_of(p.addr);
                    assert_eq!(
                        (a.seq, p.addr - a.base),
                        at,
                        "step {step}: allocate({size})"
                    );
                    assert_eq!(p.size, 1 << order_of(size));
                    live.push((p.addr, at, p.handle));
                } else if r < 940 && !live.is_empty() {
                    let (addr, at, h) = live.swap_remove((x >> 24) as usize % live.len());
                    // A handle frees only the block it was given with.
                    assert_eq!(b.free_handle(h, addr + 512, &d).unwrap(), None);
                    assert_eq!(b.free_handle(h ^ 1, addr, &d).unwrap(), None);
                    assert_eq!(b.free_handle(u32::MAX, addr, &d).unwrap(), None);
                    if x >> 40 & 7 == 0 {
                        assert_eq!(b.free_requested(addr, &d), m.free_requested(at));
                        assert_eq!(b.free_requested(addr, &d), None);
                        assert_eq!(b.free(addr, &d).unwrap(), None);
                        assert_eq!(b.free_handle(h, addr, &d).unwrap(), None);
                        waiting.push((addr, at));
                    } else {
                        let freed = if x >> 44 & 1 == 0 {
                            b.free_handle(h, addr, &d).unwrap()
                        } else {
                            b.free(addr, &d).unwrap()
                        };
                        assert_eq!(freed, m.free_requested(at));
                        m.release(at);
                        assert_eq!(b.free_handle(h, addr, &d).unwrap(), None, "freed twice");
                        assert_eq!(b.is_free_block(addr), m.is_free(at));
                    }
                } else if r < 990 && !waiting.is_empty() {
                    let (addr, at) = waiting.swap_remove((x >> 24) as usize % waiting.len());
                    b.release(addr, &d).unwrap();
                    m.release(at);
                    assert_eq!(b.is_free_block(addr), m.is_free(at));
                } else {
                    let before = b.arenas.len();
                    let freed = b.release_cached(&d).unwrap();
                    assert_eq!(freed, m.release_cached(), "step {step}: release_cached");
                    compacted += usize::from(b.arenas.len() < before && !live.is_empty());
                }
                assert_eq!(b.stats(), m.stats, "step {step}");
                assert_eq!(b.largest_free(), m.largest_free(), "step {step}");
                // Any 512 B boundary of any arena: a free block starts there in both or neither.
                if !b.arenas.is_empty() {
                    let a = &b.arenas[(x >> 32) as usize % b.arenas.len()];
                    let off = ((x >> 8) % (1 << a.order)) & !511;
                    assert_eq!(b.is_free_block(a.base + off), m.is_free((a.seq, off)));
                }
                if step % 97 == 0 {
                    b.check().unwrap();
                }
            }
            for (addr, at, h) in live {
                assert_eq!(b.free_handle(h, addr, &d).unwrap(), m.free_requested(at));
                m.release(at);
            }
            for (addr, at) in waiting {
                b.release(addr, &d).unwrap();
                m.release(at);
            }
            b.check().unwrap();
            assert_eq!(b.release_cached(&d).unwrap(), m.release_cached());
            assert_eq!(b.stats(), m.stats);
            assert!(b.arenas.is_empty() && b.segments().is_empty());
            assert_eq!(d.lock().held(), 0);
            (reused, older, flushed) = (reused + m.reused, older + m.older, flushed + m.flushed);
        }
        // Every path of parking was taken often.
        assert!(
            reused > 5_000 && older > 1_000 && flushed > 200,
            "parked blocks reused {reused}, merged for older arenas {older}, flushed {flushed}"
        );
        assert!(
            compacted > 10,
            "too few cache releases that kept arenas: {compacted}"
        );
        assert!(huge > 100, "too few requests larger than an arena: {huge}");
    }

    #[test]
    fn bits_find_set_and_clear_through_their_levels() {
        for log_len in [0, 3, 6, 7, 12, 13, 17] {
            let mut bits = Bits::new(log_len);
            let n = 1usize << log_len;
            assert!(bits.is_empty() && bits.first().is_none() && !bits.test(n - 1));
            let picks: Vec<usize> = (0..n).filter(|i| i % 37 == 5 || *i == n - 1).collect();
            for (j, &i) in picks.iter().rev().enumerate() {
                assert_eq!(bits.set(i), j == 0);
                assert_eq!(bits.first(), Some(i));
            }
            bits.check().unwrap();
            assert!(bits.ones().eq(picks.iter().copied()));
            for (j, &i) in picks.iter().enumerate() {
                assert_eq!(bits.first(), Some(i));
                assert_eq!(bits.clear(i), j + 1 == picks.len());
                bits.check().unwrap();
            }
            assert!(bits.is_empty());
        }
    }
}
