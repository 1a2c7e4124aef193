"""Putting a model on this rank's device and wrapping it for data-parallel training."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from unison.distributed.activation_ckpt import ActivationCheckpointing, ac_spec, checkpoint_blocks
from unison.distributed.compile import compile_model, compile_spec
from unison.distributed.ddp_buckets import FixedBucketsDDP, layout_is_fixable
from unison.distributed.fsdp import FSDPOptions, shard_model
from unison.distributed.primitives import device as rank_device
from unison.distributed.primitives import get_world_size, is_distributed


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel``, ``DataParallel`` and ``torch.compile`` wrappers.

    Its ``state_dict`` keys have no ``module.`` or ``_orig_mod.`` prefix. A plain module (or
    one sharded with ``fully_shard``, which keeps its class and keys) is returned as is.
    """
    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
            model = inner
        else:
            return model


FIND_UNUSED_ENV = "DDP_FIND_UNUSED_PARAMETERS"
"""The environment variable NNHandler users set to switch DDP's ``find_unused_parameters``."""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def find_unused_from_env() -> bool | None:
    """``DDP_FIND_UNUSED_PARAMETERS`` as a bool (``true``/``1``/``yes``/``on`` or
    ``false``/``0``/``no``/``off``, any case), or None when it is not set.

    Raises:
        ValueError: it holds anything else, naming the variable, the value and what it takes.
    """
    raw = os.environ.get(FIND_UNUSED_ENV)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{FIND_UNUSED_ENV}={raw!r}: expected true or false (also 1/0, yes/no, on/off). Set it to true for a "
        "model with parameters unused in some steps, or unset it (parallel.find_unused_parameters in a config "
        "wins over it)."
    )


Strategy = Literal["ddp", "fsdp"]


def prepare_model(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    strategy: Strategy = "ddp",
    fsdp: FSDPOptions | Mapping[str, Any] | None = None,
    compile: bool | Mapping[str, Any] = False,
    activation_checkpointing: ActivationCheckpointing = False,
    sync_batchnorm: bool = False,
    find_unused_parameters: bool | None = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Moves a model to this rank's device and, with more than one rank, wraps it in DDP or shards it.

    ``strategy="fsdp"`` shards parameters, gradients and optimizer state over the ranks
    with FSDP2's ``fully_shard`` (see :mod:`unison.distributed.fsdp`; ``fsdp`` takes its
    options). The model keeps its class and its ``state_dict`` keys; build the optimizer
    from the returned model's parameters. With one rank either strategy returns the plain
    model on the device.

    ``compile`` compiles the model with ``torch.compile`` after wrapping, as torch
    recommends for DDP and FSDP2 (see :mod:`unison.distributed.compile`), in place: the
    returned module and its ``state_dict`` keys are the uncompiled ones.

    ``activation_checkpointing`` makes the chosen blocks recompute their activations in the
    backward pass (see :mod:`unison.distributed.activation_ckpt`), in place, before
    wrapping: the blocks keep their classes and ``state_dict`` keys.

    The order is the one DDP needs: move first, checkpoint the blocks and convert BatchNorm
    layers next, wrap last.
    ``device_ids`` is ``[cuda index]`` on a GPU and None on the CPU. DDP broadcasts rank 0's
    parameters at wrapping, so every replica starts from the same weights.

    The gradient buckets are laid out once, at wrapping, and never change (stock DDP
    re-lays them after the first backward): with 3 or more ranks that change alters the
    summation order of the first iteration's all-reduce, so a run resumed from a
    checkpoint would end a few ulps away from the uninterrupted one. The returned module
    is a :class:`~unison.distributed.ddp_buckets.FixedBucketsDDP`, a
    ``DistributedDataParallel`` subclass; see that module for the details and the cost
    (none for sequential models).

    Args:
        model: the model, on any device.
        device: where to put it; default, this rank's device.
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm (batch statistics over
            all ranks); only with more than one rank, and on CUDA devices (torch's
            SyncBatchNorm refuses others: a clear ValueError here).
        find_unused_parameters: let DDP handle parameters that get no gradient in some
            steps, at a cost per step; needed when ``Expected to have finished reduction``
            errors appear. None (the default): the ``DDP_FIND_UNUSED_PARAMETERS``
            environment variable when it is set (NNHandler's switch), else False; a bool
            given here wins over the variable.
        strategy: ``"ddp"`` (replicas, the default) or ``"fsdp"`` (shards).
        fsdp: :class:`~unison.distributed.fsdp.FSDPOptions` or a mapping of its keys
            (``shard``, ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``,
            ``cpu_offload``); only with ``strategy="fsdp"``.
        compile: True, or a mapping of ``torch.compile`` options (``mode``,
            ``fullgraph``, ``dynamic``); False for none.
        activation_checkpointing: False (none), ``"auto"`` (with ``strategy="fsdp"`` the
            FSDP units, else the repeated blocks: classes with two or more instances holding
            parameters; of these the ones made of layers) or a list of class names.
        **ddp_kwargs: other ``DistributedDataParallel`` arguments.

    Returns:
        The model on the device, wrapped in DDP or sharded when the world size is above one.

    Distributed:
        Call it on every rank: wrapping in DDP and sharding are collectives.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_model(model=...) needs an nn.Module, got {type(model).__name__}.")
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "prepare_model(model=...) got a model already wrapped in DDP; pass the plain module."
        )
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"prepare_model(strategy={strategy!r}): expected 'ddp' or 'fsdp'.")
    if fsdp is not None and strategy != "fsdp":
        raise ValueError("prepare_model(fsdp=...) was given with strategy='ddp'; pass strategy='fsdp' to shard.")
    fsdp_options = FSDPOptions.of(fsdp) if strategy == "fsdp" else None
    compile_options = compile_spec(compile)
    ac_rule = ac_spec(activation_checkpointing, "prepare_model(activation_checkpointing=...)")
    wrapped = _wrap(model, device, fsdp_options, ac_rule, sync_batchnorm, find_unused_parameters, ddp_kwargs)
    return compile_model(wrapped, compile_options) if compile_options is not None else wrapped


def _wrap(
    model: nn.Module,
    device: torch.device | str | None,
    fsdp_options: FSDPOptions | None,
    ac_rule: str | tuple[str, ...] | None,
    sync_batchnorm: bool,
    find_unused_parameters: bool | None,
    ddp_kwargs: dict[str, Any],
) -> nn.Module:
    if find_unused_parameters is None:
        find_unused_parameters = bool(find_unused_from_env())
    target = torch.device(device) if device is not None else rank_device()
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    model = model.to(target)
    if ac_rule is not None:
        checkpoint_blocks(model, ac_rule, fsdp_options)
    if not is_distributed():
        return model
    if fsdp_options is not None:
        if sync_batchnorm:
            raise ValueError(
                "prepare_model(sync_batchnorm=True) with strategy='fsdp': SyncBatchNorm is a DDP feature here; "
                "leave it off (parallel.sync_batchnorm) or use strategy='ddp'."
            )
        return shard_model(model, fsdp_options, target, get_world_size())
    if sync_batchnorm:
        if target.type != "cuda" and any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()
        ):
            raise ValueError(
                f"prepare_model(sync_batchnorm=True): torch's SyncBatchNorm runs on CUDA devices only, and this "
                f"rank's device is {target}. Leave sync_batchnorm off here (parallel.sync_batchnorm in a config): "
                "each rank's BatchNorm then normalises with its own batch, and unison evaluates, saves and "
                "predicts with rank 0's running statistics."
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    device_ids = [target.index] if target.type == "cuda" else None
    fixable = layout_is_fixable(
        find_unused_parameters=find_unused_parameters, static_graph=bool(ddp_kwargs.get("static_graph"))
    )
    wrapper = FixedBucketsDDP if fixable else DistributedDataParallel
    return wrapper(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters, **ddp_kwargs)


def model_device(model: nn.Module) -> torch.device:
    """The device a model computes on: its first parameter's (or buffer's); the CPU for a model
    with neither. A sharded model with ``cpu_offload`` keeps its shards in CPU memory and
    computes on the device it was sharded for: that one."""
    compute = getattr(unwrap_model(model), "_unison_device", None)
    if isinstance(compute, torch.device):
        return compute
    for tensor in model.parameters():
        return tensor.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")
