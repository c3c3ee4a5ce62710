//! Timeline plots of replays: a self-contained HTML page (inline SVG, a few lines of inline
//! script for the hover read-out, nothing fetched from anywhere) with the bytes each policy
//! held from the device over the trace, and the bytes of live tensors beneath them.

use crate::replay::{PolicyResult, TimelinePoint};
use crate::units::format_size;
use std::fmt::Write as _;

/// Plot area inside the SVG (pixels).
const W: f64 = 960.0;
const H: f64 = 420.0;
const LEFT: f64 = 90.0;
const TOP: f64 = 40.0;
const RIGHT: f64 = 20.0;
const BOTTOM: f64 = 50.0;

/// Colours of the policies' lines (colour-blind safe), and of the live curve.
const COLOURS: [&str; 8] = [
    "#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#f0e442", "#000000",
];
const LIVE_COLOUR: &str = "#555555";

/// Colour and dash pattern of the `i`th policy's line, in the plot and in its legend: every
/// other line dashed, so that lines on top of each other stay visible.
fn line_style(i: usize) -> (&'static str, &'static str) {
    let dashes = if i % 2 == 1 { "7 4" } else { "none" };
    (COLOURS[i % COLOURS.len()], dashes)
}

/// How the x axis is measured.
#[derive(Debug, Clone, Copy, PartialEq)]
enum XAxis {
    /// Seconds of trace time since the first sample.
    Seconds { t0: u64 },
    /// Event index (when the trace has no usable times).
    Events,
}

impl XAxis {
    fn of(p: &TimelinePoint, axis: XAxis) -> f64 {
        match axis {
            XAxis::Seconds { t0 } => p.time_us.saturating_sub(t0) as f64 / 1e6,
            XAxis::Events => p.event as f64,
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" step (1, 2 or 5 times a power of ten, or of 1024 for bytes) giving about
/// `n` ticks over `[0, max]`.
fn nice_step(max: f64, n: f64, binary: bool) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let raw = max / n;
    let (base, unit) = if binary && raw >= 1024.0 {
        let k = (raw.log2() / 10.0).floor();
        (raw / 1024f64.powf(k), 1024f64.powf(k))
    } else {
        (raw, 1.0)
    };
    let mag = 10f64.powf(base.log10().floor());
    let m = base / mag;
    let step = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    step * mag * unit
}

/// Axis labels in one unit, the largest that keeps `max` at or above 1 of it, with as many
/// decimals as the step needs.
fn bytes_labeller(max: f64, step: f64) -> impl Fn(f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    while max >= 1024f64.powi(u as i32 + 1) && u + 1 < UNITS.len() {
        u += 1;
    }
    let unit = 1024f64.powi(u as i32);
    let s = step / unit;
    let decimals = if s >= 1.0 {
        0
    } else {
        (-s.log10()).ceil().max(1.0) as usize
    };
    move |v: f64| format!("{:.*} {}", decimals, v / unit, UNITS[u])
}

/// Numbers as a JSON array.
fn json_array<T: std::fmt::Display>(values: impl Iterator<Item = T>) -> String {
    let items: Vec<String> = values.map(|v| v.to_string()).collect();
    format!("[{}]", items.join(","))
}

/// A self-contained HTML page plotting bytes held and bytes live over the trace for each
/// policy. Fails if no result has timeline samples (replay with `timeline_points` > 0).
pub fn timeline_html(trace_name: &str, results: &[PolicyResult]) -> Result<String, String> {
    let plotted: Vec<&PolicyResult> = results.iter().filter(|r| !r.timeline.is_empty()).collect();
    if plotted.is_empty() {
        return Err(
            "no timeline samples to plot: the trace has no events to replay, or the replay \
             kept none (ReplayOptions::timeline_points > 0, which `gpumem replay --plot` sets)"
                .into(),
        );
    }
    let all = || plotted.iter().flat_map(|r| r.timeline.iter());
    // Trace time when it is there and moves forward, else event index.
    let t0 = all().map(|p| p.time_us).min().unwrap_or(0);
    let t1 = all().map(|p| p.time_us).max().unwrap_or(0);
    let monotone = plotted
        .iter()
        .all(|r| r.timeline.windows(2).all(|w| w[1].time_us >= w[0].time_us));
    let axis = if t1 > t0 && monotone {
        XAxis::Seconds { t0 }
    } else {
        XAxis::Events
    };
    let xmax = all()
        .map(|p| XAxis::of(p, axis))
        .fold(0.0, f64::max)
        .max(1e-9);
    let vmax = all().map(|p| p.held.max(p.live)).max().unwrap_or(0) as f64;
    let ystep = nice_step(vmax.max(1.0), 6.0, true);
    let ymax = ((vmax / ystep).ceil() * ystep).max(ystep);
    let xstep = nice_step(xmax, 8.0, false);
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let sx = |x: f64| LEFT + x / xmax * pw;
    let sy = |v: f64| TOP + ph - v / ymax * ph;

    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" id="plot" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12" data-x0="{LEFT}" data-y0="{TOP}" data-w="{pw}" data-h="{ph}" data-xmax="{xmax}" data-ymax="{ymax}" data-x="{}">"#,
        if axis == XAxis::Events {
            "events"
        } else {
            "seconds"
        }
    );
    // Grid and axes.
    let bytes_label = bytes_labeller(ymax, ystep);
    let mut v = 0.0;
    while v <= ymax + ystep / 2.0 {
        let y = sy(v);
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.2}" x2="{:.2}" y2="{y:.2}" stroke="#e5e5e5"/><text x="{:.2}" y="{:.2}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            bytes_label(v)
        );
        v += ystep;
    }
    let mut x = 0.0;
    while x <= xmax + xstep / 1e6 {
        let px = sx(x);
        let label = if axis == XAxis::Events {
            format!("{}", x.round() as u64)
        } else {
            format!("{}", (x * 1e6).round() / 1e6)
        };
        let _ = write!(
            svg,
            r##"<line x1="{px:.2}" y1="{TOP}" x2="{px:.2}" y2="{:.2}" stroke="#f0f0f0"/><text x="{px:.2}" y="{:.2}" text-anchor="middle">{label}</text>"##,
            TOP + ph,
            TOP + ph + 18.0
        );
        x += xstep;
    }
    let _ = write!(
        svg,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/><text x="{:.2}" y="{:.2}" text-anchor="middle">{}</text><text x="16" y="{:.2}" text-anchor="middle" transform="rotate(-90 16 {:.2})">bytes</text>"##,
        LEFT + pw / 2.0,
        H - 10.0,
        if axis == XAxis::Events {
            "trace event"
        } else {
            "trace time (s)"
        },
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    let path = |pts: &mut dyn Iterator<Item = (f64, f64)>| {
        let mut d = String::new();
        for (i, (x, y)) in pts.enumerate() {
            let _ = write!(d, "{}{:.2},{:.2}", if i == 0 { "M" } else { " L" }, x, y);
        }
        d
    };
    // Live bytes: the same requests for every policy; drawn from the first one as a filled
    // area under the lines.
    let live = &plotted[0].timeline;
    let mut area = path(
        &mut live
            .iter()
            .map(|p| (sx(XAxis::of(p, axis)), sy(p.live as f64))),
    );
    if let (Some(f), Some(l)) = (live.first(), live.last()) {
        let _ = write!(
            area,
            " L{:.2},{:.2} L{:.2},{:.2} Z",
            sx(XAxis::of(l, axis)),
            sy(0.0),
            sx(XAxis::of(f, axis)),
            sy(0.0)
        );
    }
    let _ = write!(
        svg,
        r#"<path class="live" d="{area}" fill="{LIVE_COLOUR}" fill-opacity="0.18" stroke="{LIVE_COLOUR}" stroke-width="1"><title>live tensors: peak {}</title></path>"#,
        format_size(plotted[0].peak_live_bytes)
    );
    for (i, r) in plotted.iter().enumerate() {
        let d = path(
            &mut r
                .timeline
                .iter()
                .map(|p| (sx(XAxis::of(p, axis)), sy(p.held as f64))),
        );
        let (colour, dashes) = line_style(i);
        let _ = write!(
            svg,
            r#"<path class="held" data-policy="{}" d="{d}" fill="none" stroke="{colour}" stroke-width="1.6" stroke-dasharray="{dashes}"><title>{}: peak held {} (held/live {:.3})</title></path>"#,
            escape(&r.policy),
            escape(&r.policy),
            format_size(r.peak_held_bytes),
            r.ratio
        );
    }
    // Legend.
    let mut ly = TOP + 8.0;
    for (i, r) in plotted.iter().enumerate() {
        let (colour, dashes) = line_style(i);
        let _ = write!(
            svg,
            r#"<line x1="{:.2}" y1="{ly:.2}" x2="{:.2}" y2="{ly:.2}" stroke="{colour}" stroke-width="3" stroke-dasharray="{dashes}"/><text x="{:.2}" y="{:.2}">{} held</text>"#,
            LEFT + 12.0,
            LEFT + 36.0,
            LEFT + 42.0,
            ly + 4.0,
            escape(&r.policy)
        );
        ly += 16.0;
    }
    let _ = write!(
        svg,
        r#"<rect x="{:.2}" y="{:.2}" width="24" height="8" fill="{LIVE_COLOUR}" fill-opacity="0.3"/><text x="{:.2}" y="{:.2}">live tensors</text>"#,
        LEFT + 12.0,
        ly - 4.0,
        LEFT + 42.0,
        ly + 4.0
    );
    let _ = write!(
        svg,
        r##"<line id="cursor" x1="0" y1="{TOP}" x2="0" y2="{:.2}" stroke="#999" visibility="hidden"/></svg>"##,
        TOP + ph
    );

    // The samples, for the hover read-out.
    let held: Vec<String> = plotted
        .iter()
        .map(|r| {
            let values = json_array(r.timeline.iter().map(|p| p.held));
            format!("\"{}\":{values}", escape(&r.policy))
        })
        .collect();
    let data = format!(
        "{{\"x\":{},\"live\":{},\"held\":{{{}}}}}",
        json_array(live.iter().map(|p| XAxis::of(p, axis))),
        json_array(live.iter().map(|p| p.live)),
        held.join(",")
    );

    let mut rows = String::new();
    for r in &plotted {
        let _ = write!(
            rows,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.4}</td><td>{}</td><td>{}</td></tr>",
            escape(&r.policy),
            format_size(r.peak_held_bytes),
            format_size(r.peak_live_bytes),
            r.ratio,
            r.driver_calls_total,
            r.ooms
        );
    }
    let title = format!("gpumem replay of {}", escape(trace_name));
    Ok(format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin-top: 12px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 10px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
#readout {{ font-family: monospace; white-space: pre; min-height: 6em; }}
</style></head>
<body>
<h2>{title}</h2>
<p>Bytes each policy held from the device (lines) and bytes of live tensors (shaded), over the
trace. Hover over the plot to read the values.</p>
{svg}
<div id="readout"></div>
<table><tr><th>policy</th><th>peak held</th><th>peak live</th><th>held/live</th><th>driver calls</th><th>failed requests</th></tr>
{rows}</table>
<script>
const data = {data};
const svg = document.getElementById("plot");
const cursor = document.getElementById("cursor");
const out = document.getElementById("readout");
const x0 = +svg.dataset.x0, w = +svg.dataset.w, xmax = +svg.dataset.xmax;
function size(b) {{
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (b >= 1024 && i < u.length - 1) {{ b /= 1024; i++; }}
  return b.toFixed(2) + " " + u[i];
}}
svg.addEventListener("mousemove", ev => {{
  const r = svg.getBoundingClientRect();
  const px = (ev.clientX - r.left) * (svg.viewBox.baseVal.width / r.width);
  const x = (px - x0) / w * xmax;
  if (x < 0 || x > xmax) {{ cursor.setAttribute("visibility", "hidden"); return; }}
  let lo = 0, hi = data.x.length - 1;
  while (lo < hi) {{ const m = (lo + hi) >> 1; if (data.x[m] < x) lo = m + 1; else hi = m; }}
  cursor.setAttribute("x1", px); cursor.setAttribute("x2", px);
  cursor.setAttribute("visibility", "visible");
  let t = (svg.dataset.x === "events" ? "event " : "t = ") + data.x[lo] +
    (svg.dataset.x === "events" ? "" : " s") + "\nlive tensors  " + size(data.live[lo]);
  for (const [p, v] of Object.entries(data.held)) t += "\n" + p.padEnd(14) + size(v[Math.min(lo, v.length - 1)]);
  out.textContent = t;
}});
</script>
</body></html>
"#
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{replay, ReplayOptions};
    use crate::trace::{Event, Kind, Trace};
    use crate::units::MIB;

    fn result(policy: &str, pts: &[(u64, u64, u64)]) -> PolicyResult {
        PolicyResult {
            policy: policy.into(),
            range: None,
            page_bytes: None,
            peak_held_bytes: pts.iter().map(|p| p.1).max().unwrap_or(0),
            peak_live_bytes: pts.iter().map(|p| p.2).max().unwrap_or(0),
            ratio: 1.0,
            driver_calls: serde_json::Value::Null,
            driver_calls_total: 0,
            est_driver_seconds: 0.0,
            calls_by_quarter: [0; 4],
            calls_by_quarter_by_kind: Default::default(),
            est_seconds_by_quarter: [0.0; 4],
            ooms: 0,
            allocs: 0,
            replay_seconds: 0.0,
            ns_per_op: 0.0,
            timeline: pts
                .iter()
                .enumerate()
                .map(|(i, &(t, held, live))| TimelinePoint {
                    event: i,
                    time_us: t,
                    held,
                    live,
                })
                .collect(),
            fidelity: None,
            notes: Vec::new(),
            lower_reference: None,
            remap_sites: Vec::new(),
        }
    }

    /// The numbers of a path's `d` attribute, as (x, y) pairs.
    fn points(d: &str) -> Vec<(f64, f64)> {
        d.split(|c: char| c == 'M' || c == 'L' || c == 'Z' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .map(|s| {
                let (x, y) = s.split_once(',').expect("x,y");
                (x.parse().unwrap(), y.parse().unwrap())
            })
            .collect()
    }

    /// Parses the page's SVG and returns, per held path, its policy and the values its points
    /// stand for (inverting the scale the SVG declares), plus the live area's values.
    type Curves = (Vec<(String, Vec<(f64, f64)>)>, Vec<(f64, f64)>, f64);

    /// ... and the tolerance on values: what two decimals of a pixel are worth, doubled.
    fn read_back(html: &str) -> Curves {
        let start = html.find("<svg").expect("an svg");
        let end = html.find("</svg>").expect("svg closed") + "</svg>".len();
        let doc = roxmltree::Document::parse(&html[start..end]).expect("well-formed SVG");
        let svg = doc.root_element();
        let num = |k: &str| svg.attribute(k).unwrap().parse::<f64>().unwrap();
        let (x0, y0, w, h, xmax, ymax) = (
            num("data-x0"),
            num("data-y0"),
            num("data-w"),
            num("data-h"),
            num("data-xmax"),
            num("data-ymax"),
        );
        let value = |(px, py): (f64, f64)| ((px - x0) / w * xmax, (y0 + h - py) / h * ymax);
        let mut held = Vec::new();
        let mut live = Vec::new();
        for n in svg.descendants().filter(|n| n.has_tag_name("path")) {
            let pts: Vec<(f64, f64)> = points(n.attribute("d").unwrap())
                .into_iter()
                .map(value)
                .collect();
            match n.attribute("class") {
                Some("held") => held.push((n.attribute("data-policy").unwrap().to_string(), pts)),
                Some("live") => live = pts,
                _ => {}
            }
        }
        (held, live, ymax / h * 0.02)
    }

    #[test]
    fn paths_carry_the_timeline_values() {
        // Times in µs: 0, 0.5 s, 1 s, 2 s.
        let a = result(
            "native",
            &[
                (10_000_000, 0, 0),
                (10_500_000, 20 * MIB, 8 * MIB),
                (11_000_000, 40 * MIB, 30 * MIB),
                (12_000_000, 40 * MIB, 2 * MIB),
            ],
        );
        let b = result(
            "stitched",
            &[
                (10_000_000, 0, 0),
                (10_500_000, 10 * MIB, 8 * MIB),
                (11_000_000, 32 * MIB, 30 * MIB),
                (12_000_000, 4 * MIB, 2 * MIB),
            ],
        );
        let html = timeline_html("toy <trace>", &[a.clone(), b.clone()]).unwrap();
        assert!(html.contains("gpumem replay of toy &lt;trace&gt;"));
        assert!(
            !html.contains("http://") || html.matches("http://").count() == 1,
            "only the SVG namespace"
        );
        assert!(!html.contains("src="), "nothing loaded from elsewhere");
        let (held, live, ymax_tol) = read_back(&html);
        assert_eq!(held.len(), 2, "one path per policy");
        for ((name, pts), r) in held.iter().zip([&a, &b]) {
            assert_eq!(name, &r.policy);
            assert_eq!(pts.len(), r.timeline.len());
            for (p, t) in pts.iter().zip(&r.timeline) {
                let secs = (t.time_us - 10_000_000) as f64 / 1e6;
                assert!((p.0 - secs).abs() < 0.01, "{p:?} vs {t:?}");
                assert!(
                    (p.1 - t.held as f64).abs() < ymax_tol,
                    "{name}: {p:?} vs {t:?}"
                );
            }
        }
        // The live area: the samples, then back along the axis.
        for (p, t) in live.iter().zip(&a.timeline) {
            assert!((p.1 - t.live as f64).abs() < ymax_tol);
        }
        assert_eq!(live.len(), a.timeline.len() + 2);
        assert!(html.contains("stitched: peak held 32.00 MiB"));
    }

    #[test]
    fn event_index_axis_when_times_are_missing() {
        let a = result(
            "buddy",
            &[(0, MIB, MIB), (0, 2 * MIB, MIB), (0, 4 * MIB, 3 * MIB)],
        );
        let html = timeline_html("t", &[a]).unwrap();
        assert!(html.contains(r#"data-x="events""#));
        assert!(html.contains("trace event"));
        let (held, _, _) = read_back(&html);
        let xs: Vec<f64> = held[0].1.iter().map(|p| p.0).collect();
        assert!(
            xs.iter()
                .zip([0.0, 1.0, 2.0])
                .all(|(x, e)| (x - e).abs() < 0.01),
            "{xs:?}"
        );
    }

    #[test]
    fn axis_labels_share_one_unit() {
        let l = bytes_labeller(2.4 * 1024f64.powi(3), 512.0 * 1024f64.powi(2));
        assert_eq!(l(0.0), "0.0 GiB");
        assert_eq!(l(1536.0 * 1024f64.powi(2)), "1.5 GiB");
        let l = bytes_labeller(40.0 * 1024f64.powi(2), 10.0 * 1024f64.powi(2));
        assert_eq!(l(30.0 * 1024f64.powi(2)), "30 MiB");
    }

    #[test]
    fn no_samples_is_an_error() {
        let e = timeline_html("t", &[result("native", &[])]).unwrap_err();
        assert!(e.contains("timeline_points"), "{e}");
    }

    #[test]
    fn a_replay_plots() {
        let mut events = Vec::new();
        for i in 0..50u64 {
            events.push(Event {
                kind: Kind::Alloc,
                stream: 0,
                addr: i,
                size: (i % 7 + 1) * MIB,
                time_us: 1000 * i,
            });
            if i % 3 == 0 {
                events.push(Event {
                    kind: Kind::FreeRequested,
                    stream: 0,
                    addr: i,
                    size: 0,
                    time_us: 1000 * i + 1,
                });
                events.push(Event {
                    kind: Kind::FreeCompleted,
                    stream: 0,
                    addr: i,
                    size: (i % 7 + 1) * MIB,
                    time_us: 1000 * i + 1,
                });
            }
        }
        let t = Trace {
            events,
            meta: Default::default(),
        };
        let opts = ReplayOptions {
            timeline_points: 40,
            ..Default::default()
        };
        let results: Vec<PolicyResult> = [crate::PolicyKind::Native, crate::PolicyKind::Stitched]
            .iter()
            .map(|&p| replay(&t, p, &opts, None).unwrap())
            .collect();
        let html = timeline_html("synthetic", &results).unwrap();
        let (held, _, tol) = read_back(&html);
        assert_eq!(held.len(), 2);
        for ((name, pts), r) in held.iter().zip(&results) {
            assert_eq!(name, &r.policy);
            assert_eq!(pts.len(), r.timeline.len());
            assert!(r.timeline.iter().any(|p| p.held > 0));
            for (p, t) in pts.iter().zip(&r.timeline) {
                assert!((p.1 - t.held as f64).abs() < tol, "{name}: {p:?} vs {t:?}");
            }
        }
    }
}
