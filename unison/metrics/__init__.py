"""Metrics whose states are sums, exact at any world size and reduced in one collective."""

from unison.metrics.base import SumMetric
from unison.metrics.batch_loss import BatchLoss, BatchOutput
from unison.metrics.classification import Accuracy
from unison.metrics.epoch_average import EpochAverage
from unison.metrics.gathered import exact_epoch_metric
from unison.metrics.group import MetricGroup
from unison.metrics.loss import Loss, Perplexity
from unison.metrics.regression import MeanAbsoluteError, MeanSquaredError

__all__ = [
    "Accuracy",
    "BatchLoss",
    "BatchOutput",
    "EpochAverage",
    "Loss",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "MetricGroup",
    "Perplexity",
    "SumMetric",
    "exact_epoch_metric",
]
