//! `gpumem monitor`: GPU memory per device and per process every interval, like
//! `nvidia-smi -l 1`, with an alarm on steady growth (a leak), JSON lines, and a Prometheus
//! endpoint on localhost. Stops cleanly on Ctrl-C.

use clap::Args;
use gpumem_core::units::parse_size;
use gpumem_monitor::fake::FakeSource;
use gpumem_monitor::nvml::NvmlSource;
use gpumem_monitor::{
    run as run_monitor, DetectorConfig, DeviceSource, MonitorError, MonitorOptions, Output,
};
use std::io::ErrorKind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct MonitorArgs {
    /// Time between samples (seconds, or with a unit: 500ms, 2s, 1m; 1 ms to 24 h).
    #[arg(long, short = 'i', default_value = "1", value_parser = parse_interval)]
    interval: Duration,
    /// Stop after this many samples.
    #[arg(long, short = 'c')]
    count: Option<u64>,
    /// Stop after this long (e.g. 90s, 10m; 1 ms to 365 days).
    #[arg(long, value_parser = parse_run_duration)]
    duration: Option<Duration>,
    /// One JSON object per line (a "sample" record per interval, an "end" record last).
    #[arg(long)]
    json: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (a loopback address; default
    /// 127.0.0.1:19400).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = gpumem_monitor::prom::DEFAULT_ADDR)]
    prometheus: Option<String>,
    /// Print nothing per sample (useful with --prometheus).
    #[arg(long)]
    quiet: bool,
    /// Leak alarm: the window of time a decision looks at (1 ms to 24 h, and at least 10
    /// intervals; default: 30 s, or 10 intervals when that is longer).
    #[arg(long, value_parser = parse_window)]
    window: Option<Duration>,
    /// Leak alarm: the least steady growth per second (bytes, e.g. 1MiB; above 0).
    #[arg(long, default_value = "1MiB", value_parser = parse_leak_rate)]
    leak_rate: u64,
    /// Leak alarm: the least growth over the window (bytes, e.g. 64MiB; above 0).
    #[arg(long, default_value = "64MiB", value_parser = parse_leak_min)]
    leak_min: u64,
    /// A scripted GPU instead of NVML (leak, step, noise, idle, broken), to try the monitor
    /// without a GPU.
    #[arg(long, hide = true)]
    fake: Option<String>,
}

/// The times a flag takes: from `min_s` to `max_s` seconds, said as `text`.
struct TimeRange {
    flag: &'static str,
    min_s: f64,
    max_s: f64,
    text: &'static str,
}

const INTERVAL: TimeRange = TimeRange {
    flag: "--interval",
    min_s: 0.001,
    max_s: 86_400.0,
    text: "1 ms to 24 h",
};
// The detector keeps every sample of a window and sorts them at every sample: a day of
// one-second samples is already 86 400 points per process.
const WINDOW: TimeRange = TimeRange {
    flag: "--window",
    min_s: 0.001,
    max_s: 86_400.0,
    text: "1 ms to 24 h",
};
const DURATION: TimeRange = TimeRange {
    flag: "--duration",
    min_s: 0.001,
    max_s: 365.0 * 86_400.0,
    text: "1 ms to 365 days (8760h)",
};

fn parse_interval(s: &str) -> Result<Duration, String> {
    parse_time(s, &INTERVAL)
}

fn parse_window(s: &str) -> Result<Duration, String> {
    parse_time(s, &WINDOW)
}

fn parse_run_duration(s: &str) -> Result<Duration, String> {
    parse_time(s, &DURATION)
}

/// The length of the number at the start of `t`: an optional sign, digits and dots, and an
/// exponent (`1e3`, `2.5E-1`) when one follows.
fn number_len(t: &str) -> usize {
    let b = t.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'-' | b'+')));
    while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
        i += 1;
    }
    if i > 0 && matches!(b.get(i), Some(b'e' | b'E')) {
        let mut j = i + 1;
        if matches!(b.get(j), Some(b'-' | b'+')) {
            j += 1;
        }
        let digits = j;
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        if j > digits {
            i = j;
        }
    }
    i
}

/// "1", "0.5", "500ms", "30s", "5m", "1h", "1e-3": seconds unless a unit says otherwise.
fn parse_seconds(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, unit) = t.split_at(number_len(t));
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (e.g. 1, 500ms, 30s, 5m)"))?;
    Ok(match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1000.0,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        other => return Err(format!("unknown unit '{other}' in '{s}' (ms, s, m, h)")),
    })
}

/// A time for `range`'s flag: an error naming the flag and the range when it is out of it
/// (zero, negative, or too large to mean anything), never a panic.
fn parse_time(s: &str, range: &TimeRange) -> Result<Duration, String> {
    let out_of_range = || format!("'{s}' is out of range: {} takes {}", range.flag, range.text);
    let secs = parse_seconds(s)?;
    if !(secs.is_finite() && secs >= range.min_s && secs <= range.max_s) {
        return Err(out_of_range());
    }
    Duration::try_from_secs_f64(secs).map_err(|_| out_of_range())
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 64MiB)"))
}

/// A zero rate would make every growing window count: the alarm would never clear after a
/// leak stops (it clears under half the rate) and the baseline would never move (a flat
/// window is one under a quarter of it).
fn parse_leak_rate(s: &str) -> Result<u64, String> {
    match parse_bytes(s)? {
        0 => Err(format!(
            "'{s}': --leak-rate must be above 0 (bytes per second, e.g. 1MiB): with no least \
             rate the alarm never clears and the baseline never moves"
        )),
        v => Ok(v),
    }
}

/// A zero rise would leave no window flat (one that rose by under half of it), so the
/// baseline would never follow a model load.
fn parse_leak_min(s: &str) -> Result<u64, String> {
    match parse_bytes(s)? {
        0 => Err(format!(
            "'{s}': --leak-min must be above 0 (bytes, e.g. 64MiB): with no least rise the \
             baseline never moves after a model load"
        )),
        v => Ok(v),
    }
}

/// The leak alarm's window when none is given: 30 s, stretched to the least number of samples
/// the alarm needs when the interval is long (`--interval 10s` gets a 100 s window, instead
/// of an error about a window the user never chose).
fn default_window(interval: Duration) -> Duration {
    let least = interval.saturating_mul(DetectorConfig::default().min_samples_per_window());
    least.max(Duration::from_secs(30))
}

pub fn run(a: MonitorArgs) -> Result<(), String> {
    let opts = MonitorOptions {
        interval: a.interval,
        count: a.count,
        duration: a.duration,
        output: if a.quiet {
            Output::Silent
        } else if a.json {
            Output::Json
        } else {
            Output::Table
        },
        detector: DetectorConfig {
            window_s: a
                .window
                .unwrap_or_else(|| default_window(a.interval))
                .as_secs_f64(),
            min_rate: a.leak_rate as f64,
            min_growth: a.leak_min,
            ..DetectorConfig::default()
        },
        prometheus: a.prometheus.clone(),
    };
    // Options that cannot work are refused before the GPU is opened.
    opts.check().map_err(|e| e.to_string())?;
    let mut source: Box<dyn DeviceSource> = match &a.fake {
        Some(name) => Box::new(FakeSource::scenario(name).ok_or_else(|| {
            format!("unknown fake scenario '{name}' (leak, step, noise, idle, broken)")
        })?),
        None => Box::new(
            NvmlSource::new()
                .map_err(|e| format!("monitor needs an NVIDIA GPU and its driver: {e}"))?,
        ),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::Relaxed))
        .map_err(|e| format!("cannot catch Ctrl-C: {e}"))?;
    let mut clock = gpumem_monitor::RealClock::default();
    run_monitor(
        source.as_mut(),
        &opts,
        &mut std::io::stdout().lock(),
        &mut std::io::stderr(),
        &stop,
        &mut clock,
    )
    .map(|_| ())
    .or_else(|e| match e {
        // stdout closed by its reader (`gpumem monitor | head`) already ends the run quietly
        // inside the monitor; the log (stderr) closed the same way leaves nothing to say
        // anything on either, so it is a quiet end too, like other Unix tools.
        MonitorError::Output(io) if io.kind() == ErrorKind::BrokenPipe => Ok(()),
        e => Err(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_window_stretches_to_ten_intervals() {
        assert_eq!(
            default_window(Duration::from_secs(1)),
            Duration::from_secs(30)
        );
        assert_eq!(
            default_window(Duration::from_secs(3)),
            Duration::from_secs(30)
        );
        assert_eq!(
            default_window(Duration::from_secs(5)),
            Duration::from_secs(50)
        );
        let d = DetectorConfig {
            window_s: default_window(Duration::from_secs(7)).as_secs_f64(),
            ..DetectorConfig::default()
        };
        d.check(7.0).unwrap();
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_interval("1").unwrap(), Duration::from_secs(1));
        assert_eq!(parse_interval("0.5").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_interval("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_interval("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_window("1.5min").unwrap(), Duration::from_secs(90));
        assert!(parse_interval("0").is_err());
        assert!(parse_interval("3 weeks")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_interval("soon").is_err());
    }

    #[test]
    fn times_out_of_a_flags_range_are_refused_naming_it() {
        let huge = format!("1{}", "0".repeat(300));
        for (parse, flag, range) in [
            (
                parse_interval as fn(&str) -> Result<Duration, String>,
                "--interval",
                "1 ms to 24 h",
            ),
            (parse_window, "--window", "1 ms to 24 h"),
            (parse_run_duration, "--duration", "1 ms to 365 days (8760h)"),
        ] {
            for bad in [
                huge.as_str(),
                "1e300",
                "1e30h",
                "99999999999999999999999h",
                "0",
                "-1",
                "-5s",
                "0.0000001ms",
                "1e400",
            ] {
                assert_eq!(
                    parse(bad).unwrap_err(),
                    format!("'{bad}' is out of range: {flag} takes {range}"),
                );
            }
            assert_eq!(parse("1ms").unwrap(), Duration::from_millis(1));
            assert_eq!(parse("1e-3").unwrap(), Duration::from_millis(1));
            assert_eq!(parse("2.5E1s").unwrap(), Duration::from_secs(25));
            assert_eq!(parse("24h").unwrap(), Duration::from_secs(86_400));
            assert!(parse("5e").unwrap_err().contains("unknown unit 'e'"));
            assert!(parse("NaN").unwrap_err().contains("is not a duration"));
            assert!(parse("inf").unwrap_err().contains("is not a duration"));
        }
        assert!(parse_interval("25h").is_err());
        assert_eq!(
            parse_run_duration("8760h").unwrap(),
            Duration::from_secs(365 * 86_400)
        );
    }

    #[test]
    fn zero_leak_thresholds_are_refused() {
        assert!(parse_leak_rate("0")
            .unwrap_err()
            .contains("--leak-rate must be above 0"));
        assert!(parse_leak_rate("0MiB").is_err());
        assert_eq!(parse_leak_rate("1MiB"), Ok(1 << 20));
        assert!(parse_leak_min("0")
            .unwrap_err()
            .contains("--leak-min must be above 0"));
        assert_eq!(parse_leak_min("64MiB"), Ok(64 << 20));
    }
}
