//! A simulation of PyTorch's caching allocator with `expandable_segments:True`.
//!
//! Each stream and pool gets one segment: a virtual range of 1⅛ × device memory, mapped in
//! pages of 2 MiB (small pool) or 20 MiB (large pool) as it grows. Best fit treats the free
//! block at the mapped frontier as being as large as it could grow; when nothing fits, the
//! lowest address where free and unmapped space together fit the request is mapped. Blocks are
//! split whenever at least 512 B remain. Releasing the cache unmaps every whole page of every
//! free block. (c10/cuda/CUDACachingAllocator.cpp: get_free_block, find_expandable_block,
//! try_allocate_expandable_block, map_block, unmap_block.)

use super::blocks::{BlockSet, State, NIL};
use super::segmented::round_size;
use super::{Placement, Policy, SegmentInfo};
use crate::backend::{DevPtr, PhysHandle, Stream};
use crate::device::{Device, DeviceState};
use crate::error::BackendError;
use crate::stats::{MemoryStats, Pool};
use crate::units::{LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER};

struct ExpSegment {
    base: u64,
    page: u64,
    pool: Pool,
    handles: Vec<Option<PhysHandle>>,
}

/// The expandable-segments simulation for one stream.
pub struct Expandable {
    stream: Stream,
    device_total: u64,
    set: BlockSet,
    segs: Vec<ExpSegment>,
}

impl Expandable {
    /// A pool for `stream` on a device of `device_total` bytes.
    pub fn new(stream: Stream, device_total: u64) -> Self {
        Self {
            stream,
            device_total,
            set: BlockSet::new(false, true),
            segs: Vec::new(),
        }
    }

    fn seg_of(&self, addr: u64) -> usize {
        self.segs
            .iter()
            .position(|s| addr >= s.base && addr < s.base + s.handles.len() as u64 * s.page)
            .expect("address inside an expandable segment")
    }

    /// Size of a free block counting the unmapped space right after it.
    fn expandable_size(&self, id: u32) -> u64 {
        let b = self.set.block(id);
        let extra = if b.next != NIL && self.set.block(b.next).state == State::Unmapped {
            self.set.block(b.next).size
        } else {
            0
        };
        b.size + extra
    }

    fn get_free_block(&self, pool: Pool, size: u64) -> Option<u32> {
        let mut it = self.set.fits(pool, size);
        let mut cur = it.next()?;
        for next in it {
            if self.expandable_size(next) < self.expandable_size(cur) {
                cur = next;
            } else {
                break;
            }
        }
        Some(cur)
    }

    fn allocatable(&self, id: u32) -> bool {
        id != NIL && matches!(self.set.block(id).state, State::Free | State::Unmapped)
    }

    fn find_expandable_block(
        &mut self,
        pool: Pool,
        size: u64,
        d: &mut DeviceState,
    ) -> Result<u32, BackendError> {
        let candidates: Vec<u32> = self.set.unmapped(pool).collect();
        for c in candidates {
            let mut c = c;
            let prev = self.set.block(c).prev;
            if prev != NIL && self.set.block(prev).state == State::Free {
                c = prev;
            }
            let mut bytes = 0;
            let mut b = c;
            while bytes < size && self.allocatable(b) {
                bytes += self.set.block(b).size;
                b = self.set.block(b).next;
            }
            if bytes >= size {
                return Ok(c);
            }
        }
        let page = match pool {
            Pool::Small => SMALL_BUFFER,
            Pool::Large => LARGE_BUFFER,
        };
        // (Saturating: a device total near u64::MAX then fails at the reservation below.)
        let pages = (self.device_total.saturating_add(self.device_total / 8)).div_ceil(page);
        let base = d.address_reserve(pages.saturating_mul(page), self.stream, pool)?;
        self.segs.push(ExpSegment {
            base,
            page,
            pool,
            handles: vec![None; pages as usize],
        });
        Ok(self
            .set
            .add_segment(base, pages * page, pool, State::Unmapped))
    }

    /// Maps the pages covering the first `size` bytes of unmapped block `id`; the mapped part
    /// becomes a free block merged with its free neighbours. Returns it, or `None` when the
    /// device had no memory.
    fn map_block(
        &mut self,
        id: u32,
        size: u64,
        d: &mut DeviceState,
    ) -> Result<Option<u32>, BackendError> {
        let (addr, bsize) = {
            let b = self.set.block(id);
            (b.addr, b.size)
        };
        let si = self.seg_of(addr);
        let (base, page, pool) = (self.segs[si].base, self.segs[si].page, self.segs[si].pool);
        let begin = (addr - base) / page;
        let end = (addr + size - base).div_ceil(page);
        let mut made = Vec::new();
        let mut mapped_pages = 0;
        let outcome = (|| {
            for _ in begin..end {
                made.push(d.create_chunk(page, pool)?);
            }
            for (i, &h) in (begin..end).zip(&made) {
                d.map(base + i * page, page, h)?;
                mapped_pages += 1;
            }
            d.set_access(base + begin * page, (end - begin) * page, end - begin)
        })();
        if let Err(e) = outcome {
            // Nothing of this request stays: what was mapped is unmapped and every chunk made
            // is released (best effort: a chunk the driver will not take back stays counted as
            // held, rather than being reused in an unknown state).
            let unmapped = mapped_pages == 0
                || d.unmap(base + begin * page, mapped_pages * page, mapped_pages)
                    .is_ok();
            if unmapped {
                for h in made {
                    let _ = d.release_chunk(h, page, pool);
                }
            }
            return if e.out_of_memory { Ok(None) } else { Err(e) };
        }
        for (i, h) in (begin..end).zip(made) {
            self.segs[si].handles[i as usize] = Some(h);
        }
        let mapped = (end - begin) * page;
        self.set.detach(id);
        if mapped < bsize {
            // The rest stays unmapped, after the newly mapped part.
            self.set.split_off(id, mapped);
        }
        self.set.set_detached_state(id, State::Free);
        Ok(Some(self.set.attach_coalesced(id)))
    }

    fn try_allocate_expandable(
        &mut self,
        pool: Pool,
        size: u64,
        dev: &Device,
    ) -> Result<Option<u32>, BackendError> {
        let mut d = dev.lock();
        let mut cand = self.find_expandable_block(pool, size, &mut d)?;
        if self.set.block(cand).state == State::Unmapped {
            let want = size.min(self.set.block(cand).size);
            match self.map_block(cand, want, &mut d)? {
                Some(c) => cand = c,
                None => return Ok(None),
            }
        }
        while self.set.block(cand).size < size {
            let remaining = size - self.set.block(cand).size;
            let next = self.set.block(cand).next;
            let want = remaining.min(self.set.block(next).size);
            match self.map_block(next, want, &mut d)? {
                Some(c) => cand = c,
                None => return Ok(None),
            }
        }
        Ok(Some(cand))
    }

    /// Unmaps the whole pages inside free block `id`.
    fn unmap_block(&mut self, id: u32, d: &mut DeviceState) -> Result<u64, BackendError> {
        let (addr, size) = {
            let b = self.set.block(id);
            (b.addr, b.size)
        };
        let si = self.seg_of(addr);
        let (base, page, pool) = (self.segs[si].base, self.segs[si].page, self.segs[si].pool);
        let begin = (addr - base).div_ceil(page);
        let end = (addr + size - base) / page;
        if begin >= end {
            return Ok(0);
        }
        // cuMemUnmap does not wait for the stream: PyTorch synchronizes it first.
        let ev = d.event_record(self.stream)?;
        d.event_synchronize(ev)?;
        d.event_destroy(ev);
        for i in begin..end {
            let h = self.segs[si].handles[i as usize]
                .take()
                .expect("mapped page has a handle");
            d.unmap(base + i * page, page, 1)?;
            d.release_chunk(h, page, pool)?;
        }
        let un_start = base + begin * page;
        let un_size = (end - begin) * page;
        self.set.detach(id);
        let mut mid = id;
        if un_start > addr {
            // The free head keeps `id`; the unmapped middle is split off it.
            mid = self.set.split_off(id, un_start - addr);
            self.set.attach(id);
            self.set.detach(mid);
        }
        if self.set.block(mid).size > un_size {
            self.set.split_off(mid, un_size);
        }
        self.set.set_detached_state(mid, State::Unmapped);
        let merged = self.set.attach_coalesced(mid);
        let b = self.set.block(merged);
        if !b.is_split() {
            // The whole segment is unmapped: give the address space back.
            let (va, len, _) = self.set.remove_segment(merged);
            d.address_free(va, len)?;
            self.segs.remove(si);
        }
        Ok(un_size)
    }

    /// Frees allocated block `id` used on no other stream (merged at once: the simulation of
    /// PyTorch has no quick cache); returns its size.
    fn free_block(&mut self, id: u32, _dev: &Device) -> u64 {
        let size = self.set.block(id).size;
        self.set.free_now(id);
        size
    }
}

impl Policy for Expandable {
    block_set_queries!();

    fn name(&self) -> &'static str {
        "expandable"
    }

    fn allocate(&mut self, size: u64, dev: &Device) -> Result<Placement, BackendError> {
        let rounded = round_size(size);
        let pool = Pool::of(rounded);
        let id = match self.get_free_block(pool, rounded) {
            Some(id) => id,
            None => match self.try_allocate_expandable(pool, rounded, dev)? {
                Some(id) => id,
                None => {
                    return Err(BackendError::oom(
                        crate::backend::DriverCall::MemCreate,
                        "no physical memory to grow the expandable segment",
                    ))
                }
            },
        };
        let split = self.set.block(id).size - rounded >= MIN_BLOCK;
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

    fn release_cached(&mut self, dev: &Device) -> Result<u64, BackendError> {
        let mut d = dev.lock();
        let mut freed = 0;
        for pool in [Pool::Large, Pool::Small] {
            let free: Vec<u64> = self
                .set
                .free_blocks(pool)
                .map(|id| self.set.block(id).addr)
                .collect();
            for addr in free {
                // Earlier unmaps may have merged blocks: look the block up again.
                let id = self
                    .set
                    .free_blocks(pool)
                    .find(|&id| self.set.block(id).addr == addr);
                if let Some(id) = id {
                    freed += self.unmap_block(id, &mut d)?;
                }
            }
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
