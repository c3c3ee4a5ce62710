//! Address -> block id of a [`super::blocks::BlockSet`]'s live blocks: a hash table with open
//! addressing and linear probing, kept at most an eighth full (half full past a million slots).
//!
//! Every allocation inserts one address and every release removes one, so this table is on the
//! hot path twice per allocate/free pair. A general hash map (hashbrown) costs about 60
//! instructions for the insert and 40 for the removal; this one needs a third of that: keys are
//! block addresses (multiples of 512, never `u64::MAX`, which marks an empty slot), the hash is
//! one multiplication, and a removal shifts the following entries back instead of leaving a
//! tombstone, so lookups never walk over deleted slots.
//!
//! Why an eighth: each step of a probe is a branch the CPU cannot predict (whether the slot
//! holds the key, or ends the run), and a mispredicted branch costs more than the instructions
//! around it. Half full, a removal walks about four slots (the key's run and the shift after
//! it); an eighth full, mostly one. On the 512 B-64 MiB random case of `gpumem bench alloc`
//! (500 blocks live) that took stitched from 69.2 to 59.1 ns per operation on the dev machine,
//! and 11.3 to 9.0 mispredicted branches per allocate/free pair by cachegrind's model
//! (BENCHMARKS.md §4, session 45). The price is host memory: 16-byte slots, so 128 to 256 bytes
//! per live block (a workload with 100,000 live blocks: 16 MB). Past a million slots (16 MiB,
//! 131,072 live blocks) the table grows at half full again, as before, so that a program with
//! millions of live blocks holds 32-64 bytes per block rather than 256: a table that size is
//! out of the CPU's caches anyway, and its misses cost more than its probes.

/// An empty slot's key: no block starts there (addresses are multiples of 512).
const EMPTY: u64 = u64::MAX;

/// Slots of a new table (a power of two).
const MIN_SLOTS: usize = 64;

/// The table holds at most one key per this many slots ...
const MAX_LOAD_INV: usize = 8;
/// ... until it has this many slots; then at most one per two.
const BIG_SLOTS: usize = 1 << 20;

#[derive(Clone, Copy)]
struct Slot {
    addr: u64,
    id: u32,
}

const VACANT: Slot = Slot { addr: EMPTY, id: 0 };

/// The table.
pub(crate) struct LiveMap {
    slots: Vec<Slot>,
    /// `slots.len() - 1`.
    mask: usize,
    /// 64 minus log2 of the slot count: the hash's top bits pick the slot.
    shift: u32,
    /// Keys it holds before it grows (see [`MAX_LOAD_INV`] and [`BIG_SLOTS`]), fixed with the
    /// slot count so that an insertion only compares.
    max_len: usize,
    len: usize,
}

impl LiveMap {
    pub(crate) fn new() -> Self {
        Self::with_slots(MIN_SLOTS)
    }

    fn with_slots(n: usize) -> Self {
        debug_assert!(n.is_power_of_two());
        Self {
            slots: vec![VACANT; n],
            mask: n - 1,
            shift: 64 - n.trailing_zeros(),
            max_len: if n < BIG_SLOTS {
                n / MAX_LOAD_INV
            } else {
                n / 2
            },
            len: 0,
        }
    }

    /// The home slot of `addr`. Fibonacci hashing of the address without its 512-byte granule
    /// bits: neighbouring blocks land far apart.
    #[inline(always)]
    fn home(&self, addr: u64) -> usize {
        ((addr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Number of entries.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The id at `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: u64) -> Option<u32> {
        let mut i = self.home(addr);
        loop {
            let s = self.slots[i];
            if s.addr == addr {
                return Some(s.id);
            }
            if s.addr == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Maps `addr` to `id` (replacing what it mapped to).
    #[inline]
    pub(crate) fn insert(&mut self, addr: u64, id: u32) {
        debug_assert_ne!(addr, EMPTY);
        // At most `max_len` keys (an eighth full, half past `BIG_SLOTS`), so that probes mostly
        // end at the first slot (see the module comment) and an empty slot always ends them.
        if self.len == self.max_len {
            self.grow();
        }
        let mut i = self.home(addr);
        loop {
            let s = &mut self.slots[i];
            if s.addr == EMPTY {
                *s = Slot { addr, id };
                self.len += 1;
                return;
            }
            if s.addr == addr {
                s.id = id;
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Removes `addr`; returns the id it mapped to.
    #[inline]
    pub(crate) fn remove(&mut self, addr: u64) -> Option<u32> {
        let mask = self.mask;
        let mut i = self.home(addr);
        loop {
            let s = self.slots[i];
            if s.addr == addr {
                break;
            }
            if s.addr == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
        }
        let id = self.slots[i].id;
        // Backward shift: each following entry of the run moves into the hole if the hole is
        // on its probe path (between its home slot and where it is), so that no lookup meets
        // an empty slot before its key.
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.addr == EMPTY {
                break;
            }
            let home = self.home(s.addr);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = VACANT;
        self.len -= 1;
        Some(id)
    }

    /// Doubles the slots.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let mut bigger = Self::with_slots(2 * self.slots.len());
        for s in &self.slots {
            if s.addr != EMPTY {
                bigger.insert(s.addr, s.id);
            }
        }
        *self = bigger;
    }

    /// Mean number of slots a stored key sits past its home slot: the extra probes a lookup
    /// of it walks.
    #[cfg(test)]
    fn mean_displacement(&self) -> f64 {
        let total: usize = (0..self.slots.len())
            .filter(|&j| self.slots[j].addr != EMPTY)
            .map(|j| j.wrapping_sub(self.home(self.slots[j].addr)) & self.mask)
            .sum();
        total as f64 / self.len.max(1) as f64
    }

    /// The addresses, in no order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots
            .iter()
            .filter(|s| s.addr != EMPTY)
            .map(|s| s.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestRng;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_hash_map() {
        // Random inserts and removals of clustered addresses (as blocks of a few segments
        // are), checked against std's map after every step, through several growths.
        let mut rng = TestRng::new(0x2545_F491_4F6C_DD1D);
        let mut m = LiveMap::new();
        let mut r: HashMap<u64, u32> = HashMap::new();
        for step in 0..200_000u32 {
            let addr = 0x7f00_0000_0000 + rng.below(5000) * 512 + rng.below(3) * (1 << 40);
            match rng.below(5) {
                0..=2 => {
                    m.insert(addr, step);
                    r.insert(addr, step);
                }
                _ => assert_eq!(m.remove(addr), r.remove(&addr), "step {step}"),
            }
            assert_eq!(m.len(), r.len());
            let probe = 0x7f00_0000_0000 + rng.below(5000) * 512;
            assert_eq!(m.get(probe), r.get(&probe).copied(), "step {step}");
        }
        let mut keys: Vec<u64> = m.keys().collect();
        let mut want: Vec<u64> = r.keys().copied().collect();
        keys.sort_unstable();
        want.sort_unstable();
        assert_eq!(keys, want);
    }

    #[test]
    fn probes_stay_short_when_fullest() {
        // Block addresses as a pool hands them out (multiples of 512 in a few GiB), up to the
        // fullest the table gets before it grows. Linear probing an eighth full leaves keys
        // about 0.07 slots past home on average; a quarter full 0.17, half full 0.5. The
        // benchmark's speed rests on the first (see the module comment).
        let mut rng = TestRng::new(0x9E37_79B9_7F4A_7C15);
        let mut m = LiveMap::new();
        let mut stored = HashMap::new();
        while m.len() < 4096 {
            let addr = 0x7f00_0000_0000 + rng.below(8 << 21) * 512;
            m.insert(addr, 0);
            stored.insert(addr, ());
        }
        assert_eq!(m.len(), stored.len());
        assert_eq!(m.slots.len(), 4096 * MAX_LOAD_INV, "fullest before growing");
        let d = m.mean_displacement();
        assert!(d < 0.12, "mean displacement {d:.3} slots");
        // And every key is still found.
        assert!(stored.keys().all(|&a| m.get(a) == Some(0)));
    }

    #[test]
    fn grows_at_half_full_past_a_million_slots() {
        // An eighth full up to 2^20 slots (131,072 keys), then half full: 300,000 keys stay in
        // 2^20 slots (29 % full) instead of taking 2^22 (64 MiB).
        let mut m = LiveMap::new();
        for i in 0..300_000u64 {
            m.insert(0x7f00_0000_0000 + i * 4096, i as u32);
        }
        assert_eq!(m.slots.len(), BIG_SLOTS);
        assert_eq!(m.len(), 300_000);
        for i in (0..300_000u64).step_by(997) {
            assert_eq!(m.get(0x7f00_0000_0000 + i * 4096), Some(i as u32));
        }
        // Past half full it grows again.
        for i in 300_000..=524_288u64 {
            m.insert(0x7f00_0000_0000 + i * 4096, i as u32);
        }
        assert_eq!(m.slots.len(), 2 * BIG_SLOTS);
    }
}
