//! Streaming bandwidth: HBM copy (several kernels and the driver's copy) and read, an L2-resident
//! read, and the shared-memory read against 128 B/clk/SM at the clock measured in the kernel.

use super::{bits, download, gbps_stats, launch_text, thread_count, Session};
use crate::anchors::SMEM_BYTES_PER_CLK_PER_SM;
use crate::error::{DriverContext, ProbeError};
use crate::hostdata::{fill_random, mismatches_u32, per_thread_sums};
use crate::report::Bandwidth;
use crate::stats::Stats;
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use rand::RngExt;

const BLOCK: u32 = 256;

/// Enqueues one copy of the HBM source into the destination.
type CopyRun = Box<dyn FnMut(&mut HbmBuffers) -> Result<(), ProbeError>>;

/// The HBM buffers: a source of fresh random small integers (as f32, so sums of them are
/// exact) and a destination, `n` floats each.
pub(crate) struct HbmBuffers {
    pub host: Vec<f32>,
    pub src: CudaSlice<f32>,
    pub dst: CudaSlice<f32>,
}

pub(crate) fn hbm_buffers(s: &mut Session, bytes: u64) -> Result<HbmBuffers, ProbeError> {
    let n = (bytes / 16 * 4) as usize;
    s.say(&format!(
        "preparing 2 x {} of random data for the HBM copy",
        crate::render::fmt_bytes(n as u64 * 4)
    ));
    let mut host = vec![0f32; n];
    fill_random(&mut host, s.seed(), |r| r.random_range(0u32..16) as f32);
    let mut src: CudaSlice<f32> = s.alloc(n, "the HBM copy source")?;
    s.gpu
        .stream
        .memcpy_htod(&host, &mut src)
        .ctx("upload the HBM source")?;
    let dst: CudaSlice<f32> = s.alloc(n, "the HBM copy destination")?;
    Ok(HbmBuffers { host, src, dst })
}

/// The copy variants (id, kernel or `None` for the driver's copy, label).
pub(crate) const COPY_VARIANTS: [(&str, Option<&str>, &str); 5] = [
    (
        "hbm_copy_f4",
        Some("copy_f4"),
        "copy kernel, 16 B per thread per step, grid-stride",
    ),
    (
        "hbm_copy_f4_x4",
        Some("copy_f4_x4"),
        "copy kernel, four 16 B loads in flight per thread",
    ),
    (
        "hbm_copy_f4_x4_cs",
        Some("copy_f4_x4_cs"),
        "the same with streaming cache hints (.cs)",
    ),
    (
        "hbm_copy_f4_tile",
        Some("copy_f4_tile"),
        "copy kernel, one 16 KiB tile per block, no grid-stride",
    ),
    ("hbm_copy_driver", None, "driver copy (cuMemcpyDtoDAsync)"),
];

/// One copy variant: checked (destination poisoned, then compared with the source bit for
/// bit), then timed.
pub(crate) fn hbm_copy(
    s: &mut Session,
    buf: &mut HbmBuffers,
    (id, kernel, label): (&str, Option<&str>, &str),
) -> Result<Bandwidth, ProbeError> {
    let n = buf.host.len();
    let n4 = (n / 4) as u64;
    let bytes = 2 * n as u64 * 4;
    s.say(&format!("HBM bandwidth: {label}"));
    let (launch, mut run): (String, CopyRun) = match kernel {
        Some(k) => {
            let f = s.gpu.func(k)?;
            let cfg = if k == "copy_f4_tile" {
                // One block per tile of 4 x BLOCK float4 (hbm_bytes is a multiple of 16 KiB).
                LaunchConfig {
                    grid_dim: ((n4 / (4 * u64::from(BLOCK))) as u32, 1, 1),
                    block_dim: (BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                }
            } else {
                s.gpu.full_wave(&f, BLOCK)?
            };
            let stream = s.gpu.stream.clone();
            (
                launch_text(&cfg),
                Box::new(move |b: &mut HbmBuffers| {
                    let mut l = stream.launch_builder(&f);
                    l.arg(&b.src).arg(&mut b.dst).arg(&n4);
                    // SAFETY: the copy kernels read src[0..n4) and write dst[0..n4) as
                    // float4 (copy_f4_tile only whole tiles, and n4 is a whole number of
                    // them); both buffers hold 4 * n4 floats.
                    unsafe { l.launch(cfg) }
                        .map(|_| ())
                        .ctx("launch a copy kernel")
                }),
            )
        }
        None => {
            let stream = s.gpu.stream.clone();
            (
                "driver".to_string(),
                Box::new(move |b: &mut HbmBuffers| {
                    stream
                        .memcpy_dtod(&b.src, &mut b.dst)
                        .ctx("cuMemcpyDtoDAsync")
                }),
            )
        }
    };
    // Check: poison, run once, compare.
    {
        // SAFETY: viewing the f32 destination as u32 of the same length to poison it; the
        // bytes are overwritten by the copy before anything reads them as floats.
        let mut as_u32 = unsafe { buf.dst.transmute_mut::<u32>(n) }
            .ok_or_else(|| ProbeError::Internal("view the destination as u32".into()))?;
        s.poison(&mut as_u32)?;
    }
    run(buf)?;
    let got = download(&s.gpu.stream, &buf.dst, &format!("run {id}"))?;
    let want = bits(&buf.host);
    let (bad, first) = mismatches_u32(bits(&got), |i| want[i]);
    drop(got);
    let verified = s.check(
        id,
        (bad > 0)
            .then(|| format!("{bad} of {n} floats differ from the source (first at {first:?})")),
    );
    let secs = s.gpu.time_runs(2, s.opts.runs, || run(buf))?;
    Ok(Bandwidth {
        id: id.to_string(),
        level: "HBM".into(),
        label: label.to_string(),
        counted: "read + write".into(),
        bytes_per_run: bytes,
        gbps: gbps_stats(bytes, &secs)?,
        launch,
        sm_clock_hz: None,
        bytes_per_clk_per_sm: None,
        fraction_of_peak: None,
        verified,
    })
}

/// Reads the first `n4` float4 of the source `reps` times with ld.global.cg; every thread's sum
/// is checked against the host. With the whole buffer once it measures HBM; with a few MB many
/// times, L2.
pub(crate) fn read(
    s: &mut Session,
    buf: &HbmBuffers,
    id: &str,
    level: &str,
    label: &str,
    n4: usize,
    reps: u32,
) -> Result<Bandwidth, ProbeError> {
    s.say(&format!("{level} bandwidth: {label}"));
    let f = s.gpu.func("read_f4_x4")?;
    let cfg = s.gpu.full_wave(&f, BLOCK)?;
    let threads = thread_count(&cfg);
    let src: CudaView<'_, f32> = buf.src.slice(0..4 * n4);
    let mut partial: CudaSlice<f32> = s.alloc(threads, "per-thread sums")?;
    let n4u = n4 as u64;
    let stream = s.gpu.stream.clone();
    let run = |partial: &mut CudaSlice<f32>| {
        let mut l = stream.launch_builder(&f);
        l.arg(&src).arg(&n4u).arg(&reps).arg(partial);
        // SAFETY: read_f4_x4 reads src[0..n4) as float4 (the view holds 4 * n4 floats) and
        // writes partial[thread] for every thread of the grid (`threads` floats).
        unsafe { l.launch(cfg) }
            .map(|_| ())
            .ctx("launch read_f4_x4")
    };
    {
        // SAFETY: poisoning the per-thread sums through a u32 view of the same length.
        let mut p = unsafe { partial.transmute_mut::<u32>(threads) }
            .ok_or_else(|| ProbeError::Internal("view sums as u32".into()))?;
        s.poison(&mut p)?;
    }
    run(&mut partial)?;
    let got = download(&stream, &partial, &format!("run {id}"))?;
    let want = per_thread_sums(&buf.host, n4, threads);
    let bad = got
        .iter()
        .zip(&want)
        .filter(|(g, w)| **g as f64 != (**w * u64::from(reps)) as f64)
        .count();
    let verified = s.check(
        id,
        (bad > 0).then(|| format!("{bad} of {threads} per-thread sums differ from the host")),
    );
    let secs = s.gpu.time_runs(2, s.opts.runs, || run(&mut partial))?;
    let bytes = n4 as u64 * 16 * u64::from(reps);
    Ok(Bandwidth {
        id: id.to_string(),
        level: level.to_string(),
        label: label.to_string(),
        counted: "read".into(),
        bytes_per_run: bytes,
        gbps: gbps_stats(bytes, &secs)?,
        launch: launch_text(&cfg),
        sm_clock_hz: None,
        bytes_per_clk_per_sm: None,
        fraction_of_peak: None,
        verified,
    })
}

/// Must match SMEM_BLOCK and SMEM_UNROLL in probe.cu.
pub(crate) const SMEM_BLOCK: u32 = 256;
pub(crate) const SMEM_UNROLL: u64 = 8;

/// Value of shared-memory word `i` in smem_read (small integers: exact float sums).
fn smem_value(i: u32) -> u64 {
    u64::from((i & 3) + ((i >> 2) & 3) + ((i >> 4) & 3) + ((i >> 6) & 3))
}

/// What thread `t` of a smem_read block sums over `trips` trips.
pub(crate) fn smem_expected(t: u32, trips: u32) -> u64 {
    let f = |k: u32| {
        (0..SMEM_UNROLL as u32)
            .map(|u| smem_value(k + 32 * u))
            .sum::<u64>()
    };
    let full: u64 = (0..SMEM_BLOCK).map(f).sum();
    let q = u64::from(trips / SMEM_BLOCK);
    let rem = trips % SMEM_BLOCK;
    q * full + (0..rem).map(|r| f((t + r) % SMEM_BLOCK)).sum::<u64>()
}

pub(crate) fn shared(s: &mut Session, trips: u32) -> Result<Bandwidth, ProbeError> {
    s.say("shared-memory bandwidth: ld.shared.v4, 8 loads in flight per thread");
    let f = s.gpu.func("smem_read")?;
    let cfg = s.gpu.full_wave(&f, SMEM_BLOCK)?;
    let threads = thread_count(&cfg);
    let mut out: CudaSlice<f32> = s.alloc(threads, "shared-memory sums")?;
    let mut clocks: CudaSlice<u64> = s.alloc(4 * cfg.grid_dim.0 as usize, "block clocks")?;
    let stream = s.gpu.stream.clone();
    let run = |out: &mut CudaSlice<f32>, clocks: &mut CudaSlice<u64>| {
        let mut l = stream.launch_builder(&f);
        l.arg(&trips).arg(out).arg(clocks);
        // SAFETY: smem_read writes out[thread] for each of the grid's `threads` threads and
        // clocks[4 * block + 0..4) for each of its `cfg.grid_dim.0` blocks.
        unsafe { l.launch(cfg) }.map(|_| ()).ctx("launch smem_read")
    };
    {
        // SAFETY: poisoning the per-thread sums through a u32 view of the same length.
        let mut o = unsafe { out.transmute_mut::<u32>(threads) }
            .ok_or_else(|| ProbeError::Internal("view sums as u32".into()))?;
        s.poison(&mut o)?;
    }
    run(&mut out, &mut clocks)?;
    let got = download(&stream, &out, "run smem_read")?;
    let want: Vec<u64> = (0..SMEM_BLOCK).map(|t| smem_expected(t, trips)).collect();
    let bad = got
        .iter()
        .enumerate()
        .filter(|(i, g)| **g as f64 != want[i % SMEM_BLOCK as usize] as f64)
        .count();
    let verified = s.check(
        "shared-memory read",
        (bad > 0).then(|| format!("{bad} of {threads} thread sums differ from the host")),
    );
    let mut clock_samples = Vec::new();
    let secs = s.gpu.time_runs(2, s.opts.runs, || {
        run(&mut out, &mut clocks)?;
        Ok(())
    })?;
    // The clock of the last timed run, per block: cycles over nanoseconds.
    let c = download(&stream, &clocks, "read block clocks")?;
    for b in c.chunks_exact(4) {
        let (cycles, ns) = (b[1].wrapping_sub(b[0]), b[3].wrapping_sub(b[2]));
        if ns > 0 {
            clock_samples.push(cycles as f64 / ns as f64 * 1e9);
        }
    }
    let clock = Stats::of(&clock_samples)
        .ok_or_else(|| ProbeError::Internal("smem_read: the global timer did not advance".into()))?
        .median;
    let bytes = threads as u64 * u64::from(trips) * SMEM_UNROLL * 16;
    let gbps = gbps_stats(bytes, &secs)?;
    let per_clk_sm = gbps.median * 1e9 / (f64::from(s.gpu.sm_count) * clock);
    Ok(Bandwidth {
        id: "smem_read".into(),
        level: "shared".into(),
        label: "ld.shared.v4 (16 B per thread), 8 loads in flight, conflict-free".into(),
        counted: "read".into(),
        bytes_per_run: bytes,
        gbps,
        launch: launch_text(&cfg),
        sm_clock_hz: Some(clock),
        bytes_per_clk_per_sm: Some(per_clk_sm),
        fraction_of_peak: Some(per_clk_sm / SMEM_BYTES_PER_CLK_PER_SM),
        verified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smem_expected_matches_a_direct_replay() {
        // Replay the kernel's loops literally for a few threads and trip counts.
        for trips in [1u32, 255, 256, 300, 1000] {
            for t in [0u32, 1, 77, 255] {
                let mut sum = 0u64;
                for r in 0..trips {
                    let base = (t + r) & (SMEM_BLOCK - 1);
                    for u in 0..SMEM_UNROLL as u32 {
                        sum += smem_value(base + 32 * u);
                    }
                }
                assert_eq!(smem_expected(t, trips), sum, "t={t} trips={trips}");
            }
        }
    }

    #[test]
    fn smem_sums_stay_exact_in_f32() {
        // Largest per-thread sum at the default trip count must be below 2^24.
        assert!(smem_expected(0, 8192 + 37) < 1 << 24);
    }
}
