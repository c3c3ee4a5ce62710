//! Best-fit caching over plain segments (cuMemAlloc): PyTorch's native allocator, simulated
//! rule for rule, and gpumem's `caching` policy, which differs only in its split rule.
//!
//! PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp): sizes round up to 512 B; requests of at
//! most 1 MiB use the small pool of 2 MiB segments; 1–10 MiB requests get 20 MiB segments;
//! larger ones get their own segment rounded up to 2 MiB. The smallest free block of the
//! stream's pool that fits is taken (lowest address on ties) and split when the remainder is
//! at least 512 B (small pool) or more than 1 MiB (large pool). Frees merge with free
//! neighbours.

use super::blocks::{BlockSet, State};
use super::{Placement, Policy, SegmentInfo};
use crate::backend::{DevPtr, Stream};
use crate::device::Device;
use crate::error::BackendError;
use crate::stats::{MemoryStats, Pool};
use crate::units::{
    round_up, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
};

/// PyTorch's `round_size` with no power-of-two divisions configured.
#[inline]
pub fn round_size(size: u64) -> u64 {
    if size < MIN_BLOCK {
        MIN_BLOCK
    } else {
        round_up(size, MIN_BLOCK)
    }
}

/// PyTorch's `get_allocation_size`: the segment made for a request that found no block.
#[inline]
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}

/// Best-fit caching over plain segments.
pub struct Segmented {
    name: &'static str,
    stream: Stream,
    set: BlockSet,
    /// A large-pool block is split only if more than this many bytes would remain.
    large_split_over: u64,
}

impl Segmented {
    /// PyTorch's native caching allocator.
    pub fn native(stream: Stream) -> Self {
        Self {
            name: "native",
            stream,
            set: BlockSet::new(true, true),
            large_split_over: SMALL_SIZE,
        }
    }

    /// gpumem's caching policy: PyTorch's structure, but large blocks are split down to the
    /// 512-byte granule so a big cached block is never handed out whole for a smaller request.
    pub fn caching(stream: Stream) -> Self {
        Self {
            name: "caching",
            stream,
            set: BlockSet::new(true, false).with_quick_cache(32, SMALL_SIZE),
            large_split_over: MIN_BLOCK - 1,
        }
    }

    fn free_block(&mut self, id: u32, _dev: &Device) -> u64 {
        let size = self.set.block(id).size;
        self.set.free_now(id);
        size
    }

    fn should_split(&self, pool: Pool, remaining: u64) -> bool {
        match pool {
            Pool::Small => remaining >= MIN_BLOCK,
            Pool::Large => remaining > self.large_split_over,
        }
    }
}

impl Policy for Segmented {
    block_set_queries!();

    fn name(&self) -> &'static str {
        self.name
    }

    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        let rounded = round_size(size);
        let pool = Pool::of(rounded);
        if let Some(id) = self.set.find_cached(rounded, pool) {
            let id = self.set.take_cached(id, size, pool);
            return Ok(Placement {
                addr: self.set.block(id).addr,
                size: rounded,
                handle: id,
            });
        }
        let mut found = self.set.best_fit(pool, rounded);
        if found.is_none() && self.set.has_cached() {
            // Before growing, merge the cached blocks back: together they may fit.
            self.set.flush_cache();
            found = self.set.best_fit(pool, rounded);
        }
        let id = match found {
            Some(id) => id,
            None => {
                let bytes = segment_size(rounded);
                let ptr = dev.lock().alloc_segment(bytes, pool)?;
                self.set.add_segment(ptr, bytes, pool, State::Free)
            }
        };
        let split = self.should_split(pool, self.set.block(id).size - rounded);
        let id = self.set.allocate(id, rounded, size, pool, split);
        let b = self.set.block(id);
        Ok(Placement {
            addr: b.addr,
            size: b.size,
            handle: id,
        })
    }

    fn release(&mut self, addr: DevPtr, _dev: &Device) -> Result<(), BackendError> {
        if let Some(id) = self.set.pending_at(addr) {
            self.set.release(id);
        }
        Ok(())
    }

    fn allocate_at(
        &mut self,
        addr: DevPtr,
        size: u64,
        requested: u64,
    ) -> Result<Placement, String> {
        // Blocks in the quick cache are free but not merged: merged first, they can be carved.
        self.set.flush_cache();
        let id = self.set.carve(addr, size, requested)?;
        Ok(Placement {
            addr,
            size,
            handle: id,
        })
    }

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        self.set.flush_cache();
        let mut whole = Vec::new();
        for pool in [Pool::Large, Pool::Small] {
            whole.extend(
                self.set
                    .free_blocks(pool)
                    .filter(|&id| !self.set.block(id).is_split()),
            );
        }
        let mut freed = 0;
        let mut d = dev.lock();
        for id in whole {
            // Freed by the driver first: a segment it refuses stays a cached block, for a later
            // empty_cache to try again, instead of being forgotten while still held.
            let (addr, size, pool) = {
                let b = self.set.block(id);
                (b.addr, b.size, b.pool)
            };
            d.free_segment(addr, size, pool)?;
            self.set.remove_segment(id);
            freed += size;
        }
        Ok(freed)
    }

    fn largest_free(&self) -> u64 {
        self.set.largest_free()
    }

    fn segments(&self) -> Vec<SegmentInfo> {
        self.set.segments_info(self.stream)
    }

    fn check(&self) -> Result<(), String> {
        self.set.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::backend::{CostModel, DriverCall};
    use crate::units::MIB;

    fn dev() -> Device {
        Device::new(
            Box::new(SimBackend::new(SimConfig::default()).0),
            CostModel::h200(),
        )
    }

    #[test]
    fn pytorch_rounding_and_segment_sizes() {
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(3072), 3072);
        assert_eq!(round_size(3073), 3584);
        assert_eq!(segment_size(512), 2 * MIB);
        assert_eq!(segment_size(MIB), 2 * MIB);
        assert_eq!(segment_size(MIB + 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB), 10 * MIB);
        // The first segment of the gpt2_train trace: the 154,389,504-byte embedding.
        assert_eq!(segment_size(154_389_504), 155_189_248);
    }

    #[test]
    fn small_blocks_pack_into_one_segment_and_coalesce() {
        let d = dev();
        let mut p = Segmented::native(0);
        let a = p.allocate(3072, &d).unwrap();
        let b = p.allocate(3072, &d).unwrap();
        assert_eq!(b.addr, a.addr + 3072, "second block right after the first");
        assert_eq!(d.lock().calls().count(DriverCall::MemAlloc), 1);
        assert_eq!(p.free_requested(a.addr, &d), Some(3072));
        p.release(a.addr, &d).unwrap();
        assert_eq!(p.free_requested(b.addr, &d), Some(3072));
        p.release(b.addr, &d).unwrap();
        p.check().unwrap();
        // Everything merged back into the whole 2 MiB segment, which empty_cache returns.
        assert_eq!(p.largest_free(), 2 * MIB);
        assert_eq!(p.stats().inactive_split.all.current, 0);
        assert_eq!(p.release_cached(&d).unwrap(), 2 * MIB);
        assert_eq!(d.lock().held(), 0);
    }

    #[test]
    fn large_split_rule_differs_between_native_and_caching() {
        let d = dev();
        // A 9.5 MiB request gets a 20 MiB segment (1-10 MiB requests do); the 10.5 MiB
        // remainder is more than 1 MiB, so both policies split it off as a free block. Freed,
        // the block merges back: one free 20 MiB block in each.
        let mut n = Segmented::native(0);
        let mut c = Segmented::caching(0);
        for p in [&mut n, &mut c] {
            let a = p.allocate(19 * MIB / 2, &d).unwrap();
            assert_eq!(a.size, 19 * MIB / 2, "{}", p.name());
            let segs = p.segments();
            assert_eq!(segs.len(), 1, "{}", p.name());
            assert_eq!(segs[0].size, 20 * MIB, "{}", p.name());
            assert_eq!(p.stats().inactive_split.all.current, 1, "{}", p.name());
            assert_eq!(
                p.stats().inactive_split_bytes.all.current,
                (21 * MIB / 2) as i64,
                "{}",
                p.name()
            );
            p.free_requested(a.addr, &d);
            p.release(a.addr, &d).unwrap();
            assert_eq!(p.stats().inactive_split.all.current, 0, "{}", p.name());
        }
        assert_eq!(d.lock().held(), 40 * MIB);
        // A 19.5 MiB request then fits the free 20 MiB block. Native hands it out whole (the
        // 0.5 MiB remainder is not over 1 MiB); caching splits the 0.5 MiB off.
        let b = n.allocate(39 * MIB / 2, &d).unwrap();
        assert_eq!(b.size, 20 * MIB);
        let x = c.allocate(39 * MIB / 2, &d).unwrap();
        assert_eq!(x.size, 39 * MIB / 2, "caching splits off the 0.5 MiB");
        assert_eq!(c.stats().inactive_split_bytes.all.current, (MIB / 2) as i64);
        assert_eq!(d.lock().held(), 40 * MIB, "no new segment");
        n.check().unwrap();
        c.check().unwrap();
    }

    #[test]
    fn a_block_carved_at_an_address_splits_and_counts_like_any_other() {
        let d = dev();
        let mut p = Segmented::caching(0);
        // One 2 MiB segment, all free (its only block waits in the quick cache).
        let first = p.allocate(4096, &d).unwrap();
        p.free(first.addr, &d).unwrap();
        let seg = first.addr;
        // 4 KiB at 8 KiB into the segment: a free head, the block, a free tail.
        let b = p.allocate_at(seg + 8192, 4096, 4000).unwrap();
        assert_eq!((b.addr, b.size), (seg + 8192, 4096));
        p.check().unwrap();
        let s = p.stats();
        assert_eq!(s.inactive_split.all.current, 2);
        assert_eq!(s.inactive_split_bytes.all.current, (2 * MIB - 4096) as i64);
        assert_eq!(s.allocated_bytes.small_pool.current, 4096);
        assert_eq!(s.requested_bytes.all.current, 4000);
        assert!(p.is_allocated(seg + 8192));
        // Taken, or partly outside any free block: refused, nothing changed.
        for (addr, size) in [(seg + 8192, 512), (seg + 4096, 8192), (seg + 2 * MIB, 512)] {
            assert!(p.allocate_at(addr, size, size).is_err(), "{addr:#x} {size}");
        }
        assert_eq!(p.stats().inactive_split.all.current, 2);
        // The head's own room can still be carved, right up to the block.
        let h = p.allocate_at(seg + 4096, 4096, 4096).unwrap();
        assert_eq!(p.stats().inactive_split.all.current, 2, "head and tail");
        p.free(h.addr, &d).unwrap();
        p.free(b.addr, &d).unwrap();
        // Merged back whole, the segment goes back to the device.
        assert_eq!(p.release_cached(&d).unwrap(), 2 * MIB);
        assert_eq!(p.stats().inactive_split.all.current, 0);
        assert_eq!(p.stats().inactive_split_bytes.all.current, 0);
        p.check().unwrap();
    }

    #[test]
    fn inactive_split_stats_follow_pytorch() {
        let d = dev();
        let mut p = Segmented::native(0);
        let a = p.allocate(4096, &d).unwrap();
        // Splitting a fresh 2 MiB segment leaves one inactive split block of the remainder.
        assert_eq!(p.stats().inactive_split.all.current, 1);
        assert_eq!(
            p.stats().inactive_split_bytes.all.current,
            (2 * MIB - 4096) as i64
        );
        let b = p.allocate(4096, &d).unwrap();
        assert_eq!(
            p.stats().inactive_split_bytes.all.current,
            (2 * MIB - 8192) as i64
        );
        p.free_requested(a.addr, &d);
        p.release(a.addr, &d).unwrap();
        // `a` is a new inactive split block; `b` separates it from the tail.
        assert_eq!(p.stats().inactive_split.all.current, 2);
        assert_eq!(
            p.stats().inactive_split_bytes.all.current,
            (2 * MIB - 4096) as i64
        );
        p.free_requested(b.addr, &d);
        p.release(b.addr, &d).unwrap();
        assert_eq!(p.stats().inactive_split.all.current, 0);
        assert_eq!(p.stats().inactive_split_bytes.all.current, 0);
        assert_eq!(p.stats().allocated_bytes.small_pool.peak, 8192);
    }
}
