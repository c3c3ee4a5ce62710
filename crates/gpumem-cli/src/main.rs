//! `gpumem`: replay allocation traces through gpumem's policies, convert and summarise traces,
//! benchmark allocators, probe the GPU's memory hierarchy, and monitor GPU memory.
//!
//! Each subcommand lives in its own module; this file only dispatches.

#[macro_use]
mod out;

mod bench;
mod monitor;
mod probe;
mod replay;
mod summary;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gpumem",
    version,
    about = "GPU memory manager: replay, diagnostics, analysis"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Replay an allocation trace through one or more policies and compare them.
    Replay(replay::ReplayArgs),
    /// Convert a trace (PyTorch snapshot pickle, RMM CSV) to gpumem's compact format.
    Convert(replay::ConvertArgs),
    /// Print a memory summary (like torch.cuda.memory_summary) of a snapshot.
    Summary(summary::SummaryArgs),
    /// Benchmark allocation latency of gpumem's policies against cudaMalloc and cudaMallocAsync.
    Bench(bench::BenchArgs),
    /// Measure the memory hierarchy of the GPU at hand.
    Probe(probe::ProbeArgs),
    /// Say whether a kernel is memory- or compute-bound on this GPU, and its time floor.
    Intensity(probe::IntensityArgs),
    /// Watch GPU memory per device and per process, with alarms on steady growth.
    Monitor(monitor::MonitorArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Replay(a) => replay::run(a),
        Cmd::Convert(a) => replay::convert(a),
        Cmd::Summary(a) => summary::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Probe(a) => probe::run_probe(a),
        Cmd::Intensity(a) => probe::run_intensity(a),
        Cmd::Monitor(a) => monitor::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            err_println!("gpumem: {e}");
            ExitCode::FAILURE
        }
    }
}
