"""``torch.compile`` of a prepared model, in place, so checkpoints keep the plain module's keys.

torch compiles a data-parallel model after wrapping it: the graphs dynamo captures while
DDP's forward runs are split by DDP's optimizer (``torch._dynamo.backends.distributed``)
at the boundaries of DDP's gradient buckets, so each bucket's all-reduce can start while
the rest of the backward runs; FSDP2's hooks are excluded from tracing and run eagerly
around the compiled code. :func:`compile_model` follows that order and compiles in place
(``nn.Module.compile``'s mechanism) instead of wrapping in an ``OptimizedModule``: the
model's type, its ``state_dict`` keys (no ``_orig_mod.`` prefix) and every reference to
it stay the same, so a run saved with compile resumes without it and the other way round.

What gets compiled is the module whose call the strategy runs:

- **DDP**: the module inside the wrapper. DDP's own forward (its reducer's bookkeeping)
  cannot be traced and breaks the graph at every call, so compiling the wrapper yields
  the same graphs as compiling the module it runs, which dynamo captures inside DDP's
  forward where the bucket split applies, plus dozens of failed attempts at DDP's code,
  and ``fullgraph=True`` would fail on them. Compiling the inner module gives the split
  without either.
- **FSDP2 or one process**: the model itself (an FSDP2 model keeps its class; its
  hooks run eagerly, as they do under ``torch.compile(model)``).

torch's own ``nn.Module.compile`` captures nothing when the compiled module's class is
one of torch's (``nn.Sequential``, ``nn.Linear``): dynamo skips the frames of torch's
files at the top level, and ``Module.compile`` starts at one. ``torch.compile(module)``
avoids this with an extra frame it can trace; :func:`compile_model` does the same for
such modules, so an ``nn.Sequential`` is compiled too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from unison.distributed.compile_hook import check_compiled_call_hook

COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend")
"""The ``torch.compile`` options a compile spec may set."""

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

_CPU_INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False}
"""Inductor options :func:`torch_compile_kwargs` sets on the CPU (see there why)."""


def compile_spec(value: bool | Mapping[str, Any] | None, who: str = "compile") -> dict[str, Any] | None:
    """The ``torch.compile`` options of ``value``: None for off (False/None), {} for True.

    Example:
        >>> compile_spec(True), compile_spec(False), compile_spec({"mode": "max-autotune"})
        ({}, None, {'mode': 'max-autotune'})

    Raises:
        ValueError: naming ``who`` and the key, for an unknown key or a bad value.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{who}={value!r}: expected true, false, or a mapping of {list(COMPILE_KEYS)}.")
    options = dict(value)
    unknown = sorted(set(options) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"{who}: unknown key(s) {unknown}; expected some of {list(COMPILE_KEYS)}.")
    if options.get("mode") not in _MODES:
        raise ValueError(
            f"{who}.mode={options['mode']!r}: expected one of {[m for m in _MODES if m]} or null."
        )
    if "fullgraph" in options and not isinstance(options["fullgraph"], bool):
        raise ValueError(f"{who}.fullgraph={options['fullgraph']!r}: expected true or false.")
    if "dynamic" in options and options["dynamic"] is not None and not isinstance(options["dynamic"], bool):
        raise ValueError(
            f"{who}.dynamic={options['dynamic']!r}: expected true, false or null (decide per shape)."
        )
    if "backend" in options and not isinstance(options["backend"], str):
        raise ValueError(f"{who}.backend={options['backend']!r}: expected a backend name such as 'inductor'.")
    return options


def compile_target(model: nn.Module) -> nn.Module:
    """The module whose call :func:`compile_model` compiles: the one inside DDP, else ``model``."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def compile_model(model: nn.Module, options: Mapping[str, Any] | None = None) -> nn.Module:
    """Compiles the call of ``model`` (of the module inside it, for DDP) in place; returns ``model``.

    Compilation itself happens at the first forward pass. ``options`` are
    ``torch.compile``'s (see :func:`compile_spec`).

    Raises:
        ValueError: the model (or the module inside DDP) is already compiled.
        CompiledCallChanged: this torch no longer honours the in-place mechanism (the
            model would train uncompiled).
    """
    check_compiled_call_hook()
    target = compile_target(model)
    if is_compiled(target):
        raise ValueError(
            f"compile: the {type(target).__name__} given is already compiled (torch.compile or Module.compile); "
            "pass the plain module and let compile=... do it, or leave compile off."
        )
    kwargs = torch_compile_kwargs(options, _device_of(target))
    if _torch_defined_forward(target):
        target._compiled_call_impl = torch.compile(_traceable_call(target), **kwargs)
    else:
        target.compile(**kwargs)
    return model


def torch_compile_kwargs(options: Mapping[str, Any] | None, device: torch.device) -> dict[str, Any]:
    """The ``torch.compile`` keyword arguments :func:`compile_model` uses for ``options`` on ``device``.

    With inductor (the default backend) on the CPU, inductor's reordering of kernels for peak
    memory is turned off, and ``mode`` becomes the inductor options it stands for
    (``torch.compile`` takes one or the other). The reason: torch 2.13's CPU code generator
    can lose a kernel's dependency on an in-place scatter when it fuses loops, and the
    reordering then runs the reader before the scatter. The max-pool backward scatters into
    a zeroed buffer, so a ``Conv2d -> MaxPool2d`` network (the digits recipe's) trained with
    zero gradients for its convolutions (a test marked ``compile`` in
    ``tests/distributed/test_compile.py`` reproduces it, and tells when a torch no longer needs this).

    Example:
        >>> torch_compile_kwargs({"mode": "max-autotune-no-cudagraphs"}, torch.device("cpu"))["options"]
        {'max_autotune': True, 'coordinate_descent_tuning': True, 'reorder_for_peak_memory': False}
    """
    kwargs = dict(options or {})
    if device.type != "cpu" or kwargs.get("backend", "inductor") != "inductor":
        return kwargs
    from torch._inductor import list_mode_options

    mode = kwargs.pop("mode", None)
    modes = list_mode_options(mode, kwargs.get("dynamic")) if mode not in (None, "default") else {}
    kwargs["options"] = {**modes, **_CPU_INDUCTOR_OPTIONS}
    return kwargs


def _device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model``, or the module inside it when it is a DDP wrapper, was compiled in
    place or wrapped by ``torch.compile``."""
    for module in {id(m): m for m in (model, compile_target(model))}.values():
        if getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod"):
            return True
    return False


def _torch_defined_forward(module: nn.Module) -> bool:
    """Whether dynamo would skip ``module.forward`` as a top-level frame (a class of torch's own)."""
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.check(module.forward))
    except (ImportError, AttributeError):  # a torch without the rule table: decide by the class's home
        return type(module).forward.__module__.startswith("torch.")


def _traceable_call(module: nn.Module) -> Callable[..., Any]:
    """A call of ``module`` (hooks and forward) that starts in a frame dynamo traces."""
    call = module._call_impl

    def call_module(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return call_module
