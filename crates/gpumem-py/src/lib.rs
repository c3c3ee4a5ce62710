//! # gpumem for Python and PyTorch
//!
//! One shared library, imported by Python as `gpumem._native` and loaded by PyTorch's
//! `CUDAPluggableAllocator` from the same file, so that both see the same allocators:
//!
//! - [`torch_abi`]: the C functions PyTorch calls (allocate, free, record-stream, empty-cache,
//!   memory fraction), with the C++ shim that turns failures into the exceptions PyTorch needs.
//! - [`registry`]: one allocator per device, created on first use; misuse counters.
//! - [`stats`]: statistics in `torch.cuda.memory_stats()`'s shape (and as JSON).
//! - [`diagnostics`]: gpumem-core's summaries, snapshots and leak reports as the package
//!   serves them (Python callers in leak reports, the leak check at interpreter exit).
//! - `py` (feature `python`): the Python module: `gpumem._native.Allocator` (a gpumem
//!   allocator usable without PyTorch, over a CUDA device or the simulated one) and the
//!   functions behind `gpumem.torch`.

pub mod diagnostics;
pub mod registry;
pub mod stats;
pub mod torch_abi;

#[cfg(feature = "python")]
mod py;
