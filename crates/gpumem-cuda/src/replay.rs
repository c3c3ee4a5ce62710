//! `gpumem replay TRACE --device cuda`: a trace replayed with real allocations on the first
//! CUDA device, every block written so that its memory is really used, and the physical memory
//! the driver handed out (from `cuMemGetInfo`) set beside gpumem's own accounting and the
//! simulation's figure.
//!
//! For each policy: the trace runs on the simulated device (same configuration, same device
//! size), then on the GPU through [`gpumem_core::replay::replay_on`] with a [`CudaBackend`].
//! The trace's streams become streams created for the replay; each allocated block gets a
//! `cuMemsetD8Async` of its requested bytes on its own stream. The backend samples
//! `cuMemGetInfo` whenever the bytes it holds reach a new high-water mark; physical peak = free
//! before the replay − lowest free seen. When the replay ends the allocator is dropped, its
//! backend returns every segment and page to the device, and free memory is checked against
//! the baseline before the next policy.

use crate::backend::{CudaBackend, PhysicalProbe};
use crate::driver::{self, bind, cu_stream, describe};
use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, ContentArrangement, Table};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream};
use gpumem_core::backend::Backend;
use gpumem_core::policy::PolicyKind;
use gpumem_core::reference::lower_reference;
use gpumem_core::replay::{replay, replay_on, ReplayOptions, OTHER_STREAM};
use gpumem_core::trace::Trace;
use gpumem_core::units::{format_size, DEFAULT_PAGE};
use gpumem_core::Config;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Free memory may differ from the baseline by this much after a policy's memory is returned
/// (the driver's own bookkeeping moves in 2 MiB steps).
const BASELINE_SLACK: i64 = 4 << 20;

/// The figures of one policy's replay on the GPU.
#[derive(Debug, Clone, Serialize)]
pub struct CudaReplayResult {
    /// Policy name.
    pub policy: String,
    /// The device.
    pub device: String,
    /// Events in the trace.
    pub events: usize,
    /// Allocations made on the GPU.
    pub allocs: u64,
    /// Requests that failed for lack of memory on the GPU.
    pub ooms: u64,
    /// Peak bytes of live requested tensors (from the trace).
    pub peak_live_bytes: u64,
    /// Peak bytes held in the simulation.
    pub sim_peak_held_bytes: u64,
    /// Peak bytes held on the GPU, by gpumem's own accounting.
    pub gpu_peak_held_bytes: u64,
    /// Peak bytes the driver handed out: free before − lowest free seen (cuMemGetInfo).
    pub physical_peak_bytes: u64,
    /// (GPU accounting − simulation) ÷ simulation.
    pub gpu_vs_sim: f64,
    /// (physical − GPU accounting) ÷ GPU accounting.
    pub physical_vs_gpu: f64,
    /// Peak held on the GPU ÷ peak live.
    pub gpu_ratio: f64,
    /// Physical peak ÷ peak live.
    pub physical_ratio: f64,
    /// Bytes written into the blocks.
    pub bytes_written: u64,
    /// Driver calls of the allocator on the GPU.
    pub driver_calls_total: u64,
    /// Driver calls by kind.
    pub driver_calls: serde_json::Value,
    /// Times cuMemGetInfo was sampled during the replay.
    pub mem_info_samples: u64,
    /// Wall time of the GPU replay (allocator, memsets issued, driver calls), seconds.
    pub gpu_seconds: f64,
    /// Wall time of the simulated replay, seconds.
    pub sim_seconds: f64,
    /// Free bytes before the replay.
    pub baseline_free_bytes: u64,
    /// Baseline free − free after the memory was returned (0: all of it came back).
    pub not_returned_bytes: i64,
    /// The trace's lower reference ([`gpumem_core::reference`]), held ÷ live; the same for
    /// every policy of a trace.
    pub lower_reference: f64,
}

fn rel(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        (a as f64 - b as f64) / b as f64
    }
}

/// Replays `trace` on the first CUDA device under each policy and writes the results through
/// `out` (the table, or one JSON line per policy) and the progress through `note` (the caller
/// decides what a closed pipe means).
pub fn run_cli(
    trace: &Trace,
    policies: &[PolicyKind],
    conf: &str,
    json: bool,
    out: &mut dyn FnMut(&str),
    note: &mut dyn FnMut(&str),
) -> Result<(), String> {
    let policies = if policies.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        policies.to_vec()
    };
    let config = Config::parse(conf).map_err(|e| e.to_string())?;
    let gpu = GpuReplay::open(trace)?;
    if !json {
        note(&format!(
            "replaying {} events ({} streams) on {} under {} polic{}",
            trace.events.len(),
            gpu.stream_ids.len(),
            gpu.name,
            policies.len(),
            if policies.len() == 1 { "y" } else { "ies" }
        ));
    }
    let mut results = Vec::new();
    for &p in &policies {
        let r = gpu.run(trace, p, &config, !json)?;
        if json {
            out(&format!(
                "{}\n",
                serde_json::to_string(&r).map_err(|e| e.to_string())?
            ));
        } else {
            note(&format!(
                "  {}: GPU peak held {}, physical {}, simulated {} ({:.1} s)",
                r.policy,
                format_size(r.gpu_peak_held_bytes),
                format_size(r.physical_peak_bytes),
                format_size(r.sim_peak_held_bytes),
                r.gpu_seconds
            ));
        }
        results.push(r);
    }
    if !json {
        out(&render(&trace.meta.source, &results));
    }
    let leaks: Vec<String> = results
        .iter()
        .filter(|r| r.not_returned_bytes > BASELINE_SLACK)
        .map(|r| {
            format!(
                "{} ({})",
                r.policy,
                format_size(r.not_returned_bytes as u64)
            )
        })
        .collect();
    if !leaks.is_empty() {
        return Err(format!(
            "device memory did not return to its baseline after: {}",
            leaks.join(", ")
        ));
    }
    Ok(())
}

/// The device, the streams standing for the trace's, and what each allocation's memset needs.
pub struct GpuReplay {
    ctx: Arc<CudaContext>,
    name: String,
    /// The trace's stream ids, and the created streams standing for them (same order).
    stream_ids: Vec<u64>,
    streams: Vec<Arc<CudaStream>>,
    /// The stream that cross-stream uses are recorded on.
    other: Arc<CudaStream>,
    /// The trace's lower reference, held ÷ live (a property of the trace, reported beside
    /// every policy's figures).
    reference: f64,
}

impl GpuReplay {
    /// Opens device 0 and creates a stream for each stream of `trace`.
    pub fn open(trace: &Trace) -> Result<Self, String> {
        driver::load().map_err(|e| e.message)?;
        let ctx = CudaContext::new(0).map_err(|e| format!("cannot open CUDA device 0: {e}"))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device 0".into());
        let mut stream_ids: Vec<u64> = Vec::new();
        for e in &trace.events {
            if !stream_ids.contains(&e.stream) {
                stream_ids.push(e.stream);
            }
        }
        let make = || ctx.new_stream().map_err(|e| format!("cuStreamCreate: {e}"));
        let streams = stream_ids
            .iter()
            .map(|_| make())
            .collect::<Result<Vec<_>, _>>()?;
        let other = make()?;
        let g = Self {
            ctx,
            name,
            stream_ids,
            streams,
            reference: lower_reference(trace, DEFAULT_PAGE).ratio,
            other,
        };
        g.warm_up()?;
        Ok(g)
    }

    /// Takes every path the replay will take once, so that memory the driver sets aside on
    /// first use (memset kernels, event and mapping structures) is in the baseline, not in the
    /// first policy's figures.
    fn warm_up(&self) -> Result<(), String> {
        let mut b = CudaBackend::with_context(self.ctx.clone()).map_err(|e| e.to_string())?;
        let page = b.info().page_bytes;
        let fail = |e: gpumem_core::BackendError| format!("warming up the device: {e}");
        let seg = b.mem_alloc(page).map_err(fail)?;
        let va = b.address_reserve(4 * page, 0).map_err(fail)?;
        let h = b.mem_create(page).map_err(fail)?;
        b.mem_map(va, page, h).map_err(fail)?;
        b.set_access(va, page).map_err(fail)?;
        let all: Vec<u64> = self
            .streams
            .iter()
            .chain([&self.other])
            .map(|s| s.cu_stream() as usize as u64)
            .collect();
        for &s in &all {
            for p in [seg, va] {
                // SAFETY: `p` is a segment or a mapped page of `page` bytes; `s` a live stream.
                let r = unsafe { sys::cuMemsetD8Async(p, 1, page as usize, cu_stream(s)) };
                if r != CUresult::CUDA_SUCCESS {
                    return Err(format!(
                        "warming up the device: cuMemsetD8Async: {}",
                        describe(r)
                    ));
                }
            }
            let e = b.event_record(s).map_err(fail)?;
            b.stream_wait_event(all[0], e).map_err(fail)?;
            b.event_synchronize(e).map_err(fail)?;
            b.event_destroy(e);
        }
        driver::ctx_synchronize().map_err(fail)?;
        b.mem_unmap(va, page).map_err(fail)?;
        b.mem_release(h).map_err(fail)?;
        b.address_free(va, 4 * page).map_err(fail)?;
        b.mem_free(seg, page).map_err(fail)?;
        Ok(())
    }

    fn mem_info(&self) -> Result<(u64, u64), String> {
        bind(&self.ctx).map_err(|e| e.to_string())?;
        driver::ctx_synchronize().map_err(|e| format!("the device reported an error: {e}"))?;
        driver::mem_get_info().map_err(|e| e.to_string())
    }

    /// Replays `trace` under `policy`, simulated then on the GPU.
    pub fn run(
        &self,
        trace: &Trace,
        policy: PolicyKind,
        config: &Config,
        show_progress: bool,
    ) -> Result<CudaReplayResult, String> {
        let (baseline_free, total) = self.mem_info()?;
        let opts = ReplayOptions {
            config: config.clone(),
            device_total: total,
            ..ReplayOptions::default()
        };
        let t = Instant::now();
        let sim = replay(trace, policy, &opts, None)
            .map_err(|e| format!("simulated replay under {}: {e}", policy.name()))?;
        let sim_seconds = t.elapsed().as_secs_f64();

        let mut backend = CudaBackend::with_context(self.ctx.clone()).map_err(|e| e.to_string())?;
        for (id, s) in self.stream_ids.iter().zip(&self.streams) {
            backend.alias_stream(*id, s.cu_stream() as usize as u64);
        }
        backend.alias_stream(OTHER_STREAM, self.other.cu_stream() as usize as u64);
        let probe = PhysicalProbe::new(baseline_free);
        backend.set_probe(probe.clone());

        let real: Vec<(u64, u64)> = self
            .stream_ids
            .iter()
            .zip(&self.streams)
            .map(|(&id, s)| (id, s.cu_stream() as usize as u64))
            .collect();
        let toucher = Toucher::new(&real);
        let touch = |ptr: u64, bytes: u64, stream: u64| toucher.touch(ptr, bytes, stream);
        let progress = AtomicU64::new(0);
        let n = trace.events.len() as u64;
        let done = AtomicU64::new(0);
        let t = Instant::now();
        let gpu = std::thread::scope(|s| {
            let bar = (show_progress && n > 200_000).then(|| {
                let b = ProgressBar::new(n);
                b.set_style(
                    ProgressStyle::with_template(&format!(
                        "{} on the GPU {{bar:30}} {{percent}}% ({{eta}})",
                        policy.name()
                    ))
                    .expect("template"),
                );
                b
            });
            let watcher = bar.map(|b| {
                let (progress, done) = (&progress, &done);
                s.spawn(move || {
                    while done.load(Ordering::Relaxed) == 0 {
                        b.set_position(progress.load(Ordering::Relaxed));
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    b.finish_and_clear();
                })
            });
            let r = replay_on(
                trace,
                policy,
                &opts,
                Box::new(backend),
                None,
                Some(&progress),
                Some(&touch),
            );
            done.store(1, Ordering::Relaxed);
            if let Some(w) = watcher {
                let _ = w.join();
            }
            r
        })
        .map_err(|e| format!("replay on the GPU under {}: {e}", policy.name()))?;
        if let Some(e) = toucher.error() {
            return Err(format!("writing the blocks under {}: {e}", policy.name()));
        }
        // The allocator (and its backend) are gone: every byte should be back.
        let (free_after, _) = self.mem_info()?;
        let gpu_seconds = t.elapsed().as_secs_f64();
        let physical = probe.peak_physical();
        Ok(CudaReplayResult {
            policy: policy.name().to_string(),
            device: self.name.clone(),
            events: trace.events.len(),
            allocs: gpu.allocs,
            ooms: gpu.ooms,
            peak_live_bytes: gpu.peak_live_bytes,
            sim_peak_held_bytes: sim.peak_held_bytes,
            gpu_peak_held_bytes: gpu.peak_held_bytes,
            physical_peak_bytes: physical,
            gpu_vs_sim: rel(gpu.peak_held_bytes, sim.peak_held_bytes),
            physical_vs_gpu: rel(physical, gpu.peak_held_bytes),
            gpu_ratio: gpu.ratio,
            physical_ratio: if gpu.peak_live_bytes == 0 {
                0.0
            } else {
                physical as f64 / gpu.peak_live_bytes as f64
            },
            bytes_written: toucher.bytes.load(Ordering::Relaxed),
            driver_calls_total: gpu.driver_calls_total,
            driver_calls: gpu.driver_calls,
            mem_info_samples: probe.samples(),
            gpu_seconds,
            sim_seconds,
            baseline_free_bytes: baseline_free,
            not_returned_bytes: baseline_free as i64 - free_after as i64,
            lower_reference: self.reference,
        })
    }
}

/// Writes each allocated block on its stream: the created stream standing for the trace's
/// stream the allocation was made on.
struct Toucher<'a> {
    /// (trace stream, created stream's raw handle).
    streams: &'a [(u64, u64)],
    count: AtomicUsize,
    bytes: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl<'a> Toucher<'a> {
    fn new(streams: &'a [(u64, u64)]) -> Self {
        Self {
            streams,
            count: AtomicUsize::new(0),
            bytes: AtomicU64::new(0),
            first_error: Mutex::new(None),
        }
    }

    fn touch(&self, ptr: u64, bytes: u64, trace_stream: u64) {
        let Some(&(_, stream)) = self.streams.iter().find(|&&(id, _)| id == trace_stream) else {
            self.fail(format!(
                "allocation of {bytes} bytes at {ptr:#x} on stream {trace_stream:#x}, which is \
                 not in the trace"
            ));
            return;
        };
        // A different byte for neighbouring blocks.
        let value = (self.count.fetch_add(1, Ordering::Relaxed) % 251 + 1) as u8;
        // SAFETY: `ptr` is a block of at least `bytes` bytes the allocator just handed out on
        // this device, `stream` a live stream of the current context (created for the replay
        // and alive until it ends).
        let r = unsafe { sys::cuMemsetD8Async(ptr, value, bytes as usize, cu_stream(stream)) };
        if r == CUresult::CUDA_SUCCESS {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.fail(format!(
                "cuMemsetD8Async of {bytes} bytes at {ptr:#x}: {}",
                describe(r)
            ));
        }
    }

    fn fail(&self, msg: String) {
        if let Ok(mut e) = self.first_error.lock() {
            e.get_or_insert(msg);
        }
    }

    fn error(&self) -> Option<String> {
        self.first_error.lock().ok().and_then(|e| e.clone())
    }
}

fn pct(x: f64) -> String {
    format!("{:+.2}%", 100.0 * x)
}

/// The table for people.
pub fn render(source: &str, rs: &[CudaReplayResult]) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(vec![
            "policy",
            "peak live",
            "simulated peak held",
            "GPU peak held (gpumem)",
            "physical (cuMemGetInfo)",
            "GPU vs sim",
            "physical vs GPU",
            "physical/live",
            "driver calls",
            "ooms",
            "GPU wall",
            "not returned",
        ]);
    for r in rs {
        t.add_row(vec![
            r.policy.clone(),
            format_size(r.peak_live_bytes),
            format_size(r.sim_peak_held_bytes),
            format_size(r.gpu_peak_held_bytes),
            format_size(r.physical_peak_bytes),
            pct(r.gpu_vs_sim),
            pct(r.physical_vs_gpu),
            format!("{:.4}", r.physical_ratio),
            r.driver_calls_total.to_string(),
            r.ooms.to_string(),
            format!("{:.2} s", r.gpu_seconds),
            if r.not_returned_bytes <= 0 {
                "0".into()
            } else {
                format_size(r.not_returned_bytes as u64)
            },
        ]);
    }
    for i in 1..t.column_count() {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    let device = rs.first().map_or("the GPU", |r| r.device.as_str());
    format!(
        "{source} replayed on {device}: every block written; physical = free before − lowest free \
         (cuMemGetInfo)\n{t}\n{}",
        rs.first().map_or(String::new(), |r| format!(
            "lower reference (shared/ANCHORS.md §1): {:.4} of live (every block best-fit in one \
             range, each 2 MiB page held only while a live block touches it)\n",
            r.lower_reference
        ))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_the_replay_says_so() {
        let trace = Trace::default();
        // A bad configuration is reported before the device is needed, driver or not.
        let (mut out, mut note) = (|_: &str| {}, |_: &str| {});
        let e = run_cli(&trace, &[], "policy:nope", true, &mut out, &mut note).unwrap_err();
        assert!(e.contains("unknown policy"), "{e}");
        // SAFETY: only tries to dlopen libcuda.
        let present = unsafe { sys::is_culib_present() };
        match run_cli(&trace, &[], "", true, &mut out, &mut note) {
            Err(e) => assert_eq!(e.contains("no CUDA driver was found"), !present, "{e}"),
            Ok(_) => assert!(present, "a replay on the GPU without a driver"),
        }
    }

    #[test]
    fn table_shows_the_three_figures_and_their_differences() {
        let r = CudaReplayResult {
            policy: "stitched".into(),
            device: "NVIDIA H200".into(),
            events: 10,
            allocs: 3,
            ooms: 0,
            peak_live_bytes: 1000 << 20,
            sim_peak_held_bytes: 1024 << 20,
            gpu_peak_held_bytes: 1026 << 20,
            physical_peak_bytes: 1030 << 20,
            gpu_vs_sim: rel(1026, 1024),
            physical_vs_gpu: rel(1030, 1026),
            gpu_ratio: 1.026,
            physical_ratio: 1.03,
            bytes_written: 1,
            driver_calls_total: 7,
            driver_calls: serde_json::json!({}),
            mem_info_samples: 2,
            gpu_seconds: 0.5,
            sim_seconds: 0.1,
            baseline_free_bytes: 0,
            not_returned_bytes: 0,
            lower_reference: 1.0125,
        };
        let s = render("t.pickle", &[r]);
        assert!(
            s.contains("lower reference (shared/ANCHORS.md §1): 1.0125 of live"),
            "{s}"
        );
        assert!(s.contains("+0.20%"), "{s}");
        assert!(s.contains("+0.39%"), "{s}");
        assert!(s.contains("NVIDIA H200"), "{s}");
    }
}
