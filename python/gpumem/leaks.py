"""Leak reports: what gpumem still has allocated, and where it was allocated from.

``gpumem.leak_report(allocator)`` (or ``gpumem.torch.leak_report(device)``) returns a
:class:`LeakReport`. With ``GPUMEM_LEAK_CHECK=1`` in the environment every allocator tracks its
live allocations with their stacks, and the report of each one still holding memory is printed
to standard error when the interpreter exits.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from . import _native

if TYPE_CHECKING:  # pragma: no cover
    from ._native import Allocator

__all__ = ["LeakReport", "leak_report"]


class LeakReport:
    """The live allocations of one allocator, grouped by call site.

    ``str(report)`` is the printed report (a table of call sites, then the allocations, oldest
    first); ``len(report)`` the number of live allocations, so ``if report:`` means "something
    is still allocated".

    Attributes:
        allocations: one dict per live allocation: ``addr``, ``size`` (bytes asked for),
            ``stream``, ``age_s`` (seconds, None when not tracked), ``site`` (the call site)
            and ``frames`` (``filename``, ``line``, ``name``; innermost first).
        sites: one dict per call site: ``site``, ``count``, ``bytes``, ``oldest_age_s``,
            ``streams``; most bytes first.
        total_bytes: bytes live (as asked for).
        tracked: whether live allocations were tracked (ages and call sites known).
        backtraces: whether their stacks were recorded.
        text: the printed report.
    """

    def __init__(self, data: Dict[str, Any]) -> None:
        self.text: str = data["text"]
        self.tracked: bool = data["tracked"]
        self.backtraces: bool = data["backtraces"]
        self.total_bytes: int = data["total_bytes"]
        self.sites: List[Dict[str, Any]] = data["sites"]
        self.allocations: List[Dict[str, Any]] = data["allocations"]

    def __len__(self) -> int:
        return len(self.allocations)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return (
            f"<gpumem.LeakReport: {len(self.allocations)} live allocations, "
            f"{self.total_bytes} bytes, {len(self.sites)} call sites>"
        )

    def to_dict(self) -> Dict[str, Any]:
        """The report's data (what the attributes hold), for JSON."""
        return {
            "tracked": self.tracked,
            "backtraces": self.backtraces,
            "total_bytes": self.total_bytes,
            "sites": self.sites,
            "allocations": self.allocations,
        }


def leak_report(allocator: Optional["Allocator"] = None, *, device: Any = None) -> LeakReport:
    """What ``allocator`` (a :class:`gpumem.Allocator`) still has allocated; without one, what
    gpumem's PyTorch allocator of ``device`` has (see :func:`gpumem.torch.leak_report`).

    The call site of an allocation made through ``gpumem.Allocator.allocate`` is its Python
    caller; ages and call sites need ``leak_check:1,backtraces:1`` in the allocator's
    configuration, or ``GPUMEM_LEAK_CHECK=1`` in the environment."""
    if allocator is not None:
        if device is not None:
            raise TypeError("give an allocator or a device, not both")
        if not hasattr(allocator, "leak_report"):
            raise TypeError(
                f"allocator must be a gpumem.Allocator, not {type(allocator).__name__}; "
                f"for a device of gpumem's PyTorch allocator, pass device={allocator!r}"
            )
        return LeakReport(allocator.leak_report())
    from . import torch as _torch

    return _torch.leak_report(device)


def _check_at_exit() -> None:
    """Registered with atexit by ``import gpumem``: when ``GPUMEM_LEAK_CHECK=1``, prints to
    standard error the report of every allocator that checks for leaks (all of those created
    under that variable): PyTorch's, one per device, and each ``gpumem.Allocator`` still
    alive. Allocators dropped earlier gave all their memory back with them."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):  # closed or replaced streams
            pass
    _native.leak_check_at_exit_native()
