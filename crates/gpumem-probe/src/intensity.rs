//! Roofline arithmetic for `gpumem intensity` (Williams, Waterman, Patterson, CACM 2009): a
//! kernel's arithmetic intensity (FLOP per byte of device memory traffic) against the ridge
//! point of a GPU (peak FLOP/s over bandwidth) says whether it is memory- or compute-bound, and
//! max(FLOPs / peak, bytes / bandwidth) is the time no implementation beats by much.
//!
//! Byte counts are the minimum traffic: every input read once, every output written once.

use crate::anchors::h200;
use crate::render::{fmt_bytes, new_table};
use crate::report::ProbeReport;
use comfy_table::{Cell, CellAlignment};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp32,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp32 => "fp32",
        }
    }

    pub fn parse(s: &str) -> Result<Dtype, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp16" | "f16" | "half" | "float16" => Ok(Dtype::Fp16),
            "fp32" | "f32" | "float" | "float32" => Ok(Dtype::Fp32),
            _ => Err(format!("unknown dtype {s:?} (bf16, fp16 or fp32)")),
        }
    }
}

/// The work to judge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Workload {
    /// FLOPs and bytes given directly; `dtype` picks the compute peak (bf16/fp16: tensor cores).
    Raw {
        flops: f64,
        bytes: f64,
        dtype: Dtype,
    },
    /// C[m x n] = A[m x k] B[k x n]: 2mnk FLOPs; A and B read once, C written once.
    Gemm {
        m: u64,
        n: u64,
        k: u64,
        dtype: Dtype,
    },
    /// `inputs` arrays in, `outputs` out, `flops_per_element` each (an add of two inputs: 1).
    Elementwise {
        elements: u64,
        inputs: u32,
        outputs: u32,
        flops_per_element: f64,
        dtype: Dtype,
    },
}

impl Workload {
    pub fn flops(&self) -> f64 {
        match *self {
            Workload::Raw { flops, .. } => flops,
            Workload::Gemm { m, n, k, .. } => 2.0 * m as f64 * n as f64 * k as f64,
            Workload::Elementwise {
                elements,
                flops_per_element,
                ..
            } => elements as f64 * flops_per_element,
        }
    }

    pub fn bytes(&self) -> f64 {
        match *self {
            Workload::Raw { bytes, .. } => bytes,
            Workload::Gemm { m, n, k, dtype } => {
                (m as f64 * k as f64 + k as f64 * n as f64 + m as f64 * n as f64)
                    * dtype.bytes() as f64
            }
            Workload::Elementwise {
                elements,
                inputs,
                outputs,
                dtype,
                ..
            } => elements as f64 * (f64::from(inputs) + f64::from(outputs)) * dtype.bytes() as f64,
        }
    }

    /// Which compute unit bounds it: tensor cores for bf16/fp16 matrix work (and raw figures
    /// in those types), the fp32 CUDA cores otherwise (element-wise work never uses tensor
    /// cores; an fp32 GEMM is counted without TF32).
    pub fn unit(&self) -> Unit {
        match *self {
            Workload::Raw { dtype, .. } | Workload::Gemm { dtype, .. } => match dtype {
                Dtype::Bf16 | Dtype::Fp16 => Unit::Tensor,
                Dtype::Fp32 => Unit::Fp32,
            },
            Workload::Elementwise { .. } => Unit::Fp32,
        }
    }

    pub fn describe(&self) -> String {
        match *self {
            Workload::Raw { flops, bytes, dtype } => {
                format!("{flops:.4e} FLOP over {} ({})", fmt_bytes(bytes as u64), dtype.name())
            }
            Workload::Gemm { m, n, k, dtype } => format!("GEMM {m} x {n} x {k}, {}", dtype.name()),
            Workload::Elementwise {
                elements,
                inputs,
                outputs,
                flops_per_element,
                dtype,
            } => format!(
                "element-wise, {elements} elements, {inputs} in / {outputs} out, {flops_per_element} FLOP each, {}",
                dtype.name()
            ),
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let ok = self.flops().is_finite() && self.bytes().is_finite();
        if !ok || self.flops() < 0.0 || self.bytes() <= 0.0 {
            return Err(format!(
                "the workload needs FLOPs >= 0 and bytes > 0 (got {} FLOP, {} bytes)",
                self.flops(),
                self.bytes()
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    Tensor,
    Fp32,
}

/// A rate and where it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rate {
    pub value: f64,
    pub source: String,
}

/// The ceilings of one GPU. Missing ones make [`analyze`] fail with a message saying which.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Peaks {
    /// Dense bf16/fp16 tensor-core FLOP/s.
    pub tensor_flops: Option<Rate>,
    /// fp32 FMA FLOP/s.
    pub fp32_flops: Option<Rate>,
    /// Device-memory bytes/s.
    pub bytes_per_s: Option<Rate>,
}

impl Peaks {
    /// The built-in H200 profile: ANCHORS.md §4's measured copy bandwidth and the datasheet's
    /// compute rates (the bf16 figure ANCHORS §4 uses for its ridge).
    pub fn h200() -> Peaks {
        Peaks {
            tensor_flops: Some(Rate {
                value: h200::BF16_DENSE_TFLOPS_DATASHEET * 1e12,
                source: "H200 profile: dense bf16, datasheet (ANCHORS.md §4)".into(),
            }),
            fp32_flops: Some(Rate {
                value: h200::FP32_TFLOPS_DATASHEET * 1e12,
                source: "H200 profile: fp32, datasheet".into(),
            }),
            bytes_per_s: Some(Rate {
                value: h200::HBM_COPY_GBPS * 1e9,
                source: "H200 profile: measured copy, ANCHORS.md §4".into(),
            }),
        }
    }

    /// Peaks from a probe run: measured HBM copy, measured fp32 FMA, datasheet-derived bf16.
    pub fn from_report(r: &ProbeReport) -> Peaks {
        let dev = &r.device.name;
        Peaks {
            tensor_flops: r.bf16_datasheet.as_ref().map(|b| Rate {
                value: b.tflops * 1e12,
                source: format!(
                    "{dev}: dense bf16, datasheet-derived ({} SMs x {:.0} FLOP/clk x {:.2} GHz)",
                    b.sm_count,
                    b.flop_per_clk_per_sm,
                    b.clock_hz / 1e9
                ),
            }),
            fp32_flops: r.fp32.as_ref().filter(|f| f.verified).map(|f| Rate {
                value: f.tflops.median * 1e12,
                source: format!("{dev}: fp32 FMA, measured by gpumem probe"),
            }),
            bytes_per_s: r.hbm_copy_peak.as_ref().map(|p| Rate {
                value: p.gbps * 1e9,
                source: format!("{dev}: HBM copy, measured by gpumem probe ({})", p.id),
            }),
        }
    }

    /// Replaces the given ceilings (command-line overrides).
    pub fn with_overrides(mut self, flops: Option<f64>, bytes_per_s: Option<f64>) -> Peaks {
        if let Some(f) = flops {
            let r = Rate {
                value: f,
                source: "given (--peak-flops)".into(),
            };
            self.tensor_flops = Some(r.clone());
            self.fp32_flops = Some(r);
        }
        if let Some(b) = bytes_per_s {
            self.bytes_per_s = Some(Rate {
                value: b,
                source: "given (--peak-bw)".into(),
            });
        }
        self
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bound {
    Memory,
    Compute,
}

/// The verdict for one workload on one GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Analysis {
    pub workload: Workload,
    pub description: String,
    pub flops: f64,
    pub bytes: f64,
    /// FLOP per byte.
    pub intensity: f64,
    pub unit: Unit,
    pub peak_flops: Rate,
    pub bytes_per_s: Rate,
    /// peak FLOP/s / bytes per second.
    pub ridge: f64,
    pub bound: Bound,
    /// flops / peak, seconds.
    pub compute_time_s: f64,
    /// bytes / bandwidth, seconds.
    pub memory_time_s: f64,
    /// max of the two.
    pub floor_s: f64,
}

pub fn analyze(w: &Workload, p: &Peaks) -> Result<Analysis, String> {
    w.validate()?;
    let unit = w.unit();
    let peak = match unit {
        Unit::Tensor => p.tensor_flops.clone().ok_or(
            "no tensor-core peak for this GPU: give --peak-flops (FLOP/s) or use --gpu h200",
        )?,
        Unit::Fp32 => p
            .fp32_flops
            .clone()
            .ok_or("no fp32 peak for this GPU: give --peak-flops (FLOP/s) or use --gpu h200")?,
    };
    let bw = p
        .bytes_per_s
        .clone()
        .ok_or("no memory bandwidth for this GPU: give --peak-bw (bytes/s) or use --gpu h200")?;
    if !(peak.value > 0.0 && bw.value > 0.0) {
        return Err("peak FLOP/s and bandwidth must be positive".into());
    }
    let flops = w.flops();
    let bytes = w.bytes();
    let intensity = flops / bytes;
    let ridge = peak.value / bw.value;
    let compute_time_s = flops / peak.value;
    let memory_time_s = bytes / bw.value;
    Ok(Analysis {
        workload: w.clone(),
        description: w.describe(),
        flops,
        bytes,
        intensity,
        unit,
        ridge,
        bound: if intensity < ridge {
            Bound::Memory
        } else {
            Bound::Compute
        },
        compute_time_s,
        memory_time_s,
        floor_s: compute_time_s.max(memory_time_s),
        peak_flops: peak,
        bytes_per_s: bw,
    })
}

/// Seconds in the most readable unit.
pub fn fmt_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} µs", s * 1e6)
    }
}

pub fn table(a: &Analysis) -> String {
    let mut t = new_table(&["", "value", "note"]);
    let unit = match a.unit {
        Unit::Tensor => "tensor cores",
        Unit::Fp32 => "fp32 CUDA cores",
    };
    let bound = match a.bound {
        Bound::Memory => "MEMORY-bound",
        Bound::Compute => "COMPUTE-bound",
    };
    let rows = [
        ("work", format!("{:.4e} FLOP", a.flops), String::new()),
        (
            "traffic",
            format!("{:.4e} B", a.bytes),
            format!(
                "{} (each input read once, each output written once)",
                fmt_bytes(a.bytes as u64)
            ),
        ),
        (
            "arithmetic intensity",
            format!("{:.4} FLOP/B", a.intensity),
            String::new(),
        ),
        (
            "peak compute",
            format!("{:.1} TFLOP/s", a.peak_flops.value / 1e12),
            format!("{unit}; {}", a.peak_flops.source),
        ),
        (
            "bandwidth",
            format!("{:.0} GB/s", a.bytes_per_s.value / 1e9),
            a.bytes_per_s.source.clone(),
        ),
        (
            "ridge point",
            format!("{:.1} FLOP/B", a.ridge),
            "peak compute / bandwidth".into(),
        ),
        (
            "compute time",
            fmt_time(a.compute_time_s),
            "FLOPs / peak compute".into(),
        ),
        (
            "memory time",
            fmt_time(a.memory_time_s),
            "bytes / bandwidth".into(),
        ),
        (
            "time floor",
            fmt_time(a.floor_s),
            format!(
                "max of the two; the {} term dominates",
                if a.memory_time_s >= a.compute_time_s {
                    "memory"
                } else {
                    "compute"
                }
            ),
        ),
        (
            "verdict",
            bound.to_string(),
            format!(
                "intensity {:.4} {} ridge {:.1}",
                a.intensity,
                if a.bound == Bound::Memory { "<" } else { ">=" },
                a.ridge
            ),
        ),
    ];
    for (k, v, n) in rows {
        t.add_row(vec![
            Cell::new(k),
            Cell::new(v).set_alignment(CellAlignment::Right),
            Cell::new(n),
        ]);
    }
    let mut o = String::new();
    let _ = writeln!(o, "gpumem intensity: {}", a.description);
    o.push_str(&t.to_string());
    o.push('\n');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        ((a - b) / b).abs() <= rel
    }

    #[test]
    fn gemm_8192_cubed_bf16_on_the_h200_profile() {
        let w = Workload::Gemm {
            m: 8192,
            n: 8192,
            k: 8192,
            dtype: Dtype::Bf16,
        };
        let a = analyze(&w, &Peaks::h200()).unwrap();
        // 2 * 8192^3 FLOP; (3 * 8192^2) bf16 elements of traffic.
        assert_eq!(a.flops, 1_099_511_627_776.0);
        assert_eq!(a.bytes, 402_653_184.0);
        assert!(close(a.intensity, 2_730.666_666, 1e-9), "{}", a.intensity);
        // 990e12 / 4253e9 = 232.777 FLOP/B.
        assert!(close(a.ridge, 232.7768, 1e-6), "{}", a.ridge);
        assert_eq!(a.bound, Bound::Compute);
        // 1.0995e12 / 990e12 = 1.110618 ms; 402.65 MB / 4253 GB/s = 94.675 µs.
        assert!(
            close(a.compute_time_s, 1.110_617_805e-3, 1e-8),
            "{}",
            a.compute_time_s
        );
        assert!(
            close(a.memory_time_s, 94.675_098e-6, 1e-6),
            "{}",
            a.memory_time_s
        );
        assert_eq!(a.floor_s, a.compute_time_s);
        assert_eq!(a.unit, Unit::Tensor);
    }

    #[test]
    fn elementwise_add_of_one_gi_floats_on_the_h200_profile() {
        let w = Workload::Elementwise {
            elements: 1 << 30,
            inputs: 2,
            outputs: 1,
            flops_per_element: 1.0,
            dtype: Dtype::Fp32,
        };
        let a = analyze(&w, &Peaks::h200()).unwrap();
        assert_eq!(a.flops, 1_073_741_824.0);
        assert_eq!(a.bytes, 12_884_901_888.0);
        assert!(close(a.intensity, 1.0 / 12.0, 1e-12));
        assert_eq!(a.bound, Bound::Memory);
        // 12.885 GB / 4253 GB/s = 3.02960 ms; 2^30 / 67e12 = 16.026 µs.
        assert!(close(a.floor_s, 3.029_602e-3, 1e-6), "{}", a.floor_s);
        assert!(
            close(a.compute_time_s, 16.025_997e-6, 1e-6),
            "{}",
            a.compute_time_s
        );
        assert_eq!(a.unit, Unit::Fp32);
        // Ridge on the fp32 units: 67e12 / 4253e9 = 15.75 FLOP/B.
        assert!(close(a.ridge, 15.753_586, 1e-6), "{}", a.ridge);
    }

    /// Input and output counts near u32::MAX add up in floating point, not in a wrapping u32.
    #[test]
    fn huge_array_counts_do_not_wrap() {
        let w = Workload::Elementwise {
            elements: 1024,
            inputs: u32::MAX,
            outputs: 1,
            flops_per_element: 1.0,
            dtype: Dtype::Fp32,
        };
        assert_eq!(w.bytes(), 1024.0 * 4_294_967_296.0 * 4.0);
        w.validate().unwrap();
    }

    #[test]
    fn raw_figures_with_given_peaks() {
        let p = Peaks {
            tensor_flops: None,
            fp32_flops: None,
            bytes_per_s: None,
        }
        .with_overrides(Some(100e12), Some(2e12));
        // Ridge 50 FLOP/B; intensity 40 -> memory-bound, floor = bytes / bw = 0.5 s.
        let w = Workload::Raw {
            flops: 40e12,
            bytes: 1e12,
            dtype: Dtype::Bf16,
        };
        let a = analyze(&w, &p).unwrap();
        assert_eq!(a.ridge, 50.0);
        assert_eq!(a.bound, Bound::Memory);
        assert_eq!(a.floor_s, 0.5);
        assert_eq!(a.compute_time_s, 0.4);
        // Exactly at the ridge counts as compute-bound.
        let w = Workload::Raw {
            flops: 50e12,
            bytes: 1e12,
            dtype: Dtype::Fp32,
        };
        assert_eq!(analyze(&w, &p).unwrap().bound, Bound::Compute);
    }

    #[test]
    fn missing_peaks_and_bad_workloads_are_explained() {
        let p = Peaks {
            tensor_flops: None,
            fp32_flops: None,
            bytes_per_s: None,
        };
        let w = Workload::Raw {
            flops: 1.0,
            bytes: 1.0,
            dtype: Dtype::Bf16,
        };
        assert!(analyze(&w, &p).unwrap_err().contains("--peak-flops"));
        let p = p.with_overrides(Some(1e12), None);
        assert!(analyze(&w, &p).unwrap_err().contains("--peak-bw"));
        let zero = Workload::Raw {
            flops: 1.0,
            bytes: 0.0,
            dtype: Dtype::Bf16,
        };
        assert!(analyze(&zero, &Peaks::h200()).is_err());
        assert!(Dtype::parse("int8").is_err());
        assert_eq!(Dtype::parse("BF16").unwrap(), Dtype::Bf16);
    }

    #[test]
    fn peaks_from_a_probe_report_use_measured_figures() {
        let r = crate::render::tests::sample_report();
        let p = Peaks::from_report(&r);
        assert_eq!(p.bytes_per_s.as_ref().unwrap().value, 4290e9);
        assert_eq!(p.fp32_flops.as_ref().unwrap().value, 65e12);
        assert!(p.bytes_per_s.unwrap().source.contains("measured"));
        // The sample report has no datasheet bf16 figure: a bf16 GEMM must say what is missing.
        let w = Workload::Gemm {
            m: 1024,
            n: 1024,
            k: 1024,
            dtype: Dtype::Bf16,
        };
        assert!(analyze(&w, &Peaks::from_report(&r)).is_err());
    }

    #[test]
    fn table_states_the_verdict_and_the_floor() {
        let w = Workload::Gemm {
            m: 8192,
            n: 8192,
            k: 8192,
            dtype: Dtype::Bf16,
        };
        let a = analyze(&w, &Peaks::h200()).unwrap();
        let text = table(&a);
        assert!(text.contains("GEMM 8192 x 8192 x 8192, bf16"));
        assert!(text.contains("COMPUTE-bound"));
        assert!(text.contains("1.111 ms"), "{text}");
        assert!(text.contains("94.675 µs"));
        assert!(text.contains("232.8 FLOP/B"));
        assert!(text.contains("2730.6667 FLOP/B"));
        assert!(text.contains("the compute term dominates"));
        assert!(text.contains("ANCHORS.md §4"));
        let json = serde_json::to_value(&a).unwrap();
        assert_eq!(json["bound"], "compute");
        assert_eq!(json["workload"]["kind"], "gemm");
    }

    #[test]
    fn time_formatting() {
        assert_eq!(fmt_time(2.5), "2.500 s");
        assert_eq!(fmt_time(0.0030296), "3.030 ms");
        assert_eq!(fmt_time(16.026e-6), "16.026 µs");
    }
}
