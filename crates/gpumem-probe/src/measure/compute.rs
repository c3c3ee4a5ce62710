//! fp32 FMA throughput, measured with a kernel of independent FMA chains, at the SM clock read
//! inside that kernel.

use super::{download, launch_text, thread_count, Session};
use crate::anchors::fp32_lanes_per_sm;
use crate::error::{DriverContext, ProbeError};
use crate::report::ComputePeak;
use crate::stats::Stats;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// Must match FMA_CHAINS and FMA_STEPS in probe.cu.
pub(crate) const CHAINS: u32 = 8;
pub(crate) const STEPS: u32 = 16;
const BLOCK: u32 = 256;
/// x <- x * A + B: |A| < 1 keeps the chains bounded; both exact in f32.
const A: f32 = 1.0 - 1.0 / 8192.0;
const B: f32 = 1.0 / 16384.0;

/// The value thread `lane` (thread index mod 8) of fma_peak ends with: the kernel's chains
/// replayed with the same fused multiply-add.
pub(crate) fn fma_expected(lane: u32, trips: u32) -> f32 {
    let mut x = [0f32; CHAINS as usize];
    for (c, xc) in x.iter_mut().enumerate() {
        *xc = (lane + 8 * c as u32) as f32 * 0.000_976_562_5;
    }
    for xc in x.iter_mut() {
        for _ in 0..trips * STEPS {
            *xc = xc.mul_add(A, B);
        }
    }
    ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))
}

pub(crate) fn fp32_peak(s: &mut Session, trips: u32) -> Result<ComputePeak, ProbeError> {
    s.say("fp32 FMA peak: 8 independent chains per thread, one full wave");
    let f = s.gpu.func("fma_peak")?;
    let cfg = s.gpu.full_wave(&f, BLOCK)?;
    let threads = thread_count(&cfg);
    let mut out: CudaSlice<f32> = s.alloc(threads, "FMA results")?;
    let mut clocks: CudaSlice<u64> = s.alloc(4 * cfg.grid_dim.0 as usize, "block clocks")?;
    let stream = s.gpu.stream.clone();
    let run = |out: &mut CudaSlice<f32>, clocks: &mut CudaSlice<u64>| {
        let mut l = stream.launch_builder(&f);
        l.arg(&trips).arg(&A).arg(&B).arg(out).arg(clocks);
        // SAFETY: fma_peak writes out[thread] for each of the grid's `threads` threads and
        // clocks[4 * block + 0..4) for each of its `cfg.grid_dim.0` blocks.
        unsafe { l.launch(cfg) }.map(|_| ()).ctx("launch fma_peak")
    };
    {
        // SAFETY: poisoning the results through a u32 view of the same length.
        let mut o = unsafe { out.transmute_mut::<u32>(threads) }
            .ok_or_else(|| ProbeError::Internal("view results as u32".into()))?;
        s.poison(&mut o)?;
    }
    run(&mut out, &mut clocks)?;
    let got = download(&stream, &out, "run fma_peak")?;
    let want: Vec<f32> = (0..8).map(|lane| fma_expected(lane, trips)).collect();
    let bad = got
        .iter()
        .enumerate()
        .filter(|(i, g)| g.to_bits() != want[i % 8].to_bits())
        .count();
    let verified = s.check(
        "fp32 FMA",
        (bad > 0).then(|| format!("{bad} of {threads} results differ from the host replay")),
    );
    let secs = s
        .gpu
        .time_runs(2, s.opts.runs, || run(&mut out, &mut clocks))?;
    let c = download(&stream, &clocks, "read block clocks")?;
    let samples: Vec<f64> = c
        .chunks_exact(4)
        .filter(|b| b[3] > b[2])
        .map(|b| (b[1] - b[0]) as f64 / (b[3] - b[2]) as f64 * 1e9)
        .collect();
    let clock = Stats::of(&samples)
        .ok_or_else(|| ProbeError::Internal("fma_peak: the global timer did not advance".into()))?
        .median;
    let flop = threads as f64 * f64::from(trips) * f64::from(STEPS * CHAINS) * 2.0;
    let tflops: Vec<f64> = secs.iter().map(|t| flop / t / 1e12).collect();
    let (maj, min) = s.gpu.cc;
    Ok(ComputePeak {
        tflops: Stats::of(&tflops).ok_or_else(|| ProbeError::Internal("no runs".into()))?,
        sm_clock_hz: clock,
        theoretical_tflops: fp32_lanes_per_sm(maj, min)
            .map(|lanes| f64::from(s.gpu.sm_count) * f64::from(lanes) * 2.0 * clock / 1e12),
        launch: launch_text(&cfg),
        verified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fma_chains_converge_to_the_fixed_point() {
        // x = A x + B has the fixed point B / (1 - A) = 0.5, and x_n = 0.5 + (x_0 - 0.5) A^n.
        // Lane 3 starts its eight chains at (3 + 8c) / 1024, summing to 248 / 1024.
        let n = 4096 * 16;
        let want = 4.0 + (248.0 / 1024.0 - 4.0) * f64::from(A).powi(n);
        let v = fma_expected(3, 4096);
        assert!((f64::from(v) - want).abs() < 1e-4, "{v} vs {want}");
        // Few steps: still near the start values, and lanes differ.
        assert_ne!(fma_expected(0, 1).to_bits(), fma_expected(1, 1).to_bits());
    }
}
