"""Stops every rank when a loss turns NaN or infinite on any of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine, Events

from unison.handlers.synced import SyncedHandler

_COMPACT_AFTER = 4096


class NonFiniteGuard(SyncedHandler):
    """Stops all ranks at the next sync point after a non-finite loss on any rank.

    Each iteration keeps a reference to the loss tensor: no kernel, no host sync. At the
    sync point the kept losses are checked together, and the first non-finite iteration
    of each rank travels in the engine's collective; every rank then stops at the same
    iteration, and rank 0's log names the ranks and iterations. (A rank that skipped its
    backward pass on a NaN instead would leave the others waiting in DDP's all-reduce.)

    Args:
        output_transform: picks the loss from ``engine.state.output``.

    Example:
        .. code-block:: python

            NonFiniteGuard().attach(trainer)

    Distributed:
        Attach it on every rank of a unison Engine.
    """

    def __init__(self, output_transform: Callable[[Any], Any] = lambda output: output) -> None:
        super().__init__()
        self.output_transform = output_transform
        self._losses: list[torch.Tensor] = []
        self._iterations: list[int] = []
        self._first_bad: torch.Tensor | None = None  # device scalar: first bad iteration, or inf
        self.report: dict[int, int] = {}
        """After a stop: rank -> first iteration with a non-finite loss."""

    def _record(self, engine: Engine) -> None:
        loss = self.output_transform(engine.state.output)
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
            self._iterations.append(engine.state.iteration)
        elif loss != loss or loss in (float("inf"), float("-inf")):  # a Python number: free to check
            self._fold(torch.tensor(float(engine.state.iteration), dtype=torch.float64))
        if len(self._losses) >= _COMPACT_AFTER:
            self._compact()

    def _compact(self) -> None:
        """Folds the kept losses into one device scalar, without reading them."""
        if not self._losses:
            return
        bad = ~torch.isfinite(torch.stack([t.reshape(()).float() for t in self._losses]))
        its = torch.tensor(self._iterations, dtype=torch.float64).to(bad.device, non_blocking=True)
        self._fold(torch.where(bad, its, torch.full_like(its, float("inf"))).min())
        self._losses.clear()
        self._iterations.clear()

    def _fold(self, first: torch.Tensor) -> None:
        if self._first_bad is None:
            self._first_bad = first
        else:
            self._first_bad = torch.minimum(self._first_bad.to(first.device), first)

    def attach_events(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._record)

    def local_values(self) -> tuple[float]:
        self._compact()
        first = -1.0
        if self._first_bad is not None:
            value = float(self._first_bad.item())  # read at the sync point only
            first = value if value != float("inf") else -1.0
        return (first,)

    def on_agreed(self, values: list[list[float]]) -> str | None:
        (firsts,) = values
        self._first_bad = None
        bad = {rank: int(it) for rank, it in enumerate(firsts) if it >= 0}
        if not bad:
            return None
        self.report = bad
        where = ", ".join(f"rank {r} at iteration {it}" for r, it in sorted(bad.items()))
        return f"non-finite loss on {where}"
