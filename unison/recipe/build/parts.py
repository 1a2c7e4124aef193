"""What a run is made of on each rank: :class:`RunParts`, filled by the build steps
(:mod:`unison.recipe.build.assemble`), and the :class:`Datasets` they start from.

It sits below every module that reads the parts (tracking, the test phase, the values a
resume applies), so none of them imports the steps that make them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from unison.engine import Engine
from unison.handlers import EMA, Checkpoint


@dataclass
class Datasets:
    """The datasets ``data.build`` returned; ``test`` is None when it returned two."""

    train: Any
    val: Any
    test: Any = None


@dataclass
class RunParts:
    """What the build steps make, step by step; every rank holds the same parts.

    Attributes:
        datasets: the datasets of :func:`~unison.recipe.build.assemble.build_datasets`.
        train_loader: the training loader of this rank (:func:`~unison.recipe.build.assemble.build_loaders`).
        val_loader: the validation loader of this rank, sharded without padding.
        model: the model on its device, wrapped for the world size (:func:`~unison.recipe.build.assemble.build_model`).
        optimizer: the optimizer over the model's parameters (:func:`~unison.recipe.build.assemble.build_optimizer`).
        scheduler: the learning-rate scheduler, or None.
        trainer: the training engine (:func:`~unison.recipe.build.assemble.build_trainer`).
        evaluator: the validation engine (:func:`~unison.recipe.build.assemble.build_evaluator`).
        watched: the validation metric that checkpoints, early stopping and a
            ``ReduceLROnPlateau`` scheduler watch.
        history: one row per validation, appended by the handler of :func:`~unison.recipe.build.assemble.attach_validation`
            (from the run's start: a resumed run restores the rows it has, :mod:`unison.recipe.build.history`).
        checkpoint: the checkpoint handler, None when ``checkpoint.enabled`` is false.
        ema: the average of the weights (``training.ema``), or None (:mod:`unison.recipe.build.ema_weights`).
        handlers: the user's handlers with a state, by checkpoint name (:mod:`unison.recipe.build.user_handlers`).
        attach_to_tester: attaches the user's ``to: testing`` handlers to the test phase's evaluator.
        early_stopping: the early-stopping handler (``early_stopping.patience``), or None.
    """

    datasets: Datasets
    train_loader: DataLoader | None
    val_loader: DataLoader | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    trainer: Engine
    evaluator: Engine
    watched: str
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Checkpoint | None = None
    ema: EMA | None = None
    handlers: dict[str, Any] = field(default_factory=dict)
    early_stopping: Any = None
    attach_to_tester: Callable[[Engine], None] | None = None


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are single numbers, as floats: what ``metrics.json``, the history and the
    log lines show. A metric computing an ``int`` (a count) is one; a tensor, a list or a bool is not.

    Example:
        >>> scalar_metrics({"accuracy": 0.5, "graphs": 11, "confusion": [[1, 0], [0, 1]], "flag": True})
        {'accuracy': 0.5, 'graphs': 11.0}
    """
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
