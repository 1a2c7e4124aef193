"""ignite's epoch metrics (ROC AUC, average precision, ...) made exact on unpadded shards."""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from ignite.exceptions import NotComputableError
from ignite.metrics import EpochMetric

from unison.distributed.primitives import all_gather_rows

_MARK = "_unison_gathered"


def exact_epoch_metric(metric: EpochMetric) -> EpochMetric:
    """Makes an ignite ``EpochMetric`` exact on uneven evaluation shards; returns it.

    An epoch metric keeps every prediction and target and computes on all of them at the
    end (ROC AUC, average precision, precision-recall curves, Cohen's kappa, rank
    correlations, median errors). ignite gathers them with a fixed-size ``all_gather``,
    which crashes when ranks hold different numbers of samples (unpadded shards, as
    unison's evaluation uses) and raises on a rank that holds none. This replaces the
    metric's ``compute`` so that the ranks' rows are gathered whatever their count, and
    ``compute_fn`` runs on every rank over all of them: the result is the one-process
    result, at any world size. :func:`~unison.engine.create_evaluator` applies it to
    every ``EpochMetric`` it is given.

    Args:
        metric: an ignite ``EpochMetric`` (or a subclass such as ``ROC_AUC``).

    Distributed:
        ``compute`` becomes a collective (one ``all_gather_object`` per call), as ignite's
        already was: every rank computes at the same event.
    """
    if not isinstance(metric, EpochMetric):
        raise TypeError(f"exact_epoch_metric needs an ignite EpochMetric, got {type(metric).__name__}.")
    if not vars(metric).get(_MARK, False):  # getattr would not do: Metric.__getattr__ answers anything
        metric.compute = types.MethodType(_compute, metric)  # type: ignore[method-assign]  # per instance, by design
        setattr(metric, _MARK, True)
    return metric


def _gather(parts: list[torch.Tensor]) -> torch.Tensor | None:
    rows = [t for t in all_gather_rows(torch.cat(parts, dim=0) if parts else None) if t is not None]
    return torch.cat(rows, dim=0) if rows else None


def _compute(self: EpochMetric) -> Any:
    if self._result is None:
        predictions = _gather(self._predictions)
        targets = _gather(self._targets)
        if predictions is None or targets is None or len(predictions) == 0:
            raise NotComputableError(
                f"{type(self).__name__} must have at least one example before it can be computed (no rank had one)."
            )
        self._result = self.compute_fn(predictions, targets)
    return cast(Any, self._result)
