//! A scripted device source, for tests and demonstrations without a GPU: each process's
//! memory follows a pattern of the sample number.

use crate::source::{DeviceSource, GpuSample, MonitorError, ProcSample};
use gpumem_core::units::{GIB, MIB};

/// How a fake process's memory evolves, as a function of the sample number `n`.
#[derive(Debug, Clone)]
pub enum Pattern {
    /// Constant.
    Flat(u64),
    /// `start + n × per_sample`: a leak.
    Linear {
        /// Bytes at the first sample.
        start: u64,
        /// Bytes added at every sample.
        per_sample: u64,
    },
    /// `before` until sample `at`, `after` from then on: a model load.
    Step {
        /// Bytes before.
        before: u64,
        /// Bytes after.
        after: u64,
        /// First sample with `after`.
        at: u64,
    },
    /// `base` ± `amplitude`, pseudo-random but repeatable.
    Noise {
        /// Middle value.
        base: u64,
        /// Largest deviation.
        amplitude: u64,
        /// Seed.
        seed: u64,
    },
}

impl Pattern {
    /// Bytes at sample `n`.
    pub fn at(&self, n: u64) -> u64 {
        match *self {
            Pattern::Flat(b) => b,
            Pattern::Linear { start, per_sample } => start + n * per_sample,
            Pattern::Step { before, after, at } => {
                if n >= at {
                    after
                } else {
                    before
                }
            }
            Pattern::Noise {
                base,
                amplitude,
                seed,
            } => {
                // SplitMix64 of (seed, n): uniform in [-1, 1).
                let mut z = seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                let u = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                (base as f64 + u * amplitude as f64).max(0.0) as u64
            }
        }
    }
}

/// A fake process.
#[derive(Debug, Clone)]
pub struct FakeProcess {
    /// Process id.
    pub pid: u32,
    /// Name.
    pub name: String,
    /// Its memory over time.
    pub pattern: Pattern,
}

/// A source that returns one GPU whose processes follow their patterns.
#[derive(Debug, Clone)]
pub struct FakeSource {
    /// GPU memory.
    pub total_bytes: u64,
    /// Used by the driver and contexts, besides the processes.
    pub overhead_bytes: u64,
    /// Processes.
    pub processes: Vec<FakeProcess>,
    /// Samples taken so far (failed ones too).
    pub samples: u64,
    /// Samples (numbered from 0, as `samples` counts them) that fail with a query error.
    pub failing: Vec<std::ops::Range<u64>>,
}

impl FakeSource {
    /// A GPU of `total_bytes` with `processes`.
    pub fn new(total_bytes: u64, processes: Vec<FakeProcess>) -> Self {
        Self {
            total_bytes,
            overhead_bytes: 512 * MIB,
            processes,
            samples: 0,
            failing: Vec::new(),
        }
    }

    /// The same source, with samples `at` failing.
    pub fn failing(mut self, at: std::ops::Range<u64>) -> Self {
        self.failing.push(at);
        self
    }

    /// Named scenarios (for `gpumem monitor --fake`): "leak" (pid 4242 grows 64 MiB per
    /// sample beside a steady pid 4141 and a model load in pid 4343), "step" (only the model
    /// load), "noise" (a process swinging by ±256 MiB), "idle", "broken" (idle, and every
    /// sample after the first two fails, as when the driver goes away).
    pub fn scenario(name: &str) -> Option<Self> {
        let p = |pid, name: &str, pattern| FakeProcess {
            pid,
            name: name.to_string(),
            pattern,
        };
        let load = p(
            4343,
            "loader",
            Pattern::Step {
                before: 600 * MIB,
                after: 12 * GIB,
                at: 8,
            },
        );
        let procs = match name {
            "leak" => vec![
                p(4141, "trainer", Pattern::Flat(20 * GIB)),
                p(
                    4242,
                    "leaky",
                    Pattern::Linear {
                        start: GIB,
                        per_sample: 64 * MIB,
                    },
                ),
                load,
            ],
            "step" => vec![load],
            "noise" => vec![p(
                4545,
                "swinger",
                Pattern::Noise {
                    base: 8 * GIB,
                    amplitude: 256 * MIB,
                    seed: 1,
                },
            )],
            "idle" => Vec::new(),
            "broken" => return Some(Self::new(80 * GIB, Vec::new()).failing(2..u64::MAX)),
            _ => return None,
        };
        Some(Self::new(80 * GIB, procs))
    }
}

impl DeviceSource for FakeSource {
    fn sample(&mut self) -> Result<Vec<GpuSample>, MonitorError> {
        let n = self.samples;
        self.samples += 1;
        if self.failing.iter().any(|r| r.contains(&n)) {
            return Err(MonitorError::Query(format!(
                "scripted failure of fake sample {n}"
            )));
        }
        let processes: Vec<ProcSample> = self
            .processes
            .iter()
            .map(|p| ProcSample {
                pid: p.pid,
                name: p.name.clone(),
                used_bytes: Some(p.pattern.at(n)),
            })
            .collect();
        let used = self.overhead_bytes + processes.iter().filter_map(|p| p.used_bytes).sum::<u64>();
        Ok(vec![GpuSample {
            index: 0,
            name: "Fake GPU".into(),
            uuid: "GPU-00000000-fake".into(),
            used_bytes: used.min(self.total_bytes),
            total_bytes: self.total_bytes,
            util_gpu: Some((n * 7 % 100) as u32),
            util_mem: Some((n * 3 % 100) as u32),
            processes,
        }])
    }

    fn describe(&self) -> String {
        "fake device source (no GPU)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_follow_the_sample_number() {
        assert_eq!(
            Pattern::Linear {
                start: 5,
                per_sample: 2
            }
            .at(3),
            11
        );
        let s = Pattern::Step {
            before: 1,
            after: 9,
            at: 4,
        };
        assert_eq!((s.at(3), s.at(4)), (1, 9));
        let n = Pattern::Noise {
            base: 1000,
            amplitude: 100,
            seed: 2,
        };
        let v: Vec<u64> = (0..50).map(|i| n.at(i)).collect();
        assert!(v.iter().all(|&x| (900..=1100).contains(&x)));
        // Repeatable: the same seed, built afresh, gives the same samples; another seed does
        // not.
        let again = Pattern::Noise {
            base: 1000,
            amplitude: 100,
            seed: 2,
        };
        assert_eq!(v, (0..50).map(|i| again.at(i)).collect::<Vec<_>>());
        let other = Pattern::Noise {
            base: 1000,
            amplitude: 100,
            seed: 3,
        };
        assert_ne!(v, (0..50).map(|i| other.at(i)).collect::<Vec<_>>());
        assert!(v.iter().any(|&x| x != v[0]));
    }

    #[test]
    fn the_gpu_total_adds_up() {
        let mut f = FakeSource::scenario("leak").unwrap();
        let g = f.sample().unwrap();
        let procs: u64 = g[0].processes.iter().map(|p| p.used_bytes.unwrap()).sum();
        assert_eq!(g[0].used_bytes, procs + f.overhead_bytes);
        let g2 = f.sample().unwrap();
        assert_eq!(g2[0].used_bytes - g[0].used_bytes, 64 * MIB);
        assert!(FakeSource::scenario("nonsense").is_none());
    }

    #[test]
    fn scripted_failures_fail_those_samples_only() {
        let mut f = FakeSource::scenario("idle").unwrap().failing(1..3);
        let ok: Vec<bool> = (0..5).map(|_| f.sample().is_ok()).collect();
        assert_eq!(ok, [true, false, false, true, true]);
        let mut b = FakeSource::scenario("broken").unwrap();
        let ok: Vec<bool> = (0..4).map(|_| b.sample().is_ok()).collect();
        assert_eq!(ok, [true, true, false, false]);
        let e = b.sample().unwrap_err().to_string();
        assert_eq!(e, "NVML query failed: scripted failure of fake sample 4");
    }
}
