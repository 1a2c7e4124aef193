"""Putting a model on this rank's device and wrapping it for data-parallel training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from unison.distributed.ddp_buckets import FixedBucketsDDP, layout_is_fixable
from unison.distributed.primitives import device as rank_device
from unison.distributed.primitives import is_distributed


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` (or ``DataParallel``) wrapper.

    Its ``state_dict`` keys have no ``module.`` prefix. A plain module is returned as is.
    """
    while isinstance(model, (DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def prepare_model(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    sync_batchnorm: bool = False,
    find_unused_parameters: bool = False,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Moves a model to this rank's device and, with more than one rank, wraps it in DDP.

    The order is the one DDP needs: move first, convert BatchNorm layers next, wrap last.
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
            all ranks); only with more than one rank.
        find_unused_parameters: let DDP handle parameters that get no gradient in some
            steps, at a cost per step; needed when ``Expected to have finished reduction``
            errors appear.
        **ddp_kwargs: other ``DistributedDataParallel`` arguments.

    Returns:
        The model on the device, wrapped in DDP when the world size is above one.

    Distributed:
        Call it on every rank: wrapping in DDP is a collective.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_model(model=...) needs an nn.Module, got {type(model).__name__}.")
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "prepare_model(model=...) got a model already wrapped in DDP; pass the plain module."
        )
    target = torch.device(device) if device is not None else rank_device()
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    model = model.to(target)
    if not is_distributed():
        return model
    if sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    device_ids = [target.index] if target.type == "cuda" else None
    fixable = layout_is_fixable(
        find_unused_parameters=find_unused_parameters, static_graph=bool(ddp_kwargs.get("static_graph"))
    )
    wrapper = FixedBucketsDDP if fixable else DistributedDataParallel
    return wrapper(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters, **ddp_kwargs)


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's first parameter (or buffer); the CPU for a model with neither."""
    for tensor in model.parameters():
        return tensor.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")
