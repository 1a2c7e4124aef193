"""One-hot rows: how a handler tells, through a sum all-reduce, what each rank saw."""

from __future__ import annotations

import torch

from unison.distributed.primitives import get_rank, get_world_size


def rank_row(*values: float) -> torch.Tensor:
    """``len(values)`` rows of ``world_size`` zeros, this rank's column holding ``values``.

    After a sum across ranks, row ``i`` column ``r`` is rank ``r``'s ``values[i]``.
    """
    world = get_world_size()
    state = torch.zeros(len(values) * world, dtype=torch.float64)
    for i, value in enumerate(values):
        state[i * world + get_rank()] = float(value)
    return state


def split_rows(state: torch.Tensor, rows: int) -> list[list[float]]:
    """The rows of a reduced :func:`rank_row` state, as lists indexed by rank."""
    return [chunk.tolist() for chunk in state.reshape(rows, get_world_size())]
