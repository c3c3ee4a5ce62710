//! `gpumem summary` (not built yet).

use clap::Args;

#[derive(Args)]
pub struct SummaryArgs {}

pub fn run(_a: SummaryArgs) -> Result<(), String> {
    Err("`gpumem summary` is not built yet".into())
}
