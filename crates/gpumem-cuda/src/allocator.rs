//! The Rust API: [`CudaAllocator`] (gpumem's allocator for one device, shareable across
//! threads), [`CudaDevices`] (one per device present) and [`DeviceBuffer`] (an allocation that
//! frees itself on drop and can be passed to cudarc's copies and kernel launches).

use crate::backend::CudaBackend;
use cudarc::driver::{
    sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop,
};
use gpumem_core::{AllocError, Allocation, Allocator, Config, MemoryStats};
use std::fmt;
use std::io::Write;
use std::sync::{Arc, RwLock};

struct Shared {
    engine: Allocator,
    ctx: Arc<CudaContext>,
    /// Every stream the allocator was given, kept alive for as long as the allocator: the
    /// engine keeps a pool per stream handle and records events on those streams when it frees
    /// blocks used there or empties its cache, so a stream destroyed earlier would be an event
    /// on a dead handle (a crash in the driver), and a new stream that got the same handle
    /// would inherit blocks the dead stream's work may still be writing.
    streams: RwLock<Vec<Arc<CudaStream>>>,
}

/// The handle of CUDA's per-thread default stream (`CU_STREAM_PER_THREAD`): one value naming
/// a different stream on every thread, so a pool keyed by it would hand a block freed on one
/// thread's stream to another thread's, unordered.
const PER_THREAD_STREAM: usize = 0x2;

impl Shared {
    /// Refuses streams the engine cannot key a pool by: another context's, or the per-thread
    /// default stream.
    fn check_stream(&self, stream: &CudaStream) -> Result<(), AllocError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(AllocError::Config(format!(
                "the stream belongs to CUDA device {} (or another context), this allocator \
                 serves device {}'s primary context",
                stream.context().ordinal(),
                self.engine.device_info().ordinal
            )));
        }
        if stream.cu_stream() as usize == PER_THREAD_STREAM {
            return Err(per_thread_stream_error());
        }
        Ok(())
    }

    /// Keeps `stream` alive for the allocator's life (see `streams`).
    fn keep(&self, stream: &Arc<CudaStream>) {
        if self.kept(stream).is_some() {
            return;
        }
        let mut v = self.streams.write().unwrap_or_else(|p| p.into_inner());
        if !v.iter().any(|s| s.cu_stream() == stream.cu_stream()) {
            v.push(stream.clone());
        }
    }

    /// The allocator's own handle on `stream`, if it keeps it.
    fn kept(&self, stream: &CudaStream) -> Option<Arc<CudaStream>> {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|s| s.cu_stream() == stream.cu_stream())
            .cloned()
    }
}

fn per_thread_stream_error() -> AllocError {
    AllocError::Config(
        "the per-thread default stream (CU_STREAM_PER_THREAD) names another stream on every \
         thread: allocate on an explicit stream, or on the default stream"
            .into(),
    )
}

/// gpumem's allocator for one CUDA device (its primary context). Cloning is cheap and clones
/// share the allocator, so one value can be handed to every thread.
#[derive(Clone)]
pub struct CudaAllocator {
    shared: Arc<Shared>,
}

impl fmt::Debug for CudaAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAllocator")
            .field("device", &self.shared.engine.device_info().name)
            .field("ordinal", &self.ordinal())
            .field("policy", &self.shared.engine.policy().name())
            .finish()
    }
}

impl CudaAllocator {
    /// An allocator for device `ordinal` configured by `config` (see [`Config::parse`]).
    pub fn new(ordinal: u32, config: Config) -> Result<Self, AllocError> {
        let count = crate::device_count()?;
        if ordinal >= count {
            return Err(AllocError::Config(format!(
                "there is no CUDA device {ordinal}: this machine has {count}"
            )));
        }
        let backend = CudaBackend::open(ordinal)?;
        let ctx = backend.context().clone();
        let engine = Allocator::new(Box::new(backend), config)?;
        Ok(Self {
            shared: Arc::new(Shared {
                engine,
                ctx,
                streams: RwLock::new(Vec::new()),
            }),
        })
    }

    /// An allocator for device `ordinal` configured by `GPUMEM_CONF`.
    pub fn from_env(ordinal: u32) -> Result<Self, AllocError> {
        Self::new(ordinal, Config::from_env()?)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.shared.engine.device_info().ordinal
    }

    /// The device's primary context as a cudarc context: create streams and load kernels
    /// with it.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The engine itself: statistics, `empty_cache`, snapshots, caps.
    pub fn engine(&self) -> &Allocator {
        &self.shared.engine
    }

    /// Statistics under PyTorch's names.
    pub fn memory_stats(&self) -> MemoryStats {
        self.shared.engine.memory_stats()
    }

    /// Returns cached memory that no live block uses to the device; returns the bytes freed.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        self.shared.engine.empty_cache()
    }

    /// Allocates `bytes` for use on `stream` (a stream of this device's primary context, not
    /// the per-thread default stream). The allocator keeps every stream it is given alive for
    /// as long as it lives, as PyTorch never destroys its streams: it records events on them
    /// when blocks used there are freed and when its cache is emptied.
    pub fn alloc(&self, bytes: u64, stream: &Arc<CudaStream>) -> Result<DeviceBuffer, AllocError> {
        self.shared.check_stream(stream)?;
        self.shared.keep(stream);
        let a = self
            .shared
            .engine
            .allocate(bytes, stream.cu_stream() as usize as u64)?;
        Ok(DeviceBuffer {
            owner: self.clone(),
            a,
            requested: bytes,
            stream: stream.clone(),
        })
    }

    /// Allocates `bytes` for use on `stream` from private pool `pool`, which a CUDA graph
    /// capture is filling ([`Allocator::begin_pool`] through [`CudaAllocator::engine`], called
    /// before the capture begins; [`Allocator::end_pool`] after it ends;
    /// [`Allocator::release_pool`] once the graph is destroyed). The buffer's memory is the
    /// pool's: freed, it is reused only by allocations in that pool, so that the graph keeps
    /// the addresses it replays.
    pub fn alloc_in_pool(
        &self,
        bytes: u64,
        stream: &Arc<CudaStream>,
        pool: gpumem_core::engine::PoolId,
    ) -> Result<DeviceBuffer, AllocError> {
        self.shared.check_stream(stream)?;
        self.shared.keep(stream);
        let a =
            self.shared
                .engine
                .allocate_in_pool(bytes, stream.cu_stream() as usize as u64, pool)?;
        Ok(DeviceBuffer {
            owner: self.clone(),
            a,
            requested: bytes,
            stream: stream.clone(),
        })
    }

    /// Allocates `bytes` on the default stream of the device.
    pub fn alloc_default(&self, bytes: u64) -> Result<DeviceBuffer, AllocError> {
        self.alloc(bytes, &self.shared.ctx.default_stream())
    }

    /// Allocates `bytes` for use on a stream created elsewhere (PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`, for example), given as its raw `CUstream`
    /// value (0: the legacy default stream).
    ///
    /// # Safety
    ///
    /// `stream` must be 0 or a live stream of this device's primary context, and must outlive
    /// the allocator: gpumem records events on it when the buffer is freed and when the cache
    /// is emptied. (The per-thread default stream is refused.)
    pub unsafe fn alloc_on_raw(&self, bytes: u64, stream: u64) -> Result<DeviceBuffer, AllocError> {
        if stream as usize == PER_THREAD_STREAM {
            return Err(per_thread_stream_error());
        }
        // SAFETY: the caller guarantees that `stream` is a live stream of this context that
        // outlives the wrapper (which never destroys it).
        let s = unsafe {
            self.shared
                .ctx
                .wrap_borrowed_stream(stream as usize as sys::CUstream)
        };
        self.alloc(bytes, &s)
    }
}

/// gpumem's allocators for every CUDA device present, one per device.
#[derive(Debug, Clone)]
pub struct CudaDevices {
    devices: Vec<CudaAllocator>,
}

impl CudaDevices {
    /// An allocator for each device, all configured by `config`.
    pub fn open(config: &Config) -> Result<Self, AllocError> {
        let n = crate::device_count()?;
        let devices = (0..n)
            .map(|i| CudaAllocator::new(i, config.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { devices })
    }

    /// An allocator for each device, configured by `GPUMEM_CONF`.
    pub fn from_env() -> Result<Self, AllocError> {
        Self::open(&Config::from_env()?)
    }

    /// The allocator of device `ordinal`.
    pub fn get(&self, ordinal: u32) -> Option<&CudaAllocator> {
        self.devices.get(ordinal as usize)
    }

    /// Every allocator, by ordinal.
    pub fn iter(&self) -> impl Iterator<Item = &CudaAllocator> {
        self.devices.iter()
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Whether there is no device.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// Device memory from a [`CudaAllocator`], returned to it when dropped.
///
/// It works with cudarc: it implements [`DevicePtr`] and [`DevicePtrMut`] for the [`Plain`]
/// element types (its length is its bytes divided by the element's size), so cudarc's copies
/// take it, and `LaunchArgs::arg(&buffer)` passes its address to a kernel. A copy on another
/// stream than the buffer's own first waits for the buffer's stream; it is then marked as used
/// there (like PyTorch's `Tensor.record_stream`) if the allocator keeps that stream (it was
/// allocated on or passed to [`DeviceBuffer::record_stream`] before), and otherwise waited for
/// on the host once queued. A kernel launched on another stream needs an explicit
/// [`DeviceBuffer::record_stream`] and the streams' order (`stream.join`), since cudarc's launch
/// builder does not say which stream it launches on.
pub struct DeviceBuffer {
    owner: CudaAllocator,
    a: Allocation,
    requested: u64,
    stream: Arc<CudaStream>,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.a.ptr))
            .field("bytes", &self.requested)
            .field("block_bytes", &self.a.size)
            .field("stream", &format_args!("{:#x}", self.a.stream))
            .finish()
    }
}

impl DeviceBuffer {
    /// The device address (a `CUdeviceptr`).
    pub fn ptr(&self) -> u64 {
        self.a.ptr
    }

    /// Bytes asked for.
    pub fn len_bytes(&self) -> u64 {
        self.requested
    }

    /// Bytes of the block behind it (the request rounded up by the policy).
    pub fn block_bytes(&self) -> u64 {
        self.a.size
    }

    /// The stream it was allocated on, as a raw `CUstream` value.
    pub fn raw_stream(&self) -> u64 {
        self.a.stream
    }

    /// The stream it was allocated on.
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The allocator it came from.
    pub fn allocator(&self) -> &CudaAllocator {
        &self.owner
    }

    /// Marks the buffer as used on `stream` too: once freed, its memory is reused only after
    /// the work queued on `stream` by then has completed. The stream must be of the buffer's
    /// context (and not the per-thread default stream); the allocator keeps it alive from now
    /// on, as for [`CudaAllocator::alloc`].
    pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<(), AllocError> {
        let shared = &self.owner.shared;
        shared.check_stream(stream)?;
        shared.keep(stream);
        shared
            .engine
            .record_stream(self.a.ptr, stream.cu_stream() as usize as u64)
    }

    /// [`DeviceBuffer::record_stream`] for a stream given as its raw `CUstream` value.
    ///
    /// # Safety
    ///
    /// `stream` must be 0 or a live stream of the buffer's context, and must outlive the
    /// allocator (events are recorded on it when the buffer is freed and when the cache is
    /// emptied).
    pub unsafe fn record_stream_raw(&self, stream: u64) -> Result<(), AllocError> {
        if stream as usize == PER_THREAD_STREAM {
            return Err(per_thread_stream_error());
        }
        self.owner.engine().record_stream(self.a.ptr, stream)
    }

    /// cudarc hands the buffer to work on `stream`. On another stream than its own, that
    /// stream first waits for the work queued on the buffer's stream (cudarc's contract for
    /// `device_ptr`: the use sees earlier writes). Then, if the allocator keeps `stream` alive
    /// (it was allocated on or passed to [`DeviceBuffer::record_stream`]), the buffer is marked
    /// as used there; otherwise the use is waited for on the host when cudarc is done queueing
    /// it (the `SyncOnDrop` returned), since a use recorded on a stream that may be destroyed
    /// before the buffer would be an event on a dead handle at the free.
    fn note_use<'a>(&self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        if stream.cu_stream() == self.stream.cu_stream() {
            return SyncOnDrop::Sync(None);
        }
        let kept = self.owner.shared.kept(stream);
        let outcome = stream
            .join(&self.stream)
            .map_err(|e| AllocError::Config(format!("cannot order the streams: {e}")))
            .and_then(|()| match &kept {
                Some(s) => self.record_stream(s),
                None => Ok(()),
            });
        if let Err(e) = outcome {
            let _ = writeln!(
                std::io::stderr(),
                "gpumem: using {:#x} on another stream: {e}",
                self.a.ptr
            );
        }
        match kept {
            Some(_) => SyncOnDrop::Sync(None),
            None => SyncOnDrop::Sync(Some(stream)),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.owner.engine().free_allocation(&self.a) {
            // Never panic in drop: report on stderr (a failed write is ignored).
            let _ = writeln!(
                std::io::stderr(),
                "gpumem: freeing {:#x} failed: {e}",
                self.a.ptr
            );
        }
    }
}

/// Element types a [`DeviceBuffer`] may be read as through cudarc: plain numbers, for which
/// every bit pattern is a valid value (the buffer holds untyped bytes, so reading it as `bool`
/// or a type with a niche could make an invalid value without `unsafe`). Sealed.
///
/// Bytes read back as numbers compile:
///
/// ```no_run
/// # fn read(s: &std::sync::Arc<cudarc::driver::CudaStream>, b: &gpumem_cuda::DeviceBuffer) {
/// let v: Vec<u8> = s.clone_dtoh(b).unwrap();
/// # }
/// ```
///
/// The same read as `bool` does not:
///
/// ```compile_fail
/// # fn read(s: &std::sync::Arc<cudarc::driver::CudaStream>, b: &gpumem_cuda::DeviceBuffer) {
/// let v: Vec<bool> = s.clone_dtoh(b).unwrap();
/// # }
/// ```
pub trait Plain: cudarc::driver::DeviceRepr + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {}
    )*};
}
plain!(u8, i8, u16, i16, u32, i32, u64, i64, usize, isize, f32, f64);

impl<T: Plain> DeviceSlice<T> for DeviceBuffer {
    fn len(&self) -> usize {
        (self.requested as usize)
            .checked_div(std::mem::size_of::<T>())
            .unwrap_or(0)
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

// Work queued later on the buffer's own stream is ordered after a use on another stream only
// where the use was waited for (a stream the allocator does not keep); otherwise that is the
// caller's (`own.join(&other)`), as for a raw pointer.
impl<T: Plain> DevicePtr<T> for DeviceBuffer {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.a.ptr, self.note_use(stream))
    }
}

impl<T: Plain> DevicePtrMut<T> for DeviceBuffer {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.a.ptr, self.note_use(stream))
    }
}

// SAFETY: the argument pushed is a reference to the buffer's `CUdeviceptr` (a u64, which is
// what a kernel's pointer parameter takes), and it lives as long as the launch builder ('b: 'a).
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b DeviceBuffer> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer) -> &mut Self {
        <Self as PushKernelArg<&'b u64>>::arg(self, &arg.a.ptr)
    }
}

// SAFETY: as for `&DeviceBuffer`.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut DeviceBuffer> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer) -> &mut Self {
        <Self as PushKernelArg<&'b u64>>::arg(self, &arg.a.ptr)
    }
}
