"""The build steps of a run: each rank builds the same objects and attaches the same handlers.

:func:`build_run` takes the steps in order, into a :class:`RunParts`:

1. data: :func:`build_datasets`, :func:`build_loaders`;
2. model: :func:`build_model`;
3. optimizer and scheduler: :func:`build_optimizer`;
4. trainer: :func:`build_trainer`, its LR warmup and EMA (:mod:`unison.recipe.planning.lr_plan`, :mod:`unison.recipe.build.ema_weights`);
5. evaluator: :func:`build_evaluator`, :func:`attach_validation`, :func:`attach_scheduler`;
6. handlers: :func:`attach_handlers` (:func:`checkpoint_objects`, then early stopping and
   guards in :func:`attach_control`, checkpoint and preemption in
   :func:`attach_checkpoint`, TensorBoard and progress in :func:`attach_logging`); the config's
   own ``handlers`` are built before step 5's wiring, those with ``order: before`` attached
   then and the others after step 6 (:mod:`unison.recipe.build.user_handlers`).

Each step takes what it needs of the run's plan (:func:`unison.recipe.plan`), and can be
called on its own. Every step and attacher reads the plan only (what it resolved, and the
values it planned once: :mod:`unison.recipe.planning.loader_plan`, :mod:`unison.recipe.planning.step_plans`),
never the config the plan was made from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader

from unison.config import ConfigError
from unison.config.batch_sizes import asks_world_size
from unison.distributed import get_world_size, prepare_loaders, prepare_model
from unison.engine import Engine, Events, TrainStep, UpdateEvents, create_evaluator, create_trainer
from unison.handlers import (
    Checkpoint,
    NonFiniteGuard,
    Preemption,
    ProgressBar,
    TimeLimit,
    Watchdog,
)
from unison.recipe.build.ema_weights import attach_ema, evaluated_model
from unison.recipe.build.eval_loaders import eval_loader
from unison.recipe.build.history import RunHistory
from unison.recipe.build.parts import Datasets, RunParts, scalar_metrics
from unison.recipe.build.stream_data import check_mid_epoch_saves, check_stream_sharding, train_shuffle
from unison.recipe.build.stream_workers import check_stream_workers
from unison.recipe.build.tracking import attach_tracking
from unison.recipe.build.tracking_tb import attach_hparams, attach_profiler
from unison.recipe.build.tracking_wandb import attach_wandb
from unison.recipe.build.user_handlers import build_user_handlers
from unison.recipe.planning.batch import batch_options
from unison.recipe.planning.early_stop import make_early_stopping
from unison.recipe.planning.lr_plan import attach_lr_warmup, scaled_optimizer_kwargs, scaled_scheduler_kwargs
from unison.recipe.planning.resolved import build_metrics
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import get_logger, manual_seed
from unison.utils.run_files import real_folder
from unison.utils.startup import mark, tracing

_log = get_logger("unison.recipe.run")  # the run's logger: its lines keep the name they had before the split


def build_run(plan: RunPlan, run_dir: Path, world_size: int) -> RunParts:
    """Collective: call on every rank. Takes the build steps in order and attaches every handler.

    Args:
        plan: the run's plan (:func:`~unison.recipe.plan`).
        run_dir: the run directory, the same on every rank.
        world_size: the number of ranks (it scales the learning rate).

    Returns:
        The parts, ready for :func:`~unison.recipe.phases.resume_run` and ``parts.trainer.run``.
    """
    datasets = build_datasets(plan)
    train_loader, val_loader = build_loaders(plan, datasets)
    mark("data")  # UNISON_STARTUP_TRACE (unison.utils.startup): a line per phase, when set
    model = build_model(plan)
    mark("model")
    optimizer, scheduler = build_optimizer(plan, model, world_size)
    trainer = build_trainer(plan, model, optimizer)
    attach_lr_warmup(plan.lr, optimizer, trainer)  # training.lr_scaling.warmup_steps
    ema = attach_ema(plan, model, trainer)  # training.ema; validation runs on evaluated_model
    evaluator, _ = build_evaluator(plan, evaluated_model(plan, model, ema))
    parts = RunParts(
        datasets,
        train_loader,
        val_loader,
        model,
        optimizer,
        scheduler,
        trainer,
        evaluator,
        plan.watched.metric,
        ema=ema,
    )
    users = build_user_handlers(plan.handlers, parts)  # handlers: built in order, `order: before` attached
    parts.handlers = users.to_save
    attach_validation(plan, parts, run_dir)
    attach_scheduler(parts, plan.trainer.scheduler_every)
    attach_handlers(plan, parts, run_dir)
    users.attach_after()  # handlers with `order: after` (the default), after unison's own
    if tracing():  # the first iteration's two phases; no handler at all otherwise
        trainer.add_event_handler(Events.ITERATION_STARTED(once=1), mark, "first_batch")
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=1), mark, "first_iteration")
    mark("build")
    return parts


def build_datasets(plan: RunPlan) -> Datasets:
    """Data, first half: seeds every generator with ``training.seed`` and calls ``data.build``
    (with ``world_size=`` the run's, when it has a parameter of that name).

    Raises:
        TypeError: ``data.build`` returned something other than 2 or 3 datasets.
    """
    seed, resolved = plan.seed, plan.resolved
    manual_seed(seed)
    told = {"world_size": plan.world_size} if asks_world_size(resolved.data_build) else {}
    built = resolved.data_build(seed=seed, **told, **resolved.data_kwargs)
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise TypeError(
            f"data.build must return (train, val) or (train, val, test) datasets, got {type(built).__name__}"
        )
    return Datasets(*built)


def build_loaders(plan: RunPlan, datasets: Datasets) -> tuple[DataLoader | None, DataLoader | None]:
    """Data, second half: this rank's training and validation loaders, as ``plan.loaders`` says.

    The training loader takes the ``training`` section's loader keys (``batch_size``,
    ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``drop_last``, ``shuffle``,
    ``collate``); the validation loader takes the ``validation`` section's, each defaulting to
    the training one (:mod:`unison.recipe.planning.loader_plan`), sharded without padding
    (:func:`unison.recipe.build.eval_loaders.eval_loader`).

    Returns:
        ``(train_loader, val_loader)``, each None when its dataset is None.

    Distributed:
        Call it on every rank with the same plan: the samplers shard by rank.
    """
    t = plan.loaders.training
    check_stream_sharding(plan, datasets.train, get_world_size())  # a stream: data.build's, named
    check_stream_workers(plan, datasets.train)  # training.num_workers, named
    train_loader, _ = prepare_loaders(
        datasets.train,
        None,
        batch_size=t.batch_size,
        seed=t.seed,
        shuffle=train_shuffle(plan, datasets.train),  # a stream's source decides its order
        drop_last=t.drop_last,
        collate_fn=t.collate_fn,
        **t.worker_kwargs(),
    )
    val_loader = eval_loader(plan.loaders.validation, datasets.val)
    return train_loader, val_loader  # each with its own section's loader keys


def build_model(plan: RunPlan) -> nn.Module:
    """Model: builds ``model.type(*model.args, **model.kwargs)``, moves it to this rank's device and
    wraps it as ``plan.model`` says.

    Distributed:
        Call it on every rank: wrapping in DDP or sharding broadcasts rank 0's parameters.
    """
    resolved, m = plan.resolved, plan.model
    return prepare_model(
        resolved.model_type(*resolved.model_args, **resolved.model_kwargs),
        strategy=m.strategy,
        fsdp=m.fsdp,
        compile=m.compile,
        activation_checkpointing=m.activation_checkpointing,
        sync_batchnorm=m.sync_batchnorm,
        find_unused_parameters=m.find_unused_parameters,
        **m.ddp_options(),  # parallel.output_device, on GPUs
    )


def build_optimizer(plan: RunPlan, model: nn.Module, world_size: int) -> tuple[torch.optim.Optimizer, Any]:
    """Optimizer and scheduler: ``training.lr`` overrides the optimizer's ``lr`` (in the plan), then scaled.

    The learning rate is scaled by ``training.lr_scaling`` in the global batch of
    ``world_size`` ranks (see :mod:`unison.recipe.planning.lr_plan`).

    Returns:
        ``(optimizer, scheduler)``; the scheduler is None without ``training.scheduler_type``.
    """
    resolved, lr = plan.resolved, plan.lr.at(world_size)
    opt_kwargs = scaled_optimizer_kwargs(
        lr, resolved.optimizer_type, plan.optimizer_kwargs, resolved.optimizer_args
    )
    optimizer = resolved.optimizer_type(model.parameters(), *resolved.optimizer_args, **opt_kwargs)
    scheduler_kwargs = scaled_scheduler_kwargs(lr, resolved.scheduler_type, resolved.scheduler_kwargs)
    scheduler = resolved.scheduler_type(optimizer, **scheduler_kwargs) if resolved.scheduler_type else None
    return optimizer, scheduler


def build_trainer(plan: RunPlan, model: nn.Module, optimizer: torch.optim.Optimizer) -> Engine:
    """Trainer: the training engine, with the ``training`` section's amp, accumulation and clipping."""
    t, resolved = plan.trainer, plan.resolved
    return create_trainer(
        model,
        optimizer,
        resolved.loss,
        amp=plan.amp,
        accumulation_steps=t.accumulation_steps,
        clip_grad_norm=t.clip_grad_norm,
        sync_every=t.sync_every,
        **batch_options(resolved.batches, "training"),  # training.batch, model.call
    )


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


def attach_scheduler(parts: RunParts, every: str = "epoch") -> None:
    """Scheduler, wired: once per epoch after validation (on the watched metric for plateaus), or
    with ``every="update"`` once per optimizer update (``UpdateEvents.UPDATE_COMPLETED``)."""
    scheduler, evaluator, watched = parts.scheduler, parts.evaluator, parts.watched
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


def attach_handlers(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """Handlers: early stopping and guards, the checkpoint (and preemption), logging, progress.

    Sets ``parts.checkpoint``.

    Distributed:
        Every rank attaches every handler; each filters by rank inside its side effects.
    """
    to_save = checkpoint_objects(parts)
    attach_control(plan, parts, run_dir, to_save)
    parts.checkpoint = attach_checkpoint(plan, parts, run_dir, to_save)
    attach_logging(plan, parts, run_dir)


def checkpoint_objects(parts: RunParts) -> dict[str, Any]:
    """What a checkpoint holds: model, optimizer, and the scheduler and grad scaler when there are."""
    to_save: dict[str, Any] = {"model": parts.model, "optimizer": parts.optimizer}
    if parts.scheduler is not None:
        to_save["scheduler"] = parts.scheduler
    step = cast(TrainStep, parts.trainer.process_function)
    if step.scaler is not None:
        to_save["scaler"] = step.scaler
    return {**to_save, **parts.handlers}  # the user's handlers with a state (handlers:<ClassName>)


def attach_control(plan: RunPlan, parts: RunParts, run_dir: Path, to_save: dict[str, Any]) -> None:
    """Handlers that stop or watch the run: early stopping, non-finite guard, time limit, watchdog.

    Early stopping, when ``early_stopping.patience`` is set, joins ``to_save``.
    """
    t = plan.control
    trainer, evaluator = parts.trainer, parts.evaluator
    stopper = make_early_stopping(plan.early_stopping, trainer)  # early_stopping.type, default EarlyStopping
    if stopper is not None:
        stopper.attach(evaluator)
        to_save["early_stopping"] = stopper
    if t.nonfinite_guard:
        NonFiniteGuard().attach(trainer)
    if t.time_limit is not None:
        TimeLimit(t.time_limit).attach(trainer)
    if t.hang_timeout is not None:
        watchdog = Watchdog(t.hang_timeout, run_dir=run_dir / "logs")
        watchdog.attach(trainer)
        watchdog.watch(evaluator)


def attach_checkpoint(
    plan: RunPlan, parts: RunParts, run_dir: Path, to_save: dict[str, Any]
) -> Checkpoint | None:
    """The checkpoint handler, writing ``to_save`` to ``run_dir/checkpoints``, and preemption.

    Returns:
        The checkpoint handler, or None when ``checkpoint.enabled`` is false.
    """
    ck = plan.checkpoint
    if ck is None:
        return None
    check_mid_epoch_saves(plan, parts.train_loader)  # refused by config key, before the trainer starts
    checkpoint = Checkpoint(
        real_folder(run_dir / "checkpoints"),  # a real folder, never a link (unison.utils.run_files)
        to_save,
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
    return checkpoint


def attach_logging(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """TensorBoard event files in ``run_dir/tb`` (with the HParams session and profiler traces of
    :mod:`unison.recipe.build.tracking_tb`) and the progress bar, as ``logging`` asks."""
    lg = plan.logging
    if lg.tb_every is not None:
        try:
            from unison.handlers.tensorboard import TensorBoardLogger
        except ImportError as err:  # pragma: no cover - tensorboardX is a dependency
            _log.warning("TensorBoard logging is off: %s", err)
        else:
            TensorBoardLogger(
                real_folder(run_dir / "tb"),
                trainer=parts.trainer,
                evaluators={"val": parts.evaluator},
                log_every=lg.tb_every,
            ).attach(parts.trainer)
    attach_hparams(plan, parts, run_dir)  # logging.tensorboard: the settings for the HParams view
    attach_profiler(plan, parts, run_dir)  # training.profile: a trace of a few iterations per rank
    attach_tracking(plan, parts, run_dir)  # logging.mlflow (unison.recipe.build.tracking)
    attach_wandb(plan, parts, run_dir)  # logging.wandb (unison.recipe.build.tracking_wandb)
    if lg.progress:
        ProgressBar().attach(parts.trainer)
