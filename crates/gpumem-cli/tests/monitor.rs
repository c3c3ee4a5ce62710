//! `gpumem monitor` on the scripted fake GPU, as a user runs it: flags out of range, options
//! that could not work, a source that keeps failing, a reader that goes away.

mod common;
use common::{gpumem, stderr};
use std::io::{BufRead, BufReader, Read};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

fn monitor(args: &[&str]) -> Output {
    gpumem().arg("monitor").args(args).output().unwrap()
}

#[test]
fn monitor_refuses_times_out_of_range_without_panicking() {
    let huge = format!("1{}", "0".repeat(300));
    for (flag, range) in [
        ("--interval", "1 ms to 24 h"),
        ("--window", "1 ms to 24 h"),
        ("--duration", "1 ms to 365 days (8760h)"),
    ] {
        for bad in [huge.as_str(), "1e300", "99999999999999999999999h", "0"] {
            let out = monitor(&["--fake", "idle", "--count", "1", flag, bad]);
            let e = stderr(&out);
            // clap's usage error, naming the flag, then the range it takes.
            assert_eq!(out.status.code(), Some(2), "{flag} {bad}: {e}");
            assert!(!e.contains("panicked"), "{e}");
            assert!(
                e.contains(&format!("'{bad}' is out of range: {flag} takes {range}")),
                "{e}"
            );
            assert!(out.stdout.is_empty());
        }
    }
}

#[test]
fn monitor_refuses_a_window_of_too_few_intervals() {
    // interval = window / 2: the leak alarm could never fire; said so before sampling.
    let out = monitor(&[
        "--fake",
        "leak",
        "--json",
        "--count",
        "20",
        "--interval",
        "5s",
        "--window",
        "10s",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert_eq!(
        stderr(&out),
        "gpumem: --window 10s is too short for --interval 5s: the leak alarm cuts the window \
         into 5 stretches and needs at least 10 samples in it (two per stretch), so the window \
         must be at least 10 × the interval: use --window 50s or longer, or --interval 1s or \
         shorter\n"
    );
    // The suggestion works: the leak is found.
    let out = monitor(&[
        "--fake",
        "leak",
        "--json",
        "--count",
        "20",
        "--interval",
        "10ms",
        "--window",
        "100ms",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let end: serde_json::Value = serde_json::from_str(
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(end["alarms_raised"][0]["pid"], 4242);
}

#[test]
fn monitor_refuses_zero_leak_thresholds() {
    for (flag, says) in [
        ("--leak-rate", "--leak-rate must be above 0"),
        ("--leak-min", "--leak-min must be above 0"),
    ] {
        let out = monitor(&["--fake", "leak", "--count", "1", flag, "0"]);
        assert_eq!(out.status.code(), Some(2));
        let e = stderr(&out);
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn monitor_writes_the_end_record_when_it_gives_up() {
    // Two samples, then every sample fails: five in a row, one interval apart, and it stops
    // with the end record and the error.
    let out = monitor(&[
        "--fake",
        "broken",
        "--json",
        "--interval",
        "10ms",
        "--window",
        "100ms",
        "--count",
        "100",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[1]["type"], "sample");
    let end = &lines[2];
    assert_eq!(end["type"], "end");
    assert_eq!(end["stopped"], "failed");
    assert_eq!(end["samples"], 2);
    assert_eq!(
        end["error"],
        "NVML query failed: scripted failure of fake sample 6"
    );
    let e = stderr(&out);
    assert_eq!(e.matches("gpumem monitor: sample failed").count(), 5, "{e}");
    assert!(
        e.ends_with("gpumem: NVML query failed: scripted failure of fake sample 6\n"),
        "{e}"
    );
}

#[test]
fn monitor_prints_sub_second_intervals() {
    let out = monitor(&[
        "--fake",
        "idle",
        "--count",
        "1",
        "--interval",
        "250ms",
        "--window",
        "2.5s",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text.lines().next(),
        Some(
            "gpumem monitor: fake device source (no GPU); every 250 ms; leak alarm on steady \
             growth ≥ 1.00 MiB/s and ≥ 64.00 MiB over 2.5 s"
        )
    );
}

/// Like `gpumem monitor ... | head -1`: the reader takes a line and goes away.
#[test]
fn monitor_ends_quietly_when_its_reader_goes_away() {
    // JSON lines, and the table (with a flag that changes nothing, to keep one shape).
    for mode in ["--json", "--leak-min=64MiB"] {
        let mut child = gpumem()
            .args(["monitor", "--fake", "leak", "--interval", "10ms"])
            .args(["--window", "100ms", "--count", "100000", mode])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        // The reader (and with it the pipe) is gone now.
        let expected = if mode == "--json" {
            r#"{"alarms":[]"#
        } else {
            "gpumem monitor: fake device source"
        };
        assert!(first.starts_with(expected), "{mode}: {first}");
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                panic!("{mode}: still running 10 s after its reader went away");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(status.code(), Some(0), "{mode}: {err}");
        assert_eq!(err, "", "{mode}");
    }
}
