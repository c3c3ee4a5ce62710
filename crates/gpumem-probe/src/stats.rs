//! Summary statistics of repeated measurements: median and spread.

use serde::{Deserialize, Serialize};

/// Median, extremes and quartiles of a series of repeated runs (in the unit of the field that
/// holds it). Quartiles use linear interpolation between order statistics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub n: usize,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub q1: f64,
    pub q3: f64,
}

impl Stats {
    /// Statistics of `samples`; `None` when there are none or one is not finite.
    pub fn of(samples: &[f64]) -> Option<Stats> {
        if samples.is_empty() || samples.iter().any(|x| !x.is_finite()) {
            return None;
        }
        let mut v = samples.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        Some(Stats {
            n: v.len(),
            median: quantile(&v, 0.5),
            min: v[0],
            max: v[v.len() - 1],
            q1: quantile(&v, 0.25),
            q3: quantile(&v, 0.75),
        })
    }

    /// The same statistics after mapping every sample through a monotone function `f` (for
    /// instance seconds to GB/s, which reverses the order; min and max are swapped back).
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Stats {
        let (a, b) = (f(self.min), f(self.max));
        let (c, d) = (f(self.q1), f(self.q3));
        Stats {
            n: self.n,
            median: f(self.median),
            min: a.min(b),
            max: a.max(b),
            q1: c.min(d),
            q3: c.max(d),
        }
    }

    /// (max - min) / median: the relative spread over the runs.
    pub fn rel_spread(&self) -> f64 {
        if self.median == 0.0 {
            0.0
        } else {
            (self.max - self.min) / self.median
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let w = pos - lo as f64;
    sorted[lo] * (1.0 - w) + sorted[hi] * w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_quartiles_of_known_series() {
        let s = Stats::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!(s.n, 5);
        assert_eq!(s.median, 3.0);
        assert_eq!((s.min, s.max), (1.0, 5.0));
        assert_eq!((s.q1, s.q3), (2.0, 4.0));
        let even = Stats::of(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(even.median, 2.5);
        assert_eq!(even.q1, 1.75);
        assert!((s.rel_spread() - 4.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn mapping_through_a_decreasing_function_keeps_min_below_max() {
        // Seconds to GB/s for 10 GB: the slowest run is the lowest bandwidth.
        let t = Stats::of(&[0.002, 0.004, 0.0025]).unwrap();
        let bw = t.map(|s| 10.0 / s);
        assert_eq!(bw.min, 2500.0);
        assert_eq!(bw.max, 5000.0);
        assert_eq!(bw.median, 4000.0);
    }

    #[test]
    fn empty_or_non_finite_series_has_no_stats() {
        assert!(Stats::of(&[]).is_none());
        assert!(Stats::of(&[1.0, f64::NAN]).is_none());
    }
}
