//! Snapshots in PyTorch's format (not built yet).

use crate::engine::Allocator;

/// A `torch.cuda.memory._snapshot()`-shaped pickle of the allocator's segments and history,
/// readable by PyTorch's memory visualizer and `torch.cuda._memory_viz`.
pub fn snapshot_pickle(_alloc: &Allocator) -> Result<Vec<u8>, String> {
    Err("snapshots are not built yet".into())
}
