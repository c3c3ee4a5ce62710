//! `gpumem monitor`: GPU memory per device and per process every interval, like
//! `nvidia-smi -l 1`, with an alarm on steady growth (a leak), JSON lines, and a Prometheus
//! endpoint on localhost. Stops cleanly on Ctrl-C.

use clap::Args;
use gpumem_core::units::parse_size;
use gpumem_monitor::fake::FakeSource;
use gpumem_monitor::nvml::NvmlSource;
use gpumem_monitor::{run as run_monitor, DetectorConfig, DeviceSource, MonitorOptions, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct MonitorArgs {
    /// Time between samples (seconds, or with a unit: 500ms, 2s, 1m).
    #[arg(long, short = 'i', default_value = "1", value_parser = parse_duration)]
    interval: Duration,
    /// Stop after this many samples.
    #[arg(long, short = 'c')]
    count: Option<u64>,
    /// Stop after this long (e.g. 90s, 10m).
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// One JSON object per line (a "sample" record per interval, an "end" record last).
    #[arg(long)]
    json: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (a loopback address; default
    /// 127.0.0.1:9400).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = gpumem_monitor::prom::DEFAULT_ADDR)]
    prometheus: Option<String>,
    /// Print nothing per sample (useful with --prometheus).
    #[arg(long)]
    quiet: bool,
    /// Leak alarm: the window of time a decision looks at.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    window: Duration,
    /// Leak alarm: the least steady growth per second (bytes, e.g. 1MiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_bytes)]
    leak_rate: u64,
    /// Leak alarm: the least growth over the window (bytes, e.g. 64MiB).
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    leak_min: u64,
    /// A scripted GPU instead of NVML (leak, step, noise, idle), to try the monitor without
    /// a GPU.
    #[arg(long, hide = true)]
    fake: Option<String>,
}

/// "1", "0.5", "500ms", "30s", "5m", "1h".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (e.g. 1, 500ms, 30s, 5m)"))?;
    let secs = match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1000.0,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        other => return Err(format!("unknown unit '{other}' in '{s}' (ms, s, m, h)")),
    };
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(format!("'{s}': a duration must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 64MiB)"))
}

pub fn run(a: MonitorArgs) -> Result<(), String> {
    let mut source: Box<dyn DeviceSource> =
        match &a.fake {
            Some(name) => Box::new(FakeSource::scenario(name).ok_or_else(|| {
                format!("unknown fake scenario '{name}' (leak, step, noise, idle)")
            })?),
            None => Box::new(
                NvmlSource::new()
                    .map_err(|e| format!("monitor needs an NVIDIA GPU and its driver: {e}"))?,
            ),
        };
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
            window_s: a.window.as_secs_f64(),
            min_rate: a.leak_rate as f64,
            min_growth: a.leak_min,
            ..DetectorConfig::default()
        },
        prometheus: a.prometheus.clone(),
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
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("1").unwrap(), Duration::from_secs(1));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("3 weeks")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_duration("soon").is_err());
    }
}
