//! `gpumem.Allocator`: one gpumem allocator, usable from Python without PyTorch, over a CUDA
//! device or a simulated one.

use super::{segments_list, stats_dict, to_pyerr, unpickle, GpumemError, InvalidSizeError};
use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use gpumem_core::backend::Backend;
use gpumem_core::report::{snapshot::snapshot_pickle, summary::memory_summary};
use gpumem_core::units::H200_TOTAL_BYTES;
use gpumem_core::{Allocator, Config};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
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
///     GPUMEM_CONF environment variable (default policy: stitched).
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
        conf: Option<&str>,
        device: DeviceArg,
        sim_memory: Option<u64>,
        sim_events: &str,
    ) -> PyResult<Self> {
        let conf_text = match conf {
            Some(c) => c.to_string(),
            None => std::env::var("GPUMEM_CONF").unwrap_or_default(),
        };
        let config = Config::parse(&conf_text).map_err(to_pyerr)?;
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
                    if total == 0 {
                        return Err(PyValueError::new_err("sim_memory must be positive"));
                    }
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
        let inner = Allocator::new(backend, config).map_err(to_pyerr)?;
        Ok(Self {
            inner: Arc::new(inner),
            sim,
            conf: conf_text,
            device: device_name,
        })
    }

    /// Allocates `size` bytes for use on `stream`; returns the address.
    #[pyo3(signature = (size, stream=0))]
    fn allocate(&self, py: Python<'_>, size: i128, stream: u64) -> PyResult<u64> {
        let size = checked_size(size)?;
        let a = self.inner.clone();
        py.detach(move || a.allocate(size, stream))
            .map(|a| a.ptr)
            .map_err(to_pyerr)
    }

    /// Frees the block at `ptr`. `stream`, if given, is the stream it was allocated on (a
    /// faster lookup). Raises InvalidPointerError / DoubleFreeError for pointers that are not
    /// live blocks of this allocator.
    #[pyo3(signature = (ptr, stream=None))]
    fn free(&self, py: Python<'_>, ptr: u64, stream: Option<u64>) -> PyResult<()> {
        let a = self.inner.clone();
        py.detach(move || match stream {
            Some(s) => a.free_on(ptr, s),
            None => a.free(ptr),
        })
        .map_err(to_pyerr)
    }

    /// Marks the block at `ptr` as used on `stream` too: once freed, it is reused only after
    /// the work queued on `stream` by then has completed.
    fn record_stream(&self, ptr: u64, stream: u64) -> PyResult<()> {
        self.inner.record_stream(ptr, stream).map_err(to_pyerr)
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

    /// A text table like `torch.cuda.memory_summary()`.
    fn memory_summary(&self) -> String {
        memory_summary(&self.inner.memory_stats())
    }

    /// A dict shaped like `torch.cuda.memory._snapshot()` (segments, device_traces, ...).
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let bytes = snapshot_pickle(&self.inner)
            .map_err(|e| GpumemError::new_err(format!("snapshot: {e}")))?;
        unpickle(py, &bytes)
    }

    /// Segments and their blocks, as in the `segments` list of a PyTorch snapshot.
    fn segments<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let device = i64::from(self.inner.device_info().ordinal);
        segments_list(py, device, &self.inner.snapshot())
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
        let ctl = self.sim_control()?;
        let recorded = ctl.take_recorded();
        for (e, _) in &recorded {
            ctl.complete(*e);
        }
        Ok(recorded.len())
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
