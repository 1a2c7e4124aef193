"""Counting the collectives a block of code issues, inside a rank of a distributed test.

unison and ignite call collectives as attributes of the ``torch.distributed`` module
(``dist.all_reduce(...)``), looked up at call time, so replacing those attributes with
counting wrappers for the duration of a block sees every call. Collectives that
torch implements with others (``broadcast_object_list`` uses ``broadcast``) count once,
as the call the library made: the wrappers see module attribute lookups only.

Usage, in a function run by ``run_distributed``::

    from _collective_probe import count_collectives

    with count_collectives() as calls:
        evaluator.run(loader)
    return dict(calls)          # {"all_reduce": 1, "broadcast": 0, ...}

Install it after the process group exists and after building what issues no collective
you want counted; every name in :data:`COLLECTIVES` that this torch has is a key of the
counter, so a missing key means "this torch has no such function".
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["COLLECTIVES", "count_collectives"]

COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "_all_gather_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
)
"""Every point-to-point or collective function of ``torch.distributed`` that is counted."""


def _counting(name: str, original: Callable[..., Any], calls: Counter) -> Callable[..., Any]:
    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    return counting


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Counts, by name, the ``torch.distributed`` collectives called inside the block."""
    calls: Counter = Counter()
    saved: dict[str, Callable[..., Any]] = {}
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue
        saved[name] = original
        calls[name] = 0
        setattr(dist, name, _counting(name, original, calls))
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
