//! `gpumem bench alloc`: allocation latency of gpumem's policies beside cudaMalloc and
//! cudaMallocAsync on the op sequences of ANCHORS.md §2 (the work is in `gpumem_cuda::bench`).

use crate::replay::parse_policy;
use clap::{Args, Subcommand};
use gpumem_core::policy::PolicyKind;
use gpumem_cuda::bench::{self, report, BenchOptions};
use std::io::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Subcommand)]
enum BenchWhat {
    /// ns per alloc/free on the anchor's op sequences: every gpumem policy, cudaMalloc and
    /// cudaMallocAsync, single-thread and with several threads each on its own stream.
    Alloc(AllocArgs),
}

#[derive(Args)]
struct AllocArgs {
    /// Policy to measure (repeat for several; default: all of them).
    #[arg(long = "policy", short = 'p', value_parser = parse_policy)]
    policies: Vec<PolicyKind>,
    /// Thread counts of the multi-thread case, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    threads: Vec<usize>,
    /// One JSON object per measurement on its own line, instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON lines to this file (the table still goes to stdout).
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Run gpumem's policies on the simulated device (no GPU needed; no driver baselines).
    #[arg(long)]
    sim: bool,
    /// Extra configuration applied to every policy (GPUMEM_CONF syntax).
    #[arg(long, default_value = "")]
    conf: String,
    /// Timed runs per figure (the median is reported), after one warm-up run.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Free by pointer (the path of PyTorch's free hook) instead of by allocation handle.
    #[arg(long)]
    free_by_ptr: bool,
    /// Skip cudaMalloc and cudaMallocAsync.
    #[arg(long)]
    no_baselines: bool,
    /// Only this case (repeat for several): same_1MiB, random_512B_64MiB_live500,
    /// random_512B_1MiB_live2000, mt_random_512B_1MiB_live200.
    #[arg(long = "case")]
    cases: Vec<String>,
    /// Skip the core probes and the CPU-time reads of single-thread runs (each core reading
    /// runs about 11 million instructions, untimed: leave them out when counting instructions
    /// under valgrind).
    #[arg(long)]
    no_clock: bool,
}

pub fn run(a: BenchArgs) -> Result<(), String> {
    match a.what {
        BenchWhat::Alloc(a) => alloc(a),
    }
}

fn alloc(a: AllocArgs) -> Result<(), String> {
    let known: Vec<&str> = bench::cases(&[])
        .iter()
        .map(|c| c.name)
        .chain([bench::MT_CASE])
        .collect();
    if let Some(bad) = a.cases.iter().find(|c| !known.contains(&c.as_str())) {
        return Err(format!(
            "unknown case '{bad}' (one of: {})",
            known.join(", ")
        ));
    }
    let opts = BenchOptions {
        policies: if a.policies.is_empty() {
            PolicyKind::ALL.to_vec()
        } else {
            a.policies
        },
        threads: a.threads,
        sim: a.sim,
        conf: a.conf,
        runs: a.runs,
        free_by_ptr: a.free_by_ptr,
        baselines: !a.no_baselines,
        only: a.cases,
        clock: !a.no_clock,
    };
    let mut out_file = match &a.json_out {
        Some(p) => Some(
            std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()))?,
        ),
        None => None,
    };
    let json = a.json;
    let mut write_err = None;
    let results = bench::run(&opts, &mut |m| {
        let line = serde_json::to_string(m).expect("a measurement serialises");
        if json {
            out_println!("{line}");
        } else {
            // The core's clock around the runs, where measured: the slowest and fastest reading,
            // and the least share of a run spent on a CPU (well under 100 %: other processes
            // took part of the wall time).
            let clock = match report::extent(&m.runs_clock_ghz) {
                None => String::new(),
                Some((lo, hi)) => {
                    let ghz = if hi / lo < 1.05 {
                        format!("{hi:.2}")
                    } else {
                        format!("{lo:.2}–{hi:.2}")
                    };
                    let share = report::extent(&m.runs_on_cpu_share).map_or(String::new(), |e| {
                        format!(", on a CPU ≥ {:.0} % of each run", e.0 * 100.0)
                    });
                    format!("  (core {ghz} GHz{share})")
                }
            };
            err_println!(
                "  {:<28} threads {} {:<20} {:>10.1} ns/op{clock}",
                m.case,
                m.threads,
                m.allocator,
                m.ns_per_op
            );
        }
        if let Some(f) = out_file.as_mut() {
            if let Err(e) = writeln!(f, "{line}") {
                write_err.get_or_insert(e.to_string());
            }
        }
    })?;
    if let Some(e) = write_err {
        return Err(format!("cannot write the JSON lines: {e}"));
    }
    if !json {
        out_print!("{}", report::render(&results));
    }
    Ok(())
}
