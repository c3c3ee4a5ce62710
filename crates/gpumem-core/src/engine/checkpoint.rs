//! Checkpoints of a private pool's blocks, for PyTorch's CUDA graph trees
//! (`torch.compile(mode="reduce-overhead")`).
//!
//! A graph tree records several graphs into one pool. While a recorded graph replays, the
//! tensors it creates live in the pool's memory without the allocator hearing of them. So
//! before recording a new graph after replays, PyTorch sets the pool back to the checkpoint
//! taken after the recording whose outputs are live: every block allocated in the pool now is
//! freed, and the blocks allocated at the checkpoint are handed out again at their addresses.
//! PyTorch then gives the live tensors those blocks (with the allocator's deleter) and
//! releases the rest (c10's `getCheckpointState`, `setCheckpointPoolState`).

use super::pools::PoolId;
use super::track::Action;
use super::{AllocError, Allocation, Allocator};
use crate::backend::DevPtr;
use crate::policy::{BlockInfo, BlockKind, SegmentInfo};

/// A block handed out when the checkpoint was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointBlock {
    /// Address.
    pub addr: DevPtr,
    /// Bytes of the block (the request rounded up).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
}

/// A private pool's segments and the blocks handed out from them, at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCheckpoint {
    /// The pool.
    pub id: PoolId,
    /// Its segments then: (address, bytes).
    pub segments: Vec<(DevPtr, u64)>,
    /// Its blocks handed out then, by address.
    pub blocks: Vec<CheckpointBlock>,
}

/// What setting a pool back to a checkpoint changed (c10's `CheckpointDelta`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolRestore {
    /// Blocks that were allocated and are now free: whoever holds them must not free them.
    pub freed: Vec<DevPtr>,
    /// The checkpoint's blocks, allocated again at their addresses, to be freed as usual.
    pub allocated: Vec<Allocation>,
}

impl Allocator {
    /// The blocks of private pool `id` now (PyTorch's `getCheckpointState`). Blocks freed but
    /// still waiting for other streams' work count as free, as in PyTorch.
    pub fn checkpoint_pool(&self, id: PoolId) -> Result<PoolCheckpoint, AllocError> {
        let pools = self.pools.lock();
        let key = pools.key_of(id).ok_or_else(|| no_pool(id))?;
        let segments = match self.shards.get(key) {
            Some((_, sh)) => sh.state.lock().policy.segments(),
            None => Vec::new(),
        };
        drop(pools);
        let blocks = allocated_blocks(&segments)
            .map(|b| CheckpointBlock {
                addr: b.addr,
                size: b.size,
                requested: b.requested,
            })
            .collect();
        Ok(PoolCheckpoint {
            id,
            segments: segments.iter().map(|s| (s.addr, s.size)).collect(),
            blocks,
        })
    }

    /// Sets private pool `cp.id` back to checkpoint `cp` (PyTorch's `setCheckpointPoolState`):
    /// frees every block allocated in it now and allocates the checkpoint's blocks again at
    /// their addresses. Returns both lists.
    ///
    /// Refused, with nothing changed, while a capture fills the pool, when a segment of the
    /// checkpoint is no longer the pool's, when its blocks overlap or lie outside its segments,
    /// or when a block allocated now was used on another stream (`record_stream`: its free
    /// would have to wait for that stream). Blocks freed earlier that still wait for other
    /// streams are waited for on the host first.
    pub fn restore_pool(&self, cp: &PoolCheckpoint) -> Result<PoolRestore, AllocError> {
        let pools = self.pools.lock();
        let key = pools.key_of(cp.id).ok_or_else(|| no_pool(cp.id))?;
        if pools.is_filling(cp.id) {
            return Err(refused(cp.id, "a capture is filling it"));
        }
        let stream = pools.of_key(key).and_then(|(_, s)| s).unwrap_or(key);
        let (idx, sh) = self.pool_shard(key)?;
        let mut st = sh.state.lock();
        let now = st.policy.segments();
        for &(addr, size) in &cp.segments {
            if !now.iter().any(|s| s.addr == addr && s.size == size) {
                return Err(refused(
                    cp.id,
                    &format!("its segment of {size} bytes at {addr:#x} is gone"),
                ));
            }
        }
        check_blocks(cp)?;
        let live: Vec<DevPtr> = allocated_blocks(&now).map(|b| b.addr).collect();
        if let Some(p) = live.iter().find(|p| st.uses.contains_key(p)) {
            return Err(refused(
                cp.id,
                &format!("its block at {p:#x} was used on another stream (record_stream)"),
            ));
        }
        // Blocks freed after use on other streams: waited for (their segments must be whole).
        if !st.pending.is_empty() {
            self.poll_events(&mut st, key, true)?;
            if !st.pending.is_empty() {
                return Err(refused(
                    cp.id,
                    "blocks freed in it wait for other streams while another capture is underway",
                ));
            }
        }
        // Every segment is now one free block once its live blocks are freed (none waits for
        // another stream), so the checkpoint's blocks, which tile within its segments, all fit.
        for &p in &live {
            if st.policy.free(p, &self.device)?.is_none() {
                return Err(AllocError::Pool(format!(
                    "internal error: the block at {p:#x} of private pool ({}, {}) vanished",
                    cp.id.0, cp.id.1
                )));
            }
            if self.tracker.is_some() {
                self.track(Action::FreeRequested, p, 0, key);
                self.track(Action::FreeCompleted, p, 0, key);
            }
        }
        let mut allocated = Vec::with_capacity(cp.blocks.len());
        for b in &cp.blocks {
            let p = st
                .policy
                .allocate_at(b.addr, b.size, b.requested)
                .map_err(|e| refused(cp.id, &e))?;
            st.owners.insert(p.addr, stream);
            allocated.push(self.handed_out(p, b.requested, stream, idx));
        }
        Ok(PoolRestore {
            freed: live,
            allocated,
        })
    }
}

/// A checkpoint's blocks must lie inside its segments without overlapping one another (its
/// fields are public, so one may have been built by hand): checked before anything changes.
fn check_blocks(cp: &PoolCheckpoint) -> Result<(), AllocError> {
    let mut blocks: Vec<&CheckpointBlock> = cp.blocks.iter().collect();
    blocks.sort_unstable_by_key(|b| b.addr);
    let mut end = 0;
    for b in blocks {
        let inside = cp
            .segments
            .iter()
            .any(|&(s, len)| s <= b.addr && b.addr.saturating_add(b.size) <= s + len);
        if b.size == 0 || b.addr < end || !inside {
            return Err(refused(
                cp.id,
                &format!(
                    "its block of {} bytes at {:#x} overlaps another or lies outside its segments",
                    b.size, b.addr
                ),
            ));
        }
        end = b.addr + b.size;
    }
    Ok(())
}

/// The blocks handed out (not free, not pending) of `segments`.
fn allocated_blocks(segments: &[SegmentInfo]) -> impl Iterator<Item = &BlockInfo> {
    segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.kind == BlockKind::Allocated)
}

fn no_pool(id: PoolId) -> AllocError {
    AllocError::Pool(format!("no private pool ({}, {})", id.0, id.1))
}

fn refused(id: PoolId, why: &str) -> AllocError {
    AllocError::Pool(format!(
        "private pool ({}, {}) cannot be set back to its checkpoint: {why}",
        id.0, id.1
    ))
}
