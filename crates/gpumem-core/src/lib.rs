//! # gpumem-core
//!
//! The allocator engine of gpumem, with no CUDA dependency: placement [`policy`]s, the
//! [`engine`] that serves allocations per stream, PyTorch-named [`stats`], the [`backend`]
//! trait with its simulated device, allocation [`trace`] readers and the [`replay`] that runs a
//! trace through any policy.
//!
//! ```
//! use gpumem_core::{backend::sim::{SimBackend, SimConfig}, Allocator, Config};
//! let (sim, _) = SimBackend::new(SimConfig::default());
//! let alloc = Allocator::new(Box::new(sim), Config::parse("policy:stitched").unwrap()).unwrap();
//! let a = alloc.allocate(3 << 20, 0).unwrap();
//! assert_eq!(alloc.memory_stats().allocated_bytes.all.current, 3 << 20);
//! alloc.free(a.ptr).unwrap();
//! ```
#![warn(missing_docs)]

pub mod backend;
pub mod bench_ops;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod policy;
pub mod stats;
pub mod testing;
pub mod units;

pub use config::Config;
pub use engine::{Allocation, Allocator, CheckpointBlock, PoolCheckpoint, PoolRestore};
pub use error::{AllocError, BackendError, OomReport, TraceError};
pub use policy::PolicyKind;
pub use stats::MemoryStats;
pub mod reference;
pub mod replay;
pub mod report;
pub mod trace;
