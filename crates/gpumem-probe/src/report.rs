//! The probe's result: one serde type shared by the table, `--json`, `--probe-json` and tests.

use crate::stats::Stats;
use serde::{Deserialize, Serialize};

/// Current JSON layout version of [`ProbeReport`].
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeReport {
    pub schema: u32,
    pub gpumem_version: String,
    pub device: DeviceSummary,
    pub capacity: Capacity,
    /// From NVML; `None` with `theoretical_error` saying why where NVML could not say.
    pub theoretical: Option<TheoreticalBandwidth>,
    pub theoretical_error: Option<String>,
    pub latency: Vec<Latency>,
    pub bandwidth: Vec<Bandwidth>,
    /// The fastest HBM copy variant (median), the "measured copy peak" the rest refers to.
    pub hbm_copy_peak: Option<CopyPeak>,
    pub fp32: Option<ComputePeak>,
    pub bf16_datasheet: Option<DatasheetPeak>,
    pub roofline: Option<Roofline>,
    pub elementwise: Vec<Elementwise>,
    /// Issue 7's targets, evaluated where the device is an H200.
    pub targets: Vec<Target>,
    /// Correctness checks that failed (empty when every kernel's output matched the host).
    pub failed_checks: Vec<String>,
    /// Measurements that could not run, with the reason; the rest of the report is valid.
    pub errors: Vec<String>,
    pub runs_per_measurement: usize,
    pub wall_seconds: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceSummary {
    pub ordinal: usize,
    pub name: String,
    pub uuid: String,
    pub compute_capability: (i32, i32),
    pub sm_count: u32,
    /// Driver API version, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    /// NVRTC version (major, minor); `None` where the shipped PTX was used instead.
    pub nvrtc_version: Option<(i32, i32)>,
    /// What the kernels were built for: the `--gpu-architecture` NVRTC compiled for, or the
    /// shipped PTX.
    pub compiled_for: String,
    /// Nominal maximum SM clock from the device attribute, kHz.
    pub nominal_sm_clock_khz: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Capacity {
    pub registers_per_sm: u64,
    pub registers_per_block: u64,
    pub smem_per_sm: u64,
    pub smem_per_block: u64,
    pub smem_per_block_optin: u64,
    /// L1 and shared memory together, from the architecture table (no driver attribute).
    pub l1_plus_smem_per_sm: Option<u64>,
    pub l2_bytes: u64,
    pub l2_persisting_max: u64,
    pub hbm_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TheoreticalBandwidth {
    pub bus_width_bits: u32,
    pub max_memory_clock_mhz: u32,
    /// bus width / 8 x max memory clock x 2 (double data rate), GB/s.
    pub gbps: f64,
}

/// One pointer-chase latency measurement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Latency {
    /// "shared", "L1", "L2", "HBM" or "HBM (page-local)".
    pub level: String,
    pub set_bytes: u64,
    pub stride_bytes: u64,
    /// How the chain visits the set.
    pub order: String,
    /// The load instruction used.
    pub load: String,
    /// Dependent loads timed per launch (after `warm_steps` untimed ones).
    pub steps: u32,
    pub warm_steps: u32,
    /// Cycles per load (clock64), over the launches.
    pub cycles: Stats,
    /// Nanoseconds per load (globaltimer), over the launches.
    pub ns: Stats,
    /// The SM clock while the chase ran: cycles / ns, median over launches, Hz.
    pub sm_clock_hz: f64,
    pub verified: bool,
}

/// One streaming bandwidth measurement (GB/s = 1e9 bytes per second).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Bandwidth {
    pub id: String,
    pub level: String,
    pub label: String,
    /// What the byte count includes, e.g. "read + write".
    pub counted: String,
    pub bytes_per_run: u64,
    pub gbps: Stats,
    pub launch: String,
    /// SM clock measured inside the kernel (shared memory only), Hz.
    pub sm_clock_hz: Option<f64>,
    /// Achieved bytes per clock per SM at that clock (shared memory only).
    pub bytes_per_clk_per_sm: Option<f64>,
    /// Achieved / (128 B/clk/SM x SMs x measured clock) (shared memory only).
    pub fraction_of_peak: Option<f64>,
    pub verified: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CopyPeak {
    pub id: String,
    pub gbps: f64,
}

/// fp32 FMA throughput measured with a kernel.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ComputePeak {
    pub tflops: Stats,
    pub sm_clock_hz: f64,
    /// SMs x fp32 lanes x 2 x measured clock, TFLOP/s.
    pub theoretical_tflops: Option<f64>,
    pub launch: String,
    pub verified: bool,
}

/// A rate taken from the vendor's datasheet, not measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DatasheetPeak {
    pub what: String,
    pub flop_per_clk_per_sm: f64,
    pub sm_count: u32,
    /// The clock the figure is computed at (the one measured under the fp32 kernel), Hz.
    pub clock_hz: f64,
    pub tflops: f64,
    pub source: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Roofline {
    /// The bandwidth the ridges divide by: the measured HBM copy peak, GB/s.
    pub hbm_gbps: f64,
    /// Measured fp32 FMA peak / HBM bandwidth, FLOP per byte.
    pub ridge_fp32: Option<f64>,
    /// Datasheet-derived dense bf16 peak / HBM bandwidth, FLOP per byte.
    pub ridge_bf16_datasheet: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Elementwise {
    pub id: String,
    pub label: String,
    pub elements: u64,
    /// 3 x elements x 4 bytes (two inputs read, one output written).
    pub bytes_per_run: u64,
    pub gbps: Stats,
    /// Median / the measured HBM copy peak.
    pub fraction_of_copy_peak: Option<f64>,
    pub launch: String,
    pub verified: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Target {
    pub name: String,
    pub requirement: String,
    pub measured: String,
    pub met: bool,
}

impl ProbeReport {
    /// True when every target evaluated was met.
    pub fn all_targets_met(&self) -> bool {
        self.targets.iter().all(|t| t.met)
    }

    /// True when every measurement ran and every kernel's output matched the host.
    pub fn complete_and_correct(&self) -> bool {
        self.errors.is_empty() && self.failed_checks.is_empty()
    }

    pub fn latency_of(&self, level: &str) -> Option<&Latency> {
        self.latency.iter().find(|l| l.level == level)
    }

    pub fn bandwidth_of(&self, id: &str) -> Option<&Bandwidth> {
        self.bandwidth.iter().find(|b| b.id == id)
    }
}
