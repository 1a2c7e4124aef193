"""The mean of a loss function over an evaluation."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from unison.distributed.batches import count_items
from unison.metrics.base import SumMetric
from unison.metrics.batch_loss import BatchLoss


def _items(y: Any) -> int:
    """Samples in a target: graphs of a graph batch, else its first dimension, else ``len``."""
    count = count_items(y)
    return len(y) if count is None else count


_NO_BATCH = object()


class Loss(SumMetric):
    """The mean of ``loss_fn(y_pred, y)`` over all samples, weighted by batch size.

    ``loss_fn`` returns the batch mean (PyTorch's default ``reduction="mean"``); the state is
    (sum of batch mean x batch size, number of samples), so batches of different sizes, and
    ranks with different numbers of samples, weigh what they hold.

    A :class:`~unison.metrics.BatchLoss` is called ``loss_fn(y_pred, batch)`` with the whole
    batch, which the evaluator's output carries (a :class:`~unison.metrics.BatchOutput`:
    :func:`~unison.engine.create_evaluator` gives one to the metrics that ask for it). Its
    samples are counted in the target ``y``, or in the batch when it has no target.

    Args:
        loss_fn: ``loss_fn(y_pred, y) -> scalar tensor``, or a ``BatchLoss``.
        batch_size: ``fn(y) -> int``, the number of samples in a batch; default, the graphs
            of a graph batch (``num_graphs``), else the target's first dimension.
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
        batch_size: Callable[[Any], int] = _items,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | torch.device = "cpu",
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"Loss(loss_fn=...) must be callable, got {type(loss_fn).__name__}.")
        self.loss_fn = loss_fn
        self.batch_size = batch_size
        super().__init__(output_transform=output_transform, device=device)

    @property
    def takes_batch(self) -> bool:
        """Whether the criterion reads the whole batch: the evaluator then hands it over."""
        return isinstance(self.loss_fn, BatchLoss)

    def batch_state(self, output: Any) -> torch.Tensor:
        y_pred, y = output
        if isinstance(self.loss_fn, BatchLoss):
            batch = getattr(output, "batch", _NO_BATCH)
            if batch is _NO_BATCH:
                raise ValueError(
                    f"Loss({self.loss_fn!r}) needs the whole batch, but got a {type(output).__name__} without one. "
                    "Build the evaluator with unison.engine.create_evaluator, which hands the batch to this "
                    "metric (a BatchOutput), and keep it through output_transform: return "
                    "BatchOutput(y_pred, y, batch=output.batch)."
                )
            value = self.loss_fn(y_pred, batch)
            counted = batch if y is None else y
        else:
            value = self.loss_fn(y_pred, y)
            counted = y
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValueError(
                f"Loss: loss_fn must return a scalar tensor (reduction='mean'), got "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}."
            )
        n = float(self.batch_size(counted))
        total = value.detach().reshape(()).to(torch.float64) * n
        return torch.stack([total, torch.full((), n, dtype=torch.float64, device=total.device)])

    def compute_from(self, state: torch.Tensor) -> float:
        total, count = state.tolist()
        if count == 0:
            raise self._not_computable()
        return total / count


class Perplexity(Loss):
    """``exp`` of the mean per-token loss: the perplexity of a language model.

    The state is (sum of per-token losses, number of tokens counted), where a token is
    counted exactly when the loss counts it: targets equal to ``ignore_index`` (padding,
    -100 by default, as in PyTorch's cross-entropy) are left out of both. Batches with
    different numbers of real tokens therefore weigh what they hold, and the count stays on
    the device (no host read per batch). ``loss_fn`` defaults to cross-entropy over scores
    of shape ``(N, C, T)`` and targets ``(N, T)`` with the same ``ignore_index``; a custom
    ``loss_fn`` must return the mean over the tokens that are not ``ignore_index``.

    Args:
        loss_fn: ``loss_fn(scores, targets) -> scalar``, the mean over counted tokens.
        ignore_index: the target value that marks a token not to count.
        output_transform: maps the engine's output to ``(scores, targets)``.
        device: where the state is kept.

    Example:
        >>> import torch
        >>> ppl = Perplexity()
        >>> ppl.update((torch.zeros(1, 4, 3), torch.tensor([[0, 1, -100]])))
        >>> round(ppl.compute(), 6)  # uniform over 4 classes; the padding is not counted
        4.0
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        ignore_index: int = -100,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"Perplexity(ignore_index=...) must be an int, got {ignore_index!r}.")
        self.ignore_index = ignore_index
        super().__init__(
            loss_fn if loss_fn is not None else functools.partial(F.cross_entropy, ignore_index=ignore_index),
            output_transform=output_transform,
            device=device,
        )

    def batch_state(self, output: Any) -> torch.Tensor:
        scores, targets = output
        value = self.loss_fn(scores, targets)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValueError("Perplexity: loss_fn must return a scalar tensor (the mean over counted tokens).")
        count = (targets != self.ignore_index).sum().to(torch.float64)
        # A batch of padding only: the loss's mean is NaN, and it adds nothing.
        total = torch.where(count > 0, value.detach().reshape(()).to(torch.float64) * count, 0.0)
        return torch.stack([total, count])

    def compute_from(self, state: torch.Tensor) -> float:
        return math.exp(super().compute_from(state))
