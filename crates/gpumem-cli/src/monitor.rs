//! `gpumem monitor` (not built yet).

use clap::Args;

#[derive(Args)]
pub struct MonitorArgs {}

pub fn run(_a: MonitorArgs) -> Result<(), String> {
    Err("`gpumem monitor` is not built yet".into())
}
