//! `gpumem probe` and `gpumem intensity` (not built yet).

use clap::Args;

#[derive(Args)]
pub struct ProbeArgs {}

#[derive(Args)]
pub struct IntensityArgs {}

pub fn run_probe(_a: ProbeArgs) -> Result<(), String> {
    Err("`gpumem probe` is not built yet".into())
}

pub fn run_intensity(_a: IntensityArgs) -> Result<(), String> {
    Err("`gpumem intensity` is not built yet".into())
}
