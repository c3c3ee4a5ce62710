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

/// The statistics as JSON text: gpumem-core's `{"stats": {...nested...}, "flat": {...}}`
/// (`report::summary::stats_json`), with `flat` holding exactly the keys of
/// [`torch_flat_stats`], as `memory_stats()` returns them.
pub fn stats_json_text(stats: &MemoryStats) -> String {
    let mut v = gpumem_core::report::summary::stats_json(stats);
    v["flat"] = serde_json::json!(torch_flat_stats(stats));
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_nested_stats_and_torchs_flat_keys() {
        let mut s = MemoryStats::default();
        s.allocated_bytes.all.current = 4096;
        s.allocated_bytes.all.peak = 8192;
        s.num_ooms = 2;
        let v: serde_json::Value = serde_json::from_str(&stats_json_text(&s)).unwrap();
        assert_eq!(v["flat"]["allocated_bytes.all.current"], 4096);
        assert_eq!(v["flat"]["allocated_bytes.all.peak"], 8192);
        assert_eq!(v["flat"]["oversize_segments.peak"], 0);
        assert_eq!(
            v["flat"].as_object().unwrap().len(),
            torch_flat_stats(&s).len()
        );
        assert_eq!(v["stats"]["num_ooms"], 2);
        assert_eq!(v["stats"]["allocated_bytes"]["all"]["peak"], 8192);
    }

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
