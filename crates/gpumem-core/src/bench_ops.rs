//! The operation sequences of the allocation benchmark (ANCHORS.md §2), exactly as the anchor's
//! C++ generates them: `std::mt19937_64` with the same seeds, and libstdc++'s
//! `uniform_real_distribution<double>(0, 1)` on top of it. `scripts/allocbench/ops.h` is the
//! same generator in C++ (the PyTorch extension uses it); the tests compare the two op by op.

/// The 64-bit Mersenne Twister (`std::mt19937_64`).
pub struct Mt19937_64 {
    state: [u64; Self::N],
    next: usize,
}

impl Mt19937_64 {
    const N: usize = 312;
    const M: usize = 156;
    const MATRIX_A: u64 = 0xB502_6F5A_A966_19E9;
    const UPPER: u64 = 0xFFFF_FFFF_8000_0000;
    const LOWER: u64 = 0x7FFF_FFFF;

    /// Seeded as `std::mt19937_64(seed)`.
    pub fn new(seed: u64) -> Self {
        let mut state = [0u64; Self::N];
        state[0] = seed;
        for i in 1..Self::N {
            let prev = state[i - 1];
            state[i] = 6_364_136_223_846_793_005u64
                .wrapping_mul(prev ^ (prev >> 62))
                .wrapping_add(i as u64);
        }
        Self {
            state,
            next: Self::N,
        }
    }

    fn twist(&mut self) {
        let s = &mut self.state;
        for i in 0..Self::N {
            let y = (s[i] & Self::UPPER) | (s[(i + 1) % Self::N] & Self::LOWER);
            let mut v = s[(i + Self::M) % Self::N] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= Self::MATRIX_A;
            }
            s[i] = v;
        }
        self.next = 0;
    }

    /// The next 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        if self.next >= Self::N {
            self.twist();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= (y >> 29) & 0x5555_5555_5555_5555;
        y ^= (y << 17) & 0x71D6_7FFF_EDA6_0000;
        y ^= (y << 37) & 0xFFF7_EEE0_0000_0000;
        y ^= y >> 43;
        y
    }

    /// A draw of `std::uniform_real_distribution<double>(0.0, 1.0)` as libstdc++ makes it:
    /// one 64-bit output converted to double and divided by 2^64, kept below 1.
    pub fn uniform(&mut self) -> f64 {
        let x = self.next_u64() as f64 / 18_446_744_073_709_551_616.0;
        if x >= 1.0 {
            1.0 - f64::EPSILON / 2.0
        } else {
            x
        }
    }
}

/// One operation of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes into slot `slot`.
    Alloc {
        /// Slot the pointer goes to.
        slot: u32,
        /// Bytes.
        size: u64,
    },
    /// Free the allocation in slot `slot`.
    Free {
        /// Slot.
        slot: u32,
    },
}

/// Parameters of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpParams {
    /// Allocations to make (each is freed again, so there are twice as many ops).
    pub n_allocs: u64,
    /// Most allocations live at once.
    pub max_live: u32,
    /// Smallest size (inclusive).
    pub min_size: u64,
    /// Largest size (exclusive).
    pub max_size: u64,
    /// Seed of the generator.
    pub seed: u64,
}

/// The op sequence of `p`, as `make_ops` in the anchor's allocbench.cpp makes it.
pub fn make_ops(p: OpParams) -> Vec<Op> {
    let mut rng = Mt19937_64::new(p.seed);
    let (lo, hi) = ((p.min_size as f64).ln(), (p.max_size as f64).ln());
    let mut idle: Vec<u32> = (0..p.max_live).rev().collect();
    let mut busy: Vec<u32> = Vec::with_capacity(p.max_live as usize);
    let mut ops = Vec::with_capacity(2 * p.n_allocs as usize);
    let mut made = 0u64;
    while made < p.n_allocs || !busy.is_empty() {
        // The draw is made only when both choices are open (C++'s short-circuit `||`).
        let alloc =
            made < p.n_allocs && !idle.is_empty() && (busy.is_empty() || rng.uniform() < 0.5);
        if alloc {
            let slot = idle.pop().expect("a free slot");
            // `(int64_t)std::exp(...)` truncates toward zero, as `as` does.
            let size = (lo + (hi - lo) * rng.uniform()).exp() as u64;
            ops.push(Op::Alloc { slot, size });
            busy.push(slot);
            made += 1;
        } else {
            let k = ((rng.uniform() * busy.len() as f64) as usize).min(busy.len() - 1);
            let slot = busy.swap_remove(k);
            ops.push(Op::Free { slot });
            idle.push(slot);
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::process::Command;

    const MIB: u64 = 1 << 20;

    /// The sequences the benchmark runs (single-thread cases with seed 7; one thread of the
    /// multi-thread case with seed 100 + thread).
    fn bench_params() -> Vec<OpParams> {
        let p = |n_allocs, max_live, min_size, max_size, seed| OpParams {
            n_allocs,
            max_live,
            min_size,
            max_size,
            seed,
        };
        vec![
            p(200_000, 1, MIB, MIB + 1, 7),
            p(100_000, 500, 512, 64 * MIB, 7),
            p(200_000, 2000, 512, MIB, 7),
            p(4000, 500, 512, 64 * MIB, 7),
            p(50_000, 200, 512, MIB, 100),
            p(50_000, 200, 512, MIB, 107),
            p(20_000, 200, 512, MIB, 103),
        ]
    }

    #[test]
    fn mt19937_64_matches_the_standard() {
        // The C++ standard ([rand.predef]) fixes the 10000th output of a default-constructed
        // mt19937_64 (seed 5489).
        let mut g = Mt19937_64::new(5489);
        let mut v = 0;
        for _ in 0..10_000 {
            v = g.next_u64();
        }
        assert_eq!(v, 9_981_545_732_273_789_042);
    }

    #[test]
    fn sequences_are_well_formed() {
        for p in bench_params() {
            let ops = make_ops(p);
            assert_eq!(ops.len() as u64, 2 * p.n_allocs, "{p:?}");
            let mut live = vec![false; p.max_live as usize];
            let mut n_live = 0u32;
            for op in &ops {
                match *op {
                    Op::Alloc { slot, size } => {
                        assert!(!live[slot as usize]);
                        assert!(size >= p.min_size && size < p.max_size, "{size}");
                        live[slot as usize] = true;
                        n_live += 1;
                        assert!(n_live <= p.max_live);
                    }
                    Op::Free { slot } => {
                        assert!(live[slot as usize]);
                        live[slot as usize] = false;
                        n_live -= 1;
                    }
                }
            }
            assert_eq!(n_live, 0);
        }
    }

    /// Committed fingerprints, made once from scripts/allocbench/opgen.cpp (the C++ generator)
    /// with `g++ -O2`, so this check holds where there is no compiler.
    #[test]
    fn sequences_match_the_committed_cpp_fixture() {
        let fixture = include_str!("../tests/fixtures/opgen.txt");
        let mut checked = 0;
        for line in fixture
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let f: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| f[i].parse::<u64>().expect("number");
            let p = OpParams {
                n_allocs: num(0),
                max_live: num(1) as u32,
                min_size: num(2),
                max_size: num(3),
                seed: num(4),
            };
            let ops = make_ops(p);
            assert_eq!(ops.len() as u64, num(5), "{p:?}");
            // The first ops, then the fingerprint of them all.
            let head: Vec<String> = ops
                .iter()
                .take(8)
                .map(|op| match *op {
                    Op::Alloc { slot, size } => format!("{slot}:{size}"),
                    Op::Free { slot } => format!("{slot}:0"),
                })
                .collect();
            assert_eq!(head.join(","), f[6], "{p:?}");
            let total: u64 = ops
                .iter()
                .map(|op| match *op {
                    Op::Alloc { size, .. } => size,
                    Op::Free { .. } => 0,
                })
                .sum();
            assert_eq!(total, num(7), "{p:?}: total bytes allocated");
            checked += 1;
        }
        assert_eq!(checked, bench_params().len());
    }

    /// Compiles the C++ generator and compares every op of every benchmark sequence.
    /// `scripts/test.sh` runs it where g++ is installed, and says it is skipped where not.
    #[test]
    #[ignore = "needs g++: scripts/test.sh runs it where g++ is installed"]
    fn sequences_match_the_cpp_generator_op_by_op() {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../scripts/allocbench/opgen.cpp")
            .canonicalize()
            .expect("scripts/allocbench/opgen.cpp");
        let dir = std::env::temp_dir().join(format!("gpumem-opgen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("opgen");
        let built = Command::new("g++")
            .args(["-O2", "-std=c++17", "-o"])
            .arg(&exe)
            .arg(&src)
            .status();
        let built = built.expect("g++ runs");
        assert!(built.success(), "g++ failed to build {}", src.display());
        for p in bench_params() {
            let out = Command::new(&exe)
                .args(
                    [
                        p.n_allocs,
                        p.max_live as u64,
                        p.min_size,
                        p.max_size,
                        p.seed,
                    ]
                    .map(|v| v.to_string()),
                )
                .output()
                .expect("run opgen");
            assert!(out.status.success());
            let text = String::from_utf8(out.stdout).unwrap();
            let cpp: Vec<Op> = text
                .lines()
                .map(|l| {
                    let (a, b) = l.split_once(' ').unwrap();
                    let (slot, size) = (a.parse().unwrap(), b.parse().unwrap());
                    if size == 0 {
                        Op::Free { slot }
                    } else {
                        Op::Alloc { slot, size }
                    }
                })
                .collect();
            let rust = make_ops(p);
            assert_eq!(cpp.len(), rust.len(), "{p:?}");
            if let Some(i) = cpp.iter().zip(&rust).position(|(a, b)| a != b) {
                panic!(
                    "{p:?}: op {i} differs: C++ {:?}, Rust {:?}",
                    cpp[i], rust[i]
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
