"""Metrics whose state is a vector of sums, reduced across ranks by adding."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from ignite.exceptions import NotComputableError
from ignite.metrics import Metric

from unison.distributed.primitives import all_reduce_sum


class SumMetric(Metric):
    """Base of unison's metrics: the state is ``state_size`` float64 sums.

    Sums (of correct predictions, of squared errors, of samples) add up across ranks, so
    the reduced state is the state a single process would have had over the whole
    dataset, and the metric is exact at any world size. A rank with no samples holds
    zeros. The state lives on the device of the data: updating adds on the device and
    reads nothing back to the host.

    Subclasses implement :meth:`batch_state` (the sums of one batch) and
    :meth:`compute_from` (the value from reduced sums).

    Used alone (``metric.attach(engine, name)``, as any ignite metric), ``compute()`` reduces
    this metric's state with one all-reduce. Inside :func:`~unison.engine.create_evaluator`
    all unison metrics share a single all-reduce instead.

    Args:
        output_transform: maps the engine's output to what :meth:`update` takes.
        device: kept for ignite compatibility; the state follows the data's device.
    """

    state_size: int = 0
    """Number of sums in the state."""

    def __init__(
        self, output_transform: Callable[[Any], Any] = lambda x: x, device: str | torch.device = "cpu"
    ) -> None:
        self._sums: torch.Tensor | None = None
        super().__init__(output_transform=output_transform, device=device)

    def reset(self) -> None:
        self._sums = None

    @abstractmethod
    def batch_state(self, output: Any) -> torch.Tensor:
        """The sums of one batch, a 1-D tensor of ``state_size`` elements on the data's device."""

    @abstractmethod
    def compute_from(self, state: torch.Tensor) -> Any:
        """The metric's value from ``state``, the sums over every sample of every rank."""

    def update(self, output: Any) -> None:
        sums = self.batch_state(output).detach().to(torch.float64)
        if sums.shape != (self.state_size,):
            raise RuntimeError(
                f"{type(self).__name__}.batch_state returned shape {tuple(sums.shape)}, "
                f"expected ({self.state_size},)."
            )
        if self._sums is None:
            self._sums = sums.clone()
        else:
            self._sums.add_(sums)

    def sync_state(self) -> torch.Tensor:
        """This rank's sums; zeros when it saw no batch."""
        if self._sums is None:
            return torch.zeros(self.state_size, dtype=torch.float64)
        return self._sums

    def load_synced_state(self, state: torch.Tensor) -> None:
        self._sums = state

    def compute(self) -> Any:
        """Collective when distributed: call on every rank. Reduces this metric alone."""
        (state,) = all_reduce_sum([self.sync_state()])
        return self.compute_from(state)

    def _not_computable(self) -> NotComputableError:
        return NotComputableError(
            f"{type(self).__name__} must have at least one example before it can be computed: no rank "
            "updated it during the run (is the evaluation data empty?)."
        )
