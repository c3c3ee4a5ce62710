//! Helpers for tests of programs that use gpumem (and for gpumem's own tests).

use crate::engine::Allocator;
use crate::report::leaks::leak_report;
use std::path::PathBuf;

/// Panics, with the leak report, if `alloc` still has live allocations: put it at the end of
/// a test to check that everything the test allocated was freed. Call sites and ages appear
/// when the allocator tracks leaks (`leak_check:1,backtraces:1`, or `GPUMEM_LEAK_CHECK=1`).
#[track_caller]
pub fn assert_no_leaks(alloc: &Allocator) {
    let r = leak_report(alloc);
    if !r.is_empty() {
        panic!("gpumem: allocations leaked:\n{r}");
    }
}

/// The repository's `traces/` folder.
fn traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces")
}

/// The path of a trace bundled in the repository's `traces/` folder (`rel` is relative to it,
/// e.g. `validation/mlp.pickle.gz`). Panics if it is missing: the repository always has it.
#[track_caller]
pub fn bundled_trace(rel: &str) -> PathBuf {
    let p = traces_dir().join(rel);
    assert!(p.is_file(), "bundled trace {} is missing", p.display());
    p
}

/// The PyTorch snapshots bundled in `traces/` (recorded by `scripts/record_trace.py` under
/// PyTorch's native allocator, histories complete), smallest first.
pub fn bundled_snapshots() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = ["gpt_varlen.pickle.gz"]
        .iter()
        .map(|r| bundled_trace(r))
        .chain(
            std::fs::read_dir(traces_dir().join("validation"))
                .expect("traces/validation")
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.to_string_lossy().ends_with(".pickle.gz")),
        )
        .collect();
    v.sort_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0));
    v
}

/// The path of one of the recorded traces in the project's shared folder
/// (`$GPUMEM_TRACES`, else `shared/traces` beside or above the repository), if present.
pub fn shared_trace(file: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("GPUMEM_TRACES") {
        dirs.push(d.into());
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for up in here.ancestors().skip(1).take(5) {
        dirs.push(up.join("shared").join("traces"));
    }
    dirs.push(PathBuf::from("/work/shared/traces"));
    dirs.into_iter().map(|d| d.join(file)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::Config;

    fn allocator() -> Allocator {
        let (sim, _) = SimBackend::new(SimConfig::default());
        Allocator::new(
            Box::new(sim),
            Config::parse("policy:stitched,leak_check:1,backtraces:1").unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn passes_when_everything_was_freed() {
        let a = allocator();
        let p = a.allocate(1 << 20, 0).unwrap();
        a.free(p.ptr).unwrap();
        assert_no_leaks(&a);
    }

    #[inline(never)]
    fn forgets_to_free(a: &Allocator) {
        let _never_freed = a.allocate(12345, 3).unwrap();
    }

    #[test]
    fn fails_with_the_report_when_something_is_live() {
        let a = allocator();
        forgets_to_free(&a);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| assert_no_leaks(&a)))
            .expect_err("a leak must fail the check");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("allocations leaked"), "{msg}");
        assert!(
            msg.contains("forgets_to_free"),
            "the call site is named: {msg}"
        );
        assert!(msg.contains("12.06 KiB"), "{msg}");
    }
}
