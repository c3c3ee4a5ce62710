//! The driver's own allocators, measured on the same sequences: `cudaMalloc` (cuMemAlloc /
//! cuMemFree) and `cudaMallocAsync` (cuMemAllocAsync / cuMemFreeAsync on the device's default
//! memory pool, its release threshold raised to the maximum so that the pool keeps its memory,
//! as the anchor did).

use super::{slot_count, timed_threads};
use crate::driver::{self, bind, check_named, cu_stream, describe};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream};
use gpumem_core::backend::Stream;
use gpumem_core::bench_ops::Op;
use gpumem_core::BackendError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The device's context, its default memory pool and the streams of the multi-thread runs.
pub(super) struct DriverBaselines {
    ctx: Arc<CudaContext>,
    /// The default pool (`CUmemoryPool` as an integer).
    pool: usize,
    streams: Mutex<Vec<Arc<CudaStream>>>,
}

impl DriverBaselines {
    pub(super) fn open(ordinal: u32) -> Result<Self, BackendError> {
        driver::load()?;
        let ctx = CudaContext::new(ordinal as usize).map_err(|e| {
            BackendError::new(
                gpumem_core::backend::DriverCall::MemGetInfo,
                format!("cannot open CUDA device {ordinal}: {e}"),
            )
        })?;
        bind(&ctx)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid place; the device is the context's.
        check_named("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
        })?;
        let mut threshold = u64::MAX;
        // SAFETY: the release threshold attribute takes a pointer to a u64.
        check_named("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
        })?;
        Ok(Self {
            ctx,
            pool: pool as usize,
            streams: Mutex::new(Vec::new()),
        })
    }

    pub(super) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `n` created (non-blocking) streams, as raw handles; made once and kept.
    pub(super) fn streams(&self, n: usize) -> Result<Vec<Stream>, String> {
        let mut s = self.streams.lock().map_err(|_| "stream list poisoned")?;
        while s.len() < n {
            s.push(
                self.ctx
                    .new_stream()
                    .map_err(|e| format!("cuStreamCreate: {e}"))?,
            );
        }
        Ok(s[..n]
            .iter()
            .map(|x| x.cu_stream() as usize as u64)
            .collect())
    }

    /// Makes the context current on the calling (benchmark) thread and returns the empty
    /// pointer table of `seq`.
    fn slots_on_this_thread(&self, seq: &[Op]) -> Result<Vec<u64>, String> {
        bind(&self.ctx).map_err(|e| e.to_string())?;
        Ok(vec![0u64; slot_count(seq)])
    }

    fn sync(&self) -> Result<(), String> {
        bind(&self.ctx).map_err(|e| e.to_string())?;
        driver::ctx_synchronize().map_err(|e| e.to_string())
    }

    /// One run of cuMemAlloc/cuMemFree over `seqs[0]` (single thread).
    pub(super) fn malloc_runs(&self, seqs: &[Vec<Op>]) -> Result<Duration, String> {
        let wall = timed_threads(
            seqs.len(),
            |t| self.slots_on_this_thread(&seqs[t]),
            |t, slots| malloc_pass(&seqs[t], slots),
        )?;
        self.sync()?;
        Ok(wall)
    }

    /// One run of cuMemAllocAsync/cuMemFreeAsync, thread t on `streams[t]`.
    pub(super) fn async_runs(
        &self,
        seqs: &[Vec<Op>],
        streams: &[Stream],
    ) -> Result<Duration, String> {
        let wall = timed_threads(
            seqs.len(),
            |t| self.slots_on_this_thread(&seqs[t]),
            |t, slots| async_pass(&seqs[t], slots, streams[t]),
        )?;
        self.sync()?;
        Ok(wall)
    }

    /// Returns the default pool's cached memory to the device (between cases).
    pub(super) fn trim_pool(&self) -> Result<(), String> {
        self.sync()?;
        // SAFETY: the default pool of this device; no allocation of it is live (every sequence
        // frees all it allocates, and the device is idle).
        check_named("cuMemPoolTrimTo", unsafe {
            sys::cuMemPoolTrimTo(self.pool as sys::CUmemoryPool, 0)
        })
        .map_err(|e| e.to_string())
    }
}

/// Frees what a failed run left allocated (cuMemFree).
fn free_left(slots: &mut [u64]) {
    for p in slots.iter_mut().filter(|p| **p != 0) {
        // SAFETY: a pointer cuMemAlloc returned in this run and not freed yet.
        let _ = unsafe { sys::cuMemFree_v2(*p) };
        *p = 0;
    }
}

#[inline(never)]
fn malloc_pass(ops: &[Op], slots: &mut [u64]) -> Result<(), String> {
    for op in ops {
        let r = match *op {
            Op::Alloc { slot, size } => {
                // SAFETY: the slot is a valid place for the pointer; the context is current.
                unsafe { sys::cuMemAlloc_v2(&mut slots[slot as usize], size as usize) }
            }
            Op::Free { slot } => {
                let p = std::mem::take(&mut slots[slot as usize]);
                // SAFETY: a pointer cuMemAlloc returned in this run, freed once.
                unsafe { sys::cuMemFree_v2(p) }
            }
        };
        if r != CUresult::CUDA_SUCCESS {
            free_left(slots);
            return Err(format!("cudaMalloc baseline: {}", describe(r)));
        }
    }
    Ok(())
}

#[inline(never)]
fn async_pass(ops: &[Op], slots: &mut [u64], stream: Stream) -> Result<(), String> {
    let s = cu_stream(stream);
    for op in ops {
        let r = match *op {
            Op::Alloc { slot, size } => {
                // SAFETY: the slot is a valid place; `s` is a live stream of the current context.
                unsafe { sys::cuMemAllocAsync(&mut slots[slot as usize], size as usize, s) }
            }
            Op::Free { slot } => {
                let p = std::mem::take(&mut slots[slot as usize]);
                // SAFETY: a pointer cuMemAllocAsync returned on this stream, freed once.
                unsafe { sys::cuMemFreeAsync(p, s) }
            }
        };
        if r != CUresult::CUDA_SUCCESS {
            for p in slots.iter_mut().filter(|p| **p != 0) {
                // SAFETY: pointers of this run not freed yet.
                let _ = unsafe { sys::cuMemFreeAsync(*p, s) };
                *p = 0;
            }
            return Err(format!("cudaMallocAsync baseline: {}", describe(r)));
        }
    }
    Ok(())
}
