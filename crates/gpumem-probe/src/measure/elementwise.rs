//! The element-wise add c = a + b three ways: naive scalar, coalesced and vectorised, and
//! deliberately strided; each checked exactly against the host on fresh random inputs.

use super::{bits, download, gbps_stats, launch_text, Session};
use crate::error::{DriverContext, ProbeError};
use crate::hostdata::{fill_random, mismatches_u32};
use crate::report::Elementwise;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use rand::RngExt;

const BLOCK: u32 = 256;

struct Variant {
    id: &'static str,
    kernel: &'static str,
    label: &'static str,
    /// true: n4 float4 elements over one full wave (grid-stride); false: one thread per float.
    vector: bool,
}

const VARIANTS: [Variant; 3] = [
    Variant {
        id: "add_scalar",
        kernel: "add_scalar",
        label: "naive scalar: one float per thread",
        vector: false,
    },
    Variant {
        id: "add_f4",
        kernel: "add_f4",
        label: "coalesced, vectorised: float4, grid-stride",
        vector: true,
    },
    Variant {
        id: "add_strided",
        kernel: "add_strided",
        label: "strided: lanes of a warp 128 B apart",
        vector: false,
    },
];

pub(crate) fn add_three_ways(s: &mut Session, n: usize) -> Result<Vec<Elementwise>, ProbeError> {
    if n == 0 || n % 1024 != 0 {
        return Err(ProbeError::Options(format!(
            "element-wise size {n} must be a positive multiple of 1024"
        )));
    }
    let mut a_host = vec![0f32; n];
    let mut b_host = vec![0f32; n];
    let mut a: CudaSlice<f32> = s.alloc(n, "element-wise input a")?;
    let mut b: CudaSlice<f32> = s.alloc(n, "element-wise input b")?;
    let mut c: CudaSlice<f32> = s.alloc(n, "element-wise output c")?;
    let bytes = 3 * n as u64 * 4;
    let mut out = Vec::new();
    for v in &VARIANTS {
        s.say(&format!("element-wise add: {}", v.label));
        // Fresh inputs for every variant: uniform in [-1, 1), multiples of 2^-24 (no
        // subnormal sums, so host and device round identically).
        let sa = s.seed();
        let sb = s.seed();
        fill_random(&mut a_host, sa, |r| {
            r.random_range(-(1 << 24)..(1 << 24)) as f32 / 16_777_216.0
        });
        fill_random(&mut b_host, sb, |r| {
            r.random_range(-(1 << 24)..(1 << 24)) as f32 / 16_777_216.0
        });
        s.gpu.stream.memcpy_htod(&a_host, &mut a).ctx("upload a")?;
        s.gpu.stream.memcpy_htod(&b_host, &mut b).ctx("upload b")?;
        {
            // SAFETY: poisoning c (NaN pattern) through a u32 view of the same length.
            let mut cu = unsafe { c.transmute_mut::<u32>(n) }
                .ok_or_else(|| ProbeError::Internal("view c as u32".into()))?;
            s.poison(&mut cu)?;
        }
        let f = s.gpu.func(v.kernel)?;
        let (cfg, count) = if v.vector {
            (s.gpu.full_wave(&f, BLOCK)?, (n / 4) as u64)
        } else {
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(BLOCK as usize) as u32, 1, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            (cfg, n as u64)
        };
        let stream = s.gpu.stream.clone();
        let run = |c: &mut CudaSlice<f32>| {
            let mut l = stream.launch_builder(&f);
            l.arg(&a).arg(&b).arg(c).arg(&count);
            // SAFETY: add_scalar and add_strided read a[i], b[i] and write c[i] for i < n
            // (count = n, a multiple of 1024, so add_strided's tile mapping stays below n);
            // add_f4 does so as float4 for i < n / 4 (count = n / 4). All three hold n floats.
            unsafe { l.launch(cfg) }
                .map(|_| ())
                .ctx(&format!("launch {}", v.kernel))
        };
        run(&mut c)?;
        let got = download(&stream, &c, &format!("run {}", v.kernel))?;
        let (bad, first) = mismatches_u32(bits(&got), |i| (a_host[i] + b_host[i]).to_bits());
        drop(got);
        let verified = s.check(
            v.id,
            (bad > 0)
                .then(|| format!("{bad} of {n} sums differ from the host (first at {first:?})")),
        );
        let secs = s.gpu.time_runs(2, s.opts.runs, || run(&mut c))?;
        out.push(Elementwise {
            id: v.id.to_string(),
            label: v.label.to_string(),
            elements: n as u64,
            bytes_per_run: bytes,
            gbps: gbps_stats(bytes, &secs)?,
            fraction_of_copy_peak: None,
            launch: launch_text(&cfg),
            verified,
        });
    }
    Ok(out)
}
