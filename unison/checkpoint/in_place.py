"""A resume's big records read straight into the run's own tensors: no new memory, no copy.

``torch.load`` reads each record of a checkpoint into a tensor it has just allocated, and
``load_state_dict`` then copies that tensor into the model's. On the 2-CPU virtual machine these
figures come from, the new memory cost more than the disk did: a cold 1 GB checkpoint read into
fresh tensors ran at 0.85-1.9 GB/s, read into the model's own parameters at 1.6-2.7 GB/s (the
disk read it at 2.5), and the copy that followed took another 80 ms.

:func:`mirror` gathers the run's own tensors where a resume loads a checkpoint: the weights and
buffers of its models and the state of its torch optimizers, under the key paths a checkpoint
keeps them (``objects.<name>...``), sharing memory with the objects. :func:`plan` pairs the
records of a loaded state with them: a record goes into the run's tensor at its key path when
both are plain, contiguous, whole CPU tensors of one dtype and shape, the record's storage holds
that one tensor of the state (not a view, not a storage two keys share), and no other record
goes to the same memory. The state then holds the run's tensor itself, and ``load_state_dict``'s
copy of a tensor onto itself does nothing. Every other record (a GPU model's, a DTensor's, a
view's) is read into the new tensor as before.

The run's tensors are written before the record's CRC-32 is known. A damaged checkpoint found
that way is passed over as before, and the checkpoint that is loaded overwrites what it wrote;
when no checkpoint is whole, the resume raises rather than start afresh with those weights
(:func:`unison.checkpoint.archive.overwritten`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

import torch
from torch import nn

from unison.checkpoint.keypaths import tensors_with_keys
from unison.checkpoint.state import model_state

__all__ = ["FROM", "Into", "mirror", "plan", "put"]

FROM = 1 << 20
"""Records of this many bytes or more are read in place where they can be (1 MiB): below it, the
new memory is mostly the allocator's, already in use."""


def mirror(objects: Mapping[str, Any]) -> dict[str, Any]:
    """``{"objects": {name: state}}`` for the models and torch optimizers of ``objects``: a model's
    weights and buffers (without DDP's prefix) and an optimizer's ``state_dict()``, whose tensors
    share memory with the objects, as a checkpoint keeps them."""
    states: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            states[name] = model_state(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            states[name] = obj.state_dict()
    return {"objects": states}


class Into:
    """The run's own tensors a load reads records into, under the key paths of the state it loads
    (a nested state, or one tensor for a state that is one tensor), and the checkpoint files it
    has read into them so far (:attr:`files`)."""

    def __init__(self, tensors: Any) -> None:
        self.tensors = tensors
        self.files: list[str] = []
        """Files read into the run's tensors, whole or damaged, in the order they were read."""

    @classmethod
    def of(cls, objects: Mapping[str, Any]) -> Into:
        """The tensors of the models and torch optimizers of ``objects``, where a resume loads a
        checkpoint's states (:func:`mirror`)."""
        return cls(mirror(objects))


def plan(
    state: Any, into: Any, deferred: set[int]
) -> tuple[dict[int, torch.Tensor], list[tuple[tuple[Any, ...], torch.Tensor]]]:
    """Where each deferred record of ``state`` is read, and which of ``state``'s tensors become the run's.

    Args:
        state: what ``torch.load`` returned, the storages of ``deferred`` allocated and not read.
        into: the run's own tensors (:func:`mirror`), or None.
        deferred: the data pointers of the storages whose records were not read.

    Returns:
        ``{data pointer: tensor to read the record into}`` for every deferred storage reachable in
        ``state`` (the run's tensor, or the state's own), and the ``(keys, tensor)`` swaps to make in
        ``state`` once they are read (:func:`put`).
    """
    holders: dict[int, list[tuple[tuple[Any, ...], torch.Tensor]]] = {}
    for keys, tensor in tensors_with_keys(state):
        holders.setdefault(tensor.untyped_storage().data_ptr(), []).append((keys, tensor))
    own = dict(tensors_with_keys(into)) if into is not None else {}
    targets: dict[int, torch.Tensor] = {}
    swaps: list[tuple[tuple[Any, ...], torch.Tensor]] = []
    taken: set[int] = set()
    for pointer in deferred:
        found = holders.get(pointer)
        if not found:
            continue  # not reachable in the state: the caller reads the file again without deferring
        keys, tensor = found[0]
        live = own.get(keys)
        if (
            len(found) == 1
            and live is not None
            and _whole(tensor)
            and _whole(live)
            and live.dtype == tensor.dtype
            and live.shape == tensor.shape
            and live.data_ptr() not in taken
            and _replaceable(state, keys)
        ):
            taken.add(live.data_ptr())
            targets[pointer] = live
            swaps.append((keys, live))
        else:
            targets[pointer] = tensor
    return targets, swaps


def put(state: Any, keys: tuple[Any, ...], value: Any) -> None:
    """Sets the value at ``keys`` inside ``state`` (its containers on the way are dicts and lists)."""
    holder = state
    for key in keys[:-1]:
        holder = holder[key]
    holder[keys[-1]] = value


def _whole(tensor: torch.Tensor) -> bool:
    """A plain, contiguous CPU tensor that is the whole of its storage: its bytes are the record's."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.numel() > 0
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.storage_offset() == 0
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    )


def _replaceable(state: Any, keys: tuple[Any, ...]) -> bool:
    """Whether the container that holds the value at ``keys`` can take a new one (not a tuple); a
    state that is one tensor (no keys) is replaced whole by the caller."""
    if not keys:
        return True
    holder = state
    for key in keys[:-1]:
        holder = holder[key]
    return isinstance(holder, (MutableMapping, MutableSequence))
