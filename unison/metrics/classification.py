"""Classification metrics with sum states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unison.metrics.base import SumMetric


class Accuracy(SumMetric):
    """Top-k accuracy: the fraction of samples whose target is among the k highest scores.

    ``update`` takes ``(y_pred, y)``: scores of shape ``(N, C)`` (or ``(N, C, d1, ...)``,
    one prediction per position) and integer targets of shape ``(N,)`` (or
    ``(N, d1, ...)``). State: (correct, count).

    Args:
        top_k: how many of the highest scores count as a hit; 1 is plain accuracy.
        output_transform: maps the engine's output to ``(y_pred, y)``.

    Example:
        >>> import torch
        >>> acc = Accuracy()
        >>> acc.update((torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])))
        >>> acc.compute()
        0.5
    """

    state_size = 2

    def __init__(
        self,
        top_k: int = 1,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"Accuracy(top_k={top_k!r}) must be an int >= 1.")
        self.top_k = top_k
        super().__init__(output_transform=output_transform, device=device)

    def batch_state(self, output: Any) -> torch.Tensor:
        y_pred, y = output
        if y_pred.ndim != y.ndim + 1 or y_pred.shape[0] != y.shape[0] or y_pred.shape[2:] != y.shape[1:]:
            raise ValueError(
                f"Accuracy expects y_pred of shape (N, C, ...) and y of shape (N, ...); got y_pred "
                f"{tuple(y_pred.shape)} and y {tuple(y.shape)}. For binary scores of shape (N,), "
                "stack them into two columns or threshold them into class indices first."
            )
        if self.top_k > y_pred.shape[1]:
            raise ValueError(f"Accuracy(top_k={self.top_k}) but y_pred has only {y_pred.shape[1]} classes.")
        if self.top_k == 1:
            hits = y_pred.argmax(dim=1) == y
        else:
            top = y_pred.topk(self.top_k, dim=1).indices
            hits = (top == y.unsqueeze(1)).any(dim=1)
        correct = hits.sum(dtype=torch.float64)
        return torch.stack(
            [correct, torch.full((), float(y.numel()), dtype=torch.float64, device=correct.device)]
        )

    def compute_from(self, state: torch.Tensor) -> float:
        correct, count = state.tolist()
        if count == 0:
            raise self._not_computable()
        return correct / count
