"""gpumem as PyTorch's CUDA memory allocator.

::

    import gpumem
    gpumem.torch.install()        # first thing, before any tensor is created on the GPU

From then on every CUDA tensor of the process is allocated by gpumem (one allocator per
device, created on the first request for that device). ``torch.cuda.empty_cache()`` and
``torch.cuda.set_per_process_memory_fraction()`` reach gpumem, ``Tensor.record_stream`` is
honoured, and an allocation that cannot be met raises ``torch.cuda.OutOfMemoryError``.
CUDA graphs (``torch.cuda.graph``, ``make_graphed_callables``) get private pools: what a
capture allocates stays the graph's until the graph is destroyed.

PyTorch's own statistics functions do not work under a pluggable allocator; this module
provides them in the same shapes (``memory_stats``, ``memory_summary``, ``snapshot``...), and
``install()`` by default points ``torch.cuda.memory_stats`` & co. at them so that existing code
keeps working. ``record_memory_history()`` turns on the allocation history that snapshots
carry, and ``leak_report()`` lists what is still allocated.

``install(native=True)`` plugs gpumem in as a ``CUDAAllocator`` of its own, compiled against
the PyTorch at hand, instead of through ``torch.cuda.memory.CUDAPluggableAllocator``, whose
per-pointer map and mutex cost about as much per call as PyTorch's whole allocator.

Importing this module does not import PyTorch; only ``install()`` does.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from . import _native
from ._native import GpumemError

if TYPE_CHECKING:  # pragma: no cover
    import torch as _torch_mod

    from .leaks import LeakReport

    DeviceLike = Union[int, str, "_torch_mod.device", None]
else:
    DeviceLike = Union[int, str, Any, None]

__all__ = [
    "install",
    "is_installed",
    "install_mode",
    "conf",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
    "memory_stats_json",
    "snapshot",
    "memory_snapshot",
    "dump_snapshot",
    "record_memory_history",
    "leak_report",
    "empty_cache",
    "set_memory_fraction",
    "memory_fraction",
    "error_counts",
    "driver_calls",
    "time_hooks",
    "hook_time",
    "policy_notes",
    "devices",
    "oom_exception",
]

_ALLOC_FN = "gpumem_torch_alloc"
_FREE_FN = "gpumem_torch_free"
# (exported C function, CUDAPluggableAllocator setter that takes its address)
_HOOKS = (
    ("gpumem_torch_record_stream", "set_record_stream_fn"),
    ("gpumem_torch_empty_cache", "set_reset_fn"),
    ("gpumem_torch_set_memory_fraction", "set_memory_fraction_fn"),
)

# The hooks the native allocator (csrc/torch_allocator.cpp) calls, in gpumem_native_install's
# order.
_NATIVE_HOOKS = (
    "gpumem_torch_alloc",
    "gpumem_torch_free",
    "gpumem_torch_free_any",
    "gpumem_torch_record_stream",
    "gpumem_torch_empty_cache",
    "gpumem_torch_set_memory_fraction",
    "gpumem_torch_cache_info",
    "gpumem_torch_device_stats",
    "gpumem_torch_reset_peak_stats",
    "gpumem_torch_reset_accumulated_stats",
    "gpumem_torch_limit_and_free",
    "gpumem_torch_memory_fraction",
    "gpumem_torch_pool_use_count",
    "gpumem_torch_pool_retain",
    "gpumem_torch_empty_pool",
    "gpumem_torch_pool_checkpoint",
    "gpumem_torch_pool_checkpoint_free",
    "gpumem_torch_pool_restore",
    "gpumem_torch_pool_live_blocks",
)
# CUDA graph capture's C++ hooks (gpumem_torch_pool_hook_address's numbering), with the
# CUDAPluggableAllocator setter of each; the native allocator takes them after _NATIVE_HOOKS.
_POOL_HOOKS = (
    (0, "set_begin_allocate_to_pool"),
    (1, "set_end_allocate_to_pool_fn"),
    (2, "set_release_pool"),
)
_NATIVE_SOURCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "csrc", "torch_allocator.cpp"
)
_NATIVE_ENV = "GPUMEM_TORCH_NATIVE"

_lock = threading.Lock()
# What install() made; kept alive for the life of the process (PyTorch holds raw pointers to
# the library's functions).
_installed: Optional[Dict[str, Any]] = None


def _native_library_path() -> str:
    path = _native.__file__
    if not path:  # pragma: no cover - a module loaded from memory
        raise GpumemError("cannot find the file of gpumem._native")
    return path


def _function_address(lib: ctypes.CDLL, name: str) -> int:
    addr = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if not addr:
        raise GpumemError(f"gpumem._native does not export {name}")
    return addr


def _pool_hook_address(lib: ctypes.CDLL, which: int) -> int:
    """The address of one of the C++ hooks of CUDA graph capture (0 begin, 1 end, 2 release),
    for both install paths."""
    get = lib.gpumem_torch_pool_hook_address
    get.restype = ctypes.c_size_t
    get.argtypes = [ctypes.c_int]
    addr = int(get(which))
    if not addr:
        raise GpumemError(f"gpumem._native has no CUDA graph hook {which}")
    return addr


def _bind_torch_oom(torch: Any) -> Optional[str]:
    """Make gpumem's out-of-memory errors torch.cuda.OutOfMemoryError. Returns why not."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    attempts = [
        (os.path.join(lib_dir, "libc10.so"), os.path.join(lib_dir, "libc10_cuda.so")),
        ("libc10.so", "libc10_cuda.so"),  # by soname, as libtorch loaded them
    ]
    problems = []
    for libc10, libc10_cuda in attempts:
        try:
            _native.torch_bind_c10(libc10, libc10_cuda)
            return None
        except GpumemError as e:
            problems.append(str(e))
    return "; ".join(problems)


def install(
    conf: Optional[str] = None, *, patch_torch: bool = True, native: Optional[bool] = None
) -> None:
    """Make gpumem PyTorch's CUDA allocator for this process.

    Must be called before PyTorch initializes CUDA (before the first CUDA tensor,
    ``torch.cuda.init()``, ``torch.cuda.set_device()``...): PyTorch cannot change allocators
    once its own has been initialized. Calling it again with the same configuration does
    nothing.

    Args:
        conf: configuration such as ``"policy:stitched,fraction:0.9"``; ``None`` reads the
            ``GPUMEM_CONF`` environment variable (and uses the defaults when it is unset).
        patch_torch: also point ``torch.cuda.memory_stats``, ``memory_stats_as_nested_dict``,
            ``reset_peak_memory_stats``, ``reset_accumulated_memory_stats``,
            ``memory_summary``, ``memory_snapshot``,
            ``get_per_process_memory_fraction`` and ``torch.cuda.memory._snapshot``/``_dump_snapshot``/``_record_memory_history`` at
            gpumem's versions (which the helpers ``memory_allocated``,
            ``max_memory_reserved``... use), since PyTorch's raise under a pluggable
            allocator.
        native: plug gpumem in as a subclass of PyTorch's ``CUDAAllocator``, compiled on
            first use against the PyTorch at hand (``torch.utils.cpp_extension``: needs a C++
            compiler, ninja and the CUDA toolkit's headers; about a minute, then cached),
            instead of through ``torch.cuda.memory.CUDAPluggableAllocator``. The pluggable
            allocator keeps a map from every pointer to its size, device and stream under a
            mutex, which costs about as much per call as PyTorch's own allocator; the native
            one calls gpumem and nothing else. It also answers what the pluggable one cannot:
            ``cacheInfo`` (cuDNN's benchmark mode), c10's statistics (``torch._C`` reads
            gpumem's), out-of-memory observers
            (``torch._C._cuda_attach_out_of_memory_observer``), ``torch.cuda.MemPool`` and
            ``torch.compile(mode="reduce-overhead")``, whose CUDA graph trees checkpoint and
            restore their pool. ``None`` reads
            ``GPUMEM_TORCH_NATIVE`` (``1`` or ``0``; unset: the pluggable allocator).

    Raises:
        GpumemError: PyTorch is missing or has no CUDA, CUDA was already initialized by
            PyTorch's own allocator, gpumem was installed with another configuration or the
            other way (``native``), or the native allocator could not be built.
        ValueError: ``conf`` is not a valid configuration.
    """
    global _installed
    use_native = _native_wanted(native)
    with _lock:
        if _installed is not None:
            wanted = conf if conf is not None else os.environ.get("GPUMEM_CONF", "")
            if wanted != _installed["conf"]:
                raise GpumemError(
                    f"gpumem is already PyTorch's allocator with configuration "
                    f"{_installed['conf']!r}; it cannot be reinstalled with {wanted!r}"
                )
            if native is not None and _mode(use_native) != _installed["mode"]:
                raise GpumemError(
                    f"gpumem is already PyTorch's allocator through the {_installed['mode']} "
                    f"path; it cannot be reinstalled with native={native}"
                )
            return
        try:
            import torch
        except ImportError as e:
            raise GpumemError(f"gpumem.torch.install() needs PyTorch: {e}") from e
        if not torch.cuda.is_available():
            raise GpumemError(
                "gpumem.torch.install(): PyTorch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda})"
            )
        if torch.cuda.is_initialized():
            held = _native_allocator_holdings(torch)
            raise GpumemError(
                "gpumem.torch.install() must run before PyTorch initializes CUDA, but CUDA is "
                f"already initialized{held}. Call it first thing in the program, right after "
                "`import torch` and before any tensor is created on the GPU (or "
                "torch.cuda.init()/set_device() is called)."
            )
        conf_text = _native.torch_configure(conf)
        so_path = _native_library_path()
        lib = ctypes.CDLL(so_path)
        if use_native:
            # Built before anything else: a build error leaves PyTorch's allocator in place.
            allocator: Any = _build_native_allocator(torch)
        else:
            allocator = torch.cuda.memory.CUDAPluggableAllocator(so_path, _ALLOC_FN, _FREE_FN)
            raw = allocator.allocator()
            hooks = [(setter, _function_address(lib, fn)) for fn, setter in _HOOKS]
            # CUDA graph capture: private pools for the capture's streams.
            hooks += [(setter, _pool_hook_address(lib, w)) for w, setter in _POOL_HOOKS]
            for setter, address in hooks:
                set_fn = getattr(raw, setter, None)
                if set_fn is None:
                    raise GpumemError(
                        f"this PyTorch ({torch.__version__}) has no "
                        f"CUDAPluggableAllocator.{setter}; gpumem needs it (PyTorch >= 2.3)"
                    )
                set_fn(address)
        oom_problem = _bind_torch_oom(torch)
        if use_native:
            _switch_to_native(allocator, lib)
        else:
            try:
                torch.cuda.memory.change_current_allocator(allocator)
            except RuntimeError as e:
                raise GpumemError(
                    f"PyTorch refused to switch to gpumem ({e}); call gpumem.torch.install() "
                    "before anything initializes CUDA"
                ) from e
        if oom_problem is not None:
            warnings.warn(
                "gpumem: out-of-memory errors will be raised as RuntimeError, not "
                f"torch.cuda.OutOfMemoryError, because c10's exception could not be bound: "
                f"{oom_problem}",
                RuntimeWarning,
                stacklevel=2,
            )
        elif not _native.torch_profiler_bound():
            warnings.warn(
                "gpumem: torch.profiler will not see gpumem's allocations: this PyTorch's "
                "libc10 does not export c10::memoryProfilingEnabled and "
                "c10::reportMemoryUsageToProfiler under the names gpumem binds",
                RuntimeWarning,
                stacklevel=2,
            )
        _installed = {
            "conf": conf_text,
            "mode": _mode(use_native),
            "allocator": allocator,
            "library": lib,
            "oom_problem": oom_problem,
        }
        if patch_torch:
            _patch_torch(torch)
            if not use_native:
                _explain_missing_checkpoints(torch)


# What torch.compile(mode="reduce-overhead")'s CUDA graph trees call on a pool, which PyTorch's
# pluggable wrapper cannot answer ("does not yet support ..."), and gpumem's native path does.
_CHECKPOINT_CALLS = (
    "_cuda_getCheckpointState",
    "_cuda_setCheckpointPoolState",
    "_cuda_checkPoolLiveAllocations",
)


def _explain_missing_checkpoints(torch: Any) -> None:
    """On the pluggable path, makes torch._C's pool-checkpoint calls raise an error that says
    how to get them (they raise PyTorch's bare "does not yet support" otherwise)."""

    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            raise RuntimeError(
                f"gpumem: {name} is not available through PyTorch's pluggable allocator, which "
                "has no checkpoints of a CUDA graph pool; torch.compile(mode=\"reduce-overhead\") "
                "needs them. Call gpumem.torch.install(native=True) (or set "
                "GPUMEM_TORCH_NATIVE=1) instead"
            )

        return call

    for name in _CHECKPOINT_CALLS:
        if hasattr(torch._C, name):
            setattr(torch._C, name, refuse(name))


def _flag(name: str, value: Any) -> bool:
    """A yes/no argument: a bool (or the integers 0 and 1). A string such as ``"false"`` is
    refused rather than read as true, which ``bool()`` would do."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {value!r}")


def _native_wanted(native: Optional[bool]) -> bool:
    """``install``'s ``native`` argument, or ``GPUMEM_TORCH_NATIVE`` when it is None."""
    if native is not None:
        return _flag("native", native)
    text = os.environ.get(_NATIVE_ENV, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise GpumemError(f"{_NATIVE_ENV}={text!r}: expected 1 or 0")


def _mode(native: bool) -> str:
    return "native" if native else "pluggable"


def _native_build_dir(torch: Any) -> str:
    """Where the native allocator is built: ``GPUMEM_NATIVE_BUILD_DIR``, else a folder of
    gpumem's cache per PyTorch version (cpp_extension rebuilds when the source changes)."""
    explicit = os.environ.get("GPUMEM_NATIVE_BUILD_DIR")
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = "".join(c if c.isalnum() or c in ".-_" else "_" for c in str(torch.__version__))
    return os.path.join(cache, "gpumem", f"torch-{tag}")


def _build_native_allocator(torch: Any) -> ctypes.CDLL:
    """Compiles (or loads the cached build of) csrc/torch_allocator.cpp against this
    PyTorch, without initializing CUDA."""
    if not os.path.exists(_NATIVE_SOURCE):
        raise GpumemError(f"gpumem's native allocator source is missing: {_NATIVE_SOURCE}")
    from torch.utils.cpp_extension import load

    build_dir = _native_build_dir(torch)
    try:
        os.makedirs(build_dir, exist_ok=True)
    except OSError as e:
        raise GpumemError(
            f"cannot make the native allocator's build folder {build_dir}: {e} "
            "(GPUMEM_NATIVE_BUILD_DIR chooses another)"
        ) from e
    name = "gpumem_torch_allocator"
    if not os.path.exists(os.path.join(build_dir, f"{name}.so")):
        print(
            f"gpumem: compiling the native PyTorch allocator into {build_dir} "
            "(once per PyTorch version; about a minute)",
            file=sys.stderr,
            flush=True,
        )
    # Unless TORCH_CUDA_ARCH_LIST is set, cpp_extension asks every visible GPU for its
    # architecture, which initializes CUDA, after which PyTorch refuses the switch. The source
    # has no device code, so any architecture will do.
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not saved:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        path = load(
            name=name,
            sources=[_NATIVE_SOURCE],
            extra_cflags=["-O2"],
            with_cuda=True,
            is_python_module=False,
            build_directory=build_dir,
            verbose=False,
        )
    except Exception as e:
        raise GpumemError(
            f"could not build gpumem's native PyTorch allocator ({type(e).__name__}: {e}); it "
            "needs a C++ compiler, ninja and the CUDA toolkit (CUDA_HOME). "
            "install(native=False) uses PyTorch's pluggable allocator instead"
        ) from e
    finally:
        if not saved:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    if torch.cuda.is_initialized():
        raise GpumemError(
            "building gpumem's native allocator initialized CUDA, so PyTorch would refuse it; "
            "use install(native=False)"
        )
    return ctypes.CDLL(path)


def _native_hook_addresses(lib: ctypes.CDLL) -> List[int]:
    """The addresses gpumem_native_install takes, in its order: the exported hooks, then the
    C++ hooks of CUDA graph capture."""
    return [_function_address(lib, n) for n in _NATIVE_HOOKS] + [
        _pool_hook_address(lib, w) for w, _ in _POOL_HOOKS
    ]


def _switch_to_native(nat: ctypes.CDLL, lib: ctypes.CDLL) -> None:
    """Makes the built native allocator PyTorch's; it calls gpumem._native's hooks."""
    addrs = _native_hook_addresses(lib)
    nat.gpumem_native_install.restype = ctypes.c_int
    nat.gpumem_native_install.argtypes = [
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    err = ctypes.create_string_buffer(1024)
    table = (ctypes.c_size_t * len(addrs))(*addrs)
    if nat.gpumem_native_install(table, len(addrs), err, len(err)) != 0:
        raise GpumemError(
            f"gpumem's native allocator could not be installed "
            f"({err.value.decode(errors='replace')}); PyTorch refuses it once anything has "
            "initialized CUDA, so call gpumem.torch.install() first"
        )


def _native_allocator_holdings(torch: Any) -> str:
    try:
        reserved = torch.cuda.memory_reserved()
    except Exception:  # another pluggable allocator: no statistics
        return ""
    if reserved:
        return f" and PyTorch's own allocator already holds {reserved} bytes"
    return ""


def is_installed() -> bool:
    """Whether gpumem is PyTorch's allocator in this process."""
    return _installed is not None


def install_mode() -> Optional[str]:
    """How gpumem is plugged into PyTorch: ``"native"`` (``install(native=True)``),
    ``"pluggable"`` (``torch.cuda.memory.CUDAPluggableAllocator``), or None before
    :func:`install`."""
    return None if _installed is None else _installed["mode"]


def conf() -> Optional[str]:
    """The configuration text gpumem's PyTorch allocators use (None before install())."""
    return _native.torch_conf()


def _device_index(device: DeviceLike) -> int:
    """A device index from None (the current device), an int, "cuda:N" or a torch.device."""
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        return 0
    if isinstance(device, bool):
        raise TypeError("device must be an int, a string like 'cuda:1', or a torch.device")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise ValueError(f"expected a CUDA device such as 'cuda' or 'cuda:1', got {device!r}")
        return int(index) if index else _device_index(None)
    kind = getattr(device, "type", None)
    if kind is not None:
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        index = getattr(device, "index", None)
        return _device_index(None) if index is None else int(index)
    raise TypeError(f"cannot interpret {device!r} as a CUDA device")


def memory_stats(device: DeviceLike = None) -> "collections.OrderedDict[str, int]":
    """``torch.cuda.memory_stats()`` for gpumem: the same keys, sorted, with the same meanings.

    ``reserved_bytes`` is the memory gpumem holds from the driver (plain segments or mapped
    physical pages); ``allocated_bytes`` the blocks handed to tensors; ``requested_bytes`` the
    sizes the tensors asked for. With several streams allocating, block peaks are summed over
    streams (an upper bound); ``reserved_bytes`` peaks are exact.
    """
    return collections.OrderedDict(_native.torch_memory_stats(_device_index(device)))


def memory_stats_as_nested_dict(device: DeviceLike = None) -> Dict[str, Any]:
    """``torch.cuda.memory_stats_as_nested_dict()`` for gpumem."""
    nested: Dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        parts = key.split(".")
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return nested


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes of live tensors on ``device`` (after rounding)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: DeviceLike = None) -> int:
    """Peak of :func:`memory_allocated` since the last peak reset."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: DeviceLike = None) -> int:
    """Bytes gpumem holds from the driver on ``device``."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: DeviceLike = None) -> int:
    """Peak of :func:`memory_reserved` since the last peak reset."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Sets every peak statistic of ``device`` to its current value."""
    _native.torch_reset_peak_memory_stats(_device_index(device))


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    """Zeroes the ``allocated``/``freed`` totals and the counters (``num_ooms``...) of
    ``device``'s statistics; current values and peaks stay."""
    _native.torch_reset_accumulated_memory_stats(_device_index(device))


def memory_summary(device: DeviceLike = None, abbreviated: bool = False) -> str:
    """A text table of ``device``'s statistics in the layout of ``torch.cuda.memory_summary()``:
    the same rows (allocated, active, requested, GPU reserved and non-releasable memory,
    allocations, active allocs, GPU reserved segments, non-releasable allocs, oversize
    allocations and segments), the same columns (current, peak, total allocated, total
    freed) and units. ``abbreviated`` keeps only the all-pools row of each metric, as
    PyTorch's does."""
    return _native.torch_memory_summary(_device_index(device), _flag("abbreviated", abbreviated))


def memory_stats_json(device: DeviceLike = None) -> str:
    """``device``'s statistics as JSON text, for logs and dashboards:
    ``{"stats": {...}, "flat": {...}}``, the statistics nested by metric and pool
    (``stats["allocated_bytes"]["all"]["peak"]``) and flat under
    :func:`memory_stats`'s names."""
    return _native.torch_memory_stats_json(_device_index(device))


def snapshot(device: DeviceLike = None) -> Dict[str, Any]:
    """A dict shaped like ``torch.cuda.memory._snapshot()`` for ``device``: ``segments``
    (what gpumem holds, with its blocks), ``device_traces`` (the allocation history),
    ``allocator_settings`` and ``external_annotations``; readable by
    ``torch.cuda._memory_viz`` and PyTorch's memory visualizer.

    The history is recorded once :func:`record_memory_history` (or ``history:N`` in the
    configuration) turned it on before gpumem's first allocation; without it
    ``device_traces`` is empty. Before gpumem allocated on ``device`` the snapshot is empty.
    """
    return _native.torch_snapshot(_device_index(device))


def memory_snapshot(device: DeviceLike = None) -> List[Dict[str, Any]]:
    """The ``segments`` list of :func:`snapshot`, like ``torch.cuda.memory_snapshot()``."""
    return snapshot(device)["segments"]


def dump_snapshot(path: str = "dump_snapshot.pickle", device: DeviceLike = None) -> None:
    """Writes :func:`snapshot` as a pickle, gzipped when ``path`` ends in ``.gz`` (open it
    with ``python -m torch.cuda._memory_viz`` or pytorch.org/memory_viz)."""
    _native.torch_dump_snapshot(_device_index(device), os.fspath(path))


def record_memory_history(
    enabled: Union[bool, str, None] = True,
    *,
    max_entries: int = 100_000,
    stacks: bool = True,
) -> None:
    """Records the allocation history that :func:`snapshot` carries in ``device_traces``
    (like ``torch.cuda.memory._record_memory_history``): the last ``max_entries`` events
    (allocations, frees, segments mapped and released, out-of-memory errors), with the stack
    of each allocation when ``stacks`` (native frames: PyTorch releases the interpreter
    before it allocates, so gpumem cannot see the Python caller).

    gpumem's engine fixes these settings when it creates the allocator of a device, on the
    first allocation there: call this before any tensor is created on the GPU (before or
    after :func:`install`). The same settings come from the configuration:
    ``GPUMEM_CONF=history:100000,backtraces:1``. They apply to every device.

    Args:
        enabled: ``True`` (or PyTorch's ``"all"``) to record; ``False``/``None`` not to.
        max_entries: events kept (older ones are dropped).
        stacks: capture a stack at each allocation (costs time on every allocation).

    Raises:
        GpumemError: gpumem already allocates with other history settings (asking for what
            is in force does nothing).
        ValueError: an ``enabled`` gpumem does not support (``"state"``).

    Stopping a history that is already recording cannot be done; it warns and goes on.
    """
    if enabled is None or enabled is False:
        entries = 0
    elif enabled is True or enabled == "all":
        entries = _entries(max_entries)
    elif enabled == "state":
        raise ValueError(
            "gpumem records no 'state'-only history; use enabled=True (\"all\") for the "
            "history with stacks, or leak_check:1,backtraces:1 for the stacks of live "
            "allocations (gpumem.torch.leak_report())"
        )
    else:
        raise ValueError(f"enabled must be True, False, None or 'all', not {enabled!r}")
    warning = _native.torch_record_memory_history(entries, _flag("stacks", stacks) and entries > 0)
    if warning is not None:
        warnings.warn(warning, RuntimeWarning, stacklevel=2)


def _entries(max_entries: Any) -> int:
    if isinstance(max_entries, bool) or not isinstance(max_entries, int):
        raise TypeError("max_entries must be an int")
    if max_entries <= 0:
        raise ValueError(f"max_entries must be positive, not {max_entries}")
    return max_entries


def leak_report(device: DeviceLike = None) -> "LeakReport":
    """What is still allocated by gpumem on ``device``: a :class:`gpumem.LeakReport` (prints
    as tables; ``.allocations`` and ``.sites`` hold the data). Sizes, streams and addresses
    are always there; ages and call sites need leak tracking (``GPUMEM_LEAK_CHECK=1``, or
    ``leak_check:1,backtraces:1`` in the configuration)."""
    from .leaks import LeakReport

    return LeakReport(_native.torch_leak_report(_device_index(device)))


def empty_cache() -> int:
    """Returns the cached memory of every device to the driver (``torch.cuda.empty_cache()``
    does the same once gpumem is installed). Returns the bytes released."""
    return _native.torch_empty_cache()


def set_memory_fraction(fraction: float, device: DeviceLike = None) -> None:
    """Caps the memory gpumem may hold on ``device`` at ``fraction`` of it (0 to 1); a request
    beyond the cap raises an out-of-memory error. Same as
    ``torch.cuda.set_per_process_memory_fraction`` once gpumem is installed."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError("fraction must be a float")
    if not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"invalid fraction {fraction}: expected 0 <= fraction <= 1")
    _native.torch_set_memory_fraction(float(fraction), _device_index(device))


def memory_fraction(device: DeviceLike = None) -> float:
    """The cap on ``device`` as a fraction of it (1.0 without one): what
    :func:`set_memory_fraction` or ``fraction:`` in the configuration set. Same as
    ``torch.cuda.get_per_process_memory_fraction`` once gpumem is installed."""
    return float(_native.torch_memory_fraction(_device_index(device)))


def error_counts() -> Dict[str, int]:
    """Misuse the allocator reported on stderr instead of raising (it runs inside PyTorch's
    deleters, where an exception would end the process): ``foreign_frees`` (frees of memory
    gpumem did not allocate), ``double_frees``, ``free_errors``, ``record_stream_foreign``
    (``record_stream`` on memory that is not gpumem's, ignored as PyTorch ignores it),
    ``other_errors`` and ``wrong_device_frees`` (frees naming another device than the block's,
    which gpumem frees where the block lives)."""
    return dict(_native.torch_error_counts())


def driver_calls(device: DeviceLike = None) -> Dict[str, Dict[str, float]]:
    """The driver calls gpumem made on ``device`` so far, by CUDA name: ``calls``, ``pages``
    covered, and ``seconds`` of host wall time measured around the calls (an event
    synchronisation's seconds are time the host waited for the GPU)."""
    raw = _native.torch_driver_calls(_device_index(device))
    return {k: {"calls": n, "pages": p, "seconds": s} for k, (n, p, s) in raw.items()}


def time_hooks(on: bool = True) -> None:
    """Switches on (or off) the timing of PyTorch's calls into gpumem: every allocation, free
    and ``record_stream``, on every device and thread, driver calls included. The totals
    (``hook_time()``) are kept when it is switched off. Costs two clock reads per call (tens of
    nanoseconds), so it is off until asked for."""
    _native.torch_time_hooks(_flag("on", on))


def hook_time() -> Dict[str, Dict[str, float]]:
    """Host time spent inside PyTorch's calls into gpumem while ``time_hooks()`` was on, by
    hook (``alloc``, ``free``, ``record_stream``): ``calls`` timed and ``seconds`` inside
    them, since the process started. The difference of two readings around a training step
    is what gpumem added to that step's host work."""
    raw = _native.torch_hook_time()
    return {k: {"calls": n, "seconds": s} for k, (n, s) in raw.items()}


def policy_notes(device: DeviceLike = None) -> List[str]:
    """What gpumem's policy on ``device`` changed on its own so far, one line each: for
    instance the stitched policy's streams no longer taking each other's idle pages, once
    moving them cost more than ``trade_budget`` of the time, its spare pages raised once
    remapping cost more than ``remap_budget``, or pages it made instead of remaps once several
    streams shared a range (``shared_spare``). Empty if nothing changed."""
    return list(_native.torch_policy_notes(_device_index(device)))


def devices() -> List[int]:
    """Devices on which gpumem has an allocator (one per device, created on first use)."""
    return list(_native.torch_devices())


def oom_exception() -> str:
    """The C++ exception out-of-memory failures are thrown as: ``"c10::OutOfMemoryError"``
    (Python sees ``torch.cuda.OutOfMemoryError``) once install() bound it, else
    ``"gpumem::OutOfMemoryError"`` (Python sees ``RuntimeError``)."""
    return _native.torch_oom_exception()


def _patch_torch(torch: Any) -> None:
    """Points PyTorch's statistics functions, which raise under a pluggable allocator, at
    gpumem's."""

    def _snapshot(device: DeviceLike = None, augment_with_fx_traces: bool = False) -> Dict[str, Any]:
        del augment_with_fx_traces
        return snapshot(device)

    def _dump_snapshot(filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
        del augment_with_fx_traces
        dump_snapshot(filename)

    def _memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> List[Dict[str, Any]]:
        del mempool_id, include_traces
        return memory_snapshot(None)

    def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        # PyTorch's dispatch: a bool takes the legacy signature, anything else the current one.
        # Either's arguments are checked by its signature (a misspelt keyword is a TypeError).
        if isinstance(enabled, bool):
            _history_legacy(enabled, *args, **kwargs)
        else:
            _history_current(enabled, *args, **kwargs)

    def _history_current(
        enabled: Optional[str] = "all",
        context: Optional[str] = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: DeviceLike = None,
        clear_history: bool = False,
        compile_context: bool = False,
        global_record_annotations: bool = False,
        skip_actions: Optional[List[str]] = None,
    ) -> None:
        # gpumem's history covers every device (`device` is ignored), and it records stacks at
        # allocations ("alloc"): any context but None asks for them.
        del device
        if context not in (None, "state", "alloc", "all"):
            raise ValueError(f"context must be None, 'state', 'alloc' or 'all', not {context!r}")
        if stacks not in ("python", "all"):
            raise ValueError(f"stacks must be 'python' or 'all', not {stacks!r}")
        _history_unsupported(clear_history, compile_context, global_record_annotations, skip_actions)
        record_memory_history(enabled, max_entries=max_entries, stacks=context is not None)

    def _history_legacy(
        enabled: bool,
        record_context: bool = True,
        trace_alloc_max_entries: int = 1,
        trace_alloc_record_context: bool = False,
        device: DeviceLike = None,
        record_context_cpp: bool = False,
        clear_history: bool = False,
        compile_context: bool = False,
        global_record_annotations: bool = False,
        skip_actions: Optional[List[str]] = None,
    ) -> None:
        # PyTorch's older form: the history keeps trace_alloc_max_entries events (1 unless
        # given), with stacks when record_context.
        del trace_alloc_record_context, device, record_context_cpp
        _history_unsupported(clear_history, compile_context, global_record_annotations, skip_actions)
        record_memory_history(
            enabled, max_entries=trace_alloc_max_entries, stacks=_flag("record_context", record_context)
        )

    def _history_unsupported(clear: bool, compile_context: bool, annotations: bool, skip: Any) -> None:
        asked = [
            name
            for name, value in (
                ("clear_history", clear),
                ("compile_context", compile_context),
                ("global_record_annotations", annotations),
                ("skip_actions", skip),
            )
            if value
        ]
        if asked:
            warnings.warn(
                f"gpumem's allocation history does not support {', '.join(asked)}; ignored",
                RuntimeWarning,
                stacklevel=3,
            )

    replacements = {
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "memory_summary": memory_summary,
        "memory_snapshot": _memory_snapshot,
        "_snapshot": _snapshot,
        "_dump_snapshot": _dump_snapshot,
        "_record_memory_history": _record_memory_history,
        "get_per_process_memory_fraction": memory_fraction,
    }
    for module in (torch.cuda.memory, torch.cuda):
        for name, fn in replacements.items():
            if hasattr(module, name):
                setattr(module, name, fn)
