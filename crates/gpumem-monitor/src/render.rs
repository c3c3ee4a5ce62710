//! What the monitor prints: a table per sample (like `nvidia-smi -l`), or one JSON object
//! per line.

use crate::detect::{Alarm, GrowthDetector};
use crate::source::GpuSample;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use gpumem_core::units::format_size;
use serde_json::json;

/// `HH:MM:SS` (UTC) of a Unix time.
pub fn clock(unix_s: f64) -> String {
    let s = unix_s.max(0.0) as u64 % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

fn rate(r: Option<f64>) -> String {
    match r {
        Some(r) if r.abs() >= 1024.0 => {
            let sign = if r < 0.0 { "-" } else { "+" };
            format!("{sign}{}/s", format_size(r.abs() as u64))
        }
        Some(_) => "0".to_string(),
        None => String::new(),
    }
}

/// The table of one sample, with alarm lines under it.
pub fn table(
    sample: u64,
    unix_s: f64,
    gpus: &[GpuSample],
    det: &GrowthDetector,
    alarms: &[Alarm],
) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header(vec![
        "GPU",
        "name / process",
        "memory used",
        "of",
        "GPU util",
        "mem util",
        "growth",
        "baseline",
    ]);
    let right = |c: Cell| c.set_alignment(CellAlignment::Right);
    for g in gpus {
        let pct = |u: Option<u32>| u.map(|v| format!("{v}%")).unwrap_or_else(|| "n/a".into());
        t.add_row(vec![
            Cell::new(g.index),
            Cell::new(&g.name),
            right(Cell::new(format_size(g.used_bytes))),
            right(Cell::new(format!(
                "{} ({:.0}%)",
                format_size(g.total_bytes),
                100.0 * g.used_bytes as f64 / g.total_bytes.max(1) as f64
            ))),
            right(Cell::new(pct(g.util_gpu))),
            right(Cell::new(pct(g.util_mem))),
            right(Cell::new(rate(det.rate(g.index, None)))),
            right(Cell::new("")),
        ]);
        for p in &g.processes {
            let flagged = alarms
                .iter()
                .any(|a| a.gpu == g.index && a.pid == Some(p.pid));
            t.add_row(vec![
                Cell::new(""),
                Cell::new(format!(
                    "  pid {} {}{}",
                    p.pid,
                    p.name,
                    if flagged { "  LEAK?" } else { "" }
                )),
                right(Cell::new(
                    p.used_bytes
                        .map(format_size)
                        .unwrap_or_else(|| "n/a".into()),
                )),
                Cell::new(""),
                Cell::new(""),
                Cell::new(""),
                right(Cell::new(rate(det.rate(g.index, Some(p.pid))))),
                right(Cell::new(
                    det.baseline(g.index, Some(p.pid))
                        .map(format_size)
                        .unwrap_or_default(),
                )),
            ]);
        }
        if g.processes.is_empty() {
            t.add_row(vec!["", "  (no processes visible)", "", "", "", "", "", ""]);
        }
    }
    let mut out = format!("{} UTC  sample {sample}\n{t}\n", clock(unix_s));
    for a in alarms {
        if a.new {
            out.push_str(&format!("ALARM {a}\n"));
        } else {
            out.push_str(&format!("  still growing ({:.0} s): {a}\n", a.active_s));
        }
    }
    out
}

/// One sample as a JSON object.
pub fn json_sample(
    sample: u64,
    unix_s: f64,
    gpus: &[GpuSample],
    det: &GrowthDetector,
    alarms: &[Alarm],
) -> serde_json::Value {
    let gpus: Vec<serde_json::Value> = gpus
        .iter()
        .map(|g| {
            let procs: Vec<serde_json::Value> = g
                .processes
                .iter()
                .map(|p| {
                    json!({
                        "pid": p.pid,
                        "name": p.name,
                        "used_bytes": p.used_bytes,
                        "growth_bytes_per_s": det.rate(g.index, Some(p.pid)),
                        "baseline_bytes": det.baseline(g.index, Some(p.pid)),
                    })
                })
                .collect();
            json!({
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "used_bytes": g.used_bytes,
                "total_bytes": g.total_bytes,
                "util_gpu": g.util_gpu,
                "util_mem": g.util_mem,
                "growth_bytes_per_s": det.rate(g.index, None),
                "processes": procs,
            })
        })
        .collect();
    json!({
        "type": "sample",
        "sample": sample,
        "time": unix_s,
        "gpus": gpus,
        "alarms": alarms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_is_utc_time_of_day() {
        assert_eq!(clock(0.0), "00:00:00");
        assert_eq!(clock(86_400.0 * 3.0 + 3661.5), "01:01:01");
    }

    #[test]
    fn rates_are_signed_sizes() {
        assert_eq!(rate(Some(64.0 * 1048576.0)), "+64.00 MiB/s");
        assert_eq!(rate(Some(-2048.0)), "-2.00 KiB/s");
        assert_eq!(rate(Some(3.0)), "0");
        assert_eq!(rate(None), "");
    }
}
