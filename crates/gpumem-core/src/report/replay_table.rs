//! The table `gpumem replay` prints: one row per policy, side by side.

use crate::reference::LowerReference;
use crate::replay::PolicyResult;
use crate::units::format_size;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, ContentArrangement, Table};

/// Renders replay results for people, with the trace's lower reference under the table when
/// it was computed.
pub fn render(
    trace_name: &str,
    events: usize,
    results: &[PolicyResult],
    reference: Option<&LowerReference>,
) -> String {
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
    if let Some(r) = reference {
        out.push_str(&format!(
            "lower reference (shared/ANCHORS.md §1): {:.4} of live, {} in {} pages at the peak, \
             with every block placed best-fit in one range and each page held only while a live \
             block touches it; not a strict bound (a policy may place better), but what free page \
             moves would give best fit\n",
            r.ratio,
            format_size(r.peak_page_bytes),
            format_size(r.page_bytes)
        ));
    }
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
    if let (Some(refr), Some(st)) = (reference, results.iter().find(|r| r.policy == "stitched")) {
        // Only ranges per stream keep the streams' blocks apart (`range:auto` shares the first
        // stream's range once a second stream comes).
        let per_stream = st.range == Some("stream");
        if per_stream && refr.streams >= 2 && st.ratio - refr.ratio > REFERENCE_GAP_HINT {
            out.push_str(&format!(
                "stitched holds {:.4} of live, {:.4} above the lower reference: each of the \
                 trace's {} streams places its blocks in a virtual range of its own, so blocks of \
                 different streams never share a page, where the reference puts them all in one \
                 range. Add `--conf range:shared` to place them in one range shared by the \
                 streams (docs/stitched.md, \"Several threads, each on its own stream\").\n",
                st.ratio,
                st.ratio - refr.ratio,
                refr.streams
            ));
        }
    }
    for r in results {
        for n in &r.notes {
            out.push_str(n);
            out.push('\n');
        }
        let moving = layout_calls_last_quarter(r);
        if r.policy == "stitched" && moving >= STEADY_CALLS_HINT {
            out.push_str(&format!(
                "stitched makes {} mapping calls and host waits in the last quarter of the trace (about {:.1} ms \
                 estimated): the layout keeps moving after warm-up, and in a real run these calls \
                 are host time. Add `--conf slack:0.08` to see what up to 8 % spare pages would \
                 save; `--remap-sites` lists the allocations that remap. In a run, the pool adds \
                 spare pages by itself once remapping keeps taking more than `remap_budget` of \
                 the time (a fifth by default; docs/stitched.md).\n",
                moving,
                1000.0 * r.est_seconds_by_quarter[3]
            ));
        }
    }
    for r in results {
        if let Some(line) = growth_hint(r) {
            out.push_str(&line);
        }
    }
    for r in results {
        out.push_str(&remap_sites(r, REMAP_SITES_SHOWN));
    }
    out
}

/// Under stitched with pages under 16 MiB (`big_page:off`, or a `big_page` under 16 MiB), a
/// pool of at least [`GROWTH_HINT_HELD`] grown in at least [`GROWTH_HINT_PAGES`] pages: what
/// growing cost, and the settings that cut it. Each
/// page is a handle, and the driver's cost is per handle (about 50 µs to create, map and set
/// access on an H200, BENCHMARKS.md §3, session 27), while pools this large stay within about
/// 1 % of live with 16 MiB pages (§1, session 25: 1.0027–1.0089 on the recorded traces of
/// 4–24 GiB; smaller pools do not, which is why it is not the default).
fn growth_hint(r: &PolicyResult) -> Option<String> {
    let page = r.page_bytes?;
    let created = r.driver_calls.get("cuMemCreate")?.as_u64()?;
    if r.policy != "stitched"
        || page >= 16 << 20
        || r.peak_held_bytes < GROWTH_HINT_HELD
        || created < GROWTH_HINT_PAGES
    {
        return None;
    }
    Some(format!(
        "stitched grew the pool to {} in {} pages of {} (about {:.2} s of driver calls in \
         all, {:.2} s in the first quarter of the trace): in a run, the steps that grow the \
         pool pay this as host time, about 50 µs per page on an H200, where PyTorch's \
         allocator grows by large cudaMalloc'ed segments. A pool this large stays within about \
         1 % of live with larger pages: add `--conf page:16MiB` to compare, or leave \
         `big_page` at its default (16 MiB pages once the pool holds 8 GiB; `big_after:4GiB` \
         from 4 GiB; docs/stitched.md, \"What it costs when the pool grows\").\n",
        format_size(r.peak_held_bytes),
        created,
        format_size(page),
        r.est_driver_seconds,
        r.est_seconds_by_quarter[0]
    ))
}

/// Pool size from which [`growth_hint`] speaks: the recorded traces that hold this much keep
/// within 1.009 of live with 16 MiB pages, the smaller ones do not.
const GROWTH_HINT_HELD: u64 = 4 << 30;

/// Pages made from which [`growth_hint`] speaks (2 GiB of 2 MiB pages, about 0.05 s).
const GROWTH_HINT_PAGES: u64 = 1024;

/// Rows of the remap-site table shown (`gpumem replay --remap-sites`); the JSON has them all.
const REMAP_SITES_SHOWN: usize = 12;

/// The allocations that remapped pages under one policy (`--remap-sites`), most pages first:
/// the sizes whose placement keeps landing on virtual pages whose physical page went
/// elsewhere. Empty when there were none or they were not recorded.
pub fn remap_sites(r: &PolicyResult, shown: usize) -> String {
    if r.remap_sites.is_empty() {
        return String::new();
    }
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(vec![
            "size asked",
            "stream",
            "allocations that remapped",
            "pages unmapped",
            "in the second half",
            "events",
        ]);
    for s in r.remap_sites.iter().take(shown) {
        let row = vec![
            Cell::new(format_size(s.size)),
            Cell::new(format!("{:#x}", s.stream)),
            Cell::new(s.allocations),
            Cell::new(s.pages),
            Cell::new(s.pages_second_half),
            Cell::new(format!("{}–{}", s.first_event, s.last_event)),
        ];
        t.add_row(
            row.into_iter()
                .map(|c| c.set_alignment(CellAlignment::Right))
                .collect::<Vec<_>>(),
        );
    }
    let total: u64 = r.remap_sites.iter().map(|s| s.pages).sum();
    let more = r.remap_sites.len().saturating_sub(shown);
    format!(
        "{}: allocations that unmapped pages to place their block, by size asked and stream \
         ({total} pages in all{}):\n{t}\n",
        r.policy,
        if more > 0 {
            format!("; {more} more sizes in --json")
        } else {
            String::new()
        }
    )
}

/// How far above the lower reference (as a share of live bytes) stitched must be on a
/// multi-stream trace for the table to say why: below it, per-stream ranges cost next to
/// nothing (on the recorded two-stream traces stitched is below the reference).
const REFERENCE_GAP_HINT: f64 = 0.01;

/// The calls of a trace's last quarter that a moving layout costs: virtual-memory calls and
/// host waits. Event records and queries are left out: the stitched policy records an event
/// where a page changes virtual page, also in a steady state that maps nothing. Without the
/// calls by kind (results made elsewhere), every call of the quarter.
fn layout_calls_last_quarter(r: &PolicyResult) -> u64 {
    const LAYOUT: [&str; 6] = [
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemUnmap",
        "cuMemRelease",
        "cuEventSynchronize",
    ];
    match r.calls_by_quarter_by_kind[3].as_object() {
        Some(kinds) => LAYOUT
            .iter()
            .filter_map(|k| kinds.get(*k).and_then(|v| v.as_u64()))
            .sum(),
        None => r.calls_by_quarter[3],
    }
}

/// Layout calls in a trace's last quarter from which the table points at the slack setting:
/// below it the steady state is (nearly) free of calls, as on fixed-shape training traces.
const STEADY_CALLS_HINT: u64 = 20;

#[cfg(test)]
mod tests {
    use super::*;

    fn result(policy: &str, last_quarter: u64) -> PolicyResult {
        PolicyResult {
            policy: policy.into(),
            range: None,
            page_bytes: None,
            peak_held_bytes: 2 << 30,
            peak_live_bytes: 2 << 30,
            ratio: 1.0,
            driver_calls: serde_json::Value::Null,
            driver_calls_total: 1000 + last_quarter,
            est_driver_seconds: 0.05,
            calls_by_quarter: [1000, 0, 0, last_quarter],
            calls_by_quarter_by_kind: Default::default(),
            est_seconds_by_quarter: [0.05, 0.0, 0.0, 0.0009],
            ooms: 0,
            allocs: 10,
            replay_seconds: 0.1,
            ns_per_op: 100.0,
            timeline: Vec::new(),
            fidelity: None,
            notes: Vec::new(),
            lower_reference: None,
            remap_sites: Vec::new(),
        }
    }

    #[test]
    fn steady_state_calls_point_at_the_slack_setting() {
        let out = render(
            "t",
            10,
            &[result("caching", 95), result("stitched", 95)],
            None,
        );
        assert!(
            out.contains("stitched makes 95 mapping calls and host waits in the last quarter"),
            "{out}"
        );
        assert!(out.contains("about 0.9 ms"), "{out}");
        assert_eq!(out.matches("slack:0.08").count(), 1, "{out}");
        let quiet = render("t", 10, &[result("stitched", 19)], None);
        assert!(!quiet.contains("slack"), "{quiet}");
        // By kind, event records do not count: 30 of them and 12 maps stay quiet, 21 maps
        // and host waits do not.
        let mut marks = result("stitched", 42);
        marks.calls_by_quarter_by_kind[3] =
            serde_json::json!({"cuEventRecord": 30, "cuMemMap": 12});
        let out = render("t", 10, &[marks.clone()], None);
        assert!(!out.contains("slack"), "{out}");
        marks.calls_by_quarter_by_kind[3] =
            serde_json::json!({"cuEventRecord": 30, "cuMemMap": 15, "cuEventSynchronize": 6});
        let out = render("t", 10, &[marks], None);
        assert!(
            out.contains("stitched makes 21 mapping calls and host waits"),
            "{out}"
        );
    }

    #[test]
    fn a_large_pool_grown_in_small_pages_points_at_larger_ones() {
        let mut st = result("stitched", 0);
        st.page_bytes = Some(2 << 20);
        st.peak_held_bytes = 23 << 30;
        st.driver_calls = serde_json::json!({"cuMemCreate": 11_892, "cuMemMap": 14_952});
        st.est_driver_seconds = 0.52;
        st.est_seconds_by_quarter = [0.49, 0.03, 0.0, 0.0];
        let out = render("t", 10, &[st.clone()], None);
        assert!(
            out.contains("stitched grew the pool to 23.00 GiB in 11892 pages of 2.00 MiB (about 0.52 s of driver calls in all, 0.49 s in the first quarter"),
            "{out}"
        );
        assert_eq!(out.matches("--conf page:16MiB").count(), 1, "{out}");
        // Already on 16 MiB pages, a small pool, little growth, or another policy: nothing.
        let mut big_pages = st.clone();
        big_pages.page_bytes = Some(16 << 20);
        let mut small = st.clone();
        small.peak_held_bytes = 3 << 30;
        let mut few = st.clone();
        few.driver_calls = serde_json::json!({"cuMemCreate": 1_000});
        let mut caching = st.clone();
        caching.policy = "caching".into();
        for r in [big_pages, small, few, caching] {
            let out = render("t", 10, &[r], None);
            assert!(!out.contains("page:16MiB"), "{out}");
        }
    }

    #[test]
    fn a_multi_stream_gap_to_the_reference_is_explained() {
        let reference = |streams| LowerReference {
            page_bytes: 2 << 20,
            peak_page_bytes: 768 << 20,
            peak_live_bytes: 748 << 20,
            ratio: 1.0272,
            range_bytes: 1 << 30,
            streams,
        };
        let mut st = result("stitched", 0);
        st.ratio = 1.0512;
        st.range = Some("stream");
        let out = render("t", 10, &[st.clone()], Some(&reference(5)));
        assert!(
            out.contains("lower reference (shared/ANCHORS.md §1): 1.0272 of live"),
            "{out}"
        );
        assert!(
            out.contains("stitched holds 1.0512 of live, 0.0240 above the lower reference: each of the trace's 5 streams"),
            "{out}"
        );
        assert!(out.contains("--conf range:shared"), "{out}");
        // Already in a shared range (from the start, or from the second stream on by
        // default): the line would be wrong.
        for range in ["shared", "auto"] {
            let mut shared = st.clone();
            shared.range = Some(range);
            let out = render("t", 10, &[shared], Some(&reference(5)));
            assert!(!out.contains("above the lower reference"), "{range}: {out}");
        }
        // One stream: the gap is not the ranges'; close to the reference: nothing to explain.
        let one = render("t", 10, &[st.clone()], Some(&reference(1)));
        assert!(!one.contains("above the lower reference"), "{one}");
        st.ratio = 1.0300;
        let close = render("t", 10, &[st], Some(&reference(5)));
        assert!(!close.contains("above the lower reference"), "{close}");
    }

    #[test]
    fn policy_notes_are_printed_under_the_table() {
        let mut r = result("stitched", 0);
        r.notes = vec!["stitched: the streams stopped taking each other's idle pages".into()];
        let out = render("t", 10, &[r], None);
        assert!(
            out.contains("\nstitched: the streams stopped taking each other's idle pages\n"),
            "{out}"
        );
    }
}
