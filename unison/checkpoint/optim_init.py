"""torch's optimizer-state initialisation, taken once for an optimizer that keeps no state.

``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` first make sure the optimizer
has its state (``torch.distributed.checkpoint.state_dict._init_optim_state``): when it holds
none and no parameter has a gradient, torch gives every parameter a zero gradient and takes a
step at a learning rate of 0, so that a stateful optimizer that never stepped (Adam) has
tensors to save and to load into. An optimizer whose step keeps no state (SGD without
momentum) never gets any: the zero gradients (as much new memory as the parameters) and the
step came back at every sharded save and twice at every sharded resume, since the trainer
sets gradients to None after each step. A 1 GB model at 2 ranks spent 275 ms of a 925 ms
save there.

:func:`init_once` lets torch's initialisation run as torch has it, and remembers an
optimizer that it left without state, together with the settings it had (every entry of its
parameter groups but the parameters and the learning rate: momentum, ...). While those are
the same, that optimizer's next initialisations are skipped: they would create nothing and
leave the parameters as they are. A changed setting, or any state, and torch's own runs again.
A call while a parameter has a gradient is torch's alone (torch steps nothing then, so it shows
nothing of the optimizer: an Adam saved inside an accumulation window before its first step is
not taken for a stateless one).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["init_once"]

_UNCHANGED = frozenset({"params", "lr", "initial_lr"})
"""Entries of a parameter group that do not decide whether a step creates state."""

_stateless: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, ...]] = weakref.WeakKeyDictionary()
"""Optimizers torch's initialisation left without state, with the settings they had then."""
_lock = threading.Lock()


def settings(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What decides whether ``optimizer``'s step creates state: its groups' sizes and settings.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> sgd = torch.optim.SGD([p], lr=0.1)
        >>> before = settings(sgd)
        >>> sgd.param_groups[0]["lr"] = 0.01
        >>> settings(sgd) == before
        True
        >>> sgd.param_groups[0]["momentum"] = 0.9
        >>> settings(sgd) == before
        False
    """
    return tuple(
        (len(group["params"]), tuple(sorted((k, repr(v)) for k, v in group.items() if k not in _UNCHANGED)))
        for group in optimizer.param_groups
    )


def _once(original: Callable[[torch.optim.Optimizer], None]) -> Callable[[torch.optim.Optimizer], None]:
    def init(optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:  # torch returns at once too
            return
        if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            original(optimizer)  # torch steps nothing then: nothing is learnt of the optimizer
            return
        now = settings(optimizer)
        with _lock:
            if _stateless.get(optimizer) == now:
                return
        original(optimizer)
        if not optimizer.state:
            with _lock:
                _stateless[optimizer] = now

    init.__unison_once__ = True  # type: ignore[attr-defined]
    return init


@contextmanager
def init_once() -> Iterator[None]:
    """Within it, torch's state-dict functions initialise an optimizer's state as torch does,
    except for an optimizer already seen to keep none with its present settings (skipped).

    Torch's own function is put back on leaving, so calls outside unison's checkpoints are as
    torch has them. A torch without ``_init_optim_state`` where unison expects it (see ``unison
    doctor``) is left as it is: every initialisation then runs.
    """
    from torch.distributed.checkpoint import state_dict as module

    original = getattr(module, "_init_optim_state", None)
    if original is None or getattr(original, "__unison_once__", False):  # absent, or already ours
        yield
        return
    module._init_optim_state = _once(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        module._init_optim_state = original
