//! gpumem-core's reports (`report::{summary, snapshot, leaks}`) as the Python package serves
//! them: titled summaries, empty snapshots of devices gpumem has not used yet, the Python
//! callers of allocations folded into leak reports (a native backtrace taken under the
//! interpreter shows only CPython's and gpumem's own frames), and the leak check at
//! interpreter exit over every allocator of the process.

use crate::registry::{global, Registry};
use gpumem_core::backend::DevPtr;
use gpumem_core::report::frames::Frame;
use gpumem_core::report::leaks::{leak_report, LeakReport};
use gpumem_core::report::snapshot::{to_pickle, SnapshotData};
use gpumem_core::report::summary::{render_summary, SummaryOptions};
use gpumem_core::{Allocator, Config, MemoryStats};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Weak};

/// The summary table of `stats` in the layout of `torch.cuda.memory_summary()`, under
/// `title`; `abbreviated` keeps only the all-pools row of each metric, as PyTorch's does.
/// `notes` (what the policy changed on its own) follow the table.
pub fn summary(
    stats: &MemoryStats,
    title: String,
    abbreviated: bool,
    notes: Vec<String>,
) -> String {
    render_summary(
        stats,
        &SummaryOptions {
            title,
            abbreviated,
            notes,
            ..SummaryOptions::default()
        },
    )
}

/// The snapshot of a device gpumem has not allocated on: no segments, no history (what
/// `torch.cuda.memory._snapshot()` returns before the first allocation), with the settings
/// its allocator will have.
pub fn empty_snapshot(device: u32, config: &Config) -> Vec<u8> {
    to_pickle(&SnapshotData {
        device,
        policy: config.policy.name().to_string(),
        uses_pages: config.policy.uses_pages(),
        segments: Vec::new(),
        entries: Vec::new(),
    })
}

/// The Python stack of each live allocation of one allocator, innermost frame first: the
/// call sites a Python user needs, which the engine's native backtraces cannot give.
#[derive(Default)]
pub struct CallerStacks {
    live: Mutex<HashMap<DevPtr, Arc<Vec<Frame>>>>,
}

impl CallerStacks {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the stack of the allocation at `ptr`.
    pub fn insert(&self, ptr: DevPtr, frames: Vec<Frame>) {
        if !frames.is_empty() {
            self.live.lock().insert(ptr, Arc::new(frames));
        }
    }

    /// Forgets the allocation at `ptr` (freed); returns its stack.
    pub fn take(&self, ptr: DevPtr) -> Option<Arc<Vec<Frame>>> {
        self.live.lock().remove(&ptr)
    }

    /// Puts back a stack [`CallerStacks::take`] returned (the free failed).
    pub fn restore(&self, ptr: DevPtr, frames: Arc<Vec<Frame>>) {
        self.live.lock().insert(ptr, frames);
    }

    /// The stack of the live allocation at `ptr`.
    pub fn get(&self, ptr: DevPtr) -> Option<Arc<Vec<Frame>>> {
        self.live.lock().get(&ptr).cloned()
    }

    /// `report` with the Python stacks known here as the allocations' frames and their
    /// innermost frame as the call site, regrouped by those sites. Only a tracked report
    /// (leak checking on) is changed: the others have no call sites to replace.
    pub fn apply(&self, report: LeakReport) -> LeakReport {
        if !report.tracked {
            return report;
        }
        let live = self.live.lock();
        let allocations = report
            .allocations
            .into_iter()
            .map(|mut a| {
                if let Some(frames) = live.get(&a.addr) {
                    if let Some(innermost) = frames.first() {
                        a.site = innermost.to_string();
                    }
                    a.frames = frames.as_ref().clone();
                }
                a
            })
            .collect();
        LeakReport::from_allocations(report.tracked, report.backtraces, allocations)
    }
}

/// The leak report of `alloc`, with the Python callers from `stacks` when there are any.
pub fn leaks_of(alloc: &Allocator, stacks: Option<&CallerStacks>) -> LeakReport {
    let r = leak_report(alloc);
    match stacks {
        Some(s) => s.apply(r),
        None => r,
    }
}

/// An allocator made from Python (`gpumem.Allocator`) whose leaks are reported at exit.
struct Watched {
    label: String,
    alloc: Weak<Allocator>,
    stacks: Option<Weak<CallerStacks>>,
}

static WATCHED: Mutex<Vec<Watched>> = Mutex::new(Vec::new());

/// Has the leak check at exit report on `alloc` (named `label`) if it is still alive then.
/// Only allocators that check for leaks (`leak_check:1`, `GPUMEM_LEAK_CHECK=1`) are kept.
pub fn watch_at_exit(label: String, alloc: &Arc<Allocator>, stacks: Option<&Arc<CallerStacks>>) {
    if !alloc.config().leak_check {
        return;
    }
    let mut w = WATCHED.lock();
    // Allocators dropped since returned all their memory with them: nothing to report.
    w.retain(|x| x.alloc.strong_count() > 0);
    w.push(Watched {
        label,
        alloc: Arc::downgrade(alloc),
        stacks: stacks.map(Arc::downgrade),
    });
}

/// Writes the exit report of one allocator (if it checks for leaks); returns its live
/// allocations.
fn write_one(
    out: &mut dyn Write,
    label: &str,
    alloc: &Allocator,
    stacks: Option<&CallerStacks>,
) -> usize {
    if !alloc.config().leak_check {
        return 0;
    }
    let _ = writeln!(out, "gpumem: {label}");
    // Worded as gpumem-core writes the report at exit.
    let r = leaks_of(alloc, stacks);
    r.write_exit_report(out);
    r.allocations.len()
}

/// The leak check at exit: for each allocator of `registry` (PyTorch's, one per device) and
/// each `gpumem.Allocator` still alive, when it checks for leaks, writes its report to `out`.
/// Returns the live allocations reported.
pub fn leak_check_at_exit_of(registry: &Registry, out: &mut dyn Write) -> usize {
    let mut live = 0;
    for d in registry.devices() {
        if let Some(slot) = registry.get(d) {
            let label = format!("PyTorch allocator of device {d}");
            live += write_one(out, &label, &slot.alloc, None);
        }
    }
    let watched: Vec<(String, Arc<Allocator>, Option<Arc<CallerStacks>>)> = WATCHED
        .lock()
        .iter()
        .filter_map(|w| {
            let stacks = w.stacks.as_ref().and_then(Weak::upgrade);
            Some((w.label.clone(), w.alloc.upgrade()?, stacks))
        })
        .collect();
    for (label, alloc, stacks) in &watched {
        live += write_one(out, label, alloc, stacks.as_deref());
    }
    let _ = out.flush();
    live
}

/// Whether `GPUMEM_LEAK_CHECK` asks for the report at exit (read as gpumem-core reads it).
pub fn leak_check_requested() -> bool {
    Config::from_vars(None, std::env::var("GPUMEM_LEAK_CHECK").ok().as_deref())
        .is_ok_and(|c| c.leak_check)
}

/// When `GPUMEM_LEAK_CHECK=1`: [`leak_check_at_exit_of`] the process's registry, to standard
/// error. (Allocators configured with `leak_check:1` alone are reported on demand only.)
pub fn leak_check_at_exit() -> usize {
    if !leak_check_requested() {
        return 0;
    }
    leak_check_at_exit_of(global(), &mut std::io::stderr().lock())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::sim_source;
    use gpumem_core::backend::sim::{SimBackend, SimConfig};
    use gpumem_core::units::MIB;

    fn allocator(conf: &str) -> Arc<Allocator> {
        let (sim, _) = SimBackend::new(SimConfig::default());
        Arc::new(Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap())
    }

    fn frame(name: &str, file: &str, line: u32) -> Frame {
        Frame {
            name: name.into(),
            filename: file.into(),
            line,
        }
    }

    #[test]
    fn python_callers_become_the_call_sites() {
        let a = allocator("policy:caching,leak_check:1,backtraces:1");
        let stacks = CallerStacks::new();
        let p = a.allocate(3 * MIB, 0).unwrap().ptr;
        let q = a.allocate(5 * MIB, 0).unwrap().ptr;
        let r = a.allocate(MIB, 0).unwrap().ptr;
        stacks.insert(
            p,
            vec![frame("load", "model.py", 12), frame("<module>", "x.py", 3)],
        );
        stacks.insert(q, vec![frame("load", "model.py", 12)]);
        stacks.insert(r, vec![frame("step", "train.py", 40)]);
        a.free(r).unwrap();
        assert!(stacks.take(r).is_some());
        let rep = leaks_of(&a, Some(&stacks));
        assert_eq!(rep.allocations.len(), 2);
        assert_eq!(rep.total_bytes, 8 * MIB);
        assert_eq!(rep.sites.len(), 1, "{rep}");
        assert_eq!(rep.sites[0].site, "load (model.py:12)");
        assert_eq!(rep.sites[0].bytes, 8 * MIB);
        let of_p = rep.allocations.iter().find(|x| x.addr == p).unwrap();
        assert_eq!(of_p.frames.len(), 2);
        assert!(rep.to_string().contains("load (model.py:12)"));
        // Without tracking there is nothing to replace.
        let b = allocator("policy:caching");
        let x = b.allocate(MIB, 0).unwrap().ptr;
        stacks.insert(x, vec![frame("f", "y.py", 1)]);
        let rb = leaks_of(&b, Some(&stacks));
        assert!(!rb.tracked && rb.allocations[0].site.contains("unknown"));
    }

    #[test]
    fn the_exit_check_reports_every_checked_allocator() {
        let reg = Registry::new(sim_source(2, Some(1 << 30), false));
        reg.configure(Some("policy:native,leak_check:1")).unwrap();
        let leaked = reg.alloc(7 * MIB, 1, 0).unwrap();
        let freed = reg.alloc(MIB, 0, 0).unwrap();
        reg.free(freed, 0, 0);
        let checked = allocator("policy:stitched,leak_check:1");
        let stacks = Arc::new(CallerStacks::new());
        let p = checked.allocate(2 * MIB, 0).unwrap().ptr;
        stacks.insert(p, vec![frame("forgets", "t.py", 9)]);
        watch_at_exit("gpumem.Allocator #1".into(), &checked, Some(&stacks));
        let unchecked = allocator("policy:stitched");
        unchecked.allocate(MIB, 0).unwrap();
        watch_at_exit("unchecked".into(), &unchecked, None);
        let dropped = allocator("policy:stitched,leak_check:1");
        dropped.allocate(MIB, 0).unwrap();
        watch_at_exit("dropped".into(), &dropped, None);
        drop(dropped);

        let mut out = Vec::new();
        let live = leak_check_at_exit_of(&reg, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(live, 2, "{text}");
        assert!(text.contains("gpumem: PyTorch allocator of device 0\ngpumem leak check: every allocation was freed"), "{text}");
        assert!(text.contains("gpumem: PyTorch allocator of device 1\ngpumem leak check: allocations still live at exit"), "{text}");
        assert!(text.contains(&format!("{leaked:#x}")), "{text}");
        assert!(text.contains("7.00 MiB"), "{text}");
        assert!(text.contains("forgets (t.py:9)"), "{text}");
        assert!(
            !text.contains("unchecked") && !text.contains("dropped"),
            "{text}"
        );
    }

    #[test]
    fn empty_snapshots_have_the_settings_and_nothing_else() {
        let bytes = empty_snapshot(3, &Config::parse("policy:buddy").unwrap());
        let snap =
            gpumem_core::trace::pickle::read_snapshot_bytes(bytes.clone(), "empty", 3).unwrap();
        assert!(snap.segments.is_empty());
        assert!(snap.trace.events.is_empty());
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            text.contains("buddy") && text.contains("device_traces"),
            "{text}"
        );
    }
}
