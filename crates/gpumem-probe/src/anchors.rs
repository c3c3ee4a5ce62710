//! Reference figures the probe is compared against, and datasheet rates it cannot measure.
//!
//! The H200 anchors are the project's measured table (shared/ANCHORS.md §4, one H200 141 GB,
//! driver 580, CUDA 13.0, measured with CuPy kernels). They are comparison points printed beside
//! what the probe measures on the card in hand, never substituted for a measurement.

/// ANCHORS.md §4 (and the NVML figure of §3), H200 141 GB.
pub mod h200 {
    /// 64 K 32-bit registers per SM.
    pub const REGISTERS_PER_SM: u64 = 65_536;
    /// Shared memory per SM (up to 228 KB).
    pub const SMEM_PER_SM: u64 = 233_472;
    /// L1 and shared memory together, per SM.
    pub const L1_PLUS_SMEM_PER_SM: u64 = 256 * 1024;
    pub const L2_BYTES: u64 = 62_914_560;
    pub const HBM_BYTES: u64 = 150_109_880_320;

    /// Pointer-chase latency in cycles, one thread.
    pub const LAT_SMEM_CYCLES: f64 = 28.6;
    pub const LAT_L1_CYCLES: f64 = 39.6;
    /// 8 MB set, both L2 partitions.
    pub const LAT_L2_CYCLES: f64 = 374.0;
    /// 2 GB set.
    pub const LAT_HBM_CYCLES: f64 = 672.0;
    /// The latency anchors by level, as the probe names its levels.
    pub const LATENCY_CYCLES: [(&str, f64); 4] = [
        ("shared", LAT_SMEM_CYCLES),
        ("L1", LAT_L1_CYCLES),
        ("L2", LAT_L2_CYCLES),
        ("HBM", LAT_HBM_CYCLES),
    ];

    /// The latency anchor of `level`, if it has one.
    pub fn latency_cycles(level: &str) -> Option<f64> {
        LATENCY_CYCLES
            .iter()
            .find(|(l, _)| *l == level)
            .map(|&(_, c)| c)
    }

    /// Device-to-device copy, bytes read plus bytes written.
    pub const HBM_COPY_GBPS: f64 = 4_253.0;
    pub const HBM_READ_GBPS: f64 = 4_376.0;
    /// Shared-memory read, all SMs (132 SM x 128 B/clk x 1.98 GHz = 33.4 TB/s peak).
    pub const SMEM_READ_GBPS: f64 = 32_700.0;
    /// NVML: 6016-bit bus / 8 x 3201 MHz x 2 (ANCHORS §3, which rounds it to 4.815 TB/s).
    pub const HBM_THEORETICAL_GBPS: f64 = 4_814.3;
    /// Dense bf16 tensor-core rate, vendor datasheet (ANCHORS §4 roofline: ~990 TFLOP/s).
    pub const BF16_DENSE_TFLOPS_DATASHEET: f64 = 990.0;
    /// Plain fp32 (FMA on CUDA cores), vendor datasheet for the SXM part (~67 TFLOP/s;
    /// .library H200 notes). Not in ANCHORS.md; used only by the built-in `--gpu h200` profile.
    pub const FP32_TFLOPS_DATASHEET: f64 = 67.0;
}

/// Targets of issue 7 on the H200.
pub mod targets {
    /// HBM copy, GB/s (the anchor copy was 4,253 GB/s; BabelStream copy 4.0 TB/s).
    pub const HBM_COPY_GBPS: f64 = 4_250.0;
    /// Shared-memory read as a fraction of 128 B/clk/SM at the measured clock.
    pub const SMEM_FRACTION_OF_PEAK: f64 = 0.95;
    /// Latency within this fraction of the anchor table.
    pub const LATENCY_TOLERANCE: f64 = 0.15;
}

/// Shared-memory bandwidth per SM per clock on sm_70 and later: 32 banks of 4 bytes.
pub const SMEM_BYTES_PER_CLK_PER_SM: f64 = 128.0;

/// fp32 FMA lanes per SM (one FMA = 2 FLOP per lane per clock) by compute capability, from the
/// CUDA C++ Programming Guide's table of arithmetic instruction throughput (32-bit floating-point
/// add, multiply, multiply-add: results per clock cycle per multiprocessor).
pub fn fp32_lanes_per_sm(major: i32, minor: i32) -> Option<u32> {
    match (major, minor) {
        (7, _) => Some(64),
        (8, 0) => Some(64),
        (8, 6) | (8, 7) | (8, 9) => Some(128),
        (9, 0) => Some(128),
        (10, _) | (12, _) => Some(128),
        _ => None,
    }
}

/// Combined L1 data cache and shared memory per SM, where the architecture documents it (the
/// driver has no attribute for L1). CUDA C++ Programming Guide, "Compute Capabilities":
/// 8.0: 192 KB; 8.6/8.9: 128 KB; 9.0: 256 KB; 10.0: 256 KB.
pub fn l1_plus_smem_per_sm(major: i32, minor: i32) -> Option<u64> {
    let kb = match (major, minor) {
        (8, 0) => 192,
        (8, 6) | (8, 9) => 128,
        (9, 0) => 256,
        (10, 0) => 256,
        _ => return None,
    };
    Some(kb * 1024)
}

/// Dense bf16 tensor-core rate per SM per clock (FLOP, an FMA counting 2), from the vendor's
/// published per-GPU figures divided by SM count and the clock the figure was quoted at:
/// - sm_80, A100 SXM4 (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020): 312 TFLOP/s
///   dense bf16 = 108 SM x 1.41 GHz x 2048.
/// - sm_86, RTX A6000 (NVIDIA Ampere GA102 GPU Architecture whitepaper): 154.8 TFLOP/s dense
///   = 84 SM x 1.80 GHz x 1024.
/// - sm_89, L40S (NVIDIA L40S datasheet): 362 TFLOP/s dense bf16 = 142 SM x ~2.49 GHz x 1024.
///   GeForce Ada parts run bf16 with fp32 accumulation at half this rate.
/// - sm_90, H100/H200 SXM (NVIDIA H100 Tensor Core GPU Architecture whitepaper; H200
///   datasheet): 989.4 TFLOP/s dense = 132 SM x 1.83 GHz x 4096.
/// - sm_100, B200 (NVIDIA HGX B200 datasheet: 4.5 PFLOP/s sparse, 2.25 dense): 8192 per SM per
///   clock, twice Hopper's, is inferred from 2.25 PFLOP/s over 148 SMs at ~1.86 GHz.
pub fn bf16_dense_flop_per_clk_per_sm(major: i32, minor: i32) -> Option<(f64, &'static str)> {
    match (major, minor) {
        (8, 0) => Some((
            2048.0,
            "A100 whitepaper: 312 TFLOP/s = 108 SM x 1.41 GHz x 2048",
        )),
        (8, 6) => Some((
            1024.0,
            "GA102 whitepaper: 154.8 TFLOP/s = 84 SM x 1.80 GHz x 1024",
        )),
        (8, 9) => Some((
            1024.0,
            "L40S datasheet: 362 TFLOP/s = 142 SM x 2.49 GHz x 1024",
        )),
        (9, 0) => Some((
            4096.0,
            "H100 whitepaper: 989.4 TFLOP/s = 132 SM x 1.83 GHz x 4096",
        )),
        (10, 0) => Some((
            8192.0,
            "B200 datasheet: 2.25 PFLOP/s dense over 148 SM (inferred)",
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datasheet_rates_reproduce_the_published_totals() {
        let (h100, _) = bf16_dense_flop_per_clk_per_sm(9, 0).unwrap();
        assert!((132.0 * 1.83e9 * h100 / 1e12 - 989.4).abs() < 0.5);
        let (a100, _) = bf16_dense_flop_per_clk_per_sm(8, 0).unwrap();
        assert!((108.0 * 1.41e9 * a100 / 1e12 - 311.9).abs() < 0.5);
        assert!(bf16_dense_flop_per_clk_per_sm(7, 5).is_none());
    }

    #[test]
    fn h200_theoretical_bandwidth_matches_nvml_arithmetic() {
        // The anchor is what the probe's own NVML arithmetic (`nvml::theoretical_gbps`, bus
        // width / 8 x memory clock x 2) gives for the H200's 6016-bit bus at 3201 MHz (ANCHORS
        // §3): 4814.304 GB/s, kept to one decimal.
        let gbps = crate::nvml::theoretical_gbps(6016, 3201);
        assert_eq!((gbps * 10.0).round() / 10.0, h200::HBM_THEORETICAL_GBPS);
        // 132 SM x 128 B/clk x 1.98 GHz = 33.4 TB/s (ANCHORS §4).
        assert!((132.0 * SMEM_BYTES_PER_CLK_PER_SM * 1.98e9 / 1e12 - 33.45).abs() < 0.01);
    }
}
