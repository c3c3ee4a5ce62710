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
"""

from . import torch
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

__all__ = [
    "Allocator",
    "DoubleFreeError",
    "GpumemError",
    "InvalidPointerError",
    "InvalidSizeError",
    "OutOfMemoryError",
    "__version__",
    "cuda_device_count",
    "torch",
]
