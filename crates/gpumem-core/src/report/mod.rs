//! Human-readable and machine-readable reports: the replay comparison table
//! ([`replay_table`]), timeline plots ([`plot`]), memory summaries ([`summary`]), snapshots in
//! PyTorch's format ([`snapshot`], written with [`pickle_writer`]), leak reports ([`leaks`],
//! with call sites from [`frames`]).

pub mod frames;
pub mod leaks;
pub mod pickle_writer;
pub mod plot;
pub mod replay_table;
pub mod snapshot;
pub mod summary;
