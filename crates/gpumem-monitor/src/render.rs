//! What the monitor prints: a table per sample (like `nvidia-smi -l`), or one JSON object
//! per line.

use crate::detect::{Alarm, GrowthDetector};
use crate::source::GpuSample;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use serde_json::json;

/// A size with two decimals in KiB, MiB, GiB or TiB. The unit is chosen on the printed
/// (rounded) figure, so that a value just under a unit never prints as "1024.00" of the one
/// below: 1 MiB − 1 byte is "1.00 MiB", not "1024.00 KiB". (gpumem-core's `format_size`
/// chooses on the unrounded value, and at exactly 1 MiB or 1 GiB it still prints the unit
/// below; the monitor prints through this one.)
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    loop {
        let text = format!("{v:.2}");
        let rounds_up = text.parse::<f64>().is_ok_and(|x| x >= 1024.0);
        if !rounds_up || unit + 1 == UNITS.len() {
            return format!("{text} {}", UNITS[unit]);
        }
        v /= 1024.0;
        unit += 1;
    }
}

/// A span of time with three significant digits and a unit that fits: "250 ms", "1.5 s",
/// "30 s", "5 min", "2 h".
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return format!("{secs} s");
    }
    let (v, unit) = if secs < 1.0 {
        (secs * 1000.0, "ms")
    } else if secs < 120.0 {
        (secs, "s")
    } else if secs < 7200.0 {
        (secs / 60.0, "min")
    } else {
        (secs / 3600.0, "h")
    };
    let decimals = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    let text = format!("{v:.decimals$}");
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        &text
    };
    format!("{text} {unit}")
}

/// `HH:MM:SS` (UTC) of a Unix time.
pub fn clock(unix_s: f64) -> String {
    let s = unix_s.max(0.0) as u64 % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

fn rate(r: Option<f64>) -> String {
    match r {
        Some(r) if r.abs() >= 1024.0 => {
            let sign = if r < 0.0 { "-" } else { "+" };
            format!("{sign}{}/s", size(r.abs() as u64))
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
            right(Cell::new(size(g.used_bytes))),
            right(Cell::new(format!(
                "{} ({:.0}%)",
                size(g.total_bytes),
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
                    p.used_bytes.map(size).unwrap_or_else(|| "n/a".into()),
                )),
                Cell::new(""),
                Cell::new(""),
                Cell::new(""),
                right(Cell::new(rate(det.rate(g.index, Some(p.pid))))),
                right(Cell::new(
                    det.baseline(g.index, Some(p.pid))
                        .map(size)
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
            out.push_str(&format!(
                "  still growing ({}): {a}\n",
                duration(a.active_s)
            ));
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
    fn sizes_take_the_unit_their_rounded_value_fits() {
        const KIB: u64 = 1 << 10;
        const MIB: u64 = 1 << 20;
        const GIB: u64 = 1 << 30;
        assert_eq!(size(0), "0.00 KiB");
        assert_eq!(size(512), "0.50 KiB");
        assert_eq!(size(1023 * KIB + 512), "1023.50 KiB");
        // 1023.995 KiB and up would print as "1024.00 KiB": they are 1.00 MiB.
        assert_eq!(size(1023 * KIB + 1018), "1023.99 KiB");
        assert_eq!(size(MIB - 5), "1.00 MiB");
        assert_eq!(size(MIB - 1), "1.00 MiB");
        assert_eq!(size(MIB), "1.00 MiB");
        assert_eq!(size(MIB + MIB / 2), "1.50 MiB");
        assert_eq!(size(1023 * MIB + MIB / 2), "1023.50 MiB");
        assert_eq!(size(GIB - 1), "1.00 GiB");
        assert_eq!(size(GIB), "1.00 GiB");
        assert_eq!(size(80 * GIB), "80.00 GiB");
        assert_eq!(size(1024 * GIB - 1), "1.00 TiB");
        assert_eq!(size(u64::MAX), "16777216.00 TiB");
        // The rate column and the header use it: 1 MiB/s is not "1024.00 KiB/s".
        assert_eq!(rate(Some(MIB as f64)), "+1.00 MiB/s");
        assert_eq!(rate(Some(-((MIB - 1) as f64))), "-1.00 MiB/s");
    }

    #[test]
    fn durations_keep_sub_second_precision() {
        assert_eq!(duration(0.25), "250 ms");
        assert_eq!(duration(0.05), "50 ms");
        assert_eq!(duration(0.0015), "1.5 ms");
        assert_eq!(duration(0.001), "1 ms");
        assert_eq!(duration(1.0), "1 s");
        assert_eq!(duration(1.5), "1.5 s");
        assert_eq!(duration(29.998), "30 s");
        assert_eq!(duration(0.0999958), "100 ms");
        assert_eq!(duration(90.0), "90 s");
        assert_eq!(duration(300.0), "5 min");
        assert_eq!(duration(86_400.0), "24 h");
    }

    #[test]
    fn rates_are_signed_sizes() {
        assert_eq!(rate(Some(64.0 * 1048576.0)), "+64.00 MiB/s");
        assert_eq!(rate(Some(-2048.0)), "-2.00 KiB/s");
        assert_eq!(rate(Some(3.0)), "0");
        assert_eq!(rate(None), "");
    }
}
