"""A rank's run, built from the plan: :func:`build_run` makes the parts, then attaches each concern.

The parts, in order (each builder reads the plan only, never the config it was made from):

1. data: :func:`~unison.recipe.build.data_steps.build_datasets`, then this rank's loaders
   (:mod:`unison.recipe.build.data_steps`);
2. the model, its optimizer and scheduler, the trainer (:mod:`unison.recipe.build.model_steps`),
   its LR warmup (:mod:`unison.recipe.planning.lr_plan`) and the average of its weights
   (:mod:`unison.recipe.build.ema_weights`);
3. the evaluator (:mod:`unison.recipe.build.validating`);
4. the user's own handlers (``handlers``), built in order, those with ``order: before`` attached
   now (:mod:`unison.recipe.build.user_handlers`).

Then :data:`ATTACHERS`, one function per concern, each ``attach(plan, parts, run_dir)``:
validation and the scheduler that follows it, early stopping, the guards, the checkpoint (which
holds every handler with a state, so it comes after them), and the trackers
(:data:`~unison.recipe.build.trackers.TRACKERS`); last the user's handlers with ``order: after``
(the default). Each attacher can be called on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from unison.engine import Events
from unison.recipe.build.checkpointing import attach_checkpoint
from unison.recipe.build.data_steps import build_datasets, build_loaders
from unison.recipe.build.ema_weights import attach_ema, evaluated_model
from unison.recipe.build.guards import attach_early_stopping, attach_guards
from unison.recipe.build.model_steps import build_model, build_optimizer, build_trainer
from unison.recipe.build.parts import RunParts
from unison.recipe.build.replica_steps import (
    build_group_trainer,
    group_sampler,
    start_group,
    stop_at_last_commit,
)
from unison.recipe.build.trackers import TRACKERS
from unison.recipe.build.user_handlers import build_user_handlers
from unison.recipe.build.validating import attach_scheduler, attach_validation, build_evaluator
from unison.recipe.planning.lr_plan import attach_lr_warmup
from unison.recipe.planning.run_plan import RunPlan
from unison.utils.startup import mark, tracing

Attacher = Callable[[RunPlan, RunParts, Path], object]
"""``attach(plan, parts, run_dir)``: attaches one concern's handlers to the parts (on every rank)."""

ATTACHERS: tuple[Attacher, ...] = (
    attach_validation,  # validation.every: a history row per evaluation
    attach_scheduler,  # after validation: a plateau scheduler reads the watched metric
    attach_early_stopping,  # early_stopping: its state joins the checkpoint's
    attach_guards,  # training.nonfinite_guard, time_limit, hang_timeout
    attach_checkpoint,  # checkpoint, preemption: holds every handler with a state, so after them
    *TRACKERS,  # TensorBoard, HParams, the profiler, MLflow, W&B, the progress bar
)
"""The concerns :func:`build_run` attaches, in order, after unison's parts and the user's
``order: before`` handlers."""


def build_run(plan: RunPlan, run_dir: Path, world_size: int) -> RunParts:
    """Collective: call on every rank. Builds the parts, then attaches every concern in order.

    Args:
        plan: the run's plan (:func:`~unison.recipe.plan`).
        run_dir: the run directory, the same on every rank.
        world_size: the number of ranks (it scales the learning rate).

    Returns:
        The parts, ready for :func:`~unison.recipe.phases.resume_run` and ``parts.trainer.run``.
    """
    parts = build_parts(plan, world_size)
    users = build_user_handlers(plan.handlers, parts)  # handlers: built in order, `order: before` attached
    parts.handlers, parts.attach_to_tester = users.to_save, users.attach_to_tester
    for attach in ATTACHERS:
        attach(plan, parts, run_dir)
    users.attach_after()  # handlers with `order: after` (the default), after unison's own
    if tracing():  # the first iteration's two phases; no handler at all otherwise
        parts.trainer.add_event_handler(Events.ITERATION_STARTED(once=1), mark, "first_batch")
        parts.trainer.add_event_handler(Events.ITERATION_COMPLETED(once=1), mark, "first_iteration")
    mark("build")
    return parts


def build_parts(plan: RunPlan, world_size: int) -> RunParts:
    """The run's objects before any handler: data, model, optimizer and scheduler, trainer (with
    its LR warmup and the average of the weights), evaluator."""
    group = start_group(plan)  # parallel.fault_tolerance: this rank's replica group, else None
    datasets = build_datasets(plan)
    sampler = group_sampler(plan, datasets.train, group) if group is not None else None
    train_loader, val_loader = build_loaders(plan, datasets, sampler)
    mark("data")  # UNISON_STARTUP_TRACE (unison.utils.startup): a line per phase, when set
    model = build_model(plan)
    mark("model")
    optimizer, scheduler = build_optimizer(plan, model, world_size)
    if group is None:
        trainer = build_trainer(plan, model, optimizer)
    else:  # each step one commit of the quorum; training ends at the quorum's last commit
        trainer = build_group_trainer(plan, group, model, optimizer)
        stop_at_last_commit(plan, trainer, train_loader)
    attach_lr_warmup(plan.lr, optimizer, trainer)  # training.lr_scaling.warmup_steps
    ema = attach_ema(plan, model, trainer)  # training.ema; validation runs on evaluated_model
    evaluator, _ = build_evaluator(plan, evaluated_model(plan, model, ema))
    return RunParts(
        datasets, train_loader, val_loader, model, optimizer, scheduler, trainer, evaluator,
        plan.watched.metric, ema=ema,
    )  # fmt: skip
