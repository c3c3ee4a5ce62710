//! `memory_summary`: a text table like `torch.cuda.memory_summary()` (not built yet).

use crate::stats::MemoryStats;

/// The summary table of `stats`, per pool, in the layout of `torch.cuda.memory_summary()`.
pub fn memory_summary(_stats: &MemoryStats) -> String {
    "memory summary is not built yet\n".to_string()
}
