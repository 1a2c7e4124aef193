"""Regression metrics with sum states."""

from __future__ import annotations

import torch

from unison.metrics.base import SumMetric


def _check_pair(name: str, y_pred: torch.Tensor, y: torch.Tensor) -> None:
    if y_pred.shape != y.shape:
        raise ValueError(
            f"{name} expects y_pred and y of the same shape, got {tuple(y_pred.shape)} and {tuple(y.shape)}. "
            "A model with one output gives (N, 1): reshape the target with y.view(-1, 1), or the "
            "prediction with y_pred.squeeze(1), in output_transform."
        )


class _ElementwiseError(SumMetric):
    state_size = 2

    def _errors(self, diff: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def batch_state(self, output: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y_pred, y = output
        _check_pair(type(self).__name__, y_pred, y)
        total = self._errors(y_pred.to(torch.float64) - y.to(torch.float64)).sum()
        return torch.stack(
            [total, torch.full((), float(y.numel()), dtype=torch.float64, device=total.device)]
        )

    def compute_from(self, state: torch.Tensor) -> float:
        total, count = state.tolist()
        if count == 0:
            raise self._not_computable()
        return total / count


class MeanSquaredError(_ElementwiseError):
    """Mean of ``(y_pred - y) ** 2`` over every element. State: (sum of squares, count).

    For targets of shape ``(N, D)`` this divides by ``N x D`` (the mean of PyTorch's
    ``mse_loss``), where ignite's ``MeanSquaredError`` divides by ``N`` and so reports ``D``
    times more.

    Example:
        >>> import torch
        >>> mse = MeanSquaredError()
        >>> mse.update((torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])))
        >>> mse.compute()
        2.0
    """

    def _errors(self, diff: torch.Tensor) -> torch.Tensor:
        return diff.square()


class MeanAbsoluteError(_ElementwiseError):
    """Mean of ``|y_pred - y|`` over every element. State: (sum of absolute errors, count).

    Divides by the number of elements, like PyTorch's ``l1_loss`` (ignite's divides by rows).

    Example:
        >>> import torch
        >>> mae = MeanAbsoluteError()
        >>> mae.update((torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])))
        >>> mae.compute()
        1.0
    """

    def _errors(self, diff: torch.Tensor) -> torch.Tensor:
        return diff.abs()
