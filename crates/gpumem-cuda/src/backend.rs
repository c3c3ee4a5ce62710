//! [`CudaBackend`]: the engine's [`Backend`] trait over the CUDA driver API, for one device.
//!
//! Every call first makes the device's primary context current on the calling thread (if
//! `cuCtxGetCurrent` says another or none is), then calls the driver through cudarc's raw
//! bindings. The backend remembers what it handed out (segments, physical handles, mappings,
//! virtual ranges, events), so that it refuses handles it never made instead of passing them to
//! the driver, and so that dropping it returns everything to the device: an allocator that is
//! dropped with live blocks or a full cache leaves no memory behind.

use crate::driver::{self, bind, check, check_named, cu_stream};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaContext;
use gpumem_core::backend::{
    inside_reservation, Backend, DevPtr, DeviceInfo, DriverCall, EventHandle, PhysHandle, Stream,
};
use gpumem_core::BackendError;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Page size assumed where the device has no virtual-memory API to ask (every GPU that has the
/// API reports 2 MiB).
const FALLBACK_PAGE: u64 = 2 << 20;

/// Measures the physical memory the driver really hands out while a backend runs: the lowest
/// free memory `cuMemGetInfo` reports, sampled each time the backend's own physical bytes reach
/// a new high-water mark (rare: only while the pool grows).
#[derive(Debug)]
pub struct PhysicalProbe {
    baseline_free: u64,
    min_free: AtomicU64,
    samples: AtomicU64,
}

impl PhysicalProbe {
    /// A probe measuring against `baseline_free` bytes free before the run.
    pub fn new(baseline_free: u64) -> Arc<Self> {
        Arc::new(Self {
            baseline_free,
            min_free: AtomicU64::new(baseline_free),
            samples: AtomicU64::new(0),
        })
    }

    /// Free bytes before the run.
    pub fn baseline_free(&self) -> u64 {
        self.baseline_free
    }

    /// Lowest free bytes seen.
    pub fn min_free(&self) -> u64 {
        self.min_free.load(Ordering::Relaxed)
    }

    /// Peak bytes the driver handed out: free before the run minus the lowest free seen.
    pub fn peak_physical(&self) -> u64 {
        self.baseline_free.saturating_sub(self.min_free())
    }

    /// How many times `cuMemGetInfo` was sampled.
    pub fn samples(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }

    fn record(&self, free: u64) {
        self.samples.fetch_add(1, Ordering::Relaxed);
        self.min_free.fetch_min(free, Ordering::Relaxed);
    }
}

/// The CUDA driver as the engine's [`Backend`], for one device and its primary context.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    /// Allocation properties of the device's physical pages.
    prop: sys::CUmemAllocationProp,
    segments: FxHashMap<DevPtr, u64>,
    /// Physical handles: handle -> (bytes, number of mappings).
    handles: FxHashMap<u64, (u64, u32)>,
    /// Mapped ranges: start -> (bytes, handle).
    mappings: BTreeMap<DevPtr, (u64, u64)>,
    reservations: BTreeMap<DevPtr, u64>,
    /// Events ready for reuse, and events handed out (`CUevent`s as integers).
    idle_events: Vec<u64>,
    live_events: FxHashSet<u64>,
    /// Stream ids that stand for real streams (a trace's stream ids during a replay).
    aliases: Vec<(Stream, Stream)>,
    /// Physical bytes held through this backend now, and their high-water mark.
    physical: u64,
    physical_high: u64,
    probe: Option<Arc<PhysicalProbe>>,
    /// A CUDA graph capture is underway (see [`Backend::set_capture_underway`]).
    capture_underway: bool,
}

/// What one driver call runs under (see [`CudaBackend::bind`]); both are undone when it drops.
struct CallScope {
    _ctx: driver::ScopedContext,
    _relaxed: Option<driver::RelaxedCapture>,
}

// `prop` (a driver structure with a Win32 metadata pointer) keeps the type from being `Send`
// automatically.
// SAFETY: that pointer is always null and never read; every other field is an integer handle
// or a thread-safe type, and driver handles are valid from any thread once the context is
// current, which every method ensures first.
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    /// The backend of device `ordinal`, on its primary context (retained until the backend and
    /// every clone of its context are dropped).
    pub fn open(ordinal: u32) -> Result<Self, BackendError> {
        driver::load()?;
        let ctx = CudaContext::new(ordinal as usize).map_err(|e| {
            BackendError::new(
                DriverCall::MemGetInfo,
                format!("cannot open CUDA device {ordinal}: {e}"),
            )
        })?;
        Self::with_context(ctx)
    }

    /// A backend on an existing cudarc context (which must be its device's primary context,
    /// as [`CudaContext::new`] returns).
    pub fn with_context(ctx: Arc<CudaContext>) -> Result<Self, BackendError> {
        driver::load()?;
        bind(&ctx)?;
        let dev = ctx.cu_device();
        let ordinal = ctx.ordinal() as u32;
        let name = ctx
            .name()
            .unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        let mut total = 0usize;
        // SAFETY: `dev` is a valid device of an initialised driver; `total` is a valid place.
        check_named("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, dev)
        })?;
        let mut vmm: std::ffi::c_int = 0;
        // SAFETY: as above, for an attribute every driver of CUDA ≥ 10.2 knows.
        check_named("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut vmm,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                dev,
            )
        })?;
        let prop = page_properties(dev);
        let mut page = FALLBACK_PAGE;
        if vmm != 0 {
            let mut g = 0usize;
            // SAFETY: `prop` describes pinned memory on this device; `g` is a valid place.
            check_named("cuMemGetAllocationGranularity", unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut g,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            })?;
            if g > 0 {
                page = g as u64;
            }
        }
        Ok(Self {
            ctx,
            info: DeviceInfo {
                name,
                ordinal,
                total_bytes: total as u64,
                page_bytes: page,
                supports_vmm: vmm != 0,
            },
            prop,
            segments: FxHashMap::default(),
            handles: FxHashMap::default(),
            mappings: BTreeMap::new(),
            reservations: BTreeMap::new(),
            idle_events: Vec::new(),
            live_events: FxHashSet::default(),
            aliases: Vec::new(),
            physical: 0,
            physical_high: 0,
            probe: None,
            capture_underway: false,
        })
    }

    /// The cudarc context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Measures physical memory with `probe` from now on.
    pub fn set_probe(&mut self, probe: Arc<PhysicalProbe>) {
        self.probe = Some(probe);
    }

    /// Makes stream id `id` stand for the real stream `real` in event calls. A trace replay
    /// allocates on the trace's stream ids; its events must be recorded on streams that exist.
    pub fn alias_stream(&mut self, id: Stream, real: Stream) {
        match self.aliases.iter_mut().find(|(k, _)| *k == id) {
            Some(e) => e.1 = real,
            None => self.aliases.push((id, real)),
        }
    }

    /// Physical bytes held through this backend now.
    pub fn physical_bytes(&self) -> u64 {
        self.physical
    }

    /// Makes the device's context current for one call (the caller's is put back after), in
    /// the relaxed capture mode while a CUDA graph capture is underway.
    #[inline]
    fn bind(&self) -> Result<CallScope, BackendError> {
        let relaxed = if self.capture_underway {
            Some(driver::RelaxedCapture::enter()?)
        } else {
            None
        };
        Ok(CallScope {
            _ctx: driver::bind_scoped(&self.ctx)?,
            _relaxed: relaxed,
        })
    }

    #[inline]
    fn real_stream(&self, s: Stream) -> sys::CUstream {
        let s = self
            .aliases
            .iter()
            .find(|(k, _)| *k == s)
            .map_or(s, |&(_, r)| r);
        cu_stream(s)
    }

    fn gained(&mut self, bytes: u64) {
        self.physical += bytes;
        if self.physical > self.physical_high {
            self.physical_high = self.physical;
            if let Some(p) = &self.probe {
                if let Ok((free, _)) = driver::mem_get_info() {
                    p.record(free);
                }
            }
        }
    }

    fn access_desc(&self) -> sys::CUmemAccessDesc {
        sys::CUmemAccessDesc {
            location: self.prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }

    /// Checks that `[va, va + bytes)` lies inside one range this backend reserved, so that a
    /// map, unmap or access call can only touch this backend's own address space (never
    /// another library's mappings in the same context).
    fn own_range(&self, call: DriverCall, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        if inside_reservation(&self.reservations, va, bytes) {
            Ok(())
        } else {
            Err(BackendError::new(
                call,
                format!("{va:#x}+{bytes} is not inside a range reserved by this backend"),
            ))
        }
    }

    /// Checks a virtual-memory call of `bytes`: the device has the API, and the size is a
    /// non-zero multiple of its page. Returns the page size.
    fn vmm_pages(&self, call: DriverCall, bytes: u64) -> Result<u64, BackendError> {
        if !self.info.supports_vmm {
            return Err(BackendError::new(
                call,
                format!(
                    "{} has no virtual-memory API (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED \
                     is 0): use a policy over plain segments (caching, native, buddy)",
                    self.info.name
                ),
            ));
        }
        let page = self.info.page_bytes;
        if bytes == 0 || bytes % page != 0 {
            return Err(BackendError::new(
                call,
                format!("size {bytes} is not a non-zero multiple of the {page}-byte page"),
            ));
        }
        Ok(page)
    }

    fn known_event(&self, call: DriverCall, e: EventHandle) -> Result<sys::CUevent, BackendError> {
        if self.live_events.contains(&e.0) {
            Ok(e.0 as usize as sys::CUevent)
        } else {
            Err(BackendError::new(
                call,
                format!("event {:#x} was not recorded by this backend", e.0),
            ))
        }
    }

    /// Returns everything still held to the device (at drop).
    fn release_everything(&mut self) -> Vec<String> {
        let mut errors = Vec::new();
        let _ctx = match self.bind() {
            Ok(g) => g,
            Err(e) => {
                errors.push(e.to_string());
                return errors;
            }
        };
        // Work queued on the memory must finish before it is unmapped or freed.
        if let Err(e) = driver::ctx_synchronize() {
            errors.push(e.to_string());
        }
        for (va, (bytes, _)) in std::mem::take(&mut self.mappings) {
            // SAFETY: a range this backend mapped and has not unmapped.
            let r = unsafe { sys::cuMemUnmap(va, bytes as usize) };
            if let Err(e) = check(DriverCall::MemUnmap, r) {
                errors.push(e.to_string());
            }
        }
        for (h, _) in std::mem::take(&mut self.handles) {
            // SAFETY: a handle this backend created and has not released; now unmapped.
            if let Err(e) = check(DriverCall::MemRelease, unsafe { sys::cuMemRelease(h) }) {
                errors.push(e.to_string());
            }
        }
        for (p, _) in std::mem::take(&mut self.segments) {
            // SAFETY: a segment this backend allocated and has not freed.
            if let Err(e) = check(DriverCall::MemFree, unsafe { sys::cuMemFree_v2(p) }) {
                errors.push(e.to_string());
            }
        }
        for (va, bytes) in std::mem::take(&mut self.reservations) {
            // SAFETY: a range this backend reserved, now wholly unmapped.
            let r = unsafe { sys::cuMemAddressFree(va, bytes as usize) };
            if let Err(e) = check(DriverCall::AddressFree, r) {
                errors.push(e.to_string());
            }
        }
        let events: Vec<u64> = self
            .idle_events
            .drain(..)
            .chain(self.live_events.drain())
            .collect();
        for ev in events {
            // SAFETY: an event this backend created; nothing waits on it any more.
            let _ = unsafe { sys::cuEventDestroy_v2(ev as usize as sys::CUevent) };
        }
        self.physical = 0;
        errors
    }
}

/// A new event of the current context (a `CUevent` as an integer), timing off, which makes
/// events cheaper.
fn new_event() -> Result<u64, BackendError> {
    let mut e: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `e` is a valid place for the new event; callers bind the context first.
    check(DriverCall::EventRecord, unsafe {
        sys::cuEventCreate(
            &mut e,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
        )
    })?;
    Ok(e as usize as u64)
}

/// Pinned device memory on `dev`: the kind of physical page gpumem maps.
fn page_properties(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn set_capture_underway(&mut self, underway: bool) {
        self.capture_underway = underway;
    }

    fn stream_is_capturing(&mut self, stream: Stream) -> Result<bool, BackendError> {
        let _ctx = self.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid place; the stream handle is the caller's (a stream of
        // this context, or an alias set up for one). Allowed during a capture.
        check_named("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(self.real_stream(stream), &mut status)
        })?;
        Ok(status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
    }

    fn mem_get_info(&mut self) -> Result<(u64, u64), BackendError> {
        let _ctx = self.bind()?;
        driver::mem_get_info()
    }

    fn mem_alloc(&mut self, bytes: u64) -> Result<DevPtr, BackendError> {
        if bytes == 0 {
            return Err(BackendError::new(DriverCall::MemAlloc, "size 0"));
        }
        let _ctx = self.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a valid place for the pointer; a context is current.
        check(DriverCall::MemAlloc, unsafe {
            sys::cuMemAlloc_v2(&mut p, bytes as usize)
        })?;
        self.segments.insert(p, bytes);
        self.gained(bytes);
        Ok(p)
    }

    fn mem_free(&mut self, ptr: DevPtr, bytes: u64) -> Result<(), BackendError> {
        match self.segments.get(&ptr) {
            Some(&b) if b == bytes => {}
            Some(&b) => {
                return Err(BackendError::new(
                    DriverCall::MemFree,
                    format!("segment {ptr:#x} has {b} bytes, not {bytes}"),
                ))
            }
            None => {
                return Err(BackendError::new(
                    DriverCall::MemFree,
                    format!("{ptr:#x} is not a segment allocated by this backend"),
                ))
            }
        }
        let _ctx = self.bind()?;
        // SAFETY: `ptr` is a live segment of this backend (checked above).
        check(DriverCall::MemFree, unsafe { sys::cuMemFree_v2(ptr) })?;
        self.segments.remove(&ptr);
        self.physical -= bytes;
        Ok(())
    }

    fn address_reserve(&mut self, bytes: u64, align: u64) -> Result<DevPtr, BackendError> {
        let page = self.vmm_pages(DriverCall::AddressReserve, bytes)?;
        let align = gpumem_core::backend::reserve_alignment(align, page)?;
        let _ctx = self.bind()?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: `va` is a valid place; size and alignment are multiples of the granularity
        // (checked above).
        check(DriverCall::AddressReserve, unsafe {
            sys::cuMemAddressReserve(&mut va, bytes as usize, align as usize, 0, 0)
        })?;
        self.reservations.insert(va, bytes);
        Ok(va)
    }

    fn address_free(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        if self.reservations.get(&va) != Some(&bytes) {
            return Err(BackendError::new(
                DriverCall::AddressFree,
                format!("{va:#x}+{bytes} is not a range reserved by this backend"),
            ));
        }
        if self.mappings.range(va..va + bytes).next().is_some() {
            return Err(BackendError::new(
                DriverCall::AddressFree,
                format!("{va:#x}+{bytes} still has mappings"),
            ));
        }
        let _ctx = self.bind()?;
        // SAFETY: a range this backend reserved, with nothing mapped in it (checked above).
        check(DriverCall::AddressFree, unsafe {
            sys::cuMemAddressFree(va, bytes as usize)
        })?;
        self.reservations.remove(&va);
        Ok(())
    }

    fn mem_create(&mut self, bytes: u64) -> Result<PhysHandle, BackendError> {
        self.vmm_pages(DriverCall::MemCreate, bytes)?;
        let _ctx = self.bind()?;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `h` is a valid place; `prop` describes pinned memory on this device; the size
        // is a multiple of the granularity.
        check(DriverCall::MemCreate, unsafe {
            sys::cuMemCreate(&mut h, bytes as usize, &self.prop, 0)
        })?;
        self.handles.insert(h, (bytes, 0));
        self.gained(bytes);
        Ok(PhysHandle(h))
    }

    fn mem_release(&mut self, handle: PhysHandle) -> Result<(), BackendError> {
        let Some(&(bytes, maps)) = self.handles.get(&handle.0) else {
            return Err(BackendError::new(
                DriverCall::MemRelease,
                format!("handle {:#x} was not created by this backend", handle.0),
            ));
        };
        if maps > 0 {
            return Err(BackendError::new(
                DriverCall::MemRelease,
                format!("handle {:#x} is still mapped {maps} time(s)", handle.0),
            ));
        }
        let _ctx = self.bind()?;
        // SAFETY: a handle this backend created, not mapped anywhere (checked above).
        check(DriverCall::MemRelease, unsafe {
            sys::cuMemRelease(handle.0)
        })?;
        self.handles.remove(&handle.0);
        self.physical -= bytes;
        Ok(())
    }

    fn mem_map(&mut self, va: DevPtr, bytes: u64, handle: PhysHandle) -> Result<(), BackendError> {
        self.own_range(DriverCall::MemMap, va, bytes)?;
        match self.handles.get(&handle.0) {
            Some(&(b, _)) if b == bytes => {}
            Some(&(b, _)) => {
                return Err(BackendError::new(
                    DriverCall::MemMap,
                    format!("handle {:#x} has {b} bytes, mapping asks {bytes}", handle.0),
                ))
            }
            None => {
                return Err(BackendError::new(
                    DriverCall::MemMap,
                    format!("handle {:#x} was not created by this backend", handle.0),
                ))
            }
        }
        let _ctx = self.bind()?;
        // SAFETY: a live handle of exactly `bytes`, mapped inside a range this backend reserved
        // (checked above); the driver checks that the range is not mapped already.
        check(DriverCall::MemMap, unsafe {
            sys::cuMemMap(va, bytes as usize, 0, handle.0, 0)
        })?;
        self.mappings.insert(va, (bytes, handle.0));
        if let Some(h) = self.handles.get_mut(&handle.0) {
            h.1 += 1;
        }
        Ok(())
    }

    fn mem_unmap(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        self.own_range(DriverCall::MemUnmap, va, bytes)?;
        let _ctx = self.bind()?;
        // SAFETY: a range inside one this backend reserved (checked above), so no one else's
        // mapping; the driver checks that it consists of whole mappings. The engine waits for
        // the streams that used it before asking (as PyTorch does).
        check(DriverCall::MemUnmap, unsafe {
            sys::cuMemUnmap(va, bytes as usize)
        })?;
        let inside: Vec<DevPtr> = self
            .mappings
            .range(va..va + bytes)
            .map(|(&s, _)| s)
            .collect();
        for s in inside {
            if let Some((_, h)) = self.mappings.remove(&s) {
                if let Some(e) = self.handles.get_mut(&h) {
                    e.1 = e.1.saturating_sub(1);
                }
            }
        }
        Ok(())
    }

    fn set_access(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        self.own_range(DriverCall::SetAccess, va, bytes)?;
        let _ctx = self.bind()?;
        let desc = self.access_desc();
        // SAFETY: `desc` is one valid descriptor (read/write for this device); the range lies
        // inside one this backend reserved (checked above); the driver checks that it is
        // mapped.
        check(DriverCall::SetAccess, unsafe {
            sys::cuMemSetAccess(va, bytes as usize, &desc, 1)
        })
    }

    fn event_record(&mut self, stream: Stream) -> Result<EventHandle, BackendError> {
        let _ctx = self.bind()?;
        let ev = match self.idle_events.pop() {
            Some(e) => e,
            None => new_event()?,
        };
        // SAFETY: `ev` is an event of this context; the stream handle is the caller's (a
        // stream of this context, or an alias set up for one).
        let r =
            unsafe { sys::cuEventRecord(ev as usize as sys::CUevent, self.real_stream(stream)) };
        if let Err(e) = check(DriverCall::EventRecord, r) {
            self.idle_events.push(ev);
            return Err(e);
        }
        self.live_events.insert(ev);
        Ok(EventHandle(ev))
    }

    fn event_completed(&mut self) -> Result<EventHandle, BackendError> {
        let _ctx = self.bind()?;
        // A new event, never recorded, reads as completed (cuEventQuery returns CUDA_SUCCESS),
        // which is what it stands for; a recycled one might still be waiting on its last record.
        let ev = new_event()?;
        self.live_events.insert(ev);
        Ok(EventHandle(ev))
    }

    fn event_query(&mut self, event: EventHandle) -> Result<bool, BackendError> {
        let ev = self.known_event(DriverCall::EventQuery, event)?;
        let _ctx = self.bind()?;
        // SAFETY: a live event of this backend.
        match unsafe { sys::cuEventQuery(ev) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(DriverCall::EventQuery, r).map(|_| false),
        }
    }

    fn event_synchronize(&mut self, event: EventHandle) -> Result<(), BackendError> {
        let ev = self.known_event(DriverCall::EventSynchronize, event)?;
        let _ctx = self.bind()?;
        // SAFETY: a live event of this backend.
        check(DriverCall::EventSynchronize, unsafe {
            sys::cuEventSynchronize(ev)
        })
    }

    fn event_destroy(&mut self, event: EventHandle) {
        // Events are recycled: a recorded event may be recorded again.
        if self.live_events.remove(&event.0) {
            self.idle_events.push(event.0);
        }
    }

    fn stream_wait_event(
        &mut self,
        stream: Stream,
        event: EventHandle,
    ) -> Result<(), BackendError> {
        let ev = self.known_event(DriverCall::StreamWaitEvent, event)?;
        let _ctx = self.bind()?;
        // SAFETY: a live event of this backend; the stream is the caller's (see event_record).
        check(DriverCall::StreamWaitEvent, unsafe {
            sys::cuStreamWaitEvent(self.real_stream(stream), ev, 0)
        })
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let errors = self.release_everything();
        if !errors.is_empty() {
            // Never panic in drop: report on stderr (a failed write is ignored).
            let _ = writeln!(
                std::io::stderr(),
                "gpumem: returning memory to {} at shutdown failed: {}",
                self.info.name,
                errors.join("; ")
            );
        }
    }
}
