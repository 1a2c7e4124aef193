"""ignite, imported without importing ``torch.distributed.optim`` with it.

``import ignite`` runs ``ignite.handlers.checkpoint``, whose first lines import
``ZeroRedundancyOptimizer`` from ``torch.distributed.optim``; that module imports FSDP and
DTensor's operator tables: about 0.9 s of every process's start (a third of ``import unison``),
for one ``isinstance`` check in ignite's own ``Checkpoint``, in runs that never use ZeRO.

While ignite is imported here, ``torch.distributed.optim`` is a stand-in whose
``ZeroRedundancyOptimizer`` is :class:`DeferredZero`: no object is an instance of it until the
real module has been imported (an object of that class cannot exist before its module does),
and from then on it answers as the real class does. The stand-in leaves ``sys.modules`` as soon
as ignite is imported, so any later ``import torch.distributed.optim`` imports the real module;
a name of it other than the optimizer, asked for while the stand-in is in place, imports the
real module too. When ignite or ``torch.distributed.optim`` is already imported, nothing is
deferred.
"""

from __future__ import annotations

import sys
import types
from typing import Any

_OPTIM = "torch.distributed.optim"


def _real_zero() -> type | None:
    """The real ``ZeroRedundancyOptimizer``, once its module is imported; else None."""
    module = sys.modules.get(_OPTIM)
    if module is None or isinstance(module, _StandIn):
        return None
    return getattr(module, "ZeroRedundancyOptimizer", None)


class _DeferredMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        real = _real_zero()
        return real is not None and isinstance(obj, real)

    def __subclasscheck__(cls, sub: type) -> bool:
        real = _real_zero()
        return real is not None and issubclass(sub, real)


class DeferredZero(metaclass=_DeferredMeta):
    """Stands for ``torch.distributed.optim.ZeroRedundancyOptimizer`` in ignite's ``Checkpoint``:
    ``isinstance(obj, DeferredZero)`` is ``isinstance(obj, ZeroRedundancyOptimizer)``, answered
    without importing that module before anything else has."""


class _StandIn(types.ModuleType):
    """``torch.distributed.optim`` while ignite is imported: the optimizer deferred, any other name real."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system's own questions (__path__, __spec__...): not a package
            raise AttributeError(name)
        if sys.modules.get(_OPTIM) is self:
            del sys.modules[_OPTIM]
        import importlib

        return getattr(importlib.import_module(_OPTIM), name)


def import_ignite() -> None:
    """Imports ignite with ``torch.distributed.optim`` deferred (see the module's docstring)."""
    if "ignite.handlers.checkpoint" in sys.modules or _OPTIM in sys.modules:
        return
    import torch.distributed

    if not torch.distributed.is_available():  # ignite then goes without ZeRO by itself
        return
    stand_in = _StandIn(_OPTIM)
    stand_in.ZeroRedundancyOptimizer = DeferredZero  # type: ignore[attr-defined]
    sys.modules[_OPTIM] = stand_in
    try:
        import ignite.handlers.checkpoint  # noqa: F401
    finally:
        if sys.modules.get(_OPTIM) is stand_in:
            del sys.modules[_OPTIM]


import_ignite()
