//! The monitoring loop: sample, detect, print, publish; until a count, a duration, or a stop
//! request (Ctrl-C) ends it.

use crate::detect::{Alarm, DetectorConfig, GrowthDetector};
use crate::prom::Endpoint;
use crate::render;
use crate::source::{DeviceSource, MonitorError};
use serde::Serialize;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How samples are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// A table per sample.
    Table,
    /// One JSON object per line.
    Json,
    /// Nothing (the Prometheus endpoint only).
    Silent,
}

/// What to do.
#[derive(Debug, Clone)]
pub struct MonitorOptions {
    /// Time between samples.
    pub interval: Duration,
    /// Stop after this many samples.
    pub count: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// How to print.
    pub output: Output,
    /// Leak detection thresholds.
    pub detector: DetectorConfig,
    /// Serve Prometheus metrics on this (loopback) address.
    pub prometheus: Option<String>,
}

impl Default for MonitorOptions {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            count: None,
            duration: None,
            output: Output::Table,
            detector: DetectorConfig::default(),
            prometheus: None,
        }
    }
}

/// Time for the loop: real, or advanced by hand in tests.
pub trait Clock {
    /// Seconds since the clock started.
    fn now(&mut self) -> f64;
    /// Waits until `t` (seconds since start) or until `stop` is set, whichever comes first.
    fn sleep_until(&mut self, t: f64, stop: &AtomicBool);
    /// Unix time now, seconds.
    fn unix(&mut self) -> f64;
}

/// The real clock.
pub struct RealClock(Instant);

impl Default for RealClock {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl Clock for RealClock {
    fn now(&mut self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }

    fn sleep_until(&mut self, t: f64, stop: &AtomicBool) {
        // Short naps, so that Ctrl-C is answered within 50 ms.
        while !stop.load(Ordering::Relaxed) {
            let left = t - self.now();
            if left <= 0.0 {
                break;
            }
            std::thread::sleep(Duration::from_secs_f64(left.min(0.05)));
        }
    }

    fn unix(&mut self) -> f64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    }
}

/// A clock whose sleeps return at once, having moved time forward (tests).
#[derive(Debug, Default)]
pub struct ManualClock {
    /// Seconds since start.
    pub t: f64,
}

impl Clock for ManualClock {
    fn now(&mut self) -> f64 {
        self.t
    }

    fn sleep_until(&mut self, t: f64, _stop: &AtomicBool) {
        self.t = self.t.max(t);
    }

    fn unix(&mut self) -> f64 {
        1.8e9 + self.t
    }
}

/// Why the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stopped {
    /// `count` samples taken.
    Count,
    /// `duration` elapsed.
    Duration,
    /// Stop requested (Ctrl-C).
    Signal,
}

/// How a run went.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Samples taken.
    pub samples: u64,
    /// Why it stopped.
    pub stopped: Stopped,
    /// Every alarm raised, as first raised.
    pub alarms: Vec<Alarm>,
}

/// Consecutive failed samples after which the loop gives up.
const MAX_FAILURES: u32 = 5;

/// Runs the monitor: samples `source` every interval, prints to `out`, reports status to
/// `log`, serves metrics if asked; returns when a stop condition is met.
pub fn run(
    source: &mut dyn DeviceSource,
    opts: &MonitorOptions,
    out: &mut dyn Write,
    log: &mut dyn Write,
    stop: &AtomicBool,
    clock: &mut dyn Clock,
) -> Result<RunSummary, MonitorError> {
    let endpoint = opts
        .prometheus
        .as_deref()
        .map(Endpoint::start)
        .transpose()?;
    if let Some(ep) = &endpoint {
        writeln!(
            log,
            "gpumem monitor: metrics at http://{}/metrics",
            ep.addr()
        )?;
    }
    let mut det = GrowthDetector::new(opts.detector.clone());
    if opts.output == Output::Table {
        writeln!(
            out,
            "gpumem monitor: {}; every {:.1} s; leak alarm on steady growth ≥ {}/s and ≥ {} \
             over {:.0} s{}",
            source.describe(),
            opts.interval.as_secs_f64(),
            gpumem_core::units::format_size(opts.detector.min_rate as u64),
            gpumem_core::units::format_size(opts.detector.min_growth),
            opts.detector.window_s,
            if opts.count.is_none() && opts.duration.is_none() {
                "; Ctrl-C to stop"
            } else {
                ""
            }
        )?;
    }
    let start = clock.now();
    let mut raised: Vec<Alarm> = Vec::new();
    let mut samples = 0u64;
    let mut failures = 0u32;
    let stopped = loop {
        if stop.load(Ordering::Relaxed) {
            break Stopped::Signal;
        }
        if opts.count.is_some_and(|c| samples >= c) {
            break Stopped::Count;
        }
        let t = clock.now();
        if opts
            .duration
            .is_some_and(|d| t - start >= d.as_secs_f64() && samples > 0)
        {
            break Stopped::Duration;
        }
        match source.sample() {
            Ok(gpus) => {
                failures = 0;
                samples += 1;
                let alarms = det.observe(t, &gpus);
                for a in alarms.iter().filter(|a| a.new) {
                    raised.push(a.clone());
                }
                let unix = clock.unix();
                match opts.output {
                    Output::Table => write!(
                        out,
                        "{}",
                        render::table(samples, unix, &gpus, &det, &alarms)
                    )?,
                    Output::Json => writeln!(
                        out,
                        "{}",
                        render::json_sample(samples, unix, &gpus, &det, &alarms)
                    )?,
                    Output::Silent => {}
                }
                out.flush()?;
                if let Some(ep) = &endpoint {
                    ep.update(&gpus, &det, &alarms);
                }
            }
            Err(e) => {
                failures += 1;
                writeln!(log, "gpumem monitor: sample failed: {e}")?;
                if failures >= MAX_FAILURES {
                    return Err(e);
                }
            }
        }
        let next = start + (samples.max(1) as f64 + failures as f64) * opts.interval.as_secs_f64();
        clock.sleep_until(next, stop);
    };
    let summary = RunSummary {
        samples,
        stopped,
        alarms: raised,
    };
    match opts.output {
        Output::Json => writeln!(
            out,
            "{}",
            serde_json::json!({"type": "end", "samples": summary.samples,
                "stopped": summary.stopped, "alarms_raised": summary.alarms})
        )?,
        Output::Table | Output::Silent => {
            writeln!(
                log,
                "gpumem monitor: stopped after {} sample{} ({}); {} alarm{} raised",
                summary.samples,
                if summary.samples == 1 { "" } else { "s" },
                match stopped {
                    Stopped::Count => "count reached",
                    Stopped::Duration => "duration reached",
                    Stopped::Signal => "interrupted",
                },
                summary.alarms.len(),
                if summary.alarms.len() == 1 { "" } else { "s" },
            )?;
            for a in &summary.alarms {
                writeln!(log, "  {a}")?;
            }
        }
    }
    out.flush()?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeSource;
    use std::sync::Arc;

    fn opts(output: Output, count: u64) -> MonitorOptions {
        MonitorOptions {
            count: Some(count),
            output,
            detector: DetectorConfig {
                window_s: 10.0,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn json_lines_parse_and_name_the_leak() {
        let mut src = FakeSource::scenario("leak").unwrap();
        let (mut out, mut log) = (Vec::new(), Vec::new());
        let stop = AtomicBool::new(false);
        let s = run(
            &mut src,
            &opts(Output::Json, 20),
            &mut out,
            &mut log,
            &stop,
            &mut ManualClock::default(),
        )
        .unwrap();
        assert_eq!((s.samples, s.stopped), (20, Stopped::Count));
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("each line is JSON"))
            .collect();
        assert_eq!(lines.len(), 21, "20 samples and the end record");
        assert_eq!(lines[0]["type"], "sample");
        assert_eq!(
            lines[0]["gpus"][0]["processes"].as_array().unwrap().len(),
            3
        );
        assert_eq!(lines[19]["sample"], 20);
        let first_alarm = lines
            .iter()
            .position(|l| l["alarms"].as_array().is_some_and(|a| !a.is_empty()))
            .expect("an alarm");
        assert!(
            (7..=11).contains(&first_alarm),
            "alarm at sample {first_alarm}"
        );
        let a = &lines[first_alarm]["alarms"][0];
        assert_eq!(
            (a["pid"].as_u64(), a["new"].as_bool()),
            (Some(4242), Some(true))
        );
        assert_eq!(lines[20]["type"], "end");
        assert_eq!(lines[20]["alarms_raised"].as_array().unwrap().len(), 1);
        assert!(
            s.alarms.iter().all(|a| a.pid == Some(4242)),
            "the loader is not a leak"
        );
    }

    #[test]
    fn the_table_shows_processes_and_alarms() {
        let mut src = FakeSource::scenario("leak").unwrap();
        let (mut out, mut log) = (Vec::new(), Vec::new());
        let stop = AtomicBool::new(false);
        run(
            &mut src,
            &opts(Output::Table, 14),
            &mut out,
            &mut log,
            &stop,
            &mut ManualClock::default(),
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("fake device source"), "{text}");
        assert!(text.contains("pid 4242 leaky  LEAK?"), "{text}");
        assert!(
            text.contains("ALARM LEAK? GPU 0 pid 4242 (leaky)"),
            "{text}"
        );
        assert!(text.contains("+64.00 MiB/s"), "{text}");
        let log = String::from_utf8(log).unwrap();
        assert!(
            log.contains("stopped after 14 samples (count reached); 1 alarm raised"),
            "{log}"
        );
    }

    #[test]
    fn a_step_and_noise_raise_nothing() {
        for sc in ["step", "noise", "idle"] {
            let mut src = FakeSource::scenario(sc).unwrap();
            let stop = AtomicBool::new(false);
            let s = run(
                &mut src,
                &opts(Output::Silent, 60),
                &mut Vec::new(),
                &mut Vec::new(),
                &stop,
                &mut ManualClock::default(),
            )
            .unwrap();
            assert!(s.alarms.is_empty(), "{sc}: {:?}", s.alarms);
        }
    }

    #[test]
    fn a_stop_request_ends_the_loop_promptly() {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let t = std::thread::spawn(move || {
            let mut src = FakeSource::scenario("idle").unwrap();
            let o = MonitorOptions {
                interval: Duration::from_millis(200),
                output: Output::Silent,
                ..Default::default()
            };
            run(
                &mut src,
                &o,
                &mut Vec::new(),
                &mut Vec::new(),
                &flag,
                &mut RealClock::default(),
            )
        });
        std::thread::sleep(Duration::from_millis(500));
        let asked = Instant::now();
        stop.store(true, Ordering::Relaxed);
        let s = t.join().unwrap().unwrap();
        assert!(
            asked.elapsed() < Duration::from_millis(200),
            "{:?}",
            asked.elapsed()
        );
        assert_eq!(s.stopped, Stopped::Signal);
        assert!((2..=4).contains(&s.samples), "{}", s.samples);
    }

    #[test]
    fn duration_bounds_the_run() {
        let mut src = FakeSource::scenario("idle").unwrap();
        let o = MonitorOptions {
            duration: Some(Duration::from_secs(5)),
            output: Output::Silent,
            ..Default::default()
        };
        let stop = AtomicBool::new(false);
        let s = run(
            &mut src,
            &o,
            &mut Vec::new(),
            &mut Vec::new(),
            &stop,
            &mut ManualClock::default(),
        )
        .unwrap();
        assert_eq!((s.samples, s.stopped), (5, Stopped::Duration));
    }
}
