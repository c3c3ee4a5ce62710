//! gpumem on a real GPU: the engine's [`Backend`] over the CUDA driver API, a Rust allocator
//! API on top of it, the replay of allocation traces on the device, and the allocation
//! benchmark.
//!
//! The driver is loaded at run time (cudarc's `dynamic-loading`): this crate builds with no
//! CUDA toolkit, and on a machine without a driver every entry point returns an error that
//! says so; nothing panics.
//!
//! ```no_run
//! use gpumem_cuda::CudaAllocator;
//! use gpumem_core::Config;
//!
//! let gpu = CudaAllocator::new(0, Config::parse("policy:stitched").unwrap()).unwrap();
//! let stream = gpu.context().new_stream().unwrap();
//! let buf = gpu.alloc(64 << 20, &stream).unwrap(); // 64 MiB, freed when `buf` drops
//! println!("{:#x}, {} bytes", buf.ptr(), buf.len_bytes());
//! ```
//!
//! - [`backend::CudaBackend`]: one device's driver calls (segments, virtual-memory pages,
//!   events), on its primary context, made current on whichever thread calls.
//! - [`CudaAllocator`], [`CudaDevices`], [`DeviceBuffer`]: the Rust API.
//! - [`replay`]: `gpumem replay TRACE --device cuda`.
//! - [`bench`](mod@bench): `gpumem bench alloc`.

pub mod allocator;
pub mod backend;
pub mod bench;
pub mod driver;
pub mod replay;

pub use allocator::{CudaAllocator, CudaDevices, DeviceBuffer, Plain};
pub use backend::{CudaBackend, PhysicalProbe};

use gpumem_core::backend::{Backend, DriverCall};
use gpumem_core::BackendError;

/// Number of CUDA devices, or an error saying why there are none (no driver, no GPU).
pub fn device_count() -> Result<u32, BackendError> {
    driver::device_count()
}

/// The backend of device `ordinal` (primary context, loaded at run time).
pub fn open_backend(ordinal: u32) -> Result<Box<dyn Backend>, BackendError> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(BackendError::new(
            DriverCall::MemGetInfo,
            format!("there is no CUDA device {ordinal}: this machine has {n}"),
        ));
    }
    Ok(Box::new(CudaBackend::open(ordinal)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_core::Config;

    /// Where there is no driver (CI, the development machine), every entry point reports it as
    /// an error, and nothing panics. Where there is one, none of them claims there is not.
    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // SAFETY: only tries to dlopen libcuda.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            if let Err(e) = device_count() {
                assert!(!e.message.contains("no CUDA driver was found"), "{e}");
            }
            return;
        }
        let e = device_count().unwrap_err();
        assert!(e.message.contains("no CUDA driver was found"), "{e}");
        let e = open_backend(0).err().expect("no backend without a driver");
        assert!(e.message.contains("no CUDA driver was found"), "{e}");
        let e = CudaAllocator::new(0, Config::default()).unwrap_err();
        assert!(e.to_string().contains("no CUDA driver was found"), "{e}");
        let e = CudaDevices::open(&Config::default()).unwrap_err();
        assert!(e.to_string().contains("no CUDA driver was found"), "{e}");
    }
}
