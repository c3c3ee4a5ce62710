//! gpumem on a real GPU: the CUDA backend (issue 4). Work in progress.
//!
//! The two entry points below are what the Python package and the CLI call; their signatures
//! are fixed, their bodies are being written.

pub mod replay;

use gpumem_core::backend::{Backend, DriverCall};
use gpumem_core::BackendError;

/// Number of CUDA devices, or an error saying why there are none (no driver, no GPU).
pub fn device_count() -> Result<u32, BackendError> {
    Err(BackendError::new(
        DriverCall::MemGetInfo,
        "the CUDA backend is not built yet",
    ))
}

/// The backend of device `ordinal` (primary context, loaded at run time).
pub fn open_backend(_ordinal: u32) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::new(
        DriverCall::MemGetInfo,
        "the CUDA backend is not built yet",
    ))
}
