"""The checkpoint of a run, on each rank: what it holds (the model, the optimizer, the scheduler,
the grad scaler and every handler with a state), the handler that saves it, and preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from unison.engine import TrainStep
from unison.handlers import Checkpoint, Preemption
from unison.recipe.build.parts import RunParts
from unison.recipe.build.stream_data import check_mid_epoch_saves
from unison.recipe.planning.run_plan import RunPlan
from unison.utils.run_files import real_folder


def checkpoint_objects(parts: RunParts) -> dict[str, Any]:
    """What a checkpoint holds besides early stopping: model, optimizer, the scheduler and grad
    scaler when there are, and the user's handlers with a state (``handlers:<ClassName>``)."""
    return {**_run_objects(parts), **parts.handlers}


def _run_objects(parts: RunParts) -> dict[str, Any]:
    to_save: dict[str, Any] = {"model": parts.model, "optimizer": parts.optimizer}
    if parts.scheduler is not None:
        to_save["scheduler"] = parts.scheduler
    step = cast(TrainStep, parts.trainer.process_function)
    if step.scaler is not None:
        to_save["scaler"] = step.scaler
    return to_save


def attach_checkpoint(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """The checkpoint handler, writing the run's objects, early stopping and the user's handlers
    with a state to ``run_dir/checkpoints``, and preemption; sets ``parts.checkpoint`` (None when
    ``checkpoint.enabled`` is false)."""
    ck = plan.checkpoint
    if ck is None:
        return
    stopper = {} if parts.early_stopping is None else {"early_stopping": parts.early_stopping}
    check_mid_epoch_saves(plan, parts.train_loader)  # refused by config key, before the trainer starts
    checkpoint = Checkpoint(
        real_folder(run_dir / "checkpoints"),  # a real folder, never a link (unison.utils.run_files)
        {**_run_objects(parts), **stopper, **parts.handlers},
        parts.trainer,
        every_epochs=ck.every_epochs,
        every_iters=ck.every_iters,
        every_seconds=ck.every_seconds,
        keep_last=ck.keep_last,
        keep_best=ck.keep_best,
        metric=plan.watched.metric,
        mode=plan.watched.mode,
        metric_engine=parts.evaluator,
        async_save=ck.async_save,
        config=ck.record,  # a copy for reference: URL credentials masked
    )
    checkpoint.attach()
    if ck.preemption:
        Preemption(checkpoint, requeue=ck.requeue).attach(parts.trainer)
    parts.checkpoint = checkpoint
