"""Replicated state under sharding: every rank holds rank 0's copy.

FSDP2 shards parameters only. Buffers (BatchNorm's running statistics and its batch
counter) stay whole on every rank and, in training mode, each rank's follow its own
batches, so the ranks' copies drift apart. Distributed Checkpoint (DCP) treats a plain
(not DTensor) tensor as replicated: it stores one copy, from whichever rank its planner
picks. Saved that way, a resume starts from some rank's statistics while the
uninterrupted run goes on with rank 0's, and an export holds statistics that were never
evaluated.

The rule is DDP's: rank 0's buffers are the model's. DDP broadcasts them at the start of
every training forward (``broadcast_buffers=True``); since a training forward reads the
batch's statistics, not the running ones, the only copy that matters between forwards is
rank 0's, which no broadcast changes. So sharded training agrees instead where buffers are
read: before every sharded save (:func:`agree_replicated`), and before every evaluation
(the evaluator's and ``predict``'s ``broadcast_buffers``; the EMA's average of buffers
when it is swapped in). Rank 0's values are then identical to what a per-forward broadcast
would give, with no collective on the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unison.distributed.fsdp import is_dtensor
from unison.distributed.primitives import broadcast_tensors


def replicated_tensors(state: Any) -> list[torch.Tensor]:
    """Every plain tensor in ``state`` (a tensor, or mappings, lists and tuples of them), in order,
    each once; DTensors (the shards) and empty tensors are left out."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if not is_dtensor(value) and value.numel() and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(state)
    return found


def agree_replicated(state: Any, src: int = 0) -> int:
    """Collective: call on every rank. Every plain tensor in ``state`` takes rank ``src``'s value, in
    place; the DTensors (each rank's own shards) are left as they are.

    Called on the states of every sharded save: DCP keeps one copy of a plain tensor, and
    with this it is rank 0's, on every rank (a model's ``get_model_state_dict`` holds its
    live buffers, so the model's own buffers agree too).

    Returns:
        How many tensors were broadcast (0 at world size 1).
    """
    return broadcast_tensors(replicated_tensors(state), src)
