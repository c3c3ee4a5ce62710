//! The Python module `gpumem._native`: the exception types, the [`allocator::PyAllocator`]
//! class, and the functions behind `gpumem.torch` (see `python/gpumem/torch.py`).

mod allocator;
mod torch_fns;

use gpumem_core::policy::{BlockKind, SegmentInfo};
use gpumem_core::stats::Pool;
use gpumem_core::{AllocError, MemoryStats};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

create_exception!(
    gpumem,
    GpumemError,
    PyRuntimeError,
    "Base class of the errors gpumem raises."
);
create_exception!(
    gpumem,
    OutOfMemoryError,
    GpumemError,
    "No memory for a request, even after releasing the cache. The message says where the memory is."
);
create_exception!(
    gpumem,
    InvalidPointerError,
    GpumemError,
    "A pointer gpumem did not hand out (or no longer knows)."
);
create_exception!(
    gpumem,
    DoubleFreeError,
    InvalidPointerError,
    "A pointer freed twice."
);
create_exception!(
    gpumem,
    InvalidSizeError,
    GpumemError,
    "A size no allocation can have (zero, negative, or more than the device)."
);

/// The Python exception for an allocator error.
pub(crate) fn to_pyerr(e: AllocError) -> PyErr {
    let msg = e.to_string();
    match e {
        AllocError::OutOfMemory(_) => OutOfMemoryError::new_err(msg),
        AllocError::InvalidSize { .. } => InvalidSizeError::new_err(msg),
        AllocError::UnknownPointer { .. } => InvalidPointerError::new_err(msg),
        AllocError::DoubleFree { .. } => DoubleFreeError::new_err(msg),
        AllocError::Backend(b) if b.out_of_memory => OutOfMemoryError::new_err(msg),
        AllocError::Config(_) => PyValueError::new_err(msg),
        AllocError::Backend(_) | AllocError::TooManyStreams { .. } => GpumemError::new_err(msg),
    }
}

/// `torch.cuda.memory_stats()`'s dictionary, keys in sorted order (as PyTorch returns them).
pub(crate) fn stats_dict<'py>(py: Python<'py>, s: &MemoryStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in crate::stats::torch_flat_stats(s) {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Segments in the shape of the `segments` list of `torch.cuda.memory_snapshot()`.
pub(crate) fn segments_list<'py>(
    py: Python<'py>,
    device: i64,
    segs: &[SegmentInfo],
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for s in segs {
        let d = PyDict::new(py);
        d.set_item("device", device)?;
        d.set_item("address", s.addr)?;
        d.set_item("total_size", s.size)?;
        d.set_item("stream", s.stream)?;
        d.set_item(
            "segment_type",
            match s.pool {
                Pool::Small => "small",
                Pool::Large => "large",
            },
        )?;
        let blocks = PyList::empty(py);
        let (mut allocated, mut active, mut requested) = (0u64, 0u64, 0u64);
        for b in &s.blocks {
            let bd = PyDict::new(py);
            bd.set_item("address", b.addr)?;
            bd.set_item("size", b.size)?;
            bd.set_item("requested_size", b.requested)?;
            let state = match b.kind {
                BlockKind::Allocated => {
                    allocated += b.size;
                    active += b.size;
                    requested += b.requested;
                    "active_allocated"
                }
                BlockKind::Pending => {
                    active += b.size;
                    "active_pending_free"
                }
                BlockKind::Free => "inactive",
                BlockKind::Unmapped => "unmapped",
            };
            bd.set_item("state", state)?;
            blocks.append(bd)?;
        }
        d.set_item("allocated_size", allocated)?;
        d.set_item("active_size", active)?;
        d.set_item("requested_size", requested)?;
        d.set_item("blocks", blocks)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Unpickles bytes with Python's `pickle` (snapshots are PyTorch-format pickles).
pub(crate) fn unpickle<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let data = pyo3::types::PyBytes::new(py, bytes);
    py.import("pickle")?.call_method1("loads", (data,))
}

/// gpumem's native module: the allocator engine (Rust) for Python and PyTorch.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("GpumemError", py.get_type::<GpumemError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add("InvalidPointerError", py.get_type::<InvalidPointerError>())?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("InvalidSizeError", py.get_type::<InvalidSizeError>())?;
    m.add_class::<allocator::PyAllocator>()?;
    torch_fns::register(m)?;
    Ok(())
}
