"""A run's test phase, after training: the test set, predictions, the recipe's hook, ``metrics.json``.

:func:`finish_run` runs on every rank once the trainer has returned
(:func:`~unison.recipe.phases.train_from_config`): the test set evaluated with the best
checkpoint's weights (:func:`evaluate_test_set`), the predictions (:func:`write_predictions`),
``hooks.after_training`` with a :class:`RunContext`, and ``<run>/metrics.json``, written
before the hook and again after it. A run that ends before its test phase (a trial its sweep
pruned) writes ``metrics.json`` alone (:func:`skip_test_phase`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unison.distributed import broadcast_object, get_rank
from unison.engine import create_evaluator
from unison.engine.predict import predict
from unison.recipe.build.ema_weights import evaluated_model, load_best_weights
from unison.recipe.build.eval_loaders import eval_loader
from unison.recipe.build.parts import RunParts, scalar_metrics
from unison.recipe.build.tracking import log_test_metrics
from unison.recipe.planning.batch import batch_options
from unison.recipe.planning.resolved import build_metrics
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import get_logger
from unison.utils.run_files import open_file, write_text
from unison.utils.secrets import redact_url

_log = get_logger("unison.recipe.run")  # the run's logger


@dataclass
class RunContext:
    """What a run built, handed to hooks (``hooks.after_training``) and returned by :func:`run`."""

    config: dict[str, Any]
    run_dir: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: Any
    evaluator: Any
    datasets: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)


def finish_run(plan: RunPlan, parts: RunParts, run_dir: Path, results: dict[str, Any]) -> None:
    """Test phase: the test set, predictions, the recipe's ``hooks.after_training``, metrics.json.

    Adds ``test`` and ``predictions`` to ``results`` when they are made; rank 0 writes
    ``run_dir/metrics.json`` before the hook (so a failing hook loses no results) and again
    after it (it may add results of its own).

    Distributed:
        Collective: call on every rank.
    """
    resolved, datasets = plan.resolved, parts.datasets
    if datasets.test is not None and plan.finish.test:
        results["test"] = evaluate_test_set(plan, parts)
        log_test_metrics(plan, run_dir, results["test"])  # logging.mlflow: into the training's run
    if plan.finish.predict:
        written = write_predictions(plan, parts, run_dir)
        if written is not None:
            results["predictions"] = str(written)
    context = RunContext(
        plan.record,  # the hook's own view of the run: the config as given, as plain data
        run_dir,
        parts.model,
        parts.optimizer,
        parts.trainer,
        parts.evaluator,
        {"train": datasets.train, "val": datasets.val, "test": datasets.test},
        results,
    )
    _write_metrics(run_dir, results)  # before the hook: a hook that fails loses nothing
    if resolved.after_training is not None:
        resolved.after_training(context)
        _write_metrics(run_dir, results)  # again, with what the hook added


def skip_test_phase(run_dir: Path, results: dict[str, Any], why: str) -> None:
    """No test phase: ``results`` records ``why`` (``no_test_phase``) and rank 0 writes ``metrics.json``
    with training's results only (no test metrics, no predictions, no ``hooks.after_training``).

    Distributed:
        Call it on every rank, as all ranks agree on skipping (nothing here is collective).
    """
    results["no_test_phase"] = why
    _log.info("no test phase: %s", why)
    _write_metrics(run_dir, results)


def _write_metrics(run_dir: Path, results: dict[str, Any]) -> None:
    """Rank 0 writes ``run_dir/metrics.json``."""
    if get_rank() == 0:
        write_text(run_dir / "metrics.json", redact_url(json.dumps(results, indent=2, default=str)) + "\n")


def evaluate_test_set(plan: RunPlan, parts: RunParts) -> dict[str, float]:
    """Test phase: evaluates the test set, with the best checkpoint's weights if ``testing.use_best``
    (with ``training.ema.evaluate``, the best checkpoint's average of them).

    Returns:
        The test metrics, by name.

    Distributed:
        Collective: call on every rank.
    """
    checkpoint, model = parts.checkpoint, parts.model
    if plan.finish.use_best and checkpoint is not None:
        best = checkpoint.best if get_rank() == 0 else None
        path = broadcast_object(None if best is None else str(checkpoint.folder / best.file))
        if path is not None:
            load_best_weights(plan, model, parts.ema, parts.trainer, path)
            _log.info("testing the best checkpoint %s", path)
    batches = plan.resolved.batches
    metrics = build_metrics(plan.metrics["testing"])  # testing.tester.criterion, when given
    test_loader = eval_loader(plan.loaders.testing, parts.datasets.test)
    tester = create_evaluator(
        evaluated_model(plan, model, parts.ema), metrics, amp=plan.amp, **batch_options(batches, "testing")
    )
    if parts.attach_to_tester is not None:
        parts.attach_to_tester(tester)  # handlers: items with `to: testing`
    values = scalar_metrics(tester.run(test_loader).metrics)
    _log.info("test: %s", "  ".join(f"{k} {v:.4f}" for k, v in values.items()))
    return values


def write_predictions(plan: RunPlan, parts: RunParts, run_dir: Path) -> Path | None:
    """Test phase: predicts the test set (else the validation set) into ``run_dir/predictions.pt``.

    Returns:
        The file, on rank 0; None on the other ranks.

    Distributed:
        Collective: call on every rank; rank 0 gathers and writes.
    """
    datasets, batch = parts.datasets, plan.finish.predict_batch_size
    target = datasets.test if datasets.test is not None else datasets.val
    out = predict(evaluated_model(plan, parts.model, parts.ema), target, batch_size=batch)
    if get_rank() != 0 or out is None:
        return None
    path = run_dir / "predictions.pt"
    with open_file(path, "w", binary=True) as fh:  # never through a link (unison.utils.run_files)
        torch.save(out, fh)
    return path
