//! `gpumem`: replay allocation traces through gpumem's policies, convert traces, and (with the
//! CUDA crates) benchmark, probe and monitor GPUs.

mod replay;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Replay(a) => replay::run(a),
        Cmd::Convert(a) => replay::convert(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumem: {e}");
            ExitCode::FAILURE
        }
    }
}
