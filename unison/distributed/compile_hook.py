"""Whether torch still runs a module's compiled call through ``Module._compiled_call_impl``.

:func:`~unison.distributed.compile_model` compiles in place: ``nn.Module.compile`` stores
the compiled call in the private attribute ``_compiled_call_impl`` (and so does
``compile_model`` for modules of torch's own classes), ``nn.Module.__call__`` runs it when
it is set, and :func:`~unison.distributed.is_compiled` reads it. A torch that renamed the
attribute, or stopped reading it, would train the plain model while every report says
it is compiled. :func:`check_compiled_call_hook` tells, once per process, before a model
is compiled, and refuses to go on silently.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


class CompiledCallChanged(RuntimeError):
    """torch no longer compiles a module in place through ``Module._compiled_call_impl``."""


@functools.cache
def compiled_call_problem() -> str | None:
    """What torch does differently from what in-place compiling relies on, or None.

    Checks that ``nn.Module.__call__`` runs a callable stored in ``_compiled_call_impl``
    instead of the module's own call, that removing it restores the plain call, and that
    ``nn.Module.compile`` stores its result there. Compiles nothing (no dynamo import).
    """
    module = nn.Identity()
    marker = torch.zeros(1)
    seen: list[Any] = []

    def compiled(*args: Any, **kwargs: Any) -> Any:
        seen.append(args)
        return marker

    try:
        module._compiled_call_impl = compiled
        result = module(torch.ones(1))
        del module._compiled_call_impl
        plain = module(torch.ones(1))
    except Exception as err:  # an attribute refused or a call that fails: the mechanism changed
        return f"setting nn.Module._compiled_call_impl fails ({type(err).__name__}: {err})"
    if result is not marker or len(seen) != 1:
        return "nn.Module.__call__ no longer runs the callable stored in _compiled_call_impl"
    if plain is marker or len(seen) != 1:
        return "nn.Module.__call__ still runs a compiled call after _compiled_call_impl was removed"
    if "_compiled_call_impl" not in nn.Module.compile.__code__.co_names:
        return "nn.Module.compile no longer stores the compiled call in _compiled_call_impl"
    return None


def check_compiled_call_hook() -> None:
    """Raises :class:`CompiledCallChanged` when this torch would leave a model compiled in place
    uncompiled (see :func:`compiled_call_problem`); checked once per process."""
    problem = compiled_call_problem()
    if problem is not None:
        raise CompiledCallChanged(
            f"compile: unison compiles models in place through a private torch attribute, and torch "
            f"{torch.__version__} changed it: {problem}. The model would train uncompiled while reported "
            "compiled. Turn compile off (training.compile: false), or use the torch version unison is "
            "tested with (see `unison doctor`, section 'Private APIs')."
        )
