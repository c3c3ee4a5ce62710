//! `gpumem replay` and `gpumem convert`.

use clap::Args;
use gpumem_core::backend::sim;
use gpumem_core::policy::PolicyKind;
use gpumem_core::reference::lower_reference;
use gpumem_core::replay::{replay_all, ReplayOptions};
use gpumem_core::report::replay_table;
use gpumem_core::trace;
use gpumem_core::units::parse_size;
use gpumem_core::units::DEFAULT_PAGE;
use gpumem_core::Config;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ReplayArgs {
    /// Trace file: PyTorch snapshot (.pickle / .pickle.gz), RMM CSV log, or gpumem .gmt.
    trace: PathBuf,
    /// Policy to replay (repeat for several; default: all of them).
    #[arg(long = "policy", short = 'p', value_parser = parse_policy)]
    policies: Vec<PolicyKind>,
    /// One JSON object per policy on its own line, instead of the table.
    #[arg(long)]
    json: bool,
    /// Extra configuration applied to every policy (GPUMEM_CONF syntax, e.g. "slack:0.02").
    #[arg(long, default_value = "")]
    conf: String,
    /// Memory of the simulated device (default: an H200's 150,109,880,320 bytes).
    #[arg(long, value_parser = parse_bytes)]
    device_memory: Option<u64>,
    /// Simulated GPU lag: events the policy records complete this many milliseconds of trace
    /// time later, and host waits are counted only for events not yet complete (default:
    /// every wait counted, an upper bound).
    #[arg(long, value_parser = parse_lag_ms)]
    gpu_lag_ms: Option<f64>,
    /// Which device's events to replay, for multi-GPU snapshots.
    #[arg(long, default_value_t = 0)]
    device_index: u32,
    /// Where to replay: the simulated device, or the real GPU (allocating and writing every
    /// block, and checking the physical memory the driver handed out).
    #[arg(long, value_enum, default_value_t = Target::Sim)]
    device: Target,
    /// Write a self-contained HTML timeline of bytes held vs live for each policy.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write the allocator's segments and its whole allocation history at the end of the
    /// replay as a PyTorch memory snapshot (a pickle for torch.cuda._memory_viz and PyTorch's
    /// memory visualizer; gzipped if the name ends in .gz). Needs exactly one --policy.
    #[arg(long)]
    snapshot: Option<PathBuf>,
    /// List the allocations that unmapped pages to place their block (a virtual page whose
    /// physical page had gone elsewhere), by requested size and stream, most pages first:
    /// where a layout that keeps moving pays its driver calls.
    #[arg(long)]
    remap_sites: bool,
    /// Free by address and stream, as PyTorch's allocator hooks do, instead of through each
    /// allocation's handle (the same placements; each free looks its block up).
    #[arg(long)]
    free_by_address: bool,
    /// Before each allocation and free, write to this many KiB of other memory, as a
    /// program's own work does between its allocator calls (for measuring the allocator's
    /// cache misses under a cache simulator: scripts/cold_replay.sh).
    #[arg(long, value_name = "KIB")]
    cold_kib: Option<u64>,
}

/// Where a replay runs.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// The simulated device (no GPU needed).
    Sim,
    /// The first CUDA device.
    Cuda,
}

#[derive(Args)]
pub struct ConvertArgs {
    /// Input trace.
    input: PathBuf,
    /// Output file (.gmt; .gmt.gz is gzipped).
    output: PathBuf,
    /// Which device's events to keep.
    #[arg(long, default_value_t = 0)]
    device_index: u32,
}

/// A `--policy` value (shared by `replay` and `bench alloc`).
pub(crate) fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    PolicyKind::parse(s).ok_or_else(|| {
        format!(
            "unknown policy '{s}' (one of: {})",
            PolicyKind::ALL.map(|k| k.name()).join(", ")
        )
    })
}

/// The policies to replay: `-p`'s, or the one `--conf` names with `policy:` (each run sets
/// its own policy, so a `policy:` beside `-p` would be silently overruled: refused instead).
fn policies_of(given: &[PolicyKind], conf: &str) -> Result<Vec<PolicyKind>, String> {
    let named = conf
        .split(',')
        .any(|kv| kv.split(':').next().map(str::trim) == Some("policy"));
    if !named {
        return Ok(given.to_vec());
    }
    let from_conf = Config::parse(conf).map_err(|e| e.to_string())?.policy;
    match given {
        [] => Ok(vec![from_conf]),
        [p] if *p == from_conf => Ok(given.to_vec()),
        _ => Err(format!(
            "--conf names policy:{} and -p names {}: give the policies with -p only",
            from_conf.name(),
            given
                .iter()
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    match parse_size(s) {
        // Less than one 2 MiB page could hold nothing.
        Some(b) if b >= 2 << 20 => sim::check_total_bytes(b)
            .map(|()| b)
            .map_err(|e| format!("'{s}': {e}")),
        Some(_) => Err(format!("'{s}' is smaller than one 2 MiB page")),
        None => Err(format!("'{s}' is not a size (e.g. 80GiB)")),
    }
}

/// Runs `read` on `path` with a progress bar of the bytes read (unless `quiet` or the file is
/// small); fails if the file cannot be looked at (shared by `replay`, `convert` and `summary`).
pub(crate) fn with_read_progress<T>(
    path: &Path,
    quiet: bool,
    read: impl FnOnce(Option<trace::input::Progress>) -> T,
) -> Result<T, String> {
    let size = std::fs::metadata(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?
        .len();
    let bar = (!quiet && size > 4 << 20).then(|| {
        let b = ProgressBar::new(size);
        b.set_style(
            ProgressStyle::with_template("reading {msg} {bar:30} {bytes}/{total_bytes} ({eta})")
                .expect("template"),
        );
        b.set_message(path.display().to_string());
        b
    });
    let progress: Option<trace::input::Progress> = bar.clone().map(|b| {
        let f: trace::input::Progress = Arc::new(move |n| b.set_position(n));
        f
    });
    let r = read(progress);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(r)
}

fn load(path: &Path, device: u32, quiet: bool) -> Result<trace::Trace, String> {
    let t = with_read_progress(path, quiet, |p| trace::load(path, device, p))?
        .map_err(|e| e.to_string())?;
    for w in t.warnings() {
        err_println!("gpumem: warning: {}: {w}", path.display());
    }
    // Only PyTorch's snapshots hold several devices' histories; the other formats hold one.
    if device != 0 && t.meta.format != "pytorch-snapshot" {
        err_println!(
            "gpumem: warning: {}: --device-index {device} ignored: a {} trace holds one device's \
             history, which is replayed",
            path.display(),
            t.meta.format
        );
    }
    Ok(t)
}

/// `--cold-kib` in bytes, within reason (at most 1 GiB: the buffer is allocated).
fn cold_bytes(kib: Option<u64>) -> Result<usize, String> {
    match kib {
        None => Ok(0),
        Some(k) if k <= 1 << 20 => Ok((k << 10) as usize),
        Some(k) => Err(format!("--cold-kib {k}: at most 1048576 (1 GiB)")),
    }
}

/// The flags that only the simulated device honours, by name, when given.
fn sim_only_flags(a: &ReplayArgs) -> Vec<&'static str> {
    [
        ("--plot", a.plot.is_some()),
        ("--snapshot", a.snapshot.is_some()),
        ("--device-memory", a.device_memory.is_some()),
        ("--gpu-lag-ms", a.gpu_lag_ms.is_some()),
        ("--remap-sites", a.remap_sites),
        ("--free-by-address", a.free_by_address),
        ("--cold-kib", a.cold_kib.is_some()),
    ]
    .into_iter()
    .filter_map(|(name, given)| given.then_some(name))
    .collect()
}

pub fn run(a: ReplayArgs) -> Result<(), String> {
    if a.device == Target::Cuda {
        let ignored = sim_only_flags(&a);
        if !ignored.is_empty() {
            return Err(format!(
                "{} appl{} to the simulated device only (--device sim); a replay on the GPU \
                 uses the real device's memory and timing",
                ignored.join(", "),
                if ignored.len() == 1 { "ies" } else { "y" }
            ));
        }
    }
    if let Some(p) = &a.plot {
        crate::out::check_writable(p, "--plot")?;
    }
    if let Some(p) = &a.snapshot {
        crate::out::check_writable(p, "--snapshot")?;
    }
    let chosen = policies_of(&a.policies, &a.conf)?;
    let trace = load(&a.trace, a.device_index, a.json)?;
    if a.device == Target::Cuda {
        return gpumem_cuda::replay::run_cli(
            &trace,
            &chosen,
            &a.conf,
            a.json,
            &mut |s| crate::out::print(s),
            &mut |s| crate::out::eprintln(s),
        );
    }
    let policies = if chosen.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        chosen
    };
    let mut opts = ReplayOptions {
        config: Config::parse(&a.conf).map_err(|e| e.to_string())?,
        timeline_points: if a.plot.is_some() { 2000 } else { 0 },
        remap_sites: a.remap_sites,
        free_by_address: a.free_by_address,
        cold_bytes: cold_bytes(a.cold_kib)?,
        ..ReplayOptions::default()
    };
    if let Some(m) = a.device_memory {
        opts.device_total = m;
    }
    opts.gpu_lag_us = a.gpu_lag_ms.map(|ms| (ms * 1000.0).round() as u64);
    let snapshot_result = a
        .snapshot
        .as_ref()
        .map(|path| snapshot_at_end(&mut opts, path, &policies, trace.events.len()))
        .transpose()?;
    let total = (trace.events.len() * policies.len()) as u64;
    let done = AtomicU64::new(0);
    let (results, reference) = std::thread::scope(|s| {
        let bar = (!a.json && trace.events.len() > 200_000).then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template("replaying {bar:30} {percent}% ({eta})")
                    .expect("template"),
            );
            b
        });
        let watcher = bar.clone().map(|b| {
            let done = &done;
            s.spawn(move || {
                while done.load(Ordering::Relaxed) < total {
                    b.set_position(done.load(Ordering::Relaxed));
                    std::thread::sleep(Duration::from_millis(100));
                }
                b.finish_and_clear();
            })
        });
        let reference = s.spawn(|| lower_reference(&trace, DEFAULT_PAGE));
        let r = replay_all(&trace, &policies, &opts, Some(&done));
        done.store(total, Ordering::Relaxed);
        if let Some(w) = watcher {
            let _ = w.join();
        }
        (r, reference.join())
    });
    let reference = reference.map_err(|_| "the lower reference's thread panicked".to_string())?;
    let mut ok = Vec::new();
    for (p, r) in policies.iter().zip(results) {
        match r {
            Ok(mut r) => {
                r.lower_reference = Some(reference.ratio);
                ok.push(r)
            }
            Err(e) => return Err(format!("replay under {} failed: {e}", p.name())),
        }
    }
    // The results first: a file that cannot be written must not cost the replay's figures.
    if a.json {
        for r in &ok {
            out_println!("{}", serde_json::to_string(r).map_err(|e| e.to_string())?);
        }
    } else {
        out_print!(
            "{}",
            replay_table::render(
                &a.trace.display().to_string(),
                trace.events.len(),
                &ok,
                Some(&reference)
            )
        );
    }
    let mut file_errors = Vec::new();
    if let (Some(path), Some(result)) = (&a.snapshot, snapshot_result) {
        let r = result.lock().map_err(|e| e.to_string())?.take();
        match r.unwrap_or_else(|| Err("the replay ended before the snapshot was taken".into())) {
            Ok(()) if !a.json => err_println!("snapshot written to {}", path.display()),
            Ok(()) => {}
            Err(e) => file_errors.push(format!("--snapshot: {e}")),
        }
    }
    if let Some(path) = &a.plot {
        let written = gpumem_core::report::plot::timeline_html(&a.trace.display().to_string(), &ok)
            .and_then(|html| {
                std::fs::write(path, html)
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))
            });
        match written {
            Ok(()) if !a.json => err_println!("timeline written to {}", path.display()),
            Ok(()) => {}
            Err(e) => file_errors.push(format!("--plot: {e}")),
        }
    }
    if file_errors.is_empty() {
        Ok(())
    } else {
        Err(file_errors.join("; "))
    }
}

pub fn convert(a: ConvertArgs) -> Result<(), String> {
    let t = load(&a.input, a.device_index, false)?;
    let file = std::fs::File::create(&a.output)
        .map_err(|e| format!("cannot create {}: {e}", a.output.display()))?;
    let gz = a.output.extension().is_some_and(|e| e == "gz");
    let mut w: Box<dyn std::io::Write> = if gz {
        Box::new(flate2_writer(file))
    } else {
        Box::new(std::io::BufWriter::new(file))
    };
    trace::compact::write(&t, &mut w)
        .map_err(|e| format!("cannot write {}: {e}", a.output.display()))?;
    w.flush().map_err(|e| e.to_string())?;
    drop(w);
    err_println!(
        "{} events written to {}",
        t.events.len(),
        a.output.display()
    );
    Ok(())
}

/// Asks the replay to keep the whole history and to write a snapshot at its end; returns
/// where the outcome will be.
type SnapshotResult = Arc<std::sync::Mutex<Option<Result<(), String>>>>;

fn snapshot_at_end(
    opts: &mut ReplayOptions,
    path: &Path,
    policies: &[PolicyKind],
    events: usize,
) -> Result<SnapshotResult, String> {
    if policies.len() != 1 {
        return Err(
            "--snapshot needs exactly one --policy (a snapshot is of one allocator)".into(),
        );
    }
    // Every trace event gives at most one history entry, plus the segment entries.
    opts.config.history = opts.config.history.max(2 * events + 4096);
    let result: SnapshotResult = Default::default();
    let (sink, path) = (result.clone(), path.to_path_buf());
    opts.at_end = Some(Arc::new(move |alloc: &gpumem_core::Allocator| {
        let r = gpumem_core::report::snapshot::write_snapshot(alloc, &path);
        if let Ok(mut s) = sink.lock() {
            *s = Some(r);
        }
    }));
    Ok(result)
}

fn flate2_writer(f: std::fs::File) -> impl std::io::Write {
    gpumem_core::trace::gzip_writer(f)
}

fn parse_lag_ms(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=3.6e6).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?} is not a lag in milliseconds between 0 and 3,600,000"
        )),
    }
}
