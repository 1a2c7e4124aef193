"""The mean of a loss function over an evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from unison.metrics.base import SumMetric


class Loss(SumMetric):
    """The mean of ``loss_fn(y_pred, y)`` over all samples, weighted by batch size.

    ``loss_fn`` returns the batch mean (PyTorch's default ``reduction="mean"``); the state is
    (sum of batch mean x batch size, number of samples), so batches of different sizes, and
    ranks with different numbers of samples, weigh what they hold.

    Args:
        loss_fn: ``loss_fn(y_pred, y) -> scalar tensor``.
        batch_size: ``fn(y) -> int``, the number of samples in a batch; default ``len``.
        output_transform: maps the engine's output to ``(y_pred, y)``.

    Example:
        >>> import torch
        >>> loss = Loss(torch.nn.functional.l1_loss)
        >>> loss.update((torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])))
        >>> loss.compute()
        1.0
    """

    state_size = 2

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        batch_size: Callable[[Any], int] = len,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | torch.device = "cpu",
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"Loss(loss_fn=...) must be callable, got {type(loss_fn).__name__}.")
        self.loss_fn = loss_fn
        self.batch_size = batch_size
        super().__init__(output_transform=output_transform, device=device)

    def batch_state(self, output: Any) -> torch.Tensor:
        y_pred, y = output
        value = self.loss_fn(y_pred, y)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValueError(
                f"Loss: loss_fn must return a scalar tensor (reduction='mean'), got "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}."
            )
        n = float(self.batch_size(y))
        total = value.detach().reshape(()).to(torch.float64) * n
        return torch.stack([total, torch.full((), n, dtype=torch.float64, device=total.device)])

    def compute_from(self, state: torch.Tensor) -> float:
        total, count = state.tolist()
        if count == 0:
            raise self._not_computable()
        return total / count


class Perplexity(Loss):
    """``exp`` of the mean per-token loss: the perplexity of a language model.

    The state counts every target element (token), so batches of different lengths weigh
    what they hold. ``loss_fn`` defaults to cross-entropy over scores of shape
    ``(N, C, T)`` and targets ``(N, T)``.

    Example:
        >>> import torch
        >>> ppl = Perplexity()
        >>> ppl.update((torch.zeros(1, 4, 3), torch.tensor([[0, 1, 2]])))
        >>> round(ppl.compute(), 6)  # uniform over 4 classes
        4.0
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(
            loss_fn if loss_fn is not None else torch.nn.functional.cross_entropy,
            batch_size=lambda y: y.numel(),
            output_transform=output_transform,
            device=device,
        )

    def compute_from(self, state: torch.Tensor) -> float:
        return math.exp(super().compute_from(state))
