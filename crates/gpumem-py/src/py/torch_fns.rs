//! The functions behind `gpumem.torch`: they act on the process-wide registry whose allocators
//! PyTorch's pluggable allocator calls (through the C functions of `torch_abi`).

use super::{leak_report_dict, stats_dict, unpickle, GpumemError, OutOfMemoryError};
use crate::diagnostics::{empty_snapshot, leak_check_at_exit, leaks_of, summary};
use crate::registry::{
    global, sim_source, ConfigureError, FreeOutcome, HistoryRequest, TorchError, MAX_DEVICES,
};
use crate::stats::stats_json_text;
use crate::torch_abi::{bind_c10, call_alloc_from_cpp, oom_is_c10, test_capture, CallOutcome};
use gpumem_core::policy::BlockKind;
use gpumem_core::report::leaks::LeakReport;
use gpumem_core::report::snapshot::{snapshot_pickle, write_pickle, write_snapshot};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3::wrap_pyfunction;
use std::path::PathBuf;

/// A device index from Python: one of the devices present (as PyTorch's own functions raise
/// for an index past the last GPU instead of answering zeros).
fn device(d: i64) -> PyResult<usize> {
    let present = global().devices_present();
    usize::try_from(d)
        .ok()
        .filter(|&d| d < MAX_DEVICES && present.is_none_or(|n| d < n))
        .ok_or_else(|| {
            PyValueError::new_err(match present {
                Some(n) => format!("invalid CUDA device index {d} ({n} device(s): 0..{n})"),
                None => format!("invalid CUDA device index {d}"),
            })
        })
}

fn torch_err(e: TorchError) -> PyErr {
    match e {
        TorchError::OutOfMemory(m) => OutOfMemoryError::new_err(m),
        TorchError::Other(m) => GpumemError::new_err(m),
    }
}

/// Fixes the configuration of the PyTorch allocators (conf, or GPUMEM_CONF when None).
/// Returns the configuration text in force.
#[pyfunction]
#[pyo3(signature = (conf=None))]
fn torch_configure(conf: Option<&str>) -> PyResult<String> {
    global().configure(conf).map_err(|e| match e {
        ConfigureError::Invalid(m) => PyValueError::new_err(m),
        ConfigureError::Conflict(m) => GpumemError::new_err(m),
    })
}

/// The configuration text in force, or None before the first configuration.
#[pyfunction]
fn torch_conf() -> Option<String> {
    global().conf_text()
}

/// Serves PyTorch from simulated devices instead of CUDA (tests). Only before the first
/// allocation.
#[pyfunction]
#[pyo3(signature = (devices=1, total_bytes=None, manual_events=false))]
fn torch_use_simulated_devices(
    devices: u32,
    total_bytes: Option<u64>,
    manual_events: bool,
) -> PyResult<()> {
    if devices == 0 || devices as usize > MAX_DEVICES {
        return Err(PyValueError::new_err(format!(
            "devices must be in 1..={MAX_DEVICES}"
        )));
    }
    if let Some(b) = total_bytes {
        gpumem_core::backend::sim::check_total_bytes(b)
            .map_err(|e| PyValueError::new_err(format!("total_bytes: {e}")))?;
    }
    global()
        .use_source(sim_source(devices, total_bytes, manual_events))
        .map_err(GpumemError::new_err)
}

/// Devices on which gpumem has an allocator.
#[pyfunction]
fn torch_devices() -> Vec<usize> {
    global().devices()
}

/// `torch.cuda.memory_stats(device)` of gpumem's allocator of `device`.
#[pyfunction]
fn torch_memory_stats(py: Python<'_>, device_index: i64) -> PyResult<Bound<'_, PyDict>> {
    stats_dict(py, &global().memory_stats(device(device_index)?))
}

/// Resets the peaks of `device`'s statistics.
#[pyfunction]
fn torch_reset_peak_memory_stats(device_index: i64) -> PyResult<()> {
    global().reset_peak_stats(device(device_index)?);
    Ok(())
}

/// Zeroes the allocated/freed totals and the counters of `device`'s statistics.
#[pyfunction]
fn torch_reset_accumulated_memory_stats(device_index: i64) -> PyResult<()> {
    global().reset_accumulated_stats(device(device_index)?);
    Ok(())
}

/// `device`'s statistics as JSON text (nested, and flat under torch's names).
#[pyfunction]
fn torch_memory_stats_json(device_index: i64) -> PyResult<String> {
    Ok(stats_json_text(
        &global().memory_stats(device(device_index)?),
    ))
}

/// The summary table of `device`'s statistics, titled like PyTorch's.
#[pyfunction]
#[pyo3(signature = (device_index, abbreviated=false))]
fn torch_memory_summary(device_index: i64, abbreviated: bool) -> PyResult<String> {
    let d = device(device_index)?;
    let title = format!(
        "gpumem CUDA memory summary, device ID {d} (policy {})",
        global()
            .effective_config()
            .map_err(torch_err)?
            .policy
            .name()
    );
    Ok(summary(
        &global().memory_stats(d),
        title,
        abbreviated,
        global().policy_notes(d),
    ))
}

/// The snapshot pickle of `device`: its allocator's, or an empty one before gpumem allocated
/// there (as PyTorch's is before the first allocation).
fn snapshot_bytes(d: usize) -> PyResult<Vec<u8>> {
    match global().get(d) {
        Some(slot) => {
            snapshot_pickle(&slot.alloc).map_err(|e| GpumemError::new_err(format!("snapshot: {e}")))
        }
        None => Ok(empty_snapshot(
            d as u32,
            &global().effective_config().map_err(torch_err)?,
        )),
    }
}

/// A snapshot dict of `device` in PyTorch's format.
#[pyfunction]
fn torch_snapshot(py: Python<'_>, device_index: i64) -> PyResult<Bound<'_, PyAny>> {
    let bytes = snapshot_bytes(device(device_index)?)?;
    unpickle(py, &bytes)
}

/// Writes the snapshot of `device` to `path` (gzipped when it ends in ".gz").
#[pyfunction]
fn torch_dump_snapshot(py: Python<'_>, device_index: i64, path: PathBuf) -> PyResult<()> {
    let d = device(device_index)?;
    let Some(slot) = global().get(d) else {
        let bytes = snapshot_bytes(d)?;
        return write_pickle(&bytes, &path)
            .map_err(|e| GpumemError::new_err(format!("snapshot: {e}")));
    };
    let alloc = slot.alloc.clone();
    py.detach(move || write_snapshot(&alloc, &path))
        .map_err(|e| GpumemError::new_err(format!("snapshot: {e}")))
}

/// Records the allocation history of the PyTorch allocators: `entries` events (0: none),
/// with a backtrace at each allocation when `backtraces`. Returns None when done (or already
/// so), or a warning when asked to stop a history that cannot stop; raises when the
/// allocators already exist with other settings.
#[pyfunction]
fn torch_record_memory_history(entries: usize, backtraces: bool) -> PyResult<Option<String>> {
    match global().record_history(HistoryRequest {
        entries,
        backtraces,
    }) {
        Ok(()) => Ok(None),
        Err(e) if e.turning_off => Ok(Some(e.message)),
        Err(e) => Err(GpumemError::new_err(e.message)),
    }
}

/// The history settings the PyTorch allocators have (or will have): (entries, backtraces).
#[pyfunction]
fn torch_history_settings() -> PyResult<(usize, bool)> {
    let c = global().effective_config().map_err(torch_err)?;
    Ok((c.history, c.backtraces))
}

/// The leak report of `device` as a dict (see `Allocator.leak_report`).
#[pyfunction]
fn torch_leak_report(py: Python<'_>, device_index: i64) -> PyResult<Bound<'_, PyAny>> {
    let d = device(device_index)?;
    let r = match global().get(d) {
        Some(slot) => leaks_of(&slot.alloc, None),
        None => {
            let c = global().effective_config().map_err(torch_err)?;
            LeakReport::from_allocations(c.leak_check, c.leak_check && c.backtraces, Vec::new())
        }
    };
    leak_report_dict(py, &r)
}

/// The leak check at exit: when GPUMEM_LEAK_CHECK=1, prints to standard error the report of
/// every allocator that checks for leaks: PyTorch's, one per device, and each
/// gpumem.Allocator still alive. Returns the live allocations reported.
#[pyfunction]
fn leak_check_at_exit_native(py: Python<'_>) -> usize {
    py.detach(leak_check_at_exit)
}

/// Releases the cached memory of every device; returns the bytes released.
#[pyfunction]
fn torch_empty_cache(py: Python<'_>) -> u64 {
    py.detach(|| global().empty_cache())
}

/// Caps the memory gpumem holds on `device` at `fraction` of it.
#[pyfunction]
fn torch_set_memory_fraction(fraction: f64, device_index: i64) -> PyResult<()> {
    let d = device(device_index)? as i32;
    global().set_memory_fraction(fraction, d).map_err(torch_err)
}

/// `device`'s cap as a fraction of it (1 without one).
#[pyfunction]
fn torch_memory_fraction(device_index: i64) -> PyResult<f64> {
    let d = device(device_index)? as i32;
    global().memory_fraction(d).map_err(torch_err)
}

/// Misuse reported by the free and record-stream hooks instead of raised.
#[pyfunction]
fn torch_error_counts(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in global().counters.snapshot() {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// The driver calls gpumem made on `device`: {cuda name: (calls, pages, measured seconds)},
/// the seconds being wall time measured around each call (host time the calls took).
#[pyfunction]
fn torch_driver_calls(py: Python<'_>, device_index: i64) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    if let Some(slot) = global().get(device(device_index)?) {
        let calls = slot.alloc.driver_calls();
        for (k, n) in calls.nonzero() {
            d.set_item(
                k.cuda_name(),
                (n, calls.pages(k), calls.measured_seconds(k)),
            )?;
        }
    }
    Ok(d)
}

/// Switches the timing of PyTorch's calls into gpumem on or off (totals are kept).
#[pyfunction]
fn torch_time_hooks(on: bool) {
    global().clock.set(on);
}

/// Host time inside PyTorch's calls into gpumem while timed: {hook: (calls, seconds)}.
#[pyfunction]
fn torch_hook_time(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (hook, calls, nanos) in global().clock.snapshot() {
        d.set_item(hook.name(), (calls, nanos as f64 * 1e-9))?;
    }
    Ok(d)
}

/// What gpumem's policy on `device` changed on its own so far, one line each (empty if
/// nothing, or no allocator on that device yet).
#[pyfunction]
fn torch_policy_notes(device_index: i64) -> PyResult<Vec<String>> {
    Ok(global().policy_notes(device(device_index)?))
}

/// The allocation hook's logic, raising Python exceptions instead of C++ ones.
#[pyfunction]
#[pyo3(signature = (size, device_index=0, stream=0))]
fn torch_alloc(py: Python<'_>, size: u64, device_index: i32, stream: u64) -> PyResult<u64> {
    py.detach(|| global().alloc(size, device_index, stream))
        .map_err(torch_err)
}

/// The free hook's logic; returns what happened: "freed", "null", "foreign", "double_free"
/// or "failed" (the last three are also counted in torch_error_counts()).
#[pyfunction]
#[pyo3(signature = (ptr, device_index=0, stream=0))]
fn torch_free(py: Python<'_>, ptr: u64, device_index: i32, stream: u64) -> &'static str {
    match py.detach(|| global().free(ptr, device_index, stream)) {
        FreeOutcome::Freed(_) => "freed",
        FreeOutcome::Null => "null",
        FreeOutcome::Foreign => "foreign",
        FreeOutcome::DoubleFree => "double_free",
        FreeOutcome::Failed => "failed",
    }
}

/// The record-stream hook's logic; returns whether `ptr` is a gpumem block.
#[pyfunction]
fn torch_record_stream(ptr: u64, stream: u64) -> bool {
    global().record_stream(ptr, stream)
}

/// Calls the exported allocation function from C++ as PyTorch does, catching what it
/// throws: ("returned", ptr) or ("threw", C++ type, what()).
#[pyfunction]
#[pyo3(signature = (size, device_index=0, stream=0))]
fn torch_call_alloc_from_cpp(
    py: Python<'_>,
    size: usize,
    device_index: i32,
    stream: u64,
) -> PyResult<Bound<'_, PyTuple>> {
    match py.detach(|| call_alloc_from_cpp(size, device_index, stream)) {
        CallOutcome::Returned(p) => ("returned", p).into_pyobject(py),
        CallOutcome::Threw { type_name, what } => ("threw", type_name, what).into_pyobject(py),
    }
}

/// Makes out-of-memory failures c10::OutOfMemoryError (torch.cuda.OutOfMemoryError in
/// Python), given the paths of the loaded libc10.so and libc10_cuda.so.
#[pyfunction]
fn torch_bind_c10(libc10: &str, libc10_cuda: &str) -> PyResult<()> {
    bind_c10(libc10, libc10_cuda).map_err(GpumemError::new_err)
}

/// Whether `install()` bound c10's memory-profiler functions, through which the allocation
/// and free hooks tell `torch.profiler` of each block.
#[pyfunction]
fn torch_profiler_bound() -> bool {
    crate::torch_abi::profiler_bound()
}

/// The C++ exception type out-of-memory failures are thrown as.
#[pyfunction]
fn torch_oom_exception() -> &'static str {
    if oom_is_c10() {
        "c10::OutOfMemoryError"
    } else {
        "gpumem::OutOfMemoryError"
    }
}

/// Simulated devices: completes every recorded event of `device`; returns how many.
#[pyfunction]
fn torch_sim_complete_events(device_index: i64) -> PyResult<usize> {
    Ok(global().sim_complete_events(device(device_index)?))
}

/// For the tests without a GPU: begins (`begin`) or ends a CUDA graph capture of pool
/// (`first`, `second`) on `device` whose filter takes exactly `stream`, through the shim's
/// hooks as PyTorch's CUDAGraph calls them. Raises GpumemError with what the hook threw.
#[pyfunction]
fn torch_test_capture(
    begin: bool,
    device_index: i32,
    first: u64,
    second: u64,
    stream: u64,
) -> PyResult<()> {
    test_capture(begin, device_index, (first, second), stream).map_err(GpumemError::new_err)
}

/// Users of private pool (`first`, `second`) on `device`: graphs captured into it and not yet
/// destroyed (c10's getPoolUseCount).
#[pyfunction]
fn torch_pool_use_count(device_index: i64, first: u64, second: u64) -> PyResult<u32> {
    Ok(global().pool_use_count(device(device_index)?, (first, second)))
}

/// The device whose gpumem allocator handed out the live block containing `ptr`, or None.
#[pyfunction]
fn torch_owner_device(ptr: u64) -> Option<usize> {
    global().devices().into_iter().find(|&d| {
        global().get(d).is_some_and(|s| {
            s.alloc.snapshot().iter().any(|seg| {
                seg.blocks.iter().any(|b| {
                    b.kind == BlockKind::Allocated && b.addr <= ptr && ptr < b.addr + b.size
                })
            })
        })
    })
}

/// Number of CUDA devices the driver reports (raises GpumemError without a driver).
#[pyfunction]
fn cuda_device_count() -> PyResult<u32> {
    gpumem_cuda::device_count().map_err(|e| GpumemError::new_err(e.to_string()))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(torch_configure, m)?)?;
    m.add_function(wrap_pyfunction!(torch_conf, m)?)?;
    m.add_function(wrap_pyfunction!(torch_use_simulated_devices, m)?)?;
    m.add_function(wrap_pyfunction!(torch_devices, m)?)?;
    m.add_function(wrap_pyfunction!(torch_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(torch_reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(torch_reset_accumulated_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(torch_memory_summary, m)?)?;
    m.add_function(wrap_pyfunction!(torch_memory_stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(torch_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(torch_dump_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(torch_record_memory_history, m)?)?;
    m.add_function(wrap_pyfunction!(torch_history_settings, m)?)?;
    m.add_function(wrap_pyfunction!(torch_leak_report, m)?)?;
    m.add_function(wrap_pyfunction!(leak_check_at_exit_native, m)?)?;
    m.add_function(wrap_pyfunction!(torch_empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(torch_set_memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(torch_memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(torch_error_counts, m)?)?;
    m.add_function(wrap_pyfunction!(torch_driver_calls, m)?)?;
    m.add_function(wrap_pyfunction!(torch_policy_notes, m)?)?;
    m.add_function(wrap_pyfunction!(torch_time_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(torch_hook_time, m)?)?;
    m.add_function(wrap_pyfunction!(torch_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(torch_free, m)?)?;
    m.add_function(wrap_pyfunction!(torch_record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(torch_call_alloc_from_cpp, m)?)?;
    m.add_function(wrap_pyfunction!(torch_bind_c10, m)?)?;
    m.add_function(wrap_pyfunction!(torch_oom_exception, m)?)?;
    m.add_function(wrap_pyfunction!(torch_profiler_bound, m)?)?;
    m.add_function(wrap_pyfunction!(torch_sim_complete_events, m)?)?;
    m.add_function(wrap_pyfunction!(torch_owner_device, m)?)?;
    m.add_function(wrap_pyfunction!(torch_test_capture, m)?)?;
    m.add_function(wrap_pyfunction!(torch_pool_use_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    Ok(())
}
