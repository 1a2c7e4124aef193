"""The validation metric a run watches, and which way is better: the one rule.

Checkpoint ranking and a ``ReduceLROnPlateau`` scheduler watch ``checkpoint.metric`` (left
out: the first of ``validation.metrics``, or ``loss`` without any), ranked by
``checkpoint.mode`` (left out: ``min`` for a loss-like name, else ``max``); early stopping
watches ``early_stopping.metric`` and ``.mode``, each defaulting to the checkpoint's (another
metric's mode left out follows its name the same way); ``tuning.metric`` defaults to the
checkpoint's metric, and its direction to the checkpoint's mode. Validation refuses a mode
that contradicts its metric's name and writes nothing; the run's plan derives the modes once
(``RunPlan.watched``); the tuning checks read the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

from unison.config.checks_base import metric_direction
from unison.config.schema import Config

Mode = Literal["max", "min"]


@dataclass(frozen=True)
class Watched:
    """The metric checkpoints rank by (``metric``, ``mode``) and the one early stopping follows."""

    metric: str
    mode: Mode
    stop_metric: str
    stop_mode: Mode


def watched_of(config: Config, names: Sequence[str] = ()) -> Watched:
    """The watched metrics of ``config``, whose validation metrics are ``names`` (what the run
    resolved; left out, the keys of ``validation.metrics``).

    Example:
        >>> from unison.config import Config
        >>> c = Config()
        >>> c.validation.metrics = {"accuracy": None, "loss": None}
        >>> c.checkpoint.mode, c.early_stopping.metric = "max", "loss"
        >>> c.early_stopping.mode = "min"
        >>> watched_of(c)
        Watched(metric='accuracy', mode='max', stop_metric='loss', stop_mode='min')
        >>> watched_of(Config())  # no metrics: the loss, lower is better
        Watched(metric='loss', mode='min', stop_metric='loss', stop_mode='min')
    """
    names = list(names) or [str(name) for name in config.validation.metrics] or ["loss"]
    metric = config.checkpoint.metric or names[0]
    mode = cast(Mode, config.checkpoint.mode or metric_direction(metric) or "max")
    es = config.early_stopping
    stop_metric = es.metric or metric
    stop_mode = es.mode or (mode if stop_metric == metric else metric_direction(stop_metric) or "max")
    return Watched(metric, mode, stop_metric, cast(Mode, stop_mode))
