//! The measurements, one module per kind. Each one checks its kernel's output against the host
//! before it times anything, and records a failed check instead of a number it cannot trust.

pub(crate) mod bandwidth;
pub(crate) mod capacity;
pub(crate) mod compute;
pub(crate) mod elementwise;
pub(crate) mod latency;

use crate::gpu::Gpu;
use crate::ProbeOptions;
use cudarc::driver::{CudaSlice, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::error::{DriverContext, ProbeError};

/// Plain numbers for which every bit pattern is a valid value, so device memory holding them
/// may be handed out uninitialised (see [`Session::alloc`]).
pub(crate) trait AnyBitPattern: Copy {}
impl AnyBitPattern for u8 {}
impl AnyBitPattern for f32 {}
impl AnyBitPattern for u32 {}
impl AnyBitPattern for u64 {}

/// What every measurement needs: the device, the options, somewhere to say what it is doing,
/// and the list of failed correctness checks.
pub(crate) struct Session<'a> {
    pub gpu: Gpu,
    pub opts: &'a ProbeOptions,
    pub progress: &'a mut dyn FnMut(&str),
    pub failed_checks: Vec<String>,
    /// Measurements that could not run (a driver error, too little memory): recorded so the
    /// rest of the probe still runs and reports.
    pub errors: Vec<String>,
    /// Distinct seed for every random input drawn in this run.
    next_seed: u64,
}

impl<'a> Session<'a> {
    pub fn new(gpu: Gpu, opts: &'a ProbeOptions, progress: &'a mut dyn FnMut(&str)) -> Self {
        Session {
            gpu,
            opts,
            progress,
            failed_checks: Vec::new(),
            errors: Vec::new(),
            next_seed: opts.seed,
        }
    }

    pub fn say(&mut self, msg: &str) {
        (self.progress)(msg);
    }

    pub fn seed(&mut self) -> u64 {
        self.next_seed = self.next_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        self.next_seed
    }

    /// Runs one measurement; an error is recorded (and said) instead of ending the probe.
    pub fn attempt<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut Session<'a>) -> Result<T, ProbeError>,
    ) -> Option<T> {
        match f(self) {
            Ok(v) => Some(v),
            Err(e) => {
                let msg = format!("{what}: {e}");
                (self.progress)(&format!("ERROR: {msg}"));
                self.errors.push(msg);
                None
            }
        }
    }

    /// Records a check: `None` passed, `Some(why)` failed. Returns whether it passed.
    pub fn check(&mut self, what: &str, failure: Option<String>) -> bool {
        match failure {
            None => true,
            Some(why) => {
                let msg = format!("{what}: {why}");
                (self.progress)(&format!("CHECK FAILED: {msg}"));
                self.failed_checks.push(msg);
                false
            }
        }
    }

    /// Fills `view` with the all-ones pattern (a NaN as f32): poison before a kernel that must
    /// write every element, so an element it skips cannot pass the check.
    pub fn poison(&self, view: &mut CudaViewMut<'_, u32>) -> Result<(), ProbeError> {
        let f = self.gpu.func("fill_u32")?;
        let n = view.len() as u64;
        let value = 0xFFFF_FFFFu32;
        let cfg = LaunchConfig {
            grid_dim: (self.gpu.sm_count * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream.launch_builder(&f);
        b.arg(view).arg(&n).arg(&value);
        // SAFETY: fill_u32(u32* dst, u64 n, u32 value) writes dst[0..n); the view holds n u32.
        unsafe { b.launch(cfg) }.ctx("launch fill_u32")?;
        Ok(())
    }

    /// Allocates `n` elements of device memory, saying how much in the error. The contents are
    /// left as the driver hands them out.
    pub fn alloc<T: cudarc::driver::DeviceRepr + AnyBitPattern>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<T>, ProbeError> {
        // SAFETY: the memory is uninitialised, and some callers let kernels read or write it
        // only in part (timed copies into a destination never read back, result buffers a
        // kernel fills). That is sound because `T: AnyBitPattern`: any bytes in the buffer are a
        // valid `T`, so a kernel or a copy back to the host that meets unwritten memory sees an
        // arbitrary value, never an invalid one. Every value a correctness check compares was
        // written by a kernel or an upload first.
        unsafe { self.gpu.stream.alloc::<T>(n) }.ctx(&format!(
            "allocate {} for {what}",
            crate::render::fmt_bytes((n * std::mem::size_of::<T>()) as u64)
        ))
    }
}

/// Copies a device buffer to the host and waits for the copy (and everything before it on the
/// stream), so a failed kernel is reported here, under `what`.
pub(crate) fn download<T: cudarc::driver::DeviceRepr, S: cudarc::driver::DevicePtr<T>>(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    src: &S,
    what: &str,
) -> Result<Vec<T>, ProbeError> {
    let v = stream.clone_dtoh(src).ctx(what)?;
    stream.synchronize().ctx(what)?;
    Ok(v)
}

/// Threads of a one-dimensional launch.
pub(crate) fn thread_count(cfg: &LaunchConfig) -> usize {
    cfg.grid_dim.0 as usize * cfg.block_dim.0 as usize
}

/// A launch as the report shows it: "GRID x BLOCK threads".
pub(crate) fn launch_text(cfg: &LaunchConfig) -> String {
    format!("{} x {} threads", cfg.grid_dim.0, cfg.block_dim.0)
}

/// The bytes-per-second of each run as GB/s statistics.
pub(crate) fn gbps_stats(bytes: u64, secs: &[f64]) -> Result<crate::stats::Stats, ProbeError> {
    let v: Vec<f64> = secs.iter().map(|s| bytes as f64 / s / 1e9).collect();
    crate::stats::Stats::of(&v).ok_or_else(|| ProbeError::Internal("no timed runs".into()))
}

/// Reinterprets f32 as their bit patterns, for exact comparison.
pub(crate) fn bits(v: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is a valid u32.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u32>(), v.len()) }
}
