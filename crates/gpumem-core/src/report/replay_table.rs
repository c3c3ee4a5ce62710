//! The table `gpumem replay` prints: one row per policy, side by side.

use crate::replay::PolicyResult;
use crate::units::format_size;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, ContentArrangement, Table};

/// Renders replay results for people.
pub fn render(trace_name: &str, events: usize, results: &[PolicyResult]) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(vec![
            "policy",
            "peak held",
            "peak live",
            "held/live",
            "driver calls",
            "est. driver time",
            "calls in last ¼",
            "host ns/op",
        ]);
    for r in results {
        let mut row = vec![
            Cell::new(&r.policy),
            Cell::new(format_size(r.peak_held_bytes)),
            Cell::new(format_size(r.peak_live_bytes)),
            Cell::new(format!("{:.4}", r.ratio)),
            Cell::new(r.driver_calls_total),
            Cell::new(format!("{:.3} s", r.est_driver_seconds)),
            Cell::new(r.calls_by_quarter[3]),
            Cell::new(format!("{:.0}", r.ns_per_op)),
        ];
        for c in row.iter_mut().skip(1) {
            *c = c.clone().set_alignment(CellAlignment::Right);
        }
        t.add_row(row);
    }
    let mut out = format!("{trace_name}: {events} events\n{t}\n");
    for r in results {
        if r.ooms > 0 {
            out.push_str(&format!(
                "{}: {} requests failed for lack of memory\n",
                r.policy, r.ooms
            ));
        }
        if let Some(f) = &r.fidelity {
            out.push_str(&format!(
                "fidelity of {} against the recorded allocator: segment allocations {} \
                 ({} recorded, {} simulated{}), peak held {:+.3}% ({} recorded)\n",
                r.policy,
                if f.segments_match { "match" } else { "differ" },
                f.trace_segments,
                f.sim_segments,
                f.first_mismatch
                    .map(|i| format!(", first difference at #{i}"))
                    .unwrap_or_default(),
                100.0 * f.peak_held_error,
                format_size(f.trace_peak_held)
            ));
        }
    }
    out
}
