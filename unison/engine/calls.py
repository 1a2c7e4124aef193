"""How a step takes a batch apart and calls the model on it, for batches of any shape.

The default step reads a batch as ``(x, y)`` and calls ``model(x)``. A batch with named
fields (a torch_geometric ``Batch``, a dict of tensors, a dataclass) is kept whole:
:class:`WholeBatch` moves it to the device and names its target, and :class:`ModelCall`
passes chosen fields to the model, by position or by keyword. Both take plain values
(field names), so a config can name them as well as Python code can.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from unison.distributed.batches import move_to_device
from unison.distributed.collate import is_graph_item

Field = str | int
"""A field of a batch: an attribute or key name, or a position in a tuple or list."""


def field_names(batch: Any) -> list[str]:
    """The names of ``batch``'s fields, for messages: keys, positions, or attributes."""
    if isinstance(batch, Mapping):
        return [str(key) for key in batch]
    if isinstance(batch, (list, tuple)):
        return [str(i) for i in range(len(batch))]
    if dataclasses.is_dataclass(batch):
        return [f.name for f in dataclasses.fields(batch)]
    keys = getattr(batch, "keys", None)  # a torch_geometric Data or Batch
    if callable(keys):
        try:
            return sorted(str(key) for key in keys())
        except TypeError:
            pass
    return sorted(name for name in getattr(batch, "__dict__", {}) if not name.startswith("_"))


def batch_field(batch: Any, name: Field, owner: str = "batch_field") -> Any:
    """The field ``name`` of ``batch``: an item of a mapping or a sequence, else an attribute.

    Args:
        batch: a dict, tuple, list, dataclass or any object with attributes.
        name: a key or attribute name, or an int position.
        owner: who asks, named in the error.

    Raises:
        KeyError: the batch has no such field; the message lists the fields it has.

    Example:
        >>> batch_field({"x": 1, "y": 2}, "y"), batch_field((1, 2), 0)
        (2, 1)
    """
    try:
        if isinstance(name, int) or isinstance(batch, Mapping):
            return batch[name]
        return getattr(batch, name)
    except (KeyError, IndexError, AttributeError, TypeError):
        raise KeyError(
            f"{owner}: the batch ({type(batch).__name__}) has no field {name!r}; its fields are "
            f"{field_names(batch)}. Name one of them, or pass prepare_batch=your_function(batch, device, "
            "non_blocking) -> (inputs, target) for another layout."
        ) from None


def _check_field(value: Any, where: str) -> Field:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(
            f"{where} must be a field name (str) or position (int), got {type(value).__name__}: {value!r}."
        )
    return value


class WholeBatch:
    """A ``prepare_batch`` that keeps the batch whole: inputs are the batch, on the device.

    Returns ``(batch, batch.<target>)``: the whole batch moved to the device
    (:func:`~unison.distributed.batches.move_to_device`), and its target field for the
    criterion and the metrics. Pair it with a :class:`ModelCall` that picks the model's
    arguments from the batch. The default ``prepare_batch`` does the same, with target
    ``"y"``, for batches that are not ``(x, y)`` pairs.

    Args:
        target: the field holding the target (``"y"`` of a torch_geometric batch,
            ``"labels"`` of a tokenizer's), or None for a batch without one (a
            :class:`~unison.metrics.BatchLoss` then reads what it needs from the batch).

    Example:
        >>> import torch
        >>> inputs, y = WholeBatch("labels")({"ids": torch.ones(2, 3), "labels": torch.zeros(2)}, torch.device("cpu"))
        >>> sorted(inputs), y.shape
        (['ids', 'labels'], torch.Size([2]))
    """

    def __init__(self, target: Field | None = "y") -> None:
        self.target = None if target is None else _check_field(target, "WholeBatch(target=...)")

    def __call__(self, batch: Any, device: torch.device, non_blocking: bool = True) -> tuple[Any, Any]:
        batch = move_to_device(batch, device, non_blocking)
        if self.target is None:
            return batch, None
        return batch, batch_field(batch, self.target, f"WholeBatch(target={self.target!r})")

    def __repr__(self) -> str:
        return f"WholeBatch(target={self.target!r})"


class ModelCall:
    """How the model is called on its inputs: ``model(inputs)``, or with fields of them.

    ``args`` name the fields passed by position and ``kwargs`` map keyword names to
    fields; each is read from the inputs (the batch, with :class:`WholeBatch` or the
    default ``prepare_batch`` on a batch with fields) by key, position or attribute. With
    neither, the model gets the inputs as they are (the default).

    Args:
        args: fields passed by position, in order: ``["x", "edge_index", "batch"]`` calls
            ``model(batch.x, batch.edge_index, batch.batch)``.
        kwargs: keyword -> field: ``{"attention_mask": "mask"}`` passes
            ``attention_mask=batch["mask"]``.

    Example:
        >>> import torch
        >>> call = ModelCall(args=["a"], kwargs={"other": "b"})
        >>> call(lambda a, other: a - other, {"a": torch.tensor(3), "b": torch.tensor(1)})
        tensor(2)
    """

    def __init__(self, args: Sequence[Field] = (), kwargs: Mapping[str, Field] | None = None) -> None:
        if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
            raise TypeError(
                f"ModelCall(args=...) must be a list of field names, got {type(args).__name__}: {args!r}. "
                'Write args=["x"] for one field.'
            )
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"ModelCall(kwargs=...) must map keyword names to fields, got {type(kwargs).__name__}: {kwargs!r}."
            )
        self.args = tuple(_check_field(a, f"ModelCall(args=[...]) item {i}") for i, a in enumerate(args))
        for key in kwargs:
            if not isinstance(key, str) or not key.isidentifier():
                raise TypeError(f"ModelCall(kwargs=...) keys must be keyword names, got {key!r}.")
        self.kwargs = {key: _check_field(value, f"ModelCall(kwargs={{{key!r}: ...}})") for key, value in kwargs.items()}
        self.whole = not self.args and not self.kwargs
        """No fields named: the model gets the inputs as they are."""
        self._owner = repr(self)

    def __call__(self, model: nn.Module | Callable[..., Any], inputs: Any) -> Any:
        if self.whole:
            return model(inputs)
        args = [batch_field(inputs, name, self._owner) for name in self.args]
        kwargs = {key: batch_field(inputs, name, self._owner) for key, name in self.kwargs.items()}
        return model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ModelCall(args={list(self.args)!r}, kwargs={self.kwargs!r})"


GRAPH_FIELDS: tuple[str, ...] = ("x", "edge_index", "batch")
"""The fields a graph network gets by default: node features, edges, and each node's graph."""


class AutoCall:
    """The model call that fits the batch: ``model(x, edge_index, batch)`` for a graph batch.

    A torch_geometric batch (told by its class, without importing torch_geometric) is passed
    as its :data:`GRAPH_FIELDS`, the way graph networks (and QuantumGrav's trainer) are
    called; any other inputs are passed as they are, ``model(inputs)``. Which of the two is
    decided once per batch class. A config that names no ``model.call`` gets this one.

    Example:
        >>> import torch
        >>> AutoCall()(torch.nn.Identity(), torch.ones(2)).shape
        torch.Size([2])
    """

    def __init__(self) -> None:
        self._graph = ModelCall(args=GRAPH_FIELDS)
        self._is_graph: dict[type, bool] = {}

    def __call__(self, model: nn.Module | Callable[..., Any], inputs: Any) -> Any:
        cls = inputs.__class__
        graph = self._is_graph.get(cls)
        if graph is None:
            graph = self._is_graph[cls] = is_graph_item(inputs)
        return self._graph(model, inputs) if graph else model(inputs)

    def __repr__(self) -> str:
        return "AutoCall()"


def resolve_model_call(
    model_call: Callable[[nn.Module, Any], Any] | None, owner: str
) -> Callable[[nn.Module, Any], Any] | None:
    """``model_call`` checked; None where the model is called ``model(x)`` (the step's fast path)."""
    if model_call is None or (isinstance(model_call, ModelCall) and model_call.whole):
        return None
    if not callable(model_call):
        raise TypeError(
            f"{owner}(model_call=...) must be callable as model_call(model, inputs), got "
            f"{type(model_call).__name__}: {model_call!r}. Use unison.engine.ModelCall(args=[...]) to pass "
            "fields of the batch."
        )
    return model_call


def whole_batch_with_y(batch: Any, device: torch.device, non_blocking: bool) -> tuple[Any, Any]:
    """The default ``prepare_batch`` on a batch with fields: ``(the batch on the device, its "y")``,
    or an error naming the fix when it has no ``y``."""
    if not _has_field(batch, "y"):
        raise ValueError(
            f"prepare_batch got a {type(batch).__name__} batch with fields {field_names(batch)} and no 'y' "
            "to take as the target; expected an (inputs, targets) pair, 'x'/'y' keys, or a 'y' field. Name "
            "the target with prepare_batch=unison.engine.WholeBatch(target='<field>') (target=None for a "
            "criterion that reads the batch itself, wrapped in unison.metrics.BatchLoss), and the model's "
            "arguments with model_call=unison.engine.ModelCall(args=[...])."
        )
    return _DEFAULT_WHOLE(batch, device, non_blocking)


def _has_field(batch: Any, name: str) -> bool:
    if isinstance(batch, Mapping):
        return name in batch
    try:
        getattr(batch, name)
    except (AttributeError, KeyError):
        return False
    return True


_DEFAULT_WHOLE = WholeBatch("y")
