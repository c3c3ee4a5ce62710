"""Helpers for tests of programs that use gpumem (pytest or any other runner).

::

    import gpumem, gpumem.testing

    def test_step_frees_what_it_allocates():
        alloc = gpumem.Allocator(conf="leak_check:1,backtraces:1")
        run_step(alloc)
        gpumem.testing.assert_no_leaks(alloc)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .leaks import leak_report

if TYPE_CHECKING:  # pragma: no cover
    from ._native import Allocator

__all__ = ["assert_no_leaks"]


def assert_no_leaks(allocator: Optional["Allocator"] = None, *, device: Any = None) -> None:
    """Raises ``AssertionError`` with the leak report if anything is still allocated.

    ``allocator``: a :class:`gpumem.Allocator`. Without it, gpumem's PyTorch allocator of
    ``device``, or, when ``device`` is None too, of every device gpumem serves.

    The report names each live allocation's size, address and stream; with leak tracking
    (``leak_check:1,backtraces:1`` or ``GPUMEM_LEAK_CHECK=1``) also its age and call site.
    """
    if allocator is not None or device is not None:
        reports = [("", leak_report(allocator, device=device))]
    else:
        from . import torch as _torch

        reports = [(f"device {d}: ", _torch.leak_report(d)) for d in _torch.devices()]
    leaked = [(label, r) for label, r in reports if len(r)]
    if leaked:
        text = "\n".join(f"{label}{r}" for label, r in leaked)
        raise AssertionError(f"gpumem: allocations leaked:\n{text}")
