//! `gpumem bench` (not built yet).

use clap::Args;

#[derive(Args)]
pub struct BenchArgs {}

pub fn run(_a: BenchArgs) -> Result<(), String> {
    Err("`gpumem bench` is not built yet".into())
}
