//! Loading the CUDA driver at run time and talking to it safely.
//!
//! cudarc loads `libcuda` lazily and panics when the library or one of its symbols is missing,
//! so nothing here calls into the driver before [`load`] has checked that the library opens and
//! exports every function gpumem uses. After that, each call's `CUresult` becomes a
//! [`BackendError`] that names the error (`CUDA_ERROR_OUT_OF_MEMORY` becomes an out-of-memory
//! error the engine retries on).

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaContext;
use gpumem_core::backend::DriverCall;
use gpumem_core::BackendError;
use std::ffi::CStr;
use std::sync::OnceLock;

/// Every driver function gpumem calls, by the symbol cudarc loads for it. Checked once, so a
/// driver too old to have one of them gives an error instead of cudarc's panic.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAllocationGranularity",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuMemsetD8Async",
    "cuMemsetD32Async",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolSetAttribute",
    "cuMemPoolTrimTo",
    "cuThreadExchangeStreamCaptureMode",
    "cuStreamIsCapturing",
];

/// Checks once that the driver library can be loaded, exports every function gpumem uses, and
/// initialises (`cuInit`). Every entry point calls this before its first driver call.
pub fn load() -> Result<(), BackendError> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // cudarc's loader panics where it cannot find a library or symbol; the checks below
            // avoid that, and the catch is a last guard so that nothing unwinds out of gpumem.
            std::panic::catch_unwind(probe_and_init)
                .unwrap_or_else(|_| Err("loading the CUDA driver panicked".to_string()))
        })
        .clone()
        .map_err(|m| BackendError::new(DriverCall::MemGetInfo, m))
}

fn probe_and_init() -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names (running the
    // library's initialisers, as any use of the driver would).
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "no CUDA driver was found: libcuda.so could not be loaded (is the NVIDIA driver \
             installed, and is this a machine with a GPU?)"
                .to_string(),
        );
    }
    // SAFETY: the library opens (checked just above), so `culib` returns it instead of
    // panicking; `get` only looks a symbol up, and the type it is read as is never called.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = SYMBOLS
        .iter()
        .copied()
        // SAFETY: as above: a lookup, nothing is called through the pointer.
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "the CUDA driver is too old: it lacks {} (gpumem needs a driver for CUDA 12 or later)",
            missing.join(", ")
        ));
    }
    // SAFETY: cuInit takes flags only (0 is the one valid value); every symbol is present.
    let r = unsafe { sys::cuInit(0) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(format!(
            "the CUDA driver was found but cuInit failed: {}",
            describe(r)
        ));
    }
    Ok(())
}

/// `NAME: description` of a driver result.
pub fn describe(r: CUresult) -> String {
    if load().is_err() {
        return format!("{r:?}"); // no driver to ask for the text (and cudarc would panic)
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls write a pointer to a static string owned by the driver (or fail and
    // leave the pointer null, which is checked before reading).
    unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
    }
    let read = |p: *const std::ffi::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: non-null pointers from cuGetError* point to NUL-terminated static strings.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (read(name), read(text)) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        (Some(n), None) => n,
        _ => format!("CUresult {}", r as i32),
    }
}

/// Turns a driver result into a [`BackendError`] for `call` (out-of-memory is marked so).
#[inline]
pub fn check(call: DriverCall, r: CUresult) -> Result<(), BackendError> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(BackendError::oom(call, describe(r))),
        _ => Err(BackendError::new(call, describe(r))),
    }
}

/// Like [`check`], for calls that have no [`DriverCall`] kind of their own: the message names
/// the function.
#[inline]
pub fn check_named(name: &str, r: CUresult) -> Result<(), BackendError> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(BackendError::oom(
            DriverCall::MemAlloc,
            format!("{name}: {}", describe(r)),
        )),
        _ => Err(BackendError::new(
            DriverCall::MemGetInfo,
            format!("{name} failed: {}", describe(r)),
        )),
    }
}

/// Number of CUDA devices.
pub fn device_count() -> Result<u32, BackendError> {
    load()?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: the driver is loaded and initialised; `n` is a valid place for the count.
    check_named("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n.max(0) as u32)
}

/// Makes `ctx` current on the calling thread unless it already is. PyTorch calls allocators
/// from threads that have no current context (autograd's worker thread), where every driver
/// call would fail with CUDA_ERROR_INVALID_CONTEXT.
#[inline]
pub fn bind(ctx: &CudaContext) -> Result<(), BackendError> {
    // The scoped binding, with nothing put back when it ends.
    std::mem::forget(bind_scoped(ctx)?);
    Ok(())
}

/// A context made current for the length of one call, and the caller's context put back when
/// it ends (see [`bind_scoped`]).
#[must_use = "the caller's context is put back when the guard drops"]
pub struct ScopedContext {
    /// The context current before, if it had to be changed.
    previous: Option<sys::CUcontext>,
}

impl Drop for ScopedContext {
    fn drop(&mut self) {
        if let Some(prev) = self.previous {
            // SAFETY: `prev` was the calling thread's current context (or null, none) when the
            // guard was made on this thread (the guard is neither Send nor Sync: it holds a raw
            // pointer), and a context current on a thread stays alive while it is current. A
            // failure leaves gpumem's context current, which is what `bind` did before; there
            // is nowhere to report it from a drop.
            let _ = unsafe { sys::cuCtxSetCurrent(prev) };
        }
    }
}

/// [`bind`] for one call: makes `ctx` current and puts the caller's own context back when the
/// guard drops (a thread that had none keeps `ctx`). A free reached from PyTorch on a thread
/// whose current device is another GPU must not leave that thread on gpumem's device: the
/// CUDA runtime takes the current context as the current device.
#[inline]
pub fn bind_scoped(ctx: &CudaContext) -> Result<ScopedContext, BackendError> {
    let want = ctx.cu_ctx();
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a context exists, so the driver is loaded; `cur` is a valid place for the result.
    check_named("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
    if cur == want {
        return Ok(ScopedContext { previous: None });
    }
    // SAFETY: `want` is the context `ctx` owns (retained for as long as `ctx` lives).
    check_named("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(want) })?;
    // A thread that had no context keeps the device's (as `bind` leaves it): PyTorch's worker
    // threads then find it current at their next call, and nothing of theirs is displaced.
    Ok(ScopedContext {
        previous: (!cur.is_null()).then_some(cur),
    })
}

/// The calling thread in the relaxed stream-capture mode for the length of one call, the
/// thread's own mode put back when the guard drops. While a CUDA graph is captured in the
/// global mode (PyTorch's default), the driver refuses calls that may synchronize (cuMemAlloc,
/// cuMemFree, event waits...) from every thread and invalidates the capture; PyTorch's own
/// allocator makes its cudaMalloc in the relaxed mode for that reason.
#[must_use = "the thread's capture mode is put back when the guard drops"]
pub struct RelaxedCapture {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCapture {
    /// Switches the calling thread to the relaxed mode.
    pub fn enter() -> Result<Self, BackendError> {
        load()?;
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid place, read (the new mode) and written (the old one) by the
        // driver; the call touches only the calling thread's state.
        check_named("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        Ok(Self { previous: mode })
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; a failure leaves the thread relaxed, which refuses nothing,
        // and there is nowhere to report it from a drop.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

/// (free, total) bytes of the current context's device.
pub fn mem_get_info() -> Result<(u64, u64), BackendError> {
    load()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both pointers are valid places for the results; a context is current (callers
    // bind first).
    check(DriverCall::MemGetInfo, unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// Waits for all work of the current context.
pub fn ctx_synchronize() -> Result<(), BackendError> {
    load()?;
    // SAFETY: no arguments; a context is current (callers bind first).
    check_named("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// A raw stream handle as the `CUstream` the driver takes.
#[inline]
pub fn cu_stream(s: u64) -> sys::CUstream {
    s as usize as sys::CUstream
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver the public helpers return the error (cudarc's lazily loaded symbols
    /// would panic if they were called).
    #[test]
    fn helpers_without_a_driver_return_errors() {
        // SAFETY: only tries to dlopen libcuda.
        if unsafe { sys::is_culib_present() } {
            eprintln!("not run: a driver is present (the GPU tests cover this machine)");
            return;
        }
        assert!(mem_get_info().is_err());
        assert!(ctx_synchronize().is_err());
        let e = check(DriverCall::MemAlloc, CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert!(e.to_string().contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
    }
}
