//! Leak detection: a per-process baseline and an alarm on steady growth.
//!
//! Every series (one per process per GPU, and one per GPU for its total) keeps the samples of
//! the last `window_s` seconds. The series is *growing steadily* when, over that window,
//!
//! 1. its robust slope (Theil–Sen: the median of the slopes between every pair of samples,
//!    which a single jump or a few outliers do not move much) is at least `min_rate` bytes/s,
//! 2. it rose by at least `min_growth` bytes,
//! 3. the rise is spread over the window: cut into `segments` equal stretches of time, the
//!    median of every stretch is higher than the one before by at least `evenness` times
//!    an even share of the rise. A model load, a one-off jump, rises in one stretch and
//!    fails this; noise rises and falls and fails it too; and
//! 4. the rise stands out of the noise: it is at least `significance` times the standard
//!    error of a stretch's median, estimated from the spread of the samples around the
//!    fitted line (1.4826 × their median absolute deviation). A workload that swings by
//!    gigabytes every step needs a longer window before a slow leak shows.
//!
//! The alarm is raised on the first sample where all four hold, and cleared (with
//! hysteresis) once the slope falls below half of `min_rate`.
//!
//! The tests need samples in every stretch: a window must span at least
//! [`DetectorConfig::min_samples_per_window`] sampling intervals (two per stretch, so that
//! the jitter of a real clock cannot leave a stretch empty). With an interval over half the
//! window, a window holds two samples and the alarm can never be raised; with a few more,
//! the evenness and noise tests mean little and flat but noisy memory alarms about as
//! readily as a leak. [`DetectorConfig::check`] refuses such a configuration, saying which
//! window or interval would do, instead of watching silently. The baseline of a series is
//! the median of its first stretch once it has been watched for a whole window, and moves to
//! the median of any later window that was flat: after a model load the baseline follows.

use crate::source::GpuSample;
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

/// Thresholds of the detector.
#[derive(Debug, Clone, PartialEq)]
pub struct DetectorConfig {
    /// Seconds of history a decision looks at.
    pub window_s: f64,
    /// Minimum robust slope, bytes per second.
    pub min_rate: f64,
    /// Minimum rise over the window, bytes.
    pub min_growth: u64,
    /// Stretches the window is cut into for the evenness test (at least 3).
    pub segments: usize,
    /// Share of an even rise each stretch must at least show (0..1).
    pub evenness: f64,
    /// How many standard errors of a stretch's median the rise must be.
    pub significance: f64,
}

impl DetectorConfig {
    /// The fewest sampling intervals a window must span: two per stretch of the evenness
    /// test (10 with the default five stretches).
    pub fn min_samples_per_window(&self) -> u32 {
        2 * self.segments.max(3) as u32
    }

    /// Checks the thresholds against each other and against the sampling `interval_s`
    /// (seconds). The messages name the `gpumem monitor` flags that set each value.
    pub fn check(&self, interval_s: f64) -> Result<(), String> {
        if !(self.window_s.is_finite() && self.window_s > 0.0) {
            return Err(format!(
                "--window must be a positive time, not {} s",
                self.window_s
            ));
        }
        // Zero would make the test of a flat window (|slope| < rate / 4) impossible, so the
        // baseline would never follow a model load, and the alarm (cleared once the slope is
        // under rate / 2) would never clear after a leak stops.
        if !(self.min_rate.is_finite() && self.min_rate > 0.0) {
            return Err(format!(
                "--leak-rate must be above 0 bytes/s (not {}): with no least rate every \
                 growing window counts, the alarm never clears and the baseline never moves",
                self.min_rate
            ));
        }
        // The same for the rise: a flat window is one that rose by less than half of it.
        if self.min_growth == 0 {
            return Err(
                "--leak-min must be above 0 bytes: with no least rise the baseline \
                        never moves after a model load"
                    .to_string(),
            );
        }
        if !(interval_s.is_finite() && interval_s > 0.0) {
            return Err(format!(
                "--interval must be a positive time, not {interval_s} s"
            ));
        }
        let need = self.min_samples_per_window();
        // A hair of tolerance, so that 0.5 s over 50 ms counts as the ten intervals it is.
        if self.window_s < need as f64 * interval_s * (1.0 - 1e-9) {
            let longest_interval = self.window_s / need as f64;
            let mut msg = format!(
                "--window {} is too short for --interval {}: the leak alarm cuts the window \
                 into {} stretches and needs at least {need} samples in it (two per \
                 stretch), so the window must be at least {need} × the interval: use \
                 --window {} or longer",
                flag_time(self.window_s),
                flag_time(interval_s),
                self.segments.max(3),
                flag_time_up(need as f64 * interval_s),
            );
            if longest_interval >= 0.001 {
                msg.push_str(&format!(
                    ", or --interval {} or shorter",
                    flag_time_down(longest_interval)
                ));
            }
            return Err(msg);
        }
        Ok(())
    }
}

/// A time as `gpumem monitor` takes it on its command line: "500ms", "2.5s".
fn flag_time(secs: f64) -> String {
    let trim = |v: f64| {
        let t = format!("{v:.3}");
        t.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    if secs < 1.0 {
        format!("{}ms", trim(secs * 1000.0))
    } else {
        format!("{}s", trim(secs))
    }
}

/// [`flag_time`], rounded up to the microsecond it prints (a bound that is at least `secs`).
fn flag_time_up(secs: f64) -> String {
    let unit = if secs < 1.0 { 1e-6 } else { 1e-3 };
    flag_time(((secs / unit) - 1e-6).ceil() * unit)
}

/// [`flag_time`], rounded down (a bound that is at most `secs`).
fn flag_time_down(secs: f64) -> String {
    let unit = if secs < 1.0 { 1e-6 } else { 1e-3 };
    flag_time(((secs / unit) + 1e-6).floor() * unit)
}

impl Default for DetectorConfig {
    fn default() -> Self {
        Self {
            window_s: 30.0,
            min_rate: (1 << 20) as f64,
            min_growth: 64 << 20,
            segments: 5,
            evenness: 0.25,
            significance: 5.0,
        }
    }
}

/// A series the detector follows: a process on a GPU, or a GPU's total (`pid` None).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct SeriesKey {
    /// GPU index.
    pub gpu: u32,
    /// Process id; None for the GPU's total.
    pub pid: Option<u32>,
}

/// A steady-growth alarm.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alarm {
    /// GPU index.
    pub gpu: u32,
    /// Process id; None when the GPU's total grows and no process explains it.
    pub pid: Option<u32>,
    /// Process name (or "GPU total").
    pub name: String,
    /// Robust slope over the window, bytes per second.
    pub rate_bytes_per_s: f64,
    /// Rise over the window, bytes.
    pub grew_bytes: u64,
    /// Seconds the window spans.
    pub window_s: f64,
    /// Bytes now.
    pub current_bytes: u64,
    /// Learned baseline, when there is one.
    pub baseline_bytes: Option<u64>,
    /// Seconds since the alarm was raised.
    pub active_s: f64,
    /// Raised at this sample.
    pub new: bool,
}

impl std::fmt::Display for Alarm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::render::{duration, size};
        let who = match self.pid {
            Some(pid) => format!("pid {pid} ({})", self.name),
            None => "the GPU's total (no process accounts for it)".to_string(),
        };
        write!(
            f,
            "LEAK? GPU {} {who} grows steadily: +{} in {} ({}/s), now {}",
            self.gpu,
            size(self.grew_bytes),
            duration(self.window_s),
            size(self.rate_bytes_per_s.max(0.0) as u64),
            size(self.current_bytes)
        )?;
        if let Some(b) = self.baseline_bytes {
            write!(
                f,
                ", {} above its baseline of {}",
                size(self.current_bytes.saturating_sub(b)),
                size(b)
            )?;
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Series {
    name: String,
    /// The samples of the last window, oldest first (never empty once observed).
    points: VecDeque<(f64, u64)>,
    first_t: Option<f64>,
    baseline: Option<u64>,
    alarm_since: Option<f64>,
    rate: Option<f64>,
}

/// What one decision found.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Verdict {
    slope: f64,
    rise: f64,
    span: f64,
    even: bool,
    /// Standard error of a stretch's median.
    noise: f64,
}

/// Median of a non-empty slice (sorts it).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Theil–Sen slope of `(t, value)` points (at most 120 of them are used, evenly spread).
pub fn theil_sen(points: &[(f64, f64)]) -> Option<f64> {
    let step = points.len().div_ceil(120).max(1);
    let p: Vec<(f64, f64)> = points.iter().step_by(step).copied().collect();
    let mut slopes = Vec::with_capacity(p.len() * p.len() / 2);
    for i in 0..p.len() {
        for j in i + 1..p.len() {
            let dt = p[j].0 - p[i].0;
            if dt > 0.0 {
                slopes.push((p[j].1 - p[i].1) / dt);
            }
        }
    }
    (!slopes.is_empty()).then(|| median(&mut slopes))
}

impl Series {
    fn verdict(&self, cfg: &DetectorConfig) -> Option<Verdict> {
        let (t0, t1) = (self.points.front()?.0, self.points.back()?.0);
        let span = t1 - t0;
        let pts: Vec<(f64, f64)> = self.points.iter().map(|&(t, v)| (t, v as f64)).collect();
        let slope = theil_sen(&pts)?;
        // Medians of equal stretches of time.
        let k = cfg.segments.max(3);
        let mut bins: Vec<Vec<f64>> = vec![Vec::new(); k];
        for &(t, v) in &pts {
            let i = if span > 0.0 {
                (((t - t0) / span) * k as f64) as usize
            } else {
                0
            };
            bins[i.min(k - 1)].push(v);
        }
        let meds: Vec<f64> = bins
            .iter_mut()
            .filter(|b| !b.is_empty())
            .map(|b| median(b))
            .collect();
        let rise = meds.last()? - meds.first()?;
        // Spread around the fitted line, robustly: 1.4826 × MAD estimates a standard deviation.
        let mut at0: Vec<f64> = pts.iter().map(|&(t, v)| v - slope * t).collect();
        let intercept = median(&mut at0);
        let mut res: Vec<f64> = pts
            .iter()
            .map(|&(t, v)| v - slope * t - intercept)
            .collect();
        let mid = median(&mut res);
        let mut dev: Vec<f64> = res.iter().map(|r| (r - mid).abs()).collect();
        let sigma = 1.4826 * median(&mut dev);
        let per_bin = (pts.len() as f64 / k as f64).max(1.0);
        let noise = 1.2533 * sigma / per_bin.sqrt();
        let even = meds.len() >= 3 && rise > 0.0 && {
            let share = cfg.evenness * rise / (meds.len() - 1) as f64;
            meds.windows(2).all(|w| w[1] - w[0] >= share)
        };
        Some(Verdict {
            slope,
            rise,
            span,
            even,
            noise,
        })
    }
}

/// Follows every process and GPU and raises alarms on steady growth.
#[derive(Debug, Default)]
pub struct GrowthDetector {
    cfg: DetectorConfig,
    series: BTreeMap<SeriesKey, Series>,
}

impl GrowthDetector {
    /// A detector with thresholds `cfg`.
    pub fn new(cfg: DetectorConfig) -> Self {
        Self {
            cfg,
            series: BTreeMap::new(),
        }
    }

    /// The thresholds.
    pub fn config(&self) -> &DetectorConfig {
        &self.cfg
    }

    fn observe_one(&mut self, key: SeriesKey, name: &str, t: f64, bytes: u64) -> Option<Alarm> {
        let cfg = &self.cfg;
        let s = self.series.entry(key).or_default();
        s.name = name.to_string();
        s.first_t.get_or_insert(t);
        s.points.push_back((t, bytes));
        while s
            .points
            .front()
            .is_some_and(|&(pt, _)| pt < t - cfg.window_s)
        {
            s.points.pop_front();
        }
        let watched = t - s.first_t.unwrap_or(t);
        let v = s.verdict(cfg);
        s.rate = v.map(|v| v.slope);
        let full = watched >= cfg.window_s * 0.8;
        // Baseline: first stretch of the first full window, then any flat window.
        if let (true, Some(v)) = (full, v) {
            let flat =
                v.slope.abs() < cfg.min_rate / 4.0 && v.rise.abs() < cfg.min_growth as f64 / 2.0;
            if s.baseline.is_none() || flat {
                let t0 = s.points.front().map(|p| p.0).unwrap_or(t);
                let stretch = if flat {
                    cfg.window_s
                } else {
                    cfg.window_s / cfg.segments.max(3) as f64
                };
                let mut first: Vec<f64> = s
                    .points
                    .iter()
                    .filter(|p| p.0 <= t0 + stretch)
                    .map(|p| p.1 as f64)
                    .collect();
                if !first.is_empty() {
                    s.baseline = Some(median(&mut first) as u64);
                }
            }
        }
        let growing = full
            && v.is_some_and(|v| {
                v.span >= cfg.window_s * 0.8
                    && v.slope >= cfg.min_rate
                    && v.rise >= cfg.min_growth as f64
                    && v.rise >= cfg.significance * v.noise
                    && v.even
            });
        let mut new = false;
        if growing {
            new = s.alarm_since.is_none();
            s.alarm_since.get_or_insert(t);
        } else if s.alarm_since.is_some() && !v.is_some_and(|v| v.slope >= cfg.min_rate / 2.0) {
            s.alarm_since = None;
        }
        let since = s.alarm_since?;
        let v = v?;
        Some(Alarm {
            gpu: key.gpu,
            pid: key.pid,
            name: s.name.clone(),
            rate_bytes_per_s: v.slope,
            grew_bytes: v.rise.max(0.0) as u64,
            window_s: v.span,
            current_bytes: bytes,
            baseline_bytes: s.baseline,
            active_s: t - since,
            new,
        })
    }

    /// Takes one sample of every GPU at time `t` (seconds, any origin) and returns the active
    /// alarms. A GPU's total alarms only when no process alarm on that GPU explains it.
    pub fn observe(&mut self, t: f64, gpus: &[GpuSample]) -> Vec<Alarm> {
        let mut alarms = Vec::new();
        for g in gpus {
            let mut by_process = false;
            for p in &g.processes {
                let Some(used) = p.used_bytes else { continue };
                let key = SeriesKey {
                    gpu: g.index,
                    pid: Some(p.pid),
                };
                if let Some(a) = self.observe_one(key, &p.name, t, used) {
                    by_process = true;
                    alarms.push(a);
                }
            }
            let key = SeriesKey {
                gpu: g.index,
                pid: None,
            };
            if let Some(a) = self.observe_one(key, "GPU total", t, g.used_bytes) {
                if !by_process {
                    alarms.push(a);
                }
            }
        }
        // Processes gone for a whole window are forgotten.
        let horizon = t - self.cfg.window_s;
        self.series
            .retain(|_, s| s.points.back().is_some_and(|&(last, _)| last >= horizon));
        alarms
    }

    /// Robust slope of a series over its window (bytes/s), once it has two samples.
    pub fn rate(&self, gpu: u32, pid: Option<u32>) -> Option<f64> {
        self.series.get(&SeriesKey { gpu, pid })?.rate
    }

    /// The learned baseline of a series.
    pub fn baseline(&self, gpu: u32, pid: Option<u32>) -> Option<u64> {
        self.series.get(&SeriesKey { gpu, pid })?.baseline
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::ProcSample;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn gpu(procs: &[(u32, u64)]) -> Vec<GpuSample> {
        vec![GpuSample {
            index: 0,
            name: "test".into(),
            uuid: "GPU-0".into(),
            used_bytes: 500 * MIB + procs.iter().map(|p| p.1).sum::<u64>(),
            total_bytes: 80 * GIB,
            util_gpu: Some(0),
            util_mem: Some(0),
            processes: procs
                .iter()
                .map(|&(pid, b)| ProcSample {
                    pid,
                    name: format!("proc{pid}"),
                    used_bytes: Some(b),
                })
                .collect(),
        }]
    }

    /// Deterministic noise in [-1, 1).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        }
    }

    fn noisy(base: u64, amp: u64, r: &mut Lcg) -> u64 {
        (base as f64 + amp as f64 * r.next()).max(0.0) as u64
    }

    #[test]
    fn theil_sen_ignores_one_outlier() {
        let mut pts: Vec<(f64, f64)> = (0..20).map(|i| (i as f64, 3.0 * i as f64)).collect();
        pts[7].1 = 1e9;
        assert!((theil_sen(&pts).unwrap() - 3.0).abs() < 1e-9);
    }

    #[test]
    fn steady_growth_raises_an_alarm_naming_the_process() {
        let mut d = GrowthDetector::new(DetectorConfig::default());
        let mut r = Lcg(7);
        let mut first = None;
        for s in 0..120u64 {
            let t = s as f64;
            // pid 10: flat at 3 GiB; pid 11: flat for 20 s, then +64 MiB/s.
            let leak = GIB + 64 * MIB * s.saturating_sub(20);
            let alarms = d.observe(
                t,
                &gpu(&[
                    (10, noisy(3 * GIB, 5 * MIB, &mut r)),
                    (11, noisy(leak, 5 * MIB, &mut r)),
                ]),
            );
            assert!(alarms.iter().all(|a| a.pid == Some(11)), "{alarms:?}");
            if let Some(a) = alarms.iter().find(|a| a.new) {
                assert!(first.is_none(), "raised once");
                first = Some((t, a.clone()));
            }
        }
        let (t, a) = first.expect("an alarm");
        // Growth starts at t = 20 s. Each of the five 6 s stretches of the 30 s window must
        // rise on the one before, so the alarm comes once most of the window has seen growth:
        // 20 to 31 s after it started, t = 40 to 51 s (with this seed, at 43 s).
        assert!((40.0..=51.0).contains(&t), "raised at {t}");
        assert_eq!(a.name, "proc11");
        assert!(
            (a.rate_bytes_per_s / (64 * MIB) as f64 - 1.0).abs() < 0.1,
            "{a:?}"
        );
        assert_eq!(
            a.baseline_bytes.map(|b| (b as f64 / GIB as f64).round()),
            Some(1.0)
        );
        assert!(a.to_string().contains("pid 11 (proc11)"), "{a}");
        assert!(d.rate(0, Some(10)).unwrap().abs() < MIB as f64);
    }

    #[test]
    fn a_step_like_a_model_load_raises_nothing() {
        let mut d = GrowthDetector::new(DetectorConfig::default());
        let mut r = Lcg(3);
        for s in 0..200u64 {
            // 12 GiB loaded over 3 s at t = 60, then flat.
            let load = (s.saturating_sub(60)).min(3) * 4 * GIB;
            let b = noisy(GIB + load, 2 * MIB, &mut r);
            let alarms = d.observe(s as f64, &gpu(&[(42, b)]));
            assert!(alarms.is_empty(), "t={s}: {alarms:?}");
        }
        // The baseline has moved to the new level once it was flat for a window.
        let b = d.baseline(0, Some(42)).unwrap();
        assert!((b as f64 / GIB as f64 - 13.0).abs() < 0.01, "{b}");
    }

    #[test]
    fn noise_raises_nothing() {
        for seed in 1..=20 {
            let mut d = GrowthDetector::new(DetectorConfig::default());
            let mut r = Lcg(seed);
            for s in 0..300u64 {
                // ±200 MiB of noise around 2 GiB: 3× the minimum rise, both ways.
                let b = noisy(2 * GIB, 200 * MIB, &mut r);
                let alarms = d.observe(s as f64, &gpu(&[(5, b)]));
                assert!(alarms.is_empty(), "seed {seed} t={s}: {alarms:?}");
            }
        }
    }

    #[test]
    fn a_leak_under_noise_is_found_over_a_longer_window() {
        let mut d = GrowthDetector::new(DetectorConfig {
            window_s: 60.0,
            ..DetectorConfig::default()
        });
        let mut r = Lcg(11);
        let mut raised = None;
        for s in 0..200u64 {
            let b = noisy(4 * GIB + 20 * MIB * s, 200 * MIB, &mut r);
            if let Some(a) = d
                .observe(s as f64, &gpu(&[(77, b)]))
                .into_iter()
                .find(|a| a.new)
            {
                raised.get_or_insert((s, a));
            }
        }
        let (s, a) = raised.expect("found");
        assert!(s <= 120, "found at {s}");
        assert!(
            (a.rate_bytes_per_s / (20 * MIB) as f64 - 1.0).abs() < 0.25,
            "{a:?}"
        );
    }

    #[test]
    fn slow_growth_below_the_rate_raises_nothing_and_the_alarm_clears() {
        let cfg = DetectorConfig::default();
        let mut d = GrowthDetector::new(cfg.clone());
        // 0.5 MiB/s: under min_rate.
        for s in 0..100u64 {
            assert!(d
                .observe(s as f64, &gpu(&[(1, GIB + s * MIB / 2)]))
                .is_empty());
        }
        // A leak that stops: the alarm goes once the window is flat again.
        let mut d = GrowthDetector::new(cfg);
        let mut last = Vec::new();
        for s in 0..140u64 {
            let b = GIB + 32 * MIB * s.min(70);
            last = d.observe(s as f64, &gpu(&[(9, b)]));
            if s == 69 {
                assert_eq!(last.len(), 1, "active while growing");
            }
        }
        assert!(last.is_empty(), "cleared after growth stopped: {last:?}");
    }

    #[test]
    fn the_gpu_total_alarms_when_no_process_is_visible() {
        let mut d = GrowthDetector::new(DetectorConfig::default());
        let mut raised = None;
        for s in 0..60u64 {
            let mut g = gpu(&[]);
            g[0].used_bytes = GIB + 100 * MIB * s;
            if let Some(a) = d.observe(s as f64, &g).into_iter().find(|a| a.new) {
                raised = Some(a);
            }
        }
        let a = raised.expect("GPU-level alarm");
        assert_eq!(a.pid, None);
        assert!(a.to_string().contains("GPU's total"), "{a}");
    }

    #[test]
    fn a_window_must_span_enough_intervals_and_the_rates_be_positive() {
        let cfg = DetectorConfig::default();
        assert_eq!(cfg.min_samples_per_window(), 10);
        assert_eq!(cfg.check(1.0), Ok(()));
        assert_eq!(cfg.check(3.0), Ok(()), "30 s over 3 s: exactly ten");
        let half = DetectorConfig {
            window_s: 0.5,
            ..DetectorConfig::default()
        };
        assert_eq!(
            half.check(0.05),
            Ok(()),
            "0.5 s over 50 ms is ten, not 9.999…"
        );
        // interval = window / 2.
        assert_eq!(
            cfg.check(15.0).unwrap_err(),
            "--window 30s is too short for --interval 15s: the leak alarm cuts the window \
             into 5 stretches and needs at least 10 samples in it (two per stretch), so the \
             window must be at least 10 × the interval: use --window 150s or longer, or \
             --interval 3s or shorter"
        );
        let e = half.check(0.25).unwrap_err();
        assert!(
            e.ends_with("use --window 2.5s or longer, or --interval 50ms or shorter"),
            "{e}"
        );
        // Suggestions that do not divide evenly are rounded the safe way.
        let odd = DetectorConfig {
            window_s: 1.0,
            ..DetectorConfig::default()
        };
        let e = odd.check(1.0 / 3.0).unwrap_err();
        assert!(
            e.ends_with("use --window 3.334s or longer, or --interval 100ms or shorter"),
            "{e}"
        );
        let suggested = DetectorConfig {
            window_s: 3.334,
            ..DetectorConfig::default()
        };
        assert_eq!(suggested.check(1.0 / 3.0), Ok(()), "the suggestion works");
        // Too short a window for any interval of 1 ms or more: only the window is suggested.
        let tiny = DetectorConfig {
            window_s: 0.005,
            ..DetectorConfig::default()
        };
        assert!(tiny
            .check(0.001)
            .unwrap_err()
            .ends_with("use --window 10ms or longer"));
        // A zero rate or rise would freeze the baseline and never clear an alarm.
        let zero_rate = DetectorConfig {
            min_rate: 0.0,
            ..DetectorConfig::default()
        };
        assert!(zero_rate
            .check(1.0)
            .unwrap_err()
            .starts_with("--leak-rate must be above 0 bytes/s"));
        let zero_min = DetectorConfig {
            min_growth: 0,
            ..DetectorConfig::default()
        };
        assert!(zero_min
            .check(1.0)
            .unwrap_err()
            .starts_with("--leak-min must be above 0 bytes"));
        assert!(cfg.check(0.0).is_err());
        assert!(cfg.check(f64::NAN).is_err());
    }

    /// At the least interval the check allows (window / 10), a steady leak sampled by a
    /// jittery clock (each sample up to ±30 % of an interval off its slot) is found.
    #[test]
    fn the_least_allowed_sampling_finds_a_leak_despite_jitter() {
        for seed in 1..=20 {
            let cfg = DetectorConfig::default();
            let interval = cfg.window_s / cfg.min_samples_per_window() as f64;
            assert_eq!(cfg.check(interval), Ok(()));
            let mut d = GrowthDetector::new(cfg);
            let mut r = Lcg(seed);
            let mut raised = None;
            for k in 0..40u64 {
                let t = k as f64 * interval + 0.3 * interval * r.next();
                // 16 MiB/s from the start, flat before.
                let b = GIB + (16.0 * MIB as f64 * t.max(0.0)) as u64;
                if d.observe(t, &gpu(&[(3, b)])).iter().any(|a| a.new) {
                    raised.get_or_insert(k);
                }
            }
            let k = raised.unwrap_or_else(|| panic!("seed {seed}: no alarm"));
            // Once a whole window has been watched (10 samples), at most a few samples more.
            assert!((8..=14).contains(&k), "seed {seed}: raised at sample {k}");
        }
    }
}
