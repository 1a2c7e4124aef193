"""Counting host-device synchronisations in a block of code, on the CPU.

On a GPU, reading a tensor's value on the host (``.item()``, ``bool(t)``, ``float(t)``,
``.tolist()``, ``.cpu()``, ``.numpy()``) waits for the device. On the CPU nothing waits,
so these reads are counted instead, where they are requested:

- a ``TorchDispatchMode`` sees every aten op; ``.item()``, ``bool(t)``, ``float(t)``,
  ``int(t)`` and ``t.is_nonzero()`` all reach ``aten._local_scalar_dense`` (or
  ``aten.is_nonzero``) there;
- ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu`` copy on the host without going
  through the dispatcher, so they are patched on ``torch.Tensor`` for the duration.

Usage::

    from _sync_probe import count_host_syncs

    with count_host_syncs() as syncs:
        metric.update((y_pred, y))
    assert syncs.count == 0, syncs.calls

``syncs.calls`` lists the names of the reads in order: ``"aten._local_scalar_dense"``,
``"aten.is_nonzero"``, ``"Tensor.tolist"``, ``"Tensor.numpy"``, ``"Tensor.cpu"``.
``Tensor.cpu`` is counted even on a CPU tensor, where it is free: on a GPU it would not be.

The probe counts in the thread that enters it (dispatch modes are per thread); the
patched methods count in every thread while the block runs. Probes may be nested: the
inner one counts too, and the outer one sees the same reads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncs", "count_host_syncs"]

# aten ops through which a tensor's value reaches the host.
_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default: "aten._local_scalar_dense",
    torch.ops.aten.is_nonzero.default: "aten.is_nonzero",
}
# Tensor methods that copy to the host without an aten op the dispatch mode would see.
_PATCHED_METHODS = ("tolist", "numpy", "cpu")
_MISSING = object()


@dataclass
class HostSyncs:
    """What a :func:`count_host_syncs` block read back to the host."""

    calls: list[str] = field(default_factory=list)
    """Names of the reads, in the order they happened."""

    @property
    def count(self) -> int:
        """How many reads happened."""
        return len(self.calls)


class _SyncOpMode(TorchDispatchMode):
    def __init__(self, record: HostSyncs) -> None:
        super().__init__()
        self._record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = _SYNC_OPS.get(func)
        if name is not None:
            self._record.calls.append(name)
        return func(*args, **(kwargs or {}))


def _counting(name: str, original, record: HostSyncs):  # type: ignore[no-untyped-def]
    @functools.wraps(original)
    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        record.calls.append(f"Tensor.{name}")
        return original(self, *args, **kwargs)

    return counting


@contextlib.contextmanager
def _patched_methods(record: HostSyncs) -> Iterator[None]:
    saved = {name: torch.Tensor.__dict__.get(name, _MISSING) for name in _PATCHED_METHODS}
    for name in _PATCHED_METHODS:
        setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name), record))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Counts the host-device synchronisations requested inside the block.

    Yields:
        A :class:`HostSyncs` that fills up while the block runs; read ``.count`` and
        ``.calls`` after it (or during it).
    """
    record = HostSyncs()
    with _patched_methods(record), _SyncOpMode(record):
        yield record
