"""Checks on a checkpoint's content before it is written: plain values only, finite weights only.

``torch.load(weights_only=True)`` refuses any object beyond tensors and plain containers,
so a single numpy float in an optimizer's state or a ``pathlib.Path`` in the config would
make every later checkpoint unloadable. :func:`to_plain` converts what round-trips exactly
and refuses the rest at save time, naming the key. :func:`first_non_finite` finds a NaN or
an infinity in the weights, so that a diverged run never replaces its last good checkpoint.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import PurePath
from typing import Any, NamedTuple

import torch

from unison.checkpoint.keypaths import tensors_with_paths
from unison.checkpoint.manifest import Manifest
from unison.checkpoint.positions import PositionUnknown

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
"""Values that load with ``weights_only=True`` as they are."""


class NotPlainError(TypeError):
    """A value a checkpoint cannot hold: ``torch.load(weights_only=True)`` would refuse the file."""


def _numpy_scalar(value: Any) -> Any | None:
    """A numpy scalar as the Python number it equals exactly, or None for anything else."""
    numpy = type(value).__module__ == "numpy"
    if numpy and getattr(value, "shape", None) == () and hasattr(value, "item"):
        item = value.item()
        return item if isinstance(item, (bool, int, float, complex)) else None
    return None


def _fix_for(value: Any) -> str:
    if type(value).__module__ == "numpy":
        return "convert it with torch.from_numpy(...) (an array) or .tolist()"
    if isinstance(value, (set, frozenset)):
        return "store a sorted list instead"
    return "store it as plain data (None, bool, int, float, str, list, tuple, dict) or a tensor"


def to_plain(value: Any, where: str) -> Any:
    """``value`` with numpy scalars as Python numbers and paths as strings; tensors kept as they are.

    Args:
        value: nested dicts, lists and tuples of the values a checkpoint holds.
        where: the key path of ``value``, for the message (``"config"``, ``"optimizer"``).

    Raises:
        NotPlainError: for any other value (a numpy array, a set, an object), naming its key
            path and type, and how to store it instead.

    Example:
        >>> import numpy as np
        >>> to_plain({"lr": np.float32(0.5), "dirs": ("a", PurePath("/b"))}, "config")
        {'lr': 0.5, 'dirs': ('a', '/b')}
    """
    if isinstance(value, torch.Tensor) or type(value) in _ATOMS:
        return value
    if isinstance(value, Mapping):
        items = ((key, to_plain(item, f"{where}.{key}")) for key, item in value.items())
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if type(value) in (list, tuple):
        converted = [to_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return converted if type(value) is list else tuple(converted)
    if isinstance(value, PurePath):
        return str(value)
    number = _numpy_scalar(value)
    if number is not None:
        return number
    raise NotPlainError(
        f"The checkpoint cannot hold {where} = {_short(value)} (a {type(value).__module__}.{type(value).__qualname__}): "
        f"torch.load(weights_only=True) would refuse the file, so no resume could read it. "
        f"{_fix_for(value)[0].upper()}{_fix_for(value)[1:]} where {where} is set."
    )


def plain_payload(state: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's dict through :func:`to_plain`; the objects' keys named without a prefix."""
    plain = {key: to_plain(value, key) for key, value in state.items() if key != "objects"}
    plain["objects"] = {name: to_plain(value, name) for name, value in state["objects"].items()}
    return plain


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _float_tensors(states: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    return (
        (name, t) for name, t in tensors_with_paths(states, where) if t.is_floating_point() or t.is_complex()
    )


def first_non_finite(objects: Mapping[str, Any]) -> str | None:
    """The key path of the first tensor of ``objects`` holding a NaN or an infinity, or None.

    One host read per device: the flags are computed where the tensors live and read once.
    Each tensor is first summed: a NaN or an infinity makes the sum one too, so a finite sum
    clears the tensor in one pass that allocates nothing of its size. Only a tensor whose
    sum is not finite (a NaN, an infinity, or finite values whose sum overflows) is checked
    element by element.

    Args:
        objects: name -> state (a model's weights, an optimizer's ``state_dict()``...).

    Example:
        >>> first_non_finite({"model": {"w": torch.ones(2), "b": torch.tensor([float("nan")])}})
        'model.b'
    """
    found = [(name, t) for key, state in objects.items() for name, t in _float_tensors(state, str(key))]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, tensor) in enumerate(found):
        by_device.setdefault(tensor.device, []).append(i)
    bad: list[int] = []
    for positions in by_device.values():
        sums = torch.stack([torch.isfinite(found[i][1].detach().sum()) for i in positions])
        unclear = [i for i, ok in zip(positions, sums.tolist(), strict=True) if not ok]
        if unclear:  # rare: the sum cannot tell a NaN from an overflow
            flags = torch.stack([torch.isfinite(found[i][1].detach()).all() for i in unclear])
            bad.extend(i for i, ok in zip(unclear, flags.tolist(), strict=True) if not ok)
    return found[min(bad)][0] if bad else None


class Verdict(NamedTuple):
    """Rank 0's verdict on a checkpoint it collected, shared with every rank.

    Attributes:
        kind: ``"not finite"`` (skip the save), or the name of the error to raise.
        detail: the bad tensor's key path, or the error's message.
    """

    kind: str
    detail: str


_REFUSALS: dict[str, type[Exception]] = {"NotPlainError": NotPlainError, "PositionUnknown": PositionUnknown}


def vet(
    state: dict[str, Any] | None, problem: Exception | None, *, finite: bool = True
) -> tuple[dict[str, Any] | None, Verdict | None]:
    """Checks a collected checkpoint: plain values (converted), then finite weights.

    Args:
        state: the checkpoint (rank 0), or None (other ranks: nothing to check).
        problem: an error met while collecting, to share.
        finite: check that the weights are finite; False where the writer checks its copy
            instead (:func:`finite_check`, an asynchronous save).

    Returns:
        The state with plain values, and None or the reason not to write it.
    """
    if problem is not None:
        return None, Verdict(type(problem).__name__, str(problem))
    if state is None:
        return None, None
    try:
        state = plain_payload(state)
    except NotPlainError as err:
        return None, Verdict("NotPlainError", str(err))
    bad = first_non_finite(state["objects"]) if finite else None
    return state, None if bad is None else Verdict("not finite", bad)


def finite_check(manifest: Manifest, iteration: int) -> Callable[[dict[str, Any]], str | None]:
    """The check an asynchronous save's writer runs on its copy of the state, in its thread: the
    warning of :func:`skip_message` when a weight is not finite (nothing is written then), or None."""

    def check(state: dict[str, Any]) -> str | None:
        bad = first_non_finite(state["objects"])
        return None if bad is None else skip_message(Verdict("not finite", bad), manifest, iteration)

    return check


def raise_refusal(verdict: Verdict) -> None:
    """Raises the error a verdict names (on every rank); a skip is not an error."""
    if verdict.kind != "not finite":
        raise _REFUSALS.get(verdict.kind, RuntimeError)(verdict.detail)


def skip_message(verdict: Verdict, manifest: Manifest, iteration: int) -> str:
    """The warning of a save skipped for non-finite weights: the bad tensor, and what stays newest."""
    newest = manifest.newest()
    last = newest[0].file if newest else "none (there is no earlier one)"
    return (
        f"Not saving a checkpoint at iteration {iteration}: {verdict.detail} holds a NaN or an infinity. "
        f"The newest checkpoint stays {last}."
    )
