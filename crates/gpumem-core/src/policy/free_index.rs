//! The index of free blocks, in two forms:
//!
//! - `Ordered`: a B-tree keyed by (size, address). Best fit is exact: the smallest block that
//!   fits, lowest address on ties. The simulations of PyTorch use it, because PyTorch's
//!   allocator searches a `std::set` ordered exactly this way and fidelity depends on it.
//! - `Binned`: two-level segregated lists (as in TLSF): 32 size classes per power of two, a
//!   bitmap of non-empty classes, a doubly linked list per class. Insert and remove are O(1);
//!   search looks at a few blocks of the request's own class (best of them, lowest address on
//!   ties), then takes the head of the next non-empty larger class, whose blocks all fit.
//!   gpumem's own policies use it: it is several times faster than the B-tree and places
//!   blocks within 1/32 of best fit.

use std::collections::BTreeMap;

/// Sizes below 2^MIN_FL share the first class.
const MIN_FL: u32 = 9;
const FL_COUNT: usize = 64 - MIN_FL as usize;
const SL_BITS: u32 = 5;
const SL_COUNT: usize = 1 << SL_BITS;
/// Blocks of the request's own class examined before moving to larger classes.
const SCAN: usize = 8;
/// Blocks of one generation in a class kept in address order (see `Bins::insert`).
const SORT_MAX: usize = 64;

#[derive(Clone, Copy)]
struct Node {
    prev: u32,
    next: u32,
    size: u64,
    addr: u64,
    gen: u64,
}

/// Segregated free lists. Each class's list is circular through a head node: the first
/// `CLASSES` nodes are the heads, block `id` is node `CLASSES + id`, so that linking and
/// unlinking never branch on an end of the list.
pub struct Bins {
    nodes: Vec<Node>,
    fl_bits: u64,
    sl_bits: [u32; FL_COUNT],
    len: usize,
    /// Searches so far: blocks inserted between two searches are one generation.
    gen: u64,
}

/// Number of size classes.
pub(crate) const CLASSES: usize = FL_COUNT * SL_COUNT;

/// A head's generation: never a search's, so the ordered walk of `Bins::insert` stops there.
const HEAD_GEN: u64 = u64::MAX;

/// The size class of `size`, as one index below [`CLASSES`].
#[inline]
pub(crate) fn class_index(size: u64) -> usize {
    let (fl, sl) = class(size);
    fl * SL_COUNT + sl
}

#[inline]
fn class(size: u64) -> (usize, usize) {
    let size = size.max(1 << MIN_FL);
    let fl = 63 - size.leading_zeros();
    let sl = (size >> (fl - SL_BITS)) as usize & (SL_COUNT - 1);
    ((fl - MIN_FL) as usize, sl)
}

impl Bins {
    fn new() -> Self {
        Self {
            nodes: (0..CLASSES as u32)
                .map(|h| Node {
                    prev: h,
                    next: h,
                    size: 0,
                    addr: 0,
                    gen: HEAD_GEN,
                })
                .collect(),
            fl_bits: 0,
            sl_bits: [0; FL_COUNT],
            len: 0,
            gen: 0,
        }
    }

    fn insert(&mut self, id: u32, size: u64, addr: u64) {
        let head = class_index(size);
        let i = id as usize + CLASSES;
        // Most recently freed first, but the blocks freed since the last search (one
        // generation) in address order: frees that come together (a backward pass, another
        // thread's) arrive in an order that varies from run to run, and the placements that
        // follow must not (22 recorded prefetch runs, replayed: 1,411-1,607 pages mapped,
        // depending on that order; 1,411 on every one with it). A search starts a generation,
        // so a loop that frees and allocates one block at a time stops at the head: the common
        // case, handled here without a call so that it needs few registers.
        if i < self.nodes.len() {
            let first = self.nodes[head].next;
            let n = &self.nodes[first as usize];
            if n.gen != self.gen || n.addr > addr {
                self.link(i, head, head as u32, first, size, addr);
                return;
            }
        }
        self.insert_slow(i, head, size, addr);
    }

    /// [`Bins::insert`] of a new block id or behind blocks of the current generation.
    #[inline(never)]
    fn insert_slow(&mut self, i: usize, head: usize, size: u64, addr: u64) {
        if i >= self.nodes.len() {
            let blank = Node {
                prev: 0,
                next: 0,
                size: 0,
                addr: 0,
                gen: 0,
            };
            self.nodes.resize(i + 1, blank);
        }
        // The walk is bounded: beyond SORT_MAX blocks of one generation in a class, order is
        // kept only among the first ones (50,000 frees of one size without an allocation, in
        // rising address order: 2.6 s unbounded, 6 ms with the bound; dev). It stops at the
        // head too, whose generation is no search's.
        let gen = self.gen;
        let mut prev = head as u32;
        let mut next = self.nodes[head].next;
        for _ in 0..SORT_MAX {
            let n = &self.nodes[next as usize];
            if n.gen != gen || n.addr > addr {
                break;
            }
            prev = next;
            next = n.next;
        }
        self.link(i, head, prev, next, size, addr);
    }

    /// Puts node `i` between `prev` and `next` in the list of class `head`.
    #[inline(always)]
    fn link(&mut self, i: usize, head: usize, prev: u32, next: u32, size: u64, addr: u64) {
        self.nodes[i] = Node {
            prev,
            next,
            size,
            addr,
            gen: self.gen,
        };
        self.nodes[next as usize].prev = i as u32;
        self.nodes[prev as usize].next = i as u32;
        let (fl, sl) = (head / SL_COUNT, head % SL_COUNT);
        self.fl_bits |= 1 << fl;
        self.sl_bits[fl] |= 1 << sl;
        self.len += 1;
    }

    fn remove(&mut self, id: u32) {
        let Node {
            prev, next, size, ..
        } = self.nodes[id as usize + CLASSES];
        self.nodes[prev as usize].next = next;
        self.nodes[next as usize].prev = prev;
        // Neighbours the same on both sides: the block was alone, between its head and itself,
        // and its class is now empty. The bits are cleared without a branch: whether a block
        // was alone is as random as the sizes, and a mispredicted branch costs more than
        // finding the class again.
        let (fl, sl) = class(size);
        let alone = u32::from(prev == next);
        self.sl_bits[fl] &= !(alone << sl);
        self.fl_bits &= !(u64::from(self.sl_bits[fl] == 0) << fl);
        self.len -= 1;
    }

    fn best_fit(&mut self, size: u64) -> Option<u32> {
        self.gen += 1;
        let (fl, sl) = class(size);
        let head = (fl * SL_COUNT + sl) as u32;
        // The request's own class: the best of its first few blocks that fit.
        let mut id = self.nodes[head as usize].next;
        let mut best: Option<(u64, u64, u32)> = None;
        for _ in 0..SCAN {
            if id == head {
                break;
            }
            let n = &self.nodes[id as usize];
            if n.size >= size && best.is_none_or(|(s, a, _)| (n.size, n.addr) < (s, a)) {
                best = Some((n.size, n.addr, id));
            }
            id = n.next;
        }
        if let Some((_, _, id)) = best {
            return Some(id - CLASSES as u32);
        }
        // Any block of a larger class fits: take the head of the smallest one.
        let sl_above = self.sl_bits[fl] & ((!0u32 << sl) << 1);
        let larger = if sl_above != 0 {
            Some((fl, sl_above.trailing_zeros() as usize))
        } else {
            let fl_above = self.fl_bits & ((!0u64 << fl) << 1);
            (fl_above != 0).then(|| {
                let f = fl_above.trailing_zeros() as usize;
                (f, self.sl_bits[f].trailing_zeros() as usize)
            })
        };
        if let Some((f, s)) = larger {
            return Some(self.nodes[f * SL_COUNT + s].next - CLASSES as u32);
        }
        // Nothing larger: the rest of the request's own class is the last chance.
        while id != head {
            let n = &self.nodes[id as usize];
            if n.size >= size && best.is_none_or(|(s, a, _)| (n.size, n.addr) < (s, a)) {
                best = Some((n.size, n.addr, id));
            }
            id = n.next;
        }
        best.map(|(_, _, id)| id - CLASSES as u32)
    }

    /// The node of block `id`.
    fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize + CLASSES]
    }

    fn ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        for h in 0..CLASSES as u32 {
            let mut i = self.nodes[h as usize].next;
            while i != h {
                out.push(i - CLASSES as u32);
                i = self.nodes[i as usize].next;
            }
        }
        out
    }
}

/// Free blocks of one pool.
pub enum FreeIndex {
    /// Exact best fit (PyTorch's order).
    Ordered(BTreeMap<(u64, u64), u32>),
    /// Segregated fit, O(1).
    Binned(Box<Bins>),
}

impl FreeIndex {
    /// An exact (size, address)-ordered index.
    pub fn ordered() -> Self {
        FreeIndex::Ordered(BTreeMap::new())
    }

    /// A segregated-fit index.
    pub fn binned() -> Self {
        FreeIndex::Binned(Box::new(Bins::new()))
    }

    /// Adds block `id` of `size` bytes at `addr`.
    #[inline]
    pub fn insert(&mut self, id: u32, size: u64, addr: u64) {
        match self {
            FreeIndex::Ordered(m) => {
                m.insert((size, addr), id);
            }
            FreeIndex::Binned(b) => b.insert(id, size, addr),
        }
    }

    /// Removes block `id` (which was inserted with `size` and `addr`).
    #[inline]
    pub fn remove(&mut self, id: u32, size: u64, addr: u64) {
        match self {
            FreeIndex::Ordered(m) => {
                m.remove(&(size, addr));
            }
            FreeIndex::Binned(b) => b.remove(id),
        }
    }

    /// A block of at least `size` bytes, if any. In the binned index the search also starts a
    /// new generation: blocks inserted after it come before older ones in their class, in
    /// address order among themselves.
    #[inline]
    pub fn best_fit(&mut self, size: u64) -> Option<u32> {
        match self {
            FreeIndex::Ordered(m) => m.range((size, 0)..).next().map(|(_, &id)| id),
            FreeIndex::Binned(b) => b.best_fit(size),
        }
    }

    /// Blocks with at least `size` bytes, as (size, address, id), smallest first.
    pub fn fits(&self, size: u64) -> Vec<(u64, u64, u32)> {
        match self {
            FreeIndex::Ordered(m) => m
                .range((size, 0)..)
                .map(|(&(s, a), &id)| (s, a, id))
                .collect(),
            FreeIndex::Binned(b) => {
                let mut v: Vec<_> = b
                    .ids()
                    .into_iter()
                    .map(|id| (b.node(id).size, b.node(id).addr, id))
                    .filter(|&(s, _, _)| s >= size)
                    .collect();
                v.sort_unstable();
                v
            }
        }
    }

    /// Every free block as (size, address, id), smallest first.
    pub fn all(&self) -> Vec<(u64, u64, u32)> {
        self.fits(0)
    }

    /// Whether block `id` is in the index with this size and address.
    pub fn contains(&self, id: u32, size: u64, addr: u64) -> bool {
        match self {
            FreeIndex::Ordered(m) => m.get(&(size, addr)) == Some(&id),
            FreeIndex::Binned(b) => {
                b.ids().contains(&id) && {
                    let n = b.node(id);
                    n.size == size && n.addr == addr
                }
            }
        }
    }

    /// Number of free blocks.
    pub fn len(&self) -> usize {
        match self {
            FreeIndex::Ordered(m) => m.len(),
            FreeIndex::Binned(b) => b.len,
        }
    }

    /// Whether there is no free block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the largest free block (0 if none).
    pub fn largest(&self) -> u64 {
        match self {
            FreeIndex::Ordered(m) => m.keys().next_back().map_or(0, |k| k.0),
            FreeIndex::Binned(b) => {
                if b.fl_bits == 0 {
                    return 0;
                }
                let fl = 63 - b.fl_bits.leading_zeros() as usize;
                let sl = 31 - b.sl_bits[fl].leading_zeros() as usize;
                let head = (fl * SL_COUNT + sl) as u32;
                let mut i = b.nodes[head as usize].next;
                let mut max = 0;
                while i != head {
                    max = max.max(b.nodes[i as usize].size);
                    i = b.nodes[i as usize].next;
                }
                max
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestRng;

    #[test]
    fn classes_are_monotonic_and_fine() {
        let mut last = (0, 0);
        for size in (512..(64 << 20)).step_by(512 * 97) {
            let c = class(size);
            assert!(c >= last, "class of {size} went down");
            last = c;
        }
        // 32 classes per power of two: sizes 3 % apart land in different classes.
        assert_ne!(class(1 << 20), class((1 << 20) + (1 << 15)));
        assert_eq!(class(512), (0, 0));
    }

    #[test]
    fn binned_finds_a_fitting_block_or_none() {
        let mut f = FreeIndex::binned();
        f.insert(0, 4096, 0x1000);
        f.insert(1, 1 << 20, 0x10_0000);
        f.insert(2, 3 << 20, 0x100_0000);
        assert_eq!(f.best_fit(4000), Some(0));
        assert_eq!(f.best_fit(4097), Some(1));
        assert_eq!(f.best_fit((1 << 20) + 1), Some(2));
        assert_eq!(f.best_fit(4 << 20), None);
        f.remove(1, 1 << 20, 0x10_0000);
        assert_eq!(f.best_fit(4097), Some(2));
        assert_eq!(f.largest(), 3 << 20);
        assert_eq!(f.len(), 2);
        assert!(f.contains(2, 3 << 20, 0x100_0000));
        assert!(!f.contains(1, 1 << 20, 0x10_0000));
    }

    #[test]
    fn binned_prefers_exact_size_and_lowest_address_in_class() {
        let mut f = FreeIndex::binned();
        // Same class, different sizes and addresses.
        f.insert(0, 1_040_384, 0x3000_0000);
        f.insert(1, 1_048_576, 0x2000_0000);
        f.insert(2, 1_048_576, 0x1000_0000);
        assert_eq!(f.best_fit(1_048_576), Some(2));
        assert_eq!(f.best_fit(1_000_000), Some(0));
    }

    #[test]
    fn blocks_freed_together_are_found_in_the_same_order_whatever_their_free_order() {
        // Ten 32 MiB blocks freed between two searches, in two orders: a 24 MiB request (a
        // smaller class) takes the head of their class, which must not depend on the order.
        let addrs: Vec<u64> = (0..10u64).map(|i| (i * 7 % 10 + 1) << 30).collect();
        let taken = |order: &[usize]| {
            let mut f = FreeIndex::binned();
            f.insert(100, 32 << 20, 0x40 << 30); // freed before the last search
            assert_eq!(f.best_fit(1 << 40), None);
            for &i in order {
                f.insert(i as u32, 32 << 20, addrs[i]);
            }
            let mut got = Vec::new();
            while let Some(id) = f.best_fit(24 << 20) {
                f.remove(id, 32 << 20, f_addr(id, &addrs));
                got.push(id);
            }
            got
        };
        fn f_addr(id: u32, addrs: &[u64]) -> u64 {
            addrs.get(id as usize).copied().unwrap_or(0x40 << 30)
        }
        let forward: Vec<usize> = (0..10).collect();
        let backward: Vec<usize> = (0..10).rev().collect();
        let (a, b) = (taken(&forward), taken(&backward));
        assert_eq!(a, b);
        // The latest generation first, lowest address first within it; the older block last.
        let mut by_addr: Vec<u32> = (0..10).collect();
        by_addr.sort_by_key(|&i| addrs[i as usize]);
        by_addr.push(100);
        assert_eq!(a, by_addr);
    }

    #[test]
    fn many_blocks_freed_together_are_all_kept_and_found() {
        // More blocks of one class than the ordered walk covers, freed with no search between
        // them (a program dropping a long list of equal tensors), in rising address order so
        // that each walks as far as it may: every one is kept and found, and the first ones
        // come in address order.
        let mut f = FreeIndex::binned();
        let n = 5 * SORT_MAX as u32;
        for i in 0..n {
            f.insert(i, 8192, u64::from(i) * 16384);
        }
        assert_eq!(f.len(), n as usize);
        let mut found = Vec::new();
        while let Some(id) = f.best_fit(8192) {
            f.remove(id, 8192, u64::from(id) * 16384);
            found.push(id);
        }
        assert_eq!(found[..SORT_MAX], (0..SORT_MAX as u32).collect::<Vec<_>>());
        found.sort_unstable();
        assert_eq!(found, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn binned_agrees_with_ordered_on_fit() {
        // Every answer of the binned index fits, and it answers None only when nothing fits.
        let mut b = FreeIndex::binned();
        let mut o = FreeIndex::ordered();
        let mut rng = TestRng::new(12345);
        let mut live = Vec::new();
        for id in 0..5000u32 {
            // One draw a step, its bits read several ways below.
            let x = rng.next_u64();
            let size = 512 * (1 + x % 40_000);
            let addr = (id as u64) << 32;
            if x % 3 == 0 && !live.is_empty() {
                let (i, s, a) = live.swap_remove((x as usize / 3) % live.len());
                b.remove(i, s, a);
                o.remove(i, s, a);
            } else {
                b.insert(id, size, addr);
                o.insert(id, size, addr);
                live.push((id, size, addr));
            }
            let want = 512 * (1 + (x >> 20) % 40_000);
            match (b.best_fit(want), o.best_fit(want)) {
                (Some(i), Some(_)) => {
                    let &(_, s, _) = live.iter().find(|l| l.0 == i).unwrap();
                    assert!(s >= want);
                }
                (None, None) => {}
                (bb, oo) => panic!("binned {bb:?} vs ordered {oo:?} for {want}"),
            }
        }
    }
}
