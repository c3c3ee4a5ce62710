//! Helpers for tests of programs that use gpumem (and for gpumem's own tests).

use crate::backend::sim::{SimBackend, SimConfig, SimControl};
use crate::backend::{Backend, DeviceInfo, DriverCall, EventHandle, PhysHandle, Stream};
use crate::engine::Allocator;
use crate::error::BackendError;
use crate::report::leaks::leak_report;
use crate::trace::{Event, Kind};
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

/// A trace event on stream 0 at time 0, for hand-built traces.
pub fn event(kind: Kind, addr: u64, size: u64) -> Event {
    Event {
        kind,
        stream: 0,
        addr,
        size,
        time_us: 0,
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

/// Which driver calls a [`FaultySim`] fails. Cloned handles share one plan, so a test keeps
/// one to change it while the allocator owns the backend.
#[derive(Clone, Default)]
pub struct Faults(std::sync::Arc<parking_lot::Mutex<FaultPlan>>);

#[derive(Default)]
struct FaultPlan {
    /// Calls of this kind, after `skip` successful ones, fail `times` times.
    nth: Option<(DriverCall, u64, u64)>,
    /// Event records on this stream fail (a stream destroyed while a block was used on it).
    refused_stream: Option<Stream>,
}

impl Faults {
    /// Calls of `kind` fail `times` times, after `skip` that succeed.
    pub fn arm(&self, kind: DriverCall, skip: u64, times: u64) {
        self.0.lock().nth = Some((kind, skip, times));
    }

    /// Event records on `stream` fail until [`Faults::disarm`].
    pub fn refuse_events_on(&self, stream: Stream) {
        self.0.lock().refused_stream = Some(stream);
    }

    /// Every call succeeds again.
    pub fn disarm(&self) {
        *self.0.lock() = FaultPlan::default();
    }

    fn check(&self, kind: DriverCall) -> Result<(), BackendError> {
        let mut plan = self.0.lock();
        if let Some((k, skip, times)) = plan.nth.as_mut() {
            if *k == kind {
                if *skip > 0 {
                    *skip -= 1;
                } else if *times > 0 {
                    *times -= 1;
                    return Err(BackendError::new(kind, "injected failure"));
                }
            }
        }
        Ok(())
    }

    fn check_event_record(&self, stream: Stream) -> Result<(), BackendError> {
        if self.0.lock().refused_stream == Some(stream) {
            return Err(BackendError::new(
                DriverCall::EventRecord,
                "invalid resource handle (injected)",
            ));
        }
        self.check(DriverCall::EventRecord)
    }
}

/// The simulated device, with the driver calls [`Faults`] names failing: for tests of what
/// the allocator keeps true when the driver refuses a call part-way through its work.
pub struct FaultySim {
    inner: SimBackend,
    faults: Faults,
}

impl FaultySim {
    /// A simulated device of `config`, its fault plan (empty: nothing fails yet), and the
    /// simulation's control of events.
    pub fn new(config: SimConfig) -> (Self, Faults, SimControl) {
        let (inner, ctl) = SimBackend::new(config);
        let faults = Faults::default();
        (
            Self {
                inner,
                faults: faults.clone(),
            },
            faults,
            ctl,
        )
    }
}

impl Backend for FaultySim {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn is_simulated(&self) -> bool {
        self.inner.is_simulated()
    }
    fn mem_get_info(&mut self) -> Result<(u64, u64), BackendError> {
        self.faults.check(DriverCall::MemGetInfo)?;
        self.inner.mem_get_info()
    }
    fn mem_alloc(&mut self, bytes: u64) -> Result<u64, BackendError> {
        self.faults.check(DriverCall::MemAlloc)?;
        self.inner.mem_alloc(bytes)
    }
    fn mem_free(&mut self, ptr: u64, bytes: u64) -> Result<(), BackendError> {
        self.faults.check(DriverCall::MemFree)?;
        self.inner.mem_free(ptr, bytes)
    }
    fn address_reserve(&mut self, bytes: u64, align: u64) -> Result<u64, BackendError> {
        self.faults.check(DriverCall::AddressReserve)?;
        self.inner.address_reserve(bytes, align)
    }
    fn address_free(&mut self, va: u64, bytes: u64) -> Result<(), BackendError> {
        self.faults.check(DriverCall::AddressFree)?;
        self.inner.address_free(va, bytes)
    }
    fn mem_create(&mut self, bytes: u64) -> Result<PhysHandle, BackendError> {
        self.faults.check(DriverCall::MemCreate)?;
        self.inner.mem_create(bytes)
    }
    fn mem_release(&mut self, h: PhysHandle) -> Result<(), BackendError> {
        self.faults.check(DriverCall::MemRelease)?;
        self.inner.mem_release(h)
    }
    fn mem_map(&mut self, va: u64, bytes: u64, h: PhysHandle) -> Result<(), BackendError> {
        self.faults.check(DriverCall::MemMap)?;
        self.inner.mem_map(va, bytes, h)
    }
    fn mem_unmap(&mut self, va: u64, bytes: u64) -> Result<(), BackendError> {
        self.faults.check(DriverCall::MemUnmap)?;
        self.inner.mem_unmap(va, bytes)
    }
    fn set_access(&mut self, va: u64, bytes: u64) -> Result<(), BackendError> {
        self.faults.check(DriverCall::SetAccess)?;
        self.inner.set_access(va, bytes)
    }
    fn event_record(&mut self, stream: Stream) -> Result<EventHandle, BackendError> {
        self.faults.check_event_record(stream)?;
        self.inner.event_record(stream)
    }
    fn event_query(&mut self, e: EventHandle) -> Result<bool, BackendError> {
        self.faults.check(DriverCall::EventQuery)?;
        self.inner.event_query(e)
    }
    fn event_synchronize(&mut self, e: EventHandle) -> Result<(), BackendError> {
        self.faults.check(DriverCall::EventSynchronize)?;
        self.inner.event_synchronize(e)
    }
    fn event_destroy(&mut self, e: EventHandle) {
        self.inner.event_destroy(e)
    }
    fn stream_wait_event(&mut self, s: Stream, e: EventHandle) -> Result<(), BackendError> {
        self.faults.check(DriverCall::StreamWaitEvent)?;
        self.inner.stream_wait_event(s, e)
    }
}

/// A small deterministic pseudo-random generator for reproducible test inputs: the same seed
/// draws the same values on every run and machine, so a failing step reruns identically. Not
/// for anything statistical: it only needs to vary sizes and choices.
#[derive(Clone, Debug)]
pub struct TestRng {
    state: u64,
    /// `None`: xorshift64 (shifts 13, 7, 17; the state is the value). `Some(m)`: xorshift64*
    /// (shifts 12, 25, 27; the value is the state times `m`).
    star: Option<u64>,
}

impl TestRng {
    /// Xorshift64 from `seed`, which must not be 0 (the state would stay 0 for ever).
    pub fn new(seed: u64) -> Self {
        assert_ne!(seed, 0, "a xorshift state of 0 never changes");
        Self {
            state: seed,
            star: None,
        }
    }

    /// Xorshift64* from `seed` (not 0), its values multiplied by `mul`: the variant some tests
    /// were written with, kept so that they draw the values their expectations were measured on.
    pub fn xorshift64_star(seed: u64, mul: u64) -> Self {
        assert_ne!(seed, 0, "a xorshift state of 0 never changes");
        Self {
            state: seed,
            star: Some(mul),
        }
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let x = &mut self.state;
        match self.star {
            None => {
                *x ^= *x << 13;
                *x ^= *x >> 7;
                *x ^= *x << 17;
                *x
            }
            Some(mul) => {
                *x ^= *x >> 12;
                *x ^= *x << 25;
                *x ^= *x >> 27;
                x.wrapping_mul(mul)
            }
        }
    }

    /// A value in `0..n` (the next value modulo `n`: slightly uneven, which tests do not mind).
    /// Panics if `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// An index into `len` items, as [`TestRng::below`]. Panics if `len` is 0.
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// A value in `[0, 1)`, from the next value's top 53 bits.
    pub fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}
