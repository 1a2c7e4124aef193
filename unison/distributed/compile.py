"""``torch.compile`` of a prepared model, in place, so checkpoints keep the plain module's keys.

torch recommends compiling after the DDP or FSDP2 wrapping (DDP's optimizer then splits
the graph at its gradient buckets; FSDP2's hooks run around the compiled forward).
:func:`compile_model` compiles the outermost module with ``nn.Module.compile``, which
compiles its call in place instead of wrapping it in an ``OptimizedModule``: the model's
type, its ``state_dict`` keys (no ``_orig_mod.`` prefix) and every reference to it stay
the same, so a run saved with compile resumes without it and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend")
"""The ``torch.compile`` options a compile spec may set."""

_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_spec(value: bool | Mapping[str, Any] | None, who: str = "compile") -> dict[str, Any] | None:
    """The ``torch.compile`` options of ``value``: None for off (False/None), {} for True.

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
        raise ValueError(f"{who}.mode={options['mode']!r}: expected one of {[m for m in _MODES if m]} or null.")
    for key in ("fullgraph",):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"{who}.{key}={options[key]!r}: expected true or false.")
    if "dynamic" in options and options["dynamic"] is not None and not isinstance(options["dynamic"], bool):
        raise ValueError(f"{who}.dynamic={options['dynamic']!r}: expected true, false or null (decide per shape).")
    if "backend" in options and not isinstance(options["backend"], str):
        raise ValueError(f"{who}.backend={options['backend']!r}: expected a backend name such as 'inductor'.")
    return options


def compile_model(model: nn.Module, options: Mapping[str, Any] | None = None) -> nn.Module:
    """Compiles ``model``'s call in place (``nn.Module.compile``) and returns the same object.

    Compilation itself happens at the first forward pass.
    """
    model.compile(**dict(options or {}))
    return model


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` was compiled in place or wrapped by ``torch.compile``."""
    return getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod")
