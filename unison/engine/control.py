"""Stop requests that any rank may make and all ranks agree on at a sync point."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from unison.distributed.primitives import get_rank, get_world_size


@dataclass
class StopDecision:
    """What the ranks agreed at a sync point."""

    ranks: list[int]
    """The ranks that asked."""
    epoch_only: bool
    """True when only the current epoch ends (``terminate_epoch``)."""
    reasons: dict[int, list[str]] = field(default_factory=dict)
    """Each asking rank's reasons, filled in when the engine gathers them."""


class StopRequests:
    """The engine's own contributor to its sync points: who asked to stop.

    Each rank adds a one-hot row (its rank) for a stop request and one for an
    end-of-epoch request; after the sum, every rank knows which ranks asked, and takes the
    same decision.
    """

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.epoch_reasons: list[str] = []
        self.decision: StopDecision | None = None

    def clear(self) -> None:
        self.reasons.clear()
        self.epoch_reasons.clear()
        self.decision = None

    def sync_state(self) -> torch.Tensor:
        world, rank = get_world_size(), get_rank()
        state = torch.zeros(2 * world, dtype=torch.float64)
        if self.reasons:
            state[rank] = 1.0
        if self.epoch_reasons:
            state[world + rank] = 1.0
        return state

    def load_synced_state(self, state: torch.Tensor) -> None:
        world = get_world_size()
        values = state.tolist()  # one read, not one per element
        stop = [r for r in range(world) if values[r] > 0]
        epoch = [r for r in range(world) if values[world + r] > 0]
        if stop:
            self.decision = StopDecision(ranks=stop, epoch_only=False)
        elif epoch:
            self.decision = StopDecision(ranks=epoch, epoch_only=True)

    def state_dict(self) -> dict[str, Any]:
        return {"reasons": list(self.reasons), "epoch_reasons": list(self.epoch_reasons)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reasons = list(state.get("reasons", []))
        self.epoch_reasons = list(state.get("epoch_reasons", []))
