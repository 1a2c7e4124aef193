"""Small models, deterministic data and bookkeeping shared by the engine tests."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

D_IN, D_HIDDEN, D_OUT = 6, 16, 3


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A two-layer MLP whose initial weights depend on ``seed`` only."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT)).to(dtype)
    torch.random.set_rng_state(gen_state)
    return model


def regression_rows(
    n: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of inputs and targets drawn from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=gen, dtype=dtype)
    y = torch.randn(n, D_OUT, generator=gen, dtype=dtype)
    return x, y


def shard_batches(
    x: torch.Tensor, y: torch.Tensor, *, n_batches: int, per_rank: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: batch ``i`` holds rows ``[i*G + rank*per_rank, ... + per_rank)``.

    ``G = per_rank * world_size`` is the global batch.

    With ``world_size=1`` and ``per_rank=G`` this is the single-process batch ``i``, rows
    ``[i*G, (i+1)*G)``, whose two halves are exactly batch ``i`` of ranks 0 and 1 of a 2-rank run.
    """
    global_batch = per_rank * world_size
    out = []
    for i in range(n_batches):
        start = i * global_batch + rank * per_rank
        out.append((x[start : start + per_rank].clone(), y[start : start + per_rank].clone()))
    return out


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])


def window_of(iteration: int, epoch_length: int, k: int) -> range:
    """0-based positions, within the epoch, of the accumulation window that ends at ``iteration``.

    The specification: windows of ``k`` iterations restart at each epoch; the last one of an
    epoch is shorter when ``epoch_length`` is not a multiple of ``k``.
    """
    position = (iteration - 1) % epoch_length
    start = (position // k) * k
    return range(start, position + 1)


def manual_window_grad(
    module: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The gradient of the mean of ``loss_fn`` over ``batches``, on a copy of ``module``."""
    clone = copy.deepcopy(module)
    clone.zero_grad(set_to_none=True)
    total = sum(loss_fn(clone(x), y) for x, y in batches) / len(batches)
    total.backward()
    return flat_grads(clone)
