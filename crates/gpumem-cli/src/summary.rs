//! `gpumem summary SNAPSHOT`: the memory summary (torch.cuda.memory_summary's table) of a
//! snapshot file, PyTorch's or gpumem's: current figures from its segments, peaks and totals
//! from its allocation history.

use crate::replay::with_read_progress;
use clap::Args;
use gpumem_core::report::snapshot::check_replayable;
use gpumem_core::report::summary::{render_summary, snapshot_stats, SummaryOptions};
use gpumem_core::trace::pickle::load_snapshot;
use std::path::PathBuf;

#[derive(Args)]
pub struct SummaryArgs {
    /// Snapshot: torch.cuda.memory._snapshot() pickled (plain or .gz), or one gpumem wrote
    /// (`gpumem replay --snapshot`, or the Python package's snapshot()).
    snapshot: PathBuf,
    /// Device whose segments and history to summarise.
    #[arg(long, default_value_t = 0)]
    device_index: u32,
    /// One JSON object (nested stats, torch's flat names, notes) instead of the table.
    #[arg(long)]
    json: bool,
    /// Only the totals, not the rows per pool.
    #[arg(long)]
    abbreviated: bool,
    /// Also check that the history replays backwards from the segments, as PyTorch's memory
    /// visualizer replays it; fails if it does not.
    #[arg(long)]
    check: bool,
}

pub fn run(a: SummaryArgs) -> Result<(), String> {
    let snap = with_read_progress(&a.snapshot, a.json, |p| {
        load_snapshot(&a.snapshot, a.device_index, p)
    })?
    .map_err(|e| e.to_string())?;
    let check = a.check.then(|| check_replayable(&snap));
    let r = snapshot_stats(&snap);
    if a.json {
        let mut j = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        j["source"] = a.snapshot.display().to_string().into();
        j["device"] = a.device_index.into();
        j["flat"] = serde_json::to_value(r.stats.to_flat()).map_err(|e| e.to_string())?;
        if let Some(c) = &check {
            j["replayable"] = c.is_ok().into();
            if let Err(e) = c {
                j["replay_error"] = e.clone().into();
            }
        }
        out_println!("{j}");
    } else {
        let opts = SummaryOptions {
            title: format!(
                "gpumem memory summary of {}, device {}",
                a.snapshot
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                a.device_index
            ),
            abbreviated: a.abbreviated,
            current_only: r.current_only.clone(),
            notes: r.notes.clone(),
        };
        out_print!("{}", render_summary(&r.stats, &opts));
        if let Some(Ok(())) = &check {
            out_println!(
                "check: the {} history entries replay backwards from the {} segments",
                r.history_events,
                r.segments
            );
        }
    }
    match check {
        Some(Err(e)) => Err(format!(
            "{}: the history does not agree with the segments: {e}",
            a.snapshot.display()
        )),
        _ => Ok(()),
    }
}
