//! `gpumem probe` (the memory hierarchy of the GPU at hand) and `gpumem intensity` (memory- or
//! compute-bound, and the time floor). The measuring and the arithmetic live in gpumem-probe;
//! this module parses flags, shows progress and prints.

use clap::{Args, ValueEnum};
use gpumem_core::units::parse_size;
use gpumem_probe::intensity::{self, Dtype, Peaks, Workload};
use gpumem_probe::{render, ProbeOptions, ProbeReport, Scope};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct ProbeArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Print the report as JSON on stdout instead of the tables (progress stays on stderr).
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to this file.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Smaller buffers (1 GiB) and 10 runs, for a shorter run.
    #[arg(long)]
    quick: bool,
    /// Timed runs per measurement (the median is reported; at least 10).
    #[arg(long)]
    runs: Option<usize>,
    /// Size of each of the two HBM copy buffers (default 4 GiB).
    #[arg(long, value_parser = parse_bytes)]
    hbm_size: Option<u64>,
    /// Set of the HBM pointer chase (default 2 GiB).
    #[arg(long, value_parser = parse_bytes)]
    chase_size: Option<u64>,
    /// Floats per array of the element-wise add (a multiple of 1024; default 2^28).
    #[arg(long)]
    elements: Option<u64>,
    /// Seed of the random inputs and permutations.
    #[arg(long)]
    seed: Option<u64>,
    /// No progress messages.
    #[arg(long, short)]
    quiet: bool,
    /// Exit with status 2 when a target of the H200 table is not met.
    #[arg(long)]
    strict: bool,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 4GiB)"))
}

/// Prints progress on stderr with the time since start.
fn progress_printer(quiet: bool) -> impl FnMut(&str) {
    let t0 = Instant::now();
    move |msg: &str| {
        if !quiet {
            err_println!("[{:6.1}s] {msg}", t0.elapsed().as_secs_f64());
        }
    }
}

pub fn run_probe(a: ProbeArgs) -> Result<(), String> {
    let mut opts = if a.quick {
        ProbeOptions::quick()
    } else {
        ProbeOptions::default()
    };
    opts.device = a.device;
    if let Some(r) = a.runs {
        opts.runs = r;
    }
    if let Some(b) = a.hbm_size {
        opts.hbm_bytes = b;
    }
    if let Some(b) = a.chase_size {
        opts.hbm_chase_bytes = b;
    }
    if let Some(n) = a.elements {
        opts.elementwise_elements = n;
    }
    if let Some(s) = a.seed {
        opts.seed = s;
    }
    opts.validate().map_err(|e| e.to_string())?;
    if let Some(path) = &a.save {
        crate::out::check_writable(path, "--save")?;
    }
    let mut progress = progress_printer(a.quiet);
    let report = gpumem_probe::run(&opts, &mut progress).map_err(|e| e.to_string())?;
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    // The report first: a file that cannot be written must not cost the measurements.
    if a.json {
        out_println!("{json}");
    } else {
        out_print!("{}", render::probe_table(&report));
    }
    if let Some(path) = &a.save {
        std::fs::write(path, &json)
            .map_err(|e| format!("--save: cannot write {}: {e}", path.display()))?;
    }
    if !report.complete_and_correct() {
        return Err(format!(
            "{} measurement(s) could not run and {} correctness check(s) failed (listed above)",
            report.errors.len(),
            report.failed_checks.len()
        ));
    }
    if a.strict && !report.all_targets_met() {
        err_print!("{}", render::targets_summary(&report));
        std::process::exit(2);
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    /// C[m x n] = A[m x k] B[k x n].
    Gemm,
    /// `--inputs` arrays in, `--outputs` out, element by element.
    Elementwise,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KnownGpu {
    /// ANCHORS.md §4: measured copy 4,253 GB/s; datasheet 990 TFLOP/s dense bf16, 67 fp32.
    H200,
}

#[derive(Args)]
pub struct IntensityArgs {
    /// Floating-point operations of the kernel (e.g. 1.1e12).
    #[arg(long, requires = "bytes", conflicts_with = "kind", value_parser = parse_number)]
    flops: Option<f64>,
    /// Bytes the kernel must move through device memory (e.g. 4e8 or 400MiB).
    #[arg(long, requires = "flops", value_parser = parse_amount)]
    bytes: Option<f64>,
    /// Describe the kernel by its kind and size instead of --flops/--bytes.
    #[arg(long, value_enum)]
    kind: Option<Kind>,
    /// GEMM: rows of A and C.
    #[arg(long)]
    m: Option<u64>,
    /// GEMM: columns of B and C.
    #[arg(long)]
    n: Option<u64>,
    /// GEMM: the shared (reduction) dimension.
    #[arg(long)]
    k: Option<u64>,
    /// Elements of an element-wise kernel.
    #[arg(long)]
    elements: Option<u64>,
    /// Input arrays of an element-wise kernel.
    #[arg(long, default_value_t = 2)]
    inputs: u32,
    /// Output arrays of an element-wise kernel.
    #[arg(long, default_value_t = 1)]
    outputs: u32,
    /// FLOPs per element (default: inputs - 1, at least 1: an add of two inputs is 1).
    #[arg(long)]
    flops_per_element: Option<f64>,
    /// Element type: bf16, fp16 or fp32 (default: fp32 for element-wise, bf16 otherwise).
    #[arg(long, value_parser = Dtype::parse)]
    dtype: Option<Dtype>,
    /// Peaks of a known GPU instead of measuring (for machines without one).
    #[arg(long, value_enum)]
    gpu: Option<KnownGpu>,
    /// Peaks from a saved `gpumem probe --json` report.
    #[arg(long, conflicts_with = "gpu")]
    probe_json: Option<PathBuf>,
    /// Peak FLOP/s to use (overrides the GPU's; e.g. 989e12 or 989T).
    #[arg(long, value_parser = parse_number)]
    peak_flops: Option<f64>,
    /// Memory bandwidth in bytes/s to use (overrides the GPU's; e.g. 4.25e12 or 4.25T).
    #[arg(long, value_parser = parse_number)]
    peak_bw: Option<f64>,
    /// CUDA device to measure when no other source of peaks is given.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

/// "1.1e12", "989T", "4.25 T", "400G": a number with an optional decimal SI prefix.
fn parse_number(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number (e.g. 1.5e12 or 1.5T)"))?;
    let mult = match suffix.trim() {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        other => return Err(format!("unknown suffix '{other}' in '{s}' (k, M, G, T, P)")),
    };
    let v = v * mult;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("'{s}' must be a finite non-negative number"));
    }
    Ok(v)
}

/// A byte count: a plain number (1e9) or a size (400MiB).
fn parse_amount(s: &str) -> Result<f64, String> {
    parse_number(s).or_else(|_| {
        parse_size(s)
            .map(|b| b as f64)
            .ok_or_else(|| format!("'{s}' is not a byte count"))
    })
}

fn workload(a: &IntensityArgs) -> Result<Workload, String> {
    match (a.flops, a.bytes, a.kind) {
        (Some(flops), Some(bytes), None) => Ok(Workload::Raw {
            flops,
            bytes,
            dtype: a.dtype.unwrap_or(Dtype::Bf16),
        }),
        (None, None, Some(Kind::Gemm)) => match (a.m, a.n, a.k) {
            (Some(m), Some(n), Some(k)) if m > 0 && n > 0 && k > 0 => Ok(Workload::Gemm {
                m,
                n,
                k,
                dtype: a.dtype.unwrap_or(Dtype::Bf16),
            }),
            _ => Err("--kind gemm needs --m, --n and --k (all positive)".into()),
        },
        (None, None, Some(Kind::Elementwise)) => {
            let elements = a
                .elements
                .filter(|&e| e > 0)
                .ok_or("--kind elementwise needs --elements N (positive)")?;
            if a.inputs == 0 && a.outputs == 0 {
                return Err("an element-wise kernel needs at least one input or output".into());
            }
            Ok(Workload::Elementwise {
                elements,
                inputs: a.inputs,
                outputs: a.outputs,
                flops_per_element: a
                    .flops_per_element
                    .unwrap_or(f64::from(a.inputs.saturating_sub(1).max(1))),
                dtype: a.dtype.unwrap_or(Dtype::Fp32),
            })
        }
        _ => Err(
            "say what to judge: --flops F --bytes B, or --kind gemm --m M --n N --k K, or \
                  --kind elementwise --elements N"
                .into(),
        ),
    }
}

/// Where the ceilings come from: a saved probe, a known GPU, the command line, or a quick
/// measurement of this machine's GPU, in that order.
fn peaks(a: &IntensityArgs) -> Result<Peaks, String> {
    let base = if let Some(path) = &a.probe_json {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let r: ProbeReport = serde_json::from_str(&text).map_err(|e| {
            format!(
                "{} is not a gpumem probe --json report: {e}",
                path.display()
            )
        })?;
        Peaks::from_report(&r)
    } else if a.gpu == Some(KnownGpu::H200) {
        Peaks::h200()
    } else if a.peak_flops.is_some() && a.peak_bw.is_some() {
        Peaks {
            tensor_flops: None,
            fp32_flops: None,
            bytes_per_s: None,
        }
    } else {
        if !gpumem_probe::driver_present() {
            return Err(
                "no GPU here to measure: pass --gpu h200, --probe-json FILE (from gpumem \
                        probe --json), or --peak-flops and --peak-bw"
                    .into(),
            );
        }
        let opts = ProbeOptions {
            device: a.device,
            scope: Scope::Peaks,
            ..ProbeOptions::quick()
        };
        let mut progress = progress_printer(false);
        progress(
            "measuring this GPU's peaks (HBM copy, fp32 FMA); pass --probe-json to reuse a probe",
        );
        let r = gpumem_probe::run(&opts, &mut progress).map_err(|e| e.to_string())?;
        if !r.failed_checks.is_empty() {
            return Err(format!(
                "the measurement failed its checks: {:?}",
                r.failed_checks
            ));
        }
        Peaks::from_report(&r)
    };
    Ok(base.with_overrides(a.peak_flops, a.peak_bw))
}

pub fn run_intensity(a: IntensityArgs) -> Result<(), String> {
    let w = workload(&a)?;
    w.validate()?;
    let p = peaks(&a)?;
    let analysis = intensity::analyze(&w, &p)?;
    if a.json {
        out_println!(
            "{}",
            serde_json::to_string_pretty(&analysis).map_err(|e| e.to_string())?
        );
    } else {
        out_print!("{}", intensity::table(&analysis));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: IntensityArgs,
    }

    fn parse(args: &[&str]) -> Result<IntensityArgs, String> {
        let mut v = vec!["intensity"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v)
            .map(|c| c.a)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn numbers_with_si_prefixes() {
        assert_eq!(parse_number("989T").unwrap(), 989e12);
        assert_eq!(parse_number("4.25e12").unwrap(), 4.25e12);
        assert_eq!(parse_number("1.5 G").unwrap(), 1.5e9);
        assert!(parse_number("12x").is_err());
        assert!(parse_number("-3").is_err());
        assert_eq!(parse_amount("1MiB").unwrap(), 1_048_576.0);
    }

    #[test]
    fn gemm_on_the_h200_profile_end_to_end() {
        let a = parse(&[
            "--kind", "gemm", "--m", "8192", "--n", "8192", "--k", "8192", "--gpu", "h200",
        ])
        .unwrap();
        let w = workload(&a).unwrap();
        let r = intensity::analyze(&w, &peaks(&a).unwrap()).unwrap();
        assert_eq!(r.bound, intensity::Bound::Compute);
        // 2 m n k FLOP at the profile's 990 TFLOP/s (dense bf16, the default dtype): 1.1106 ms.
        let expected = 2.0 * 8192f64.powi(3) / 990e12;
        assert!((r.floor_s - expected).abs() <= 1e-15, "{} s", r.floor_s);
    }

    #[test]
    fn elementwise_defaults_to_fp32_add() {
        let a = parse(&[
            "--kind",
            "elementwise",
            "--elements",
            "1073741824",
            "--gpu",
            "h200",
        ])
        .unwrap();
        let w = workload(&a).unwrap();
        assert_eq!(w.flops(), 1_073_741_824.0);
        assert_eq!(w.bytes(), 12_884_901_888.0);
        let r = intensity::analyze(&w, &peaks(&a).unwrap()).unwrap();
        assert_eq!(r.bound, intensity::Bound::Memory);
    }

    #[test]
    fn raw_figures_with_given_peaks_need_no_gpu() {
        let a = parse(&[
            "--flops",
            "40T",
            "--bytes",
            "1e12",
            "--peak-flops",
            "100T",
            "--peak-bw",
            "2T",
        ])
        .unwrap();
        let r = intensity::analyze(&workload(&a).unwrap(), &peaks(&a).unwrap()).unwrap();
        assert_eq!(r.ridge, 50.0);
        assert_eq!(r.floor_s, 0.5);
        // Overrides apply on top of a profile.
        let a = parse(&[
            "--flops",
            "1e12",
            "--bytes",
            "1e9",
            "--gpu",
            "h200",
            "--peak-bw",
            "1T",
        ])
        .unwrap();
        let p = peaks(&a).unwrap();
        assert_eq!(p.bytes_per_s.unwrap().value, 1e12);
        assert_eq!(p.tensor_flops.unwrap().value, 990e12);
    }

    #[test]
    fn incomplete_or_conflicting_input_is_refused() {
        assert!(parse(&["--flops", "1e9"]).is_err(), "--flops needs --bytes");
        assert!(parse(&["--flops", "1", "--bytes", "1", "--kind", "gemm"]).is_err());
        let a = parse(&["--kind", "gemm", "--m", "8", "--n", "8"]).unwrap();
        assert!(workload(&a).unwrap_err().contains("--k"));
        let a = parse(&["--kind", "elementwise"]).unwrap();
        assert!(workload(&a).unwrap_err().contains("--elements"));
        assert!(parse(&["--kind", "gemm", "--dtype", "int4"]).is_err());
    }

    #[test]
    fn a_saved_probe_report_supplies_the_peaks() {
        let dir = std::env::temp_dir().join(format!("gpumem-intensity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.json");
        std::fs::write(&bad, "{\"not\": \"a report\"}").unwrap();
        let a = parse(&[
            "--flops",
            "1",
            "--bytes",
            "1",
            "--probe-json",
            bad.to_str().unwrap(),
        ])
        .unwrap();
        assert!(peaks(&a)
            .unwrap_err()
            .contains("not a gpumem probe --json report"));
        std::fs::remove_dir_all(&dir).unwrap();

        // A saved report (synthetic numbers): measured copy 4290 GB/s, fp32 65 TFLOP/s.
        let saved = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../gpumem-probe/tests/fixtures/synthetic_h200_report.json"
        );
        let a = parse(&[
            "--kind",
            "elementwise",
            "--elements",
            "1000000",
            "--probe-json",
            saved,
        ])
        .unwrap();
        let r = intensity::analyze(&workload(&a).unwrap(), &peaks(&a).unwrap()).unwrap();
        assert_eq!(r.bytes_per_s.value, 4290e9);
        assert_eq!(r.peak_flops.value, 65e12);
        assert!((r.floor_s - 12e6 / 4290e9).abs() < 1e-15);
        // That report has no bf16 figure: a bf16 GEMM says what is missing.
        let a = parse(&[
            "--kind",
            "gemm",
            "--m",
            "64",
            "--n",
            "64",
            "--k",
            "64",
            "--probe-json",
            saved,
        ])
        .unwrap();
        let err = intensity::analyze(&workload(&a).unwrap(), &peaks(&a).unwrap()).unwrap_err();
        assert!(err.contains("tensor-core peak"), "{err}");
    }
}
