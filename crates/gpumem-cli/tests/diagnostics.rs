//! The diagnostics subcommands, run as a user runs them: `gpumem summary`, `gpumem replay
//! --snapshot/--plot`, `gpumem monitor` (on the scripted fake GPU, and without a GPU).

mod common;
use common::gpumem;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpumem_core::testing::bundled_trace;

/// The command exited with success (its stderr is the failure message otherwise).
#[track_caller]
fn assert_succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("gpumem-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn summary_of_a_pytorch_snapshot() {
    // A snapshot PyTorch wrote (an encoder-decoder's training, recorded on an H200).
    let t = bundled_trace("validation/encdec.pickle.gz");
    let out = gpumem()
        .args(["summary", "--json", "--check"])
        .arg(&t)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["replayable"], true);
    assert_eq!(j["history_complete"], true);
    // The command's figures are those of the snapshot as the library reads it: its segments,
    // and the peak of its recorded segment events walked forward.
    let snap = gpumem_core::trace::pickle::load_snapshot(&t, 0, None).unwrap();
    let segments = snap.segments.len() as u64;
    assert!(segments > 0);
    assert_eq!(j["segments"], segments);
    assert_eq!(j["flat"]["segment.all.current"], segments);
    let (mut cur, mut peak) = (0i64, 0i64);
    for e in &snap.trace.events {
        match e.kind {
            gpumem_core::trace::Kind::SegmentAlloc => cur += e.size as i64,
            gpumem_core::trace::Kind::SegmentFree => cur -= e.size as i64,
            _ => {}
        }
        peak = peak.max(cur);
    }
    assert!(peak > 0);
    assert_eq!(j["flat"]["reserved_bytes.all.peak"], peak);
    let table = gpumem().arg("summary").arg(&t).output().unwrap();
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.contains("| GPU reserved memory   |"), "{text}");
    assert!(text.contains("from small pool"), "{text}");
}

#[test]
fn summary_errors_are_clear() {
    let bad = tmp("not-a-snapshot.pickle");
    std::fs::write(&bad, b"hello").unwrap();
    let out = gpumem().arg("summary").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("not a pickle"), "{e}");
    let out = gpumem()
        .args(["summary", "/no/such/file"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

#[test]
fn replay_writes_a_snapshot_and_a_plot() {
    let t = bundled_trace("gpt_varlen.pickle.gz");
    let snap = tmp("expandable.pickle.gz");
    let plot = tmp("plot.html");
    let out = gpumem()
        .args(["replay", "-p", "expandable", "--snapshot"])
        .arg(&snap)
        .arg("--plot")
        .arg(&plot)
        .arg(&t)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let out = gpumem()
        .args(["summary", "--json", "--check"])
        .arg(&snap)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["replayable"], true);
    // Every allocation of the trace is in the history.
    let allocs = gpumem_core::trace::load(&t, 0, None).unwrap().allocs() as u64;
    assert!(allocs > 1000);
    assert_eq!(j["flat"]["allocation.all.allocated"], allocs);
    let html = std::fs::read_to_string(&plot).unwrap();
    assert!(html.contains(r#"data-policy="expandable""#));
    // Several policies cannot share one snapshot.
    let out = gpumem()
        .args(["replay", "--snapshot"])
        .arg(&snap)
        .arg(&t)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("exactly one --policy"));
}

#[test]
fn monitor_json_names_the_leaking_process() {
    let out = gpumem()
        .args(["monitor", "--fake", "leak", "--json", "--count", "20"])
        .args(["--interval", "50ms", "--window", "0.5s"])
        .output()
        .unwrap();
    assert_succeeded(&out);
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(lines.len(), 21);
    let end = &lines[20];
    assert_eq!(end["type"], "end");
    let raised = end["alarms_raised"].as_array().unwrap();
    assert_eq!(raised.len(), 1, "{raised:?}");
    assert_eq!(raised[0]["pid"], 4242);
    assert_eq!(raised[0]["name"], "leaky");
}

#[test]
fn monitor_without_a_gpu_says_so() {
    let out = gpumem()
        .args(["monitor", "--count", "1", "--json"])
        .output()
        .unwrap();
    if out.status.success() {
        // A GPU machine: one sample and the end record.
        let text = String::from_utf8(out.stdout).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
    } else {
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            e.contains("needs an NVIDIA GPU") && e.contains("NVML"),
            "{e}"
        );
        assert!(!e.contains("panicked"), "{e}");
    }
}

fn interrupt(child: &std::process::Child) {
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

fn wait(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("did not stop within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn monitor_stops_cleanly_on_ctrl_c_and_serves_metrics() {
    let mut child = gpumem()
        .args(["monitor", "--fake", "leak", "--quiet", "--interval", "50ms"])
        .args(["--window", "0.5s", "--prometheus", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    let url = first
        .split("http://")
        .nth(1)
        .and_then(|s| s.strip_suffix("/metrics\n"))
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_string();
    // Let it take a few samples, then scrape over a real connection.
    std::thread::sleep(Duration::from_millis(900));
    let mut s = std::net::TcpStream::connect(&url).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(
        body.contains(r#"gpumem_leak_alarm{gpu="0",pid="4242",process="leaky"} 1.0"#),
        "{body}"
    );
    interrupt(&child);
    let status = wait(&mut child, Duration::from_secs(5));
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    assert!(status.success(), "exit {status:?}: {rest}");
    assert!(rest.contains("(interrupted)"), "{rest}");
    assert!(rest.contains("pid 4242 (leaky)"), "{rest}");
}

#[test]
fn replay_gpu_lag_counts_fewer_host_waits_and_refuses_nonsense() {
    let t = bundled_trace("gpt_varlen.pickle.gz");
    let waits = |extra: &[&str]| {
        let out = gpumem()
            .args(["replay", "-p", "stitched", "--json"])
            .args(extra)
            .arg(&t)
            .output()
            .unwrap();
        assert_succeeded(&out);
        let j: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap())
                .unwrap();
        (
            j["driver_calls"]["cuEventSynchronize"]
                .as_u64()
                .unwrap_or(0),
            j["peak_held_bytes"].as_u64().unwrap(),
        )
    };
    let (every, held) = waits(&[]);
    let (lag0, held0) = waits(&["--gpu-lag-ms", "0"]);
    assert!(
        lag0 < every,
        "lag 0: {lag0} host waits, every wait counted: {every}"
    );
    assert_eq!(held0, held);
    for bad in ["-1", "soon", "NaN"] {
        let out = gpumem()
            .args(["replay", &format!("--gpu-lag-ms={bad}")])
            .arg(&t)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains("not a lag in milliseconds"), "{bad}: {e}");
    }
}

#[test]
fn replay_remap_sites_lists_the_sizes_that_remap() {
    let t = bundled_trace("anchors/prefetch_mlp.gmt.gz");
    let out = gpumem()
        .args([
            "replay",
            "-p",
            "stitched",
            "--gpu-lag-ms",
            "10",
            "--remap-sites",
        ])
        .arg(&t)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let head = text
        .lines()
        .find(|l| l.contains("allocations that unmapped pages to place their block"))
        .unwrap_or_else(|| panic!("no remap-site table: {text}"));
    // "(N pages in all": N is the sum of the table's page column when every size is shown.
    let total: u64 = head
        .split('(')
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(total > 0, "{head}");
    let out = gpumem()
        .args(["replay", "-p", "stitched", "--json", "--remap-sites"])
        .arg(&t)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let j: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    let sites = j["remap_sites"]
        .as_array()
        .expect("remap_sites in the JSON");
    assert!(sites.iter().all(|s| s["pages"].as_u64().unwrap() >= 1));
}

#[test]
fn absurd_arguments_are_refused_before_any_work() {
    let t = bundled_trace("validation/mlp.pickle.gz");
    // `gpumem replay ARGS TRACE`, which must fail: what it said.
    let refused = |args: &[&str]| {
        let out = gpumem().arg("replay").args(args).arg(&t).output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        common::stderr(&out)
    };
    let e = refused(&["--device-memory", "1"]);
    assert!(e.contains("smaller than one 2 MiB page"), "{e}");
    // A device of 1,024 TiB once made the expandable policy ask for 8 GiB of page table.
    let e = refused(&["--device-memory", "1024TiB"]);
    assert!(
        e.contains("'1024TiB': 1125899906842624 bytes is more than the 4 TiB"),
        "{e}"
    );
    // A policy named in --conf is the one replayed, and one that -p contradicts is refused
    // (each run sets its own policy, so it was silently dropped).
    let e = refused(&["--conf", "policy:buddy", "-p", "caching"]);
    assert!(
        e.contains("--conf names policy:buddy and -p names caching"),
        "{e}"
    );
    let out = gpumem()
        .args(["replay", "--json", "--conf", "policy:buddy"])
        .arg(&t)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["policy"], "buddy", "one policy's result: {v}");
    // A device index where the format holds one device: said, not silently dropped.
    let csv = tmp("one_device.csv");
    std::fs::write(
        &csv,
        "Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x1000,4096,0\n1,2.0,free,0x1000,4096,0\n",
    )
    .unwrap();
    let out = gpumem()
        .args(["replay", "-p", "caching", "--device-index", "3"])
        .arg(&csv)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let e = common::stderr(&out);
    assert!(
        e.contains("--device-index 3 ignored: a rmm-csv trace"),
        "{e}"
    );
    // More threads than an allocator has streams: refused at once, not 100,000 threads spawned.
    let t0 = Instant::now();
    let out = gpumem()
        .args(["bench", "alloc", "--sim", "--threads", "100000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("100000 threads: at most 1024"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}
