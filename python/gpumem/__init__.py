"""gpumem: a GPU memory manager.

A caching device-memory pool written in Rust, with several placement policies (the default,
``stitched``, maps 2 MiB physical pages wherever a block needs them, so freed memory is never
stranded by fragmentation). Two ways to use it from Python:

- as PyTorch's CUDA allocator::

      import gpumem
      gpumem.torch.install()          # before the first CUDA tensor

- directly, without PyTorch, over a CUDA device or a simulated one::

      alloc = gpumem.Allocator(device="sim")
      ptr = alloc.allocate(3 << 20)
      alloc.free(ptr)

Configuration strings (``conf=`` or the ``GPUMEM_CONF`` environment variable) look like
``"policy:stitched,fraction:0.9"``; see docs/pytorch.md.

Diagnostics: ``memory_summary()``, ``snapshot()`` and ``leak_report()`` of an allocator (or
``gpumem.torch``'s functions of the same names), ``gpumem.leak_report()``,
``gpumem.testing.assert_no_leaks()``. With ``GPUMEM_LEAK_CHECK=1`` in the environment the
allocations still live at interpreter exit are printed to standard error.
"""

import atexit

from . import testing, torch
from ._native import (
    Allocator,
    DoubleFreeError,
    GpumemError,
    InvalidPointerError,
    InvalidSizeError,
    OutOfMemoryError,
    __version__,
    cuda_device_count,
)
from .leaks import LeakReport, _check_at_exit, leak_report

# With GPUMEM_LEAK_CHECK=1, prints what every allocator still has allocated when the
# interpreter exits; does nothing without it.
atexit.register(_check_at_exit)

__all__ = [
    "Allocator",
    "DoubleFreeError",
    "GpumemError",
    "InvalidPointerError",
    "InvalidSizeError",
    "LeakReport",
    "OutOfMemoryError",
    "__version__",
    "cuda_device_count",
    "leak_report",
    "testing",
    "torch",
]
