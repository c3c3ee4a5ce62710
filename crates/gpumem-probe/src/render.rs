//! Human tables of a [`ProbeReport`], with the H200 anchors (ANCHORS.md §4) side by side.

use crate::anchors::{h200, SMEM_BYTES_PER_CLK_PER_SM};
use crate::report::*;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, ContentArrangement, Table};
use std::fmt::Write;

/// "16 KiB", "2 GiB", "60 MiB", "1.50 GiB": binary units, exact when whole.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, size) in UNITS {
        if b >= size {
            return if b % size == 0 {
                format!("{} {name}", b / size)
            } else {
                format!("{:.2} {name}", b as f64 / size as f64)
            };
        }
    }
    format!("{b} B")
}

/// 62914560 -> "62,914,560".
pub fn thousands(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub(crate) fn new_table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.iter().map(Cell::new));
    t
}

fn right(s: impl ToString) -> Cell {
    Cell::new(s.to_string()).set_alignment(CellAlignment::Right)
}

fn ghz(hz: f64) -> String {
    format!("{:.3} GHz", hz / 1e9)
}

fn ratio(measured: f64, anchor: f64) -> String {
    format!("{:.2}", measured / anchor)
}

fn spread(s: &crate::stats::Stats, digits: usize) -> String {
    format!("{:.*}–{:.*}", digits, s.min, digits, s.max)
}

fn mark(ok: bool) -> &'static str {
    if ok {
        "ok"
    } else {
        "FAILED"
    }
}

/// The whole report: device, capacity, latency, bandwidth, compute and roofline, element-wise
/// add, targets, failed checks.
pub fn probe_table(r: &ProbeReport) -> String {
    let mut o = String::new();
    let d = &r.device;
    let _ = writeln!(
        o,
        "gpumem probe: {} (compute capability {}.{}, {} SMs), driver {}, {}, kernels: {}",
        d.name,
        d.compute_capability.0,
        d.compute_capability.1,
        d.sm_count,
        crate::format_version(d.driver_version),
        d.nvrtc_version
            .map(|(a, b)| format!("NVRTC {a}.{b}"))
            .unwrap_or_else(|| "no NVRTC".into()),
        d.compiled_for
    );
    let mut clocks = Vec::new();
    if let Some(l) = r.latency.first() {
        clocks.push(format!("{} (pointer chase)", ghz(l.sm_clock_hz)));
    }
    if let Some(c) = r.bandwidth_of("smem_read").and_then(|b| b.sm_clock_hz) {
        clocks.push(format!("{} (shared read)", ghz(c)));
    }
    if let Some(f) = &r.fp32 {
        clocks.push(format!("{} (fp32 FMA)", ghz(f.sm_clock_hz)));
    }
    let nominal = d
        .nominal_sm_clock_khz
        .map(|k| format!("; nominal maximum {}", ghz(k as f64 * 1e3)))
        .unwrap_or_default();
    let _ = writeln!(
        o,
        "SM clock measured inside the kernels (clock64 / globaltimer): {}{nominal}",
        clocks.join(", ")
    );
    let _ = writeln!(
        o,
        "Each figure: median of {} timed runs after warm-up; spread = min–max over the runs. Anchor: one H200, ANCHORS.md §4.\n",
        r.runs_per_measurement
    );

    o.push_str("Capacity (device attributes)\n");
    o.push_str(&capacity_table(r).to_string());
    o.push_str("\n\n");
    if !r.latency.is_empty() {
        o.push_str("Latency: one thread, dependent loads (pointer chase)\n");
        o.push_str(&latency_table(r).to_string());
        o.push_str("\n\n");
    }
    o.push_str("Bandwidth\n");
    o.push_str(&bandwidth_table(r).to_string());
    o.push('\n');
    if let Some(e) = &r.theoretical_error {
        let _ = writeln!(o, "(theoretical bandwidth not available: {e})");
    }
    o.push('\n');
    o.push_str("Compute and roofline\n");
    o.push_str(&compute_table(r).to_string());
    o.push_str("\n\n");
    if !r.elementwise.is_empty() {
        o.push_str("Element-wise add c = a + b (float32; bytes = 3 x N x 4)\n");
        o.push_str(&elementwise_table(r).to_string());
        o.push_str("\n\n");
    }
    if !r.targets.is_empty() {
        o.push_str("Targets (issue 7, H200)\n");
        let mut t = new_table(&["target", "requirement", "measured", "result"]);
        for x in &r.targets {
            t.add_row(vec![
                Cell::new(&x.name),
                Cell::new(&x.requirement),
                right(&x.measured),
                Cell::new(if x.met { "MET" } else { "NOT MET" }),
            ]);
        }
        o.push_str(&t.to_string());
        o.push('\n');
    } else {
        let _ = writeln!(
            o,
            "Targets: not evaluated ({} is not an H200, the card they are set for)",
            d.name
        );
    }
    if !r.errors.is_empty() {
        o.push_str("MEASUREMENTS THAT COULD NOT RUN:\n");
        for e in &r.errors {
            let _ = writeln!(o, "  - {e}");
        }
    }
    if r.failed_checks.is_empty() {
        o.push_str("Correctness: every kernel's output matched the host computation.\n");
    } else {
        o.push_str("CORRECTNESS CHECKS FAILED (the figures of these kernels are not valid):\n");
        for c in &r.failed_checks {
            let _ = writeln!(o, "  - {c}");
        }
    }
    o
}

fn capacity_table(r: &ProbeReport) -> Table {
    let c = &r.capacity;
    let mut t = new_table(&["level", "this GPU", "H200 anchor"]);
    let rows: Vec<(String, String, String)> = vec![
        (
            "registers per SM".into(),
            format!(
                "{} x 32-bit ({})",
                thousands(c.registers_per_sm),
                fmt_bytes(c.registers_per_sm * 4)
            ),
            format!("{} x 32-bit", thousands(h200::REGISTERS_PER_SM)),
        ),
        (
            "shared memory per SM".into(),
            format!(
                "{} ({} B)",
                fmt_bytes(c.smem_per_sm),
                thousands(c.smem_per_sm)
            ),
            format!("{} B", thousands(h200::SMEM_PER_SM)),
        ),
        (
            "shared memory per block".into(),
            format!(
                "{} default, {} opt-in",
                fmt_bytes(c.smem_per_block),
                fmt_bytes(c.smem_per_block_optin)
            ),
            "—".into(),
        ),
        (
            "L1 + shared per SM".into(),
            c.l1_plus_smem_per_sm
                .map(|b| format!("{} (architecture table)", fmt_bytes(b)))
                .unwrap_or_else(|| "not documented for this architecture".into()),
            fmt_bytes(h200::L1_PLUS_SMEM_PER_SM),
        ),
        (
            "L2".into(),
            format!("{} ({} B)", fmt_bytes(c.l2_bytes), thousands(c.l2_bytes)),
            format!("{} B", thousands(h200::L2_BYTES)),
        ),
        (
            "HBM (cuDeviceTotalMem)".into(),
            format!("{} ({} B)", fmt_bytes(c.hbm_bytes), thousands(c.hbm_bytes)),
            format!("{} B", thousands(h200::HBM_BYTES)),
        ),
    ];
    for (a, b, c) in rows {
        t.add_row(vec![Cell::new(a), right(b), right(c)]);
    }
    t
}

fn latency_table(r: &ProbeReport) -> Table {
    let mut t = new_table(&[
        "level",
        "set / stride / load",
        "cycles",
        "spread",
        "ns",
        "H200 anchor (cycles)",
        "ratio",
        "check",
    ]);
    for l in &r.latency {
        let anchor = h200::latency_cycles(&l.level);
        t.add_row(vec![
            Cell::new(&l.level),
            Cell::new(format!(
                "{} / {} B / {}",
                fmt_bytes(l.set_bytes),
                l.stride_bytes,
                l.load
            )),
            right(format!("{:.1}", l.cycles.median)),
            right(spread(&l.cycles, 1)),
            right(format!("{:.1}", l.ns.median)),
            right(anchor.map(|a| format!("{a}")).unwrap_or_else(|| "—".into())),
            right(
                anchor
                    .map(|a| ratio(l.cycles.median, a))
                    .unwrap_or_else(|| "—".into()),
            ),
            Cell::new(mark(l.verified)),
        ]);
    }
    t
}

fn bandwidth_anchor(id: &str) -> Option<f64> {
    match id {
        "hbm_read" => Some(h200::HBM_READ_GBPS),
        "smem_read" => Some(h200::SMEM_READ_GBPS),
        id if id.starts_with("hbm_copy") => Some(h200::HBM_COPY_GBPS),
        _ => None,
    }
}

fn bandwidth_table(r: &ProbeReport) -> Table {
    let mut t = new_table(&[
        "level",
        "measurement",
        "counted",
        "GB/s",
        "spread",
        "IQR",
        "H200 anchor",
        "ratio",
        "note",
        "check",
    ]);
    if let Some(th) = &r.theoretical {
        t.add_row(vec![
            Cell::new("HBM"),
            Cell::new(format!(
                "theoretical (NVML): {} bit / 8 x {} MHz x 2",
                th.bus_width_bits, th.max_memory_clock_mhz
            )),
            Cell::new("—"),
            right(format!("{:.0}", th.gbps)),
            right("—"),
            right("—"),
            right(format!("{:.0}", h200::HBM_THEORETICAL_GBPS)),
            right(ratio(th.gbps, h200::HBM_THEORETICAL_GBPS)),
            Cell::new(""),
            Cell::new(""),
        ]);
    }
    for b in &r.bandwidth {
        let anchor = bandwidth_anchor(&b.id);
        let mut note = Vec::new();
        if b.level == "HBM" {
            if let Some(th) = &r.theoretical {
                note.push(format!(
                    "{:.1} % of theoretical",
                    b.gbps.median / th.gbps * 100.0
                ));
            }
        }
        if let (Some(f), Some(c), Some(bpc)) =
            (b.fraction_of_peak, b.sm_clock_hz, b.bytes_per_clk_per_sm)
        {
            note.push(format!(
                "{bpc:.1} B/clk/SM = {:.1} % of {SMEM_BYTES_PER_CLK_PER_SM:.0} B/clk/SM at {}",
                f * 100.0,
                ghz(c)
            ));
        }
        if b.id == "l2_read" {
            note.push("published: 9.7–10.5 TB/s (gpu-benches, H200)".into());
        }
        if r.hbm_copy_peak.as_ref().is_some_and(|p| p.id == b.id) {
            note.push("copy peak".into());
        }
        t.add_row(vec![
            Cell::new(&b.level),
            Cell::new(&b.label),
            Cell::new(&b.counted),
            right(format!("{:.0}", b.gbps.median)),
            right(spread(&b.gbps, 0)),
            right(format!("{:.0}–{:.0}", b.gbps.q1, b.gbps.q3)),
            right(
                anchor
                    .map(|a| format!("{a:.0}"))
                    .unwrap_or_else(|| "—".into()),
            ),
            right(
                anchor
                    .map(|a| ratio(b.gbps.median, a))
                    .unwrap_or_else(|| "—".into()),
            ),
            Cell::new(note.join("; ")),
            Cell::new(mark(b.verified)),
        ]);
    }
    t
}

fn compute_table(r: &ProbeReport) -> Table {
    let mut t = new_table(&["figure", "value", "spread", "how", "H200 reference"]);
    if let Some(f) = &r.fp32 {
        let pct = f
            .theoretical_tflops
            .map(|th| {
                format!(
                    "; {:.1} % of SMs x lanes x 2 x clock = {th:.1}",
                    f.tflops.median / th * 100.0
                )
            })
            .unwrap_or_default();
        t.add_row(vec![
            Cell::new("fp32 FMA peak (measured)"),
            right(format!("{:.1} TFLOP/s", f.tflops.median)),
            right(spread(&f.tflops, 1)),
            Cell::new(format!(
                "kernel, {} at {}{pct} [{}]",
                f.launch,
                ghz(f.sm_clock_hz),
                mark(f.verified)
            )),
            right(format!(
                "~{:.0} TFLOP/s (datasheet)",
                h200::FP32_TFLOPS_DATASHEET
            )),
        ]);
    }
    if let Some(b) = &r.bf16_datasheet {
        t.add_row(vec![
            Cell::new("dense bf16 peak (DATASHEET-DERIVED)"),
            right(format!("{:.0} TFLOP/s", b.tflops)),
            right("—"),
            Cell::new(format!(
                "{:.0} FLOP/clk/SM x {} SMs x {} (not measured: needs a GEMM library); {}",
                b.flop_per_clk_per_sm,
                b.sm_count,
                ghz(b.clock_hz),
                b.source
            )),
            right(format!(
                "~{:.0} TFLOP/s (datasheet)",
                h200::BF16_DENSE_TFLOPS_DATASHEET
            )),
        ]);
    }
    if let Some(rf) = &r.roofline {
        if let Some(x) = rf.ridge_fp32 {
            t.add_row(vec![
                Cell::new("roofline ridge, fp32"),
                right(format!("{x:.1} FLOP/B")),
                right("—"),
                Cell::new(format!(
                    "measured fp32 peak / measured HBM copy {:.0} GB/s",
                    rf.hbm_gbps
                )),
                right("—"),
            ]);
        }
        if let Some(x) = rf.ridge_bf16_datasheet {
            t.add_row(vec![
                Cell::new("roofline ridge, dense bf16"),
                right(format!("{x:.1} FLOP/B")),
                right("—"),
                Cell::new(format!(
                    "datasheet-derived bf16 peak / measured HBM copy {:.0} GB/s",
                    rf.hbm_gbps
                )),
                right("~206 FLOP/B (990 TFLOP/s / 4.8 TB/s)"),
            ]);
        }
    }
    t
}

fn elementwise_table(r: &ProbeReport) -> Table {
    let mut t = new_table(&[
        "variant",
        "launch",
        "GB/s",
        "spread",
        "% of measured copy peak",
        "check",
    ]);
    for e in &r.elementwise {
        t.add_row(vec![
            Cell::new(&e.label),
            Cell::new(&e.launch),
            right(format!("{:.0}", e.gbps.median)),
            right(spread(&e.gbps, 0)),
            right(
                e.fraction_of_copy_peak
                    .map(|f| format!("{:.1} %", f * 100.0))
                    .unwrap_or_else(|| "—".into()),
            ),
            Cell::new(mark(e.verified)),
        ]);
    }
    t
}

/// One line per target, for scripts: "MET HBM copy: 4301 GB/s (...) [>= 4250 GB/s]".
pub fn targets_summary(r: &ProbeReport) -> String {
    let mut o = String::new();
    for t in &r.targets {
        let _ = writeln!(
            o,
            "{:7} {}: {} [{}]",
            if t.met { "MET" } else { "NOT MET" },
            t.name,
            t.measured,
            t.requirement
        );
    }
    o
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::stats::Stats;

    pub(crate) fn st(median: f64, min: f64, max: f64) -> Stats {
        Stats {
            n: 20,
            median,
            min,
            max,
            q1: (min + median) / 2.0,
            q3: (median + max) / 2.0,
        }
    }

    /// A report as an H200 run would produce it, with made-up but plausible numbers.
    pub(crate) fn sample_report() -> ProbeReport {
        let lat = |level: &str, set: u64, cyc: f64| Latency {
            level: level.into(),
            set_bytes: set,
            stride_bytes: 128,
            order: "random cyclic permutation of the lines".into(),
            load: "ld.global.cg.u32 (L2 only)".into(),
            steps: 65536,
            warm_steps: 1024,
            cycles: st(cyc, cyc - 0.2, cyc + 0.3),
            ns: st(cyc / 1.98, cyc / 1.98 - 0.1, cyc / 1.98 + 0.1),
            sm_clock_hz: 1.98e9,
            verified: true,
        };
        let bw = |id: &str, level: &str, gbps: f64| Bandwidth {
            id: id.into(),
            level: level.into(),
            label: id.into(),
            counted: "read + write".into(),
            bytes_per_run: 8 << 30,
            gbps: st(gbps, gbps - 20.0, gbps + 10.0),
            launch: "264 x 256 threads".into(),
            sm_clock_hz: None,
            bytes_per_clk_per_sm: None,
            fraction_of_peak: None,
            verified: true,
        };
        let mut smem = bw("smem_read", "shared", 32_900.0);
        smem.sm_clock_hz = Some(1.98e9);
        smem.bytes_per_clk_per_sm = Some(32_900e9 / (132.0 * 1.98e9));
        smem.fraction_of_peak = Some(32_900e9 / (132.0 * 1.98e9) / 128.0);
        let mut r = ProbeReport {
            schema: SCHEMA_VERSION,
            gpumem_version: "0.1.0".into(),
            device: DeviceSummary {
                ordinal: 0,
                name: "NVIDIA H200".into(),
                uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
                compute_capability: (9, 0),
                sm_count: 132,
                driver_version: 13000,
                nvrtc_version: Some((13, 0)),
                compiled_for: "sm_90".into(),
                nominal_sm_clock_khz: Some(1_980_000),
            },
            capacity: Capacity {
                registers_per_sm: 65536,
                registers_per_block: 65536,
                smem_per_sm: 233_472,
                smem_per_block: 49_152,
                smem_per_block_optin: 232_448,
                l1_plus_smem_per_sm: Some(256 * 1024),
                l2_bytes: 62_914_560,
                l2_persisting_max: 47_185_920,
                hbm_bytes: 150_109_880_320,
            },
            theoretical: Some(TheoreticalBandwidth {
                bus_width_bits: 6016,
                max_memory_clock_mhz: 3201,
                gbps: crate::theoretical_gbps(6016, 3201),
            }),
            theoretical_error: None,
            latency: vec![
                lat("shared", 16 << 10, 29.0),
                lat("L1", 16 << 10, 40.0),
                lat("L2", 8 << 20, 380.0),
                lat("HBM", 2 << 30, 800.0),
            ],
            bandwidth: vec![
                bw("hbm_copy_f4", "HBM", 4200.0),
                bw("hbm_copy_driver", "HBM", 4290.0),
                bw("l2_read", "L2", 10_100.0),
                smem,
            ],
            hbm_copy_peak: Some(CopyPeak {
                id: "hbm_copy_driver".into(),
                gbps: 4290.0,
            }),
            fp32: Some(ComputePeak {
                tflops: st(65.0, 64.5, 65.2),
                sm_clock_hz: 1.98e9,
                theoretical_tflops: Some(132.0 * 128.0 * 2.0 * 1.98e9 / 1e12),
                launch: "1056 x 256 threads".into(),
                verified: true,
            }),
            bf16_datasheet: None,
            roofline: Some(Roofline {
                hbm_gbps: 4290.0,
                ridge_fp32: Some(65e12 / 4290e9),
                ridge_bf16_datasheet: Some(1070e12 / 4290e9),
            }),
            elementwise: vec![Elementwise {
                id: "add_f4".into(),
                label: "coalesced, vectorised: float4, grid-stride".into(),
                elements: 1 << 28,
                bytes_per_run: 3 << 30,
                gbps: st(4100.0, 4050.0, 4120.0),
                fraction_of_copy_peak: Some(4100.0 / 4290.0),
                launch: "2112 x 256 threads".into(),
                verified: true,
            }],
            targets: vec![],
            failed_checks: vec![],
            errors: vec![],
            runs_per_measurement: 20,
            wall_seconds: 12.0,
        };
        r.targets = crate::evaluate_targets(&r);
        r
    }

    #[test]
    fn byte_formatting() {
        assert_eq!(fmt_bytes(16 * 1024), "16 KiB");
        assert_eq!(fmt_bytes(62_914_560), "60 MiB");
        assert_eq!(fmt_bytes(233_472), "228 KiB");
        assert_eq!(fmt_bytes(3 << 29), "1.50 GiB");
        assert_eq!(fmt_bytes(100), "100 B");
        assert_eq!(thousands(150_109_880_320), "150,109,880,320");
        assert_eq!(thousands(999), "999");
    }

    #[test]
    fn targets_are_judged_against_the_anchor_figures() {
        let r = sample_report();
        let get = |n: &str| r.targets.iter().find(|t| t.name == n).unwrap();
        assert!(get("HBM copy").met, "4290 >= 4250");
        assert!(
            get("shared-memory read").met,
            "32.9 TB/s is 98.3 % of 33.45"
        );
        assert!(get("shared latency").met, "29.0 vs 28.6");
        // 800 cycles is 19 % above the 672-cycle anchor: outside 15 %.
        let hbm = get("HBM latency");
        assert!(!hbm.met);
        assert!(hbm.measured.contains("+19.0 %"), "{}", hbm.measured);
        assert!(!r.all_targets_met());
    }

    #[test]
    fn targets_apply_to_the_h200_only() {
        let mut r = sample_report();
        r.device.name = "NVIDIA A100-SXM4-80GB".into();
        r.targets = crate::evaluate_targets(&r);
        assert!(r.targets.is_empty());
        assert!(probe_table(&r).contains("not an H200"));
    }

    #[test]
    fn table_shows_measured_anchor_and_ratio_side_by_side() {
        let r = sample_report();
        let text = probe_table(&r);
        // L2 latency row: 380 cycles beside the 374-cycle anchor, ratio 1.02.
        let l2 = text
            .lines()
            .find(|l| l.contains("│ L2 ") && l.contains("cg"))
            .unwrap();
        assert!(
            l2.contains("380.0") && l2.contains("374") && l2.contains("1.02"),
            "{l2}"
        );
        // Theoretical HBM from NVML figures, and the copy's share of it.
        assert!(text.contains("6016 bit / 8 x 3201 MHz x 2"));
        assert!(text.contains("┆  4814 ┆"), "theoretical GB/s");
        assert!(text.contains(&format!(
            "{:.1} % of theoretical",
            4290.0 / 4814.304 * 100.0
        )));
        // Shared memory as a share of 128 B/clk/SM.
        assert!(
            text.contains("125.9 B/clk/SM = 98.3 % of 128 B/clk/SM at 1.980 GHz"),
            "{text}"
        );
        // Element-wise add as a share of the copy peak.
        assert!(text.contains("95.6 %"));
        // The miss is visible.
        assert!(text.contains("NOT MET"));
        assert!(text.contains("every kernel's output matched"));
    }

    #[test]
    fn failed_checks_are_shown() {
        let mut r = sample_report();
        r.failed_checks
            .push("add_f4: 3 of 268435456 sums differ".into());
        r.elementwise[0].verified = false;
        let text = probe_table(&r);
        assert!(text.contains("CORRECTNESS CHECKS FAILED"));
        assert!(text.contains("add_f4: 3 of 268435456"));
        assert!(text.contains("FAILED"));
    }

    #[test]
    fn measurements_that_could_not_run_are_listed() {
        let mut r = sample_report();
        r.errors
            .push("l2_read: allocate 1 MiB for per-thread sums: CUDA driver error".into());
        assert!(!r.complete_and_correct());
        let text = probe_table(&r);
        assert!(text.contains("MEASUREMENTS THAT COULD NOT RUN"));
        assert!(text.contains("l2_read: allocate"));
    }

    /// `a` and `b` have the same keys, lengths and values, except that floats may differ in
    /// their last bit: serde_json (its `float_roundtrip` feature is off in this workspace)
    /// parses some decimals to the neighbouring f64 (14.646464646464647 is written and
    /// 14.646464646464649 read back), so an exact comparison of floats would fail.
    fn same_value(a: &serde_json::Value, b: &serde_json::Value, at: &str) {
        use serde_json::Value;
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                assert_eq!(
                    x.keys().collect::<Vec<_>>(),
                    y.keys().collect::<Vec<_>>(),
                    "{at}"
                );
                for (k, v) in x {
                    same_value(v, &y[k], &format!("{at}.{k}"));
                }
            }
            (Value::Array(x), Value::Array(y)) => {
                assert_eq!(x.len(), y.len(), "{at}");
                for (i, (v, w)) in x.iter().zip(y).enumerate() {
                    same_value(v, w, &format!("{at}[{i}]"));
                }
            }
            (Value::Number(x), Value::Number(y)) if x.is_f64() && y.is_f64() => {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                assert!(
                    (x - y).abs() <= f64::EPSILON * x.abs().max(y.abs()),
                    "{at}: {x} != {y}"
                );
            }
            _ => assert_eq!(a, b, "{at}"),
        }
    }

    #[test]
    fn report_round_trips_through_json() {
        let r = sample_report();
        let json = serde_json::to_string_pretty(&r).unwrap();
        let back: ProbeReport = serde_json::from_str(&json).unwrap();
        // Every field comes back: the report read back is exactly what the text says...
        let text: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(serde_json::to_value(&back).unwrap(), text);
        // ...and what was written, floats to within their last bit.
        same_value(
            &serde_json::to_value(&back).unwrap(),
            &serde_json::to_value(&r).unwrap(),
            "report",
        );
        assert_eq!(back.latency.len(), r.latency.len());
        assert_eq!(back.hbm_copy_peak.unwrap().gbps, 4290.0);
        assert_eq!(back.capacity.l2_bytes, 62_914_560);
    }

    /// tests/fixtures/synthetic_h200_report.json is `sample_report()` serialised: a report
    /// with made-up numbers (not a measurement) that other crates' tests read as a saved
    /// `gpumem probe --json`. Regenerate with GPUMEM_REGEN_FIXTURE=1 after a schema change.
    #[test]
    fn synthetic_fixture_is_current() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/synthetic_h200_report.json"
        );
        let json = serde_json::to_string_pretty(&sample_report()).unwrap() + "\n";
        if std::env::var_os("GPUMEM_REGEN_FIXTURE").is_some() {
            std::fs::write(path, &json).unwrap();
        }
        let on_disk = std::fs::read_to_string(path).expect("fixture exists");
        assert_eq!(
            on_disk, json,
            "fixture out of date: rerun with GPUMEM_REGEN_FIXTURE=1"
        );
    }
}
