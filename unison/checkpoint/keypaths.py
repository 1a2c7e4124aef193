"""Where each tensor sits in a nested state: the key paths that warnings and errors name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["tensors_with_keys", "tensors_with_paths"]


def tensors_with_paths(obj: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``obj`` (nested dicts, lists, tuples) with its key path below ``where``
    (``model.0.weight``), in the containers' own order.

    Example:
        >>> [p for p, _ in tensors_with_paths({"model": {"w": torch.ones(1)}, "steps": [torch.zeros(1), 3]})]
        ['model.w', 'steps.0']
    """
    for keys, tensor in tensors_with_keys(obj):
        yield ".".join(str(k) for k in (where, *keys) if k != ""), tensor


def tensors_with_keys(obj: Any, keys: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """Each tensor of ``obj`` (nested dicts, lists, tuples) with the keys and indices that lead to
    it from ``obj``, in the containers' own order.

    Example:
        >>> [k for k, _ in tensors_with_keys({"model": {"w": torch.ones(1)}, "steps": [torch.zeros(1), 3]})]
        [('model', 'w'), ('steps', 0)]
    """
    if isinstance(obj, torch.Tensor):
        yield keys, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from tensors_with_keys(value, (*keys, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_with_keys(value, (*keys, i))
