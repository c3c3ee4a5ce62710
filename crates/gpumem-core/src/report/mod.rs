//! Human-readable and machine-readable reports: the replay comparison table, timeline plots,
//! memory summaries, snapshots in PyTorch's format.

pub mod frames;
pub mod leaks;
pub mod pickle_writer;
pub mod plot;
pub mod replay_table;
pub mod snapshot;
pub mod summary;
