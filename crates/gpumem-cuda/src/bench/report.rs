//! The benchmark's table for people: one row per case, one column per allocator, each gpumem
//! figure with its ratio to PyTorch's anchor, then the targets checked per policy.

use super::{anchor, target, Measurement, MT_CASE};
use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, ContentArrangement, Table};
use std::fmt::Write;

fn fmt_ns(ns: f64) -> String {
    if ns >= 100.0 {
        format!("{ns:.0}")
    } else {
        format!("{ns:.1}")
    }
}

/// Rows (case, threads) and columns (allocators) in the order first seen.
fn layout(ms: &[Measurement]) -> (Vec<(String, usize)>, Vec<String>) {
    let mut rows: Vec<(String, usize)> = Vec::new();
    let mut cols: Vec<String> = Vec::new();
    for m in ms {
        let r = (m.case.clone(), m.threads);
        if !rows.contains(&r) {
            rows.push(r);
        }
        if !cols.contains(&m.allocator) {
            cols.push(m.allocator.clone());
        }
    }
    (rows, cols)
}

/// The side-by-side table and the target check.
pub fn render(ms: &[Measurement]) -> String {
    let (rows, cols) = layout(ms);
    let device = ms.first().map_or("cuda", |m| m.device.as_str());
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic);
    let mut header = vec!["case".to_string(), "threads".to_string()];
    header.extend(cols.iter().cloned());
    header.extend(["PyTorch (anchor)".into(), "cudaMallocAsync (anchor)".into()]);
    t.set_header(header);
    for (case, threads) in &rows {
        let (torch, asynca, _) = anchor(case, *threads);
        let mut row = vec![case.clone(), threads.to_string()];
        for c in &cols {
            let cell = ms
                .iter()
                .find(|m| &m.case == case && m.threads == *threads && &m.allocator == c)
                .map_or_else(String::new, |m| match m.ratio_to_torch_anchor {
                    Some(r) if c.starts_with("gpumem:") => {
                        format!("{} ({r:.2}×)", fmt_ns(m.ns_per_op))
                    }
                    _ => fmt_ns(m.ns_per_op),
                });
            row.push(cell);
        }
        row.push(torch.map_or_else(String::new, fmt_ns));
        row.push(asynca.map_or_else(String::new, fmt_ns));
        t.add_row(row);
    }
    for i in 1..t.column_count() {
        if let Some(col) = t.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    let mut s = format!(
        "gpumem bench alloc ({device}): host ns per op (alloc or free), median of runs; \
         multi-thread rows: wall time ÷ all threads' ops; (×) = ÷ PyTorch's anchor\n{t}\n"
    );
    s.push_str(&targets(ms));
    s.push_str(&driver_calls(ms));
    s.push_str(&spread(ms));
    s
}

/// The slowest run over the fastest one above which a row's runs are taken to straddle two
/// conditions, such as two speeds of the host. The lent GPU machines switch between two
/// speeds about 1.45× apart (BENCHMARKS.md §4, session 49), while runs within one speed stay
/// within about 15 % of each other.
const SPREAD_LIMIT: f64 = 1.3;

/// gpumem's single-thread rows whose runs are more than 1.3× apart (`SPREAD_LIMIT`), each
/// with its runs: the host changed speed between them, or some runs made driver calls (growth,
/// remaps) and others none, so their median may mix the two and compare badly with a row
/// measured in one. Multi-thread runs also differ by what the threads met (a stream spilling
/// from a shared range, say), so they are left out.
pub fn spread(ms: &[Measurement]) -> String {
    let mut s = String::new();
    for m in ms
        .iter()
        .filter(|m| m.allocator.starts_with("gpumem:") && m.threads == 1)
    {
        // (No runs: nothing to compare; one run: hi / lo is 1. Neither is apart.)
        let Some((lo, hi)) = extent(&m.runs_ns_per_op) else {
            continue;
        };
        if lo > 0.0 && hi / lo > SPREAD_LIMIT {
            let runs: Vec<String> = m.runs_ns_per_op.iter().map(|&r| fmt_ns(r)).collect();
            let mut clocks = String::new();
            if !m.runs_clock_ghz.is_empty() {
                let c: Vec<String> = m.runs_clock_ghz.iter().map(|g| format!("{g:.2}")).collect();
                let _ = write!(clocks, " (core clock before each: {} GHz", c.join(", "));
                if !m.runs_on_cpu_share.is_empty() {
                    let c: Vec<String> = m
                        .runs_on_cpu_share
                        .iter()
                        .map(|s| format!("{:.0}", s * 100.0))
                        .collect();
                    let _ = write!(clocks, "; on a CPU {} % of each", c.join(", "));
                }
                clocks.push(')');
            }
            let _ = writeln!(
                s,
                "  {} {}×{}: runs {} ns per op{clocks}, {:.2}× apart: the median may mix two \
                 speeds of the host, or runs with and without driver calls; compare within one \
                 (docs/cuda.md)",
                m.allocator,
                m.case,
                m.threads,
                runs.join(", "),
                hi / lo
            );
        }
    }
    s
}

/// The smallest and the largest of `v`; `None` when it is empty.
pub fn extent(v: &[f64]) -> Option<(f64, f64)> {
    let lo = v.iter().copied().reduce(f64::min)?;
    let hi = v.iter().copied().reduce(f64::max)?;
    Some((lo, hi))
}

/// gpumem rows whose timed runs made driver calls: how many, and the host time they took (the
/// part of the ns per op that is the driver's, not the allocator's own bookkeeping).
pub fn driver_calls(ms: &[Measurement]) -> String {
    let mut s = String::new();
    for m in ms {
        if let (Some(n), Some(secs)) = (m.driver_calls_per_run, m.driver_seconds_per_run) {
            if n > 0.0 {
                let per_op = secs * 1e9 / m.ops_per_run.max(1) as f64;
                let _ = writeln!(
                    s,
                    "  driver calls in timed runs: {} {}×{}: {n:.1} per run, {:.3} ms per run ({} of the ns per op)",
                    m.allocator,
                    m.case,
                    m.threads,
                    secs * 1e3,
                    fmt_ns(per_op)
                );
            }
        }
        for n in &m.notes {
            let _ = writeln!(s, "  {} {}×{}: {n}", m.allocator, m.case, m.threads);
        }
    }
    s
}

/// One line per gpumem policy: each target of the issue, met or not.
pub fn targets(ms: &[Measurement]) -> String {
    let (_, cols) = layout(ms);
    let mut s = String::from("targets (≤ 40 ns same-size, ≤ 100 ns random, multi-thread falling to ≤ 40 ns at 8 threads):\n");
    for c in cols.iter().filter(|c| c.starts_with("gpumem:")) {
        let mine: Vec<&Measurement> = ms.iter().filter(|m| &m.allocator == c).collect();
        let mut parts = Vec::new();
        for m in &mine {
            if let Some(limit) = target(&m.case, m.threads) {
                let ok = m.ns_per_op <= limit;
                parts.push(format!(
                    "{}{} {} {}",
                    m.case,
                    if m.threads > 1 {
                        format!("×{}", m.threads)
                    } else {
                        String::new()
                    },
                    fmt_ns(m.ns_per_op),
                    if ok { "ok" } else { "MISSED" }
                ));
            }
        }
        let mut mt: Vec<&&Measurement> = mine.iter().filter(|m| m.case == MT_CASE).collect();
        mt.sort_by_key(|m| m.threads);
        if mt.len() > 1 {
            let falling = mt.windows(2).all(|w| w[1].ns_per_op < w[0].ns_per_op);
            let seq: Vec<String> = mt.iter().map(|m| fmt_ns(m.ns_per_op)).collect();
            parts.push(format!(
                "threads {}: {} {}",
                mt.iter()
                    .map(|m| m.threads.to_string())
                    .collect::<Vec<_>>()
                    .join("/"),
                seq.join(" → "),
                if falling { "falling ok" } else { "NOT FALLING" }
            ));
        }
        let _ = writeln!(s, "  {c}: {}", parts.join("; "));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(case: &str, threads: usize, allocator: &str, ns: f64) -> Measurement {
        let torch = anchor(case, threads).0;
        Measurement {
            case: case.into(),
            threads,
            allocator: allocator.into(),
            device: "cuda".into(),
            ns_per_op: ns,
            runs_ns_per_op: vec![ns],
            runs_clock_ghz: Vec::new(),
            runs_adds_per_cycle: Vec::new(),
            runs_on_cpu_share: Vec::new(),
            runs_waiting_share: Vec::new(),
            ops_per_run: 1,
            peak_held_bytes: None,
            driver_calls_per_run: None,
            driver_seconds_per_run: None,
            anchor_torch_ns: torch,
            ratio_to_torch_anchor: torch.map(|t| ns / t),
            notes: Vec::new(),
        }
    }

    #[test]
    fn table_has_ratios_and_targets() {
        let ms = vec![
            m("same_1MiB", 1, "gpumem:stitched", 22.8),
            m("same_1MiB", 1, "cudaMallocAsync", 400.0),
            m(MT_CASE, 1, "gpumem:stitched", 60.0),
            m(MT_CASE, 2, "gpumem:stitched", 40.0),
            m(MT_CASE, 8, "gpumem:stitched", 45.0),
        ];
        let s = render(&ms);
        assert!(s.contains("22.8 (0.10×)"), "{s}");
        // PyTorch's anchor for same_1MiB (228 ns, from `anchor`) is in its column of that row.
        let cells = |line: &str| -> Vec<String> {
            line.split(['│', '┆'])
                .map(|c| c.trim().to_string())
                .collect()
        };
        let header = cells(s.lines().find(|l| l.contains("PyTorch (anchor)")).unwrap());
        let col = header.iter().position(|c| c == "PyTorch (anchor)").unwrap();
        let row = s
            .lines()
            .map(cells)
            .find(|r| r.get(1).is_some_and(|c| c == "same_1MiB"))
            .unwrap_or_else(|| panic!("no same_1MiB row in\n{s}"));
        assert_eq!(row[col], "228", "{s}");
        assert!(s.contains("same_1MiB 22.8 ok"), "{s}");
        // 45 at 8 threads misses the 40 ns target, and 40 → 45 is not falling.
        assert!(s.contains(&format!("{MT_CASE}×8 45.0 MISSED")), "{s}");
        assert!(s.contains("60.0 → 40.0 → 45.0 NOT FALLING"), "{s}");
        // Single runs cannot be apart.
        assert!(!s.contains("apart"), "{s}");
    }

    #[test]
    fn extent_is_the_least_and_the_most() {
        assert_eq!(extent(&[]), None);
        assert_eq!(extent(&[2.0, 1.0, 3.0]), Some((1.0, 3.0)));
    }

    /// A row whose runs straddle the host's two speeds is named with its runs; rows within
    /// one speed, and rows that are not gpumem's, are not.
    #[test]
    fn runs_far_apart_are_named() {
        let with_runs = |allocator: &str, runs: &[f64]| Measurement {
            runs_ns_per_op: runs.to_vec(),
            ..m("random_512B_64MiB_live500", 1, allocator, runs[1])
        };
        let ms = vec![
            with_runs("gpumem:stitched", &[144.1, 103.4, 145.8]),
            with_runs("gpumem:caching", &[113.0, 110.1, 100.0]),
            Measurement {
                runs_clock_ghz: vec![2.6, 3.8, 2.6],
                ..with_runs("gpumem:buddy", &[81.5, 56.0, 82.0])
            },
            Measurement {
                runs_clock_ghz: vec![3.5, 3.5, 3.5],
                runs_on_cpu_share: vec![0.5, 0.99, 0.996],
                ..with_runs("gpumem:native", &[154.0, 77.0, 76.5])
            },
            with_runs("cudaMallocAsync", &[1000.0, 1500.0, 2000.0]),
            Measurement {
                runs_ns_per_op: vec![111.0, 60.0, 58.0],
                ..m(MT_CASE, 2, "gpumem:stitched", 60.0)
            },
        ];
        let s = spread(&ms);
        assert_eq!(s.lines().count(), 3, "{s}");
        assert!(
            s.contains("gpumem:stitched random_512B_64MiB_live500×1: runs 144, 103, 146 ns per op, 1.41× apart"),
            "{s}"
        );
        // Runs measured with the core's clock say it.
        assert!(
            s.contains("gpumem:buddy random_512B_64MiB_live500×1: runs 81.5, 56.0, 82.0 ns per op (core clock before each: 2.60, 3.80, 2.60 GHz), 1.46× apart"),
            "{s}"
        );
        // And the share of each run spent on a CPU, where measured.
        assert!(
            s.contains("runs 154, 77.0, 76.5 ns per op (core clock before each: 3.50, 3.50, 3.50 GHz; on a CPU 50, 99, 100 % of each), 2.01× apart"),
            "{s}"
        );
        // 113.0 / 100.0 = 1.13: one speed.
        assert!(!s.contains("caching"), "{s}");
        // Threads' runs differ by what they met, not only by the host's speed.
        assert!(!s.contains("×2"), "{s}");
        // The full report carries the line too.
        assert!(render(&ms).contains("1.41× apart"));
    }
}
