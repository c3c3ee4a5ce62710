//! gpumem probe: the memory hierarchy of the GPU at hand, measured (issue 7).
//!
//! - capacity per level from device attributes;
//! - latency per level by a one-thread pointer chase, in cycles and in nanoseconds at the SM
//!   clock measured inside the kernel (clock64 against %globaltimer);
//! - bandwidth of HBM (copy, read), L2 and shared memory, with the spread over repeated runs;
//! - theoretical HBM bandwidth from NVML, the fp32 FMA peak, the roofline ridge;
//! - the element-wise add three ways, as a share of the measured copy peak.
//!
//! Kernels are CUDA C compiled at run time by NVRTC for the device's own architecture, so a
//! user needs no nvcc; the driver, NVRTC and NVML are all loaded at run time, so this crate
//! builds and its tests run on machines without them. [`intensity`] is the roofline
//! arithmetic behind `gpumem intensity`.
//!
//! ```no_run
//! let opts = gpumem_probe::ProbeOptions::default();
//! let report = gpumem_probe::run(&opts, &mut |msg| eprintln!("{msg}"))?;
//! println!("{}", gpumem_probe::render::probe_table(&report));
//! # Ok::<(), gpumem_probe::ProbeError>(())
//! ```

pub mod anchors;
pub mod error;
mod gpu;
mod hostdata;
pub mod intensity;
mod measure;
mod nvml;
pub mod render;
pub mod report;
pub mod stats;

pub use error::ProbeError;
pub use gpu::{driver_present, format_version, nvrtc_present};
pub use nvml::theoretical_gbps;
pub use report::*;

use measure::latency::{ChaseSpec, Order, Residency, Walker};
use measure::Session;
use serde::{Deserialize, Serialize};
use std::time::Instant;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Most timed runs per measurement (beyond it the run takes hours and says nothing new).
const MAX_RUNS: usize = 10_000;
/// Largest buffer any measurement may ask for: above every GPU made, and far from overflow.
const MAX_BUFFER: u64 = 1 << 40;

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Scope {
    /// Everything in the module docs.
    Full,
    /// Capacities, the HBM copy and the fp32 peak only: what `gpumem intensity` needs.
    Peaks,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Timed runs per bandwidth and compute measurement (the median is reported; at least 10).
    pub runs: usize,
    /// Bytes per array of the HBM copy and read (source and destination each this size).
    pub hbm_bytes: u64,
    /// Buffer read many times for the L2 bandwidth (must fit well inside L2).
    pub l2_read_bytes: u64,
    /// Set of the L2 pointer chase.
    pub l2_chase_bytes: u64,
    /// Set of the HBM pointer chase (far larger than L2).
    pub hbm_chase_bytes: u64,
    /// Floats per array of the element-wise add (a multiple of 1024).
    pub elementwise_elements: u64,
    /// Seed of every random input and permutation.
    pub seed: u64,
    pub scope: Scope,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            device: 0,
            runs: 20,
            hbm_bytes: 4 * GIB,
            l2_read_bytes: 16 * MIB,
            l2_chase_bytes: 8 * MIB,
            hbm_chase_bytes: 2 * GIB,
            elementwise_elements: 1 << 28,
            seed: 0x6770_756D_656D,
            scope: Scope::Full,
        }
    }
}

impl ProbeOptions {
    /// Smaller buffers (1 GiB) and the minimum of 10 runs, for a shorter run.
    pub fn quick() -> Self {
        ProbeOptions {
            runs: 10,
            hbm_bytes: GIB,
            elementwise_elements: 1 << 26,
            ..Default::default()
        }
    }

    /// Rejects options that cannot give a meaningful measurement.
    pub fn validate(&self) -> Result<(), ProbeError> {
        let bad = |m: String| Err(ProbeError::Options(m));
        if !(10..=MAX_RUNS).contains(&self.runs) {
            return bad(format!(
                "runs must be between 10 (median of >= 10) and {MAX_RUNS}, not {}",
                self.runs
            ));
        }
        if self.hbm_bytes < 64 * MIB
            || self.hbm_bytes > MAX_BUFFER
            || self.hbm_bytes % (16 * 1024) != 0
        {
            return bad(format!(
                "the HBM buffer must be a multiple of 16 KiB between 64 MiB and 1 TiB, not {}",
                self.hbm_bytes
            ));
        }
        if self.l2_read_bytes < MIB || self.l2_read_bytes > self.hbm_bytes {
            return bad("the L2 read buffer must be between 1 MiB and the HBM buffer".into());
        }
        if self.l2_chase_bytes < MIB {
            return bad("the L2 chase set must be at least 1 MiB".into());
        }
        if self.hbm_chase_bytes >= 16 * GIB {
            return bad(
                "the HBM chase set must be below 16 GiB (its 4-byte words are indexed by u32)"
                    .into(),
            );
        }
        if self.elementwise_elements == 0
            || self.elementwise_elements % 1024 != 0
            || self.elementwise_elements > MAX_BUFFER / 4
        {
            return bad(format!(
                "element-wise elements must be a positive multiple of 1024 of at most 2^38 \
                 (1 TiB of floats per array), not {}",
                self.elementwise_elements
            ));
        }
        Ok(())
    }
}

/// Runs the probe on `opts.device`, reporting each step through `progress`. Errors (no driver,
/// no device, no NVRTC, a failed driver call) come back as [`ProbeError`], never as a panic;
/// failed correctness checks are listed in [`ProbeReport::failed_checks`].
pub fn run(opts: &ProbeOptions, progress: &mut dyn FnMut(&str)) -> Result<ProbeReport, ProbeError> {
    opts.validate()?;
    // cudarc panics where a library symbol is missing; turn that into an error too.
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_inner(opts, progress)));
    match outcome {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(ProbeError::Internal(format!(
                "the probe stopped on an internal error (a panic, in gpumem or in the CUDA \
                 bindings): {msg}"
            )))
        }
    }
}

fn run_inner(
    opts: &ProbeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<ProbeReport, ProbeError> {
    let t0 = Instant::now();
    progress("opening the device and compiling the kernels with NVRTC");
    let gpu = gpu::Gpu::open(opts.device)?;
    progress(&format!(
        "{} (sm_{}{}, {} SMs), kernels compiled for {}",
        gpu.name, gpu.cc.0, gpu.cc.1, gpu.sm_count, gpu.compiled_for
    ));
    let capacity = measure::capacity::read(&gpu)?;
    let (free, _) = gpu
        .ctx
        .mem_get_info()
        .map_err(|e| ProbeError::driver("cuMemGetInfo", e))?;
    let need = (2 * opts.hbm_bytes).saturating_add(capacity.l2_bytes.saturating_mul(4));
    if (free as u64) < need {
        return Err(ProbeError::Options(format!(
            "the device has {} free, the HBM measurement needs {}: lower --hbm-size",
            render::fmt_bytes(free as u64),
            render::fmt_bytes(need)
        )));
    }
    if opts.scope == Scope::Full && opts.hbm_chase_bytes < 4 * capacity.l2_bytes {
        return Err(ProbeError::Options(format!(
            "the HBM chase set ({}) must be at least 4 x L2 ({})",
            render::fmt_bytes(opts.hbm_chase_bytes),
            render::fmt_bytes(capacity.l2_bytes)
        )));
    }
    if opts.hbm_bytes < 4 * capacity.l2_bytes {
        return Err(ProbeError::Options(format!(
            "the HBM buffer ({}) must be at least 4 x L2 ({})",
            render::fmt_bytes(opts.hbm_bytes),
            render::fmt_bytes(capacity.l2_bytes)
        )));
    }
    let device = DeviceSummary {
        ordinal: gpu.ordinal,
        name: gpu.name.clone(),
        uuid: gpu.uuid.clone(),
        compute_capability: gpu.cc,
        sm_count: gpu.sm_count,
        driver_version: gpu.driver_version,
        nvrtc_version: gpu.nvrtc_version,
        compiled_for: gpu.compiled_for.clone(),
        nominal_sm_clock_khz: gpu
            .attr_opt(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .map(|v| v as u64),
    };
    let (theoretical, theoretical_error) = match nvml::theoretical(&gpu.uuid) {
        Ok(t) => (Some(t), None),
        Err(e) => {
            progress(&format!("theoretical bandwidth unavailable: {e}"));
            (None, Some(e))
        }
    };
    let l2 = capacity.l2_bytes;
    let mut s = Session::new(gpu, opts, progress);

    let mut latency = Vec::new();
    if opts.scope == Scope::Full {
        let specs = [
            ChaseSpec {
                level: "shared",
                set_bytes: 16 * 1024,
                stride_bytes: 128,
                order: Order::Random,
                walker: Walker::Shared,
                steps: 1 << 16,
                warm: 1 << 10,
                repeats: 5,
                residency: Residency::Warm,
            },
            ChaseSpec {
                level: "L1",
                set_bytes: 16 * 1024,
                stride_bytes: 128,
                order: Order::Random,
                walker: Walker::L1,
                steps: 1 << 16,
                warm: 1 << 10,
                repeats: 5,
                residency: Residency::Warm,
            },
            // Two L2 figures. "L2" (the anchor's situation): lines the grid has just written,
            // read for the first time by the walking SM, so either L2 partition answers.
            ChaseSpec {
                level: "L2",
                set_bytes: opts.l2_chase_bytes.min(l2 / 2),
                stride_bytes: 128,
                order: Order::Random,
                walker: Walker::L2Only,
                steps: (opts.l2_chase_bytes.min(l2 / 2) / 128 / 8) as u32,
                warm: 0,
                repeats: 5,
                residency: Residency::Written,
            },
            // "L2 (re-read)": every line read once by the walker before timing. If Hopper keeps
            // a copy near the reading SM (as published near/far figures suggest), this is the
            // near partition's latency and the gap to "L2" is the far partition's share.
            ChaseSpec {
                level: "L2 (re-read)",
                set_bytes: opts.l2_chase_bytes.min(l2 / 2),
                stride_bytes: 128,
                order: Order::Random,
                walker: Walker::L2Only,
                steps: 1 << 16,
                warm: (opts.l2_chase_bytes.min(l2 / 2) / 128) as u32,
                repeats: 5,
                residency: Residency::Warm,
            },
            ChaseSpec {
                level: "HBM",
                set_bytes: opts.hbm_chase_bytes,
                stride_bytes: 128,
                order: Order::Random,
                walker: Walker::L2Only,
                steps: 1 << 15,
                warm: 1 << 10,
                repeats: 3,
                residency: Residency::Cold,
            },
            ChaseSpec {
                level: "HBM (page-local)",
                set_bytes: opts.hbm_chase_bytes,
                stride_bytes: 128,
                order: Order::PageLocal { page: 2 * MIB },
                walker: Walker::L2Only,
                steps: 1 << 15,
                warm: 1 << 10,
                repeats: 3,
                residency: Residency::Cold,
            },
        ];
        for (i, spec) in specs.iter().enumerate() {
            s.say(&format!(
                "[latency {}/{}] pointer chase: {} ({} set, {} B stride)",
                i + 1,
                specs.len(),
                spec.level,
                render::fmt_bytes(spec.set_bytes),
                spec.stride_bytes
            ));
            let what = format!("{} latency", spec.level);
            latency.extend(s.attempt(&what, |s| measure::latency::measure(s, spec)));
        }
    }

    let mut bandwidth = Vec::new();
    if let Some(mut buf) = s.attempt("HBM buffers", |s| {
        measure::bandwidth::hbm_buffers(s, opts.hbm_bytes)
    }) {
        for v in measure::bandwidth::COPY_VARIANTS {
            bandwidth.extend(s.attempt(v.0, |s| measure::bandwidth::hbm_copy(s, &mut buf, v)));
        }
        if opts.scope == Scope::Full {
            let n4 = buf.host.len() / 4;
            bandwidth.extend(s.attempt("hbm_read", |s| {
                measure::bandwidth::read(
                    s,
                    &buf,
                    "hbm_read",
                    "HBM",
                    "read kernel (ld.global.cg, four 16 B loads in flight)",
                    n4,
                    1,
                )
            }));
            let l2_n4 = (opts.l2_read_bytes.min(l2 / 2) / 16) as usize;
            // Enough passes over the L2-resident buffer for 8 GiB of reads.
            let reps = ((8 * GIB) / (l2_n4 as u64 * 16)).clamp(10, 10_000) as u32;
            let label = format!(
                "{} read {reps} times (ld.global.cg: L1 bypassed)",
                render::fmt_bytes(l2_n4 as u64 * 16)
            );
            bandwidth.extend(s.attempt("l2_read", |s| {
                measure::bandwidth::read(s, &buf, "l2_read", "L2", &label, l2_n4, reps)
            }));
        }
    }
    if opts.scope == Scope::Full {
        bandwidth.extend(s.attempt("smem_read", |s| measure::bandwidth::shared(s, 8192 + 37)));
    }
    let hbm_copy_peak = bandwidth
        .iter()
        .filter(|b| b.id.starts_with("hbm_copy") && b.verified)
        .max_by(|a, b| a.gbps.median.total_cmp(&b.gbps.median))
        .map(|b| CopyPeak {
            id: b.id.clone(),
            gbps: b.gbps.median,
        });

    let fp32 = s.attempt("fp32 FMA peak", |s| measure::compute::fp32_peak(s, 4096));
    let (maj, min) = s.gpu.cc;
    let sm_count = s.gpu.sm_count;
    let bf16_datasheet = fp32.as_ref().and_then(|f| {
        anchors::bf16_dense_flop_per_clk_per_sm(maj, min).map(|(rate, source)| DatasheetPeak {
            what: "dense bf16 tensor-core peak (datasheet rate, not measured)".into(),
            flop_per_clk_per_sm: rate,
            sm_count,
            clock_hz: f.sm_clock_hz,
            tflops: rate * f64::from(sm_count) * f.sm_clock_hz / 1e12,
            source: source.into(),
        })
    });
    let roofline = hbm_copy_peak.as_ref().map(|p| Roofline {
        hbm_gbps: p.gbps,
        ridge_fp32: fp32
            .as_ref()
            .filter(|f| f.verified)
            .map(|f| f.tflops.median * 1e12 / (p.gbps * 1e9)),
        ridge_bf16_datasheet: bf16_datasheet
            .as_ref()
            .map(|d| d.tflops * 1e12 / (p.gbps * 1e9)),
    });

    let mut elementwise = Vec::new();
    if opts.scope == Scope::Full {
        let n = opts.elementwise_elements as usize;
        elementwise = s
            .attempt("element-wise add", |s| {
                measure::elementwise::add_three_ways(s, n)
            })
            .unwrap_or_default();
        if let Some(p) = &hbm_copy_peak {
            for e in &mut elementwise {
                e.fraction_of_copy_peak = Some(e.gbps.median / p.gbps);
            }
        }
    }

    let failed_checks = std::mem::take(&mut s.failed_checks);
    let errors = std::mem::take(&mut s.errors);
    let mut report = ProbeReport {
        schema: SCHEMA_VERSION,
        gpumem_version: env!("CARGO_PKG_VERSION").to_string(),
        device,
        capacity,
        theoretical,
        theoretical_error,
        latency,
        bandwidth,
        hbm_copy_peak,
        fp32,
        bf16_datasheet,
        roofline,
        elementwise,
        targets: Vec::new(),
        failed_checks,
        errors,
        runs_per_measurement: opts.runs,
        wall_seconds: 0.0,
    };
    report.targets = evaluate_targets(&report);
    report.wall_seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Issue 7's targets, for an H200 only (they are that card's figures): HBM copy >= 4.25 TB/s,
/// shared memory >= 95 % of 128 B/clk/SM, each latency within 15 % of ANCHORS §4.
pub fn evaluate_targets(r: &ProbeReport) -> Vec<Target> {
    use anchors::{h200, targets};
    if !r.device.name.contains("H200") {
        return Vec::new();
    }
    let mut out = Vec::new();
    if let Some(p) = &r.hbm_copy_peak {
        out.push(Target {
            name: "HBM copy".into(),
            requirement: format!(">= {:.0} GB/s", targets::HBM_COPY_GBPS),
            measured: format!("{:.0} GB/s ({})", p.gbps, p.id),
            met: p.gbps >= targets::HBM_COPY_GBPS,
        });
    }
    if let Some(b) = r.bandwidth_of("smem_read") {
        if let Some(f) = b.fraction_of_peak {
            out.push(Target {
                name: "shared-memory read".into(),
                requirement: format!(
                    ">= {:.0} % of 128 B/clk/SM",
                    targets::SMEM_FRACTION_OF_PEAK * 100.0
                ),
                measured: format!("{:.1} %", f * 100.0),
                met: f >= targets::SMEM_FRACTION_OF_PEAK && b.verified,
            });
        }
    }
    for (level, anchor) in h200::LATENCY_CYCLES {
        if let Some(l) = r.latency_of(level) {
            let ratio = l.cycles.median / anchor;
            out.push(Target {
                name: format!("{level} latency"),
                requirement: format!(
                    "within {:.0} % of {anchor} cycles",
                    targets::LATENCY_TOLERANCE * 100.0
                ),
                measured: format!(
                    "{:.1} cycles ({:+.1} %)",
                    l.cycles.median,
                    (ratio - 1.0) * 100.0
                ),
                met: (ratio - 1.0).abs() <= targets::LATENCY_TOLERANCE && l.verified,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_quick_options_are_valid() {
        ProbeOptions::default().validate().unwrap();
        ProbeOptions::quick().validate().unwrap();
    }

    #[test]
    fn bad_options_are_rejected_with_a_reason() {
        let o = ProbeOptions {
            runs: 3,
            ..Default::default()
        };
        assert!(o.validate().unwrap_err().to_string().contains("between 10"));
        let o = ProbeOptions {
            elementwise_elements: 1000,
            ..Default::default()
        };
        assert!(o.validate().unwrap_err().to_string().contains("1024"));
        let o = ProbeOptions {
            hbm_bytes: 1 << 20,
            ..Default::default()
        };
        let e = o.validate().unwrap_err().to_string();
        assert!(
            e.contains("HBM buffer") && e.contains("between 64 MiB") && e.contains("1048576"),
            "{e}"
        );
    }

    /// Sizes that would overflow the arithmetic or could never be measured are refused before
    /// any work, with the range that would do.
    #[test]
    fn absurd_options_are_rejected_before_any_work() {
        let cases: [(ProbeOptions, &str); 4] = [
            (
                ProbeOptions {
                    hbm_bytes: 1 << 62,
                    ..Default::default()
                },
                "between 64 MiB and 1 TiB",
            ),
            (
                ProbeOptions {
                    runs: usize::MAX,
                    ..Default::default()
                },
                "between 10",
            ),
            (
                ProbeOptions {
                    elementwise_elements: 1 << 50,
                    ..Default::default()
                },
                "at most 2^38",
            ),
            (
                ProbeOptions {
                    hbm_chase_bytes: 16 * GIB,
                    ..Default::default()
                },
                "below 16 GiB",
            ),
        ];
        for (o, want) in cases {
            let e = o.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            // `run` validates first: it fails the same way with or without a driver.
            let e = run(&o, &mut |_| {}).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        // The largest accepted values are still accepted.
        ProbeOptions {
            hbm_bytes: MAX_BUFFER,
            runs: MAX_RUNS,
            elementwise_elements: MAX_BUFFER / 4,
            hbm_chase_bytes: 16 * GIB - 4096,
            ..Default::default()
        }
        .validate()
        .unwrap();
    }

    /// Without a driver (CI), `run` must fail with NoDriver, not panic. With one, the whole
    /// probe runs in the GPU test `probe_on_the_gpu` instead.
    #[test]
    fn no_driver_is_a_clear_error() {
        if driver_present() {
            eprintln!("not run: a CUDA driver is present (probe_on_the_gpu covers this machine)");
            return;
        }
        let err = run(&ProbeOptions::quick(), &mut |_| {}).unwrap_err();
        assert!(matches!(err, ProbeError::NoDriver), "{err}");
        assert!(err.to_string().contains("no CUDA driver"));
    }

    /// The whole probe on the GPU (quick sizes): every check passes, numbers are sane.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn probe_on_the_gpu() {
        let r = run(&ProbeOptions::quick(), &mut |m| eprintln!("{m}")).expect("probe runs");
        assert!(
            r.complete_and_correct(),
            "{:?} {:?}",
            r.errors,
            r.failed_checks
        );
        assert_eq!(r.latency.len(), 6);
        let lat = |l: &str| r.latency_of(l).unwrap().cycles.median;
        assert!(lat("shared") < lat("L1") && lat("L1") < lat("L2") && lat("L2") < lat("HBM"));
        // A line read before answers at least as fast as one read for the first time, and
        // both come from L2, well under HBM.
        assert!(lat("L1") < lat("L2 (re-read)") && lat("L2 (re-read)") <= lat("L2"));
        assert!(
            lat("L2") < 0.75 * lat("HBM"),
            "first-read L2 {} vs HBM {}",
            lat("L2"),
            lat("HBM")
        );
        let copy = r.hbm_copy_peak.as_ref().unwrap().gbps;
        if let Some(t) = &r.theoretical {
            assert!(
                copy < t.gbps * 1.02,
                "copy {copy} above theoretical {}",
                t.gbps
            );
        }
        assert!(r.bandwidth_of("l2_read").unwrap().gbps.median > copy);
        let smem = r.bandwidth_of("smem_read").unwrap();
        assert!(smem.fraction_of_peak.unwrap() < 1.02);
        assert_eq!(r.elementwise.len(), 3);
        let json = serde_json::to_string(&r).unwrap();
        let back: ProbeReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back.latency.len(), 6);
    }
}
