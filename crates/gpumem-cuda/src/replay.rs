//! `gpumem replay --device cuda` (not built yet).

use gpumem_core::policy::PolicyKind;
use gpumem_core::trace::Trace;

/// Replays `trace` on the first CUDA device under each policy and prints the results.
pub fn run_cli(
    _trace: &Trace,
    _policies: &[PolicyKind],
    _conf: &str,
    _json: bool,
) -> Result<(), String> {
    Err("replay on the GPU is not built yet".into())
}
