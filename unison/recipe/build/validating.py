"""Validation in a run, on each rank: the evaluator with the plan's metrics, its run every
``validation.every`` epochs (a row of the history each time), and the scheduler that steps after it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from unison.config import ConfigError
from unison.engine import Engine, Events, UpdateEvents, create_evaluator
from unison.recipe.build.history import RunHistory
from unison.recipe.build.parts import RunParts, scalar_metrics
from unison.recipe.planning.batch import batch_options
from unison.recipe.planning.resolved import build_metrics
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import get_logger

_log = get_logger("unison.recipe.run")  # the run's logger


def build_evaluator(plan: RunPlan, model: nn.Module) -> tuple[Engine, str]:
    """Evaluator: the validation engine with fresh metrics, and the metric the run watches.

    Returns:
        ``(evaluator, watched)``: ``watched`` is ``checkpoint.metric``, default the first
        validation metric.

    Raises:
        ConfigError: ``checkpoint.metric`` names no validation metric.
    """
    metrics = build_metrics(plan.metrics["validation"])
    evaluator = create_evaluator(
        model, metrics, amp=plan.amp, **batch_options(plan.resolved.batches, "validation")
    )
    watched = plan.watched.metric
    if watched not in metrics:
        raise ConfigError(
            f"no validation metric named {watched!r}; metrics: {sorted(metrics)}",
            key=["checkpoint", "metric"],
        )
    return evaluator, watched


def attach_validation(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """Evaluator, wired: evaluates every ``validation.every`` epochs and at the last one.

    Each evaluation appends a row (epoch, training loss, ``val_<metric>``) to
    ``parts.history`` (and ``<run>/history.jsonl``, so a resumed run's history is complete:
    :mod:`unison.recipe.build.history`) and logs one line.

    Distributed:
        Every rank attaches it: evaluating is a collective.
    """
    evaluator, history = parts.evaluator, RunHistory(run_dir, parts.history)
    history.attach(parts.trainer)
    every = plan.control.validate_every

    def validate(engine: Engine) -> None:
        if engine.state.epoch % every and engine.state.epoch != engine.state.max_epochs:
            return
        values = scalar_metrics(evaluator.run(parts.val_loader).metrics)
        row = {"epoch": engine.state.epoch, "train_loss": engine.state.metrics.get("loss")}
        row.update({f"val_{k}": v for k, v in values.items()})
        history.append(row)
        shown = "  ".join(f"val {k} {v:.4f}" for k, v in values.items())
        _log.info(
            "epoch %d/%d  train loss %.4f  %s",
            engine.state.epoch,
            engine.state.max_epochs,
            row["train_loss"],
            shown,
        )

    parts.trainer.add_event_handler(Events.EPOCH_COMPLETED, validate)


def attach_scheduler(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """Scheduler, wired: once per epoch after validation (on the watched metric for plateaus), or
    with ``training.scheduler_every: update`` once per optimizer update (``UpdateEvents.UPDATE_COMPLETED``)."""
    scheduler, evaluator, watched = parts.scheduler, parts.evaluator, parts.watched
    every = plan.trainer.scheduler_every
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        parts.trainer.add_event_handler(
            Events.EPOCH_COMPLETED, lambda e: scheduler.step(evaluator.state.metrics[watched])
        )
    elif every == "update":
        parts.trainer.add_event_handler(UpdateEvents.UPDATE_COMPLETED, lambda e: scheduler.step())
    else:
        parts.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: scheduler.step())
