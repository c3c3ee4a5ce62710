//! Private pools: memory set aside for one user, that no other allocation may take while the
//! pool is in use. CUDA graphs need them (PyTorch's graph pools, `torch.cuda.graph`): a graph
//! replays the addresses it was captured with, so the blocks it used, freed or not, must stay
//! its own until the graph is destroyed.
//!
//! A pool is a shard of its own in the engine's stream table, under a key no stream handle can
//! have, always with the caching policy over plain segments: a graph's memory must keep its
//! physical pages for as long as the graph lives, which rules out the stitched policy's
//! trading of pages between streams. This module keeps the bookkeeping: which pools exist,
//! who uses each (graphs sharing one), and which are being filled now (a capture underway).

use crate::backend::Stream;
use rustc_hash::FxHashMap;

/// A private pool's id, as PyTorch names it (`MempoolId_t`): a pair, of which a graph's own
/// pool sets the first value and `graph_pool_handle()` the second. (0, 0) names no pool.
pub type PoolId = (u64, u64);

/// Private pools' shards live in the stream table under keys from here up. Stream handles are
/// user-space pointers (below 2^48) or small constants (0, 1, 2), never this high; `u64::MAX`
/// stays reserved.
pub const POOL_KEY_BASE: Stream = 1 << 63;

/// Whether a stream-table key is a private pool's.
#[inline]
pub fn is_pool_key(key: Stream) -> bool {
    key >= POOL_KEY_BASE && key != u64::MAX
}

/// One pool's bookkeeping.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Its shard's key in the stream table.
    key: Stream,
    /// Users holding it (graphs captured into it, and the capture underway): while any is
    /// left, its cached memory is never released.
    users: u32,
    /// Whether a capture is filling it now.
    filling: bool,
    /// The first stream that allocated in it (a capture's stream), which snapshots show.
    stream: Option<Stream>,
}

/// The private pools of one allocator.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    by_id: FxHashMap<PoolId, Entry>,
    /// Keys of retired pools (their shard holds nothing), given to the next new pool, so that a
    /// program making and dropping graphs does not fill the stream table.
    spare: Vec<Stream>,
    /// Keys handed out so far.
    made: u64,
}

impl Pools {
    /// A capture starts filling pool `id`: made on first use, one more user. Returns its key.
    /// Refused for the null id and for a pool another capture is filling now (as PyTorch
    /// refuses it).
    pub fn begin(&mut self, id: PoolId) -> Result<Stream, String> {
        let e = self.entry(id)?;
        if e.filling {
            return Err(format!(
                "private pool ({}, {}) is already being filled by another capture",
                id.0, id.1
            ));
        }
        e.filling = true;
        e.users += 1;
        Ok(e.key)
    }

    /// A user takes pool `id` without filling it (PyTorch's `createOrIncrefPool`, made by a
    /// `torch.cuda.MemPool`): made on first use, one more user. Returns its key.
    pub fn retain(&mut self, id: PoolId) -> Result<Stream, String> {
        let e = self.entry(id)?;
        e.users += 1;
        Ok(e.key)
    }

    /// Pool `id`, made (with no user) if it does not exist; refused for the null id.
    fn entry(&mut self, id: PoolId) -> Result<&mut Entry, String> {
        if id == (0, 0) {
            return Err("pool id (0, 0) names no pool".into());
        }
        let (spare, made) = (&mut self.spare, &mut self.made);
        Ok(self.by_id.entry(id).or_insert_with(|| Entry {
            key: spare.pop().unwrap_or_else(|| {
                *made += 1;
                POOL_KEY_BASE + *made
            }),
            users: 0,
            filling: false,
            stream: None,
        }))
    }

    /// The capture filling pool `id` ended: allocations no longer go to it (its user stays
    /// until [`Pools::release`]).
    pub fn end(&mut self, id: PoolId) -> Result<(), String> {
        match self.by_id.get_mut(&id) {
            Some(e) if e.filling => {
                e.filling = false;
                Ok(())
            }
            Some(_) => Err(format!(
                "private pool ({}, {}) is not being filled by a capture",
                id.0, id.1
            )),
            None => Err(unknown(id)),
        }
    }

    /// A user of pool `id` is gone (its graph was destroyed). Returns the pool's key and
    /// whether users remain.
    pub fn release(&mut self, id: PoolId) -> Result<(Stream, bool), String> {
        match self.by_id.get_mut(&id) {
            Some(e) if e.users > 0 => {
                e.users -= 1;
                Ok((e.key, e.users > 0))
            }
            Some(_) => Err(format!(
                "private pool ({}, {}) has no user left",
                id.0, id.1
            )),
            None => Err(unknown(id)),
        }
    }

    /// The shard key of pool `id` while a capture fills it, for an allocation on `stream`.
    #[inline]
    pub fn filling_key(&mut self, id: PoolId, stream: Stream) -> Option<Stream> {
        let e = self.by_id.get_mut(&id).filter(|e| e.filling)?;
        e.stream.get_or_insert(stream);
        Some(e.key)
    }

    /// The pool whose shard key is `key`, and the first stream that allocated in it.
    pub fn of_key(&self, key: Stream) -> Option<(PoolId, Option<Stream>)> {
        self.by_id
            .iter()
            .find(|(_, e)| e.key == key)
            .map(|(&id, e)| (id, e.stream))
    }

    /// Users of pool `id` (0 for a pool that does not exist).
    pub fn users(&self, id: PoolId) -> u32 {
        self.by_id.get(&id).map_or(0, |e| e.users)
    }

    /// Pools no one uses: (id, key) of each.
    pub fn unused(&self) -> Vec<(PoolId, Stream)> {
        self.by_id
            .iter()
            .filter(|(_, e)| e.users == 0 && !e.filling)
            .map(|(&id, e)| (id, e.key))
            .collect()
    }

    /// Forgets unused pool `id`, whose shard holds nothing any more; its key goes to the next
    /// new pool.
    pub fn retire(&mut self, id: PoolId) {
        if let Some(e) = self.by_id.remove(&id) {
            self.spare.push(e.key);
        }
    }

    /// Whether a capture is filling pool `id` now.
    pub fn is_filling(&self, id: PoolId) -> bool {
        self.by_id.get(&id).is_some_and(|e| e.filling)
    }

    /// The key of pool `id`, if it exists.
    pub fn key_of(&self, id: PoolId) -> Option<Stream> {
        self.by_id.get(&id).map(|e| e.key)
    }

    /// Every pool: (id, key).
    pub fn keys(&self) -> impl Iterator<Item = (PoolId, Stream)> + '_ {
        self.by_id.iter().map(|(&id, e)| (id, e.key))
    }

    /// Number of pools that exist.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }
}

fn unknown(id: PoolId) -> String {
    format!("no private pool ({}, {})", id.0, id.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_count_users_and_reuse_keys_of_retired_pools() {
        let mut p = Pools::default();
        assert!(p.begin((0, 0)).is_err());
        let a = p.begin((1, 0)).unwrap();
        assert!(is_pool_key(a));
        assert_eq!(p.filling_key((1, 0), 7), Some(a));
        assert_eq!(p.of_key(a), Some(((1, 0), Some(7))));
        assert!(
            p.begin((1, 0)).is_err(),
            "two captures into one pool at once"
        );
        p.end((1, 0)).unwrap();
        assert_eq!(p.filling_key((1, 0), 7), None);
        assert!(p.end((1, 0)).is_err());
        // A second graph shares the pool: two users.
        assert_eq!(p.begin((1, 0)).unwrap(), a);
        p.end((1, 0)).unwrap();
        assert_eq!(p.users((1, 0)), 2);
        assert_eq!(p.release((1, 0)).unwrap(), (a, true));
        assert!(p.unused().is_empty());
        assert_eq!(p.release((1, 0)).unwrap(), (a, false));
        assert!(p.release((1, 0)).is_err());
        assert_eq!(p.unused(), vec![((1, 0), a)]);
        p.retire((1, 0));
        assert_eq!(p.len(), 0);
        assert_eq!(p.begin((0, 7)).unwrap(), a, "the retired key is reused");
        assert_ne!(p.begin((2, 0)).unwrap(), a);
        assert!(p.release((9, 9)).is_err());
        // A MemPool: made and held without a capture, then filled.
        let m = p.retain((0, 9)).unwrap();
        assert_eq!(p.filling_key((0, 9), 3), None);
        assert_eq!(p.begin((0, 9)).unwrap(), m);
        assert_eq!((p.users((0, 9)), p.filling_key((0, 9), 3)), (2, Some(m)));
        assert!(p.retain((0, 0)).is_err());
        assert!(!is_pool_key(0x7f00_1234_5600));
        assert!(!is_pool_key(u64::MAX));
    }
}
