//! Human-readable reports: the replay comparison table, timeline plots.

pub mod plot;
pub mod replay_table;
