//! The Python module `gpumem._native`: the exception types, the [`allocator::PyAllocator`]
//! class, and the functions behind `gpumem.torch` (see `python/gpumem/torch.py`).

mod allocator;
mod torch_fns;

/// Most Python frames kept per allocation (innermost first).
const MAX_PYTHON_FRAMES: usize = 64;

use crate::diagnostics::CallerStacks;
use gpumem_core::report::frames::Frame;
use gpumem_core::report::leaks::LeakReport;
use gpumem_core::{AllocError, MemoryStats};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::collections::HashSet;

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
        AllocError::Backend(_)
        | AllocError::TooManyStreams { .. }
        | AllocError::ReservedStream { .. }
        | AllocError::Pool(_) => GpumemError::new_err(msg),
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

/// Unpickles bytes with Python's `pickle` (snapshots are PyTorch-format pickles).
pub(crate) fn unpickle<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let data = pyo3::types::PyBytes::new(py, bytes);
    py.import("pickle")?.call_method1("loads", (data,))
}

/// The Python stack of the caller, innermost frame first, as snapshot frames
/// (`filename`, `line`, `name`). A stack that cannot be read is empty: diagnostics never make
/// an allocation fail.
pub(crate) fn python_stack(py: Python<'_>) -> Vec<Frame> {
    let read = || -> PyResult<Vec<Frame>> {
        let mut frames = Vec::new();
        // Native functions have no frame of their own: this is the caller's.
        let mut f = py
            .import(intern!(py, "sys"))?
            .getattr(intern!(py, "_getframe"))?
            .call0()?;
        while !f.is_none() && frames.len() < MAX_PYTHON_FRAMES {
            let code = f.getattr(intern!(py, "f_code"))?;
            frames.push(Frame {
                name: code.getattr(intern!(py, "co_name"))?.extract()?,
                filename: code.getattr(intern!(py, "co_filename"))?.extract()?,
                line: f
                    .getattr(intern!(py, "f_lineno"))?
                    .extract::<Option<u32>>()?
                    .unwrap_or(0),
            });
            f = f.getattr(intern!(py, "f_back"))?;
        }
        Ok(frames)
    };
    read().unwrap_or_default()
}

fn frames_list<'py>(py: Python<'py>, frames: &[Frame]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for f in frames {
        let d = PyDict::new(py);
        d.set_item("filename", &f.filename)?;
        d.set_item("line", f.line)?;
        d.set_item("name", &f.name)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Whether a native frame belongs to this extension (gpumem's engine is inside it too); the
/// native frames under it are the interpreter's, which the Python frames stand for.
fn is_extension_frame(name: &str) -> bool {
    let n = name.trim_start_matches('<');
    n.starts_with("_native::") || n.starts_with("pyo3::") || n.starts_with("gpumem")
}

/// `item["frames"]` cut after the extension's last native frame, then `python` (a new list:
/// the unpickled snapshot shares one list among the blocks and entries that have the same
/// native stack).
fn extend_frames(py: Python<'_>, item: &Bound<'_, PyAny>, python: &[Frame]) -> PyResult<()> {
    let merged = PyList::empty(py);
    if let Ok(old) = item.get_item("frames") {
        let native: Vec<Bound<'_, PyAny>> = old.try_iter()?.collect::<PyResult<_>>()?;
        let mut keep = 0;
        for (i, f) in native.iter().enumerate() {
            if is_extension_frame(&f.get_item("name")?.extract::<String>()?) {
                keep = i + 1;
            }
        }
        for f in &native[..keep] {
            merged.append(f)?;
        }
    }
    for f in frames_list(py, python)?.iter() {
        merged.append(f)?;
    }
    item.set_item("frames", merged)
}

/// Adds the Python stacks of the live allocations to an unpickled snapshot, in place of the
/// interpreter's native frames (innermost first, as PyTorch lists C++ frames then Python
/// ones): to their
/// blocks, and to the history entry that allocated each of them (the newest `alloc` of its
/// address, since an address is not handed out again while its block lives).
pub(crate) fn add_python_frames(
    py: Python<'_>,
    snap: &Bound<'_, PyAny>,
    stacks: &CallerStacks,
) -> PyResult<()> {
    for seg in snap.get_item("segments")?.try_iter()? {
        for block in seg?.get_item("blocks")?.try_iter()? {
            let block = block?;
            if block.get_item("state")?.extract::<String>()? != "active_allocated" {
                continue;
            }
            if let Some(frames) = stacks.get(block.get_item("address")?.extract()?) {
                extend_frames(py, &block, &frames)?;
            }
        }
    }
    for trace in snap.get_item("device_traces")?.try_iter()? {
        let entries: Vec<Bound<'_, PyAny>> = trace?.try_iter()?.collect::<PyResult<_>>()?;
        let mut seen = HashSet::new();
        for e in entries.iter().rev() {
            if e.get_item("action")?.extract::<String>()? != "alloc" {
                continue;
            }
            let addr: u64 = e.get_item("addr")?.extract()?;
            if seen.insert(addr) {
                if let Some(frames) = stacks.get(addr) {
                    extend_frames(py, e, &frames)?;
                }
            }
        }
    }
    Ok(())
}

/// A leak report as a dict: gpumem-core's JSON form (`tracked`, `backtraces`, `total_bytes`,
/// `sites`, `allocations`) and its printed form under `text`.
pub(crate) fn leak_report_dict<'py>(
    py: Python<'py>,
    r: &LeakReport,
) -> PyResult<Bound<'py, PyAny>> {
    let d = py
        .import(intern!(py, "json"))?
        .call_method1(intern!(py, "loads"), (r.to_json().to_string(),))?;
    d.set_item("text", r.to_string())?;
    Ok(d)
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
