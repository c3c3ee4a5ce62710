//! Statistics in the exact shape of `torch.cuda.memory_stats()`.

use gpumem_core::MemoryStats;
use std::collections::BTreeMap;

/// `torch.cuda.memory_stats()`'s flat dictionary for `stats` (PyTorch 2.11's key set): the
/// core statistics of [`MemoryStats::to_flat`] plus `oversize_allocations` and
/// `oversize_segments`, which count blocks larger than `max_split_size`. gpumem never refuses
/// to split a block (`max_split_size` is -1, PyTorch's default), so they are always zero.
pub fn torch_flat_stats(stats: &MemoryStats) -> BTreeMap<String, i64> {
    let mut m = stats.to_flat();
    for field in ["current", "peak", "allocated", "freed"] {
        m.insert(format!("oversize_allocations.{field}"), 0);
        m.insert(format!("oversize_segments.{field}"), 0);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn has_every_key_of_torch() {
        let m = torch_flat_stats(&MemoryStats::default());
        // 9 statistics x 3 pools x 4 fields, 2 oversize statistics x 4 fields, 6 scalars.
        assert_eq!(m.len(), 108 + 8 + 6);
        for k in [
            "allocation.all.current",
            "requested_bytes.large_pool.freed",
            "oversize_segments.peak",
            "max_split_size",
            "num_sync_all_streams",
        ] {
            assert!(m.contains_key(k), "{k}");
        }
        assert_eq!(m["max_split_size"], -1);
    }
}
