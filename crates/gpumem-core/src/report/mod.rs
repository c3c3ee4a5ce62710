//! Human-readable reports: the replay comparison table.

pub mod replay_table;
