//! Timeline plots of replays (not built yet).

use crate::replay::PolicyResult;

/// A self-contained HTML page plotting bytes held and bytes live over the trace for each
/// policy.
pub fn timeline_html(_trace_name: &str, _results: &[PolicyResult]) -> Result<String, String> {
    Err("timeline plots are not built yet".into())
}
