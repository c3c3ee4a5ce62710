//! `gpumem.Allocator`: one gpumem allocator, usable from Python without PyTorch, over a CUDA
//! device or a simulated one.

use super::{
    add_python_frames, leak_report_dict, python_stack, stats_dict, to_pyerr, unpickle, GpumemError,
    InvalidPointerError, InvalidSizeError,
};
use crate::diagnostics::{leaks_of, summary, watch_at_exit, CallerStacks};
use crate::registry::parse_conf;
use crate::stats::stats_json_text;
use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use gpumem_core::backend::Backend;
use gpumem_core::report::snapshot::{snapshot_pickle, write_pickle, write_snapshot};
use gpumem_core::units::H200_TOTAL_BYTES;
use gpumem_core::Allocator;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::path::PathBuf;
use std::sync::Arc;

/// Which device an `Allocator` serves: `"sim"` or a CUDA ordinal.
#[derive(FromPyObject)]
pub enum DeviceArg {
    /// A CUDA device ordinal.
    Index(i64),
    /// `"sim"`.
    Name(String),
}

/// A gpumem allocator over one device.
///
/// Allocator(conf=None, device="sim", sim_memory=None, sim_events="immediate")
///
/// conf: a GPUMEM_CONF-style string ("policy:stitched,fraction:0.5"); None reads the
///     GPUMEM_CONF environment variable (default policy: stitched). "history:N" keeps the
///     last N allocation events for snapshot(), "leak_check:1" tracks live allocations for
///     leak_report(), "backtraces:1" records where each allocation was made (the Python
///     stack, and the native one). GPUMEM_LEAK_CHECK=1 in the environment adds
///     leak_check:1,backtraces:1 and reports what is still allocated at interpreter exit.
/// device: "sim" for the simulated device (no GPU), or a CUDA device ordinal.
/// sim_memory: bytes of the simulated device (default: an H200's 150,109,880,320).
/// sim_events: "immediate" (work on other streams is always finished) or "manual" (events
///     complete only at sim_complete_events(), to test stream-ordered reuse).
///
/// Pointers are integers; streams are integers (a cudaStream_t value, 0 for the default).
#[pyclass(name = "Allocator", module = "gpumem", frozen)]
pub struct PyAllocator {
    inner: Arc<Allocator>,
    sim: Option<SimControl>,
    conf: String,
    device: String,
    /// Python callers of the live allocations, when backtraces are recorded.
    stacks: Option<Arc<CallerStacks>>,
}

fn checked_size(size: i128) -> PyResult<u64> {
    if size <= 0 {
        return Err(InvalidSizeError::new_err(format!(
            "invalid size {size} bytes: an allocation needs at least 1 byte"
        )));
    }
    u64::try_from(size).map_err(|_| {
        InvalidSizeError::new_err(format!("invalid size {size} bytes: more than 2**64"))
    })
}

#[pymethods]
impl PyAllocator {
    #[new]
    #[pyo3(signature = (conf=None, device=DeviceArg::Name("sim".into()), sim_memory=None, sim_events="immediate"))]
    fn new(
        py: Python<'_>,
        conf: Option<&str>,
        device: DeviceArg,
        sim_memory: Option<u64>,
        sim_events: &str,
    ) -> PyResult<Self> {
        let conf_text = match conf {
            Some(c) => c.to_string(),
            None => std::env::var("GPUMEM_CONF").unwrap_or_default(),
        };
        let config = parse_conf(&conf_text).map_err(to_pyerr)?;
        let (backend, sim, device_name): (Box<dyn Backend>, Option<SimControl>, String) =
            match device {
                DeviceArg::Name(n) if n == "sim" => {
                    let event_mode = match sim_events {
                        "immediate" => EventMode::Immediate,
                        "manual" => EventMode::Manual,
                        other => {
                            return Err(PyValueError::new_err(format!(
                                "sim_events must be 'immediate' or 'manual', not {other:?}"
                            )))
                        }
                    };
                    let total = sim_memory.unwrap_or(H200_TOTAL_BYTES);
                    gpumem_core::backend::sim::check_total_bytes(total)
                        .map_err(|e| PyValueError::new_err(format!("sim_memory: {e}")))?;
                    let (b, ctl) = SimBackend::new(SimConfig {
                        total_bytes: total,
                        event_mode,
                        ..SimConfig::default()
                    });
                    (Box::new(b), Some(ctl), "sim".to_string())
                }
                DeviceArg::Name(n) => {
                    return Err(PyValueError::new_err(format!(
                        "device must be 'sim' or a CUDA device index, not {n:?}"
                    )))
                }
                DeviceArg::Index(i) => {
                    if sim_memory.is_some() {
                        return Err(PyValueError::new_err(
                            "sim_memory applies to device='sim' only",
                        ));
                    }
                    let ordinal = u32::try_from(i).map_err(|_| {
                        PyValueError::new_err(format!("invalid CUDA device index {i}"))
                    })?;
                    let b = gpumem_cuda::open_backend(ordinal).map_err(|e| {
                        GpumemError::new_err(format!("cannot open CUDA device {ordinal}: {e}"))
                    })?;
                    (b, None, format!("cuda:{ordinal}"))
                }
            };
        let tracked = config.backtraces && (config.leak_check || config.history > 0);
        let leak_check = config.leak_check;
        let inner = Arc::new(Allocator::new(backend, config).map_err(to_pyerr)?);
        let stacks = tracked.then(|| Arc::new(CallerStacks::new()));
        if leak_check {
            let made_at = python_stack(py)
                .first()
                .map(|f| format!(", made at {f}"))
                .unwrap_or_default();
            let label = format!(
                "gpumem.Allocator(device={device_name:?}, policy={:?}){made_at}",
                inner.policy().name()
            );
            watch_at_exit(label, &inner, stacks.as_ref());
        }
        Ok(Self {
            inner,
            sim,
            conf: conf_text,
            device: device_name,
            stacks,
        })
    }

    /// Allocates `size` bytes for use on `stream`; returns the address.
    #[pyo3(signature = (size, stream=0))]
    fn allocate(&self, py: Python<'_>, size: i128, stream: u64) -> PyResult<u64> {
        let size = checked_size(size)?;
        let a = self.inner.clone();
        let ptr = py
            .detach(move || a.allocate(size, stream))
            .map(|a| a.ptr)
            .map_err(to_pyerr)?;
        if let Some(s) = &self.stacks {
            s.insert(ptr, python_stack(py));
        }
        Ok(ptr)
    }

    /// Frees the block at `ptr`. `stream`, if given, is the stream it was allocated on (a
    /// faster lookup). Raises InvalidPointerError / DoubleFreeError for pointers that are not
    /// live blocks of this allocator.
    #[pyo3(signature = (ptr, stream=None))]
    fn free(&self, py: Python<'_>, ptr: i128, stream: Option<u64>) -> PyResult<()> {
        let ptr = device_pointer(ptr)?;
        // Forgotten before the free: once freed, another thread may be handed the same
        // address. Put back if the free fails (the block is still live).
        let stack = self.stacks.as_ref().and_then(|s| s.take(ptr));
        let a = self.inner.clone();
        let freed = py.detach(move || match stream {
            Some(s) => a.free_on(ptr, s),
            None => a.free(ptr),
        });
        if let (Err(_), Some(stack), Some(s)) = (&freed, stack, &self.stacks) {
            s.restore(ptr, stack);
        }
        freed.map_err(to_pyerr)
    }

    /// Marks the block at `ptr` as used on `stream` too: once freed, it is reused only after
    /// the work queued on `stream` by then has completed.
    fn record_stream(&self, ptr: i128, stream: u64) -> PyResult<()> {
        self.inner
            .record_stream(device_pointer(ptr)?, stream)
            .map_err(to_pyerr)
    }

    /// Waits for every pending event and releases the blocks that waited for them.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let a = self.inner.clone();
        py.detach(move || a.synchronize_events()).map_err(to_pyerr)
    }

    /// Returns all cached memory no live block uses to the device; returns the bytes released.
    fn empty_cache(&self, py: Python<'_>) -> PyResult<u64> {
        let a = self.inner.clone();
        py.detach(move || a.empty_cache()).map_err(to_pyerr)
    }

    /// Statistics as `torch.cuda.memory_stats()` returns them (a flat dict).
    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.memory_stats())
    }

    /// Statistics as JSON text: {"stats": {...nested...}, "flat": {...memory_stats()...}}.
    fn memory_stats_json(&self) -> String {
        stats_json_text(&self.inner.memory_stats())
    }

    /// The statistics as a text table in the layout of `torch.cuda.memory_summary()`
    /// (`abbreviated`: only the all-pools row of each metric).
    #[pyo3(signature = (abbreviated=false))]
    fn memory_summary(&self, abbreviated: bool) -> String {
        let title = format!(
            "gpumem memory summary, device {} (policy {})",
            self.device,
            self.inner.policy().name()
        );
        summary(
            &self.inner.memory_stats(),
            title,
            abbreviated,
            self.inner.policy_notes(),
        )
    }

    /// A dict shaped like `torch.cuda.memory._snapshot()`: `segments` (with their blocks),
    /// `device_traces` (the history, when the configuration keeps one: "history:N"),
    /// `allocator_settings`, `external_annotations`. With "backtraces:1" blocks and entries
    /// carry `frames`: the native stack, then the Python stack of live allocations.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let bytes = snapshot_pickle(&self.inner)
            .map_err(|e| GpumemError::new_err(format!("snapshot: {e}")))?;
        let snap = unpickle(py, &bytes)?;
        if let Some(s) = &self.stacks {
            add_python_frames(py, &snap, s)?;
        }
        Ok(snap)
    }

    /// Writes `snapshot()` as a pickle to `path` (gzipped when it ends in ".gz"), for
    /// `python -m torch.cuda._memory_viz` and PyTorch's memory visualizer.
    fn dump_snapshot(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        if self.stacks.is_none() {
            let a = self.inner.clone();
            return py
                .detach(move || write_snapshot(&a, &path))
                .map_err(|e| GpumemError::new_err(format!("snapshot: {e}")));
        }
        // With Python stacks the pickle is re-made from the dict they were added to.
        let snap = self.snapshot(py)?;
        let data = py
            .import("pickle")?
            .call_method1("dumps", (snap,))?
            .cast_into::<PyBytes>()?;
        write_pickle(data.as_bytes(), &path)
            .map_err(|e| GpumemError::new_err(format!("snapshot: {e}")))
    }

    /// The segments and their blocks: the `segments` list of `snapshot()`, like
    /// `torch.cuda.memory_snapshot()`.
    fn segments<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        Ok(self
            .snapshot(py)?
            .get_item("segments")?
            .cast_into::<PyList>()?)
    }

    /// What is still allocated, as a dict: `allocations` (address, size, stream, age_s,
    /// site, frames), `sites` (grouped by call site), `total_bytes`, `tracked`, `backtraces`,
    /// and `text`, the printed report. Ages and call sites need "leak_check:1,backtraces:1"
    /// (or GPUMEM_LEAK_CHECK=1); the call site is the Python caller of `allocate`.
    fn leak_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let r = leaks_of(&self.inner, self.stacks.as_deref());
        leak_report_dict(py, &r)
    }

    /// Caps the memory held at `fraction` of the device (0 < fraction <= 1).
    fn set_memory_fraction(&self, fraction: f64) -> PyResult<()> {
        self.inner.set_memory_fraction(fraction).map_err(to_pyerr)
    }

    /// Caps the memory held at `bytes` (None: no cap).
    #[pyo3(signature = (bytes=None))]
    fn set_cap(&self, bytes: Option<u64>) {
        self.inner.set_cap(bytes);
    }

    /// Sets every peak statistic to its current value.
    fn reset_peak_memory_stats(&self) {
        self.inner.reset_peak_stats();
    }

    /// Driver calls made so far, by CUDA function name (simulated ones on the sim device).
    fn driver_calls<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, n) in self.inner.driver_calls().nonzero() {
            d.set_item(k.cuda_name(), n)?;
        }
        Ok(d)
    }

    /// What the policy changed on its own so far, one line each (for instance the stitched
    /// policy's streams stopping page trading once it cost more than `trade_budget`, or its
    /// spare pages raised once remapping cost more than `remap_budget`).
    fn policy_notes(&self) -> Vec<String> {
        self.inner.policy_notes()
    }

    /// Bytes held from the device now.
    #[getter]
    fn held_bytes(&self) -> u64 {
        self.inner.held_bytes()
    }

    /// Most bytes held from the device so far.
    #[getter]
    fn peak_held_bytes(&self) -> u64 {
        self.inner.peak_held_bytes()
    }

    /// The placement policy's name.
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy().name()
    }

    /// The configuration string the allocator was made with.
    #[getter]
    fn conf(&self) -> &str {
        &self.conf
    }

    /// What the device is: name, ordinal, total_bytes, page_bytes, supports_vmm.
    fn device_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.inner.device_info();
        let d = PyDict::new(py);
        d.set_item("name", &i.name)?;
        d.set_item("ordinal", i.ordinal)?;
        d.set_item("total_bytes", i.total_bytes)?;
        d.set_item("page_bytes", i.page_bytes)?;
        d.set_item("supports_vmm", i.supports_vmm)?;
        Ok(d)
    }

    /// Streams that have allocated so far.
    fn streams(&self) -> Vec<u64> {
        self.inner.streams()
    }

    /// Checks the allocator's internal invariants; raises GpumemError if one is broken.
    fn check(&self) -> PyResult<()> {
        self.inner.check().map_err(GpumemError::new_err)
    }

    /// Simulated device: events recorded and not yet completed.
    fn sim_pending_events(&self) -> PyResult<usize> {
        Ok(self.sim_control()?.pending())
    }

    /// Simulated device: completes every event recorded so far (the other streams caught up);
    /// returns how many.
    fn sim_complete_events(&self) -> PyResult<usize> {
        Ok(self.sim_control()?.complete_recorded())
    }

    fn __repr__(&self) -> String {
        format!(
            "gpumem.Allocator(device={:?}, policy={:?}, held={} bytes)",
            self.device,
            self.inner.policy().name(),
            self.inner.held_bytes()
        )
    }
}

impl PyAllocator {
    fn sim_control(&self) -> PyResult<&SimControl> {
        self.sim
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("this allocator is not on the simulated device"))
    }
}

/// A pointer given from Python: any int is accepted, and one that cannot be a device address
/// (negative, or wider than 64 bits) is refused as a pointer gpumem never handed out.
fn device_pointer(ptr: i128) -> PyResult<u64> {
    u64::try_from(ptr).map_err(|_| {
        InvalidPointerError::new_err(format!("{ptr} is not a device pointer gpumem handed out"))
    })
}
