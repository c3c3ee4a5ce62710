//! The core as the benchmark's own thread sees it, measured next to each timed run: its clock,
//! and how many independent adds it retires per cycle.
//!
//! The lent GPU machines run the same code at two speeds about 1.45× apart (BENCHMARKS.md §4,
//! session 49), and their virtual machines expose no hardware counters, so `perf` cannot say
//! whether the slow state is a lower clock or a core that does less per cycle. Two probes tell
//! these apart from inside the guest:
//!
//! - the clock: a chain of dependent register-to-register adds takes one cycle per add on
//!   x86-64 cores, whatever the caches or a sibling thread do, so adds per nanosecond is the
//!   clock in GHz. (Adds of an immediate will not do: recent Intel cores fold chains of them at
//!   rename, and such a chain read 18.8 "GHz" on a 3.4 GHz Xeon.)
//! - the core's share: four independent chains of adds retire about 3.4 adds a cycle on a core
//!   of its own (dev's Xeon). Another thread on the same physical core (a sibling hyperthread,
//!   which a virtual machine may be given without knowing) takes issue slots from them, while
//!   shared caches and memory do not touch them (no memory is read).

use std::time::Instant;

/// Loop iterations per probe, of 16 adds each: the chain's probe takes about 0.5 ms at 3 GHz,
/// the four chains' about a quarter of that; short enough to run beside every timed run, long
/// enough that the two clock reads around a probe cost under 0.1 % of it.
const PROBE_ITERS: u64 = 100_000;

/// Probes per reading: the fastest is kept, since an interruption (the guest's vCPU preempted,
/// an interrupt) can only make a probe slower.
const PROBES: usize = 3;

/// One reading of the core ([`read_core`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CoreReading {
    /// The clock, GHz.
    pub ghz: f64,
    /// Independent adds retired per cycle (four chains).
    pub adds_per_cycle: f64,
}

/// The calling thread's core, measured now; `None` where the probes are not built (other
/// architectures than x86-64).
pub fn read_core() -> Option<CoreReading> {
    let ghz = adds_per_ns(add_chain)?;
    let wide = adds_per_ns(add_chains_4)?;
    Some(CoreReading {
        ghz,
        adds_per_cycle: wide / ghz,
    })
}

/// Adds per nanosecond of `probe` over `PROBE_ITERS` iterations, the best of `PROBES`.
fn adds_per_ns(probe: fn(u64) -> Option<u64>) -> Option<f64> {
    (0..PROBES)
        .filter_map(|_| {
            let t0 = Instant::now();
            let adds = probe(PROBE_ITERS)?;
            let ns = t0.elapsed().as_nanos() as f64;
            (ns > 0.0).then(|| adds as f64 / ns)
        })
        .reduce(f64::max)
}

/// Runs `iters` iterations of 16 dependent adds; returns the adds done.
#[cfg(target_arch = "x86_64")]
fn add_chain(iters: u64) -> Option<u64> {
    if iters == 0 {
        // The loop tests its counter after the first pass: zero would wrap it.
        return Some(0);
    }
    let mut x: u64 = 0;
    let one: u64 = 1;
    let mut n = iters;
    // SAFETY: the block only adds `one` to `x` and counts `n` down to zero, registers it is
    // given as operands (`one` read only); it reads and writes no memory (`nomem`), uses no
    // stack (`nostack`), and changes the flags, which it does not declare preserved. `n`
    // starts at one or more, so the loop ends after exactly `iters` passes.
    unsafe {
        std::arch::asm!(
            "2:",
            "add {x}, {one}", "add {x}, {one}", "add {x}, {one}", "add {x}, {one}",
            "add {x}, {one}", "add {x}, {one}", "add {x}, {one}", "add {x}, {one}",
            "add {x}, {one}", "add {x}, {one}", "add {x}, {one}", "add {x}, {one}",
            "add {x}, {one}", "add {x}, {one}", "add {x}, {one}", "add {x}, {one}",
            "dec {n}",
            "jnz 2b",
            x = inout(reg) x,
            one = in(reg) one,
            n = inout(reg) n,
            options(nomem, nostack),
        );
    }
    debug_assert_eq!(n, 0);
    Some(x)
}

/// Runs `iters` iterations of four independent chains of 4 adds each; returns the adds done.
#[cfg(target_arch = "x86_64")]
fn add_chains_4(iters: u64) -> Option<u64> {
    if iters == 0 {
        return Some(0);
    }
    let (mut a, mut b, mut c, mut d) = (0u64, 0u64, 0u64, 0u64);
    let one: u64 = 1;
    let mut n = iters;
    // SAFETY: as `add_chain`'s block, with four accumulators: register operands only, no
    // memory, no stack, the flags changed and not declared preserved; `n` starts at one or
    // more.
    unsafe {
        std::arch::asm!(
            "2:",
            "add {a}, {one}", "add {b}, {one}", "add {c}, {one}", "add {d}, {one}",
            "add {a}, {one}", "add {b}, {one}", "add {c}, {one}", "add {d}, {one}",
            "add {a}, {one}", "add {b}, {one}", "add {c}, {one}", "add {d}, {one}",
            "add {a}, {one}", "add {b}, {one}", "add {c}, {one}", "add {d}, {one}",
            "dec {n}",
            "jnz 2b",
            a = inout(reg) a,
            b = inout(reg) b,
            c = inout(reg) c,
            d = inout(reg) d,
            one = in(reg) one,
            n = inout(reg) n,
            options(nomem, nostack),
        );
    }
    debug_assert_eq!(n, 0);
    Some(a + b + c + d)
}

#[cfg(not(target_arch = "x86_64"))]
fn add_chain(_iters: u64) -> Option<u64> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
fn add_chains_4(_iters: u64) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cycles per ns from a chain of multiplies, which take 3 cycles each on x86-64 cores
    /// (Intel since 2008, AMD since Zen): a second clock to check the adds' against.
    #[cfg(target_arch = "x86_64")]
    fn imul_ghz() -> f64 {
        (0..PROBES)
            .map(|_| {
                let t0 = Instant::now();
                let mut x: u64 = 3;
                let n: u64 = PROBE_ITERS / 4;
                // SAFETY: as `add_chain`'s block: two register operands, no memory, no stack,
                // `n` starts above zero.
                unsafe {
                    std::arch::asm!(
                        "2:",
                        "imul {x}, {x}", "imul {x}, {x}", "imul {x}, {x}", "imul {x}, {x}",
                        "dec {n}",
                        "jnz 2b",
                        x = inout(reg) x,
                        n = inout(reg) n => _,
                        options(nomem, nostack),
                    );
                }
                std::hint::black_box(x);
                // PROBE_ITERS / 4 passes of 4 multiplies, 3 cycles each.
                (PROBE_ITERS as f64 * 3.0) / t0.elapsed().as_nanos() as f64
            })
            .fold(0.0, f64::max)
    }

    /// The chain does every add it is asked for (the compiler cannot drop an asm block's
    /// work), and the clock it gives is the one a chain of multiplies gives: both count
    /// cycles, neither is folded away by the core.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_clock_is_a_real_one() {
        assert_eq!(add_chain(0), Some(0));
        assert_eq!(add_chain(3), Some(48));
        assert_eq!(add_chains_4(0), Some(0));
        assert_eq!(add_chains_4(3), Some(48));
        // The two probes run one after the other; a test run beside others may be
        // interrupted, which only lowers a reading, so the best of a few pairs is compared.
        let (adds, muls) = (0..5)
            .map(|_| (read_core().expect("built on x86-64").ghz, imul_ghz()))
            .min_by(|a, b| (a.0 / a.1 - 1.0).abs().total_cmp(&(b.0 / b.1 - 1.0).abs()))
            .expect("five pairs");
        assert!(
            (0.3..8.0).contains(&adds),
            "{adds} GHz is no clock a core of this kind runs at"
        );
        assert!(
            (adds / muls - 1.0).abs() < 0.2,
            "adds read {adds:.2} GHz, multiplies {muls:.2} GHz"
        );
    }

    /// Four chains retire more than one add a cycle (the chains overlap) and at most four.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn independent_chains_overlap() {
        let best = (0..5)
            .map(|_| read_core().expect("built on x86-64").adds_per_cycle)
            .fold(0.0, f64::max);
        assert!((1.5..=4.2).contains(&best), "{best} adds per cycle");
    }

    #[cfg(not(target_arch = "x86_64"))]
    #[test]
    fn no_probe_elsewhere() {
        assert_eq!(read_core(), None);
    }
}
