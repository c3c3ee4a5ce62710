//! `memory_summary`: the statistics as a text table in the layout of
//! `torch.cuda.memory_summary()` (same rows, columns, units and widths, so that eyes and
//! scripts used to PyTorch's table read this one), their JSON form, and the statistics of a
//! snapshot file (current figures from its segments, peaks and totals from its history).

use crate::stats::{MemoryStats, Pool, Stat, StatArray};
use crate::trace::pickle::{BlockState, Snapshot};
use crate::trace::Kind;
use crate::units::{round_up, MIN_BLOCK};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::BTreeMap;

/// Width of the table between its outer bars (PyTorch's).
const WIDTH: usize = 75;

/// How to render a summary.
#[derive(Debug, Clone)]
pub struct SummaryOptions {
    /// The title line ("gpumem memory summary, device 0").
    pub title: String,
    /// Only the "all" row of each metric, not the per-pool rows.
    pub abbreviated: bool,
    /// Metrics (stats names, e.g. "inactive_split") whose peak and totals are not known:
    /// shown as "n/a".
    pub current_only: Vec<&'static str>,
    /// Lines printed under the table.
    pub notes: Vec<String>,
}

impl Default for SummaryOptions {
    fn default() -> Self {
        Self {
            title: "gpumem memory summary".to_string(),
            abbreviated: false,
            current_only: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// The summary table of `stats`, per pool, in the layout of `torch.cuda.memory_summary()`.
pub fn memory_summary(stats: &MemoryStats) -> String {
    render_summary(stats, &SummaryOptions::default())
}

#[derive(Clone, Copy)]
enum Unit {
    Bytes,
    Count,
}

/// The metrics, in PyTorch's order, with PyTorch's row labels.
const METRICS: [(&str, &str, Unit); 9] = [
    ("allocated_bytes", "Allocated memory", Unit::Bytes),
    ("active_bytes", "Active memory", Unit::Bytes),
    ("requested_bytes", "Requested memory", Unit::Bytes),
    ("reserved_bytes", "GPU reserved memory", Unit::Bytes),
    ("inactive_split_bytes", "Non-releasable memory", Unit::Bytes),
    ("allocation", "Allocations", Unit::Count),
    ("active", "Active allocs", Unit::Count),
    ("segment", "GPU reserved segments", Unit::Count),
    ("inactive_split", "Non-releasable allocs", Unit::Count),
];

fn metric<'a>(s: &'a MemoryStats, name: &str) -> &'a StatArray {
    match name {
        "allocated_bytes" => &s.allocated_bytes,
        "active_bytes" => &s.active_bytes,
        "requested_bytes" => &s.requested_bytes,
        "reserved_bytes" => &s.reserved_bytes,
        "inactive_split_bytes" => &s.inactive_split_bytes,
        "allocation" => &s.allocation,
        "active" => &s.active,
        "segment" => &s.segment,
        "inactive_split" => &s.inactive_split,
        other => unreachable!("unknown metric {other}"),
    }
}

/// A byte count in a 10-character cell, in the unit chosen for `reference` (the "all" value
/// of the column): the largest of B, KiB, MiB... that keeps the reference at or above 768 of
/// it, as PyTorch's table does; values are truncated to whole units.
fn size_cell(value: i64, reference: i64) -> String {
    const UNITS: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut v, mut r, mut u) = (value, reference as f64, 0);
    while u + 1 < UNITS.len() && r >= 768.0 * 1024.0 {
        v = v.div_euclid(1024);
        r /= 1024.0;
        u += 1;
    }
    format!("{v:>6} {}", UNITS[u])
}

/// A count in a 10-character cell: plain, or in thousands (K) or millions (M) once the
/// reference reaches 750 of them.
fn count_cell(value: i64, reference: i64) -> String {
    const UNITS: [&str; 3] = [" ", "K", "M"];
    let (mut v, mut r, mut u) = (value, reference as f64, 0);
    while u + 1 < UNITS.len() && r >= 750.0 * 1000.0 {
        v = v.div_euclid(1000);
        r /= 1000.0;
        u += 1;
    }
    format!("{v:>7} {} ", UNITS[u])
}

/// One framed line; content wider than the frame (a long file name in the title, very large
/// counts) goes on as many more lines as it needs, broken at a space where there is one.
fn line(out: &mut String, content: &str) {
    let mut rest: Vec<char> = content.chars().collect();
    loop {
        let mut take = rest.len().min(WIDTH);
        if take < rest.len() {
            if let Some(sp) = rest[..take]
                .iter()
                .rposition(|&c| c == ' ')
                .filter(|&i| i > 0)
            {
                take = sp;
            }
        }
        out.push('|');
        out.extend(&rest[..take]);
        out.extend(std::iter::repeat_n(' ', WIDTH - take));
        out.push_str("|\n");
        // The rest goes on the next line, after one space of indent.
        let tail: Vec<char> = rest[take..]
            .iter()
            .copied()
            .skip_while(|&c| c == ' ')
            .collect();
        if tail.is_empty() {
            break;
        }
        rest = std::iter::once(' ').chain(tail).collect();
    }
}

fn centered(text: &str) -> String {
    let n = text.chars().count();
    let left = WIDTH.saturating_sub(n) / 2;
    format!("{}{text}", " ".repeat(left))
}

/// The summary table with options (title, abbreviation, unknown columns, notes).
pub fn render_summary(stats: &MemoryStats, opts: &SummaryOptions) -> String {
    let mut out = String::new();
    let rule = |c: &str| c.repeat(WIDTH);
    line(&mut out, &rule("="));
    line(&mut out, &centered(&opts.title));
    line(&mut out, &rule("-"));
    let half = WIDTH / 2;
    let ooms = format!("OOMs: {}", stats.num_ooms);
    let retries = format!("alloc retries: {}", stats.num_alloc_retries);
    line(
        &mut out,
        &format!(
            "{:^w1$}|{:^w2$}",
            ooms,
            retries,
            w1 = half,
            w2 = WIDTH - half - 1
        ),
    );
    line(&mut out, &rule("="));
    line(
        &mut out,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    );
    for (key, label, unit) in METRICS {
        line(&mut out, &rule("-"));
        let arr = metric(stats, key);
        let known = !opts.current_only.contains(&key);
        let mut rows: Vec<(&str, &Stat)> = vec![(label, &arr.all)];
        if !opts.abbreviated {
            rows.push(("      from large pool", &arr.large_pool));
            rows.push(("      from small pool", &arr.small_pool));
        }
        let reference = arr.all;
        for (name, s) in rows {
            let cell = |v: i64, r: i64| match unit {
                Unit::Bytes => size_cell(v, r),
                Unit::Count => count_cell(v, r),
            };
            let na = "    n/a   ".to_string();
            let (peak, alloc, freed) = if known {
                (
                    cell(s.peak, reference.peak),
                    cell(s.allocated, reference.allocated),
                    cell(s.freed, reference.freed),
                )
            } else {
                (na.clone(), na.clone(), na)
            };
            line(
                &mut out,
                &format!(
                    " {name:<21} | {} | {peak} | {alloc} | {freed} ",
                    cell(s.current, reference.current)
                ),
            );
        }
    }
    // gpumem never refuses to split a block (PyTorch's max_split_size is unlimited), so no
    // allocation or segment is "oversize": the rows are kept for the layout's sake.
    let zero = Stat::default();
    for label in ["Oversize allocations", "Oversize GPU segments"] {
        line(&mut out, &rule("-"));
        let c = count_cell(zero.current, 0);
        line(&mut out, &format!(" {label:<21} | {c} | {c} | {c} | {c} "));
    }
    line(&mut out, &rule("-"));
    line(
        &mut out,
        &format!(
            " device allocs: {}   device frees: {}   waits for all events: {}",
            stats.num_device_alloc, stats.num_device_free, stats.num_sync_all_streams
        ),
    );
    line(&mut out, &rule("="));
    for n in &opts.notes {
        out.push_str(n);
        out.push('\n');
    }
    out
}

/// The statistics as JSON: `{"stats": {...nested, as MemoryStats...}, "flat": {...torch's
/// flat names...}}`.
pub fn stats_json(stats: &MemoryStats) -> serde_json::Value {
    serde_json::json!({
        "stats": stats,
        "flat": stats.to_flat(),
    })
}

/// The statistics of a snapshot file.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotStats {
    /// Statistics: current values from the segments, peaks and totals from the history.
    pub stats: MemoryStats,
    /// Segments in the snapshot.
    pub segments: usize,
    /// Events of the history used.
    pub history_events: usize,
    /// Metrics whose peak and totals could not be derived.
    pub current_only: Vec<&'static str>,
    /// Whether the history reaches back to an empty allocator (every reserved and requested
    /// byte at the end is accounted for by its events), so that totals cover the whole run.
    pub history_complete: bool,
    /// How the figures were obtained, for people.
    pub notes: Vec<String>,
}

/// Per-pool running values of the metrics derived from a history.
#[derive(Default, Clone, Copy)]
struct Walk {
    cur: [i64; 2],
    peak: [i64; 2],
    peak_all: i64,
    up: [i64; 2],
    down: [i64; 2],
}

impl Walk {
    fn start(arr: &StatArray) -> Self {
        let cur = [arr.small_pool.current, arr.large_pool.current];
        Walk {
            cur,
            peak: cur,
            peak_all: arr.all.current,
            up: [0; 2],
            down: [0; 2],
        }
    }

    /// Undoes a change of `delta` in `pool` (walking the history backwards).
    fn undo(&mut self, pool: Pool, delta: i64) {
        let i = pool.index();
        self.cur[i] -= delta;
        if delta > 0 {
            self.up[i] += delta;
        } else {
            self.down[i] -= delta;
        }
        self.peak[i] = self.peak[i].max(self.cur[i]);
        self.peak_all = self.peak_all.max(self.cur[0] + self.cur[1]);
    }

    fn into_array(self, arr: &mut StatArray) {
        for (i, s) in [&mut arr.small_pool, &mut arr.large_pool]
            .into_iter()
            .enumerate()
        {
            s.peak = self.peak[i];
            s.allocated = self.up[i];
            s.freed = self.down[i];
        }
        arr.all.peak = self.peak_all;
        arr.all.allocated = self.up[0] + self.up[1];
        arr.all.freed = self.down[0] + self.down[1];
    }

    fn at_start_all(&self) -> i64 {
        self.cur[0] + self.cur[1]
    }
}

/// The statistics of a snapshot: current values from its segments (exact); peaks and
/// allocated/freed totals by walking its history backwards from that state (exact for counts,
/// requested and reserved bytes over the history's window; block bytes of blocks that no
/// longer exist are their requested sizes rounded to 512 B, which PyTorch's large pool may
/// exceed by up to 1 MiB when it does not split a block).
pub fn snapshot_stats(snap: &Snapshot) -> SnapshotStats {
    let mut st = MemoryStats::default();
    // Current state.
    let mut end_blocks: FxHashMap<u64, (u64, Pool)> = FxHashMap::default();
    for seg in &snap.segments {
        let p = seg.pool;
        st.segment.inc(p, 1);
        st.reserved_bytes.inc(p, seg.total_size);
        let split = seg.blocks.len() > 1;
        for b in &seg.blocks {
            match b.state {
                BlockState::ActiveAllocated => {
                    st.allocation.inc(p, 1);
                    st.allocated_bytes.inc(p, b.size);
                }
                BlockState::ActivePendingFree => {}
                BlockState::Inactive => {
                    if split {
                        st.inactive_split.inc(p, 1);
                        st.inactive_split_bytes.inc(p, b.size);
                    }
                }
            }
            if b.state.is_active() {
                st.active.inc(p, 1);
                st.active_bytes.inc(p, b.size);
                st.requested_bytes.inc(p, b.requested_size);
                end_blocks.insert(b.address, (b.size, p));
            }
        }
    }
    // Only current values so far: totals restart from the history.
    st.reset_accumulated();
    let events = &snap.trace.events;
    let mut notes = Vec::new();
    let pooled: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.pool_id != (0, 0))
        .collect();
    if !pooled.is_empty() {
        let mut ids: Vec<_> = pooled.iter().map(|s| s.pool_id).collect();
        ids.sort_unstable();
        ids.dedup();
        notes.push(format!(
            "{} of the {} segments ({} held) belong to {} private pool(s) (CUDA graphs or \
             MemPools), whose memory no other allocation may take.",
            pooled.len(),
            snap.segments.len(),
            crate::units::format_size(pooled.iter().map(|s| s.total_size).sum()),
            ids.len()
        ));
    }
    let mut current_only = vec!["inactive_split", "inactive_split_bytes"];
    if events.is_empty() {
        current_only = METRICS.iter().map(|m| m.0).collect();
        notes.push(
            "The snapshot has no allocation history: peaks and totals are unknown (record \
             with torch.cuda.memory._record_memory_history(), or gpumem's history:N)."
                .to_string(),
        );
        return SnapshotStats {
            segments: snap.segments.len(),
            stats: st,
            history_events: 0,
            current_only,
            history_complete: false,
            notes,
        };
    }
    let has_maps = events
        .iter()
        .any(|e| matches!(e.kind, Kind::SegmentMap | Kind::SegmentUnmap));
    if has_maps {
        // Mapped ranges merge and split: their count is not a count of events.
        current_only.push("segment");
    }
    let seg_pool = segment_pools(snap);
    let spans = SegmentSpans::of(snap);
    let mut allocation = Walk::start(&st.allocation);
    let mut allocated = Walk::start(&st.allocated_bytes);
    let mut active = Walk::start(&st.active);
    let mut active_b = Walk::start(&st.active_bytes);
    let mut requested = Walk::start(&st.requested_bytes);
    let mut segment = Walk::start(&st.segment);
    let mut reserved = Walk::start(&st.reserved_bytes);
    // Blocks met walking backwards: the size of the block behind each live address.
    let mut block_size: FxHashMap<u64, u64> = FxHashMap::default();
    let mut seen_end: rustc_hash::FxHashSet<u64> = Default::default();
    let mut ooms = 0;
    for (i, e) in events.iter().enumerate().rev() {
        match e.kind {
            Kind::Alloc | Kind::FreeRequested | Kind::FreeCompleted => {
                // The pool of the segment it is in now, so that per-pool values stay consistent
                // with the current ones.
                let pool = spans.pool_at(e.addr).unwrap_or(Pool::of(e.size));
                // A block alive at the end has its exact size the first time we meet it.
                let bytes = match end_blocks.get(&e.addr) {
                    Some(&(sz, _)) if !seen_end.contains(&e.addr) => sz,
                    _ => *block_size
                        .entry(e.addr)
                        .or_insert_with(|| round_up(e.size.max(1), MIN_BLOCK)),
                } as i64;
                let req = e.size as i64;
                match e.kind {
                    Kind::Alloc => {
                        seen_end.insert(e.addr);
                        block_size.remove(&e.addr);
                        allocation.undo(pool, 1);
                        allocated.undo(pool, bytes);
                        active.undo(pool, 1);
                        active_b.undo(pool, bytes);
                        requested.undo(pool, req);
                    }
                    Kind::FreeRequested => {
                        allocation.undo(pool, -1);
                        allocated.undo(pool, -bytes);
                    }
                    _ => {
                        active.undo(pool, -1);
                        active_b.undo(pool, -bytes);
                        requested.undo(pool, -req);
                    }
                }
            }
            Kind::SegmentAlloc | Kind::SegmentFree | Kind::SegmentMap | Kind::SegmentUnmap => {
                let sign = if matches!(e.kind, Kind::SegmentAlloc | Kind::SegmentMap) {
                    st.num_device_alloc += 1;
                    1
                } else {
                    st.num_device_free += 1;
                    -1
                };
                // Unknown: a plain segment's size says its pool (PyTorch's small segments are
                // 2 MiB); a mapping's does not (every page is 2 MiB), and gpumem maps large.
                let by_size = if e.size <= 2 << 20
                    && matches!(e.kind, Kind::SegmentAlloc | Kind::SegmentFree)
                {
                    Pool::Small
                } else {
                    Pool::Large
                };
                let pool = seg_pool.get(&i).copied().unwrap_or(by_size);
                reserved.undo(pool, sign * e.size as i64);
                if matches!(e.kind, Kind::SegmentAlloc | Kind::SegmentFree) {
                    segment.undo(pool, sign);
                }
            }
            Kind::Oom => ooms += 1,
            Kind::Snapshot => {}
        }
    }
    let history_complete = reserved.at_start_all() == 0 && requested.at_start_all() == 0;
    allocation.into_array(&mut st.allocation);
    allocated.into_array(&mut st.allocated_bytes);
    active.into_array(&mut st.active);
    active_b.into_array(&mut st.active_bytes);
    requested.into_array(&mut st.requested_bytes);
    reserved.into_array(&mut st.reserved_bytes);
    if !has_maps {
        segment.into_array(&mut st.segment);
    }
    st.num_ooms = ooms;
    let span_s = events
        .last()
        .zip(events.first())
        .map(|(l, f)| l.time_us.saturating_sub(f.time_us) as f64 / 1e6)
        .unwrap_or(0.0);
    notes.push(format!(
        "Current values from the {} segments; peaks and totals from {} history events over \
         {span_s:.1} s{}.",
        snap.segments.len(),
        events.len(),
        if history_complete {
            " (the whole run: the history starts from an empty allocator)"
        } else {
            " (the history's window only: it starts after memory was already in use)"
        }
    ));
    notes.push(
        "Peaks and totals of allocated/active memory count freed blocks at their requested \
         size rounded to 512 B; non-releasable figures are current only; alloc retries are \
         not recorded in snapshots."
            .to_string(),
    );
    SnapshotStats {
        segments: snap.segments.len(),
        stats: st,
        history_events: events.len(),
        current_only,
        history_complete,
        notes,
    }
}

/// The address ranges of a snapshot's segments, for lookups.
struct SegmentSpans(Vec<(u64, u64, Pool)>);

impl SegmentSpans {
    fn of(snap: &Snapshot) -> Self {
        let mut v: Vec<(u64, u64, Pool)> = snap
            .segments
            .iter()
            .map(|s| (s.address, s.address + s.total_size, s.pool))
            .collect();
        v.sort_unstable();
        SegmentSpans(v)
    }

    /// The pool of the segment containing `addr`, if one does.
    fn pool_at(&self, addr: u64) -> Option<Pool> {
        let k = self.0.partition_point(|s| s.0 <= addr);
        (k > 0 && addr < self.0[k - 1].1).then(|| self.0[k - 1].2)
    }
}

/// The pool of each segment event (by index): from the snapshot segment that contains its
/// address, else from the first allocation placed inside it after it.
fn segment_pools(snap: &Snapshot) -> FxHashMap<usize, Pool> {
    let spans = SegmentSpans::of(snap);
    let events = &snap.trace.events;
    let mut out = FxHashMap::default();
    // Open segment events waiting for an allocation inside them: (start, end, index).
    let mut waiting: Vec<(u64, u64, usize)> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        match e.kind {
            Kind::SegmentAlloc | Kind::SegmentFree | Kind::SegmentMap | Kind::SegmentUnmap => {
                if let Some(p) = spans.pool_at(e.addr) {
                    out.insert(i, p);
                } else {
                    waiting.push((e.addr, e.addr + e.size, i));
                }
            }
            Kind::Alloc if !waiting.is_empty() => {
                // An allocation overlapping the range (a block may start before a mapped page
                // and reach into it).
                waiting.retain(|&(s, end, idx)| {
                    if e.addr < end && e.addr.saturating_add(e.size) > s {
                        out.insert(idx, Pool::of(e.size));
                        false
                    } else {
                        true
                    }
                });
            }
            _ => {}
        }
    }
    // A free or unmap whose segment is gone takes the pool of the segment or mapping it ends
    // (an unmap may cover part of a mapping, or several).
    let mut last: BTreeMap<u64, (u64, Pool)> = BTreeMap::new();
    for (i, e) in events.iter().enumerate() {
        match e.kind {
            Kind::SegmentAlloc | Kind::SegmentMap => {
                if let Some(&p) = out.get(&i) {
                    last.insert(e.addr, (e.addr.saturating_add(e.size), p));
                }
            }
            Kind::SegmentFree | Kind::SegmentUnmap if !out.contains_key(&i) => {
                let end = e.addr.saturating_add(e.size);
                let hit = last
                    .range(..end)
                    .rev()
                    .find(|&(_, &(stop, _))| stop > e.addr)
                    .map(|(_, &(_, p))| p);
                if let Some(p) = hit {
                    out.insert(i, p);
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::event as ev;
    use crate::trace::pickle::{SnapshotBlock, SnapshotSegment};
    use crate::trace::Trace;
    use crate::units::MIB;

    #[test]
    fn cells_follow_torch_units() {
        assert_eq!(size_cell(512, 512), "   512 B  ");
        // 3 MiB is below 768 MiB: shown in KiB, as PyTorch does.
        assert_eq!(size_cell(3 << 20, 3 << 20), "  3072 KiB");
        assert_eq!(size_cell(5 << 30, 5 << 30), "  5120 MiB");
        // The unit follows the reference (the "all" row), not the value.
        assert_eq!(size_cell(1 << 20, 1 << 40), "     0 GiB");
        assert_eq!(size_cell(1 << 20, 1 << 30), "     1 MiB");
        assert_eq!(size_cell(700 << 10, 700 << 10), "716800 B  ");
        assert_eq!(size_cell(800 << 10, 800 << 10), "   800 KiB");
        assert_eq!(count_cell(12, 12), "     12   ");
        assert_eq!(count_cell(2_500_000, 2_500_000), "   2500 K ");
        assert_eq!(count_cell(900_000_000, 900_000_000), "    900 M ");
    }

    #[test]
    fn table_has_torch_rows_and_hand_computed_values() {
        let mut s = MemoryStats::default();
        // Two large blocks (8 MiB, 4 MiB) and one small (512 B); the 4 MiB one freed.
        s.allocated_bytes.inc(Pool::Large, 8 * MIB);
        s.allocated_bytes.inc(Pool::Large, 4 * MIB);
        s.allocated_bytes.inc(Pool::Small, 512);
        s.allocated_bytes.dec(Pool::Large, 4 * MIB);
        s.allocation.inc(Pool::Large, 2);
        s.allocation.inc(Pool::Small, 1);
        s.allocation.dec(Pool::Large, 1);
        s.reserved_bytes.inc(Pool::Large, 20 * MIB);
        s.reserved_bytes.inc(Pool::Small, 2 * MIB);
        s.num_ooms = 3;
        let t = memory_summary(&s);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines.iter().all(|l| l.chars().count() == WIDTH + 2), "{t}");
        // Wider content stays inside the frame, on more lines: a title of 120 characters
        // without a space, and counts of 19 digits.
        let long = format!("/data/{}/trace.pickle.gz", "x".repeat(96));
        let mut big = s.clone();
        big.num_device_alloc = i64::MAX;
        big.num_device_free = i64::MAX;
        let opts = SummaryOptions {
            title: long.clone(),
            ..SummaryOptions::default()
        };
        let w = render_summary(&big, &opts);
        assert!(w.lines().all(|l| l.chars().count() == WIDTH + 2), "{w}");
        let title: String = w
            .lines()
            .skip(1)
            .take(2)
            .map(|l| l.trim_matches('|').trim())
            .collect();
        assert_eq!(title, long, "{w}");
        assert!(
            w.contains(&format!(
                "| waits for all events: {}",
                big.num_sync_all_streams
            )),
            "{w}"
        );
        assert!(t.contains("OOMs: 3"), "{t}");
        let row = |label: &str| {
            *lines
                .iter()
                .find(|l| l.starts_with(&format!("| {label}")))
                .unwrap_or_else(|| panic!("no row {label} in\n{t}"))
        };
        // all: current 8 MiB + 512 B, peak and total 12 MiB + 512 B, freed 4 MiB: each
        // column in KiB (its value is at least 768 KiB but below 768 MiB), truncated.
        assert_eq!(
            row("Allocated memory"),
            "| Allocated memory      |   8192 KiB |  12288 KiB |  12288 KiB |   4096 KiB |"
        );
        // Per-pool rows use the unit of the "all" row: 512 B is 0 KiB.
        let small = lines
            .iter()
            .skip_while(|l| !l.starts_with("| Allocated memory"))
            .find(|l| l.contains("from small pool"))
            .unwrap();
        assert_eq!(
            *small,
            "|       from small pool |      0 KiB |      0 KiB |      0 KiB |      0 KiB |"
        );
        assert_eq!(
            row("GPU reserved memory"),
            "| GPU reserved memory   |  22528 KiB |  22528 KiB |  22528 KiB |      0 B   |"
        );
        assert_eq!(
            row("Allocations"),
            "| Allocations           |       2    |       3    |       3    |       1    |"
        );
        // The statistics these rows show (active, requested, inactive split, segment and
        // oversize counts) were never set above: every cell is zero, in bytes or as a count.
        for label in ["Active memory", "Requested memory", "Non-releasable memory"] {
            assert_eq!(
                row(label),
                format!("| {label:<21} |{}", "      0 B   |".repeat(4))
            );
        }
        for label in [
            "Active allocs",
            "GPU reserved segments",
            "Non-releasable allocs",
            "Oversize allocations",
            "Oversize GPU segments",
        ] {
            assert_eq!(
                row(label),
                format!("| {label:<21} |{}", "       0    |".repeat(4))
            );
        }
        let short = render_summary(
            &s,
            &SummaryOptions {
                abbreviated: true,
                current_only: vec!["allocation"],
                ..Default::default()
            },
        );
        assert!(!short.contains("from large pool"));
        assert!(short.contains("| Allocations           |       2    |     n/a    |"));
    }

    #[test]
    fn json_has_nested_and_flat_forms() {
        let mut s = MemoryStats::default();
        s.active_bytes.inc(Pool::Small, 4096);
        let j = stats_json(&s);
        assert_eq!(j["stats"]["active_bytes"]["small_pool"]["current"], 4096);
        assert_eq!(j["flat"]["active_bytes.all.peak"], 4096);
    }

    #[test]
    fn snapshot_stats_walk_the_history_back() {
        // A 20 MiB segment at 0x1000_0000: a (3 MiB) allocated then freed, b (5 MiB + 1)
        // allocated and still live; a small 2 MiB segment with one 100-byte block, freed.
        let big = 0x1000_0000;
        let small = 0x2000_0000;
        let events = vec![
            ev(Kind::SegmentAlloc, big, 20 * MIB),
            ev(Kind::Alloc, big, 3 * MIB),
            ev(Kind::Alloc, big + 3 * MIB, 5 * MIB + 1),
            ev(Kind::FreeRequested, big, 3 * MIB),
            ev(Kind::FreeCompleted, big, 3 * MIB),
            ev(Kind::SegmentAlloc, small, 2 * MIB),
            ev(Kind::Alloc, small, 100),
            ev(Kind::FreeRequested, small, 100),
            ev(Kind::FreeCompleted, small, 100),
            ev(Kind::SegmentFree, small, 2 * MIB),
        ];
        let b_size = 5 * MIB + 512;
        let snap = Snapshot {
            trace: Trace {
                events,
                meta: Default::default(),
            },
            segments: vec![SnapshotSegment {
                device: 0,
                address: big,
                total_size: 20 * MIB,
                stream: 0,
                pool: Pool::Large,
                is_expandable: false,
                pool_id: (0, 0),
                blocks: vec![
                    SnapshotBlock {
                        address: big,
                        size: 3 * MIB,
                        requested_size: 0,
                        state: BlockState::Inactive,
                    },
                    SnapshotBlock {
                        address: big + 3 * MIB,
                        size: b_size,
                        requested_size: 5 * MIB + 1,
                        state: BlockState::ActiveAllocated,
                    },
                    SnapshotBlock {
                        address: big + 3 * MIB + b_size,
                        size: 20 * MIB - 3 * MIB - b_size,
                        requested_size: 0,
                        state: BlockState::Inactive,
                    },
                ],
            }],
        };
        let r = snapshot_stats(&snap);
        let s = &r.stats;
        assert!(r.history_complete);
        assert_eq!(s.reserved_bytes.all.current, 20 * MIB as i64);
        assert_eq!(s.reserved_bytes.all.peak, 22 * MIB as i64);
        assert_eq!(s.reserved_bytes.small_pool.allocated, 2 * MIB as i64);
        assert_eq!(s.reserved_bytes.small_pool.freed, 2 * MIB as i64);
        assert_eq!(s.segment.all.peak, 2);
        assert_eq!(s.allocated_bytes.all.current, b_size as i64);
        // Peak: a (3 MiB) + b (its exact block size), before a was freed.
        assert_eq!(s.allocated_bytes.all.peak, (3 * MIB + b_size) as i64);
        assert_eq!(
            s.allocated_bytes.all.allocated,
            (3 * MIB + b_size + 512) as i64
        );
        assert_eq!(s.allocated_bytes.small_pool.freed, 512);
        assert_eq!(s.requested_bytes.all.peak, (8 * MIB + 1) as i64);
        assert_eq!(s.allocation.all.allocated, 3);
        assert_eq!(s.allocation.all.freed, 2);
        assert_eq!(s.inactive_split.all.current, 2);
        assert_eq!(s.inactive_split_bytes.all.current, (15 * MIB - 512) as i64);
        assert!(r.current_only.contains(&"inactive_split"));
    }
}
