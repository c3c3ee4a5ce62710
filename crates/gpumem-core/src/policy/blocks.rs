//! Blocks inside address ranges: best-fit search, splitting, coalescing of free neighbours,
//! and PyTorch's block statistics. The segment-based policies (PyTorch native and expandable
//! simulations, gpumem's caching policy) and the stitched policy's virtual heap all place
//! blocks with this one mechanism; they differ only in where ranges come from and in their
//! rounding and split rules.

use super::free_index::FreeIndex;
use super::live_map::LiveMap;
use super::{BlockInfo, BlockKind, SegmentInfo};
use crate::stats::{BlockStats, Pool};
use std::collections::BTreeMap;

/// "No block".
pub const NIL: u32 = u32::MAX;

/// Where a block is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// In the free index, reusable.
    Free,
    /// Handed out.
    Allocated,
    /// Freed by the user, waiting for other streams' events.
    Pending,
    /// Address space with no physical memory behind it (expandable segments).
    Unmapped,
    /// Freed and kept whole for a request of the same size (the quick cache), not merged
    /// with its neighbours until it is evicted.
    Cached,
}

/// A block: a range of one segment. One cache line each (56 bytes of fields, aligned to 64):
/// inside a real step every call finds the blocks out of the caches, and a block that
/// straddled two lines, as three in four of them did, cost two misses.
#[derive(Debug, Clone)]
#[repr(align(64))]
pub struct Block {
    /// Start address.
    pub addr: u64,
    /// Size in bytes (a multiple of 512).
    pub size: u64,
    /// Bytes the user asked for (0 when free).
    pub requested: u64,
    /// Previous block of the same segment, or NIL.
    pub prev: u32,
    /// Next block of the same segment, or NIL.
    pub next: u32,
    /// Index of the segment.
    pub seg: u32,
    /// Pool the block counts in.
    pub pool: Pool,
    /// Pool of the block's segment: the free index it goes to when free. (Kept in the block
    /// so that the hot path need not look up the segment.)
    heap: Pool,
    /// Life state.
    pub state: State,
    /// Neighbours in the quick cache's list of its size class (while Cached).
    qprev: u32,
    qnext: u32,
    /// Neighbours in the quick cache's age order (while Cached): a list through the blocks,
    /// so that taking a block out of the middle needs no search.
    older: u32,
    newer: u32,
}

impl Block {
    /// Whether the block is part of a split segment.
    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }
}

/// A contiguous address range blocks are carved from.
#[derive(Debug, Clone)]
pub struct Segment {
    /// Start address.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Pool (selects the free index its blocks go to).
    pub pool: Pool,
    /// First block.
    pub head: u32,
    /// Whether the slot holds a segment.
    pub live: bool,
}

/// Blocks and segments of one stream's pool, with the free index.
pub struct BlockSet {
    blocks: Vec<Block>,
    spare: Vec<u32>,
    free: [FreeIndex; 2],
    unmapped: [BTreeMap<u64, u32>; 2],
    live: LiveMap,
    segments: Vec<Segment>,
    spare_segments: Vec<u32>,
    /// Block statistics (allocation, active, inactive_split, *_bytes, requested_bytes).
    pub stats: BlockStats,
    track_split: bool,
    quick: Quick,
}

/// Blocks recently freed, kept whole so that the next request of the same size takes one
/// back without splitting, merging or touching the free index (the common case in training
/// loops, which ask for the same sizes step after step). A few small blocks at most; the
/// oldest is merged back into the free blocks when more arrive, and all of them whenever
/// placement would otherwise have to grow.
struct Quick {
    /// Size class -> most recently cached block of the class.
    heads: Vec<u32>,
    /// Oldest cached block (the list goes on through `Block::newer`), or NIL.
    oldest: u32,
    /// Newest cached block, or NIL.
    newest: u32,
    /// Number of cached blocks.
    len: usize,
    /// Largest block size cached (0: the cache is off).
    max: u64,
    /// Most blocks cached.
    cap: usize,
}

impl BlockSet {
    /// An empty set. `track_split` enables the inactive_split statistics (PyTorch keeps them
    /// for plain segments, not for virtual-memory ones); `exact` selects the exact
    /// (size, address) best-fit order of PyTorch rather than gpumem's O(1) segregated fit.
    pub fn new(track_split: bool, exact: bool) -> Self {
        let index = || {
            if exact {
                FreeIndex::ordered()
            } else {
                FreeIndex::binned()
            }
        };
        Self {
            blocks: Vec::new(),
            spare: Vec::new(),
            free: [index(), index()],
            unmapped: [BTreeMap::new(), BTreeMap::new()],
            live: LiveMap::new(),
            segments: Vec::new(),
            spare_segments: Vec::new(),
            stats: BlockStats::default(),
            track_split,
            quick: Quick {
                heads: Vec::new(),
                oldest: NIL,
                newest: NIL,
                len: 0,
                max: 0,
                cap: 0,
            },
        }
    }

    /// Turns on the quick cache for at most `cap` blocks of at most `max` bytes each (off by
    /// default: the PyTorch simulations must merge at once).
    pub fn with_quick_cache(mut self, cap: usize, max: u64) -> Self {
        self.quick.max = max;
        self.quick.cap = cap;
        self.quick.heads = vec![NIL; super::free_index::CLASSES];
        self
    }

    /// Whether the quick cache holds anything.
    #[inline]
    pub fn has_cached(&self) -> bool {
        self.quick.len != 0
    }

    /// A block by id.
    #[inline]
    pub fn block(&self, id: u32) -> &Block {
        &self.blocks[id as usize]
    }

    #[inline]
    fn b(&mut self, id: u32) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    /// A segment by index.
    pub fn segment(&self, seg: u32) -> &Segment {
        &self.segments[seg as usize]
    }

    fn new_block(&mut self, b: Block) -> u32 {
        if let Some(id) = self.spare.pop() {
            self.blocks[id as usize] = b;
            id
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    fn drop_block(&mut self, id: u32) {
        self.spare.push(id);
    }

    /// Puts a block in the index its state calls for.
    fn index(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let h = b.heap.index();
        match b.state {
            State::Free => self.index_free(id),
            State::Unmapped => {
                self.unmapped[h].insert(b.addr, id);
            }
            State::Allocated | State::Pending | State::Cached => {
                self.live.insert(b.addr, id);
            }
        }
    }

    /// Takes a block out of its index.
    fn unindex(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let h = b.heap.index();
        match b.state {
            State::Free => self.unindex_free(id),
            State::Unmapped => {
                self.unmapped[h].remove(&b.addr);
            }
            State::Allocated | State::Pending | State::Cached => {
                self.live.remove(b.addr);
            }
        }
    }

    /// Puts free block `id` in the free index: [`BlockSet::index`]'s case of a free block, called
    /// directly where the block is known to be free.
    #[inline]
    fn index_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        debug_assert_eq!(b.state, State::Free);
        self.free[b.heap.index()].insert(id, b.size, b.addr);
    }

    /// Takes free block `id` out of the free index ([`BlockSet::unindex`]'s case of a free
    /// block).
    #[inline]
    fn unindex_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        debug_assert_eq!(b.state, State::Free);
        self.free[b.heap.index()].remove(id, b.size, b.addr);
    }

    /// Adds a segment made of one block in `state` (Free or Unmapped); returns the block.
    pub fn add_segment(&mut self, addr: u64, size: u64, pool: Pool, state: State) -> u32 {
        let seg = match self.spare_segments.pop() {
            Some(s) => s,
            None => {
                self.segments.push(Segment {
                    addr: 0,
                    size: 0,
                    pool,
                    head: NIL,
                    live: false,
                });
                (self.segments.len() - 1) as u32
            }
        };
        let id = self.new_block(Block {
            addr,
            size,
            requested: 0,
            prev: NIL,
            next: NIL,
            seg,
            pool,
            heap: pool,
            state,
            qprev: NIL,
            qnext: NIL,
            older: NIL,
            newer: NIL,
        });
        self.segments[seg as usize] = Segment {
            addr,
            size,
            pool,
            head: id,
            live: true,
        };
        self.index(id);
        id
    }

    /// Removes a segment whose only block is `id` (free or unmapped); returns (addr, size, pool).
    pub fn remove_segment(&mut self, id: u32) -> (u64, u64, Pool) {
        let b = self.blocks[id as usize].clone();
        debug_assert!(!b.is_split() && matches!(b.state, State::Free | State::Unmapped));
        self.unindex(id);
        self.drop_block(id);
        let s = &mut self.segments[b.seg as usize];
        s.live = false;
        let out = (s.addr, s.size, s.pool);
        self.spare_segments.push(b.seg);
        out
    }

    /// The smallest free block of `pool` with at least `size` bytes (lowest address on ties).
    /// Blocks freed after this search are a new generation of the free lists
    /// ([`FreeIndex::best_fit`]).
    #[inline]
    pub fn best_fit(&mut self, pool: Pool, size: u64) -> Option<u32> {
        self.free[pool.index()].best_fit(size)
    }

    /// Free blocks of `pool` with at least `size` bytes, smallest first.
    pub fn fits(&self, pool: Pool, size: u64) -> impl Iterator<Item = u32> + '_ {
        self.free[pool.index()]
            .fits(size)
            .into_iter()
            .map(|(_, _, id)| id)
    }

    /// Unmapped blocks of `pool`, by address.
    pub fn unmapped(&self, pool: Pool) -> impl Iterator<Item = u32> + '_ {
        self.unmapped[pool.index()].values().copied()
    }

    /// Free blocks of `pool`, smallest first.
    pub fn free_blocks(&self, pool: Pool) -> impl Iterator<Item = u32> + '_ {
        self.free[pool.index()]
            .all()
            .into_iter()
            .map(|(_, _, id)| id)
    }

    /// Size of the largest free block of either pool.
    pub fn largest_free(&self) -> u64 {
        let cached = self
            .cached_ids()
            .map(|id| self.blocks[id as usize].size)
            .max()
            .unwrap_or(0);
        self.free
            .iter()
            .map(|f| f.largest())
            .max()
            .unwrap_or(0)
            .max(cached)
    }

    /// Bytes in free (mapped) blocks.
    pub fn free_bytes(&self) -> u64 {
        self.free
            .iter()
            .flat_map(|f| f.all())
            .map(|(s, _, _)| s)
            .sum()
    }

    /// The live (allocated or pending) block at `addr`.
    #[inline]
    pub fn live_at(&self, addr: u64) -> Option<u32> {
        self.live.get(addr)
    }

    /// Addresses of the live (allocated or pending) blocks, in no order.
    pub fn live_addrs(&self) -> impl Iterator<Item = u64> + '_ {
        self.live.keys()
    }

    /// Number of live blocks.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Whether `addr` is the start of a free block (a double free points there).
    pub fn is_free_start(&self, addr: u64) -> bool {
        let cached = self
            .live
            .get(addr)
            .is_some_and(|id| self.blocks[id as usize].state == State::Cached);
        cached
            || self
                .free
                .iter()
                .any(|f| f.all().iter().any(|&(_, a, _)| a == addr))
    }

    /// Hands out `size` bytes from free block `id` (PyTorch's `alloc_found_block`): with
    /// `split`, the remainder stays free as a new block after the allocated one. Returns the
    /// allocated block (same id, same address).
    #[inline]
    pub fn allocate(&mut self, id: u32, size: u64, requested: u64, pool: Pool, split: bool) -> u32 {
        // The block's fields read once (the hot path: one allocation in two goes through here).
        let (addr, found, prev, next, seg, heap) = {
            let b = &self.blocks[id as usize];
            debug_assert_eq!(b.state, State::Free);
            (b.addr, b.size, b.prev, b.next, b.seg, b.heap)
        };
        self.free[heap.index()].remove(id, found, addr);
        let already_split = prev != NIL || next != NIL;
        let track = self.track_split;
        let mut handed = found;
        if split && found > size {
            let rest_size = found - size;
            let rest = self.new_block(Block {
                addr: addr + size,
                size: rest_size,
                requested: 0,
                prev: id,
                next,
                seg,
                pool: heap,
                heap,
                state: State::Free,
                qprev: NIL,
                qnext: NIL,
                older: NIL,
                newer: NIL,
            });
            if next != NIL {
                self.b(next).prev = rest;
            }
            self.free[heap.index()].insert(rest, rest_size, addr + size);
            self.b(id).next = rest;
            handed = size;
            if track {
                if already_split {
                    // An inactive split block shrinks by the bytes handed out.
                    self.stats.inactive_split_bytes.dec(heap, size);
                } else {
                    self.stats.inactive_split_bytes.inc(heap, rest_size);
                    self.stats.inactive_split.inc(heap, 1);
                }
            }
        } else if already_split && track {
            self.stats.inactive_split_bytes.dec(heap, found);
            self.stats.inactive_split.dec(heap, 1);
        }
        let b = self.b(id);
        b.size = handed;
        b.state = State::Allocated;
        b.requested = requested;
        b.pool = pool;
        self.live.insert(addr, id);
        self.stats.block_handed_out(pool, handed, requested);
        id
    }

    /// Hands out `size` bytes at exactly `addr`, from the free block that covers
    /// `[addr, addr + size)`: split before `addr` and after the range as needed. For putting a
    /// private pool's blocks back where a checkpoint saw them (PyTorch's
    /// `setCheckpointPoolState`), not for the hot path: it walks the segment's blocks. Refused,
    /// with nothing changed, when no free block covers the range (quick-cached blocks do not
    /// count: flush the cache first).
    pub fn carve(&mut self, addr: u64, size: u64, requested: u64) -> Result<u32, String> {
        let seg = self
            .segments
            .iter()
            .find(|s| s.live && s.addr <= addr && addr < s.addr + s.size)
            .ok_or_else(|| format!("no segment holds {addr:#x}"))?;
        let mut id = seg.head;
        while id != NIL && self.block(id).addr + self.block(id).size <= addr {
            id = self.block(id).next;
        }
        let b = self.block(id);
        if size == 0 || b.state != State::Free || addr + size > b.addr + b.size {
            return Err(format!(
                "{size} bytes at {addr:#x} are not inside one free block"
            ));
        }
        let (start, whole, heap, was_split) = (b.addr, b.size, b.heap, b.is_split());
        if addr > start {
            // The head stays free: one free block becomes two.
            self.unindex_free(id);
            let tail = self.split_off(id, addr - start);
            self.index_free(id);
            if self.track_split {
                if was_split {
                    self.stats.inactive_split.inc(heap, 1);
                } else {
                    self.stats.inactive_split.inc(heap, 2);
                    self.stats.inactive_split_bytes.inc(heap, whole);
                }
            }
            id = tail;
        }
        let split = self.block(id).size > size;
        Ok(self.allocate(id, size, requested, Pool::of(size), split))
    }

    /// The allocated block at `addr`, if there is one.
    #[inline]
    pub fn allocated_at(&self, addr: u64) -> Option<u32> {
        self.live
            .get(addr)
            .filter(|&id| self.blocks[id as usize].state == State::Allocated)
    }

    /// Block `id`, if it is allocated at `addr` (a handle check that needs no lookup).
    #[inline]
    pub fn allocated_handle(&self, id: u32, addr: u64) -> Option<u32> {
        self.blocks
            .get(id as usize)
            .filter(|b| b.addr == addr && b.state == State::Allocated)
            .map(|_| id)
    }

    /// The pending (freed, waiting for events) block at `addr`, if there is one.
    #[inline]
    pub fn pending_at(&self, addr: u64) -> Option<u32> {
        self.live
            .get(addr)
            .filter(|&id| self.blocks[id as usize].state == State::Pending)
    }

    /// The user freed block `id`: it stops counting as allocated but stays active until
    /// [`BlockSet::release`].
    #[inline]
    pub fn free_requested(&mut self, id: u32) {
        let b = self.b(id);
        debug_assert_eq!(b.state, State::Allocated);
        b.state = State::Pending;
        let (pool, size) = (b.pool, b.size);
        self.stats.block_freed(pool, size);
    }

    /// A pending block becomes reusable (PyTorch's `free_block`): it merges with free
    /// neighbours and goes back to the free index. Returns the resulting free block.
    pub fn release(&mut self, id: u32) -> u32 {
        debug_assert_eq!(self.block(id).state, State::Pending);
        self.stop_being_active(id);
        self.settle(id)
    }

    /// Active statistics of a block that is no longer in use.
    #[inline]
    fn stop_being_active(&mut self, id: u32) {
        let b = self.block(id);
        let (pool, size, requested) = (b.pool, b.size, b.requested);
        self.stats.block_released(pool, size, requested);
    }

    /// A pending or cached block becomes a free block: merged with free neighbours, indexed,
    /// the inactive-split statistics updated. Returns it.
    ///
    /// The merges are written out here rather than through [`BlockSet::merge`]: the direction
    /// of each is known, and the block's fields stay in registers until they are stored once.
    #[inline]
    fn settle(&mut self, id: u32) -> u32 {
        let (state, mut addr, mut size, mut prev, mut next, seg, heap) = {
            let b = &self.blocks[id as usize];
            (b.state, b.addr, b.size, b.prev, b.next, b.seg, b.heap)
        };
        debug_assert!(matches!(state, State::Cached | State::Pending));
        self.live.remove(addr);
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        if state == State::Cached && (prev != NIL || next != NIL) {
            // A cached block counted as an inactive split block of its own.
            net_blocks -= 1;
            net_bytes -= size as i64;
        }
        let h = heap.index();
        if prev != NIL && self.blocks[prev as usize].state == State::Free {
            // The free block before takes this one's place: its start, its own predecessor.
            let (p_addr, p_size, p_prev) = {
                let p = &self.blocks[prev as usize];
                (p.addr, p.size, p.prev)
            };
            self.free[h].remove(prev, p_size, p_addr);
            if p_prev != NIL {
                self.b(p_prev).next = id;
            } else {
                self.segments[seg as usize].head = id;
            }
            self.drop_block(prev);
            addr = p_addr;
            size += p_size;
            prev = p_prev;
            net_blocks -= 1;
            net_bytes -= p_size as i64;
        }
        if next != NIL && self.blocks[next as usize].state == State::Free {
            let (n_addr, n_size, n_next) = {
                let n = &self.blocks[next as usize];
                (n.addr, n.size, n.next)
            };
            self.free[h].remove(next, n_size, n_addr);
            if n_next != NIL {
                self.b(n_next).prev = id;
            }
            self.drop_block(next);
            size += n_size;
            next = n_next;
            net_blocks -= 1;
            net_bytes -= n_size as i64;
        }
        {
            let b = self.b(id);
            b.state = State::Free;
            b.requested = 0;
            b.pool = heap;
            b.addr = addr;
            b.size = size;
            b.prev = prev;
            b.next = next;
        }
        self.free[h].insert(id, size, addr);
        if prev != NIL || next != NIL {
            net_blocks += 1;
            net_bytes += size as i64;
        }
        if self.track_split {
            self.stats.inactive_split.change(heap, net_blocks);
            self.stats.inactive_split_bytes.change(heap, net_bytes);
        }
        id
    }

    /// The user freed allocated block `id` and no other stream used it: it goes whole into
    /// the quick cache for a request of its size (the oldest cached block is merged back if the
    /// cache is full), or, without the quick cache, is released at once.
    ///
    /// Returns the range (address, size) of a cached block merged back to make room, if any.
    #[inline]
    pub fn free_now(&mut self, id: u32) -> Option<(u64, u64)> {
        let (pool, size, requested, split, heap) = {
            let b = &self.blocks[id as usize];
            debug_assert_eq!(b.state, State::Allocated);
            (b.pool, b.size, b.requested, b.is_split(), b.heap)
        };
        self.stats.block_freed_and_released(pool, size, requested);
        if size > self.quick.max {
            self.blocks[id as usize].state = State::Pending;
            self.settle(id);
            return None;
        }
        if self.track_split && split {
            self.stats.inactive_split.inc(heap, 1);
            self.stats.inactive_split_bytes.inc(heap, size);
        }
        let c = super::free_index::class_index(size);
        let head = self.quick.heads[c];
        {
            let b = self.b(id);
            b.state = State::Cached;
            b.requested = 0;
            b.qprev = NIL;
            b.qnext = head;
        }
        if head != NIL {
            self.b(head).qprev = id;
        }
        self.quick.heads[c] = id;
        self.push_newest(id);
        if self.quick.len > self.quick.cap {
            let old = self.pop_oldest();
            let range = (self.block(old).addr, self.block(old).size);
            self.uncache(old);
            self.settle(old);
            return Some(range);
        }
        None
    }

    /// Adds `id` to the quick cache's age order, as the newest.
    #[inline]
    fn push_newest(&mut self, id: u32) {
        let newest = self.quick.newest;
        {
            let b = self.b(id);
            b.older = newest;
            b.newer = NIL;
        }
        if newest != NIL {
            self.b(newest).newer = id;
        } else {
            self.quick.oldest = id;
        }
        self.quick.newest = id;
        self.quick.len += 1;
    }

    /// Takes the oldest block out of the age order (which must not be empty).
    #[inline]
    fn pop_oldest(&mut self) -> u32 {
        let id = self.quick.oldest;
        debug_assert_ne!(id, NIL);
        self.unlink_age(id);
        id
    }

    /// Takes `id` out of the age order.
    #[inline]
    fn unlink_age(&mut self, id: u32) {
        let (older, newer) = {
            let b = self.block(id);
            (b.older, b.newer)
        };
        if older != NIL {
            self.b(older).newer = newer;
        } else {
            self.quick.oldest = newer;
        }
        if newer != NIL {
            self.b(newer).older = older;
        } else {
            self.quick.newest = older;
        }
        self.quick.len -= 1;
    }

    /// The cached blocks, oldest first.
    fn cached_ids(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(self.quick.oldest).filter(|&id| id != NIL), |&id| {
            Some(self.block(id).newer).filter(|&n| n != NIL)
        })
    }

    /// Takes a block out of the quick cache's class list (not out of the age order).
    #[inline]
    fn uncache(&mut self, id: u32) {
        let (prev, next, size) = {
            let b = self.block(id);
            (b.qprev, b.qnext, b.size)
        };
        if prev != NIL {
            self.b(prev).qnext = next;
        } else {
            self.quick.heads[super::free_index::class_index(size)] = next;
        }
        if next != NIL {
            self.b(next).qprev = prev;
        }
    }

    /// A cached block of exactly `size` bytes in a segment of `heap`'s pool, if there is one.
    #[inline]
    pub fn find_cached(&self, size: u64, heap: Pool) -> Option<u32> {
        if self.quick.len == 0 {
            return None;
        }
        let mut id = self.quick.heads[super::free_index::class_index(size)];
        for _ in 0..4 {
            if id == NIL {
                return None;
            }
            let b = self.block(id);
            if b.size == size && b.heap == heap {
                return Some(id);
            }
            id = b.qnext;
        }
        None
    }

    /// Hands out cached block `id` (from [`BlockSet::find_cached`]) for `requested` bytes of
    /// `pool`.
    #[inline]
    pub fn take_cached(&mut self, id: u32, requested: u64, pool: Pool) -> u32 {
        debug_assert_eq!(self.block(id).state, State::Cached);
        let size = self.block(id).size;
        self.uncache(id);
        self.unlink_age(id);
        let (split, heap) = {
            let b = self.block(id);
            (b.is_split(), b.heap)
        };
        if self.track_split && split {
            self.stats.inactive_split.dec(heap, 1);
            self.stats.inactive_split_bytes.dec(heap, size);
        }
        let b = self.b(id);
        b.state = State::Allocated;
        b.requested = requested;
        b.pool = pool;
        self.stats.block_handed_out(pool, size, requested);
        id
    }

    /// Merges every cached block back into the free blocks; returns their ranges (address,
    /// size) as they were cached.
    pub fn flush_cache(&mut self) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity(self.quick.len);
        while self.quick.len != 0 {
            let id = self.pop_oldest();
            out.push((self.block(id).addr, self.block(id).size));
            self.uncache(id);
            self.settle(id);
        }
        out
    }

    /// Merges neighbour `src` into `dst` when both have the same free-or-unmapped state.
    /// Returns the bytes subsumed (0 if no merge). `dst` must be out of the indexes.
    #[inline]
    pub fn merge(&mut self, dst: u32, src: u32) -> u64 {
        if src == NIL {
            return 0;
        }
        let (state, addr, size, prev, next, seg) = {
            let s = self.block(src);
            (s.state, s.addr, s.size, s.prev, s.next, s.seg)
        };
        if state != self.block(dst).state {
            return 0;
        }
        match state {
            State::Free => self.unindex_free(src),
            State::Unmapped => self.unindex(src),
            _ => return 0,
        }
        if self.block(dst).prev == src {
            let d = self.b(dst);
            d.addr = addr;
            d.prev = prev;
            if prev != NIL {
                self.b(prev).next = dst;
            } else {
                self.segments[seg as usize].head = dst;
            }
        } else {
            self.b(dst).next = next;
            if next != NIL {
                self.b(next).prev = dst;
            }
        }
        self.b(dst).size += size;
        self.drop_block(src);
        size
    }

    /// Splits `id` (free or unmapped, out of the indexes) at `at` bytes from its start; the
    /// tail becomes a new block in the same state, which is indexed. Returns the tail.
    pub fn split_off(&mut self, id: u32, at: u64) -> u32 {
        let b = self.block(id).clone();
        debug_assert!(at > 0 && at < b.size);
        let tail = self.new_block(Block {
            addr: b.addr + at,
            size: b.size - at,
            requested: 0,
            prev: id,
            next: b.next,
            seg: b.seg,
            pool: b.pool,
            heap: b.heap,
            state: b.state,
            qprev: NIL,
            qnext: NIL,
            older: NIL,
            newer: NIL,
        });
        if b.next != NIL {
            self.b(b.next).prev = tail;
        }
        let bm = self.b(id);
        bm.next = tail;
        bm.size = at;
        self.index(tail);
        tail
    }

    /// Takes a block out of the indexes (to reshape it) and returns its state.
    pub fn detach(&mut self, id: u32) -> State {
        self.unindex(id);
        self.block(id).state
    }

    /// Puts a detached block back as it is.
    pub fn attach(&mut self, id: u32) {
        self.index(id);
    }

    /// Changes the state of a detached block.
    pub fn set_detached_state(&mut self, id: u32, state: State) {
        self.b(id).state = state;
    }

    /// Merges a detached block with its neighbours of the same free-or-unmapped state, then
    /// indexes it. Returns the merged block (same id).
    pub fn attach_coalesced(&mut self, id: u32) -> u32 {
        for cand in [self.block(id).prev, self.block(id).next] {
            self.merge(id, cand);
        }
        self.index(id);
        id
    }

    /// Describes every segment and its blocks, by address.
    pub fn segments_info(&self, stream: u64) -> Vec<SegmentInfo> {
        let mut out: Vec<SegmentInfo> = self
            .segments
            .iter()
            .filter(|s| s.live)
            .map(|s| {
                let mut blocks = Vec::new();
                let mut id = s.head;
                while id != NIL {
                    let b = self.block(id);
                    blocks.push(BlockInfo {
                        addr: b.addr,
                        size: b.size,
                        requested: b.requested,
                        kind: match b.state {
                            State::Free | State::Cached => BlockKind::Free,
                            State::Allocated => BlockKind::Allocated,
                            State::Pending => BlockKind::Pending,
                            State::Unmapped => BlockKind::Unmapped,
                        },
                    });
                    id = b.next;
                }
                SegmentInfo {
                    addr: s.addr,
                    size: s.size,
                    stream,
                    pool: s.pool,
                    blocks,
                }
            })
            .collect();
        out.sort_by_key(|s| s.addr);
        out
    }

    /// Checks the structure: blocks tile each segment, neighbours link both ways, no two free
    /// neighbours are left unmerged, indexes agree with states. For tests.
    pub fn check(&self) -> Result<(), String> {
        let mut free_seen = 0;
        let mut cached_seen = 0;
        for (si, s) in self.segments.iter().enumerate() {
            if !s.live {
                continue;
            }
            let mut id = s.head;
            let mut addr = s.addr;
            let mut prev = NIL;
            while id != NIL {
                let b = self.block(id);
                if b.seg as usize != si {
                    return Err(format!("block {id} in segment {si} says segment {}", b.seg));
                }
                if b.addr != addr {
                    return Err(format!(
                        "gap or overlap at {addr:#x} (block at {:#x})",
                        b.addr
                    ));
                }
                if b.prev != prev {
                    return Err(format!("block {id} prev link broken"));
                }
                if b.size == 0 {
                    return Err(format!("block {id} has size 0"));
                }
                if prev != NIL {
                    let p = self.block(prev);
                    if p.state == b.state && matches!(b.state, State::Free | State::Unmapped) {
                        return Err(format!("free neighbours left unmerged at {:#x}", b.addr));
                    }
                }
                let indexed = match b.state {
                    State::Free => {
                        free_seen += 1;
                        self.free[s.pool.index()].contains(id, b.size, b.addr)
                    }
                    State::Unmapped => self.unmapped[s.pool.index()].get(&b.addr) == Some(&id),
                    State::Cached => {
                        cached_seen += 1;
                        self.cached_ids().any(|c| c == id) && self.live.get(b.addr) == Some(id)
                    }
                    _ => self.live.get(b.addr) == Some(id),
                };
                if !indexed {
                    return Err(format!(
                        "block {id} at {:#x} missing from its index",
                        b.addr
                    ));
                }
                addr += b.size;
                prev = id;
                id = b.next;
            }
            if addr != s.addr + s.size {
                return Err(format!(
                    "segment {si} blocks end at {addr:#x}, segment at {:#x}",
                    s.addr + s.size
                ));
            }
        }
        if cached_seen != self.quick.len || self.cached_ids().count() != self.quick.len {
            return Err(format!(
                "{} blocks in the quick cache, {cached_seen} cached in segments",
                self.quick.len
            ));
        }
        let indexed: usize = self.free.iter().map(|f| f.len()).sum();
        if indexed != free_seen {
            return Err(format!(
                "{indexed} blocks indexed as free, {free_seen} free in segments"
            ));
        }
        Ok(())
    }
}
