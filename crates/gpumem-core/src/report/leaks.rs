//! Leak reports: the allocations still live, with size, stream, age and backtrace, grouped by
//! call site (the first stack frame outside gpumem and the standard library).
//!
//! Ages and call sites need live-allocation tracking (`GPUMEM_CONF=leak_check:1,backtraces:1`,
//! or `GPUMEM_LEAK_CHECK=1`, which turns both on). Without it the report still lists what is
//! live, from the allocator's blocks, with sizes and streams only.

use crate::engine::Allocator;
use crate::policy::BlockKind;
use crate::report::frames::{call_site, frames_of, Frame};
use crate::units::format_size;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, Table};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::fmt;
use std::io::Write;

/// One live allocation.
#[derive(Debug, Clone, Serialize)]
pub struct LiveAllocation {
    /// Address.
    pub addr: u64,
    /// Bytes asked for.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Seconds since it was allocated (when tracked).
    pub age_s: Option<f64>,
    /// Call site (see the module documentation).
    pub site: String,
    /// Stack frames, innermost first (when backtraces are on).
    pub frames: Vec<Frame>,
}

/// The live allocations of one call site.
#[derive(Debug, Clone, Serialize)]
pub struct CallSite {
    /// Call site.
    pub site: String,
    /// Live allocations made there.
    pub count: usize,
    /// Their bytes (as asked for).
    pub bytes: u64,
    /// Age of the oldest, seconds (when tracked).
    pub oldest_age_s: Option<f64>,
    /// Streams they were made on.
    pub streams: Vec<u64>,
}

/// What is still allocated, and where it came from.
#[derive(Debug, Clone, Serialize)]
pub struct LeakReport {
    /// Whether live allocations were tracked (ages known).
    pub tracked: bool,
    /// Whether backtraces were captured (call sites known).
    pub backtraces: bool,
    /// Bytes live (as asked for).
    pub total_bytes: u64,
    /// Call sites, most bytes first.
    pub sites: Vec<CallSite>,
    /// Every live allocation, oldest first when ages are known, else by address.
    pub allocations: Vec<LiveAllocation>,
}

const UNTRACKED: &str = "(call site unknown: set GPUMEM_LEAK_CHECK=1)";
const NO_BACKTRACE: &str = "(no backtrace: add backtraces:1 to GPUMEM_CONF)";

/// The live allocations of `alloc`, grouped by call site.
pub fn leak_report(alloc: &Allocator) -> LeakReport {
    let now = crate::engine::track::now_us();
    let backtraces = alloc.config().backtraces;
    let tracked = alloc
        .with_tracker(|t| t.tracks_leaks().then(|| t.live()))
        .flatten();
    let allocations: Vec<LiveAllocation> = match &tracked {
        Some(live) => live
            .iter()
            .map(|(addr, l)| {
                let frames = l.backtrace.as_deref().map(frames_of).unwrap_or_default();
                let site = match (&l.backtrace, call_site(&frames)) {
                    (None, _) => NO_BACKTRACE.to_string(),
                    (Some(_), Some(f)) => f.to_string(),
                    (Some(_), None) => "(no frame outside gpumem)".to_string(),
                };
                LiveAllocation {
                    addr: *addr,
                    size: l.size,
                    stream: l.stream,
                    age_s: Some(now.saturating_sub(l.time_us) as f64 / 1e6),
                    site,
                    frames,
                }
            })
            .collect(),
        None => alloc
            .snapshot()
            .iter()
            .flat_map(|s| {
                s.blocks
                    .iter()
                    .filter(|b| b.kind == BlockKind::Allocated)
                    .map(|b| LiveAllocation {
                        addr: b.addr,
                        size: b.requested,
                        stream: s.stream,
                        age_s: None,
                        site: UNTRACKED.to_string(),
                        frames: Vec::new(),
                    })
            })
            .collect(),
    };
    let backtraces = tracked.is_some() && backtraces;
    LeakReport::from_allocations(tracked.is_some(), backtraces, allocations)
}

impl LeakReport {
    /// The report of `allocations`: sorted (oldest first when ages are known, else by
    /// address) and grouped by call site. [`leak_report`] builds it from the allocator; an
    /// embedder that knows better call sites (the Python package, which records the Python
    /// caller of each allocation) rewrites `site` and `frames` and regroups with this.
    pub fn from_allocations(
        tracked: bool,
        backtraces: bool,
        mut allocations: Vec<LiveAllocation>,
    ) -> LeakReport {
        allocations.sort_by(|a, b| {
            b.age_s
                .unwrap_or(0.0)
                .total_cmp(&a.age_s.unwrap_or(0.0))
                .then(a.addr.cmp(&b.addr))
        });
        let mut by_site: FxHashMap<&str, CallSite> = FxHashMap::default();
        for a in &allocations {
            let s = by_site.entry(&a.site).or_insert_with(|| CallSite {
                site: a.site.clone(),
                count: 0,
                bytes: 0,
                oldest_age_s: None,
                streams: Vec::new(),
            });
            s.count += 1;
            s.bytes += a.size;
            if let Some(age) = a.age_s {
                s.oldest_age_s = Some(s.oldest_age_s.map_or(age, |o: f64| o.max(age)));
            }
            if !s.streams.contains(&a.stream) {
                s.streams.push(a.stream);
            }
        }
        let mut sites: Vec<CallSite> = by_site.into_values().collect();
        sites.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.site.cmp(&b.site)));
        LeakReport {
            tracked,
            backtraces,
            total_bytes: allocations.iter().map(|a| a.size).sum(),
            sites,
            allocations,
        }
    }

    /// Nothing is live.
    pub fn is_empty(&self) -> bool {
        self.allocations.is_empty()
    }

    /// The report as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// Writes the report as the leak check at exit words it (see [`write_at_exit`]).
    pub fn write_exit_report(&self, out: &mut dyn Write) {
        let _ = if self.is_empty() {
            writeln!(out, "gpumem leak check: every allocation was freed")
        } else {
            write!(
                out,
                "gpumem leak check: allocations still live at exit\n{self}"
            )
        };
    }
}

fn age(a: Option<f64>) -> String {
    a.map(|s| format!("{s:.1} s")).unwrap_or_else(|| "?".into())
}

/// Allocations listed one by one under the table of call sites.
const LISTED: usize = 20;

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return writeln!(f, "no live allocations");
        }
        writeln!(
            f,
            "{} live allocation{} holding {} (as requested), from {} call site{}:",
            self.allocations.len(),
            if self.allocations.len() == 1 { "" } else { "s" },
            format_size(self.total_bytes),
            self.sites.len(),
            if self.sites.len() == 1 { "" } else { "s" },
        )?;
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED).set_header(vec![
            "call site",
            "allocations",
            "bytes",
            "oldest",
            "streams",
        ]);
        for s in &self.sites {
            t.add_row(vec![
                Cell::new(&s.site),
                Cell::new(s.count).set_alignment(CellAlignment::Right),
                Cell::new(format_size(s.bytes)).set_alignment(CellAlignment::Right),
                Cell::new(age(s.oldest_age_s)).set_alignment(CellAlignment::Right),
                Cell::new(
                    s.streams
                        .iter()
                        .map(|x| format!("{x:#x}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                ),
            ]);
        }
        writeln!(f, "{t}")?;
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED).set_header(vec![
            "address",
            "size",
            "stream",
            "age",
            "call site",
        ]);
        for a in self.allocations.iter().take(LISTED) {
            t.add_row(vec![
                Cell::new(format!("{:#x}", a.addr)),
                Cell::new(format_size(a.size)).set_alignment(CellAlignment::Right),
                Cell::new(format!("{:#x}", a.stream)),
                Cell::new(age(a.age_s)).set_alignment(CellAlignment::Right),
                Cell::new(&a.site),
            ]);
        }
        writeln!(f, "{t}")?;
        if self.allocations.len() > LISTED {
            writeln!(f, "... and {} more", self.allocations.len() - LISTED)?;
        }
        // The allocations are oldest first; the first with a backtrace is the oldest only if
        // every allocation before it was recorded with one.
        if let Some((i, a)) = self
            .allocations
            .iter()
            .enumerate()
            .find(|(_, a)| !a.frames.is_empty())
        {
            let which = if i == 0 {
                "the oldest"
            } else {
                "the oldest with one"
            };
            writeln!(f, "backtrace of {which} ({:#x}):", a.addr)?;
            for fr in &a.frames {
                writeln!(f, "    {fr}")?;
            }
        }
        if !self.tracked {
            writeln!(
                f,
                "ages and call sites are not tracked: set GPUMEM_LEAK_CHECK=1 (or \
                 GPUMEM_CONF=leak_check:1,backtraces:1)"
            )?;
        }
        Ok(())
    }
}

/// The report at exit, written to `out` when the allocator checks for leaks (`leak_check`,
/// set by `GPUMEM_LEAK_CHECK=1`). Returns the report either way.
pub fn write_at_exit(alloc: &Allocator, out: &mut dyn Write) -> LeakReport {
    let r = leak_report(alloc);
    if alloc.config().leak_check {
        r.write_exit_report(out);
    }
    r
}

/// [`write_at_exit`] to standard error: call it when the program ends (the Python package
/// registers it with `atexit`; Rust programs can hold an [`AtExit`] guard).
pub fn print_at_exit(alloc: &Allocator) -> LeakReport {
    write_at_exit(alloc, &mut std::io::stderr())
}

/// Prints the leak report (see [`print_at_exit`]) when dropped, e.g. at the end of `main`.
pub struct AtExit<'a>(pub &'a Allocator);

impl Drop for AtExit<'_> {
    fn drop(&mut self) {
        print_at_exit(self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::units::MIB;
    use crate::Config;

    fn allocator(conf: Config) -> Allocator {
        let (sim, _) = SimBackend::new(SimConfig::default());
        Allocator::new(Box::new(sim), conf).unwrap()
    }

    #[inline(never)]
    fn leak_from_here(a: &Allocator, n: usize, size: u64) -> Vec<u64> {
        (0..n).map(|_| a.allocate(size, 7).unwrap().ptr).collect()
    }

    #[inline(never)]
    fn other_site(a: &Allocator) -> u64 {
        a.allocate(3 * MIB, 0).unwrap().ptr
    }

    #[test]
    fn groups_live_allocations_by_call_site() {
        let a = allocator(Config::from_vars(Some("policy:caching"), Some("1")).unwrap());
        let kept = leak_from_here(&a, 3, 1000);
        let other = other_site(&a);
        let freed = a.allocate(5 * MIB, 0).unwrap();
        a.free(freed.ptr).unwrap();
        let r = leak_report(&a);
        assert!(r.tracked && r.backtraces);
        assert_eq!(r.allocations.len(), 4);
        assert_eq!(r.total_bytes, 3 * 1000 + 3 * MIB);
        assert_eq!(r.sites.len(), 2, "{r}");
        // Most bytes first: the 3 MiB one.
        assert!(r.sites[0].site.contains("other_site"), "{r}");
        assert_eq!((r.sites[0].count, r.sites[0].bytes), (1, 3 * MIB));
        let s = &r.sites[1];
        assert!(s.site.contains("leak_from_here"), "{r}");
        assert!(s.site.contains("leaks.rs"), "{r}");
        assert_eq!((s.count, s.bytes, s.streams.clone()), (3, 3000, vec![7]));
        assert!(s.oldest_age_s.unwrap() >= 0.0);
        assert!(r.allocations.iter().any(|x| x.addr == other));
        assert!(kept
            .iter()
            .all(|p| r.allocations.iter().any(|x| x.addr == *p)));
        let text = r.to_string();
        assert!(text.contains("4 live allocations"), "{text}");
        assert!(text.contains("backtrace of the oldest"), "{text}");
        assert_eq!(r.to_json()["sites"][1]["count"], 3);
        for p in kept.into_iter().chain([other]) {
            a.free(p).unwrap();
        }
        assert!(leak_report(&a).is_empty());
    }

    #[test]
    fn without_tracking_the_blocks_are_still_reported() {
        let a = allocator(Config::parse("policy:native").unwrap());
        let p = a.allocate(2 * MIB + 3, 5).unwrap();
        let r = leak_report(&a);
        assert!(!r.tracked);
        assert_eq!(r.allocations.len(), 1);
        assert_eq!(
            (
                r.allocations[0].addr,
                r.allocations[0].size,
                r.allocations[0].stream
            ),
            (p.ptr, 2 * MIB + 3, 5)
        );
        assert!(r.to_string().contains("GPUMEM_LEAK_CHECK=1"));
    }

    #[test]
    fn pending_frees_are_not_leaks() {
        let a = allocator(Config::parse("policy:caching,leak_check:1").unwrap());
        let p = a.allocate(MIB, 1).unwrap();
        a.record_stream(p.ptr, 2).unwrap();
        a.free(p.ptr).unwrap();
        assert!(leak_report(&a).is_empty());
    }

    #[test]
    fn the_exit_report_is_written_only_when_asked_for() {
        let on = allocator(Config::from_vars(None, Some("1")).unwrap());
        let p = on.allocate(4096, 0).unwrap();
        let mut out = Vec::new();
        let r = write_at_exit(&on, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(r.allocations.len(), 1);
        assert!(text.contains("allocations still live at exit"), "{text}");
        assert!(
            text.contains("1 live allocation holding 4.00 KiB"),
            "{text}"
        );
        on.free(p.ptr).unwrap();
        let mut out = Vec::new();
        write_at_exit(&on, &mut out);
        assert!(String::from_utf8(out)
            .unwrap()
            .contains("every allocation was freed"));

        let off = allocator(Config::from_vars(None, None).unwrap());
        let _p = off.allocate(4096, 0).unwrap();
        let mut out = Vec::new();
        let r = write_at_exit(&off, &mut out);
        assert!(out.is_empty(), "nothing printed without GPUMEM_LEAK_CHECK");
        assert_eq!(r.allocations.len(), 1, "but the report is returned");
    }
}
