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
use std::sync::Arc;

struct Shared {
    engine: Allocator,
    ctx: Arc<CudaContext>,
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
            shared: Arc::new(Shared { engine, ctx }),
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

    /// Allocates `bytes` for use on `stream` (a stream of this device's context).
    pub fn alloc(&self, bytes: u64, stream: &Arc<CudaStream>) -> Result<DeviceBuffer, AllocError> {
        if stream.context().cu_ctx() != self.shared.ctx.cu_ctx() {
            return Err(AllocError::Config(format!(
                "the stream belongs to CUDA device {}, this allocator serves device {}",
                stream.context().ordinal(),
                self.ordinal()
            )));
        }
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
    /// the buffer: gpumem records events on it when the buffer is freed.
    pub unsafe fn alloc_on_raw(&self, bytes: u64, stream: u64) -> Result<DeviceBuffer, AllocError> {
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
/// It works with cudarc: it implements [`DevicePtr`] and [`DevicePtrMut`] (for any element
/// type: its length is its bytes divided by the element's size), so cudarc's copies take it,
/// and `LaunchArgs::arg(&buffer)` passes its address to a kernel. Using it on a stream other
/// than the one it was allocated on through `device_ptr`/`device_ptr_mut` marks it as used there
/// (like PyTorch's `Tensor.record_stream`); a kernel launched on another stream needs an explicit
/// [`DeviceBuffer::record_stream`], since cudarc's launch builder does not say which stream it
/// launches on.
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
    /// the work queued on `stream` by then has completed.
    pub fn record_stream(&self, stream: &CudaStream) -> Result<(), AllocError> {
        self.owner
            .engine()
            .record_stream(self.a.ptr, stream.cu_stream() as usize as u64)
    }

    /// [`DeviceBuffer::record_stream`] for a stream given as its raw `CUstream` value.
    ///
    /// # Safety
    ///
    /// `stream` must be 0 or a live stream of the buffer's context until the buffer has been
    /// dropped (an event is recorded on it then).
    pub unsafe fn record_stream_raw(&self, stream: u64) -> Result<(), AllocError> {
        self.owner.engine().record_stream(self.a.ptr, stream)
    }

    fn note_use(&self, stream: &CudaStream) {
        if stream.cu_stream() != self.stream.cu_stream() {
            if let Err(e) = self.record_stream(stream) {
                let _ = writeln!(
                    std::io::stderr(),
                    "gpumem: cannot mark {:#x} as used on another stream: {e}",
                    self.a.ptr
                );
            }
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

impl<T> DeviceSlice<T> for DeviceBuffer {
    fn len(&self) -> usize {
        (self.requested as usize)
            .checked_div(std::mem::size_of::<T>())
            .unwrap_or(0)
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for DeviceBuffer {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.note_use(stream);
        // Ordering between streams is the caller's, as with a raw pointer: nothing to record.
        (self.a.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.note_use(stream);
        (self.a.ptr, SyncOnDrop::Sync(None))
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
