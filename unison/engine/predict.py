"""Inference sharded over every rank, gathered on rank 0 in dataset order."""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from unison.distributed.fsdp import gathered_parameters, swapped_in
from unison.distributed.model import model_device, unwrap_model
from unison.distributed.primitives import broadcast_buffers, get_rank, get_world_size, is_distributed
from unison.distributed.samplers import EvalSampler


def predict(
    model: nn.Module,
    dataset: Dataset,
    *,
    batch_size: int = 64,
    input_transform: Callable[[Any], Any] | None = None,
    num_workers: int = 0,
) -> torch.Tensor | None:
    """Collective: call on every rank. Predicts every sample once; rank 0 gets them in order.

    Each rank runs the model (unwrapped from DDP, in eval mode, without gradients, with rank
    0's buffers such as BatchNorm's running statistics) on its
    :class:`~unison.distributed.EvalSampler` shard: no sample is duplicated or padded.
    The outputs are gathered to rank 0 and put back in dataset order, so row ``i`` is the
    prediction for ``dataset[i]`` (a common bug of hand-written gathers is to concatenate
    the ranks' outputs in rank order instead).

    Args:
        model: the model (plain or DDP).
        dataset: yields inputs, or ``(inputs, targets)`` pairs (targets are ignored).
        batch_size: per-rank batch size.
        input_transform: picks the model input from a batch; default, the first element
            of a pair, else the batch.
        num_workers: DataLoader workers.

    Returns:
        On rank 0, a CPU tensor with one row per sample, in dataset order; None elsewhere.
    """
    net = unwrap_model(model)
    device = model_device(net)
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=EvalSampler(cast(Sized, dataset)), num_workers=num_workers
    )
    pick = input_transform or (lambda b: b[0] if isinstance(b, (list, tuple)) else b)
    broadcast_buffers(net)  # every rank predicts with the statistics rank 0 saves
    was_training = net.training
    net.eval()
    outputs: list[torch.Tensor] = []
    with torch.no_grad(), swapped_in(net), gathered_parameters(net):  # shards differ in batches: forwards stay local
        for batch in loader:
            x = pick(batch)
            x = x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
            outputs.append(net(x).detach().cpu())
    net.train(was_training)
    local = torch.cat(outputs) if outputs else None
    if not is_distributed():
        return local
    shards: list[Any] | None = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(local, shards, dst=0)
    if shards is None:
        return None
    world = get_world_size()
    present = [s for s in shards if s is not None]
    if not present:
        return None
    result = present[0].new_empty((len(dataset), *present[0].shape[1:]))  # type: ignore[arg-type]  # a map-style Dataset: sized, though torch's type does not say so
    for rank, shard in enumerate(shards):
        if shard is not None:
            result[rank::world] = shard  # EvalSampler: rank r holds samples r, r + world, ...
    return result
