//! Where the CLI's output goes: a closed stdout, files that cannot be written, and flags that do
//! not apply. Each failure must be clear and must come before the long work, not after it.

mod common;
use common::{gpumem, stderr};
use gpumem_core::testing::bundled_trace;
use std::process::{Command, Stdio};

/// The write end of a pipe whose reader has already exited: every write to it fails with
/// EPIPE, as `gpumem ... | head -1` does once `head` has its line. (The reader is `true`, which
/// exits at once; waiting for it makes the closed read end certain, not a race.)
fn closed_pipe() -> Stdio {
    let mut reader = Command::new("true")
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn true");
    let write_end = reader.stdin.take().expect("piped stdin");
    assert!(reader.wait().unwrap().success());
    Stdio::from(write_end)
}

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let mlp = bundled_trace("validation/mlp.pickle.gz");
    let mlp = mlp.to_str().unwrap();
    let commands: [&[&str]; 4] = [
        &["replay", mlp, "-p", "caching"],
        &["replay", mlp, "-p", "caching", "--json"],
        &["summary", mlp],
        &[
            "intensity",
            "--gpu",
            "h200",
            "--flops",
            "1e12",
            "--bytes",
            "1e9",
        ],
    ];
    for args in commands {
        let out = gpumem()
            .args(args)
            .stdout(closed_pipe())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let e = stderr(&out);
        assert!(!e.contains("panicked"), "gpumem {args:?}: {e}");
        assert_eq!(out.status.code(), Some(0), "gpumem {args:?}: {e}");
    }
}

#[test]
fn simulator_flags_are_refused_on_the_gpu() {
    let mlp = bundled_trace("validation/mlp.pickle.gz");
    let out = gpumem()
        .arg("replay")
        .arg(&mlp)
        .args(["--device", "cuda", "--plot", "x.html", "--gpu-lag-ms", "5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("--plot, --gpu-lag-ms apply to the simulated device only"),
        "{e}"
    );
    for (flag, args) in [
        ("--device-memory", &["--device-memory", "80GiB"][..]),
        ("--remap-sites", &["--remap-sites"][..]),
        ("--free-by-address", &["--free-by-address"][..]),
        ("--cold-kib", &["--cold-kib", "64"][..]),
    ] {
        let out = gpumem()
            .arg("replay")
            .arg(&mlp)
            .args(["--device", "cuda"])
            .args(args)
            .output()
            .unwrap();
        let e = stderr(&out);
        assert!(
            e.contains(&format!("{flag} applies to the simulated device only")),
            "{e}"
        );
    }
}

#[test]
fn an_absurd_cold_buffer_is_refused() {
    let mlp = bundled_trace("validation/mlp.pickle.gz");
    let out = gpumem()
        .arg("replay")
        .arg(&mlp)
        .args(["-p", "stitched", "--cold-kib", "99999999"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("--cold-kib 99999999: at most 1048576"), "{e}");
}

#[test]
fn unwritable_output_paths_fail_before_the_work() {
    let mlp = bundled_trace("validation/mlp.pickle.gz");
    let bad = std::env::temp_dir()
        .join(format!("gpumem-no-such-dir-{}", std::process::id()))
        .join("out.html");
    for flag in ["--plot", "--snapshot"] {
        let out = gpumem()
            .arg("replay")
            .arg(&mlp)
            .args(["-p", "stitched", flag])
            .arg(&bad)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let e = stderr(&out);
        assert!(e.contains(&format!("{flag} {}", bad.display())), "{e}");
        assert!(e.contains("cannot write there"), "{e}");
        // Refused before the replay: no table was printed.
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The probe refuses its --save path before it looks for a GPU, so the answer is the same
    // on a machine with one and without.
    let out = gpumem()
        .args(["probe", "--quick", "--save"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("--save") && e.contains("cannot write there"),
        "{e}"
    );
    // And a check that passes leaves no empty file behind.
    let fine = std::env::temp_dir().join(format!("gpumem-plot-{}.html", std::process::id()));
    let out = gpumem()
        .args(["probe", "--quick", "--runs", "5", "--save"])
        .arg(&fine)
        .output()
        .unwrap();
    assert!(stderr(&out).contains("runs must be between 10"));
    assert!(!fine.exists());
}

#[test]
fn absurd_probe_and_intensity_sizes_get_a_range_not_a_panic() {
    for (flag, value, want) in [
        (
            "--hbm-size",
            "9223372036854775808",
            "between 64 MiB and 1 TiB",
        ),
        ("--chase-size", "16GiB", "below 16 GiB"),
        ("--elements", "18446744073709550592", "at most 2^38"),
        ("--runs", "18446744073709551615", "between 10"),
    ] {
        let out = gpumem().args(["probe", flag, value]).output().unwrap();
        assert!(!out.status.success());
        let e = stderr(&out);
        assert!(
            e.contains(want) && !e.contains("panicked"),
            "{flag} {value}: {e}"
        );
    }
    // Array counts that overflow a u32 sum: 4,294,967,296 arrays of 1024 floats = 16 TiB.
    let out = gpumem()
        .args([
            "intensity",
            "--gpu",
            "h200",
            "--kind",
            "elementwise",
            "--elements",
            "1024",
        ])
        .args(["--inputs", "4294967295", "--outputs", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        j["bytes"].as_f64(),
        Some(1024.0 * 4_294_967_296.0 * 4.0),
        "{j}"
    );
}

/// The replay shows the trace's lower reference beside the policies: in the table, and in
/// every policy's JSON line. The small MLP trace's lower reference is 1.0175 of live, and its
/// stitched replay holds exactly that.
#[test]
fn replay_shows_the_lower_reference() {
    let mlp = bundled_trace("validation/mlp.pickle.gz");
    let out = gpumem()
        .arg("replay")
        .arg(&mlp)
        .args(["-p", "caching", "-p", "stitched", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let r = l["lower_reference"]
            .as_f64()
            .expect("a lower_reference field");
        assert!((r - 1.0175).abs() < 0.00005, "{l}");
    }
    // The caching policy (PyTorch's segments) is far above it, stitched on it.
    assert!(lines[0]["ratio"].as_f64().unwrap() > 1.1);
    assert!((lines[1]["ratio"].as_f64().unwrap() - 1.0175).abs() < 0.00005);
    let out = gpumem()
        .arg("replay")
        .arg(&mlp)
        .args(["-p", "stitched"])
        .output()
        .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("lower reference (shared/ANCHORS.md §1): 1.0175 of live"),
        "{table}"
    );
}
