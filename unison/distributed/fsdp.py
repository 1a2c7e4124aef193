"""Sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank holds a 1/N shard of every parameter, gradient and optimizer state; a unit's
parameters are all-gathered for its forward and backward and freed after. Which
submodules become units is the ``shard`` rule (:mod:`unison.distributed.units`): ``"auto"``
takes the repeated blocks, or a list of class names. The root is always a unit, holding what
no unit took, and what a unit shares with a module outside it (tied weights).

The helpers here keep unison's guarantees under sharding:

- :func:`no_gradient_sync`: an accumulation window's inner backward passes keep their
  gradients local (FSDP2's ``set_requires_gradient_sync``; DDP's ``no_sync``).
- :func:`gathered_parameters`: evaluation and prediction shard their data without
  padding, so ranks run different numbers of batches; a sharded forward is a collective.
  Inside this context every unit is gathered once, on every rank together, and forward
  passes are local until it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from unison.distributed.units import auto_units, named_units, untied_units
from unison.utils.logging import get_logger

_log = get_logger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class FSDPOptions:
    """How ``strategy="fsdp"`` shards a model.

    Attributes:
        shard: ``"auto"`` (the repeated blocks) or the class names of the submodules
            that become units.
        reshard_after_forward: free the gathered parameters after each unit's forward
            (less memory; the backward gathers them again).
        param_dtype: the dtype of the gathered parameters used in forward and backward
            (``"bfloat16"``, ``"float16"``, ``"float32"``); None keeps the parameters'.
        reduce_dtype: the dtype gradients are reduced in; None: ``param_dtype``.
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU
            memory (CUDA only).
    """

    shard: str | Sequence[str] = "auto"
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False

    @classmethod
    def of(
        cls, value: FSDPOptions | Mapping[str, Any] | None, who: str = "prepare_model(fsdp=...)"
    ) -> FSDPOptions:
        """Options from an instance, a mapping of the same keys, or None (the defaults).

        Raises:
            ValueError: naming ``who`` and the key, for an unknown key or a bad value.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            options = value
        elif isinstance(value, Mapping):
            unknown = sorted(
                set(value) - {"shard", "reshard_after_forward", "param_dtype", "reduce_dtype", "cpu_offload"}
            )
            if unknown:
                raise ValueError(
                    f"{who}: unknown key(s) {unknown}; expected shard, reshard_after_forward, param_dtype, "
                    "reduce_dtype, cpu_offload."
                )
            options = cls(**dict(value))
        else:
            raise TypeError(f"{who}: expected FSDPOptions or a mapping, got {type(value).__name__}.")
        shard = options.shard
        if isinstance(shard, str) and shard != "auto":  # one class name
            options = dataclasses.replace(options, shard=(shard,))
            shard = options.shard
        if not (
            shard == "auto"
            or (isinstance(shard, (list, tuple)) and shard and all(isinstance(s, str) for s in shard))
        ):
            raise ValueError(
                f"{who}: shard={shard!r}; expected 'auto' (the repeated blocks) or a non-empty list of class names "
                "such as ['TransformerEncoderLayer']."
            )
        for key in ("param_dtype", "reduce_dtype"):
            name = getattr(options, key)
            if name is not None and _DTYPE_ALIASES.get(name, name) not in _DTYPES:
                raise ValueError(
                    f"{who}: {key}={name!r}; expected one of {sorted(_DTYPES)} (or bf16/fp16/fp32) or null."
                )
        for key in ("reshard_after_forward", "cpu_offload"):
            if not isinstance(getattr(options, key), bool):
                raise ValueError(f"{who}: {key}={getattr(options, key)!r}; expected true or false.")
        return options

    def dtype(self, key: str) -> torch.dtype | None:
        name = getattr(self, key)
        return None if name is None else _DTYPES[_DTYPE_ALIASES.get(name, name)]


def shard_model(model: nn.Module, options: FSDPOptions, device: torch.device, world_size: int) -> nn.Module:
    """Applies ``fully_shard`` to the units of ``options.shard``, innermost first, then the root.

    Collective: call on every rank with the same model. The model must already be on
    ``device``; rank 0's parameters are broadcast first so every rank shards the same weights.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if options.cpu_offload and device.type != "cuda":
        raise ValueError(
            f"parallel.fsdp.cpu_offload: this rank's device is {device}; offloading moves shards from a GPU to "
            "CPU memory, so it needs CUDA. Turn it off here."
        )
    _broadcast_parameters(model)
    units = auto_units(model) if options.shard == "auto" else named_units(model, list(options.shard))
    units, ties = untied_units(model, units)
    for name, others in ties.items():
        _log.info(
            "parallel.fsdp: %s is tied to %s; the modules holding it are sharded with the root unit, "
            "the one unit that holds them all (FSDP2 shards a parameter in one unit).",
            name,
            ", ".join(others),
        )
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=options.dtype("param_dtype"), reduce_dtype=options.dtype("reduce_dtype")
    )
    offload = CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy()
    for unit in [*reversed(units), model]:  # children before the modules that hold them, the root last
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
        )
    model._unison_fsdp = options  # type: ignore[assignment]  # read back by gathered_parameters
    model._unison_device = device  # type: ignore[assignment]  # where it computes, even with its shards offloaded
    return model


def _broadcast_parameters(model: nn.Module) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or the module inside a compile wrapper) was sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def fsdp_units(model: nn.Module) -> list[Any]:
    """Every ``fully_shard`` unit of ``model`` (``FSDPModule``), in module order (the root first)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in getattr(model, "_orig_mod", model).modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def swapped_in(model: nn.Module) -> Iterator[None]:
    """Enters ``model.swapped()`` where a model has it (an EMA's view of a sharded model), else nothing."""
    swap = getattr(model, "swapped", None)
    if callable(swap):
        with swap():
            yield
    else:
        yield


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients on this rank, to be reduced with a later one.

    DDP: ``no_sync()``. FSDP2: ``set_requires_gradient_sync(False)`` (the unsharded
    gradients accumulate locally; the window's last backward reduce-scatters their sum).
    Anything else: nothing to skip.
    """
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)
    if isinstance(inner, DistributedDataParallel):
        with inner.no_sync():
            yield
        return
    if not is_sharded(inner):
        yield
        return
    inner.set_requires_gradient_sync(False)  # type: ignore[operator]  # an FSDPModule
    try:
        yield
    finally:
        inner.set_requires_gradient_sync(True)  # type: ignore[operator]


@contextlib.contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[None]:
    """Inside, a sharded model's forward passes issue no collective: every unit is gathered once.

    Collective on entry and exit for a sharded model: every rank enters together. A plain
    or DDP model: nothing happens. Memory: the whole model's parameters, as under DDP.
    """
    units = fsdp_units(model)  # the units inside, also when ``model`` wraps a sharded one
    if not units:
        yield
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        root_options = getattr(units[0], "_unison_fsdp", None)
        again = root_options.reshard_after_forward if isinstance(root_options, FSDPOptions) else True
        for unit in units:
            # the root keeps its gathered parameters after forward, as fully_shard sets it
            unit.set_reshard_after_forward(again and unit is not units[0], recurse=False)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def stored_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's shard of a DTensor (its local tensor, no autograd op on
    the way: what a copy into it or out of it reads and writes); any other tensor detached."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor.detach()  # type: ignore[attr-defined]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter, gradient or state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def global_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the whole value of ``tensor``: a DTensor's full value, anything else as is.

    A DTensor with a pending reduction (a partial sum, such as a sharded gradient norm)
    is reduced here, a collective: call it on every rank together.
    """
    if not is_dtensor(tensor):
        return tensor
    from torch.distributed.tensor import Replicate

    if all(isinstance(p, Replicate) for p in tensor.placements):  # type: ignore[attr-defined]
        return tensor.to_local()  # type: ignore[attr-defined]
    return tensor.full_tensor()  # type: ignore[attr-defined]


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole weights as plain tensors, keyed as the unwrapped module's ``state_dict``.

    A sharded model's parameters are all-gathered (a collective: call on every rank); any
    other model's state is returned as is (without DDP's or compile's prefixes).
    """
    inner = getattr(model, "_orig_mod", model)
    while hasattr(inner, "module") and isinstance(inner.module, nn.Module) and not is_sharded(inner):
        inner = inner.module  # DDP, DataParallel
    if not is_sharded(inner):
        return inner.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
