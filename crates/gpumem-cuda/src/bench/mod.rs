//! `gpumem bench alloc`: host-side nanoseconds per allocator operation (one alloc or one free)
//! on the op sequences of ANCHORS.md §2, for each gpumem policy, `cudaMalloc` (cuMemAlloc /
//! cuMemFree) and `cudaMallocAsync` (cuMemAllocAsync / cuMemFreeAsync on the device's default
//! pool, release threshold at its maximum), in one run.
//!
//! Method, as the anchor's (`anchors/allocbench.cpp`, `alloc.py`, `alloc_mt.py`): the ops are
//! generated before timing; one warm run, then the median of three timed runs; a fresh
//! allocator (empty cache) for each policy and case. Multi-thread cases: each thread has its own
//! op sequence (seed 100 + thread) and its own stream, all threads start together, and the
//! figure is the aggregate: wall time ÷ all threads' ops. The timed loop makes no call but the
//! allocator's own: pointers go to a preallocated slot table, errors end the run.

mod clock;
mod driver_baselines;
pub mod report;
mod thread_time;

use crate::backend::CudaBackend;
use driver_baselines::DriverBaselines;
use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig};
use gpumem_core::backend::{Backend, Stream};
use gpumem_core::bench_ops::{make_ops, Op, OpParams};
use gpumem_core::policy::PolicyKind;
use gpumem_core::units::MIB;
use gpumem_core::{AllocError, Allocation, Allocator, Config};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One benchmark case (single-thread, or one thread count of the multi-thread case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// Name, as in the JSON output and the PyTorch script.
    pub name: &'static str,
    /// Host threads, each on its own stream (1 for the single-thread cases).
    pub threads: usize,
    /// Sequence of thread 0 in the timed runs (thread t adds t to the seed).
    pub timed: OpParams,
    /// Sequence of thread 0 in the warm-up run.
    pub warm: OpParams,
    /// Allocations in one run of `cudaMalloc`, which is too slow for the whole sequence.
    pub malloc_allocs: Option<u64>,
}

impl Case {
    /// The op sequences of each thread (`warm` for the warm-up run).
    pub fn sequences(&self, warm: bool) -> Vec<Vec<Op>> {
        let base = if warm { self.warm } else { self.timed };
        (0..self.threads as u64)
            .map(|t| {
                make_ops(OpParams {
                    seed: base.seed + t,
                    ..base
                })
            })
            .collect()
    }
}

/// Name of the multi-thread case.
pub const MT_CASE: &str = "mt_random_512B_1MiB_live200";

/// The cases of ANCHORS.md §2: the three single-thread sequences, then the multi-thread one for
/// each thread count of `threads`.
pub fn cases(threads: &[usize]) -> Vec<Case> {
    let st = |name, n_allocs, max_live, min_size, max_size| {
        let p = OpParams {
            n_allocs,
            max_live,
            min_size,
            max_size,
            seed: 7,
        };
        Case {
            name,
            threads: 1,
            timed: p,
            warm: p,
            malloc_allocs: Some(n_allocs.min(4000)),
        }
    };
    let mut v = vec![
        st("same_1MiB", 200_000, 1, MIB, MIB + 1),
        st("random_512B_64MiB_live500", 100_000, 500, 512, 64 * MIB),
        st("random_512B_1MiB_live2000", 200_000, 2000, 512, MIB),
    ];
    for &t in threads {
        let p = |n_allocs| OpParams {
            n_allocs,
            max_live: 200,
            min_size: 512,
            max_size: MIB,
            seed: 100,
        };
        v.push(Case {
            name: MT_CASE,
            threads: t,
            timed: p(50_000),
            warm: p(20_000),
            malloc_allocs: None,
        });
    }
    v
}

/// The anchor figures of ANCHORS.md §2 (ns per op on the H200): PyTorch's caching allocator,
/// cudaMallocAsync, cudaMalloc.
pub fn anchor(case: &str, threads: usize) -> (Option<f64>, Option<f64>, Option<f64>) {
    match (case, threads) {
        ("same_1MiB", 1) => (Some(228.0), Some(429.0), Some(34_009.0)),
        ("random_512B_64MiB_live500", 1) => (Some(682.0), Some(1_597.0), Some(22_783.0)),
        ("random_512B_1MiB_live2000", 1) => (Some(712.0), Some(981.0), Some(3_986.0)),
        (MT_CASE, 1) => (Some(687.0), Some(976.0), None),
        (MT_CASE, 2) => (Some(1_783.0), Some(4_448.0), None),
        (MT_CASE, 4) => (Some(2_467.0), Some(5_167.0), None),
        (MT_CASE, 8) => (Some(2_785.0), Some(5_525.0), None),
        _ => (None, None, None),
    }
}

/// The targets for gpumem (one thread: ≤ 40 ns same-size, ≤ 100 ns random; 8 threads:
/// ≤ 40 ns aggregate).
pub fn target(case: &str, threads: usize) -> Option<f64> {
    match (case, threads) {
        ("same_1MiB", 1) => Some(40.0),
        ("random_512B_64MiB_live500", 1) | ("random_512B_1MiB_live2000", 1) => Some(100.0),
        (MT_CASE, 8) => Some(40.0),
        _ => None,
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// gpumem policies to measure.
    pub policies: Vec<PolicyKind>,
    /// Thread counts of the multi-thread case.
    pub threads: Vec<usize>,
    /// Run the gpumem policies on the simulated device (no GPU, no driver baselines).
    pub sim: bool,
    /// Extra configuration for every policy (GPUMEM_CONF syntax).
    pub conf: String,
    /// Timed runs per measurement (the median is reported).
    pub runs: usize,
    /// Free by pointer (`free_on(ptr, stream)`, the path of PyTorch's free hook) instead of by
    /// the allocation handle.
    pub free_by_ptr: bool,
    /// Measure cudaMalloc and cudaMallocAsync too (ignored with `sim`).
    pub baselines: bool,
    /// Only these cases (by name; empty: all).
    pub only: Vec<String>,
    /// Read the core before each single-thread gpumem run, and its thread's CPU time during it
    /// (`runs_clock_ghz` and the fields after it). Off for instruction counts
    /// (`scripts/instr_alloc.sh`): each core reading runs about 11 million instructions,
    /// untimed but counted by valgrind.
    pub clock: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            policies: PolicyKind::ALL.to_vec(),
            threads: vec![1, 2, 4, 8],
            sim: false,
            conf: String::new(),
            runs: 3,
            free_by_ptr: false,
            baselines: true,
            only: Vec::new(),
            clock: true,
        }
    }
}

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    /// Case name.
    pub case: String,
    /// Host threads.
    pub threads: usize,
    /// "gpumem:POLICY", "cudaMalloc" or "cudaMallocAsync".
    pub allocator: String,
    /// "cuda" or "sim".
    pub device: String,
    /// Median ns per op (aggregate over threads: wall time ÷ all ops).
    pub ns_per_op: f64,
    /// Every timed run's ns per op.
    pub runs_ns_per_op: Vec<f64>,
    /// gpumem's single-thread rows, on x86-64: the core's clock in GHz, measured on the timed
    /// thread just before each timed run (`bench/clock.rs`), to tell a host whose clock
    /// dropped from an allocator that got slower.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs_clock_ghz: Vec<f64>,
    /// With `runs_clock_ghz`: independent adds the core retired per cycle in the same probe
    /// (about 3.4 on a core of its own; lower when another thread shares the physical core).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs_adds_per_cycle: Vec<f64>,
    /// With `runs_clock_ghz`, on Linux: the share of each timed run's wall time that its
    /// thread ran on a CPU, by the scheduler's account (`bench/thread_time.rs`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs_on_cpu_share: Vec<f64>,
    /// With `runs_on_cpu_share`: the share it spent runnable, waiting for a CPU that another
    /// process held. What is neither is, on kernels that account for it, time the hypervisor
    /// gave to something else.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs_waiting_share: Vec<f64>,
    /// Ops in one timed run (all threads).
    pub ops_per_run: u64,
    /// Peak bytes the allocator held from the device (gpumem only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_held_bytes: Option<u64>,
    /// gpumem only: driver calls per timed run (after the warm-up), and the host seconds they
    /// took per timed run (measured around each call).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_calls_per_run: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_seconds_per_run: Option<f64>,
    /// PyTorch's figure for this case in ANCHORS.md §2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_torch_ns: Option<f64>,
    /// ns_per_op ÷ the PyTorch anchor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_torch_anchor: Option<f64>,
    /// gpumem only: what the policy changed on its own during the runs
    /// (`Allocator::policy_notes`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// A device to run gpumem's policies on.
enum Target {
    Sim,
    Cuda(DriverBaselines),
}

impl Target {
    fn device(&self) -> &'static str {
        match self {
            Target::Sim => "sim",
            Target::Cuda(_) => "cuda",
        }
    }

    fn backend(&self) -> Result<Box<dyn Backend>, String> {
        match self {
            Target::Sim => {
                let (b, _) = SimBackend::new(SimConfig {
                    event_mode: EventMode::Immediate,
                    ..SimConfig::default()
                });
                Ok(Box::new(b))
            }
            Target::Cuda(d) => Ok(Box::new(
                CudaBackend::with_context(d.context().clone()).map_err(|e| e.to_string())?,
            )),
        }
    }

    /// Streams for `n` threads: created streams on the GPU, distinct ids on the simulation.
    fn streams(&self, n: usize) -> Result<Vec<Stream>, String> {
        match self {
            Target::Sim => Ok((1..=n as u64).map(|i| i << 8).collect()),
            Target::Cuda(d) => d.streams(n),
        }
    }
}

/// Runs the benchmark; `progress` sees each figure as it is measured.
pub fn run(
    opts: &BenchOptions,
    progress: &mut dyn FnMut(&Measurement),
) -> Result<Vec<Measurement>, String> {
    if opts.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    if opts.threads.contains(&0) {
        return Err("thread counts must be at least 1".into());
    }
    // Each thread has a stream of its own, and an allocator serves at most MAX_STREAMS.
    let most = gpumem_core::engine::MAX_STREAMS;
    if let Some(t) = opts.threads.iter().find(|&&t| t > most) {
        return Err(format!("{t} threads: at most {most} (one stream each)"));
    }
    let base_config = Config::parse(&opts.conf).map_err(|e| e.to_string())?;
    let target = if opts.sim {
        Target::Sim
    } else {
        crate::driver::load().map_err(|e| e.message)?;
        Target::Cuda(DriverBaselines::open(0).map_err(|e| e.to_string())?)
    };
    let cases: Vec<Case> = cases(&opts.threads)
        .into_iter()
        .filter(|c| opts.only.is_empty() || opts.only.iter().any(|o| o == c.name))
        .collect();
    let mut out = Vec::new();
    for case in &cases {
        let timed = case.sequences(false);
        let warm = case.sequences(true);
        let ops_per_run: u64 = timed.iter().map(|s| s.len() as u64).sum();
        let (torch, _, _) = anchor(case.name, case.threads);
        let mut emit = |allocator: String,
                        runs: Vec<f64>,
                        peak: Option<u64>,
                        ops: u64,
                        calls: Option<(f64, f64)>,
                        notes: Vec<String>,
                        probes: RunProbes| {
            let ns = median(&runs);
            let on_cpu = probes.shares(&runs, ops, |t| t.0);
            let waiting = probes.shares(&runs, ops, |t| t.1);
            let m = Measurement {
                case: case.name.to_string(),
                threads: case.threads,
                allocator,
                device: target.device().to_string(),
                ns_per_op: ns,
                runs_ns_per_op: runs,
                runs_clock_ghz: probes.cores.iter().map(|c| c.ghz).collect(),
                runs_adds_per_cycle: probes.cores.iter().map(|c| c.adds_per_cycle).collect(),
                runs_on_cpu_share: on_cpu,
                runs_waiting_share: waiting,
                ops_per_run: ops,
                peak_held_bytes: peak,
                driver_calls_per_run: calls.map(|c| c.0),
                driver_seconds_per_run: calls.map(|c| c.1),
                anchor_torch_ns: torch,
                ratio_to_torch_anchor: torch.map(|t| ns / t),
                notes,
            };
            progress(&m);
            out.push(m);
        };
        let streams = if case.threads == 1 {
            // As the anchor: single-thread cases run on the legacy default stream.
            vec![0]
        } else {
            target.streams(case.threads)?
        };
        for &policy in &opts.policies {
            let mut config = base_config.clone();
            config.policy = policy;
            let alloc = Allocator::new(target.backend()?, config).map_err(|e| e.to_string())?;
            let fail = |e: String| format!("{} under {}: {e}", case.name, policy.name());
            let mut after_warm = None;
            let probes = Mutex::new(RunProbes::default());
            let runs = ns_per_op(opts.runs, ops_per_run, |w| {
                if !w && after_warm.is_none() {
                    after_warm = Some(alloc.driver_calls());
                }
                let seqs = if w { &warm } else { &timed };
                let probes = (!w && opts.clock).then_some(&probes);
                gpumem_runs(&alloc, seqs, &streams, opts.free_by_ptr, probes).map_err(fail)
            })?;
            let probes = probes.into_inner().unwrap_or_default().complete(runs.len());
            let timed_calls = after_warm.map(|w| {
                let d = alloc.driver_calls().since(&w);
                let n = opts.runs as f64;
                (d.total() as f64 / n, d.measured_total_seconds() / n)
            });
            let left = alloc.memory_stats().allocated_bytes.all.current;
            if left != 0 {
                return Err(fail(format!("{left} bytes still allocated after the runs")));
            }
            emit(
                format!("gpumem:{}", policy.name()),
                runs,
                Some(alloc.peak_held_bytes()),
                ops_per_run,
                timed_calls,
                alloc.policy_notes(),
                probes,
            );
        }
        if let (Target::Cuda(d), true) = (&target, opts.baselines) {
            if let Some(n) = case.malloc_allocs {
                let seq = vec![make_ops(OpParams {
                    n_allocs: n,
                    ..case.timed
                })];
                let ops = seq[0].len() as u64;
                let runs = ns_per_op(opts.runs, ops, |_| d.malloc_runs(&seq))?;
                emit(
                    "cudaMalloc".into(),
                    runs,
                    None,
                    ops,
                    None,
                    Vec::new(),
                    RunProbes::default(),
                );
            }
            let runs = ns_per_op(opts.runs, ops_per_run, |w| {
                d.async_runs(if w { &warm } else { &timed }, &streams)
            })?;
            d.trim_pool()?;
            emit(
                "cudaMallocAsync".into(),
                runs,
                None,
                ops_per_run,
                None,
                Vec::new(),
                RunProbes::default(),
            );
        }
    }
    Ok(out)
}

/// ns per op of each of `runs` timed runs, after one warm-up run: `run(true)` is the warm-up,
/// `run(false)` a timed run of `ops` ops, returning its wall time.
fn ns_per_op(
    runs: usize,
    ops: u64,
    mut run: impl FnMut(bool) -> Result<Duration, String>,
) -> Result<Vec<f64>, String> {
    run(true)?;
    (0..runs)
        .map(|_| run(false).map(|t| t.as_nanos() as f64 / ops as f64))
        .collect()
}

/// Slots a sequence's pointer table needs: one more than the highest slot it names.
pub(crate) fn slot_count(seq: &[Op]) -> usize {
    seq.iter()
        .map(|op| match *op {
            Op::Alloc { slot, .. } | Op::Free { slot } => slot as usize + 1,
        })
        .max()
        .unwrap_or(0)
}

/// What the timed thread of each single-thread run saw of its core and its CPU time.
#[derive(Default)]
struct RunProbes {
    /// The core, read before the run ([`clock::read_core`]).
    cores: Vec<clock::CoreReading>,
    /// Nanoseconds on a CPU and waiting for one during the run ([`thread_time::SchedStat`]).
    times: Vec<(u64, u64)>,
}

impl RunProbes {
    /// Keeps each kind of reading only if every one of `runs` timed runs has one (none for
    /// multi-thread rows, or where a probe is not built).
    fn complete(mut self, runs: usize) -> Self {
        if self.cores.len() != runs {
            self.cores.clear();
        }
        if self.times.len() != runs || self.cores.is_empty() {
            self.times.clear();
        }
        self
    }

    /// `pick` of each run's times as a share of its wall time (`ns_per_op` × `ops`).
    fn shares(&self, runs: &[f64], ops: u64, pick: impl Fn(&(u64, u64)) -> u64) -> Vec<f64> {
        self.times
            .iter()
            .zip(runs)
            .map(|(t, ns)| pick(t) as f64 / (ns * ops as f64))
            .collect()
    }
}

/// One run of gpumem over every thread's sequence (thread t on `streams[t]`); returns the wall
/// time from the common start to the last thread's end. With `probes`, a single thread reads
/// its core before the start (untimed) and its CPU time at the start and the end of its pass
/// (two reads of a few microseconds, timed), and adds both there.
fn gpumem_runs(
    alloc: &Allocator,
    seqs: &[Vec<Op>],
    streams: &[Stream],
    by_ptr: bool,
    probes: Option<&Mutex<RunProbes>>,
) -> Result<Duration, String> {
    let probes = probes.filter(|_| seqs.len() == 1);
    timed_threads(
        seqs.len(),
        |t| {
            let sched = probes.and_then(|p| {
                if let (Some(r), Ok(mut p)) = (clock::read_core(), p.lock()) {
                    p.cores.push(r);
                }
                thread_time::SchedStat::open()
            });
            Ok((vec![None::<Allocation>; slot_count(&seqs[t])], sched))
        },
        |t, (slots, sched)| {
            let before = sched.as_ref().and_then(|s| s.read());
            gpumem_pass(alloc, &seqs[t], slots, streams[t], by_ptr).map_err(|e| e.to_string())?;
            let after = sched.as_ref().and_then(|s| s.read());
            if let (Some(p), Some(b), Some(a)) = (probes, before, after) {
                if let Ok(mut p) = p.lock() {
                    p.times
                        .push((a.0.saturating_sub(b.0), a.1.saturating_sub(b.1)));
                }
            }
            Ok(())
        },
    )
}

/// The timed loop for gpumem: nothing but the allocator's own calls.
#[inline(never)]
fn gpumem_pass(
    alloc: &Allocator,
    ops: &[Op],
    slots: &mut [Option<Allocation>],
    stream: Stream,
    by_ptr: bool,
) -> Result<(), AllocError> {
    for op in ops {
        match *op {
            Op::Alloc { slot, size } => slots[slot as usize] = Some(alloc.allocate(size, stream)?),
            Op::Free { slot } => {
                if let Some(a) = slots[slot as usize].take() {
                    if by_ptr {
                        alloc.free_on(a.ptr, stream)?;
                    } else {
                        alloc.free_allocation(&a)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Runs `work` on `n` threads that start together (after each ran `prepare`); returns the wall
/// time from the start to the last thread's end.
pub(crate) fn timed_threads<S, P, W>(n: usize, prepare: P, work: W) -> Result<Duration, String>
where
    P: Fn(usize) -> Result<S, String> + Sync,
    W: Fn(usize, &mut S) -> Result<(), String> + Sync,
{
    let ready = AtomicUsize::new(0);
    let go = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (ready, go, prepare, work) = (&ready, &go, &prepare, &work);
        let handles: Vec<_> = (0..n)
            .map(|t| {
                s.spawn(move || {
                    let state = prepare(t);
                    ready.fetch_add(1, Ordering::AcqRel);
                    while !go.load(Ordering::Acquire) {
                        std::hint::spin_loop();
                    }
                    state.and_then(|mut st| work(t, &mut st))
                })
            })
            .collect();
        while ready.load(Ordering::Acquire) < n {
            std::thread::yield_now();
        }
        let start = Instant::now();
        go.store(true, Ordering::Release);
        let results: Vec<Result<(), String>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a benchmark thread panicked".into()))
            })
            .collect();
        let wall = start.elapsed();
        results.into_iter().collect::<Result<Vec<()>, String>>()?;
        Ok(wall)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_follow_the_anchor() {
        let c = cases(&[1, 2, 4, 8]);
        assert_eq!(c.len(), 7);
        assert_eq!(c[0].timed.n_allocs, 200_000);
        assert_eq!(c[1].malloc_allocs, Some(4000));
        let mt = &c[6];
        assert_eq!(
            (mt.threads, mt.timed.n_allocs, mt.warm.n_allocs),
            (8, 50_000, 20_000)
        );
        let seqs = mt.sequences(false);
        assert_eq!(seqs.len(), 8);
        // Thread t uses seed 100 + t, as alloc_mt.py's run_ops_mt.
        assert_eq!(
            seqs[3],
            make_ops(OpParams {
                seed: 103,
                ..mt.timed
            })
        );
        assert_ne!(seqs[0], seqs[1]);
    }

    #[test]
    fn sim_bench_measures_every_policy_and_frees_everything() {
        let opts = BenchOptions {
            sim: true,
            threads: vec![1, 2],
            runs: 1,
            only: vec!["random_512B_64MiB_live500".into(), MT_CASE.into()],
            ..BenchOptions::default()
        };
        let mut seen = 0;
        let m = run(&opts, &mut |_| seen += 1).unwrap();
        // 2 cases × every policy; no driver baselines on the simulation.
        assert_eq!(m.len(), 3 * PolicyKind::ALL.len());
        assert_eq!(seen, m.len());
        for x in &m {
            assert!(x.ns_per_op > 0.0 && x.ns_per_op.is_finite(), "{x:?}");
            assert_eq!(x.device, "sim");
            let expect_ops = if x.case == MT_CASE {
                100_000 * x.threads as u64
            } else {
                200_000
            };
            assert_eq!(x.ops_per_run, expect_ops);
            // The core's clock beside each single-thread run, where the probe is built; never
            // beside a multi-thread run, whose threads run on several cores.
            let clocks = if x.threads == 1 && cfg!(target_arch = "x86_64") {
                1
            } else {
                0
            };
            assert_eq!(x.runs_clock_ghz.len(), clocks, "{x:?}");
            assert_eq!(x.runs_adds_per_cycle.len(), clocks, "{x:?}");
            // On Linux, the run's CPU time beside them: a share of its wall time, which the
            // thread's time on a CPU and waiting for one never exceed by more than the two
            // reads' own rounding.
            if cfg!(target_os = "linux") {
                assert_eq!(x.runs_on_cpu_share.len(), clocks, "{x:?}");
                for (run, wait) in x.runs_on_cpu_share.iter().zip(&x.runs_waiting_share) {
                    assert!(*run > 0.0 && run + wait < 1.05, "{x:?}");
                }
            }
            // The 64 MiB case peaks at gigabytes live: every policy held at least that much.
            if x.case == "random_512B_64MiB_live500" {
                assert!(x.peak_held_bytes.unwrap() > 1 << 30, "{x:?}");
                assert_eq!(x.anchor_torch_ns, Some(682.0));
            }
        }
    }

    /// Without the clock probe (instruction counts), no row carries a clock.
    #[test]
    fn the_clock_probe_can_be_left_out() {
        let opts = BenchOptions {
            sim: true,
            policies: vec![PolicyKind::Caching],
            threads: vec![1],
            runs: 2,
            only: vec!["same_1MiB".into()],
            clock: false,
            ..BenchOptions::default()
        };
        let m = run(&opts, &mut |_| {}).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].runs_ns_per_op.len(), 2);
        assert!(m[0].runs_clock_ghz.is_empty(), "{:?}", m[0]);
        assert!(m[0].runs_on_cpu_share.is_empty(), "{:?}", m[0]);
    }

    #[test]
    fn bad_options_are_errors() {
        let o = BenchOptions {
            sim: true,
            runs: 0,
            ..BenchOptions::default()
        };
        assert!(run(&o, &mut |_| {}).unwrap_err().contains("runs"));
        let o = BenchOptions {
            sim: true,
            conf: "policy:nope".into(),
            ..BenchOptions::default()
        };
        assert!(run(&o, &mut |_| {}).unwrap_err().contains("unknown policy"));
    }

    #[test]
    fn the_gpu_bench_without_a_driver_says_so() {
        // SAFETY: only tries to dlopen libcuda.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            // A driver: the bench's device check must not claim there is none (the bench
            // itself runs in scripts/device/cuda.sh).
            if let Err(e) = crate::device_count() {
                assert!(!e.message.contains("no CUDA driver was found"), "{e}");
            }
            return;
        }
        let e = run(&BenchOptions::default(), &mut |_| {}).unwrap_err();
        assert!(e.contains("no CUDA driver was found"), "{e}");
    }
}
