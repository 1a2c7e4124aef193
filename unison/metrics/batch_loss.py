"""A criterion that reads the whole batch, and the evaluator output that carries it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class BatchLoss:
    """Marks a criterion that is called ``loss_fn(y_pred, batch)``, with the whole batch.

    Most criteria compare the prediction with a target: ``loss_fn(y_pred, y)``. Some read
    more of the batch (a graph network's loss reading ``batch.y`` and node masks, a
    language model's reading the attention mask): wrap them once, and pass the wrapper
    wherever the criterion goes. The trainer (:func:`~unison.engine.create_trainer`) then
    calls it with the batch on the device, and the :class:`~unison.metrics.Loss` metric
    with the batch the evaluator hands it (a :class:`BatchOutput`). Calling the wrapper
    calls the criterion with the same arguments.

    With ``with_trainer``, training calls ``loss_fn(y_pred, batch, trainer)``: the training
    :class:`~unison.engine.Engine` is the third argument (its ``state`` holds the epoch and
    iteration), as QuantumGrav's trainer passes itself to ``compute_loss(outputs, data,
    trainer)``. Evaluation always calls ``loss_fn(y_pred, batch)``.

    Args:
        loss_fn: ``loss_fn(y_pred, batch) -> scalar tensor``, the mean over the batch.
        with_trainer: pass the trainer as a third argument in training.

    Example:
        >>> import torch
        >>> def compute_loss(y_pred, batch):
        ...     return torch.nn.functional.mse_loss(y_pred, batch["y"])
        >>> criterion = BatchLoss(compute_loss)
        >>> float(criterion(torch.ones(2), {"y": torch.zeros(2)}))
        1.0
    """

    loss_fn: Callable[..., torch.Tensor]
    """The criterion, called ``loss_fn(y_pred, batch)``."""

    with_trainer: bool
    """Whether training passes the trainer as a third argument."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], with_trainer: bool = False) -> None:
        if isinstance(loss_fn, BatchLoss):  # wrapping twice changes nothing
            with_trainer = with_trainer or loss_fn.with_trainer
            loss_fn = loss_fn.loss_fn
        if not callable(loss_fn):
            raise TypeError(
                f"BatchLoss(loss_fn=...) must be callable as loss_fn(y_pred, batch), got "
                f"{type(loss_fn).__name__}: {loss_fn!r}."
            )
        self.loss_fn = loss_fn
        self.with_trainer = bool(with_trainer)

    def __call__(self, y_pred: Any, batch: Any, *trainer: Any) -> torch.Tensor:
        return self.loss_fn(y_pred, batch, *trainer)

    def __repr__(self) -> str:
        extra = ", with_trainer=True" if self.with_trainer else ""
        return f"BatchLoss({getattr(self.loss_fn, '__qualname__', self.loss_fn)!r}{extra})"


class BatchOutput(tuple[Any, Any]):
    """An evaluator's output ``(y_pred, y)`` that also holds the batch it came from.

    It unpacks as the pair every metric takes (``y_pred, y = output``); ``output.batch`` is
    the whole batch on the device, for a :class:`~unison.metrics.Loss` of a :class:`BatchLoss`.

    Example:
        >>> out = BatchOutput(1, 2, batch={"y": 2})
        >>> y_pred, y = out
        >>> (y_pred, y, out.batch)
        (1, 2, {'y': 2})
    """

    batch: Any

    def __new__(cls, y_pred: Any, y: Any, batch: Any) -> BatchOutput:
        output = super().__new__(cls, (y_pred, y))
        output.batch = batch
        return output

    def __getnewargs__(self) -> tuple[Any, Any, Any]:  # copies and pickles keep the batch
        return (self[0], self[1], self.batch)
