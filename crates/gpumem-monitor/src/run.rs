//! The monitoring loop: sample, detect, print, publish; until a count, a duration, or a stop
//! request (Ctrl-C) ends it.

use crate::detect::{Alarm, DetectorConfig, GrowthDetector};
use crate::prom::Endpoint;
use crate::render;
use crate::source::{DeviceSource, MonitorError};
use serde::Serialize;
use std::io::{ErrorKind, Write};
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

impl MonitorOptions {
    /// Checks the options before a run: the detector's thresholds, and that a window spans
    /// enough sampling intervals for the leak alarm to be able to fire at all
    /// ([`DetectorConfig::check`]).
    pub fn check(&self) -> Result<(), MonitorError> {
        self.detector
            .check(self.interval.as_secs_f64())
            .map_err(MonitorError::Config)
    }
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
    /// `MAX_FAILURES` samples in a row failed; [`run`] returns the last error.
    Failed,
    /// The output was closed by its reader (a broken pipe, as `gpumem monitor | head`): the
    /// run ends quietly, with nothing more written.
    Closed,
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

/// Writes `text` to the output and flushes it, so that a reader sees every sample when it is
/// taken (and a closed pipe is noticed at once).
fn emit(out: &mut dyn Write, text: &str) -> std::io::Result<()> {
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// Whether a write failed because the reader closed the output.
fn closed(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::BrokenPipe
}

/// Runs the monitor: samples `source` every interval, prints to `out`, reports status to
/// `log`, serves metrics if asked; returns when a stop condition is met.
///
/// Samples are taken on a fixed schedule, `start + k × interval`; a failed sample uses its
/// slot like any other, and a sample that took longer than an interval skips the slots that
/// went by rather than sampling in a burst to catch up. A `duration` is a deadline: the last
/// wait ends at it. When `out` is closed by its reader ([`ErrorKind::BrokenPipe`]) the run
/// ends quietly with [`Stopped::Closed`]. After `MAX_FAILURES` failed samples in a row the
/// end record (JSON) or the summary (log) is written with the reason, and the last error is
/// returned.
pub fn run(
    source: &mut dyn DeviceSource,
    opts: &MonitorOptions,
    out: &mut dyn Write,
    log: &mut dyn Write,
    stop: &AtomicBool,
    clock: &mut dyn Clock,
) -> Result<RunSummary, MonitorError> {
    opts.check()?;
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
    for note in source.notes() {
        writeln!(log, "gpumem monitor: note: {note}")?;
    }
    let mut det = GrowthDetector::new(opts.detector.clone());
    let mut raised: Vec<Alarm> = Vec::new();
    let mut samples = 0u64;
    if opts.output == Output::Table {
        let header = format!(
            "gpumem monitor: {}; every {}; leak alarm on steady growth ≥ {}/s and ≥ {} \
             over {}{}\n",
            source.describe(),
            render::duration(opts.interval.as_secs_f64()),
            render::size(opts.detector.min_rate as u64),
            render::size(opts.detector.min_growth),
            render::duration(opts.detector.window_s),
            if opts.count.is_none() && opts.duration.is_none() {
                "; Ctrl-C to stop"
            } else {
                ""
            }
        );
        match emit(out, &header) {
            Err(e) if closed(&e) => {
                return Ok(RunSummary {
                    samples,
                    stopped: Stopped::Closed,
                    alarms: raised,
                })
            }
            other => other?,
        }
    }
    let interval = opts.interval.as_secs_f64();
    let start = clock.now();
    let deadline = opts.duration.map(|d| start + d.as_secs_f64());
    // The schedule's next slot: sample k is due at start + k × interval.
    let mut slot = 0u64;
    let mut failures = 0u32;
    let mut failure: Option<MonitorError> = None;
    let stopped = loop {
        if stop.load(Ordering::Relaxed) {
            break Stopped::Signal;
        }
        if opts.count.is_some_and(|c| samples >= c) {
            break Stopped::Count;
        }
        let t = clock.now();
        // At least one attempt, however short the duration.
        if slot > 0 && deadline.is_some_and(|d| t >= d) {
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
                let text = match opts.output {
                    Output::Table => Some(render::table(samples, unix, &gpus, &det, &alarms)),
                    Output::Json => Some(format!(
                        "{}\n",
                        render::json_sample(samples, unix, &gpus, &det, &alarms)
                    )),
                    Output::Silent => None,
                };
                if let Some(text) = text {
                    match emit(out, &text) {
                        Err(e) if closed(&e) => break Stopped::Closed,
                        other => other?,
                    }
                }
                if let Some(ep) = &endpoint {
                    ep.update(&gpus, &det, &alarms);
                }
            }
            Err(e) => {
                failures += 1;
                writeln!(log, "gpumem monitor: sample failed: {e}")?;
                if failures >= MAX_FAILURES {
                    failure = Some(e);
                    break Stopped::Failed;
                }
            }
        }
        // The slot after this one; if sampling overran it, the first slot still ahead.
        let now_slot = ((clock.now() - start) / interval).floor();
        slot = (slot + 1).max(now_slot.max(0.0) as u64 + 1);
        let mut next = start + slot as f64 * interval;
        if let Some(d) = deadline {
            next = next.min(d);
        }
        clock.sleep_until(next, stop);
    };
    let summary = RunSummary {
        samples,
        stopped,
        alarms: raised,
    };
    if stopped == Stopped::Closed {
        return Ok(summary);
    }
    match opts.output {
        Output::Json => {
            let mut end = serde_json::json!({"type": "end", "samples": summary.samples,
                "stopped": summary.stopped, "alarms_raised": summary.alarms});
            if let Some(e) = &failure {
                end["error"] = e.to_string().into();
            }
            match emit(out, &format!("{end}\n")) {
                Err(e) if closed(&e) => {}
                other => other?,
            }
        }
        Output::Table | Output::Silent => {
            let reason = match stopped {
                Stopped::Count => "count reached".to_string(),
                Stopped::Duration => "duration reached".to_string(),
                Stopped::Signal => "interrupted".to_string(),
                Stopped::Failed => format!("gave up after {MAX_FAILURES} failed samples in a row"),
                Stopped::Closed => "output closed".to_string(),
            };
            writeln!(
                log,
                "gpumem monitor: stopped after {} sample{} ({reason}); {} alarm{} raised",
                summary.samples,
                if summary.samples == 1 { "" } else { "s" },
                summary.alarms.len(),
                if summary.alarms.len() == 1 { "" } else { "s" },
            )?;
            for a in &summary.alarms {
                writeln!(log, "  {a}")?;
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(summary),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeSource;
    use std::cell::Cell;
    use std::rc::Rc;
    use std::sync::Arc;

    /// The times (seconds since start) of the samples printed as JSON lines.
    fn sample_times(out: &[u8]) -> Vec<f64> {
        String::from_utf8(out.to_vec())
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|l| l["type"] == "sample")
            .map(|l| l["time"].as_f64().unwrap() - 1.8e9)
            .collect()
    }

    /// [`run`] with its output and log thrown away and no stop requested.
    fn run_silent(
        src: &mut FakeSource,
        o: &MonitorOptions,
        clock: &mut dyn Clock,
    ) -> Result<RunSummary, MonitorError> {
        let stop = AtomicBool::new(false);
        run(src, o, &mut Vec::new(), &mut Vec::new(), &stop, clock)
    }

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
            let s = run_silent(
                &mut src,
                &opts(Output::Silent, 60),
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
        let s = run_silent(&mut src, &o, &mut ManualClock::default()).unwrap();
        assert_eq!((s.samples, s.stopped), (5, Stopped::Duration));
    }

    #[test]
    fn a_failed_sample_still_waits_for_the_next_interval() {
        // Sample 1 fails: the samples are those of slots 0, 2 and 3, one interval apart
        // (before: 0, 2, 2, the one after a failure taken at once).
        let o = MonitorOptions {
            count: Some(3),
            output: Output::Json,
            ..Default::default()
        };
        let mut src = FakeSource::scenario("idle").unwrap().failing(1..2);
        let (mut out, mut log) = (Vec::new(), Vec::new());
        let stop = AtomicBool::new(false);
        let mut clock = ManualClock::default();
        let s = run(&mut src, &o, &mut out, &mut log, &stop, &mut clock).unwrap();
        assert_eq!((s.samples, s.stopped), (3, Stopped::Count));
        assert_eq!(sample_times(&out), [0.0, 2.0, 3.0]);
        assert_eq!(src.samples, 4, "one failed attempt and three samples");
        let log = String::from_utf8(log).unwrap();
        assert_eq!(
            log.lines().collect::<Vec<_>>(),
            ["gpumem monitor: sample failed: NVML query failed: scripted failure of fake sample 1"]
        );
        // The first sample fails: the next comes one interval later, not two (before: 2, 2, 2).
        let mut src = FakeSource::scenario("idle").unwrap().failing(0..1);
        let mut out = Vec::new();
        let mut clock = ManualClock::default();
        run(&mut src, &o, &mut out, &mut Vec::new(), &stop, &mut clock).unwrap();
        assert_eq!(sample_times(&out), [1.0, 2.0, 3.0]);
    }

    /// A clock and a source sharing the time: each sample takes `cost` seconds.
    struct SlowClock(Rc<Cell<f64>>);
    struct SlowSource(FakeSource, Rc<Cell<f64>>, f64);

    impl Clock for SlowClock {
        fn now(&mut self) -> f64 {
            self.0.get()
        }
        fn sleep_until(&mut self, t: f64, _stop: &AtomicBool) {
            self.0.set(self.0.get().max(t));
        }
        fn unix(&mut self) -> f64 {
            1.8e9 + self.0.get()
        }
    }

    impl DeviceSource for SlowSource {
        fn sample(&mut self) -> Result<Vec<crate::GpuSample>, MonitorError> {
            self.1.set(self.1.get() + self.2);
            self.0.sample()
        }
        fn describe(&self) -> String {
            "slow".into()
        }
    }

    #[test]
    fn a_sample_slower_than_the_interval_skips_the_slots_it_overran() {
        let t = Rc::new(Cell::new(0.0));
        let mut src = SlowSource(FakeSource::scenario("idle").unwrap(), t.clone(), 2.5);
        let o = MonitorOptions {
            count: Some(3),
            output: Output::Json,
            ..Default::default()
        };
        let mut out = Vec::new();
        let stop = AtomicBool::new(false);
        run(
            &mut src,
            &o,
            &mut out,
            &mut Vec::new(),
            &stop,
            &mut SlowClock(t),
        )
        .unwrap();
        // Sampling starts at slots 0, 3 and 6 (each sample ends 2.5 s in, past two slots of
        // 1 s), and the printed time is when it ended: no burst of back-to-back samples.
        assert_eq!(sample_times(&out), [2.5, 5.5, 8.5]);
    }

    #[test]
    fn the_duration_is_a_deadline_the_last_wait_stops_at() {
        let mut src = FakeSource::scenario("idle").unwrap();
        let o = MonitorOptions {
            interval: Duration::from_secs(2),
            duration: Some(Duration::from_secs(5)),
            output: Output::Silent,
            ..Default::default()
        };
        let mut clock = ManualClock::default();
        let s = run_silent(&mut src, &o, &mut clock).unwrap();
        // Samples at 0, 2 and 4 s; the wait after the last one ends at 5 s, not 6.
        assert_eq!((s.samples, s.stopped), (3, Stopped::Duration));
        assert_eq!(clock.t, 5.0);
        // A first sample that fails under a short duration does not spin: one attempt, then
        // the deadline.
        let mut src = FakeSource::scenario("idle").unwrap().failing(0..1);
        let o = MonitorOptions {
            duration: Some(Duration::from_millis(10)),
            output: Output::Silent,
            ..Default::default()
        };
        let mut clock = ManualClock::default();
        let s = run_silent(&mut src, &o, &mut clock).unwrap();
        assert_eq!(
            (s.samples, s.stopped, src.samples),
            (0, Stopped::Duration, 1)
        );
        assert_eq!(clock.t, 0.01);
    }

    #[test]
    fn giving_up_after_failures_still_writes_the_end_record() {
        let mut src = FakeSource::scenario("broken").unwrap();
        let (mut out, mut log) = (Vec::new(), Vec::new());
        let stop = AtomicBool::new(false);
        let mut clock = ManualClock::default();
        let e = run(
            &mut src,
            &opts(Output::Json, 100),
            &mut out,
            &mut log,
            &stop,
            &mut clock,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "NVML query failed: scripted failure of fake sample 6"
        );
        // Two samples, then five failures one interval apart (2 to 6 s).
        assert_eq!(clock.t, 6.0);
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "{text}");
        let end = &lines[2];
        assert_eq!(end["type"], "end");
        assert_eq!(end["samples"], 2);
        assert_eq!(end["stopped"], "failed");
        assert_eq!(
            end["error"],
            "NVML query failed: scripted failure of fake sample 6"
        );
        assert_eq!(end["alarms_raised"], serde_json::json!([]));
        assert_eq!(String::from_utf8(log).unwrap().lines().count(), 5);
        // The table's summary, on the log, says why too.
        let mut src = FakeSource::scenario("broken").unwrap();
        let mut log = Vec::new();
        run(
            &mut src,
            &opts(Output::Table, 100),
            &mut Vec::new(),
            &mut log,
            &stop,
            &mut ManualClock::default(),
        )
        .unwrap_err();
        let log = String::from_utf8(log).unwrap();
        assert_eq!(
            log.lines().last(),
            Some(
                "gpumem monitor: stopped after 2 samples (gave up after 5 failed samples in a \
                 row); 0 alarms raised"
            ),
            "{log}"
        );
    }

    /// Takes `left` writes, then fails every one with `kind`.
    struct Closing {
        left: usize,
        kind: ErrorKind,
        got: Vec<u8>,
    }

    impl Write for Closing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.left == 0 {
                return Err(std::io::Error::from(self.kind));
            }
            self.left -= 1;
            self.got.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_output_ends_the_run_quietly() {
        for (output, lines) in [(Output::Json, 3), (Output::Table, 0)] {
            let mut out = Closing {
                left: 3,
                kind: ErrorKind::BrokenPipe,
                got: Vec::new(),
            };
            let mut log = Vec::new();
            let stop = AtomicBool::new(false);
            let s = run(
                &mut FakeSource::scenario("leak").unwrap(),
                &opts(output, 1000),
                &mut out,
                &mut log,
                &stop,
                &mut ManualClock::default(),
            )
            .unwrap();
            assert_eq!(s.stopped, Stopped::Closed);
            // JSON: three lines went out, the fourth sample found the pipe closed. Table: the
            // header and two tables went out (one write each).
            assert_eq!(s.samples, if output == Output::Json { 4 } else { 3 });
            let got = String::from_utf8(out.got).unwrap();
            if lines > 0 {
                assert_eq!(got.lines().count(), lines);
                assert!(got.lines().all(|l| l.contains(r#""type":"sample""#)));
            } else {
                assert!(
                    got.starts_with("gpumem monitor: fake device source"),
                    "{got}"
                );
            }
            assert!(log.is_empty(), "{}", String::from_utf8_lossy(&log));
        }
        // Any other write error is still an error.
        let mut out = Closing {
            left: 1,
            kind: ErrorKind::PermissionDenied,
            got: Vec::new(),
        };
        let e = run(
            &mut FakeSource::scenario("idle").unwrap(),
            &opts(Output::Json, 10),
            &mut out,
            &mut Vec::new(),
            &AtomicBool::new(false),
            &mut ManualClock::default(),
        )
        .unwrap_err();
        assert!(
            matches!(e, MonitorError::Output(ref io) if io.kind() == ErrorKind::PermissionDenied)
        );
    }

    #[test]
    fn the_header_keeps_sub_second_intervals_and_unit_boundaries() {
        let o = MonitorOptions {
            interval: Duration::from_millis(250),
            count: Some(1),
            detector: DetectorConfig {
                window_s: 2.5,
                min_rate: (1u64 << 20) as f64,
                min_growth: 1 << 30,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut out = Vec::new();
        run(
            &mut FakeSource::scenario("idle").unwrap(),
            &o,
            &mut out,
            &mut Vec::new(),
            &AtomicBool::new(false),
            &mut ManualClock::default(),
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text.lines().next(),
            Some(
                "gpumem monitor: fake device source (no GPU); every 250 ms; leak alarm on \
                 steady growth ≥ 1.00 MiB/s and ≥ 1.00 GiB over 2.5 s"
            )
        );
    }

    #[test]
    fn a_window_of_too_few_intervals_is_refused_before_anything_runs() {
        // interval = window / 2: the alarm could not fire; said so, with values that work.
        let o = MonitorOptions {
            interval: Duration::from_secs(5),
            output: Output::Json,
            detector: DetectorConfig {
                window_s: 10.0,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut src = FakeSource::scenario("leak").unwrap();
        let mut out = Vec::new();
        let e = run(
            &mut src,
            &o,
            &mut out,
            &mut Vec::new(),
            &AtomicBool::new(false),
            &mut ManualClock::default(),
        )
        .unwrap_err();
        assert!(matches!(e, MonitorError::Config(_)), "{e:?}");
        assert_eq!(
            e.to_string(),
            "--window 10s is too short for --interval 5s: the leak alarm cuts the window into 5 \
             stretches and needs at least 10 samples in it (two per stretch), so the window \
             must be at least 10 × the interval: use --window 50s or longer, or --interval 1s \
             or shorter"
        );
        assert!(out.is_empty());
        assert_eq!(src.samples, 0);
    }
}
